"""The presets of the Llama variants (issue 28): each one's config.json round-trips through its
family's writer and reader, its class can hold it, and its parameter count is the total its
publisher states (each figure below says where it is stated, and to how many digits)."""

import json

import pytest

from zoo import families
from zoo.arch.layout import num_parameters
from zoo.arch.presets import PRESETS, preset, preset_info
from zoo.io.hf_config import config_from_hf, config_to_hf, hf_incompatibility

# name -> (total, non-embedding total or None, where the figures are published). Totals in
# billions, within one unit of the last digit given (publishers round some figures and truncate
# others: Qwen2.5-7B's card says 7.61B of 7,615,616,512); "non-embedding" as Qwen's cards count it
# (the token embedding and an untied head left out).
PUBLISHED = {
    # Qwen's model cards (huggingface.co/Qwen/<name>, "Number of Parameters" and "(Non-Embedding)").
    "qwen2.5-0.5b": ("0.49", "0.36", "Qwen/Qwen2.5-0.5B model card"),
    "qwen2.5-1.5b": ("1.54", "1.31", "Qwen/Qwen2.5-1.5B-Instruct model card"),
    "qwen2.5-3b": ("3.09", "2.77", "Qwen/Qwen2.5-3B model card"),
    "qwen2.5-7b": ("7.61", "6.53", "Qwen/Qwen2.5-7B model card"),
    "qwen3-0.6b": ("0.6", "0.44", "Qwen/Qwen3-0.6B model card"),
    "qwen3-1.7b": ("1.7", "1.4", "Qwen/Qwen3-1.7B model card"),
    "qwen3-4b": ("4.0", "3.6", "Qwen/Qwen3-4B model card"),
    "qwen3-8b": ("8.2", "6.95", "Qwen/Qwen3-8B model card"),
    # The "Model size" Hugging Face's page shows from the safetensors headers (untied heads counted
    # once, as stored; these models store no second copy of a tied head).
    "mistral-7b-v0.1": ("7.24", None, "huggingface.co/mistralai/Mistral-7B-v0.1, model size"),
    "mistral-7b-v0.3": ("7.25", None, "huggingface.co/mistralai/Mistral-7B-v0.3, model size"),
    "olmo-2-1b": ("1.48", None, "huggingface.co/allenai/OLMo-2-0425-1B, model size"),
    "olmo-2-7b": ("7.30", None, "huggingface.co/allenai/OLMo-2-1124-7B, model size (7.3B)"),
    "smollm3-3b": ("3.08", None, "huggingface.co/HuggingFaceTB/SmolLM3-3B, model size"),
    "granite-3.3-2b": ("2.53", None, "huggingface.co/ibm-granite/granite-3.3-2b-instruct, model size"),
    "granite-3.3-8b": ("8.17", None, "huggingface.co/ibm-granite/granite-3.3-8b-instruct, model size"),
}

# Exact counts zoo's layout gives, pinned so a change to a preset or to the layout shows here.
EXACT = {
    "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512, "qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096, "qwen3-8b": 8_190_735_360, "mistral-7b-v0.1": 7_241_732_096,
    "mistral-7b-v0.3": 7_248_023_552, "olmo-2-1b": 1_484_916_736, "olmo-2-7b": 7_298_617_344,
    "smollm3-3b": 3_075_098_624, "granite-3.3-2b": 2_533_539_840, "granite-3.3-8b": 8_170_864_640,
}

VARIANT_FAMILIES = ("qwen2", "qwen3", "mistral", "olmo2", "smollm3", "granite")
VARIANT_PRESETS = [p.name for p in PRESETS if p.config.family in VARIANT_FAMILIES]

def _round_trip_params():
    return [pytest.param(name, id=name) for name in VARIANT_PRESETS]


def _close(count: int, published: str) -> bool:
    """count (parameters) is the published figure (billions) to within a unit of its last digit."""
    digits = len(published.split(".")[1])
    return abs(count / 1e9 - float(published)) < 10 ** -digits


def test_every_family_has_presets_and_every_variant_preset_is_listed():
    assert {preset(n).family for n in VARIANT_PRESETS} == set(VARIANT_FAMILIES)
    assert sorted(VARIANT_PRESETS) == sorted(PUBLISHED) == sorted(EXACT)


@pytest.mark.parametrize("name", _round_trip_params())
def test_config_round_trips_through_its_family(name):
    cfg = preset(name)
    family = families.get(cfg.family)
    assert hf_incompatibility(cfg) is None
    written = family.write_config(cfg)
    assert written["architectures"] == [family.saves_as] and written["model_type"] in family.model_types
    hf = json.loads(json.dumps(config_to_hf(cfg, dtype="bfloat16", bos_token_id=1, eos_token_id=2)))
    assert config_from_hf(hf, f"{name}/config.json") == cfg


