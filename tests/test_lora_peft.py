"""LoRA against PEFT on tiny random GPT-2 and Llama with an fp32 base: logits and adapter
gradients, adapters in PEFT's format both ways, `zoo merge` against merge_and_unload, and the
adapters zoo refuses (each error naming the file and the field or tensor)."""

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

from helpers import SHAKESPEARE, needs_shared  # noqa: E402
from hf_helpers import (  # noqa: E402
    hf_logits,
    load_hf_fp32,
    save_hf_as,
    tiny_gpt2,
    tiny_llama,
    tokens,
)

import zoo  # noqa: E402
from zoo.arch.lora import LoraConfig, adapter_layout, adapters, module_names  # noqa: E402
from zoo.cli import main  # noqa: E402
from zoo.core.errors import CheckpointError  # noqa: E402
from zoo.io.hf_config import read_config  # noqa: E402
from zoo.io.load import load_with_adapter  # noqa: E402
from zoo.io.peft import (  # noqa: E402
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    KEY_PREFIX,
    load_adapter,
    read_adapter,
    save_adapter,
)

FAMILIES = {
    "gpt2": dict(make=lambda: tiny_gpt2(), targets=["c_attn", "c_proj", "c_fc"]),
    "llama": dict(make=lambda: tiny_llama(n_kv_head=2),
                  targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
R, ALPHA = 4, 12


@pytest.fixture(scope="module", params=list(FAMILIES))
def base(request, tmp_path_factory):
    """(family, base checkpoint folder, the fp32 transformers model)."""
    folder = tmp_path_factory.mktemp(f"base-{request.param}")
    hf = FAMILIES[request.param]["make"]()
    save_hf_as(hf, folder)
    return request.param, folder, hf


def peft_model(folder: Path, targets, adapter: Path | None = None):
    """PEFT over a fresh fp32 copy of the base: a new LoRA with random A and B (init off, so that
    every factor counts), or the adapter saved in `adapter`."""
    hf = load_hf_fp32(folder)
    if adapter is not None:
        return peft.PeftModel.from_pretrained(hf, adapter).eval()
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(targets), task_type="CAUSAL_LM",
                          init_lora_weights=False)
    return peft.get_peft_model(hf, cfg).eval()


def peft_factors(pm) -> dict[str, torch.Tensor]:
    """PEFT's trainable factors by zoo's names (`<module>.lora_A.weight`)."""
    return {n.removeprefix(KEY_PREFIX).replace(".default.", "."): p for n, p in pm.named_parameters()
            if ".lora_" in n}


def peft_loss_and_grads(pm, tok, tgt) -> tuple[float, dict[str, np.ndarray]]:
    pm.zero_grad(set_to_none=True)
    logits = pm(torch.from_numpy(tok)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.from_numpy(tgt).reshape(-1), ignore_index=-100)
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy().copy() for n, p in peft_factors(pm).items()}


def saved_peft_adapter(folder: Path, targets, out: Path) -> Path:
    pm = peft_model(folder, targets)
    pm.save_pretrained(out)
    return out


# --- the module map ---------------------------------------------------------------------------


def test_adapted_modules_are_peft_modules(base):
    """zoo's modules and factor shapes for the family's targets are those PEFT creates."""
    family, folder, _ = base
    targets = FAMILIES[family]["targets"]
    cfg = read_config(folder)
    assert module_names(cfg) == targets
    pm = peft_model(folder, targets)
    ref = {n: tuple(p.shape) for n, p in peft_factors(pm).items()}
    ours = {spec.name: spec.shape for spec in adapter_layout(cfg, LoraConfig(r=R, targets=targets))[0]}
    assert ours == ref


