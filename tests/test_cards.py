"""Model cards (zoo/tools/cards.py): every preset has a committed card, the committed cards are
exactly what the generator writes today (so they cannot drift from the code), `zoo card NAME`
prints one, and a card shows a `zoo bench --json` result placed in its benchmarks folder."""

import json
import shutil
from pathlib import Path

import pytest

import zoo
from zoo.arch.config import ModelConfig
from zoo.arch.layout import num_parameters
from zoo.arch.memory import finetune_memory_bytes
from zoo.arch.presets import PRESETS, preset_info
from zoo.cli import main
from zoo.tools import cards

ROOT = Path(__file__).resolve().parents[1]
CARDS = ROOT / cards.CARDS_DIR


@pytest.fixture(scope="module")
def generated():
    return cards.render_all(ROOT / cards.BENCHMARKS_DIR)


def test_every_preset_has_a_committed_card(generated):
    names = [p.name for p in PRESETS]
    assert sorted(generated) == sorted([f"{n}.md" for n in names] + [f"{n}.json" for n in names] + ["README.md"])
    for n in names:
        assert (CARDS / f"{n}.md").is_file(), f"model_cards/{n}.md missing: run `zoo cards`"
        assert (CARDS / f"{n}.json").is_file(), f"model_cards/{n}.json missing: run `zoo cards`"


def test_regenerating_changes_nothing(generated):
    stale = cards.differing(CARDS, generated)
    assert not stale, f"model cards out of date, run `zoo cards`: {stale}"
    # Deterministic: a second rendering is byte-identical.
    assert cards.render_all(ROOT / cards.BENCHMARKS_DIR) == generated


def test_check_and_write(tmp_path, capsys):
    bench = tmp_path / "no-benchmarks"
    out = tmp_path / "cards"
    assert main(["cards", "--check", "--out", str(out), "--benchmarks", str(bench)]) == 1
    assert not out.exists()  # --check writes nothing
    assert main(["cards", "--out", str(out), "--benchmarks", str(bench)]) == 0
    assert main(["cards", "--check", "--out", str(out), "--benchmarks", str(bench)]) == 0
    (out / "gpt2.md").write_text("edited by hand\n")
    (out / "old-preset.json").write_text("{}\n")
    capsys.readouterr()
    assert main(["cards", "--check", "--out", str(out), "--benchmarks", str(bench)]) == 1
    listed = capsys.readouterr().out
    assert "gpt2.md (differs)" in listed and "old-preset.json (stale" in listed
    assert "tiny-llama" not in listed
    assert (out / "gpt2.md").read_text() == "edited by hand\n"
    assert main(["cards", "--out", str(out), "--benchmarks", str(bench)]) == 0
    assert not (out / "old-preset.json").exists()
    assert main(["cards", "--check", "--out", str(out), "--benchmarks", str(bench)]) == 0


def test_card_json_facts():
    zoo.set_threads(cards.CARD_THREADS)  # the count the memory figures assume
    for p in PRESETS:
        d = json.loads((CARDS / f"{p.name}.json").read_text())
        cfg = p.config
        assert ModelConfig(**d["config"]) == cfg
        assert d["parameters"]["total"] == num_parameters(cfg)
        assert sum(t["parameters"] for t in d["tensors"]) == num_parameters(cfg)
        assert d["hf_checkpoints"] == list(p.hf_checkpoints) and d["licence"] == p.licence
        kind = d["blocks"]["attention"]["kind"]
        assert kind == ("MHA" if cfg.n_kv_head == cfg.n_head else "MQA" if cfg.n_kv_head == 1 else "GQA")
        for row in d["finetune_memory"]:
            assert row["seq_len"] <= cfg.max_seq_len
            m = finetune_memory_bytes(cfg, row["batch"], row["seq_len"], row["checkpointing"])
            assert row["total"] == m.total and row["activations"] == m.activations


@pytest.mark.parametrize("threads", [1, 3])
def test_a_card_is_the_same_at_any_thread_count(capsys, threads):
    """The memory figures are at CARD_THREADS whatever count the process runs at (the arena holds
    each thread's scratch): generated at 4 threads, 78 of the 79 files differed from the committed ones."""
    zoo.set_threads(threads)
    for name in ("gpt2", "llama-3.2-1b"):
        assert cards.render_card(name, ROOT / cards.BENCHMARKS_DIR) == (CARDS / f"{name}.md").read_text()
    assert main(["card", "gpt2", "--json"]) == 0  # the command's card too
    assert capsys.readouterr().out == (CARDS / "gpt2.json").read_text()
    assert zoo.get_threads() == threads  # given back


