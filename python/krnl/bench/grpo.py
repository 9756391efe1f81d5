"""The GRPO workload: G completions sampled for each of a few prompts, then one optimizer step of
GRPO on them, the two timed apart, on pref.py's model (the 1b shape, LoRA r=16 x7).

Generation: krnl's models.batch_decode.generate_batch (the LoRA on, one seed per row) next to
transformers' generate on the PEFT model (what TRL's GRPOTrainer calls without vLLM), with
num_return_sequences G: sampling at temperature 1 from the whole vocabulary (top-p 1, top-k off) on
both sides, and both generate exactly max_new tokens a row: the model has no EOS on either side
(krnl: eos_id None; transformers: eos_token_id None, and min_new_tokens = max_new_tokens besides),
checked on every output. Reported as completion tokens generated / generation time.

Training: on one batch of krnl's completions with random rewards (their group-normalised
advantages), krnl's train.grpo.grpo_step (loss dapo, beta 0, clipping 0.2, one pass: old = current)
and AdamW (lr 1e-4, clipping at 1), next to TRL's GRPOTrainer's loss (its compute_loss under the
trainer's autocast context, on the same tokens and advantages) with torch's AdamW alike. Reported
as the rows' prompt + completion tokens / step time."""

import gc

import numpy as np

from . import pref
from .qlora import krnl_clock, time_krnl, time_steps, time_torch, torch_clock, with_peer

SIZES = {
    "full": dict(shape="1b", prompts=2, G=8, prompt=64, completion=128, runs=2, steps=5, warmup=2),
    "quick": dict(shape="quick", prompts=2, G=4, prompt=6, completion=8, runs=1, steps=2, warmup=1),
}
TEMPERATURE, EPS, LOSS, SEED = 1.0, 0.2, "dapo", 0
SKIP = "sized for the H200 (the 1b shape); --quick runs a small one here"
ROWS = ("krnl generate", "krnl step", "HF generate", "TRL GRPO step")


def gen_counts(s):
    """The generation's sizes for qlora.time_steps: one warm-up run, then s["runs"] timed, each of
    prompts x G rows of s["completion"] new tokens."""
    return dict(warmup=1, steps=s["runs"], B=s["prompts"] * s["G"], T=s["completion"])


def step_counts(s):
    return dict(warmup=s["warmup"], steps=s["steps"], B=s["prompts"] * s["G"], T=s["prompt"] + s["completion"])


def seeds(s, run):
    return [int(x) for x in np.random.SeedSequence([SEED, run]).generate_state(s["prompts"] * s["G"])]


def check(got, s, who):
    """Raises unless `got` holds prompts x G completions of exactly s["completion"] tokens."""
    lengths = sorted({len(c) for c in got})
    if len(got) != s["prompts"] * s["G"] or lengths != [s["completion"]]:
        raise RuntimeError(f"[krnl bench] grpo: {who} generated {len(got)} rows of {lengths} tokens, expected "
                           f"{s['prompts'] * s['G']} of {s['completion']}")


def batch(s, prompts, completions, seed=0):
    """(ids, targets, advantages): the rows prompt + completion (each prompt's G rows together),
    the completion's tokens learned, random rewards' group-normalised advantages."""
    from ..train.grpo import advantages
    ids = np.concatenate([np.repeat(prompts, s["G"], axis=0), np.asarray(completions, np.int64)], axis=1)
    tg = np.full(ids.shape, -100, np.int64)
    tg[:, s["prompt"] - 1:-1] = ids[:, s["prompt"]:]
    rewards = np.random.default_rng(seed).standard_normal(len(ids))
    return ids, tg, advantages(rewards, s["G"])


def run_krnl(dev, s, prompts, dtype, log=print, profile=False):
    """(generation's figures, the step's, the batch trained on)."""
    from ..models.batch_decode import generate_batch
    from ..train.grpo import grpo_step
    model = pref.krnl_model(dev, s, dtype)
    rows = np.repeat(prompts, s["G"], axis=0).tolist()
    out = []

    def generate(run):
        got = generate_batch(model, rows, s["completion"], temperature=TEMPERATURE, top_p=1.0, top_k=0,
                             seeds=seeds(s, run), eos_id=None)
        check(got, s, "krnl")
        out[:] = got

    gen = time_steps(generate, list(range(1 + s["runs"])), gen_counts(s), krnl_clock(dev), log, "grpo krnl generate")
    b = batch(s, prompts, out)
    step = time_krnl(dev, model, step_counts(s), [b] * (s["warmup"] + s["steps"]), log, "grpo krnl step", profile,
                     objective=lambda m, x: grpo_step(m, *x, None, 0.0, EPS, EPS, LOSS, s["completion"])[0])
    del model
    gc.collect()
    dev.trim()
    return gen, step, b


