"""A training run's output folder (--adapter-path): the exclusive writer lock, the refusal of a new
run into a folder that holds another run, --overwrite, the repair of metrics.jsonl on resume
(rows past the checkpoint and a torn last line dropped) and the comparison of a resumed run's
options with the checkpoint's.

The lock is an flock on `.krnl-train.lock` inside the folder: the OS drops it when the process
ends, however it ends, so a crash never leaves a stale lock; the file holds the holder's pid for
the refusal message. The file itself stays (removing it would let two writers lock two files)."""

import json
import os
import shutil
from pathlib import Path

from .checkpoint import list_checkpoints
from .fileio import atomic_write_bytes

LOCK_NAME = ".krnl-train.lock"
METRICS = "metrics.jsonl"
# What a krnl run writes into its folder (besides checkpoints/): what --overwrite removes.
RUN_FILES = (METRICS, "loss.png", "adapter_model.safetensors", "adapter_config.json")

# TrainConfig fields and run options as the command line spells them.
FLAGS = {"batch_size": "--batch-size", "grad_accum": "--grad-accumulation", "learning_rate": "--learning-rate",
         "warmup": "--warmup", "schedule": "--lr-schedule", "min_lr_ratio": "min_lr_ratio",
         "weight_decay": "--weight-decay", "max_grad_norm": "--max-grad-norm", "seed": "--seed",
         "val_batches": "val_batches", "data": "--data", "data_sha256": "--data (train.jsonl contents)",
         "max_seq_length": "--max-seq-length", "mask_prompt": "--mask-prompt", "pack": "--pack",
         "train_samples": "--train-samples", "iters": "--iters", "length_bucket": "--length-bucket",
         "graphs": "--no-graphs", "reduce_order": "--reduce-order", "optimizer": "--optimizer", "betas": "--betas",
         "eps": "--eps", "momentum": "--momentum", "dampening": "--dampening", "nesterov": "--nesterov",
         "beta2_decay": "--beta2-decay", "clip_threshold": "--clip-threshold", "relative_step": "--relative-step",
         "ns_steps": "--ns-steps", "adjust_lr_fn": "--adjust-lr-fn", "loraplus_lr_ratio": "--loraplus-lr-ratio",
         "min_8bit_size": "--min-8bit-size"}
# Options that may differ on resume without --resume-override: how long to train (the schedule is
# stretched), how often to validate and save, and how the step runs (padding, graphs, the order of
# the gradients' sums over rows), which do not change the training itself (f32 rounding aside).
FREE = ("iters", "val_every", "save_every", "keep_checkpoints", "length_bucket", "graphs", "reduce_order")

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no locking
    fcntl = None


class FolderLock:
    """The exclusive lock of one run folder; release() (or process exit) frees it."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd = None

    def acquire(self):
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                try:
                    holder = os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
                finally:
                    os.close(fd)
                raise ValueError(f"[train] {self.folder} is in use by another krnl train (pid {holder}, lock file "
                                 f"{self.path}); wait for it to finish or choose another --adapter-path") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self):
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self):
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        self.release()


def occupant(folder):
    """A description of the earlier run in `folder` (its checkpoints, metrics or adapter), or None."""
    folder = Path(folder)
    found = list_checkpoints(folder / "checkpoints")
    if found:
        return f"the checkpoints of another run (newest: step {found[-1][0]})"
    present = [n for n in (METRICS, "adapter_model.safetensors") if (folder / n).exists()]
    return f"another run's {' and '.join(present)}" if present else None


def claim(folder, resume=False, overwrite=False):
    """Locks `folder` for this run and returns the FolderLock. A new run (not resume) into a folder
    that holds another run is refused unless overwrite, which removes that run's files first."""
    if resume and overwrite:
        raise ValueError("[train] --overwrite starts a new run and --resume continues one: choose one")
    lock = FolderLock(folder).acquire()
    try:
        if not resume:
            what = occupant(folder)
            if what is not None and not overwrite:
                raise ValueError(f"[train] {folder} holds {what}; continue it with --resume, start over with "
                                 f"--overwrite (removes it), or choose another --adapter-path")
            if what is not None:
                remove_run(folder)
    except BaseException:
        lock.release()
        raise
    return lock


def remove_run(folder):
    """Removes what a krnl run wrote into `folder` (checkpoints/ and RUN_FILES) and nothing else.
    checkpoints/ is first renamed aside, so an interruption never leaves half a checkpoint tree."""
    folder = Path(folder)
    ck = folder / "checkpoints"
    if ck.is_dir():
        trash = folder / f".krnl-overwritten-{os.getpid()}"
        os.replace(ck, trash)
        shutil.rmtree(trash)
    for name in RUN_FILES:
        try:
            os.remove(folder / name)
        except FileNotFoundError:
            pass


def repair_metrics(path, step):
    """Drops the rows of metrics file `path` past `step` (the interrupted run's, to be replayed)
    and a torn last line (a write cut short); rewrites the file atomically when anything was
    dropped. Returns a note on the torn line, or None. A malformed line before the last is an
    error naming the file and line."""
    path = Path(path)
    if not path.exists():
        return None
    lines = path.read_bytes().split(b"\n")
    keep, note, dropped = [], None, False
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("no step")
        except ValueError:
            if i == last:
                note = f"dropped the torn last line of {path} (line {i + 1}: {raw[:40]!r})"
                dropped = True
                continue
            raise ValueError(f"[train] {path}: line {i + 1} is not a metrics row; remove it to resume") from None
        if row["step"] > step:
            dropped = True
            continue
        keep.append(raw.decode("utf-8"))
    if dropped:
        # atomically, keeping the file's permission bits (the user's umask at its creation)
        atomic_write_bytes(path, "".join(ln + "\n" for ln in keep).encode(), mode=os.stat(path).st_mode & 0o7777)
    return note


def _show(v):
    return repr(v) if isinstance(v, str) else str(v)


def option_changes(saved, current):
    """{name: (saved value, current value)} of the options (TrainConfig fields and run options)
    that differ, leaving out FREE ones and ones the checkpoint does not record."""
    return {k: (saved[k], current[k]) for k in current
            if k not in FREE and k in saved and json.loads(json.dumps(saved[k])) != json.loads(json.dumps(current[k]))}


def describe(changes):
    """'--learning-rate 0.003 -> 0.001, --seed 0 -> 1' for option_changes' result."""
    return ", ".join(f"{FLAGS.get(k, k)} {_show(a)} -> {_show(b)}" for k, (a, b) in changes.items())
