"""Long context (`krnl bench --workloads long`): the train workload (train.py) on its 8b shape,
Llama-3-8B's layer x8, at 16,384 and 32,768 tokens a row, batch 1, where a Mac or a smaller card
runs out of memory first. Every implementation checkpoints its layers, as such a run must:
krnl's grad_checkpoint, transformers' gradient_checkpointing_enable under PEFT eager, compiled
and with Liger's kernels, mlx-lm's grad_checkpoint, and Unsloth twice (its own "unsloth"
offloading and the standard checkpointing, like for like). The same rows as train, per length,
on one folder written for the longest; --quick runs the quick shape at two short lengths here.

--train-layers, --train-steps, --train-warmup and --train-batch apply as to train;
--train-seq N times one length instead of both."""

import tempfile
from pathlib import Path

from . import train
from .targets import is_gpu

SEQS = {"full": (16384, 32768), "quick": (40, 72)}
BASE = {"full": "8b", "quick": "quick"}
STEPS = {"full": dict(steps=5, warmup=2), "quick": dict(steps=2, warmup=1)}  # a 32k step takes seconds
SKIP = "the 8b shape at 16k and 32k tokens a row is sized for a GPU; --quick runs a small one here"


def shapes(quick, opts=None):
    """The shape of each length (train.shape's, with "ckpt"); opts: the --train-* options."""
    size = "quick" if quick else "full"
    opts = {k: v for k, v in (opts or {}).items() if v is not None and k not in ("shape", "gpus")}
    lengths = (opts.pop("seq"),) if "seq" in opts else SEQS[size]
    over = {**STEPS[size], "batch": 1, **opts}
    return [dict(train.shape(BASE[size], seq=T, **over), ckpt=True) for T in lengths]


def session_rows(session, opts, profile=False):
    """The rows a Session adds for the long workload, each with its length's "workload" (long
    16384, long 32768) and train.run's figures; with profile, the last length's krnl step's."""
    if not session.quick and not is_gpu(session.dev):
        return [dict(impl="krnl", status="skipped", reason=SKIP)]
    if (opts or {}).get("shape") or (opts or {}).get("gpus", 1) > 1:
        session.log("krnl bench: long: --train-shape and --gpus are the train workload's; long runs the 8b "
                    "shape on one device")
    ss = shapes(session.quick, opts)
    rows = []
    with tempfile.TemporaryDirectory(prefix="krnl-bench-long-") as tmp:
        folder = train.write_folder(dict(ss[0], T=max(s["T"] for s in ss)), Path(tmp) / "model")
        for s in ss:
            wl = f"long {s['T']}"
            session.log(f"krnl bench: {wl} ({train.describe(s)})")
            try:
                got = train.run(session.dev, session.dtype, s, session.peers, session.log, is_gpu(session.dev),
                                folder=folder, profile=profile and s is ss[-1])
            except RuntimeError as e:  # krnl failed at this length (out of memory, say): the next still runs
                got = [dict(impl="krnl", status="absent", reason=str(e)[:300])]
            title = f"Long-context training end to end ({train.describe(s)}; {session.dtype})"
            rows += [dict(r, workload=wl, title=title) for r in got]
    return rows
