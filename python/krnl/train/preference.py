"""Preference training's objectives as TRL defines them (DPOTrainer; ORPOTrainer and CPOTrainer's
SimPO in trl.experimental), on the per-sample
log-probabilities krnl's forward gives (models/sequence_loss.py). A batch holds P pairs as 2P rows,
the P chosen completions first and their rejected ones after, in the same order (TRL's layout);
each row's targets cover its completion only (the prompt's are -100).

DPO, with policy log-probabilities c, r of a pair's chosen and rejected completion and the
reference's (the base model: the adapter off) c0, r0, and d = (c - c0) - (r - r0):

    sigmoid  -log sigmoid(beta d)
    hinge    max(0, 1 - beta d)
    ipo      ((c - c0) / n_c - (r - r0) / n_r - 1 / (2 beta))^2    (log-ratios per completion token)

averaged over the pairs. ORPO and SimPO need no reference; with a = logp / n per completion token
and NLL the chosen rows' mean token loss:

    orpo   NLL - beta mean log sigmoid(log odds),  log odds = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r))
           (its NLL over the chosen rows' prompt and completion tokens, as TRL's; with a pair's
           preference score s, mlx-lm-lora's, s a_c stands for a_c in the log odds and the rewards)
    simpo  mean -log sigmoid(beta (a_c - a_r) - gamma) + cpo_alpha NLL (over the completion tokens)

The loss's gradient is taken here with respect to each row's summed token losses (S = -logp),
which scales that row's cross-entropy gradient in the model's backward.
Everything on the host is float64: a batch's handful of scalars."""

import numpy as np

from ..models.config import IGNORE_INDEX
from ..models.sequence_loss import adapter_off, forward_backward_rows, row_losses, skip_rows
from . import grpo
from .dist.ranks import pooled
from .dist.world import World

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _sigmoid(x):
    return np.exp(_log_sigmoid(x))