# --- zoo merge --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_equals_merge_and_unload(base, tmp_path, dtype):
    family, folder, _ = base
    adapter = saved_peft_adapter(folder, FAMILIES[family]["targets"], tmp_path / "adapter")
    merged = peft_model(folder, [], adapter).merge_and_unload()
    ref = {k: v.detach() for k, v in merged.state_dict().items()}
    out = tmp_path / "merged"
    assert main(["merge", str(folder), str(adapter), str(out), "--dtype", dtype]) == 0
    written = safetensors_torch.load_file(out / "model.safetensors")
    assert {v.dtype for v in written.values()} == {getattr(torch, dtype)}
    for name, value in written.items():
        want = ref[name].to(getattr(torch, dtype))
        if dtype == "float32":
            assert torch.allclose(value, want, rtol=0, atol=1e-6), name
        else:  # zoo rounds its float32 sum to bf16 once; PEFT's float32 sum rounded: within one bf16 step
            assert torch.allclose(value.float(), want.float(), rtol=2 ** -8, atol=1e-6), name
    base_tensors = safetensors_torch.load_file(folder / "model.safetensors")
    n_adapted = len(adapters(read_config(folder), LoraConfig(targets=FAMILIES[family]["targets"])))
    assert sum(not torch.equal(written[k].float(), base_tensors[k].to(written[k].dtype).float())
               for k in written if k in base_tensors) == n_adapted
    # transformers loads it and computes what PEFT's merged model computes, in bf16 what that
    # model computes with its weights rounded to bf16 (some one bf16 step apart: see above).
    tok, _ = tokens()
    want = merged
    if dtype == "bfloat16":
        want = type(merged)(merged.config).eval()
        want.load_state_dict({k: v.bfloat16().float() for k, v in ref.items()})
    diff = np.abs(hf_logits(load_hf_fp32(out), tok) - hf_logits(want, tok)).max()
    assert diff <= 1e-4, diff  # measured: 0 (the rounding itself moves the logits by 2e-2 to 5e-2)
    assert json.loads((out / "config.json").read_text())["model_type"] == family


def test_bf16_merge_of_a_bf16_base_is_exact(base, tmp_path, monkeypatch):
    """A base stored in BF16, merged to bfloat16 (held in bf16, 2 bytes per parameter): every
    weight is PEFT's float32 merge of the same base rounded once to bf16, bit for bit."""
    import zoo.io.load

    held = []
    load = zoo.io.load.load_pretrained  # what zoo.io.load, the one loading layer, calls
    monkeypatch.setattr(zoo.io.load, "load_pretrained",
                        lambda path, *a, **kw: held.append(kw.get("base_dtype")) or load(path, *a, **kw))
    family, _, hf = base
    folder = tmp_path / "base-bf16"
    save_hf_as(hf, folder, dtype=torch.bfloat16)
    adapter = saved_peft_adapter(folder, FAMILIES[family]["targets"], tmp_path / "adapter")
    ref = peft_model(folder, [], adapter).merge_and_unload().state_dict()
    out = tmp_path / "merged"
    assert main(["merge", str(folder), str(adapter), str(out), "--dtype", "bfloat16"]) == 0
    written = safetensors_torch.load_file(out / "model.safetensors")
    for name, value in written.items():
        assert torch.equal(value, ref[name].to(torch.bfloat16)), name
    assert held == ["bf16"]


@needs_shared(SHAKESPEARE)
def test_merge_carries_the_tokenizer_over(tmp_path):
    """The base's tokenizer files reach the merged folder, as `zoo convert` carries them."""
    from hf_helpers import gpt2_checkpoint

    folder = gpt2_checkpoint(tmp_path / "base", SHAKESPEARE.read_text()[:50_000])
    adapter = saved_peft_adapter(folder, ["c_attn"], tmp_path / "adapter")
    assert main(["merge", str(folder), str(adapter), str(tmp_path / "merged")]) == 0
    for name in ("vocab.json", "merges.txt"):
        assert (tmp_path / "merged" / name).read_bytes() == (folder / name).read_bytes()
    assert zoo.Tokenizer.from_pretrained(tmp_path / "merged").encode("To be") == \
        zoo.Tokenizer.from_pretrained(folder).encode("To be")


