"""The PyTorch reference model (zoo/tools/torch_reference.py) that `zoo bench` times and the
parity tests compare with: it implements every block a config can choose, refuses by name
what it does not implement instead of standing in another block, never imports zoo, and the
bench's PyTorch worker computes zoo's loss from zoo's init (relu2 included)."""

import json
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
from helpers import RELU2_TINY

import zoo
from zoo import ModelConfig
from zoo.core import blocks
from zoo.tools import bench

torch = pytest.importorskip("torch")
from zoo.tools import torch_reference as tr  # noqa: E402
from zoo.tools.torch_reference import Reference  # noqa: E402

TOOLS = Path(tr.__file__).parent


def tokens_and_targets(cfg, B=2, T=12, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))


def allowed_values(field: str) -> set:
    """What a config may name: the native block registry lists the norms, MLP activations and
    layer arrangements (zoo.core.blocks), the config's Literal the positions."""
    if field == "norm":
        return set(blocks.norms())
    if field == "layer":
        return set(blocks.layers())
    if field == "mlp":
        return set(blocks.activations())
    return set(typing.get_args(ModelConfig.model_fields[field].annotation))


def test_every_block_a_config_allows_is_implemented():
    for field, _, table in tr.BLOCK_TABLES:
        allowed = allowed_values(field)
        assert allowed and allowed <= set(table), f"{field}: the reference lacks {allowed - set(table)}"
    assert set(ModelConfig.model_fields) <= tr.CONFIG_FIELDS


def test_its_roles_are_the_executors():
    roles = zoo.build_info()["roles"]
    assert list(tr.GLOBAL_ROLES) == roles["model"]
    assert list(tr.LAYER_ROLES) == roles["layer"]


@pytest.mark.parametrize("field,value", [("norm", "groupnorm"), ("mlp", "no_such_mlp"), ("positions", "alibi")])
def test_an_unknown_block_is_refused_by_name(field, value):
    cfg = RELU2_TINY.model_dump()
    layout = tr.zoo_layout(cfg)
    with pytest.raises(NotImplementedError, match=rf"torch reference: {field}='{value}' is not implemented here"):
        tr.Decoder(dict(cfg, **{field: value}), layout)
    with pytest.raises(NotImplementedError, match=rf"{field}='{value}'"):
        Reference(dict(cfg, **{field: value}), {}, layout=layout)


def test_an_unknown_config_field_is_refused_by_name():
    cfg = RELU2_TINY.model_dump()
    with pytest.raises(NotImplementedError, match="config field future_option=True is not implemented"):
        tr.Decoder(dict(cfg, future_option=True), tr.zoo_layout(cfg))


def test_relu2_is_relu_squared():
    h = torch.tensor([[-2.0, -0.5, 0.0, 0.5, 3.0]])
    assert tr.MLPS["relu2"](h).tolist() == [[0.0, 0.0, 0.0, 0.25, 9.0]]
    # Whole model: zoo's relu2 loss, and not the loss GELU would give on the same weights.
    model = zoo.Model(RELU2_TINY, seed=1)
    tokens, targets = tokens_and_targets(RELU2_TINY)
    loss = model.loss(tokens, targets)
    assert float(Reference(RELU2_TINY, model.parameters()).loss(tokens, targets).detach()) == pytest.approx(loss, abs=1e-5)
    as_gelu = ModelConfig(**dict(RELU2_TINY.model_dump(), mlp="gelu"))
    assert abs(float(Reference(as_gelu, model.parameters()).loss(tokens, targets).detach()) - loss) > 1e-4


def test_the_reference_imports_without_zoo():
    # How the bench's PyTorch worker finds it: by its folder on sys.path, not as zoo.tools.
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import torch_reference; "
            "loaded = [m for m in sys.modules if m == 'zoo' or m.startswith('zoo.')]; "
            "assert not loaded, loaded; print('ok')")
    run = subprocess.run([sys.executable, "-c", code, str(TOOLS)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def run_torch_worker(workdir: Path):
    return subprocess.run([sys.executable, str(TOOLS / "bench_torch.py"), "--workdir", str(workdir),
                           "--optimizer", "default", "--steps", "1", "--warmup", "0", "--threads", "1",
                           "--out", str(workdir / "torch.json")], capture_output=True, text=True)


def test_bench_torch_worker_computes_zoos_relu2_loss_from_zoos_init(tmp_path):
    B, T, seed = 2, 16, 3
    bench.write_workdir(tmp_path, RELU2_TINY, B, T, seed)
    run = run_torch_worker(tmp_path)
    assert run.returncode == 0, run.stderr
    first_loss = json.loads((tmp_path / "torch.json").read_text())["losses"][0]  # before any update
    data = np.fromfile(tmp_path / "tokens.bin", dtype=np.int32).reshape(B, T + 1)
    model = zoo.Model(RELU2_TINY, seed=seed)  # the bench's weights are this model's
    assert first_loss == pytest.approx(model.loss(data[:, :-1], data[:, 1:]), rel=1e-5)


def test_bench_torch_worker_refuses_an_unknown_block_in_one_line(tmp_path):
    bench.write_workdir(tmp_path, RELU2_TINY, 1, 8, 0)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["config"]["mlp"] = "no_such_mlp"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    run = run_torch_worker(tmp_path)
    assert run.returncode == 3 and "Traceback" not in run.stderr
    assert "mlp='no_such_mlp' is not implemented here" in run.stderr
