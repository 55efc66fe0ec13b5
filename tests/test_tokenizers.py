"""Tokenizers: ids equal to the reference implementations (the `tokenizers` library for
byte-level BPE trained here, transformers' sentencepiece-based tokenizer for Llama-2's
tokenizer.model), bos/eos from the checkpoint's files, zoo's byte-level tokenizer, bad files."""

import json
import shutil

import pytest
from helpers import LLAMA2_TOKENIZER, SHAKESPEARE, needs, needs_shared

from zoo.core.errors import CheckpointError
from zoo.text.tokenizers import Tokenizer

# Several scripts, whitespace runs (spaces, tabs, newlines, trailing), digits, emoji, contractions.
SAMPLE = ("Hello   world!! It's 12345 or 3.14159, isn't it?\n\n\tTabs\t\there  \n"
          "Grüße aus Köln — Ünïcödé; 日本語のテキスト; русский текст; العربية; हिन्दी; 한국어\n"
          "emoji 🙂🚀👍🏽 and 🇫🇷 flags   trailing   ")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _corpus() -> list[str]:
    text = SHAKESPEARE.read_text()[:100_000] if SHAKESPEARE.is_file() else "To be, or not to be.\n" * 2000
    return [text] + [SAMPLE.replace("  ", " ")] * 30


@pytest.fixture(scope="module")
def gpt2_style(tmp_path_factory):
    """A byte-level BPE trained here, saved both as tokenizer.json and as vocab.json + merges.txt."""
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(_corpus(), vocab_size=800, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    both = tmp_path_factory.mktemp("gpt2_json")
    bpe.save(str(both / "tokenizer.json"))
    bpe.save_model(str(both))
    merges_only = tmp_path_factory.mktemp("gpt2_merges")
    bpe.save_model(str(merges_only))
    return tokenizers.Tokenizer.from_file(str(both / "tokenizer.json")), both, merges_only


@pytest.fixture(scope="module")
def llama3_style(tmp_path_factory):
    """A Llama-3 style tokenizer.json: Split(regex) then ByteLevel, BOS added by a template."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=900, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    folder = tmp_path_factory.mktemp("llama3")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]}))
    return tok, folder


def test_gpt2_bpe_matches_tokenizers_library(gpt2_style):
    ref, both, merges_only = gpt2_style
    text = SAMPLE + "<|endoftext|>second document<|endoftext|>"
    expected = ref.encode(text).ids
    assert expected.count(0) == 2  # the special token was matched, not spelled out
    for folder in (both, merges_only):
        tok = Tokenizer.from_pretrained(folder)
        assert tok.encode(text) == expected, folder
        assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert Tokenizer.from_pretrained(both).kind == Tokenizer.from_pretrained(merges_only).kind == "byte-level-bpe"


def test_gpt2_defaults_and_special_as_text(gpt2_style):
    ref, _, merges_only = gpt2_style
    tok = Tokenizer.from_pretrained(merges_only)
    # GPT2Tokenizer's defaults when nothing names them: <|endoftext|> is bos and eos.
    assert tok.bos_id == tok.eos_id == ref.token_to_id("<|endoftext|>")
    spelled = tok.encode("<|endoftext|>", special=False)
    assert len(spelled) > 1 and tok.decode(spelled) == "<|endoftext|>"
    assert tok.decode(tok.encode("a<|endoftext|>b"), skip_special=True) == "ab"


def test_digits_then_byte_level_matches_tokenizers_library(tmp_path):
    """SmolLM's pre-tokenizer: every digit alone, then GPT-2's regex."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    text = SAMPLE + " x 42 y  \t\n 7.5% $ 100\n\n2024-01-01 '9 a1b2  3<|endoftext|>٣ ½"
    assert Tokenizer.from_pretrained(tmp_path).encode(text) == tok.encode(text).ids


def test_llama3_style_matches_tokenizers_library(llama3_style):
    ref, folder = llama3_style
    text = SAMPLE + "<|eot_id|>next<|end_of_text|>"
    tok = Tokenizer.from_pretrained(folder)
    assert tok.encode(text, add_bos=True) == ref.encode(text).ids  # the template adds BOS
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
    assert tok.bos_id == ref.token_to_id("<|begin_of_text|>")
    assert tok.eos_id == ref.token_to_id("<|eot_id|>")  # tokenizer_config.json wins
    assert set(tok.eos_ids) == {ref.token_to_id("<|eot_id|>"), ref.token_to_id("<|end_of_text|>")}
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE


def test_llama3_bos_from_template_alone(llama3_style, tmp_path):
    ref, folder = llama3_style
    shutil.copy(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_pretrained(tmp_path / "tokenizer.json")
    assert tok.bos_id == ref.token_to_id("<|begin_of_text|>")


@needs_shared(LLAMA2_TOKENIZER)
@needs("sentencepiece", "transformers")
def test_llama2_sentencepiece_matches_transformers():
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    # transformers' sentencepiece-based tokenizer with Llama-2's special tokens (legacy behaviour,
    # as Llama-2's own tokenizer.json: each stretch between special tokens gets the "▁" prefix).
    ref = SentencePieceBackend(vocab_file=str(LLAMA2_TOKENIZER), bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                               legacy=True)
    tok = Tokenizer.from_pretrained(LLAMA2_TOKENIZER)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 32000)
    for text in (SAMPLE, SAMPLE + "</s> next<s>doc<unk>x", "<s>", "  two leading", ""):
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
    assert tok.encode("Hi", add_bos=True, add_eos=True)[::2] == [1, 2]
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert tok.decode([1] + tok.encode("Hi") + [2], skip_special=True) == "Hi"


@needs_shared(LLAMA2_TOKENIZER)
def test_llama2_folder_with_config_files(tmp_path):
    shutil.copy(LLAMA2_TOKENIZER, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "add_bos_token": True,
         "added_tokens_decoder": {"32000": {"content": "<pad>", "special": True}}}))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32064, "bos_token_id": 1, "eos_token_id": 2}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.vocab_size == 32064  # the model's embedding rows, from config.json
    assert tok.encode("a<pad>b")[1] == 32000 and tok.decode([32000]) == "<pad>"
    saved = tmp_path / "saved"
    tok.save(saved)
    # Its own files back unchanged, plus what hands it over to transformers.
    assert sorted(p.name for p in saved.iterdir()) == ["special_tokens_map.json", "tokenizer.json", "tokenizer.model",
                                                       "tokenizer_config.json"]
    assert (saved / "tokenizer_config.json").read_bytes() == (tmp_path / "tokenizer_config.json").read_bytes()
    assert Tokenizer.from_pretrained(saved).encode(SAMPLE) == tok.encode(SAMPLE)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32000}))
    with pytest.raises(CheckpointError, match=r"config\.json.*vocab_size"):
        Tokenizer.from_pretrained(tmp_path)