def test_merge_error_is_one_line(base, tmp_path, capsys):
    family, folder, _ = base
    adapter = saved_peft_adapter(folder, FAMILIES[family]["targets"][:1], tmp_path / "adapter")
    _edit_config(adapter, use_dora=True)
    capsys.readouterr()  # transformers' loading progress
    assert main(["merge", str(folder), str(adapter), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zoo: error: ") and ADAPTER_CONFIG in err[0] and "use_dora" in err[0]
    assert not (tmp_path / "out" / "model.safetensors").exists()


# --- refused adapters ------------------------------------------------------------------------


def _edit_config(adapter: Path, **fields) -> None:
    path = adapter / ADAPTER_CONFIG
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg))


def _edit_tensors(adapter: Path, edit) -> None:
    path = adapter / ADAPTER_WEIGHTS
    tensors = safetensors_torch.load_file(path)
    edit(tensors)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})


def _first_key(tensors: dict) -> str:
    return sorted(tensors)[0]


REFUSED = {
    "peft_type": (dict(peft_type="IA3"), "IA3"),
    "use_dora": (dict(use_dora=True), "DoRA"),
    "use_rslora": (dict(use_rslora=True), "rsLoRA"),
    "rank_pattern": (dict(rank_pattern={"q_proj": 8}), "per-module ranks"),
    "alpha_pattern": (dict(alpha_pattern={"c_attn": 3}), "per-module alphas"),
    "bias": (dict(bias="lora_only"), "no biases"),
    "modules_to_save": (dict(modules_to_save=["lm_head"]), "extra modules"),
    "layers_to_transform": (dict(layers_to_transform=[0]), "some layers"),
    "r": (dict(r=0), "greater than 0"),
    "target_modules": (dict(target_modules=["lm_head"]), "lm_head"),
    "fan_in_fan_out": (None, "Conv1D"),
    "some_future_field": (dict(some_future_field={"x": 1}), "does not have"),
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_refused_config_fields_are_named(base, tmp_path, field):
    family, folder, _ = base
    adapter = saved_peft_adapter(folder, FAMILIES[family]["targets"], tmp_path / "adapter")
    edit, words = REFUSED[field]
    if edit is None:  # the orientation that does not match the family's modules
        edit = {"fan_in_fan_out": family != "gpt2"}
        words = "Linear" if family == "llama" else "Conv1D"
    _edit_config(adapter, **edit)
    with pytest.raises(CheckpointError) as e:
        read_adapter(adapter, read_config(folder))
    assert ADAPTER_CONFIG in str(e.value) and field in str(e.value) and words in str(e.value), str(e.value)


def test_some_layers_only_is_refused(base, tmp_path):
    """A regex that adapts one layer's modules: zoo adapts a module type in every layer."""
    family, folder, _ = base
    first = FAMILIES[family]["targets"][0]
    prefix = r"transformer\.h" if family == "gpt2" else r"model\.layers"
    pm = peft.get_peft_model(load_hf_fp32(folder), peft.LoraConfig(r=R, lora_alpha=ALPHA, task_type="CAUSAL_LM",
                                                                   target_modules=rf"{prefix}\.0\..*\.{first}"))
    pm.save_pretrained(tmp_path / "one-layer")
    with pytest.raises(CheckpointError, match="every layer") as e:
        read_adapter(tmp_path / "one-layer", read_config(folder))
    assert "target_modules" in str(e.value) and ".1." in str(e.value)


def test_regex_and_all_linear_targets_are_read(base, tmp_path):
    """PEFT's other ways of naming the targets select the same modules as the list."""
    family, folder, _ = base
    cfg = read_config(folder)
    for how in ("all-linear", r".*\.(" + "|".join(FAMILIES[family]["targets"]) + ")"):
        pm = peft.get_peft_model(load_hf_fp32(folder), peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=how,
                                                                       task_type="CAUSAL_LM"))
        pm.save_pretrained(tmp_path / "a")
        adapter = read_adapter(tmp_path / "a", cfg)
        assert adapter.lora.targets == FAMILIES[family]["targets"], how
        assert adapter.lora.scaling == ALPHA / R


