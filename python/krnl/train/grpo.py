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
from ..models.sequence_loss import adapter_off, forward_backward_rows, row_losses, skip_rows
from .batches import pad_batch
from .data import Sample
from .dist.ranks import pooled
from .dist.world import World

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def advantages(rewards, group_size, scale="group", batch_std=None):
    """(B,) float64 advantages of B = prompts x group_size rewards, each group a prompt's completions
    in a row (TRL's order); scale "group" (each group's std), "batch" (the batch's: batch_std where the
    batch spans ranks) or "none"."""
    r = np.asarray(rewards, np.float64)
    if group_size < 1 or len(r) % group_size:
        raise ValueError(f"[grpo] {len(r)} rewards are not whole groups of {group_size}")
    g = r.reshape(-1, group_size)
    adv = (g - g.mean(axis=1, keepdims=True)).reshape(-1)
    if scale == "none":
        return adv
    if scale not in ("group", "batch"):
        raise ValueError(f"[grpo] scale must be group, batch or none, got {scale!r}")
    if scale == "batch":
        std = np.full(len(r), r.std(ddof=1) if batch_std is None else batch_std)
    else:
        std = np.repeat(g.std(axis=1, ddof=1), group_size)
    return adv / (std + 1e-4)


def objective(logp, mask, adv, old=None, ref=None, beta=0.0, eps_low=0.2, eps_high=0.2, loss_type="grpo",
              max_completion_length=None, kl_correction=True, whole=None):
    """(loss, dloss/dlogp (B, T), metrics) of completion tokens' log-probabilities logp (B, T) where mask.
    whole: (completions, completion tokens) of the global batch when these rows are a rank's part of it:
    the loss, gradient and metrics are then this part's shares, which sum over the ranks to the batch's."""
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
    B, T = logp.shape
    n, tokens = whole or (B, m.sum())
    per_token = 1 / max(tokens, 1)
    metrics = {"clip_ratio/low_mean": float((lo & (A < 0))[m > 0].sum() * per_token),
               "clip_ratio/high_mean": float((hi & (A > 0))[m > 0].sum() * per_token)}
    if beta:
        d = np.asarray(ref, np.float64) - logp
        kl, dkl = np.exp(d) - d - 1, 1 - np.exp(d)
        if kl_correction:  # d(rho kl)/dlogp = rho (dkl + kl): rho is differentiable even where it is 1
            kl, dkl = rho * kl, rho * (dkl + kl)
        per, dper = per + beta * kl, dper + beta * dkl
        metrics["kl"] = float((kl * m).sum() * per_token)
    if loss_type == "grpo":
        scale = 1 / (n * np.maximum(m.sum(axis=1, keepdims=True), 1))
    elif loss_type == "dr_grpo":
        scale = np.full((B, 1), 1 / (n * (max_completion_length or T)))
    else:  # bnpo, dapo: the batch's tokens (over the ranks; no accumulation split)
        scale = np.full((B, 1), per_token)
    return float((per * m * scale).sum()), dper * m * scale, metrics