def test_card_contents():
    gpt2 = (CARDS / "gpt2.md").read_text()
    for text in ("124,439,808", "openai-community/gpt2", "MHA", "LayerNorm", "GELU", "learned absolute",
                 "`transformer.h.{i}.attn.c_attn.weight` | 2304 x 768 *", "## Measured speed",
                 "[gpt2-b4-t64.json](../benchmarks/gpt2-b4-t64.json)",
                 "zoo bench --preset gpt2 --batch-size 4 --seq-len 64 --steps 10", "MIT (OpenAI"):
        assert text in gpt2, text  # measured: benchmarks/gpt2-*.json are committed
    xl = (CARDS / "gpt2-xl.md").read_text()
    assert "Not measured yet" in xl and "zoo bench --preset gpt2-xl --batch-size 4 --seq-len 256" in xl
    llama = (CARDS / "llama-3.2-1b.md").read_text()
    for text in ("GQA", "32 query heads, 8 key/value heads", "head_dim 64", "theta 500000", "llama3: factor 32",
                 "meta-llama/Llama-3.2-1B-Instruct", "Llama 3.x Community License", "| 8 | 1024 |"):
        assert text in llama, text
    tiny = (CARDS / "tiny-llama.md").read_text()
    assert "None: a zoo-only shape" in tiny and "| 8 | 256 |" in tiny and "| 8 | 1024 |" not in tiny
    index = (CARDS / "README.md").read_text()
    assert all(f"[{p.name}]({p.name}.md)" in index and f"{num_parameters(p.config):,}" in index for p in PRESETS)


def test_zoo_card_prints(capsys):
    assert main(["card", "gpt2"]) == 0
    assert capsys.readouterr().out == (CARDS / "gpt2.md").read_text()
    assert main(["card", "tiny-llama", "--json"]) == 0
    assert capsys.readouterr().out == (CARDS / "tiny-llama.json").read_text()


def test_unknown_preset(capsys):
    assert main(["card", "gpt3"]) == 1
    err = capsys.readouterr().err
    assert "unknown preset 'gpt3'" in err and "gpt2, gpt2-medium" in err and "tiny-llama" in err
    with pytest.raises(KeyError, match="known presets"):
        cards.render_card("gpt3", None)


