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


# --- The presets of issue 29's families: Gemma, Gemma 2, Gemma 3 (text), Phi-3, GPT-NeoX/Pythia ---

# name -> (total, non-embedding total, where they are published). An int is an exact count the
# publisher states; a string is in billions, to within one unit of its last digit; None: not
# published for this shape. Non-embedding as the Gemma and Pythia reports count it: the token
# embedding (and Pythia's untied embed_out) left out.
PUBLISHED_29 = {
    # Gemma: Open Models Based on Gemini Research and Technology (2024), Table 2: embedding and
    # non-embedding parameters; Hugging Face's "Model size" of the safetensors for the totals.
    "gemma-2b": ("2.51", 1_981_884_416, "Gemma report, Table 2; huggingface.co/google/gemma-2b, model size"),
    "gemma-7b": ("8.54", 7_751_248_896, "Gemma report, Table 2; huggingface.co/google/gemma-7b, model size"),
    # Gemma 2: Improving Open Language Models at a Practical Size (2024), Table 1 (non-embedding).
    "gemma-2-2b": ("2.61", 2_024_517_888, "Gemma 2 report, Table 1; huggingface.co/google/gemma-2-2b, model size"),
    "gemma-2-9b": ("9.24", 8_324_201_984, "Gemma 2 report, Table 1; huggingface.co/google/gemma-2-9b, model size"),
    # Gemma 3 Technical Report (2025), Table 1: 302M embedding and 698M non-embedding parameters in
    # the 1B; 3,209M non-embedding in the 4B, whose published total (4.3B) counts its 417M vision
    # encoder, which this text-only shape does not hold.
    "gemma-3-1b": ("1.00", "0.698", "Gemma 3 report, Table 1 (302M + 698M)"),
    "gemma-3-4b": (None, "3.209", "Gemma 3 report, Table 1 (non-embedding; the total counts the vision encoder)"),
    # Phi-3 Technical Report (2024): "phi-3-mini, a 3.8 billion parameter language model";
    # Hugging Face's model size of microsoft/Phi-3-mini-4k-instruct: 3.82B.
    "phi-3-mini-4k": ("3.82", None, "huggingface.co/microsoft/Phi-3-mini-4k-instruct, model size"),
    # The Pythia model cards (huggingface.co/EleutherAI/pythia-410m-deduped, "Naming convention and
    # parameter count"): exact total and non-embedding counts.
    "pythia-70m": (70_426_624, 18_915_328, "Pythia model card, naming convention and parameter count"),
    "pythia-160m": (162_322_944, 85_056_000, "Pythia model card, naming convention and parameter count"),
    "pythia-410m": (405_334_016, 302_311_424, "Pythia model card, naming convention and parameter count"),
    "pythia-1b": (1_011_781_632, 805_736_448, "Pythia model card, naming convention and parameter count"),
}

EXACT_29 = {
    "gemma-2b": 2_506_172_416, "gemma-7b": 8_537_680_896, "gemma-2-2b": 2_614_341_888, "gemma-2-9b": 9_241_705_984,
    "gemma-3-1b": 999_885_952, "gemma-3-4b": 3_880_263_168, "phi-3-mini-4k": 3_821_079_552,
    "pythia-70m": 70_426_624, "pythia-160m": 162_322_944, "pythia-410m": 405_334_016, "pythia-1b": 1_011_781_632,
}

FAMILIES_29 = ("gemma", "gemma2", "gemma3", "phi3", "gpt_neox")
PRESETS_29 = [p.name for p in PRESETS if p.config.family in FAMILIES_29]


def _is_published(count: int, published) -> bool:
    return count == published if isinstance(published, int) else _close(count, published)


def test_every_issue_29_family_has_presets_and_each_is_listed():
    assert {preset(n).family for n in PRESETS_29} == set(FAMILIES_29)
    assert sorted(PRESETS_29) == sorted(PUBLISHED_29) == sorted(EXACT_29)


@pytest.mark.parametrize("name", PRESETS_29)
def test_issue_29_config_round_trips_through_its_family(name):
    test_config_round_trips_through_its_family(name)


@pytest.mark.parametrize("name", PRESETS_29)
def test_issue_29_parameter_count_is_the_published_one(name):
    cfg = preset(name)
    n = num_parameters(cfg)
    assert n == EXACT_29[name]
    total, non_embedding, source = PUBLISHED_29[name]
    if total is not None:
        assert _is_published(n, total), f"{name}: {n:,} is not the {total} of {source}"
    if non_embedding is not None:
        embeddings = cfg.vocab_size * cfg.d_model * (1 if cfg.tied_embeddings else 2)
        assert _is_published(n - embeddings, non_embedding), f"{name}: {n - embeddings:,} non-embedding, {source}"