def grpo_step(model, ids, targets, adv, old=None, beta=0.0, eps_low=0.2, eps_high=0.2, loss_type="grpo",
              max_completion_length=None, kl_correction=True, loss_scale=1.0, whole=None, first_row=None):
    """One forward and backward of GRPO on rows ids (B, T) of prompt then completion, targets the
    completion tokens (the prompt's -100), advantages adv (B,); old (B, T) the sampling policy's
    log-probabilities of the targets (None: this policy's, rho = 1); the reference for beta > 0 the
    adapter off. LoRA gradients accumulate. Returns (loss, metrics). A rank's part of a global batch:
    whole as objective() takes it, first_row the part's first row in it (forward_backward_rows')."""
    targets = np.asarray(targets)
    mask = targets != IGNORE_INDEX
    ref = None
    if beta:
        with adapter_off(model):
            ref = -row_losses(model, ids, targets)

    def weigh(rows):
        loss, dlogp, metrics = objective(-rows, mask, adv, old, ref, beta, eps_low, eps_high, loss_type,
                                         max_completion_length, kl_correction, whole)
        return -dlogp, (loss, metrics)  # logp = -(row loss)

    return forward_backward_rows(model, ids, targets, weigh, loss_scale, first_row)


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
                 top_p=1.0, beta=0.0, eps_low=0.2, eps_high=None, loss_type="dapo", scale="group", seed=0, top_k=0,
                 graphs=True):
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
        self.graphs = bool(graphs)  # False (--no-graphs): the generation's decoding steps run eagerly
        self.position = (0, 0)  # (step, micro-batch) the trainer sets: the sampling seeds, so that resume is exact
        self.world = World()    # the ranks sharing each batch (krnl.train.preference.objective sets the trainer's)

    def run(self, model, prompts, loss_scale=1.0):
        """(loss, metrics, completion tokens trained) of one global batch of prompts (load_prompts' items).
        With ranks, each samples and trains on its slice of the prompts (whole groups; the seeds one
        process's); the loss is this rank's part (the StepRunner sums them), the rest the batch's."""
        t0 = time.perf_counter()
        G, (lo, hi) = self.G, self.world.span(len(prompts))
        each = [p for p in prompts[lo:hi] for _ in range(G)]              # (ids, line) of each completion
        seeds = np.random.SeedSequence([self.seed, *self.position]).generate_state(len(prompts) * G)[lo * G:]
        comps = model.generate_batch([ids for ids, _ in each], self.max_len, self.temperature, self.top_p,
                                     seeds[:len(each)], self.tok.eos_id, self.top_k,
                                     fixed=None if self.graphs else False) if each else []
        got = self.rewarded(each, comps)                                  # (functions, completions)
        total = np.nansum(got * self.weights[:, None], axis=0)
        whole = self.pool(each, comps, got, total)
        adv = advantages(total, G, self.scale, whole["std"])
        t1 = time.perf_counter()
        # rows of prompt + completion, the completion's tokens learned (its prompt's predict nothing)
        rows = [Sample(np.asarray(list(p) + list(c), np.int32), np.arange(len(p) + len(c)) >= len(p))
                for (p, _), c in zip(each, comps)]
        loss, metrics = 0.0, {}
        if rows:  # with dropout padded as the whole batch: the rank's rows then draw one process's masks
            ids, tg = pad_batch(rows, self.tok.pad_id, int(whole["longest"]) if model.lora_config.dropout else 1)
            loss, metrics = grpo_step(model, ids, tg, adv, None, self.beta, self.eps_low, self.eps_high, self.loss_type,
                                      self.max_len, loss_scale=loss_scale,
                                      whole=(whole["completions"], whole["tokens"]), first_row=lo * G)
        else:
            skip_rows(model)
        metrics = pooled(self.world, metrics, "the grpo metrics")
        n = whole["completions"]
        metrics.update({"reward": whole["reward"] / n, "reward_std": whole["std"],
                        "completions/mean_length": whole["tokens"] / n,
                        "timing/generation_s": t1 - t0, "timing/training_s": time.perf_counter() - t1,
                        **{f"rewards/{name}/mean": whole[f"{name}/sum"] / whole[f"{name}/n"] if whole[f"{name}/n"]
                           else float("nan") for name, _ in self.rewards}})
        return loss, metrics, int(whole["tokens"])

    def rewarded(self, each, comps):
        """(functions, completions) float64: each function's rewards of the completions of `each`'s
        (ids, line), NaN where it answers None."""
        if not comps:  # a rank without prompts
            return np.zeros((len(self.rewards), 0))
        lines = [line for _, line in each]
        texts = [self.tok.decode(c) for c in comps]
        extra = {k: [ln[k] for ln in lines] for k in lines[0] if k != "prompt"}
        return np.array([[np.nan if v is None else float(v) for v in f(prompts=[ln["prompt"] for ln in lines],
                                                                      completions=texts, completion_ids=comps, **extra)]
                         for _, f in self.rewards], np.float64)

    def pool(self, each, comps, got, total):
        """The batch's sums over the ranks: completions, their tokens, rewards (each function's over the
        completions it rewarded), the longest row, and the total rewards' std about the batch's mean."""
        mine = {"completions": len(comps), "tokens": sum(map(len, comps)), "reward": float(total.sum()),
                "longest": max((len(p) + len(c) for (p, _), c in zip(each, comps)), default=0)}
        for (name, _), r in zip(self.rewards, got):
            mine.update({f"{name}/sum": float(np.nansum(r)), f"{name}/n": int(np.count_nonzero(~np.isnan(r)))})
        whole = pooled(self.world, mine, "the grpo rewards", most=("longest",))
        mean = whole["reward"] / whole["completions"]
        # a second sum, of squares about the batch's mean: sums of raw squares would cancel
        spread = pooled(self.world, {"sq": float(((total - mean) ** 2).sum())}, "the grpo reward std")["sq"]
        return dict(whole, std=float(np.sqrt(spread / (whole["completions"] - 1))))
