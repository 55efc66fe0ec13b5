"""Preference losses against TRL (test-only reference): for a tiny Llama and a tiny GPT-2 with
LoRA on every linear layer (fp32), the loss of one batch, the gradients of every adapter factor
and the logged rewards and log-probabilities equal TRL's DPOTrainer (sigmoid, conservative DPO
through "aot" over a batch of one pair, ipo), ORPOTrainer and CPOTrainer (simpo, with and
without label smoothing and the CPO term) within 1e-4 relative, for the same weights, token ids
and settings. And zoo tokenizes text records as TRL's DPOTrainer does."""

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import zoo  # noqa: E402
from helpers import LLAMA2_TOKENIZER, SHAKESPEARE, needs_shared  # noqa: E402
from zoo.arch.lora import LoraConfig  # noqa: E402
from zoo.io.peft import KEY_PREFIX, load_adapter  # noqa: E402
from zoo.train.preference import PairFile, PairSplits, tokenize_pairs  # noqa: E402
from zoo.train.preference_loss import PreferenceLoss  # noqa: E402
from zoo.train.preference_step import PreferenceObjective  # noqa: E402

WORDS = ("the a cat dog sat ran on under mat rug red blue big small quickly slowly and then it was not very "
         "green old new").split()
PAIRS = [
    {"prompt": "the cat sat on", "chosen": " the mat", "rejected": " a red rug and then ran"},
    {"prompt": "a dog ran", "chosen": " quickly under the big old mat", "rejected": " slowly"},
    {"prompt": "it was", "chosen": " not very green", "rejected": " a small blue dog"},
]
R, ALPHA = 4, 8
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]


def word_tokenizer(family: str):
    """A word-level tokenizer: Llama's adds BOS <s> and ends with </s>; GPT-2's one <|endoftext|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["<s>", "</s>", "<pad>"] if family == "llama" else ["<|endoftext|>", "<pad>"]
    vocab = {w: i for i, w in enumerate(specials + list(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if family == "llama":
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                    pad_token="<pad>"), len(vocab)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>", pad_token="<pad>"), len(vocab)


def base_model(family: str, vocab: int):
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                       tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=1)
        model = transformers.GPT2LMHeadModel(cfg)
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # every parameter random, so each gradient path counts
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def peft_config(family: str):
    return peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM",
                           target_modules=LLAMA_TARGETS if family == "llama" else GPT2_TARGETS)


# (method's name here, TRL trainer, its settings, zoo's loss)
CASES = {
    "dpo": ("dpo", dict(loss_type=["sigmoid"], beta=0.1), PreferenceLoss("dpo", beta=0.1)),
    "dpo-smoothed": ("dpo1", dict(loss_type=["aot"], beta=0.3, label_smoothing=0.2),
                     PreferenceLoss("dpo", beta=0.3, label_smoothing=0.2)),
    "ipo": ("dpo", dict(loss_type=["ipo"], beta=0.2), PreferenceLoss("ipo", beta=0.2)),
    "orpo": ("orpo", dict(beta=0.25), PreferenceLoss("orpo", beta=0.25)),
    "simpo": ("cpo", dict(loss_type="simpo", beta=2.0, simpo_gamma=0.4, cpo_alpha=0.0),
              PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.4)),
    "cpo-simpo": ("cpo", dict(loss_type="simpo", beta=1.5, simpo_gamma=0.3, cpo_alpha=0.7, label_smoothing=0.1),
                  PreferenceLoss("simpo", beta=1.5, simpo_gamma=0.3, cpo_alpha=0.7, label_smoothing=0.1)),
}


def trl_step(kind: str, settings: dict, model, tokenizer, pairs, out: Path):
    """TRL's loss, its adapter gradients (by zoo's names), its logged metrics and the token ids of
    its pairs (prompt, chosen, rejected) for one batch of all the pairs (in any order: the loss is
    a mean, the gradients a sum, the metrics means)."""
    common = dict(output_dir=str(out), per_device_train_batch_size=len(pairs), bf16=False, report_to=[],
                  use_cpu=True, seed=0, logging_steps=1, max_length=None, dataloader_num_workers=0)
    dataset = datasets.Dataset.from_list(pairs)
    if kind in ("dpo", "dpo1"):
        args = trl.DPOConfig(gradient_checkpointing=False, **common, **settings)
        trainer = trl.DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                 peft_config=peft_config(family_of(model)))
    elif kind == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        args = ORPOConfig(**{**common, "max_length": 64}, **settings)
        trainer = ORPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                              peft_config=peft_config(family_of(model)))
    else:
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(**{**common, "max_length": 64}, **settings)
        trainer = CPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                             peft_config=peft_config(family_of(model)))
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    if kind in ("dpo", "dpo1"):
        loss = trainer.compute_loss(trainer.model, batch)
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        rows = trainer.train_dataset
        ids = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows]
    else:
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch, train_eval="train")
        ids = []
        for r in trainer.train_dataset:
            n = r["chosen_labels"].count(-100)
            assert r["rejected_input_ids"][:n] == r["chosen_input_ids"][:n]
            ids.append((r["chosen_input_ids"][:n], r["chosen_input_ids"][n:], r["rejected_input_ids"][n:]))
    loss.backward()
    grads = {n.removeprefix(KEY_PREFIX).replace(".default.", "."): p.grad.numpy().copy()
             for n, p in trainer.model.named_parameters() if ".lora_" in n and ".default." in n}
    trainer.model.save_pretrained(out / "adapter")
    return float(loss.detach()), grads, metrics, ids


def family_of(model) -> str:
    return "llama" if isinstance(model, transformers.LlamaForCausalLM) else "gpt2"


def zoo_step(folder: Path, adapter: Path, family: str, loss: PreferenceLoss, ids):
    """zoo's loss, adapter gradients and metrics for the same pairs (token ids) in one batch."""
    targets = LLAMA_TARGETS if family == "llama" else GPT2_TARGETS
    model = zoo.Model.from_pretrained(folder, lora=LoraConfig(r=R, alpha=ALPHA, targets=targets), base_dtype="fp32")
    load_adapter(model, adapter)
    tokens, starts = [], [0]
    for part in (np.asarray(p, np.int64) for triple in ids for p in triple):
        tokens.append(part)
        starts.append(starts[-1] + len(part))
    pair_file = PairFile(np.concatenate(tokens), np.asarray(starts), Path("-"), "", [], [], False)
    splits = PairSplits(pair_file, len(ids), 64, 0.0, 1, 0)
    objective = PreferenceObjective(loss, splits)
    model.zero_grads()
    value, sums = objective.micro_step(model, np.arange(len(ids)), 0, len(ids), 1.0)
    return value, {n: g.copy() for n, g in model.gradients().items()}, objective.metrics(sums)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_one_step_equals_trl(family, case, tmp_path):
    kind, settings, loss = CASES[case]
    tokenizer, vocab = word_tokenizer(family)
    base = base_model(family, vocab)
    base.save_pretrained(tmp_path / "base")
    pairs = PAIRS[:1] if kind == "dpo1" else PAIRS  # "aot" is conservative DPO on a batch of one pair
    trl_loss, trl_grads, trl_metrics, ids = trl_step(kind, settings, base, tokenizer, pairs, tmp_path / "trl")
    value, grads, metrics = zoo_step(tmp_path / "base", tmp_path / "trl" / "adapter", family, loss, ids)

    assert value == pytest.approx(trl_loss, rel=1e-4, abs=1e-7)
    assert set(grads) == set(trl_grads)
    for name, g in grads.items():
        assert rel(g, trl_grads[name]) <= 1e-4, name
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected") + (("nll_loss", "log_odds_ratio", "log_odds_chosen") if kind == "orpo" else ()):
        assert metrics[name] == pytest.approx(float(trl_metrics[name]), rel=1e-4, abs=1e-6), name
    if case != "dpo-smoothed":  # a margin to learn from: the reference and the adapted model differ
        assert abs(metrics["rewards/margins"]) > 1e-3