def test_card_picks_up_benchmarks(tmp_path, capsys):
    """A real `zoo bench --json` run (zoo alone, one step) and a copy with PyTorch ratios."""
    bench = tmp_path / "benchmarks"
    run = bench / "tiny-gpt2-b1-t16.json"
    assert main(["bench", "--preset", "tiny-gpt2", "--batch-size", "1", "--seq-len", "16", "--steps", "1",
                 "--warmup", "0", "--threads", "1", "--vs", "none", "--json", str(run),
                 "--png", str(tmp_path / "chart.png")]) == 0
    r = json.loads(run.read_text())
    vs_torch = dict(r, command=r["command"].replace("--vs none", "--vs torch"), batch=2, vs="torch",
                    ratios={"zoo_over_torch_fused": {"step_time": 0.81234, "tokens_per_s": 1.2, "peak_rss": 0.5},
                            "zoo_over_torch_default": {"step_time": 0.5, "tokens_per_s": 2.0, "peak_rss": 0.4}})
    (bench / "a-vs-torch.json").write_text(json.dumps(vs_torch))
    (bench / "other-preset.json").write_text(json.dumps(dict(r, model=dict(r["model"], preset="tiny-llama"))))
    (bench / "not-a-bench.json").write_text(json.dumps({"hello": 1}))
    capsys.readouterr()

    assert main(["card", "tiny-gpt2", "--benchmarks", str(bench)]) == 0
    md = capsys.readouterr().out
    assert "Not measured yet" not in md
    assert r["command"] in md and vs_torch["command"] in md
    zoo = r["systems"]["zoo"]
    assert (f"| 1 | 16 | 1 | no | fp32 | {round(zoo['step_ms_median'], 2):,.1f} | "
            f"{round(zoo['tokens_per_s'], 1):,.0f} |") in md
    assert "| 0.812x | 0.500x |" in md and "[tiny-gpt2-b1-t16.json](../benchmarks/tiny-gpt2-b1-t16.json)" in md
    assert md.index("| 1 | 16 |") < md.index("| 2 | 16 |")  # rows by (B, T, ...)

    d = cards.card_data(preset_info("tiny-gpt2"), cards.read_benchmarks(bench))
    assert [b["file"] for b in d["benchmarks"]] == ["benchmarks/tiny-gpt2-b1-t16.json", "benchmarks/a-vs-torch.json"]
    assert d["benchmarks"][0]["step_time_over_torch_fused"] is None
    assert d["benchmarks"][1]["step_time_over_torch_fused"] == 0.812
    other = cards.card_data(preset_info("tiny-llama"), cards.read_benchmarks(bench))
    assert [b["file"] for b in other["benchmarks"]] == ["benchmarks/other-preset.json"]

    # A --precision bf16 run: a bf16 row beside its fp32 one, against autocast.
    bf16 = tmp_path / "bench-bf16"
    bf16.mkdir()
    (bf16 / "b.json").write_text(json.dumps(dict(
        r, systems=dict(r["systems"], zoo_bf16=dict(zoo, step_ms_median=1.5)),
        ratios={"zoo_bf16_over_torch_fused_bf16": {"step_time": 0.4, "tokens_per_s": 2.5, "peak_rss": 0.7}})))
    rows = cards.card_data(preset_info("tiny-gpt2"), cards.read_benchmarks(bf16))["benchmarks"]
    assert [(b["precision"], b["step_time_over_torch_fused"]) for b in rows] == [("bf16", 0.4), ("fp32", None)]
    assert rows[0]["step_ms_median"] == 1.5
    ran = r["machine"]["zoo_build"]["gemm"]  # the real run: forced only where the suite runs forced
    assert ("(forced class)" in md) == (ran["vector_isa"] != ran["cpu_vector_isa"])

    # A run in a forced CPU class (DNNL_MAX_CPU_ISA) says so in its row and beside its command.
    forced = tmp_path / "bench-forced"
    forced.mkdir()
    build = r["machine"]["zoo_build"]
    gemm = dict(build["gemm"], onednn_isa="avx2", vector_isa="avx2", cpu_vector_isa="avx512_bf16")
    (forced / "f.json").write_text(json.dumps(dict(
        r, machine=dict(r["machine"], zoo_build=dict(build, gemm=gemm)),
        gemm=dict(r["gemm"], openblas_core="Haswell"))))
    rows = cards.card_data(preset_info("tiny-gpt2"), cards.read_benchmarks(forced))["benchmarks"]
    assert rows[0]["forced_class"] == "oneDNN ISA avx2, OpenBLAS Haswell"
    capsys.readouterr()
    assert main(["card", "tiny-gpt2", "--benchmarks", str(forced)]) == 0
    md = capsys.readouterr().out
    assert "(../benchmarks/f.json) (forced class) |" in md
    assert "forced to a lower CPU class: oneDNN ISA avx2, OpenBLAS Haswell" in md

    # The whole set: the index counts the runs; regenerating is byte-identical; --check sees new results.
    out = tmp_path / "cards"
    assert main(["cards", "--out", str(out), "--benchmarks", str(bench)]) == 0
    assert "| 2 runs |" in (out / "README.md").read_text()
    first = {f.name: f.read_bytes() for f in out.iterdir()}
    assert main(["cards", "--check", "--out", str(out), "--benchmarks", str(bench)]) == 0
    assert {f.name: f.read_bytes() for f in out.iterdir()} == first
    shutil.copy(run, bench / "z-again.json")
    assert main(["cards", "--check", "--out", str(out), "--benchmarks", str(bench)]) == 1


def test_broken_benchmark_file(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["card", "gpt2", "--benchmarks", str(tmp_path)]) == 1
    assert "bad.json: not readable JSON" in capsys.readouterr().err


def test_a_card_names_each_block_by_what_it_is():
    from zoo.arch.presets import Preset

    base = PRESETS[0].config.model_dump()
    for norm, mlp, words in (("rmsnorm", "relu2", ("RMSNorm (`rmsnorm`)", "squared ReLU (`relu2`)")),
                             ("layernorm", "swiglu", ("LayerNorm (`layernorm`)", "SwiGLU (`swiglu`)"))):
        p = Preset("x", ModelConfig(**dict(base, norm=norm, mlp=mlp)), (), "MIT")
        md = cards.card_markdown(cards.card_data(p, []))
        assert all(w in md for w in words), (norm, mlp)


