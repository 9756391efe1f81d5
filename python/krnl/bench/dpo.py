"""The DPO workload: one optimizer step of DPO (sigmoid loss, beta 0.1) on P pairs of a prompt and
two completions, the 2P rows (chosen first) of prompt + completion tokens, on pref.py's model (the
1b shape, LoRA r=16 x7). krnl: krnl.train.preference's Pairwise objective (the policy's forward and
backward, the reference's forward with the adapter off) and AdamW (lr 1e-4, clipping at 1). Next
to TRL's DPOTrainer on transformers + PEFT in bf16, the reference computed at each step as well
(precompute_ref_log_probs off: the adapter disabled), no gradient checkpointing; its step is the
trainer's training_step on batches its collator made before the timing, then torch's AdamW with
the same settings. Both sides train on the same token ids; tokens/s counts the 2P rows' tokens."""

import gc

import numpy as np

from . import pref
from .qlora import time_krnl, time_torch, with_peer

SIZES = {
    "full": dict(shape="1b", P=4, prompt=256, completion=256, steps=10, warmup=3),
    "quick": dict(shape="quick", P=2, prompt=8, completion=8, steps=3, warmup=1),
}
BETA = 0.1
SKIP = "sized for the H200 (the 1b shape); --quick runs a small one here"
TRL_ROW = "TRL DPOTrainer"


class Pairs:
    """One step's P pairs of token ids: prompt (P, Tp), chosen and rejected completions (P, Tc)."""

    def __init__(self, prompt, chosen, rejected):
        self.prompt, self.chosen, self.rejected = prompt, chosen, rejected

    def rows(self):
        """(ids, targets) (2P, Tp + Tc) as krnl's Pairwise takes them: chosen rows first, each row's
        targets its completion's tokens at the positions that predict them (the rest -100)."""
        Tp = self.prompt.shape[1]
        ids = np.concatenate([np.concatenate([self.prompt, c], axis=1) for c in (self.chosen, self.rejected)])
        tg = np.full(ids.shape, -100, np.int64)
        tg[:, Tp - 1:-1] = ids[:, Tp:]
        return ids, tg

    def examples(self):
        """TRL's tokenized examples, what its DataCollatorForPreference takes."""
        return [{"prompt_ids": p.tolist(), "chosen_ids": c.tolist(), "rejected_ids": r.tolist()}
                for p, c, r in zip(self.prompt, self.chosen, self.rejected)]


def batches(s, seed=0):
    rng = np.random.default_rng(seed)
    P, Tp, Tc = s["P"], s["prompt"], s["completion"]
    return [Pairs(pref.tokens(rng, s, P, Tp), pref.tokens(rng, s, P, Tc), pref.tokens(rng, s, P, Tc))
            for _ in range(s["warmup"] + s["steps"])]


def counts(s):
    """The timing's sizes (qlora.time_steps): 2P rows of prompt + completion tokens a step."""
    return dict(s, B=2 * s["P"], T=s["prompt"] + s["completion"])


def run_krnl(dev, s, bs, dtype, log=print, profile=False):
    from ..train.preference import Pairwise
    model = pref.krnl_model(dev, s, dtype)
    objective = Pairwise("dpo", BETA, "sigmoid")
    res = time_krnl(dev, model, counts(s), [b.rows() for b in bs], log, "dpo krnl", profile,
                    objective=lambda m, x: objective.run(m, x)[0])
    del model
    gc.collect()
    dev.trim()
    return res


def run_trl(s, bs, on_gpu, log=print):
    pm = pref.peft_model(s, on_gpu)
    tr = pref.trl_trainer("dpo", s, pm, on_gpu, s["P"], beta=BETA, max_length=s["prompt"] + s["completion"],
                          precompute_ref_log_probs=False)
    collated = [tr.data_collator(b.examples()) for b in bs]  # a DataLoader's work, done before the timing
    res = time_torch(pm, counts(s), collated, on_gpu, log, "dpo " + TRL_ROW,
                     fwd_bwd=lambda b: tr.training_step(pm, b))
    del tr, pm
    return dict(impl=TRL_ROW, note=pref.versions(), **res)


def run(dev, dtype="bf16", quick=False, peers=True, log=print, profile=False):
    """Rows for the session: krnl, then TRL's DPOTrainer where torch, PEFT and TRL import."""
    s = SIZES["quick" if quick else "full"]
    bs = batches(s)
    desc = (f"DPO sigmoid beta {BETA}, {s['P']} pairs of prompt {s['prompt']} + completion {s['completion']} "
            f"(tokens/s of the {2 * s['P']} rows); {pref.describe(s)}; policy and reference (adapter off) + AdamW")
    rows = [dict(impl="krnl", title=desc, **run_krnl(dev, s, bs, dtype, log, profile))]
    return with_peer(rows, dev, peers, lambda on_gpu: pref.peer_rows(TRL_ROW, lambda: run_trl(s, bs, on_gpu, log)),
                     name=TRL_ROW)