@pytest.mark.parametrize("name", PRESETS_29)
def test_issue_29_preset_names_its_checkpoints_and_licence(name):
    p = preset_info(name)
    assert p.hf_checkpoints and all("/" in c for c in p.hf_checkpoints)
    expected = {"gemma": "Gemma Terms of Use", "gemma2": "Gemma Terms of Use", "gemma3": "Gemma Terms of Use",
                "phi3": "MIT", "gpt_neox": "Apache-2.0"}[p.config.family]
    assert p.licence.startswith(expected)


def test_the_issue_29_options_each_preset_sets():
    gemma = preset("gemma-7b")
    assert (gemma.norm, gemma.mlp, gemma.head_dim, gemma.vocab_size, gemma.tied_embeddings) == (
        "rmsnorm_1p", "geglu", 256, 256000, True)
    assert gemma.embedding_scale == 3072 ** 0.5 and gemma.n_head * gemma.head_dim == 4096 != gemma.d_model
    assert preset("gemma-2b").n_kv_head == 1
    g2 = preset("gemma-2-9b")
    assert (g2.branch_norms, g2.attention_scale, g2.attention_softcap, g2.logit_softcap, g2.sliding_window) == (
        "both", 256 ** -0.5, 50.0, 30.0, 4096)
    assert g2.sliding_layers == tuple(range(0, 42, 2))
    hf = config_to_hf(g2)
    assert (hf["query_pre_attn_scalar"], hf["attn_logit_softcapping"], hf["final_logit_softcapping"]) == (256, 50.0, 30.0)
    assert hf["layer_types"][:2] == ["sliding_attention", "full_attention"]
    g3 = preset("gemma-3-1b")
    assert (g3.qk_norm, g3.sliding_window, g3.rope_theta, g3.sliding_rope_theta, g3.rope_scaling, g3.vocab_size) == (
        "head", 512, 1e6, 1e4, None, 262144)
    assert [i for i in range(26) if i not in g3.sliding_layers] == [5, 11, 17, 23]
    g34 = preset("gemma-3-4b")
    assert (g34.rope_scaling.rope_type, g34.rope_scaling.factor, g34.sliding_window, g34.vocab_size) == (
        "linear", 8.0, 1024, 262208)
    assert preset_info("gemma-3-4b").note  # the checkpoints are multimodal: the card says so
    hf = config_to_hf(g34)["rope_parameters"]
    assert hf["full_attention"]["rope_type"] == "linear" and hf["full_attention"]["factor"] == 8.0
    assert hf["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    phi = preset("phi-3-mini-4k")
    assert (phi.sliding_window, phi.sliding_layers, phi.rotary_dim, phi.vocab_size, phi.tied_embeddings) == (
        2047, None, None, 32064, False)
    assert config_to_hf(phi)["sliding_window"] == 2047
    for name, rotary in (("pythia-70m", 16), ("pythia-160m", 16), ("pythia-410m", 16), ("pythia-1b", 64)):
        p = preset(name)
        assert (p.layer, p.mlp, p.norm, p.rotary_dim, p.vocab_size, p.tied_embeddings) == (
            "parallel_two_norms", "gelu_erf", "layernorm", rotary, 50304, False), name
        hf = config_to_hf(p)
        assert (hf["rotary_pct"], hf["use_parallel_residual"], hf["hidden_act"]) == (0.25, True, "gelu"), name


def test_phi_3_5_mini_is_refused_for_its_longrope():
    """Phi-3.5-mini-instruct's config.json (its shape is Phi-3-mini-4k's, its context 131,072 by
    "longrope" scaling): no preset, and zoo names the key it refuses."""
    from zoo.core.errors import CheckpointError

    hf = {**config_to_hf(preset("phi-3-mini-4k")), "max_position_embeddings": 131072,
          "original_max_position_embeddings": 4096, "rope_parameters": None,
          "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48}}
    with pytest.raises(CheckpointError, match="rope_scaling"):
        config_from_hf(hf, "Phi-3.5-mini-instruct/config.json")
    assert not [p for p in PRESETS if "3.5" in p.name and p.config.family == "phi3"]


@pytest.mark.parametrize("name, texts", [
    ("gemma-2-2b", ("preset gemma-2-2b", "26 layers, d_model 2304, 8 heads, 4 kv heads, head_dim 256, d_ff 9216",
                    "rmsnorm_1p, geglu", "norms on the branch inputs and outputs",
                    "window of 4096 keys on layers 0, 2, 4", "embeddings x 48", "2,614,341,888")),
    ("pythia-160m", ("preset pythia-160m", "12 layers, d_model 768, 12 heads, head_dim 64, d_ff 3072",
                     "layernorm, gelu_erf", "untied embeddings", "162,322,944")),
])
def test_zoo_inspect_issue_29_presets_show_each_way_to_finetune(name, texts, capsys, monkeypatch):
    from zoo.cli import main

    monkeypatch.setenv("ZOO_MEMORY_AVAILABLE", str(8 * 2**30))
    assert main(["inspect", name]) == 0
    out = capsys.readouterr().out
    for text in (*texts, "full finetune (fp32, AdamW)", "full finetune (bf16 products)", "LoRA r=16, bf16 base",
                 "LoRA r=16, int8 base", "LoRA r=16, nf4 base", "generation, bf16 weights", "  fits"):
        assert text in out, text


@pytest.mark.parametrize("name, plain, norms", [
    # per layer: Gemma 2's two norms on the branch outputs (of d_model each)
    ("gemma-2-2b", dict(branch_norms="pre", attention_softcap=None, logit_softcap=None), 2 * 2304),
    # Gemma 3's q and k norms of head_dim and its two output norms
    ("gemma-3-1b", dict(branch_norms="pre", qk_norm="none"), 2 * 256 + 2 * 1152),
    # Pythia: the parallel layer keeps both norms, partial rotary has no tensors
    ("pythia-160m", dict(layer="sequential", rotary_dim=None), 0),
])
def test_memory_counts_the_issue_29_tensors_and_activations(name, plain, norms):
    from zoo.arch.config import ModelConfig
    from zoo.arch.memory import finetune_memory_bytes

    cfg = preset(name)
    simpler = ModelConfig(**{**cfg.model_dump(), **plain})
    extra = num_parameters(cfg) - num_parameters(simpler)
    assert extra == cfg.n_layer * norms
    m, m_simpler = finetune_memory_bytes(cfg, 1, 256), finetune_memory_bytes(simpler, 1, 256)
    assert m.parameters - m_simpler.parameters == 4 * extra and m.optimizer - m_simpler.optimizer == 8 * extra
    if cfg.layer == "parallel_two_norms":
        # both branches read the layer's input: no residual between them is kept, one (T, d_model)
        # float32 row block per layer fewer than the sequential layer's
        assert m_simpler.activations - m.activations == cfg.n_layer * 256 * cfg.d_model * 4
    else:
        assert m.activations > m_simpler.activations


def test_transformers_builds_each_issue_29_preset_with_the_same_count():
    """transformers reads the config.json zoo writes for each preset as its class and builds (on
    the meta device: no memory) a model with zoo's parameter count."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    for name in PRESETS_29:
        cfg = preset(name)
        hf = config_to_hf(cfg)
        config = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        assert type(model).__name__ == families.get(cfg.family).saves_as, name
        assert sum(t.numel() for t in model.parameters()) == num_parameters(cfg), name
        if cfg.sliding_layers is not None:
            assert [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"] == list(cfg.sliding_layers)


# The keys of each published config.json that set the shape (facts from the files on the Hub, with
# the transformers version that wrote them), as zoo reads them. The Gemma 2 and Gemma 3 files were
# written before transformers wrote `layer_types`: transformers derives it (Gemma 2: the even layers
# slide; Gemma 3: `sliding_window_pattern`, 6); zoo's gemma2/gemma3 readers put the window on every
# layer (and Gemma 3's local RoPE table with it). Gemma 1's files say hidden_act "gelu", which
# transformers reads as the tanh GELU and zoo's gemma reader refuses (llama.read_config reads the key
# with Llama's activations). Reported; zoo/families/ is not this change's to edit.
_GEMMA = {"attention_bias": False, "head_dim": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "vocab_size": 256000,
          "max_position_embeddings": 8192}
PUBLISHED_CONFIGS = {
    "gemma-2b": {**_GEMMA, "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_act": "gelu",
                 "hidden_size": 2048, "intermediate_size": 16384, "num_attention_heads": 8, "num_hidden_layers": 18,
                 "num_key_value_heads": 1},
    "gemma-2-2b": {**_GEMMA, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "hidden_act": "gelu_pytorch_tanh",
                   "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "intermediate_size": 9216,
                   "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
                   "query_pre_attn_scalar": 256, "sliding_window": 4096, "transformers_version": "4.42.4"},
    "gemma-3-1b": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
                   "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
                   "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
                   "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26,
                   "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
                   "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
                   "sliding_window_pattern": 6, "vocab_size": 262144, "transformers_version": "4.50.0.dev0"},
    # the 4B's text_config: the keys it sets; the others are Gemma3TextConfig's defaults
    "gemma-3-4b": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                   "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                   "sliding_window": 1024},
    "phi-3-mini-4k": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False,
                      "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
                      "max_position_embeddings": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
                      "num_key_value_heads": 32, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
                      "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047,
                      "tie_word_embeddings": False, "vocab_size": 32064},
    "pythia-70m": {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_act": "gelu",
                   "hidden_size": 512, "intermediate_size": 2048, "layer_norm_eps": 1e-05,
                   "max_position_embeddings": 2048, "num_attention_heads": 8, "num_hidden_layers": 6,
                   "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
                   "use_parallel_residual": True, "vocab_size": 50304},
}
@pytest.mark.parametrize("name", list(PUBLISHED_CONFIGS))
def test_the_published_config_json_reads_as_the_preset(name):
    assert config_from_hf(PUBLISHED_CONFIGS[name], f"{name}/config.json") == preset(name)
