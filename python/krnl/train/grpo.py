"""GRPO as TRL's GRPOTrainer computes it: completions sampled by krnl's own generation and rewarded by
the user's functions (GRPO, below), then, on them,
group-normalised advantages, and the clipped per-token loss over the completion rows' log-probabilities
(models/sequence_loss.py gives them and takes the loss's gradient row by row):

    A_i = (r_i - mean of its group) / (std of its group + 1e-4)      (scale_rewards "group"; Bessel's std)
    rho_t = exp(logp_t - logp_old_t)                                  (1 on the first pass: old = current)
    l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) + beta rho_t (e^(ref_t - logp_t) - (ref_t - logp_t) - 1)
    (the KL term times rho_t: TRL's use_bias_correction_kl, its default; without it, times 1)

aggregated over the completion tokens by loss_type: grpo (each completion's mean, then their mean), bnpo
(the batch's token mean), dr_grpo (sum / (completions * max_completion_length)), dapo (sum / the
batch's tokens). Everything on the host is float64: a batch's (B, T) scalars."""

import time
from pathlib import Path

import numpy as np

from ..models.config import IGNORE_INDEX
from ..models.sequence_loss import adapter_off, forward_backward_rows, row_losses
from .batches import pad_batch
from .data import Sample

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


def load_reward(spec):
    """(name, callable) of a reward function named "module:function" or "path/to/file.py:function"; it
    is called as TRL calls its reward functions, f(prompts=[...], completions=[...], completion_ids=[...],
    **the lines' other keys), and returns a float (or None) per completion."""
    import importlib
    import importlib.util

    mod, _, fn = str(spec).rpartition(":")
    if not mod or not fn:
        raise ValueError(f"[grpo] --reward {spec!r}: expected module:function or file.py:function")
    try:
        if mod.endswith(".py"):
            s = importlib.util.spec_from_file_location(Path(mod).stem, mod)
            m = importlib.util.module_from_spec(s)
            s.loader.exec_module(m)
        else:
            m = importlib.import_module(mod)
        f = getattr(m, fn)
    except (ImportError, OSError, AttributeError) as e:
        raise ValueError(f"[grpo] --reward {spec!r}: {type(e).__name__}: {e}") from None
    if not callable(f):
        raise ValueError(f"[grpo] --reward {spec!r} is not callable")
    return fn, f


class GRPO:
    """The objective of --train-mode grpo for the trainer's StepRunner: a batch of prompts, each sampled
    num_generations times by krnl's KV-cached generation, every completion of the batch decoded
    together (generate_batch: the current adapter, temperature, top_k, top_p, max_completion_length,
    stopping at EOS; seeds from the run's position), rewarded, and trained on with grpo_step (one
    pass: the sampling policy is this one)."""

    def __init__(self, tok, rewards, weights=None, num_generations=8, max_completion_length=512, temperature=1.0,
                 top_p=1.0, beta=0.0, eps_low=0.2, eps_high=None, loss_type="dapo", scale="group", seed=0, top_k=0):
        if not rewards:
            raise ValueError("[grpo] at least one reward function (--reward module:function)")
        self.tok, self.rewards = tok, list(rewards)
        self.weights = np.ones(len(rewards)) if weights is None else np.asarray(weights, np.float64)
        if len(self.weights) != len(self.rewards):
            raise ValueError(f"[grpo] {len(self.weights)} reward weights for {len(self.rewards)} reward functions")
        if num_generations < 2:
            raise ValueError(f"[grpo] num_generations must be >= 2 (a group's advantages), got {num_generations}")
        self.G, self.max_len, self.temperature, self.top_p = int(num_generations), int(max_completion_length), \
            float(temperature), float(top_p)
        self.beta, self.eps_low, self.eps_high = float(beta), float(eps_low), float(eps_low if eps_high is None else eps_high)
        self.loss_type, self.scale, self.seed, self.top_k = loss_type, scale, int(seed), int(top_k)
        self.position = (0, 0)  # (step, micro-batch) the trainer sets: the sampling seeds, so that resume is exact

    def run(self, model, prompts, loss_scale=1.0):
        """(loss, metrics, completion tokens trained) of one batch of prompts (load_prompts' items)."""
        t0 = time.perf_counter()
        each = [p for p in prompts for _ in range(self.G)]                # (ids, line) of each completion
        seeds = np.random.SeedSequence([self.seed, *self.position]).generate_state(len(each))
        comps = model.generate_batch([ids for ids, _ in each], self.max_len, self.temperature, self.top_p, seeds,
                                     self.tok.eos_id, self.top_k)
        lines = [line for _, line in each]
        texts = [self.tok.decode(c) for c in comps]
        extra = {k: [ln[k] for ln in lines] for k in lines[0] if k != "prompt"}
        got = np.array([[np.nan if v is None else float(v) for v in f(prompts=[ln["prompt"] for ln in lines],
                                                                     completions=texts, completion_ids=comps, **extra)]
                        for _, f in self.rewards], np.float64)                # (functions, B)
        total = np.nansum(got * self.weights[:, None], axis=0)
        adv = advantages(total, self.G, self.scale)
        t1 = time.perf_counter()
        # rows of prompt + completion, the completion's tokens learned (its prompt's predict nothing)
        ids, tg = pad_batch([Sample(np.asarray(list(p) + list(c), np.int32), np.arange(len(p) + len(c)) >= len(p))
                             for (p, _), c in zip(each, comps)],
                            self.tok.pad_id)
        loss, metrics = grpo_step(model, ids, tg, adv, None, self.beta, self.eps_low, self.eps_high, self.loss_type,
                                  self.max_len, loss_scale=loss_scale)
        metrics.update({"reward": float(total.mean()), "reward_std": float(total.std(ddof=1)),
                        "completions/mean_length": float(np.mean([len(c) for c in comps])),
                        "timing/generation_s": t1 - t0, "timing/training_s": time.perf_counter() - t1,
                        **{f"rewards/{n}/mean": float(np.nanmean(r)) for (n, _), r in zip(self.rewards, got)}})
        return loss, metrics, int((tg != IGNORE_INDEX).sum())
