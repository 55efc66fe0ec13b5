"""The whole path for each Llama variant family (Mistral, Qwen2, Qwen3, OLMo-2, SmolLM3,
Granite), on tiny random checkpoints transformers wrote (test_families.py checks loading, fp32
parity and saving back): gradients against transformers in float64, both backends; a LoRA
adapter both ways with PEFT; greedy generation with the KV cache against transformers' (a
prompt longer than the windows); GGUF export read back equal to the safetensors import, and in
llama.cpp itself where llama-cpp-python is installed; zoo merge back to the same class."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_helpers import (  # noqa: E402
    VOCAB,
    as_checkpoint,
    hf_logits,
    hf_loss_and_grads,
    load_hf_fp32,
    tiny_variant,
    tokens,
)

import zoo  # noqa: E402

# (the tiny checkpoints have no tokenizer: the GGUF files say so, llama.cpp runs their token ids)
pytestmark = pytest.mark.filterwarnings("ignore:.*no tokenizer to write:RuntimeWarning")
FAMILIES = ["mistral", "qwen2", "qwen3", "olmo2", "smollm3", "granite", "gemma", "gemma2", "gemma3", "phi3", "gpt_neox"]
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj", "query_key_value", "dense", "dense_h_to_4h",
           "dense_4h_to_h"]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(family, folder transformers saved, the transformers model)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = tiny_variant(request.param)
    hf.save_pretrained(folder)
    return request.param, folder, hf


def test_gradients_equal_transformers_in_float64(checkpoint):
    family, folder, hf = checkpoint
    tok, tgt = tokens(2, seq=14)
    hf64 = load_hf_fp32(folder).double()
    _, want = hf_loss_and_grads(hf64, tok, tgt)
    _, fp32 = hf_loss_and_grads(hf, tok, tgt)
    backends = ["manual", "clad"] if zoo.build_info()["clad"] else ["manual"]
    for ad in backends:
        model = zoo.Model.from_pretrained(folder, ad=ad)
        got = as_checkpoint(model, model.loss_and_grads(tok, tgt)[1])
        for name, ref in want.items():
            scale = np.abs(ref).max() + 1e-300
            err, fp32_err = np.abs(got[name] - ref).max() / scale, np.abs(fp32[name] - ref).max() / scale
            assert err <= max(1e-5, 4 * fp32_err), f"{ad} {name}: {err:.2e} (transformers float32: {fp32_err:.2e})"


def test_lora_adapters_go_both_ways_with_peft(checkpoint, tmp_path):
    peft = pytest.importorskip("peft")
    from zoo.io.load import load_with_adapter
    from zoo.io.peft import save_adapter

    family, folder, _ = checkpoint
    tok, tgt = tokens(3, seq=14)
    # PEFT's adapter (random factors, every one counts) into zoo: logits and factor gradients.
    torch.manual_seed(1)
    pm = peft.get_peft_model(load_hf_fp32(folder), peft.LoraConfig(r=4, lora_alpha=8, target_modules=MODULES,
                                                                   init_lora_weights=False, task_type="CAUSAL_LM"))
    pm.eval().save_pretrained(tmp_path / "peft")
    model = load_with_adapter(folder, tmp_path / "peft", zoo.Model, base_dtype="fp32")
    np.testing.assert_allclose(model.logits(tok), hf_logits(pm, tok), atol=1e-4 * np.abs(hf_logits(pm, tok)).max())
    grads = as_checkpoint(model, model.loss_and_grads(tok, tgt)[1])
    pm.zero_grad(set_to_none=True)
    logits = pm(torch.from_numpy(tok)).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.from_numpy(tgt).reshape(-1),
                                      ignore_index=-100).backward()
    for n, p in pm.named_parameters():
        if ".lora_" in n:
            name = n.removeprefix("base_model.model.").replace(".default.", ".")
            ref = p.grad.numpy()
            assert np.abs(grads[name] - ref).max() <= 1e-3 * np.abs(ref).max(), name
    # zoo's adapter back into PEFT.
    save_adapter(model, tmp_path / "zoo")
    back = peft.PeftModel.from_pretrained(load_hf_fp32(folder), tmp_path / "zoo").eval()
    np.testing.assert_allclose(hf_logits(back, tok), model.logits(tok), atol=1e-4 * np.abs(model.logits(tok)).max())


def test_greedy_generation_with_the_cache_equals_transformers(checkpoint):
    from zoo.generate import generate

    family, folder, hf = checkpoint
    model = zoo.Model.from_pretrained(folder)
    prompt = [2, 17, 42, 9, 77, 31, 5, 60, 11]  # longer than the windows (5)
    ours = generate(model, prompt, 24, temperature=0.0)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        logits = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].numpy()
    top2 = np.sort(logits, axis=-1)[:, -2:]
    ties = np.flatnonzero(top2[:, 1] - top2[:, 0] < 1e-4)  # a near-tie may go either way
    free = ties[0] if len(ties) else len(ours)
    assert free >= 8 and ours[:free] == ref[:free]


def test_gguf_reads_back_as_the_safetensors_import(checkpoint, tmp_path):
    pytest.importorskip("gguf")
    from zoo.io.gguf import save_gguf

    family, folder, _ = checkpoint
    model = zoo.Model.from_pretrained(folder)
    save_gguf(model, tmp_path / "m.gguf")
    back = zoo.Model.from_pretrained(tmp_path / "m.gguf")
    assert back.config.family == ("llama" if family == "mistral" else family)
    tok, _ = tokens(4, seq=5)  # within Mistral's window, which llama.cpp's llama has not
    np.testing.assert_array_equal(back.logits(tok), model.logits(tok))


def test_llama_cpp_computes_the_gguf_zoo_writes(checkpoint, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    from zoo.io.gguf import save_gguf

    family, folder, _ = checkpoint
    model = zoo.Model.from_pretrained(folder)
    save_gguf(model, tmp_path / "m.gguf")
    ids = [2, 17, 42, 9, 77]  # within the windows
    want = model.logits(np.asarray([ids]))[0]
    llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=64, n_threads=1, logits_all=True, verbose=False,
                          type_k=0, type_v=0)
    llm.eval(ids)
    got = np.asarray(llm.scores[:len(ids)])
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max(), np.abs(got - want).max()


def test_merge_saves_the_same_class(checkpoint, tmp_path):
    from zoo.cli import main

    family, folder, hf = checkpoint
    model = zoo.Model.from_pretrained(folder, lora=zoo.LoraConfig(r=2), base_dtype="fp32")
    rng = np.random.default_rng(0)
    for v in model.parameters().values():
        v[...] = 0.05 * rng.standard_normal(v.shape)
    from zoo.io.peft import save_adapter

    save_adapter(model, tmp_path / "adapter")
    assert main(["merge", str(folder), str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["architectures"] == [type(hf).__name__]
    tok, _ = tokens(5)
    np.testing.assert_allclose(hf_logits(load_hf_fp32(tmp_path / "merged"), tok), model.logits(tok),
                               atol=1e-4 * np.abs(model.logits(tok)).max())


def test_gemma2_where_the_caps_and_the_one_plus_w_norm_bite(tmp_path):
    """Norm weights near -1 (1 + w near 0) and caps below the scores and logits: transformers
    and zoo agree, and each cap changes the result (so the test would see a missing one)."""
    from hf_helpers import _randomized, assert_parity

    def model(attn_cap, logit_cap):
        cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=0,
                                        eos_token_id=1, pad_token_id=None, sliding_window=5,
                                        query_pre_attn_scalar=1, attn_logit_softcapping=attn_cap,
                                        final_logit_softcapping=logit_cap)
        hf = _randomized(transformers.Gemma2ForCausalLM, cfg, seed=4)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.copy_(-1.0 + 0.3 * torch.randn_like(p, generator=torch.Generator().manual_seed(5)))
        return hf

    hf = model(0.2, 0.3)
    hf.save_pretrained(tmp_path / "capped")
    ours = zoo.Model.from_pretrained(tmp_path / "capped")
    assert ours.config.norm == "rmsnorm_1p" and min(v.min() for k, v in ours.parameters().items() if "norm" in k) < -1.5
    assert_parity(hf, ours)
    tok, _ = tokens(6)
    capped = hf_logits(hf, tok)
    for uncapped in (model(None, 0.3), model(0.2, None)):
        uncapped.load_state_dict(hf.state_dict())
        assert np.abs(hf_logits(uncapped, tok) - capped).max() > 1e-2


def test_the_cli_finetunes_with_lora_generates_evaluates_and_converts(checkpoint, tmp_path, capsys):
    """zoo finetune --lora, then generate and eval from the run (its adapter over the base), zoo
    merge and zoo convert --to gguf: each verb on the family's checkpoint, with a tokenizer."""
    from zoo.cli import main
    from zoo.text.tokenizers import Tokenizer

    family, _, _ = checkpoint
    src = tmp_path / "src"
    tiny_variant(family, vocab=320).save_pretrained(src)
    Tokenizer.byte_level().save(src)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    out = tmp_path / "run"
    common = ["--threads", "1", "--no-progress"]
    assert main(["finetune", "--from", str(src), "--data", str(text), "--out", str(out), "--lora", "--steps", "3",
                 "--batch-size", "2", "--seq-len", "32", "--sample-tokens", "0", "--eval-batches", "1",
                 "--cache-dir", str(tmp_path / "cache"), *common]) == 0, capsys.readouterr().err
    final = out  # the run folder holds the adapter, which names its base
    assert (final / "adapter_config.json").is_file(), sorted(out.iterdir())
    capsys.readouterr()
    assert main(["generate", "--from", str(final), "--prompt", "The quick", "--max-new-tokens", "4",
                 "--temperature", "0", "--threads", "1"]) == 0, capsys.readouterr().err
    assert main(["eval", "--from", str(final), "--data", str(text), "--batch-size", "2", "--seq-len", "32",
                 "--threads", "1"]) == 0, capsys.readouterr().err
    assert "perplexity" in capsys.readouterr().out
    assert main(["merge", str(src), str(final), str(tmp_path / "merged")]) == 0, capsys.readouterr().err
    assert main(["convert", str(tmp_path / "merged"), str(tmp_path / "m.gguf"), "--to", "gguf"]) == 0, \
        capsys.readouterr().err
