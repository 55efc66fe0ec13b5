"""The preference losses, as TRL defines them, over each pair's log-probabilities, with their
derivatives: a loss is a function of sums of target log-probabilities, so its gradient reaches
the model as a weight per answer token (zoo.Model.backward_logprobs).

For pair i, pc and pr are the summed log-probabilities of its chosen and rejected answers under
the model, nc and nr their token counts, rc and rr the reference model's sums, beta the
temperature, eps the label smoothing, s(x) the logistic function:

  dpo    h = (pc - rc) - (pr - rr);  loss = -(1 - eps) log s(beta h) - eps log s(-beta h)
         (TRL's DPOTrainer loss_type "sigmoid"; eps > 0 is conservative DPO, TRL's "sigmoid"
         before 1.0 and its "aot" over batches of one pair); rewards beta (pc - rc), beta (pr - rr)
  ipo    d = (pc - rc) / nc - (pr - rr) / nr;  loss = (d - 1 / (2 beta))^2  (DPOTrainer "ipo");
         rewards as dpo
  orpo   ac = pc / nc, ar = pr / nr;  o = (ac - ar) - (log(1 - e^ac) - log(1 - e^ar));
         loss = NLL - beta log s(o), the NLL the mean cross-entropy over the prompt and chosen answer
         tokens of the batch (TRL's ORPOTrainer); rewards beta ac, beta ar
  simpo  ac, ar as orpo;  z = beta (ac - ar) - gamma;
         loss = -(1 - eps) log s(z) - eps log s(-z) + alpha NLL, the NLL over the chosen answers
         only (TRL's CPOTrainer loss_type "simpo", cpo_alpha = alpha: 0 is SimPO); rewards as orpo

A batch's loss is the mean over its pairs (plus the NLL term, a mean over its tokens), as TRL's.
Logged per step as TRL names them: rewards/chosen, rewards/rejected, rewards/accuracies (the
share of pairs whose chosen reward is the larger), rewards/margins, logps/chosen, logps/rejected
(sums for dpo and ipo, per-token means for orpo and simpo); orpo also nll_loss,
log_odds_ratio (the mean of log s(o)) and log_odds_chosen (of o); simpo with alpha > 0 nll_loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

METHODS = ("dpo", "ipo", "orpo", "simpo")
# The per-pair metrics, summed over pairs and divided by their number.
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")
ORPO_METRICS = ("log_odds_ratio", "log_odds_chosen")
# An average log-probability of exactly 0 (every token certain) makes ORPO's log(1 - e^a) -inf,
# and TRL's loss NaN; here it stays this far below 0.
_ORPO_CEILING = -1e-12


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(log_sigmoid(x))


def log1mexp(x: np.ndarray) -> np.ndarray:
    """log(1 - e^x) for x < 0, in the stable branch on each side of -log 2 (as TRL's)."""
    x = np.asarray(x, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x < -np.log(2.0), np.log1p(-np.exp(x)), np.log(-np.expm1(x)))


@dataclass(frozen=True)
class PairTerms:
    """A batch's pairs under a loss: each pair's loss and its derivatives by pc and pr (of the
    pair's own loss, not yet divided by the number of pairs), and the metrics per pair."""

    loss: np.ndarray
    d_chosen: np.ndarray
    d_rejected: np.ndarray
    metrics: dict[str, np.ndarray]


@dataclass(frozen=True)
class PreferenceLoss:
    method: str
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 0.0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r}: choose one of {', '.join(METHODS)}")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference model (dpo, ipo); orpo and simpo do not."""
        return self.method in ("dpo", "ipo")

    @property
    def nll_weight(self) -> float:
        """The weight of the NLL term: 1 for orpo, alpha for simpo, 0 otherwise."""
        return 1.0 if self.method == "orpo" else self.cpo_alpha if self.method == "simpo" else 0.0

    @property
    def nll_on_prompt(self) -> bool:
        """Whether the NLL term counts the prompt's tokens too (TRL's ORPO does; its CPO does not)."""
        return self.method == "orpo"

    def pairs(self, pc, pr, nc, nr, rc=None, rr=None) -> PairTerms:
        """The terms of pairs with policy sums pc, pr over nc, nr answer tokens (and the reference's
        sums rc, rr where the loss needs them), all arrays of one length. A NaN in (a diverged
        model's) gives NaN terms, quietly: the trainer names the step."""
        with np.errstate(all="ignore"):
            return self._pairs(pc, pr, nc, nr, rc, rr)

    def _pairs(self, pc, pr, nc, nr, rc, rr) -> PairTerms:
        pc, pr = np.asarray(pc, np.float64), np.asarray(pr, np.float64)
        nc, nr = np.maximum(np.asarray(nc, np.float64), 1.0), np.maximum(np.asarray(nr, np.float64), 1.0)
        b, eps = self.beta, self.label_smoothing
        extra: dict[str, np.ndarray] = {}
        if self.needs_reference:
            if rc is None or rr is None:
                raise ValueError(f"{self.method} needs the reference model's log-probabilities")
            cr, rj = pc - np.asarray(rc, np.float64), pr - np.asarray(rr, np.float64)
            if self.method == "dpo":
                z = b * (cr - rj)
                loss = -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)
                dz = -(1 - eps) * sigmoid(-z) + eps * sigmoid(z)
                d_chosen, d_rejected = b * dz, -b * dz
            else:  # ipo
                delta = cr / nc - rj / nr - 1.0 / (2 * b)
                loss = delta ** 2
                d_chosen, d_rejected = 2 * delta / nc, -2 * delta / nr
            reward_c, reward_r, logp_c, logp_r = b * cr, b * rj, pc, pr
        else:
            ac, ar = pc / nc, pr / nr
            if self.method == "orpo":
                ac_in, ar_in = np.minimum(ac, _ORPO_CEILING), np.minimum(ar, _ORPO_CEILING)
                odds = (ac_in - ar_in) - (log1mexp(ac_in) - log1mexp(ar_in))
                ratio = log_sigmoid(odds)
                loss = -b * ratio
                d_odds = -b * sigmoid(-odds)
                # d odds / d ac = 1 / (1 - e^ac); d odds / d ar = -1 / (1 - e^ar); flat where clamped
                d_ac = np.where(ac < _ORPO_CEILING, d_odds / -np.expm1(ac_in), 0.0)
                d_ar = np.where(ar < _ORPO_CEILING, -d_odds / -np.expm1(ar_in), 0.0)
                extra = {"log_odds_ratio": ratio, "log_odds_chosen": odds}
            else:  # simpo
                z = b * (ac - ar) - self.simpo_gamma
                loss = -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)
                dz = -(1 - eps) * sigmoid(-z) + eps * sigmoid(z)
                d_ac, d_ar = b * dz, -b * dz
            d_chosen, d_rejected = d_ac / nc, d_ar / nr
            reward_c, reward_r, logp_c, logp_r = b * ac, b * ar, ac, ar
        metrics = {"rewards/chosen": reward_c, "rewards/rejected": reward_r,
                   "rewards/accuracies": (reward_c > reward_r).astype(np.float64),
                   "rewards/margins": reward_c - reward_r, "logps/chosen": logp_c, "logps/rejected": logp_r, **extra}
        return PairTerms(loss, d_chosen, d_rejected, metrics)

    def metric_names(self) -> tuple[str, ...]:
        """The names this loss logs per pair, besides the loss and nll_loss."""
        return PAIR_METRICS + (ORPO_METRICS if self.method == "orpo" else ())

    def describe(self) -> str:
        m = self.method
        if m == "dpo":
            what = f"DPO (sigmoid), beta {self.beta:g}" + (f", label smoothing {self.label_smoothing:g}"
                                                            if self.label_smoothing else "")
        elif m == "ipo":
            what = f"IPO, beta (tau) {self.beta:g}"
        elif m == "orpo":
            what = f"ORPO, beta (lambda) {self.beta:g}: NLL of the prompt and chosen answer plus the odds ratio"
        else:
            what = (f"SimPO, beta {self.beta:g}, gamma {self.simpo_gamma:g}"
                    + (f", label smoothing {self.label_smoothing:g}" if self.label_smoothing else "")
                    + (f", plus {self.cpo_alpha:g} x the NLL of the chosen answers (CPO)" if self.cpo_alpha else ""))
        ref = ("; the reference is the model before training" if self.needs_reference
               else "; no reference model")
        return what + ref


def loss_from_config(cfg) -> Optional[PreferenceLoss]:
    """A TrainConfig's preference loss; None for supervised finetuning (method sft)."""
    if cfg.method == "sft":
        return None
    return PreferenceLoss(cfg.method, cfg.beta, cfg.label_smoothing, cfg.simpo_gamma, cfg.cpo_alpha)