@pytest.mark.parametrize("name", VARIANT_PRESETS)
def test_parameter_count_is_the_published_one(name):
    n = num_parameters(preset(name))
    assert n == EXACT[name]
    total, non_embedding, source = PUBLISHED[name]
    assert _close(n, total), f"{name}: {n:,} is not the {total}B of {source}"
    if non_embedding is not None:
        cfg = preset(name)
        embeddings = cfg.vocab_size * cfg.d_model * (1 if cfg.tied_embeddings else 2)
        assert _close(n - embeddings, non_embedding), f"{name}: {n - embeddings:,} non-embedding, {source}"


@pytest.mark.parametrize("name", VARIANT_PRESETS)
def test_preset_names_its_checkpoints_and_licence(name):
    p = preset_info(name)
    assert p.hf_checkpoints and all("/" in c for c in p.hf_checkpoints)
    assert p.licence


def test_the_variant_options_each_preset_sets():
    assert preset("qwen2.5-7b").attention_bias and not preset("qwen2.5-7b").attention_out_bias
    assert preset("qwen3-8b").qk_norm == "head" and preset("qwen3-8b").head_dim == 128
    assert preset("mistral-7b-v0.1").sliding_window == 4096 and preset("mistral-7b-v0.1").sliding_layers is None
    assert preset("mistral-7b-v0.3").sliding_window is None
    olmo = preset("olmo-2-7b")
    assert (olmo.qk_norm, olmo.branch_norms, olmo.vocab_size) == ("projection", "post", 100352)
    assert preset("smollm3-3b").nope_layers == tuple(i for i in range(36) if (i + 1) % 4 == 0)
    granite = preset("granite-3.3-8b")
    assert (granite.embedding_scale, granite.residual_scale, granite.attention_scale, granite.logit_scale) == (
        12.0, 0.22, 1 / 128, 1 / 16)
    hf = config_to_hf(granite)
    assert (hf["embedding_multiplier"], hf["residual_multiplier"], hf["attention_multiplier"],
            hf["logits_scaling"]) == (12.0, 0.22, 0.0078125, 16.0)
    assert config_to_hf(preset("smollm3-3b"))["no_rope_layers"] == [0 if (i + 1) % 4 == 0 else 1 for i in range(36)]


def test_zoo_inspect_qwen3_8b_shows_each_way_to_finetune(capsys, monkeypatch):
    from zoo.cli import main

    monkeypatch.setenv("ZOO_MEMORY_AVAILABLE", str(24 * 2**30))
    assert main(["inspect", "qwen3-8b"]) == 0
    out = capsys.readouterr().out
    for text in ("preset qwen3-8b", "36 layers, d_model 4096, 32 heads, 8 kv heads, head_dim 128, d_ff 12288",
                 "variant        q/k rmsnorm over each head", "8,190,735,360", "full finetune (fp32, AdamW)",
                 "full finetune (bf16 products)", "LoRA r=16, bf16 base", "LoRA r=16, int8 base",
                 "LoRA r=16, nf4 base", "generation, bf16 weights", "does not fit", "  fits"):
        assert text in out, text


@pytest.mark.parametrize("name, plain", [
    ("qwen3-8b", dict(qk_norm="none")),
    ("olmo-2-1b", dict(qk_norm="none", branch_norms="pre")),
    ("granite-3.3-2b", dict(embedding_scale=1.0, residual_scale=1.0, attention_scale=None, logit_scale=1.0)),
])
def test_memory_counts_the_variants_tensors_and_activations(name, plain):
    """The estimate `zoo inspect` and the cards print: the q/k and branch-output norms' weights are
    parameters (with their gradients and moments), and the activations they keep are planned."""
    from zoo.arch.config import ModelConfig
    from zoo.arch.memory import finetune_memory_bytes

    cfg = preset(name)
    llama = ModelConfig(**{**cfg.model_dump(), **plain})
    extra = num_parameters(cfg) - num_parameters(llama)
    # per layer: Qwen3's q and k norms of head_dim; OLMo-2's of the whole projections (16 x 128 each),
    # its two output norms in place of the two input norms; Granite's scalars are no tensors
    norms = {"qwen3-8b": 2 * 128, "olmo-2-1b": 2 * 2048, "granite-3.3-2b": 0}[name]
    assert extra == cfg.n_layer * norms
    m, m_llama = finetune_memory_bytes(cfg, 1, 256), finetune_memory_bytes(llama, 1, 256)
    assert m.parameters - m_llama.parameters == 4 * extra and m.optimizer - m_llama.optimizer == 8 * extra
    assert m.activations > m_llama.activations if norms else m.activations >= m_llama.activations