def test_byte_level_tokenizer(tmp_path):
    tok = Tokenizer.byte_level()
    assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (258, 256, 257)
    ids = tok.encode(SAMPLE + "<|eos|>")
    assert ids[-1] == 256 and all(i < 256 for i in ids[:-1])
    assert tok.decode(ids) == SAMPLE + "<|eos|>"
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"  # half a character decodes to the replacement mark
    tok.save(tmp_path)
    again = Tokenizer.from_pretrained(tmp_path)
    assert again.encode(SAMPLE, add_bos=True) == [257] + tok.encode(SAMPLE)
    assert again.fingerprint() == tok.fingerprint()


def test_bad_tokenizer_files(tmp_path, gpt2_style):
    _, both, merges_only = gpt2_style
    bad = tmp_path / "notjson"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json.*JSON"):
        Tokenizer.from_pretrained(bad)

    wordpiece = tmp_path / "wordpiece"
    wordpiece.mkdir()
    data = json.loads((both / "tokenizer.json").read_text())
    data["model"]["type"] = "WordPiece"
    (wordpiece / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: 'model\.type'"):
        Tokenizer.from_pretrained(wordpiece)

    bad_regex = tmp_path / "bad_regex"
    bad_regex.mkdir()
    data = json.loads((both / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "[a-"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (bad_regex / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: 'pre_tokenizer'"):
        Tokenizer.from_pretrained(bad_regex)

    broken = tmp_path / "broken_merges"
    shutil.copytree(merges_only, broken)
    with open(broken / "merges.txt", "a") as f:
        f.write("one two three\n")
    with pytest.raises(CheckpointError, match=r"merges\.txt.*line"):
        Tokenizer.from_pretrained(broken)

    unknown_merge = tmp_path / "unknown_merge"
    shutil.copytree(merges_only, unknown_merge)
    with open(unknown_merge / "merges.txt", "a") as f:
        f.write("Ġzq xv\n")
    with pytest.raises(CheckpointError, match=r"merges\.txt: 'merges'.*not in the vocabulary"):
        Tokenizer.from_pretrained(unknown_merge)

    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00\x01 not a sentencepiece model")
    with pytest.raises(CheckpointError, match="garbage.model"):
        Tokenizer.from_pretrained(garbage)

    with pytest.raises(CheckpointError, match="no tokenizer"):
        Tokenizer.from_pretrained(tmp_path)  # holds only folders and garbage.model
