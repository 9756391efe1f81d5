"""Preference training's objectives as TRL defines them (DPOTrainer), on the per-sample
log-probabilities krnl's forward gives (models/sequence_loss.py). A batch holds P pairs as 2P rows,
the P chosen completions first and their rejected ones after, in the same order (TRL's layout);
each row's targets cover its completion only (the prompt's are -100).

DPO, with policy log-probabilities c, r of a pair's chosen and rejected completion and the
reference's (the base model: the adapter off) c0, r0, and d = (c - c0) - (r - r0):

    sigmoid  -log sigmoid(beta d)
    hinge    max(0, 1 - beta d)
    ipo      ((c - c0) / n_c - (r - r0) / n_r - 1 / (2 beta))^2    (log-ratios per completion token)

averaged over the pairs. The loss's gradient is taken here with respect to each row's summed
token losses (-logp), which scales that row's cross-entropy gradient in the model's backward.
Everything on the host is float64: a batch's handful of scalars."""

import numpy as np

from ..models.sequence_loss import adapter_off, forward_backward_sequences, sequence_logps

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _sigmoid(x):
    return np.exp(_log_sigmoid(x))


def dpo(logp, n, ref_logp, beta=0.1, loss_type="sigmoid"):
    """(loss, w, metrics) of a DPO batch: logp, ref_logp (2P,) the policy's and the reference's summed
    log-probabilities, n (2P,) completion tokens; w (2P,) = -dloss/dlogp; metrics as TRL logs them
    (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected)."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"[dpo] loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {loss_type!r}")
    if not beta > 0:
        raise ValueError(f"[dpo] beta must be > 0, got {beta!r}")
    logp, ref_logp, n = (np.asarray(a, np.float64) for a in (logp, ref_logp, n))
    if len(logp) % 2 or len(logp) != len(ref_logp) or len(logp) != len(n):
        raise ValueError(f"[dpo] a batch holds pairs: chosen rows then rejected ones, got {len(logp)} rows")
    P = len(logp) // 2
    ratio = logp - ref_logp                                               # (2P,) log pi / pi_ref
    if loss_type == "ipo":
        ratio_n = ratio / np.maximum(n, 1.0)
        d = ratio_n[:P] - ratio_n[P:]
        per, dper = (d - 1 / (2 * beta)) ** 2, 2 * (d - 1 / (2 * beta))
        scale = 1 / np.maximum(n, 1.0)                                    # d(d) / d(logp): per token
    else:
        d = ratio[:P] - ratio[P:]
        if loss_type == "sigmoid":
            per, dper = -_log_sigmoid(beta * d), -beta * _sigmoid(-beta * d)
        else:
            per, dper = np.maximum(0.0, 1 - beta * d), np.where(1 - beta * d > 0, -beta, 0.0)
        scale = np.ones(2 * P)
    dlogp = np.concatenate([dper, -dper]) * scale / P                     # dloss / dlogp
    rewards = beta * ratio
    metrics = {"rewards/chosen": rewards[:P].mean(), "rewards/rejected": rewards[P:].mean(),
               "rewards/accuracies": (rewards[:P] > rewards[P:]).mean(),
               "rewards/margins": (rewards[:P] - rewards[P:]).mean(),
               "logps/chosen": logp[:P].mean(), "logps/rejected": logp[P:].mean()}
    return float(per.mean()), -dlogp, {k: float(v) for k, v in metrics.items()}


def dpo_step(model, ids, targets, beta=0.1, loss_type="sigmoid", ref_logp=None, loss_scale=1.0):
    """One forward and backward of DPO on the model (LoRA gradients accumulate); ref_logp (2P,) the
    reference's log-probabilities where known already (TRL's precompute_ref_log_probs), else computed
    here with the adapter off. Returns (loss, metrics)."""
    if ref_logp is None:
        with adapter_off(model):
            ref_logp, _ = sequence_logps(model, ids, targets)

    def weigh(logp, n):
        loss, w, metrics = dpo(logp, n, ref_logp, beta, loss_type)
        return w, (loss, metrics)

    return forward_backward_sequences(model, ids, targets, weigh, loss_scale)


def check(cfg):
    """Raises naming a TrainConfig's bad preference settings."""
    if cfg.train_mode not in ("sft", "dpo"):
        raise ValueError(f"[train] train_mode must be sft or dpo, got {cfg.train_mode!r}")
    if cfg.train_mode == "dpo":
        if cfg.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"[train] loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {cfg.loss_type!r}")
        if not (cfg.beta > 0 and np.isfinite(cfg.beta)):
            raise ValueError(f"[train] beta must be > 0, got {cfg.beta!r}")


class DPO:
    """The objective of --train-mode dpo for the trainer's StepRunner: step() trains on a batch of
    pairs (the reference the adapter off, computed at each batch), evaluate() gives its loss."""

    def __init__(self, beta, loss_type):
        self.beta, self.loss_type = float(beta), loss_type

    def step(self, model, ids, targets, loss_scale=1.0):
        return dpo_step(model, ids, targets, self.beta, self.loss_type, loss_scale=loss_scale)

    def evaluate(self, model, ids, targets):
        with adapter_off(model):
            ref, _ = sequence_logps(model, ids, targets)
        logp, n = sequence_logps(model, ids, targets)
        return dpo(logp, n, ref, self.beta, self.loss_type)[0]


def objective(cfg, world=None):
    """The trainer's objective of cfg.train_mode: None for sft, else its step and evaluation."""
    if cfg.train_mode == "sft":
        return None
    if world is not None and world.size > 1:
        raise ValueError(f"[train] --train-mode {cfg.train_mode} runs on one process for now (a pair's rows must "
                         "stay together and the pairs' mean spans the ranks)")
    return DPO(cfg.beta, cfg.loss_type)
