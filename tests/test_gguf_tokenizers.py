"""The tokenizers of the new families in GGUF files, checked in llama.cpp itself.

Each family's tokenizer is built with the `tokenizers` library as the published tokenizer.json
is (test_family_tokenizers' builders), a tiny random model of the family (transformers') is
saved with it to GGUF, and then (a) llama.cpp (llama-cpp-python, vocab only) encodes a
multi-script sample to the ids the library gives, (b) zoo's GGUF reader gives the same ids.

The SentencePiece-style tokenizers (Mistral, Gemma, Phi-3) are put in the form their published
tokenizer.json files have, being converted from SentencePiece models: every split of a token
into two tokens is a merge, ranked by the token's score (here its id, the order BPE training
made it), then by the ids of the two parts. The builders' own files, with only the merges that
training made, are refused (llama.cpp's merging by score would encode them differently).
"""

import json
import unicodedata
import warnings
from pathlib import Path

import pytest
from helpers import needs

import zoo
from zoo.core.errors import CheckpointError
from zoo.text.tokenizers import Tokenizer

pytestmark = needs("tokenizers", "torch", "transformers")

import test_family_tokenizers as fam  # the family builders
import tokenizers
from hf_helpers import tiny_variant

from zoo.io.gguf import save_gguf

SPACE = fam.SPACE
NFC_FAMILIES = ("qwen2", "neox")


def sentencepiece_form(tok) -> "tokenizers.Tokenizer":
    """The tokenizer with the merges a SentencePiece model converted to tokenizer.json has."""
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    added = {e["content"] for e in data["added_tokens"]}
    normal = {t: i for t, i in vocab.items() if t not in added and not (t.startswith("<0x") and len(t) == 6)}
    merges = []
    for token, i in sorted(normal.items(), key=lambda item: item[1]):
        splits = [(token[:k], token[k:]) for k in range(1, len(token))]
        splits = [(a, b) for a, b in splits if a in normal and b in normal]
        merges += sorted(splits, key=lambda s: (normal[s[0]], normal[s[1]]))
    data["model"]["merges"] = [list(m) for m in merges]
    return tokenizers.Tokenizer.from_str(json.dumps(data))


def _resaved(tok, folder: Path):
    tok.save(str(folder / "tokenizer.json"))
    return tok, folder


def phi3_published(folder: Path):
    """Phi-3 as published: its chat tokens and </s> take the whitespace after them (rstrip)."""
    flags = {t: {"rstrip": True} for t in ("</s>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>")}
    return fam._space_bpe(folder, specials=fam.PHI3_SPECIALS, words=True,
                          normalizer=fam.normalizers.Sequence([fam.normalizers.Prepend(SPACE),
                                                               fam.normalizers.Replace(" ", SPACE)]),
                          pre_tokenizer=None, decoder=fam.LLAMA_DECODER, bos="<s>", flags=flags,
                          config={"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "<|endoftext|>",
                                  "unk_token": "<unk>", "pad_token": "<|endoftext|>"})


def smollm3(folder: Path):
    """SmolLM3 (Llama 3's tokenizer): OLMo-2's regex, and a word that is a token taken whole."""
    tok, folder = fam.olmo2(folder)
    data = json.loads(tok.to_str())
    data["model"]["ignore_merges"] = True
    return _resaved(tokenizers.Tokenizer.from_str(json.dumps(data)), folder)


def _sentencepiece(builder):
    def build(folder: Path):
        tok, folder = builder(folder)
        return _resaved(sentencepiece_form(tok), folder)
    return build


# name -> (builder, the family of the tiny model, llama.cpp's tokenizer.ggml.model and .pre)
CASES = {
    "qwen2": (fam.qwen2, "qwen2", "gpt2", "qwen2"),
    "qwen3": (fam.qwen2, "qwen3", "gpt2", "qwen2"),
    "olmo2": (fam.olmo2, "olmo2", "gpt2", "dbrx"),
    "smollm3": (smollm3, "smollm3", "gpt2", "llama-bpe"),
    "granite": (fam.granite, "granite", "gpt2", "smollm"),
    "neox": (fam.neox, "gpt_neox", "gpt2", "gpt-2"),
    "mistral": (_sentencepiece(fam.mistral), "mistral", "llama", None),
    "gemma": (_sentencepiece(fam.gemma), "gemma", "llama", None),
    "phi3": (_sentencepiece(phi3_published), "phi3", "llama", None),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            builder, family, _, _ = CASES[name]
            folder = tmp_path_factory.mktemp(name)
            ref, folder = builder(folder / "tok")
            model_folder = folder.parent / "model"
            tiny_variant(family, vocab=ref.get_vocab_size()).save_pretrained(model_folder)
            model = zoo.Model.from_pretrained(model_folder)
            path = folder.parent / f"{name}.gguf"  # general.name is the stem: "phi3" for Phi-3's rules
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                save_gguf(model, path, tokenizer=folder)
            cache[name] = ref, folder, path, [str(w.message) for w in caught]
        return cache[name]
    return get


def samples(ref) -> list[str]:
    added = sorted(t.content for t in ref.get_added_tokens_decoder().values())
    inline = " ".join(f"a{t}b {t}\n x{t}  y" for t in added if SPACE not in t and not t.isspace())
    return [fam.SAMPLE, fam.SAMPLE + fam.RARE, inline, " leading space", "  two leading", "x", "\n\n\n",
            "    four    spaces     five", "1234567890 ½ ٣ 12.5%", fam.RARE, "trailing   "]


def _text(name: str, text: str) -> str:
    # llama.cpp normalizes nothing: the NFC families agree on text already in NFC (see the warning test)
    return unicodedata.normalize("NFC", text) if name in NFC_FAMILIES or name == "qwen3" else text


@pytest.mark.parametrize("name", CASES)
def test_gguf_tokenizer_keys_are_llama_cpps(built, name):
    import gguf

    _, _, model_kind, pre = CASES[name]
    _, _, path, _ = built(name)
    r = gguf.GGUFReader(path)
    assert r.fields["tokenizer.ggml.model"].contents() == model_kind
    if pre is not None:
        assert r.fields["tokenizer.ggml.pre"].contents() == pre
    else:
        assert r.fields["tokenizer.ggml.add_space_prefix"].contents() is (name != "gemma")
        assert len(r.fields["tokenizer.ggml.scores"].contents()) == len(r.fields["tokenizer.ggml.tokens"].contents())


@pytest.mark.parametrize("name", CASES)
def test_llama_cpp_encodes_as_the_tokenizers_library(built, name):
    llama_cpp = pytest.importorskip("llama_cpp")
    ref, _, path, _ = built(name)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in samples(ref):
        text = _text(name, text)
        want = ref.encode(text, add_special_tokens=False).ids
        assert llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) == want, repr(text)
    # With the BOS the family's files add (llama.cpp's add_bos_token).
    text = _text(name, fam.SAMPLE)
    assert llm.tokenize(text.encode("utf-8"), add_bos=True, special=True) == ref.encode(text).ids


