"""Tokenizer hand-over: folders zoo saves load in transformers' AutoTokenizer and encode as zoo
does, BOS included (AutoTokenizer's encode() adds it exactly where zoo starts documents with
it: Tokenizer.adds_bos); the tokenizer.json zoo writes is read the same by the tokenizers
library and by zoo itself; generation_config.json goes along; zoo reads its folders as before."""

import json
import shutil

import pytest
from helpers import LLAMA2_TOKENIZER, SHAKESPEARE, needs, needs_shared

import zoo
from zoo.cli import main
from zoo.io.checkpoints import save_pretrained
from zoo.text.tokenizers import Tokenizer
from zoo.train.config import DEMO_DATA

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# Latin with accents, Cyrillic, CJK, Arabic, Devanagari, emoji (with modifiers and a flag), code,
# runs of spaces, tabs and newlines, leading and trailing whitespace, digits.
SAMPLES = [
    "Crème brûlée, naïve façade — Ünïcödé: ÀÉÎÕÜ ß œ ø å",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "日本語のテキストと中文文本，한국어 텍스트도。",
    "العربية: مرحبا بالعالم! ١٢٣ हिन्दी पाठ",
    "emoji 🙂🚀👍🏽 and a flag 🇫🇷 👨‍👩‍👧",
    "def f(x):\n\treturn {'a': [1, 2, 3]}  # comment\n\n\n    if x >= 10_000: pass\r\n",
    "   leading, then   runs   of   spaces\t\t\tand tabs   ",
    " 12345 or 3.14159, isn't it? It's 2024-01-01.",
    "",
]


def with_specials(tok):
    """The samples, and the samples joined by the tokenizer's special tokens written in the text."""
    specials = sorted(tok.special_tokens)
    joined = "".join(sample + specials[i % len(specials)] for i, sample in enumerate(SAMPLES)) if specials else ""
    return SAMPLES + [joined, specials[0] + "x" if specials else "x"]


def assert_hands_over(folder, tok):
    """AutoTokenizer on `folder` gives zoo's ids on every sample, with and without its special
    tokens added, and names the same bos/eos; zoo reads the folder back to the same tokenizer."""
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.special_tokens, "samples need special tokens in the text"
    for text in with_specials(tok):
        ids = tok.encode(text)
        assert ref.encode(text, add_special_tokens=False) == ids, text
        assert ref.encode(text) == tok.encode(text, add_bos=tok.adds_bos), text
    assert (ref.bos_token, ref.eos_token) == (tok.bos_token, tok.eos_token)
    again = Tokenizer.from_pretrained(folder)
    assert again.fingerprint() == tok.fingerprint()
    assert all(again.encode(text) == tok.encode(text) for text in with_specials(tok))
    return ref


def test_top_level_import():
    assert zoo.Tokenizer is Tokenizer and "Tokenizer" in zoo.__all__


def test_byte_level_tokenizer_json(tmp_path):
    tok = Tokenizer.byte_level()
    tok.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["special_tokens_map.json", "tokenizer.json",
                                                          "tokenizer_config.json", "zoo_tokenizer.json"]
    ref = assert_hands_over(tmp_path, tok)
    assert ref.decode(tok.encode(SAMPLES[5])) == SAMPLES[5]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["add_eos_token"] is False
    assert ref.encode("hi")[0] == tok.bos_id == 257

    # The tokenizers library reads the file as it is; so does zoo, from tokenizer.json alone.
    lib = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tmp_path / "tokenizer.json", bare / "tokenizer.json")
    alone = Tokenizer.from_pretrained(bare)
    assert alone.kind == "byte-level-bpe" and alone.bos_id == 257
    for text in with_specials(tok):
        assert lib.encode(text).ids == tok.encode(text, add_bos=True)
        assert lib.encode(text, add_special_tokens=False).ids == alone.encode(text) == tok.encode(text)