def hf_generate(pm, s, prompts, on_gpu, log=print):
    """transformers' generate on the PEFT model: prompts x G rows of exactly s["completion"] tokens."""
    import torch
    import transformers
    cfg = transformers.GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_p=1.0, top_k=0,
                                        max_new_tokens=s["completion"], min_new_tokens=s["completion"],
                                        num_return_sequences=s["G"], eos_token_id=None, pad_token_id=0, use_cache=True)
    x = torch.as_tensor(prompts, dtype=torch.long, device="cuda" if on_gpu else "cpu")
    pm.eval()

    def generate(run):
        torch.manual_seed(SEED + run)
        with torch.no_grad():
            got = pm.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=cfg)
        check(got[:, x.shape[1]:], s, "transformers")

    return time_steps(generate, list(range(1 + s["runs"])), gen_counts(s), torch_clock(torch, on_gpu), log,
                      "grpo transformers generate")


def trl_step(pm, s, b, on_gpu, log=print):
    """TRL GRPOTrainer's loss on the batch b (ids, targets, advantages), backward, torch's AdamW."""
    import torch
    rows, Tp = len(b[0]), s["prompt"]
    tr = pref.trl_trainer("grpo", s, pm, on_gpu, rows, num_generations=s["G"], max_completion_length=s["completion"],
                          loss_type=LOSS, beta=0.0, epsilon=EPS, temperature=TEMPERATURE)
    t = lambda a, dt=torch.long: torch.as_tensor(a, dtype=dt, device="cuda" if on_gpu else "cpu")
    ones = np.ones(b[0].shape, np.int64)
    inputs = {"prompt_ids": t(b[0][:, :Tp]), "prompt_mask": t(ones[:, :Tp]), "completion_ids": t(b[0][:, Tp:]),
              "completion_mask": t(ones[:, Tp:]), "advantages": t(b[2], torch.float32),
              "num_items_in_batch": t(rows * s["completion"])}

    def fwd_bwd(inp):
        with tr.compute_loss_context_manager():  # the autocast Trainer.training_step runs the loss under
            loss = tr.compute_loss(pm, inp)
        loss.backward()
        return loss

    res = time_torch(pm, step_counts(s), [inputs] * (s["warmup"] + s["steps"]), on_gpu, log, "grpo TRL step",
                     fwd_bwd=fwd_bwd)
    del tr
    return res


def run_peers(s, prompts, b, on_gpu, log=print):
    """The transformers generate row and the TRL step row, each measured against its krnl row."""
    pm = pref.peft_model(s, on_gpu)
    gen = pref.peer_rows(ROWS[2], lambda: dict(impl=ROWS[2], base=0, note=pref.versions(),
                                               **hf_generate(pm, s, prompts, on_gpu, log)), trl=False)
    step = pref.peer_rows(ROWS[3], lambda: dict(impl=ROWS[3], base=1, **trl_step(pm, s, b, on_gpu, log)))
    return [gen, step]


def run(dev, dtype="bf16", quick=False, peers=True, log=print, profile=False):
    """Rows for the session: krnl's generation and step, then transformers' generation and TRL's
    step where torch and PEFT (and TRL for the step) import."""
    s = SIZES["quick" if quick else "full"]
    prompts = pref.tokens(np.random.default_rng(SEED), s, s["prompts"], s["prompt"])
    n = s["prompts"] * s["G"]
    desc = (f"GRPO, {s['prompts']} prompts of {s['prompt']} tokens x G={s['G']}: generate = {n} x {s['completion']} "
            f"sampled tokens (temperature 1, no EOS), completion tokens/s; step = loss {LOSS} beta 0 + AdamW, "
            f"tokens/s of the {n} rows' {s['prompt'] + s['completion']}; {pref.describe(s)}")
    gen, step, b = run_krnl(dev, s, prompts, dtype, log, profile)
    rows = [dict(impl=ROWS[0], title=desc, **gen), dict(impl=ROWS[1], **step)]
    peer = lambda on_gpu: pref.peer_rows("HF + PEFT", lambda: run_peers(s, prompts, b, on_gpu, log), trl=False)
    return with_peer(rows, dev, peers, peer, first=2, name="HF + PEFT")