REFUSED_TENSORS = {
    "missing": (lambda t: t.pop(_first_key(t)), "missing from the adapter"),
    "shape": (lambda t: t.update({_first_key(t): torch.zeros(R + 1, 3)}), "expected"),
    "extra": (lambda t: t.update({KEY_PREFIX + "lm_head.lora_A.weight": torch.zeros(R, 3)}), "no place"),
    "prefix": (lambda t: t.update({"lm_head.weight": torch.zeros(2)}), "base_model.model."),
    "nonfinite": (lambda t: t[_first_key(t)].view(-1).__setitem__(0, float("nan")), "non-finite"),
    "dtype": (lambda t: t.update({_first_key(t): t[_first_key(t)].to(torch.int32)}), "dtype I32"),
}


@pytest.mark.parametrize("case", list(REFUSED_TENSORS))
def test_refused_tensors_are_named(base, tmp_path, case):
    family, folder, _ = base
    adapter = saved_peft_adapter(folder, FAMILIES[family]["targets"], tmp_path / "adapter")
    first = _first_key(safetensors_torch.load_file(adapter / ADAPTER_WEIGHTS))
    edit, words = REFUSED_TENSORS[case]
    _edit_tensors(adapter, edit)
    with pytest.raises(CheckpointError) as e:
        read_adapter(adapter, read_config(folder))
    msg = str(e.value)
    assert ADAPTER_WEIGHTS in msg and words in msg, msg
    if case not in ("extra", "prefix"):
        assert first in msg, msg


def test_missing_files_are_named(base, tmp_path):
    family, folder, _ = base
    adapter = saved_peft_adapter(folder, FAMILIES[family]["targets"], tmp_path / "adapter")
    (adapter / ADAPTER_WEIGHTS).unlink()
    with pytest.raises(CheckpointError, match=ADAPTER_WEIGHTS):
        read_adapter(adapter, read_config(folder))
    with pytest.raises(CheckpointError, match="not an adapter folder"):
        read_adapter(tmp_path / "nowhere", read_config(folder))


# --- parity with PEFT (the native LoRA core) ---------------------------------------------------


def zoo_lora_model(folder: Path, targets):
    return zoo.Model.from_pretrained(folder, lora=LoraConfig(r=R, alpha=ALPHA, targets=list(targets)),
                                     base_dtype="fp32")


def copy_factors(pm, model) -> None:
    """PEFT's factors into zoo's adapters, by name (no file in between)."""
    params = model.parameters()
    ref = peft_factors(pm)
    assert set(params) == set(ref), set(params) ^ set(ref)
    for name, p in ref.items():
        params[name][...] = p.detach().numpy()


def test_logits_and_gradients_match_peft(base):
    family, folder, _ = base
    targets = FAMILIES[family]["targets"]
    pm = peft_model(folder, targets)
    model = zoo_lora_model(folder, targets)
    copy_factors(pm, model)
    tok, tgt = tokens()
    diff = np.abs(model.logits(tok) - hf_logits(pm, tok)).max()
    assert diff <= 1e-4, f"logits differ by {diff:.2e}"
    loss, grads = model.loss_and_grads(tok, tgt)
    ref_loss, ref_grads = peft_loss_and_grads(pm, tok, tgt)
    assert abs(loss - ref_loss) <= 1e-5, (loss, ref_loss)
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    for name, ref in ref_grads.items():
        err = np.abs(grads[name] - ref).max() / (np.abs(ref).max() + 1e-12)
        assert err <= 1e-3, f"{name}: gradient relative error {err:.2e}"