@needs_shared(LLAMA2_TOKENIZER, SHAKESPEARE)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_text_records_tokenize_as_trl_dpo_does(family, tmp_path):
    """zoo's pairs from the JSONL records equal the prompt, chosen and rejected ids of TRL's
    DPOTrainer, EOS and (Llama) BOS included: Llama-2's SentencePiece tokenizer, and a byte-level
    BPE, each saved by zoo for transformers."""
    from hf_helpers import gpt2_checkpoint

    if family == "llama":
        ours = zoo.Tokenizer.from_pretrained(LLAMA2_TOKENIZER)
    else:
        gpt2_checkpoint(tmp_path / "gpt2", SHAKESPEARE.read_text(encoding="utf-8"))
        ours = zoo.Tokenizer.from_pretrained(tmp_path / "gpt2")
    ours.save(tmp_path / "tok")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    if theirs.pad_token is None:
        theirs.pad_token = theirs.eos_token
    records = [{"prompt": "To be, or not to be", "chosen": ": that is the question.", "rejected": " that I know."},
               {"prompt": "Now is the winter", "chosen": " of our discontent", "rejected": " of my content<|endoftext|>"},
               {"prompt": "A horse!", "chosen": " A horse! My kingdom for a horse!", "rejected": "No."}]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in records))
    pairs = tokenize_pairs([data], ours, tmp_path / "cache")
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, max_length=None)
    trainer = trl.DPOTrainer(model=base_model(family, len(theirs)), args=args,
                             train_dataset=datasets.Dataset.from_list(records), processing_class=theirs,
                             peft_config=peft_config(family))  # (else it loads a reference by the model's name)
    for i, row in enumerate(trainer.train_dataset):
        assert [list(map(int, a)) for a in pairs.pair(i)] == [row["prompt_ids"], row["chosen_ids"],
                                                             row["rejected_ids"]], i