@pytest.mark.parametrize("name", CASES)
def test_zoo_reads_the_gguf_tokenizer_back(built, name):
    ref, folder, path, _ = built(name)
    back = zoo.Model.from_pretrained(path).pretrained_tokenizer
    original = Tokenizer.from_pretrained(folder)
    for text in samples(ref):
        text = _text(name, text)
        assert back.encode(text) == ref.encode(text, add_special_tokens=False).ids, repr(text)
    text = _text(name, fam.SAMPLE + fam.RARE)
    assert back.decode(back.encode(text)) == original.decode(original.encode(text))
    assert (back.bos_id, back.eos_id) == (original.bos_id, original.eos_id)


def test_nfc_families_warn_that_llama_cpp_does_not_normalize(built):
    llama_cpp = pytest.importorskip("llama_cpp")
    ref, _, path, said = built("qwen2")
    assert any("NFC" in s and "llama.cpp normalizes nothing" in s for s in said), said
    decomposed = "Cafe\u0301 and \u1100\u1161"  # e + combining acute; conjoining Hangul jamo
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    assert llm.tokenize(decomposed.encode(), add_bos=False, special=True) != ref.encode(decomposed).ids
    _, _, _, quiet = built("olmo2")
    assert not any("NFC" in s for s in quiet)


# --- refused: what llama.cpp would encode differently ------------------------------------------


def _export_error(tmp_path: Path, folder: Path, vocab: int, family: str = "mistral", name: str = "m") -> str:
    tiny_variant(family, vocab=vocab).save_pretrained(tmp_path / "model")
    model = zoo.Model.from_pretrained(tmp_path / "model")
    with pytest.raises(CheckpointError) as caught:
        save_gguf(model, tmp_path / f"{name}.gguf", tokenizer=folder)
    assert not (tmp_path / f"{name}.gguf").exists()
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_trained_merges_are_refused(tmp_path):
    """The builder's Mistral as trained: its merges are not every split of a token."""
    ref, folder = fam.mistral(tmp_path / "tok")
    message = _export_error(tmp_path, folder, ref.get_vocab_size())
    assert "tokenizer.json: 'model.merges'" in message and "llama.cpp would merge" in message


def test_metaspace_first_is_refused(tmp_path):
    ref, folder = fam.mistral_metaspace(tmp_path / "tok")
    _resaved(sentencepiece_form(ref), folder)
    message = _export_error(tmp_path, folder, ref.get_vocab_size())
    assert "'pre_tokenizer'" in message and "prepend_scheme 'first'" in message


def test_rstrip_needs_a_phi3_name(built, tmp_path):
    ref, folder, _, _ = built("phi3")
    message = _export_error(tmp_path, folder, ref.get_vocab_size(), family="phi3", name="my-model")
    assert "general.name 'my-model'" in message and "rstrip" in message and "'phi3'" in message
    # and a model so named makes llama.cpp strip whitespace after the specials of any tokenizer
    ref, folder = fam.olmo2(tmp_path / "olmo")
    message = _export_error(tmp_path, folder, ref.get_vocab_size(), family="olmo2", name="phi3-olmo")
    assert "does not take the whitespace after it" in message or "not all in this vocabulary" in message


def test_lstrip_is_refused(tmp_path):
    ref, folder = fam.qwen2(tmp_path / "tok")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["added_tokens"][1]["lstrip"] = True
    (folder / "tokenizer.json").write_text(json.dumps(data))
    message = _export_error(tmp_path, folder, ref.get_vocab_size(), family="qwen2")
    assert "lstrip" in message and data["added_tokens"][1]["content"] in message
