"""`python -m zoo.tools.bench_lora` end to end on the tiny presets: it runs, prints its table,
writes its JSON, and each side trains the same adapters. No timing assertions. One thread."""

import json
import math

import pytest

import zoo
from zoo.arch.lora import LoraConfig, adapters, module_names
from zoo.arch.presets import preset
from zoo.tools import bench_lora

FAST = ["--steps", "2", "--warmup", "1", "--threads", "1", "--seq-len", "32", "--rank", "4"]


def adapter_params(name: str, r: int = 4) -> int:
    return sum(r * (a.d_in + a.o1 - a.o0) for a in adapters(preset(name), LoraConfig(r=r)))


def check_system(s: dict, tokens: int) -> None:
    for k in ("step_ms_median", "tokens_per_s", "peak_rss_mib", "gflops", "build_s"):
        assert s[k] > 0 and math.isfinite(s[k]), (k, s[k])
    assert s["step_ms_min"] <= s["step_ms_median"] <= s["step_ms_max"] and len(s["step_ms"]) == 2
    assert s["tokens_per_s"] == pytest.approx(tokens / (s["step_ms_median"] / 1000), rel=1e-9)
    assert math.isfinite(s["loss_first"]) and s["loss_first"] > 0


@pytest.mark.parametrize("name,settings", [("tiny-llama", ["bf16", "fp32"]), ("tiny-gpt2", ["fp32"])])
def test_torch_side(tmp_path, capsys, name, settings):
    """PyTorch + PEFT in both settings: LoRA on every linear of every layer, in a process that
    never imported zoo."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    out = tmp_path / "lora.json"
    assert bench_lora.main(["--preset", name, "--base", "none", "--torch", *settings, "--torch-checkpointing",
                            "--json", str(out), *FAST]) == 0
    table = capsys.readouterr().out
    assert "| torch_fp32 | fp32, gradient checkpointing" in table
    if "bf16" in settings:
        assert "| torch_bf16 | bf16 weights, fp32 adapters, autocast bf16, gradient checkpointing" in table
    r = json.loads(out.read_text())
    assert r["schema"] == "zoo-bench-lora/1" and set(r["systems"]) == {f"torch_{s}" for s in settings}
    assert r["lora"] == {"r": 4, "alpha": 8.0, "dropout": 0.0, "targets": module_names(preset(name))}
    assert f"--base none --torch {' '.join(settings)}" in r["command"] and r["ratios"] == {}
    for s in r["systems"].values():
        check_system(s, 32)
        assert s["trainable_params"] == adapter_params(name) and s["checkpointing"]
        assert s["imported_zoo"] is False


def test_bad_flags_are_one_line(capsys):
    assert bench_lora.main(["--preset", "tiny-llama", "--base", "q3", *FAST]) == 1
    assert capsys.readouterr().err.strip() == "bench_lora: error: --base q3: choose from bf16, int8, nf4, fp32, " \
                                              "or 'none'"
    assert bench_lora.main(["--preset", "tiny-llama", "--targets", "c_attn", *FAST]) == 1
    assert "this model's modules are q_proj" in capsys.readouterr().err


def test_zoo_next_to_torch(tmp_path, capsys):
    """zoo over each base format, next to PyTorch + PEFT: the same adapters, a ratio per pair."""
    pytest.importorskip("peft")
    out = tmp_path / "lora.json"
    assert bench_lora.main(["--preset", "tiny-llama", "--base", "bf16", "int8", "nf4", "--torch", "bf16",
                            "--checkpointing", "--json", str(out), *FAST]) == 0
    r = json.loads(out.read_text())
    assert set(r["systems"]) == {"zoo_bf16", "zoo_int8", "zoo_nf4", "torch_bf16"}
    for name, s in r["systems"].items():
        check_system(s, 32)
        assert s["trainable_params"] == adapter_params("tiny-llama")
    for base in ("bf16", "int8", "nf4"):
        ratio = r["ratios"][f"zoo_{base}_over_torch_bf16"]
        z, t = r["systems"][f"zoo_{base}"], r["systems"]["torch_bf16"]
        assert ratio["step_time"] == pytest.approx(z["step_ms_median"] / t["step_ms_median"], rel=1e-9)
        assert ratio["peak_rss"] == pytest.approx(z["peak_rss_mib"] / t["peak_rss_mib"], rel=1e-9)
    table = capsys.readouterr().out
    assert "zoo_nf4 / torch_bf16: step time" in table
    # The kernels each zoo system's products ran on, as oneDNN named them (bf16 products where the
    # CPU has bf16 dot products; else fp32 ones on the fp32 library, which oneDNN does not list).
    for base in ("bf16", "int8", "nf4"):
        used = r["systems"][f"zoo_{base}"]["kernels_used"]
        if zoo.gemm_info()["bf16_native"]:
            assert used and all(u["bf16_kernel"] for u in used if u["precision"] == "bf16"), used
            assert f"zoo_{base}'s products ran on onednn:" in table


@pytest.mark.skipif(not zoo.gemm_info()["bf16_native"], reason="a packed base needs bf16 kernels")
def test_the_packed_base_beside_the_bf16_one(tmp_path, capsys):
    """--packed-base: a second zoo system over the same bf16 base with its packed copy, which
    trains the same adapters bit for bit, reads that copy, and holds it in memory."""
    out = tmp_path / "lora.json"
    assert bench_lora.main(["--preset", "tiny-llama", "--base", "bf16", "--packed-base", "--torch", "none",
                            "--json", str(out), *FAST]) == 0
    r = json.loads(out.read_text())
    plain, packed = r["systems"]["zoo_bf16"], r["systems"]["zoo_bf16_packed"]
    check_system(packed, 32)
    assert (packed["loss_first"], packed["loss_last"]) == (plain["loss_first"], plain["loss_last"])
    assert "--packed-base" in r["command"]
    assert packed["packed_base_bytes"] == packed["arena_bytes"]["packed_base"] > 0
    assert plain["arena_bytes"]["packed_base"] == 0
    assert any("weights prepacked" in u["kernel"] for u in packed["kernels_used"])
    assert not any("weights prepacked" in u["kernel"] for u in plain["kernels_used"])
    assert r["ratios"]["zoo_bf16_packed_over_zoo_bf16"]["step_time"] == pytest.approx(
        packed["step_ms_median"] / plain["step_ms_median"], rel=1e-9)
    assert "zoo_bf16_packed / zoo_bf16: step time" in capsys.readouterr().out
    assert bench_lora.main(["--preset", "tiny-llama", "--base", "nf4", "--packed-base", *FAST]) == 1
    assert "--packed-base packs a bf16 base: add bf16 to --base" in capsys.readouterr().err


def test_random_checkpoint_holds_the_model_built_in_memory(tmp_path):
    """write_random_checkpoint: zoo's init of a preset in bf16, which a bf16 base loads as the very
    values zoo.Model(cfg, seed=0) builds in memory (an untied embedding mapped from the file)."""
    cfg = preset("tiny-llama").model_copy(update={"tied_embeddings": False})
    bench_lora.write_random_checkpoint(cfg, tmp_path / "ck", seed=0)
    lora = LoraConfig(r=4)
    built = zoo.Model(cfg, seed=0, lora=lora, base_dtype="bf16")
    loaded = zoo.Model.from_pretrained(tmp_path / "ck", lora=lora, base_dtype="bf16")
    assert loaded.config == cfg and loaded.arena_bytes()["frozen_base_mapped"] > 0
    for name in built.base_tensor_names():
        assert (built.base_tensor(name) == loaded.base_tensor(name)).all(), name


def test_zoo_from_checkpoint(tmp_path):
    """--from-checkpoint: each zoo system loads the written checkpoint, and trains as the model
    built in memory does (the same losses)."""
    cfg = tmp_path / "untied.json"
    cfg.write_text(json.dumps(preset("tiny-llama").model_copy(update={"tied_embeddings": False}).model_dump()))
    losses = {}
    for extra in ([], ["--from-checkpoint"]):
        out = tmp_path / f"lora{len(extra)}.json"
        assert bench_lora.main(["--config", str(cfg), "--base", "bf16", "nf4", "--torch", "none", "--json", str(out),
                                *extra, *FAST]) == 0
        r = json.loads(out.read_text())
        for name, s in r["systems"].items():
            check_system(s, 32)
            mapped = s["arena_bytes"]["frozen_base_mapped"]
            assert mapped > 0 if (extra and name == "zoo_bf16") else mapped == 0, (extra, name)
            assert s["loaded_from"] == ("safetensors checkpoint (bf16)" if extra else "built in memory")
        losses[bool(extra)] = {name: s["loss_first"] for name, s in r["systems"].items()}
        assert ("--from-checkpoint" in r["command"]) == bool(extra)
    # the bf16 base is the same model either way; the nf4 one quantizes the bf16-rounded values
    assert losses[True]["zoo_bf16"] == losses[False]["zoo_bf16"]
