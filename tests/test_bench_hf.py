"""The benchmarks against transformers' own modeling class of a config's family (issue 28):
`zoo bench --hf-class`, bench_lora's PyTorch side and bench_variants, end to end on tiny configs
of the new families. No timing assertions: that each runs, reports transformers' class and its
attention, and (zoo bench) that transformers' class computed zoo's losses from zoo's weights."""

import json
import math

import pytest

from helpers import needs
from zoo.arch.config import ModelConfig
from zoo.arch.presets import preset
from zoo.cli import main
from zoo.tools import bench, bench_lora, bench_variants

FAST = ["--steps", "2", "--warmup", "1", "--threads", "1"]

# Tiny configs with each new family's options, the shapes of tiny-llama.
OPTIONS = {
    "qwen2": {"attention_bias": True, "attention_out_bias": False, "tied_embeddings": True},
    "qwen3": {"attention_bias": False, "qk_norm": "head", "head_dim": 32, "tied_embeddings": True},
    "olmo2": {"attention_bias": False, "qk_norm": "projection", "branch_norms": "post"},
    "granite": {"attention_bias": False, "embedding_scale": 12.0, "residual_scale": 0.22,
                "attention_scale": 0.015625, "logit_scale": 0.125},
    "smollm3": {"attention_bias": False, "nope_layers": (1,)},
}
HF_CLASS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
            "granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM"}


def tiny(family: str) -> ModelConfig:
    d = preset("tiny-llama").model_dump()
    d.update({"family": family, "rope_scaling": None, "tied_embeddings": False, **OPTIONS[family]})
    return ModelConfig(**d)


def config_file(tmp_path, family: str):
    f = tmp_path / f"{family}.json"
    f.write_text(json.dumps(tiny(family).model_dump()))
    return f


@needs("torch", "transformers")
@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_zoo_bench_hf_class_computes_zoos_losses(tmp_path, capsys, family):
    """--vs hf --hf-class eager sdpa: one system per attention implementation, transformers' class
    of the family, in a process without zoo, with zoo's weights: zoo's losses step after step."""
    out = tmp_path / "hf.json"
    assert main(["bench", "--config", str(config_file(tmp_path, family)), "--batch-size", "2", "--seq-len", "16",
                 "--vs", "hf", "--hf-class", "eager", "sdpa", "--json", str(out), *FAST]) == 0
    table = capsys.readouterr().out
    cls = HF_CLASS[family]
    for row in (f"| torch_hf_eager: transformers {cls} (eager attention), AdamW(fused=True) |",
                f"| torch_hf_sdpa: transformers {cls} (sdpa attention), AdamW(fused=True) |",
                "- zoo / torch_hf_eager: step time", "| torch_fused"):
        assert (row in table) == (row != "| torch_fused"), row
    r = json.loads(out.read_text())
    assert r["vs"] == "hf" and r["hf_class"] == ["eager", "sdpa"] and "--hf-class eager sdpa" in r["command"]
    assert r["system_order"] == ["zoo", "torch_hf_eager", "torch_hf_sdpa"]
    assert r["hf_config"]["architectures"] == [cls]
    assert r["systems"]["torch_fused"] is None  # the reference model did not run (--vs hf)
    zoo_s = r["systems"]["zoo"]
    for attn in ("eager", "sdpa"):
        s = r["systems"][f"torch_hf_{attn}"]
        assert s["hf_class"] == cls and s["hf_attention"] == attn and s["imported_zoo"] is False
        assert s["precision"] == "fp32" and len(s["step_ms"]) == 2 and s["peak_rss_mib"] > 0
        assert s["loss_first"] == pytest.approx(zoo_s["loss_first"], rel=1e-5)
        assert s["loss_last"] == pytest.approx(zoo_s["loss_last"], rel=1e-4)
        ratio = r["ratios"][f"zoo_over_torch_hf_{attn}"]
        assert ratio["step_time"] == pytest.approx(zoo_s["step_ms_median"] / s["step_ms_median"], rel=1e-9)
    assert zoo_s["loss_last"] < zoo_s["loss_first"]


