"""GRPO's objective as TRL's GRPOTrainer computes it, on completions already sampled and rewarded:
group-normalised advantages, and the clipped per-token loss over the completion rows' log-probabilities
(models/sequence_loss.py gives them and takes the loss's gradient row by row):

    A_i = (r_i - mean of its group) / (std of its group + 1e-4)      (scale_rewards "group"; Bessel's std)
    rho_t = exp(logp_t - logp_old_t)                                  (1 on the first pass: old = current)
    l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) + beta rho_t (e^(ref_t - logp_t) - (ref_t - logp_t) - 1)
    (the KL term times rho_t: TRL's use_bias_correction_kl, its default; without it, times 1)

aggregated over the completion tokens by loss_type: grpo (each completion's mean, then their mean), bnpo
(the batch's token mean), dr_grpo (sum / (completions * max_completion_length)), dapo (sum / the
batch's tokens). Everything on the host is float64: a batch's (B, T) scalars."""

import numpy as np

from ..models.config import IGNORE_INDEX
from ..models.sequence_loss import adapter_off, forward_backward_rows, row_losses

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def advantages(rewards, group_size, scale="group"):
    """(B,) float64 advantages of B = prompts x group_size rewards, each group a prompt's completions
    in a row (TRL's order); scale "group" (each group's std), "batch" (the batch's) or "none"."""
    r = np.asarray(rewards, np.float64)
    if group_size < 1 or len(r) % group_size:
        raise ValueError(f"[grpo] {len(r)} rewards are not whole groups of {group_size}")
    g = r.reshape(-1, group_size)
    adv = (g - g.mean(axis=1, keepdims=True)).reshape(-1)
    if scale == "none":
        return adv
    if scale not in ("group", "batch"):
        raise ValueError(f"[grpo] scale must be group, batch or none, got {scale!r}")
    std = np.repeat(g.std(axis=1, ddof=1), group_size) if scale == "group" else np.full(len(r), r.std(ddof=1))
    return adv / (std + 1e-4)


def objective(logp, mask, adv, old=None, ref=None, beta=0.0, eps_low=0.2, eps_high=0.2, loss_type="grpo",
              max_completion_length=None, kl_correction=True):
    """(loss, dloss/dlogp (B, T), metrics) of completion tokens' log-probabilities logp (B, T) where mask."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"[grpo] loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    logp, m = np.asarray(logp, np.float64), np.asarray(mask, np.float64)
    A = np.asarray(adv, np.float64)[:, None]
    rho = np.exp(logp - (logp if old is None else np.asarray(old, np.float64)))
    lo, hi = rho < 1 - eps_low, rho > 1 + eps_high
    clipped = np.clip(rho, 1 - eps_low, 1 + eps_high)
    per = -np.minimum(rho * A, clipped * A)
    # the min takes the unclipped term unless the clipped one is smaller (then its gradient is 0)
    dper = np.where(rho * A <= clipped * A, -A * rho, 0.0)
    metrics = {"clip_ratio/low_mean": float((lo & (A < 0))[m > 0].mean()),
               "clip_ratio/high_mean": float((hi & (A > 0))[m > 0].mean())}
    if beta:
        d = np.asarray(ref, np.float64) - logp
        kl, dkl = np.exp(d) - d - 1, 1 - np.exp(d)
        if kl_correction:  # d(rho kl)/dlogp = rho (dkl + kl): rho is differentiable even where it is 1
            kl, dkl = rho * kl, rho * (dkl + kl)
        per, dper = per + beta * kl, dper + beta * dkl
        metrics["kl"] = float((kl * m).sum() / max(m.sum(), 1))
    B, T = logp.shape
    if loss_type == "grpo":
        scale = 1 / (B * np.maximum(m.sum(axis=1, keepdims=True), 1))
    elif loss_type == "dr_grpo":
        scale = np.full((B, 1), 1 / (B * (max_completion_length or T)))
    else:  # bnpo, dapo: the batch's tokens (one process, no accumulation split)
        scale = np.full((B, 1), 1 / max(m.sum(), 1))
    return float((per * m * scale).sum()), dper * m * scale, metrics


def grpo_step(model, ids, targets, adv, old=None, beta=0.0, eps_low=0.2, eps_high=0.2, loss_type="grpo",
              max_completion_length=None, kl_correction=True, loss_scale=1.0):
    """One forward and backward of GRPO on rows ids (B, T) of prompt then completion, targets the
    completion tokens (the prompt's -100), advantages adv (B,); old (B, T) the sampling policy's
    log-probabilities of the targets (None: this policy's, rho = 1); the reference for beta > 0 the
    adapter off. LoRA gradients accumulate. Returns (loss, metrics)."""
    targets = np.asarray(targets)
    mask = targets != IGNORE_INDEX
    ref = None
    if beta:
        with adapter_off(model):
            ref = -row_losses(model, ids, targets)

    def weigh(rows):
        loss, dlogp, metrics = objective(-rows, mask, adv, old, ref, beta, eps_low, eps_high, loss_type,
                                         max_completion_length, kl_correction)
        return -dlogp, (loss, metrics)  # logp = -(row loss)

    return forward_backward_rows(model, ids, targets, weigh, loss_scale)