def test_byte_level_from_a_training_run(tmp_path, capsys):
    """What `zoo train` writes (a checkpoint and the final model) hands over, and a finetune
    from it carries its generation_config.json unchanged."""
    out = tmp_path / "run"
    fast = ["--threads", 1, "--no-progress", "--sample-tokens", 0, "--batch-size", 2, "--seq-len", 16]
    data = ["--data", DEMO_DATA, "--cache-dir", tmp_path / "cache"]
    args = ["train", "--preset", "tiny-llama", "--steps", 2, "--out", out, *data, *fast]
    assert main([str(a) for a in args]) == 0, capsys.readouterr().err
    tok = Tokenizer.byte_level()
    for folder in (out, out / "checkpoints" / "step-00000002"):
        for name in ("zoo_tokenizer.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            assert (folder / name).is_file(), folder / name
        assert json.loads((folder / "generation_config.json").read_text()) == {"bos_token_id": 257, "eos_token_id": 256}
        assert_hands_over(folder, tok)
        generation = transformers.GenerationConfig.from_pretrained(str(folder))
        assert (generation.bos_token_id, generation.eos_token_id) == (257, 256)

    custom = {"bos_token_id": 257, "eos_token_id": 256, "temperature": 0.7, "do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(custom, indent=3))
    tuned = tmp_path / "tuned"
    args = ["finetune", "--from", out, "--steps", 1, "--out", tuned, *data, *fast]
    assert main([str(a) for a in args]) == 0, capsys.readouterr().err
    for folder in (tuned, tuned / "checkpoints" / "step-00000001"):
        assert (folder / "generation_config.json").read_text() == json.dumps(custom, indent=3)
        assert_hands_over(folder, tok)


@needs_shared(LLAMA2_TOKENIZER)
def test_sentencepiece_hands_over_with_bos(tmp_path):
    tok = Tokenizer.from_pretrained(LLAMA2_TOKENIZER)
    folder = tmp_path / "saved"
    tok.save(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["unk_token"], config["add_bos_token"]) == \
           ("<s>", "</s>", "<unk>", True)
    ref = assert_hands_over(folder, tok)
    assert ref.encode("Hello")[0] == 1  # the BOS transformers used to lose
    lib = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    long_text = SHAKESPEARE
    long_text = long_text.read_text()[:200_000] if long_text.is_file() else " ".join(SAMPLES) * 500
    assert lib.encode(long_text, add_special_tokens=False).ids == tok.encode(long_text)


@needs_shared(LLAMA2_TOKENIZER)
@needs("torch")
def test_convert_of_a_llama_checkpoint(tmp_path, capsys):
    """`zoo convert` of a folder transformers wrote (tokenizer.model only): the copy has its
    generation_config.json unchanged, and the tokenizer files hand over with config.json beside
    them (model_type llama must not make transformers pick its own Llama class)."""
    from hf_helpers import llama_checkpoint

    src = llama_checkpoint(tmp_path / "src")
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst)]) == 0, capsys.readouterr().err
    assert (dst / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    assert (dst / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()
    assert_hands_over(dst, Tokenizer.from_pretrained(src))

    # A folder that has tokenizer files of its own keeps them as they are.
    (src / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "legacy": True,
                                                           "add_bos_token": True, "chat_template": "{{ 'x' }}"}))
    again = tmp_path / "again"
    assert main(["convert", str(src), str(again)]) == 0, capsys.readouterr().err
    assert (again / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    assert (again / "tokenizer.json").is_file() and (again / "special_tokens_map.json").is_file()


def _trained_sentencepiece(folder, model_type):
    spm = pytest.importorskip("sentencepiece")
    text = "\n".join(SAMPLES * 3 + ["the quick brown fox jumps over the lazy dog " * 3] * 20)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_prefix=str(folder / "sp"),
                                   vocab_size=600, hard_vocab_limit=False, model_type=model_type, byte_fallback=True,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   character_coverage=0.98, minloglevel=2)
    return Tokenizer.from_pretrained(folder / "sp.model")


def test_trained_sentencepiece_models(tmp_path):
    """A second SentencePiece BPE (trained here) hands over too; a unigram model gets the
    config files but no tokenizer.json (zoo writes one only where it is exact)."""
    bpe = _trained_sentencepiece(tmp_path, "bpe")
    assert bpe.adds_bos
    bpe.save(tmp_path / "bpe")
    assert (tmp_path / "bpe" / "tokenizer.json").is_file()
    assert_hands_over(tmp_path / "bpe", bpe)

    unigram = _trained_sentencepiece(tmp_path, "unigram")
    unigram.save(tmp_path / "unigram")
    assert not (tmp_path / "unigram" / "tokenizer.json").exists()
    config = json.loads((tmp_path / "unigram" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>"


def test_byte_level_bpe_tokenizer_json(tmp_path):
    """A Llama-3 style tokenizer.json built here (regex split, BOS by a template), given without
    tokenizer_config.json: zoo's save adds the config files that make transformers encode alike."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

    lib = tokenizers.Tokenizer(models.BPE())
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    lib.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    lib.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    lib.train_from_iterator(SAMPLES * 20, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                              show_progress=False))
    lib.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    src = tmp_path / "src"
    src.mkdir()
    lib.save(str(src / "tokenizer.json"))
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    tok = Tokenizer.from_pretrained(src)
    assert (tok.bos_id, tok.eos_id, tok.adds_bos) == (0, 1, True)
    tok.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert_hands_over(tmp_path / "saved", tok)


def test_gpt2_vocab_and_merges(tmp_path):
    """GPT-2's own files (vocab.json + merges.txt): <|endoftext|> is BOS and EOS, so no BOS is
    added, by zoo or by transformers' GPT2Tokenizer that the written config names."""
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(SAMPLES * 20, vocab_size=500, special_tokens=["<|endoftext|>"], show_progress=False)
    src = tmp_path / "src"
    src.mkdir()
    bpe.save_model(str(src))
    tok = Tokenizer.from_pretrained(src)
    assert not tok.adds_bos and tok.bos_id == tok.eos_id
    tok.save(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "GPT2Tokenizer" and config["add_bos_token"] is False
    assert not (tmp_path / "saved" / "tokenizer.json").exists()
    assert_hands_over(tmp_path / "saved", tok)


def test_save_pretrained_writes_generation_config_from_ids(tmp_path):
    model = zoo.Model(zoo.preset("tiny-gpt2"), seed=0)
    folder = save_pretrained(model, tmp_path / "m", tokenizer=Tokenizer.byte_level())
    assert json.loads((folder / "generation_config.json").read_text()) == {"bos_token_id": 257, "eos_token_id": 256}
    bare = save_pretrained(model, tmp_path / "bare")  # no tokenizer, no ids: nothing to say
    assert not (bare / "generation_config.json").exists() and not (bare / "tokenizer_config.json").exists()