def dpo(logp, n, ref_logp, beta=0.1, loss_type="sigmoid"):
    """(loss, w, metrics) of a DPO batch: logp, ref_logp (2P,) the policy's and the reference's summed
    log-probabilities, n (2P,) completion tokens; w (2P,) = -dloss/dlogp; metrics as TRL logs them
    (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected).
    n counts tokens of completions (at least 1 taken)."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"[dpo] loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {loss_type!r}")
    if not beta > 0:
        raise ValueError(f"[dpo] beta must be > 0, got {beta!r}")
    logp, n, P = _pairs(logp, n, "dpo")
    ratio = logp - np.asarray(ref_logp, np.float64)                       # (2P,) log pi / pi_ref
    if loss_type == "ipo":
        ratio_n = ratio / n
        d = ratio_n[:P] - ratio_n[P:]
        per, dper = (d - 1 / (2 * beta)) ** 2, 2 * (d - 1 / (2 * beta))
        scale = 1 / n                                                     # d(d) / d(logp): per token
    else:
        d = ratio[:P] - ratio[P:]
        if loss_type == "sigmoid":
            per, dper = -_log_sigmoid(beta * d), -beta * _sigmoid(-beta * d)
        else:
            per, dper = np.maximum(0.0, 1 - beta * d), np.where(1 - beta * d > 0, -beta, 0.0)
        scale = np.ones(2 * P)
    dlogp = np.concatenate([dper, -dper]) * scale / P                     # dloss / dlogp
    metrics = _reward_metrics(beta * ratio, logp, P)
    return float(per.mean()), -dlogp, {k: float(v) for k, v in metrics.items()}


def _log1mexp(x):
    """log(1 - e^x) for x < 0, without cancellation on either side of -ln 2."""
    return np.where(x < -np.log(2.0), np.log1p(-np.exp(x)), np.log(-np.expm1(x)))


def _pairs(logp, n, who):
    logp, n = np.asarray(logp, np.float64), np.asarray(n, np.float64)
    if len(logp) % 2 or len(logp) != len(n):
        raise ValueError(f"[{who}] a batch holds pairs: chosen rows then rejected ones, got {len(logp)} rows")
    return logp, np.maximum(n, 1.0), len(logp) // 2


def _reward_metrics(r, logp, P):
    return {"rewards/chosen": r[:P].mean(), "rewards/rejected": r[P:].mean(),
            "rewards/accuracies": (r[:P] > r[P:]).mean(), "rewards/margins": (r[:P] - r[P:]).mean(),
            "logps/chosen": logp[:P].mean(), "logps/rejected": logp[P:].mean()}


def orpo(logp, n, beta=0.1, nll=0.0, scores=None):
    """(loss, w, metrics) of ORPO (TRL's ORPOTrainer) given the NLL term `nll` (its gradient the
    caller's): as dpo() without a reference; w = dloss/dS. scores (P,): the pairs' preference
    scores (mlx-lm-lora's orpo_loss: the chosen per-token log-probability times the score), or None."""
    logp, n, P = _pairs(logp, n, "orpo")
    s = np.concatenate([np.ones(P) if scores is None else np.asarray(scores, np.float64), np.ones(P)])
    a = s * logp / n                                                      # (2P,) per-token log-probabilities
    lo = (a[:P] - a[P:]) - (_log1mexp(a[:P]) - _log1mexp(a[P:]))
    ratio = _log_sigmoid(lo)
    dlo = -beta * _sigmoid(-lo) / P                                       # d(-beta mean ratio) / d lo
    da = np.concatenate([dlo / -np.expm1(a[:P]), -dlo / -np.expm1(a[P:])])  # dlo/da = 1 / (1 - e^a), signed
    metrics = {**_reward_metrics(beta * a, logp / n, P), "nll_loss": nll, "log_odds_ratio": ratio.mean(),
               "log_odds_chosen": lo.mean()}
    return float(nll - beta * ratio.mean()), -da * s / n, {k: float(v) for k, v in metrics.items()}  # a = -s S / n


def simpo(logp, n, beta=2.0, gamma=0.5, cpo_alpha=0.0, label_smoothing=0.0, nll=0.0):
    """(loss, w, metrics) of SimPO (TRL's CPOTrainer with loss_type "simpo") given the NLL term `nll`
    (its gradient the caller's); w = dloss/dS."""
    logp, n, P = _pairs(logp, n, "simpo")
    a = logp / n
    z = beta * (a[:P] - a[P:]) - gamma
    per = -(1 - label_smoothing) * _log_sigmoid(z) - label_smoothing * _log_sigmoid(-z)
    dz = (-(1 - label_smoothing) * _sigmoid(-z) + label_smoothing * _sigmoid(z)) / P
    metrics = {**_reward_metrics(beta * a, a, P), "nll_loss": nll if cpo_alpha else 0.0}  # TRL skips it at 0
    return float(per.mean() + cpo_alpha * nll), -np.concatenate([beta * dz, -beta * dz]) / n, \
        {k: float(v) for k, v in metrics.items()}


def dpo_step(model, ids, targets, beta=0.1, loss_type="sigmoid", loss_scale=1.0):
    """One forward and backward of DPO on the model (LoRA gradients accumulate), the reference computed
    with the adapter off. Returns (loss, metrics)."""
    return Pairwise("dpo", beta, loss_type).step(model, ids, targets, loss_scale)


MODES = ("sft", "dpo", "orpo", "simpo", "grpo")


def check(cfg):
    """Raises naming a TrainConfig's bad preference settings."""
    if cfg.train_mode not in MODES:
        raise ValueError(f"[train] train_mode must be one of {', '.join(MODES)}, got {cfg.train_mode!r}")
    types = {"dpo": DPO_LOSS_TYPES, "grpo": grpo.LOSS_TYPES}.get(cfg.train_mode)
    if types and cfg.loss_type not in types:
        raise ValueError(f"[train] loss_type of {cfg.train_mode} must be one of {', '.join(types)}, got {cfg.loss_type!r}")
    for k in ("beta", "simpo_gamma", "cpo_alpha"):
        v, positive = getattr(cfg, k), k == "beta" and cfg.train_mode != "grpo"  # grpo's beta 0: no KL
        if not (np.isfinite(v) and (v > 0 if positive else v >= 0)):
            raise ValueError(f"[train] {k} must be {'> 0' if positive else '>= 0'}, got {v!r}")


def check_full(cfg, lora):
    """Refuses a mode whose reference is the base with the adapter off (DPO; GRPO with beta > 0) for
    a full fine-tune, which keeps no base beside its trained weights."""
    if lora.train_embeddings and cfg.train_mode != "sft":
        raise ValueError(f"[train] --train-embeddings trains with --train-mode sft only; {cfg.train_mode} weighs each "
                         "row after the head's gradient is taken: leave the embeddings frozen")
    if lora.full and (cfg.train_mode == "dpo" or (cfg.train_mode == "grpo" and cfg.beta)):
        what = "set --beta 0 (no KL term)" if cfg.train_mode == "grpo" else "use orpo or simpo (no reference)"
        raise ValueError(f"[train] --train-mode {cfg.train_mode} takes its reference from the base with the adapter "
                         f"off, and full fine-tuning keeps no base beside its weights: train LoRA, or {what}")


class Pairwise:
    """The objective of --train-mode dpo, orpo or simpo for the trainer's StepRunner: step() trains on
    a batch of pairs (DPO's reference the adapter off, computed at each batch), evaluate() gives its loss.
    With ranks (world), run() and evaluate() take the global batch and each rank its whole pairs: its
    parts of the loss, of its gradient and of the metrics sum over the ranks to the batch's."""

    def __init__(self, mode, beta, loss_type="sigmoid", gamma=0.5, cpo_alpha=0.0, world=None):
        self.mode, self.beta, self.loss_type, self.gamma, self.cpo_alpha = mode, float(beta), loss_type, gamma, cpo_alpha
        self.world = world or World()

    def targets(self, ids, targets):
        """(the targets the forward reads, the completion rows (B, T) bool): ORPO's NLL also reads the
        chosen rows' prompt tokens, every row up to the completion's last."""
        done = targets != IGNORE_INDEX
        if self.mode != "orpo":
            return targets, done
        T = targets.shape[1]
        last = np.where(done.any(axis=1), T - 1 - np.argmax(done[:, ::-1], axis=1), -1)
        full = np.where(np.arange(T)[None, :] <= last[:, None], np.concatenate([ids[:, 1:], ids[:, :1]], axis=1),
                        IGNORE_INDEX)
        return full, done

    def loss(self, rows, read, done, ref=None, share=1.0, nll_tokens=None, scores=None):
        """(loss, w (B, T) dloss/d(row loss), metrics) from the rows' losses (B, T). A rank's part of a
        global batch: `share` its pairs' fraction of the batch's (the pair terms are means over pairs),
        nll_tokens the batch's NLL tokens (the NLL is a mean over them), so that the parts sum to the whole.
        scores: the pairs' preference scores (ORPO's) or None."""
        if scores is not None and self.mode != "orpo":
            raise ValueError(f"[{self.mode}] preference scores weigh ORPO's odds ratio; {self.mode} has no use for "
                             "them")
        logp, n = -(rows * done).sum(axis=1), done.sum(axis=1)
        P, chosen = len(rows) // 2, np.zeros(rows.shape, bool)
        chosen[:P] = read[:P] != IGNORE_INDEX                             # the NLL's rows
        per_nll = 1 / max(chosen.sum() if nll_tokens is None else nll_tokens, 1)
        nll = rows[chosen].sum() * per_nll
        if self.mode == "dpo":
            loss, w, m = dpo(logp, n, ref, self.beta, self.loss_type)
        elif self.mode == "orpo":
            loss, w, m = orpo(logp, n, self.beta, scores=scores)
        else:
            loss, w, m = simpo(logp, n, self.beta, self.gamma, self.cpo_alpha)
        alpha = 1.0 if self.mode == "orpo" else self.cpo_alpha if self.mode == "simpo" else 0.0
        m = {k: v * share for k, v in m.items()}
        if "nll_loss" in m:  # TRL's simpo logs 0 without its NLL term
            m["nll_loss"] = float(nll) if alpha else 0.0
        return share * loss + alpha * nll, share * w[:, None] * done + alpha * chosen * per_nll, m

    def reference(self, model, ids, targets, done):
        if self.mode != "dpo":
            return None
        with adapter_off(model):
            return -(row_losses(model, ids, targets) * done).sum(axis=1)

    def step(self, model, ids, targets, loss_scale=1.0, share=1.0, nll_tokens=None, scores=None):
        ids, targets = np.asarray(ids), np.asarray(targets)
        read, done = self.targets(ids, targets)
        ref = self.reference(model, ids, read, done)

        def weigh(rows):
            loss, w, metrics = self.loss(rows, read, done, ref, share, nll_tokens, scores)
            return w, (loss, metrics)

        return forward_backward_rows(model, ids, read, weigh, loss_scale)

    def mine(self, ids, targets, scores=None):
        """(this rank's rows of a global batch of pairs (its pairs' chosen rows, then their rejected ones),
        its share of the pairs, the batch's NLL tokens, its pairs' scores or None)."""
        P = len(ids) // 2
        lo, hi = self.world.span(P)
        read, _ = self.targets(ids, targets)
        mine = None if scores is None else np.asarray(scores, np.float64)[lo:hi]
        return np.r_[lo:hi, P + lo:P + hi], (hi - lo) / P, int((read[:P] != IGNORE_INDEX).sum()), mine

    def run(self, model, batch, loss_scale=1.0):
        """(loss, metrics, completion tokens) of one global batch (ids, targets[, scores]) of pairs
        (pairs.rows): the StepRunner's call. With ranks, the loss is this rank's part (the StepRunner sums
        them), the rest the batch's."""
        ids, targets = np.asarray(batch[0]), np.asarray(batch[1])
        rows, share, nll_tokens, scores = self.mine(ids, targets, *batch[2:])
        loss, metrics = 0.0, {}
        if len(rows):
            loss, metrics = self.step(model, ids[rows], targets[rows], loss_scale, share, nll_tokens, scores)
        else:
            skip_rows(model)
        metrics = pooled(self.world, metrics, f"the {self.mode} metrics")
        return loss, metrics, int((targets != IGNORE_INDEX).sum())

    def evaluate(self, model, ids, targets, scores=None):
        """The loss of a global batch of pairs (with ranks, each computes its pairs' part)."""
        ids, targets = np.asarray(ids), np.asarray(targets)
        rows, share, nll_tokens, scores = self.mine(ids, targets, scores)
        part = {}
        if len(rows):
            ids, targets = ids[rows], targets[rows]
            read, done = self.targets(ids, targets)
            part["loss"] = self.loss(row_losses(model, ids, read), read, done, self.reference(model, ids, read, done),
                                     share, nll_tokens, scores)[0]
        return float(pooled(self.world, part, f"the {self.mode} validation")["loss"])


def objective(cfg, world=None, given=None):
    """The trainer's objective of cfg.train_mode: None for sft, `given` (grpo's: its tokenizer and
    reward functions are the caller's; it takes the world), else its step and evaluation."""
    if cfg.train_mode == "sft":
        return None
    if cfg.train_mode == "grpo" and given is None:
        raise ValueError("[train] --train-mode grpo needs its objective (krnl.train.grpo.GRPO) given to the Trainer")
    if given is not None:
        given.world = world or World()
        return given
    return Pairwise(cfg.train_mode, cfg.beta, cfg.loss_type, cfg.simpo_gamma, cfg.cpo_alpha, world)