def test_cards_show_each_way_to_finetune():
    from zoo.arch.memory import finetune_ways

    zoo.set_threads(cards.CARD_THREADS)  # the count the figures assume
    for p in PRESETS:
        d = json.loads((CARDS / f"{p.name}.json").read_text())
        b, t = cards.ways_point(p.config)
        expected = finetune_ways(p.config, b, t, cards.WAYS_LORA_R, cards.WAYS_LORA_PRECISION)
        assert [(w["way"], w["total"], w["total_checkpointing"]) for w in d["finetune_ways"]] == expected, p.name
    md = (CARDS / "qwen3-8b.md").read_text()
    for way in ("full finetune (fp32, AdamW)", "full finetune (bf16 products)", "LoRA r=16, bf16 base",
                "LoRA r=16, int8 base", "LoRA r=16, nf4 base"):
        assert f"| {way} |" in md, way


def test_cards_describe_the_variants():
    words = {
        "qwen2.5-7b": ("attention q/k/v yes, attention output no",),
        "qwen3-8b": ("| q/k norm | the model's norm over each head's q and k",),
        "olmo-2-1b": ("on each branch's output before its residual add (no pre-norm)", "all of q and all of k at once"),
        "mistral-7b-v0.1": ("| attention window | each query sees the 4,096 keys ending at itself, on every layer",),
        "smollm3-3b": ("| NoPE layers | no rotary positions on layers 3, 7, 11, 15, 19, 23, 27, 31, 35 |",),
        "granite-3.3-8b": ("token embeddings x 12", "each branch's output x 0.22", "softmax scale 0.0078125",
                           "logits x 0.0625 (divided by 16)"),
    }
    for name, texts in words.items():
        md = (CARDS / f"{name}.md").read_text()
        assert all(t in md for t in texts), name
    assert "| q/k norm" not in (CARDS / "llama-3.2-1b.md").read_text()
    from zoo.arch.presets import Preset

    base = preset_info("qwen3-1.7b").config.model_dump()
    p = Preset("x", ModelConfig(**dict(base, norm="rmsnorm_1p", mlp="geglu", family="llama", qk_norm="none")), (), "MIT")
    md = cards.card_markdown(cards.card_data(p, []))
    assert "RMSNorm times (1 + w)" in md and "GeGLU (`geglu`)" in md


def test_cards_describe_the_issue_29_blocks():
    words = {
        "gemma-7b": ("RMSNorm times (1 + w)", "GeGLU (`geglu`)", "token embeddings x 55.42562584220407 (sqrt of d_model 3072)",
                     "head_dim 256", "Gemma Terms of Use"),
        "gemma-2-2b": ("| soft-caps | scores -> 50 tanh(scores / 50), before the mask; logits -> 30 tanh(logits / 30) |",
                       "on each branch's input and on its output before the residual add",
                       "the 4,096 keys ending at itself, on layers 0, 2, 4,", "token embeddings x 48 (sqrt of d_model 2304)"),
        "gemma-3-1b": ("theta 1e+06 on the full-attention layers; scaling: none; the sliding layers' own table: theta "
                       "10000, unscaled", "| q/k norm | the model's norm over each head's q and k"),
        "gemma-3-4b": ("scaling: linear: every frequency divided by 8", "The text model of these checkpoints",
                       "Gemma3ForConditionalGeneration"),
        "phi-3-mini-4k": ("the 2,047 keys ending at itself, on every layer", "microsoft/Phi-3-mini-4k-instruct", "MIT"),
        "pythia-160m": ("| layer | parallel residual (`parallel_two_norms`): x + attn(norm1 x) + mlp(norm2 x)",
                        "GELU, exact (`gelu_erf`)", "the first 16 of each head's 64 values rotated (rotary_dim 16)",
                        "attention yes, MLP yes", "its own matrix (untied)", "Apache-2.0"),
    }
    for name, texts in words.items():
        md = (CARDS / f"{name}.md").read_text()
        assert all(t in md for t in texts), (name, [t for t in texts if t not in md])
    for name in ("llama-3.2-1b", "qwen3-8b", "gpt2"):  # the sequential, fully rotated, uncapped models: no such rows
        md = (CARDS / f"{name}.md").read_text()
        assert "| layer |" not in md and "| soft-caps |" not in md and "partial:" not in md, name
    index = (CARDS / "README.md").read_text()
    assert "soft-capped" in index and "rotary 16/64, parallel residual" in index and "local RoPE table" in index
    d = json.loads((CARDS / "pythia-1b.json").read_text())["blocks"]
    assert (d["layer"], d["rope"]["rotary_dim"], d["attention"]["head_dim"]) == ("parallel_two_norms", 64, 256)
    d = json.loads((CARDS / "gemma-2-9b.json").read_text())["blocks"]
    assert d["softcaps"] == {"attention": 50.0, "logits": 30.0}
