"""The fastest LoRA trainers people use, as peers of the train, long and qlora workloads:

- Liger: liger_kernel.transformers.apply_liger_kernel_to_llama with its defaults (RoPE, RMSNorm,
  SwiGLU and the fused linear cross entropy, which takes labels and never forms the logits) on
  transformers + PEFT, set up as the PEFT rows are (train_peers.peft_model, qlora.peft_model).
- Unsloth: FastLanguageModel.from_pretrained and get_peft_model with the recipe's rank, alpha and
  seven projections, in two rows: "Unsloth" with the gradient checkpointing its docs recommend
  ("unsloth": the saved layer inputs offloaded to host memory), and "Unsloth ckpt off" (or "on"
  where the workload checkpoints, the long rows) like for like with the other rows.

Both patch transformers for their whole process (Liger's apply replaces modeling_llama's classes,
importing Unsloth rewrites transformers' functions), which would change every row after theirs:
each row runs in a process of its own (fast_worker.py, through spawn.launch) on the same folder and
batches, its figures back as JSON. Each row is labelled with its package's version (the note and
"version"); one that cannot run is a row with the reason: not selected (--peers), not installed,
no CUDA device (both are Triton GPU kernels), or what failed."""

import importlib.metadata
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from .spawn import launch
from .targets import kind

# --peers name -> (the module the row imports, the distribution whose version labels it)
PACKAGES = {"liger": ("liger_kernel", "liger-kernel"), "unsloth": ("unsloth", "unsloth")}
# the device kinds each runs on, and why only there
KINDS = {"liger": ("cuda",), "unsloth": ("cuda",)}
WHY = {"liger": "Liger's kernels are Triton GPU kernels",
       "unsloth": "Unsloth's kernels are Triton GPU kernels (without a GPU it falls back to stock transformers + "
                  "PEFT, the PEFT eager row)"}
# The worker's environment: the GPU machines reach no network (no Hub lookups, no usage
# statistics); Unsloth writes its compiled modules under the scratch folder, not the working one.
ENV = {"HF_HUB_OFFLINE": "1", "UNSLOTH_DISABLE_STATISTICS": "1"}
WORKER = ["-m", "krnl.bench.fast_worker"]


def rows_of(s):
    """(impl, --peers name, gradient checkpointing) of each row on shape s; s["ckpt"]: the
    workload checkpoints its rows (long), and the like-for-like Unsloth row with them."""
    ckpt = bool(s.get("ckpt"))
    return [("PEFT+Liger", "liger", ckpt), ("Unsloth", "unsloth", "unsloth"),
            (f"Unsloth ckpt {'on' if ckpt else 'off'}", "unsloth", ckpt)]


def available(sel, device_kind):
    """(version, None) where peer `sel` can run on krnl's device kind; else (version or None,
    why not). Nothing is imported: importing Unsloth patches transformers for this process."""
    mod, dist = PACKAGES[sel]
    try:
        found = importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return None, f"not installed (no module {mod!r}); pip install {dist}"
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    if device_kind not in KINDS[sel]:
        return version, f"{dist} {version}: {WHY[sel]}, CUDA devices only (this run: {device_kind})"
    return version, None


def save_batches(bs, path):
    """The batches as the worker reads them: train.Batch rows (ids and lengths) or id arrays."""
    if hasattr(bs[0], "lengths"):
        np.savez(path, ids=np.stack([b.ids for b in bs]), lengths=np.stack([b.lengths for b in bs]))
    else:
        np.savez(path, ids=np.stack([np.asarray(b) for b in bs]))
    return str(path)


def worker_env(scratch):
    """ENV, Unsloth's cache folder, and krnl importable in the worker wherever it was found here."""
    here = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(x for x in (here, os.environ.get("PYTHONPATH")) if x)
    return dict(ENV, UNSLOTH_COMPILE_LOCATION=str(Path(scratch) / "unsloth_compiled_cache"), PYTHONPATH=path)


def run_row(spec, impl, version, log):
    """One row from its worker: the figures with the version, or absent with the reason."""
    dist = PACKAGES[spec["peer"]][1]
    try:
        r = launch([sys.executable] + WORKER, spec, log, env=worker_env(spec["scratch"]), window=True)
    except Exception as e:  # listed with what broke; the other rows still run
        return dict(impl=impl, status="absent", reason=f"failed ({dist} {version}): {e}"[:300])
    if "unavailable" in r:
        return dict(impl=impl, status="absent", reason=f"{dist} {version}: {r['unavailable']}"[:300])
    r.update(version=version, note="; ".join(x for x in (f"{dist} {version}", r.get("note")) if x))
    log(f"krnl bench: {spec['workload']} {impl}: {r['tokens_per_s']:,.0f} tokens/s, loss {r['loss']:.4f}")
    return dict(impl=impl, **r)


def rows(workload, device_name, dtype, s, bs, peers, log=print, folder=None, selected_only=False):
    """The rows of workload "train" (its long rows too: `folder`, the model every row trains) or
    "qlora" (no folder: Unsloth's worker writes the bf16 model it quantizes on loading, once for
    both rows). selected_only: no row for a peer not asked for (qlora lists none)."""
    k = kind(device_name)
    out = []
    with tempfile.TemporaryDirectory(prefix="krnl-bench-peers-") as tmp:
        spec = dict(workload=workload, shape=s, dtype=dtype, device=device_name, kind=k, scratch=tmp,
                    folder=str(folder or Path(tmp) / "model"))
        for impl, sel, ckpt in rows_of(s):
            if sel not in peers:
                if not selected_only:
                    out.append(dict(impl=impl, status="absent", reason="not selected (--peers)"))
                continue
            version, why = available(sel, k)
            if why:
                out.append(dict(impl=impl, status="absent", reason=why))
                continue
            if "batches" not in spec:
                spec["batches"] = save_batches(bs, Path(tmp) / "batches.npz")
            out.append(run_row(dict(spec, peer=sel, ckpt=ckpt), impl, version, log))
    return out


def run_all(device_name, dtype, folder, s, bs, peers, log=print):
    """train.run's rows of these peers (train_peers.run_all's arguments)."""
    return rows("train", device_name, dtype, s, bs, peers, log, folder=folder)


def qlora_rows(device_name, s, batches, peers, log=print):
    """qlora.run's rows of the peers selected: bf16 compute on a 4-bit base (bitsandbytes NF4)."""
    return rows("qlora", device_name, "bf16", s, batches, peers, log, selected_only=True)