@needs("torch", "transformers")
def test_zoo_bench_hf_class_next_to_the_reference(tmp_path, capsys):
    """--hf-class alone: sdpa, after the reference systems; a config transformers' class cannot
    express is refused in one line, naming the field."""
    cfg_file = config_file(tmp_path, "qwen2")
    assert main(["bench", "--config", str(cfg_file), "--batch-size", "1", "--seq-len", "8", "--hf-class",
                 "--json", str(tmp_path / "r.json"), *FAST]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["system_order"] == ["zoo", "torch_fused", "torch_default", "torch_hf_sdpa"]
    assert r["systems"]["torch_hf_sdpa"]["hf_class"] == "Qwen2ForCausalLM"
    assert r["systems"]["torch_hf_sdpa"]["loss_first"] == pytest.approx(r["systems"]["torch_fused"]["loss_first"],
                                                                        rel=1e-5)
    capsys.readouterr()
    d = tiny("qwen2").model_dump()
    d["qk_norm"] = "head"  # Qwen2ForCausalLM has no q/k norm
    cfg_file.write_text(json.dumps(d))
    assert main(["bench", "--config", str(cfg_file), "--seq-len", "8", "--hf-class", *FAST]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zoo bench: error:") and "qk_norm" in err and "Traceback" not in err
    assert main(["bench", "--preset", "tiny-llama", "--seq-len", "8", "--vs", "none", "--hf-class", *FAST]) == 1
    assert "--vs none measures zoo alone" in capsys.readouterr().err


def test_system_names():
    assert bench.system_names("fp32", "torch", ("sdpa",)) == ["zoo", "torch_fused", "torch_default", "torch_hf_sdpa"]
    assert bench.system_names("bf16", "hf", ("eager",)) == ["zoo", "zoo_bf16", "torch_hf_eager", "torch_hf_eager_bf16"]
    assert bench.system_names("fp32", "none", ("sdpa",)) == ["zoo"]
    assert bench.hf_attention("torch_hf_eager_bf16") == "eager" and bench.hf_attention("torch_fused") is None
    assert bench.system_precision("torch_hf_sdpa_bf16") == "bf16" and bench.system_precision("torch_hf_sdpa") == "fp32"


@needs("torch", "transformers", "peft")
def test_bench_lora_names_transformers_class(tmp_path, capsys):
    """bench_lora's PyTorch side is transformers' class of the family; --hf-class picks its
    attention (a system each when it names two); --rounds runs the systems in turn and pools;
    --profile profiles zoo per block."""
    out = tmp_path / "lora.json"
    assert bench_lora.main(["--config", str(config_file(tmp_path, "qwen3")), "--base", "bf16", "--torch", "bf16",
                            "--hf-class", "eager", "sdpa", "--rounds", "2", "--profile", "--seq-len", "16", "--rank", "4",
                            "--json", str(out), *FAST]) == 0
    table = capsys.readouterr().out
    assert "- torch_bf16_eager: transformers' Qwen3ForCausalLM, eager attention" in table
    assert "- torch_bf16_sdpa: transformers' Qwen3ForCausalLM, sdpa attention" in table
    assert "| round | zoo_bf16 s | torch_bf16_eager s | torch_bf16_sdpa s |" in table
    r = json.loads(out.read_text())
    assert set(r["systems"]) == {"zoo_bf16", "torch_bf16_eager", "torch_bf16_sdpa"}
    for attn in ("eager", "sdpa"):
        s = r["systems"][f"torch_bf16_{attn}"]
        assert s["hf_class"] == "Qwen3ForCausalLM" and s["attention"] == attn and s["imported_zoo"] is False
        assert len(s["step_ms"]) == 4  # 2 steps in each of 2 rounds
    assert r["hf_class"] == ["eager", "sdpa"] and "--hf-class eager sdpa --rounds 2 --profile" in r["command"]
    assert "zoo_bf16 per block (a separate profiled run" in table  # --profile: zoo's blocks, once more
    blocks = r["systems"]["zoo_bf16"]["blocks"]
    assert blocks["lora"]["total_ms"] > 0 and blocks["linear"]["total_ms"] > 0
    assert r["systems"]["zoo_bf16"]["profiled_step_ms_mean"] > 0
    assert set(r["ratios"]) == {"zoo_bf16_over_torch_bf16_eager", "zoo_bf16_over_torch_bf16_sdpa"}
    assert len(r["by_round"]) == 2
    for e in r["by_round"]:
        assert e["zoo_bf16_over_torch_bf16_eager"] == pytest.approx(
            e["zoo_bf16_step_ms"] / e["torch_bf16_eager_step_ms"], rel=1e-9)


def test_bench_variants(tmp_path, capsys):
    """bench_variants: the baseline and each option, per block, the baseline first."""
    out = tmp_path / "v.json"
    assert bench_variants.main(["--preset", "tiny-llama", "--variants", "qk_norm_head", "post_norms", "olmo2",
                                "--batch-size", "1", "--seq-len", "16", "--rounds", "1", "--steps", "1",
                                "--threads", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| llama: the baseline" in table and "| qk_norm_head: Qwen3" in table
    r = json.loads(out.read_text())
    assert list(r["variants"]) == ["llama", "qk_norm_head", "post_norms", "olmo2"]
    assert r["baseline_config"]["qk_norm"] == "none" and r["baseline_config"]["family"] == "llama"
    for name, v in r["variants"].items():
        assert v["step_ms"] > 0 and math.isfinite(v["step_ms"]) and v["blocks_ms"]["linear"] > 0
        assert v["blocks_ms"]["norm"] > 0
    assert r["variants"]["llama"]["step_over_baseline"] == 1.0
    assert r["variants"]["olmo2"]["options"] == {"qk_norm": "projection", "branch_norms": "post"}
    assert bench_variants.main(["--preset", "gpt2", "--threads", "1"]) == 1  # learned positions, LayerNorm
    assert "not a Llama-like shape" in capsys.readouterr().err