def test_zoo_saved_adapter_loads_in_peft(base, tmp_path):
    family, folder, _ = base
    targets = FAMILIES[family]["targets"]
    model = zoo_lora_model(folder, targets)
    rng = np.random.default_rng(3)
    for p in model.parameters().values():  # lora_B starts at zero: make every factor count
        p[...] = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(0.1)
    save_adapter(model, tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert saved["base_model_name_or_path"] == str(folder) and saved["fan_in_fan_out"] == (family == "gpt2")
    pm = peft_model(folder, [], tmp_path / "adapter")
    tok, _ = tokens()
    diff = np.abs(model.logits(tok) - hf_logits(pm, tok)).max()
    assert diff <= 1e-4, f"logits differ by {diff:.2e}"
    assert not any(p.requires_grad for p in pm.parameters())  # loaded for inference: nothing else changed


def test_peft_saved_adapter_loads_in_zoo(base, tmp_path):
    family, folder, _ = base
    targets = FAMILIES[family]["targets"]
    adapter = saved_peft_adapter(folder, targets, tmp_path / "adapter")
    model = load_with_adapter(folder, adapter, zoo.Model, base_dtype="fp32")
    assert model.lora.r == R and model.lora.scaling == ALPHA / R and set(model.lora.targets) == set(targets)
    tok, _ = tokens()
    diff = np.abs(model.logits(tok) - hf_logits(peft_model(folder, [], adapter), tok)).max()
    assert diff <= 1e-4, f"logits differ by {diff:.2e}"
    # An adapter whose rank or alpha differs from the model's LoRA is refused by name.
    _edit_config(adapter, lora_alpha=ALPHA * 2)
    with pytest.raises(CheckpointError, match="lora_alpha"):
        load_adapter(model, adapter)


@pytest.mark.parametrize("family,targets,read_back", [
    ("gpt2", ["c_attn", "mlp.c_proj"], ["c_attn", "mlp.c_proj"]),  # one of GPT-2's two c_proj
    ("llama", None, FAMILIES["llama"]["targets"]),  # every linear layer
])
def test_other_targets_round_trip(tmp_path, family, targets, read_back):
    """zoo's targets as PEFT reads them: its matching rule is zoo's, so they go into
    target_modules unchanged and come back as the same modules."""
    folder = tmp_path / "base"
    save_hf_as(FAMILIES[family]["make"](), folder)
    model = zoo.Model.from_pretrained(folder, lora=LoraConfig(r=R, alpha=ALPHA, targets=targets), base_dtype="fp32")
    rng = np.random.default_rng(4)
    for p in model.parameters().values():
        p[...] = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(0.1)
    save_adapter(model, tmp_path / "adapter")
    pm = peft_model(folder, [], tmp_path / "adapter")
    assert set(peft_factors(pm)) == set(model.parameters())
    tok, _ = tokens()
    diff = np.abs(model.logits(tok) - hf_logits(pm, tok)).max()
    assert diff <= 1e-4, f"logits differ by {diff:.2e}"
    assert read_adapter(tmp_path / "adapter", model.config).lora.targets == read_back


def test_bf16_factors_are_read_as_float32(base, tmp_path):
    """PEFT saves the factors in the model's dtype: bf16 ones are widened exactly."""
    family, folder, _ = base
    adapter = saved_peft_adapter(folder, FAMILIES[family]["targets"], tmp_path / "adapter")
    stored = safetensors_torch.load_file(adapter / ADAPTER_WEIGHTS)
    _edit_tensors(adapter, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    factors = read_adapter(adapter, read_config(folder)).factors
    assert set(factors) == {k.removeprefix(KEY_PREFIX) for k in stored}
    for key, value in stored.items():
        assert np.array_equal(factors[key.removeprefix(KEY_PREFIX)], value.to(torch.bfloat16).float().numpy()), key
