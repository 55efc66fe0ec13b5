"""Tiny random transformers models and checkpoints, and parity checks against them. Imported
only by tests that need torch and transformers (helpers.needs("torch", "transformers"), or an
import inside the test after that mark): everything else is in helpers.py.

gpt2_checkpoint, llama_checkpoint: checkpoints that transformers itself writes, with their
tokenizers, for end-to-end tests. GPT-2: a byte-level BPE (vocab.json + merges.txt) trained
here on the start of the data. Llama: the Llama-2 SentencePiece tokenizer from the shared
data (32000 ids), tied embeddings."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from helpers import LLAMA2_TOKENIZER, shared

VOCAB = 97


def tiny_gpt2(*, n_inner=None, tie=True, vocab=VOCAB, seed=0) -> "transformers.GPT2LMHeadModel":
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=n_inner,
                                  tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1)
    return _randomized(transformers.GPT2LMHeadModel, cfg, seed)


def tiny_llama(*, n_kv_head=4, tie=False, head_dim=None, rope_parameters=None, attention_bias=False,
               mlp_bias=False, seed=0) -> "transformers.LlamaForCausalLM":
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=n_kv_head, head_dim=head_dim,
                                   max_position_embeddings=64, rope_parameters=rope_parameters,
                                   attention_bias=attention_bias, mlp_bias=mlp_bias, tie_word_embeddings=tie,
                                   rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1)
    return _randomized(transformers.LlamaForCausalLM, cfg, seed)


# The Llama variants: tiny random models of each class, with what makes it differ switched on
# where the published models leave it off (Qwen2's window on its second layer, SmolLM3's NoPE
# layer, Granite's four scalars away from 1). Shapes shared: 3 layers of 32 wide, 4 heads.
_SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
              pad_token_id=None)  # (a pad id makes torch freeze that embedding row: zoo trains every row)


def tiny_variant(family: str, seed: int = 3, vocab: int = VOCAB):
    t = transformers
    _SHAPE = {**globals()["_SHAPE"], "vocab_size": vocab}
    made = {
        "mistral": lambda: (t.MistralForCausalLM, t.MistralConfig(**_SHAPE, head_dim=12, sliding_window=5)),
        "qwen2": lambda: (t.Qwen2ForCausalLM, t.Qwen2Config(**_SHAPE, use_sliding_window=True, sliding_window=5,
                                                             max_window_layers=1)),
        "qwen3": lambda: (t.Qwen3ForCausalLM, t.Qwen3Config(**_SHAPE, head_dim=16, tie_word_embeddings=True)),
        "olmo2": lambda: (t.Olmo2ForCausalLM, t.Olmo2Config(**_SHAPE)),
        "smollm3": lambda: (t.SmolLM3ForCausalLM, t.SmolLM3Config(**{**_SHAPE, "num_hidden_layers": 4})),
        "granite": lambda: (t.GraniteForCausalLM, t.GraniteConfig(**_SHAPE, embedding_multiplier=6.0,
                                                                   residual_multiplier=0.4, attention_multiplier=0.3,
                                                                   logits_scaling=3.0)),
    }
    gemma = dict(_SHAPE, head_dim=16)
    made.update({
        "gemma": lambda: (t.GemmaForCausalLM, t.GemmaConfig(**gemma)),
        "gemma2": lambda: (t.Gemma2ForCausalLM, t.Gemma2Config(**gemma, sliding_window=5, query_pre_attn_scalar=16,
                                                               attn_logit_softcapping=0.5, final_logit_softcapping=2.0)),
        "gemma3": lambda: (t.Gemma3ForCausalLM, t.Gemma3TextConfig(
            **{**gemma, "num_hidden_layers": 6}, sliding_window=5, query_pre_attn_scalar=16,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    })
    made["phi3"] = lambda: (t.Phi3ForCausalLM, t.Phi3Config(**_SHAPE, sliding_window=5, original_max_position_embeddings=64,
                                                            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                             "partial_rotary_factor": 0.5}))
    neox = {k: v for k, v in _SHAPE.items() if k not in ("num_key_value_heads", "rms_norm_eps")}
    made["gpt_neox"] = lambda: (t.GPTNeoXForCausalLM, t.GPTNeoXConfig(**neox, layer_norm_eps=1e-5, rotary_pct=0.25,
                                                                      hidden_act="gelu"))
    cls, cfg = made[family]()
    return _randomized(cls, cfg, seed)


def _randomized(cls, cfg, seed):
    """A model whose every parameter (norm weights and biases too) is random, so each
    gradient path is exercised; eager attention so autograd runs through plain ops."""
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def save_hf_as(model, folder: Path, *, dtype=torch.float32, max_shard_size=None) -> None:
    """model.save_pretrained with its tensors stored as `dtype` (the fp32 model is untouched)."""
    kw = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    if dtype is torch.float32:
        model.save_pretrained(folder, **kw)
        return
    casted = type(model)(model.config)
    casted.load_state_dict(model.state_dict())
    casted.to(dtype).save_pretrained(folder, **kw)


def load_hf_fp32(folder: Path):
    """The transformers model of `folder` in float32 (BF16 weights upcast exactly)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval()


def tokens(seed=0, batch=2, seq=12, vocab=VOCAB):
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, vocab, (batch, seq))
    tgt = rng.integers(0, vocab, (batch, seq))
    tgt[0, :2] = -100  # ignored positions count in neither loss nor gradients
    return tok, tgt


def hf_logits(model, tok: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tok)).logits.float().numpy()


def hf_loss_and_grads(model, tok: np.ndarray, tgt: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """Mean cross-entropy over non-ignored targets and torch autograd's gradients, by HF name."""
    model.zero_grad(set_to_none=True)
    logits = model(torch.from_numpy(tok)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.from_numpy(tgt).reshape(-1), ignore_index=-100)
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def as_checkpoint(zoo_model, grads: dict) -> dict:
    """zoo's gradients by zoo's (checkpoint) names with each tensor's rows in the checkpoint's
    order (GPT-NeoX's interleaved q|k|v), keyed as transformers' parameters are (transformers 5
    calls GPT-NeoX's embed_out lm_head)."""
    from zoo import families

    cfg = zoo_model.config
    family = families.get(cfg.family)
    out = {name: family.rows_to_checkpoint(cfg, name, g) for name, g in grads.items()}
    head = family.names.head + ".weight"
    if head in out and head != "lm_head.weight":
        out["lm_head.weight"] = out.pop(head)
    return out


def assert_parity(hf_model, zoo_model, seed=0) -> None:
    """Logits within 1e-4, loss within 1e-5, every gradient within 1e-3 relative."""
    from zoo.arch.layout import parameter_layout

    tok, tgt = tokens(seed)
    diff = np.abs(zoo_model.logits(tok) - hf_logits(hf_model, tok)).max()
    assert diff <= 1e-4, f"logits differ by {diff:.2e}"
    loss, grads = zoo_model.loss_and_grads(tok, tgt)
    grads = as_checkpoint(zoo_model, grads)
    ref_loss, ref_grads = hf_loss_and_grads(hf_model, tok, tgt)
    assert abs(loss - ref_loss) <= 1e-5, (loss, ref_loss)
    specs = {s.name: s for s in parameter_layout(zoo_model.config)}
    specs["lm_head.weight"] = next(iter(specs.values()))  # (an untransposed tensor, for the check below)
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    for name, ref in ref_grads.items():
        ours = grads[name].T if specs[name].hf_transposed else grads[name]
        err = np.abs(ours - ref).max() / (np.abs(ref).max() + 1e-12)
        assert err <= 1e-3, f"{name}: gradient relative error {err:.2e}"


# --- checkpoints with tokenizers, for end-to-end tests ---------------------------------------


def gpt2_checkpoint(folder: Path, text: str, vocab_size: int = 384, n_positions: int = 128) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[:200_000]], trainer)
    eos = tok.token_to_id("<|endoftext|>")
    cfg = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=n_positions, n_embd=64, n_layer=2,
                                  n_head=4, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.model.save(str(folder))  # vocab.json + merges.txt, GPT-2's own files
    return folder


def llama_checkpoint(folder: Path) -> Path:
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    shutil.copy(shared(LLAMA2_TOKENIZER), folder / "tokenizer.model")
    return folder


def folder_logits(folder: Path, tokens: np.ndarray) -> np.ndarray:
    """The logits transformers computes for `tokens` with the checkpoint in `folder`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
