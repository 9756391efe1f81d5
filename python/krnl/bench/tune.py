"""GEMM tuning (`krnl tune`): which of a device's GEMM variants (metal/gemm.metal says what each
trades) runs fastest for each shape class, measured on the user's GPU and kept in a JSON cache
keyed by GPU name and OS version (docs/architecture.md, 'GEMM variants and krnl tune').

Only a device whose capabilities say `gemm_tuning` (a real Metal GPU) is ever timed: never the
simulator, the CPU or CUDA, and never inside a step. Without a cache entry every class runs the
default variant (the first of `Device.gemm_variants()`); a cache that cannot be read is ignored
with a one-line note."""

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import krnl

from ..io.fileio import atomic_write_bytes

ops = krnl.ops

CACHE_NAME = "gemm_tuning.json"
FORMAT = 1
FORMS = ("nn", "nt", "tn")
# One model-like product (M, N, K) per size bucket of Device.gemm_shape_class, per form: skinny is
# a LoRA product with the rank as N (x A^T) or, for tn, as M (dA = dt^T x); shallow has the rank
# as K (t B^T); medium and large are frozen projections of a short and a long batch.
SHAPES = {
    "skinny": {"nn": (2048, 16, 2048), "nt": (2048, 16, 2048), "tn": (16, 2048, 2048)},
    "shallow": {f: (2048, 2048, 16) for f in FORMS},
    "medium": {f: (512, 1024, 1024) for f in FORMS},
    "large": {f: (2048, 2048, 2048) for f in FORMS},
}
# A variant replaces the default only when its median is this much faster: timing noise alone
# never switches kernels.
MARGIN = 0.02


def note(msg):
    print(f"krnl: {msg}", file=sys.stderr)


def first_line(err):
    return (str(err).splitlines() or [type(err).__name__])[0]


def tunable(dev):
    """Whether timing dev's GEMM variants measures a real GPU (its capabilities say so)."""
    return bool(dev.capabilities().get("gemm_tuning")) and len(dev.gemm_variants()) > 1


def cache_path():
    """$KRNL_CACHE/gemm_tuning.json, else ~/.cache/krnl/gemm_tuning.json."""
    root = os.environ.get("KRNL_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "krnl") / CACHE_NAME


def os_version():
    mac = platform.mac_ver()[0]
    return f"macOS {mac}" if mac else f"{platform.system()} {platform.release()}"


def cache_key(dev, os_ver=None):
    """'<GPU name> | <OS version>': a new GPU or OS (new drivers, a new Metal compiler) tunes again."""
    gpu = dev.capabilities()["details"].get("gpu", dev.name)
    return f"{gpu} | {os_ver if os_ver is not None else os_version()}"


def plan(dev, dtypes):
    """[(shape class, (M, N, K), trans_a, trans_b, operand dtype, C dtype)] covering every class of
    `dtypes`: C in the operand dtype, and in f32 for half operands (the LoRA gradients)."""
    out = []
    for dt in dtypes:
        for cdt in [dt] + (["f32"] if dt != "f32" else []):
            for form in FORMS:
                ta, tb = form[0] == "t", form[1] == "t"
                for size, shapes in SHAPES.items():
                    M, N, K = shapes[form]
                    cls = dev.gemm_shape_class(M, N, K, ta, tb, dt, cdt)
                    out.append((cls, (M, N, K), ta, tb, dt, cdt))
    return out


def device_timer(dev):
    """timer(run, shape class, variant) -> seconds of dev's own time for run()'s ops: on Metal the
    GPU's timestamps (while profiling, each record runs alone in a command buffer), so that the
    host's commit and wait do not blur small products; elsewhere the ops' host time."""
    def timer(run, shape_class, variant):
        with krnl.profile(dev) as prof:
            run()
        return (prof.op_ms if prof.records else prof.wall_ms) / 1e3

    return timer


def wall_timer(run, shape_class, variant):
    """Seconds one synchronised run() takes, host overhead included."""
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def measure(dev, dtypes, timer=None, warmup=2, repeats=5, log=None):
    """{shape class: {variant: median seconds}} of every class of `dtypes` and every variant of
    dev: `warmup` runs (pipeline builds, first touches) left out, the median of `repeats`. timer
    (run, shape class, variant) -> seconds, device_timer(dev) by default; tests pass a fake one.
    A variant that fails (a kernel the GPU's compiler refuses) is left out with a note. dev's
    choice table is restored."""
    timer = timer or device_timer(dev)
    saved = dict(dev.gemm_choices())
    rng = np.random.default_rng(0)
    results = {}
    try:
        for cls, (M, N, K), ta, tb, dt, cdt in plan(dev, dtypes):
            A = dev.tensor(rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32), dt)
            B = dev.tensor(rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32), dt)
            C = dev.empty((M, N), cdt)

            def run():
                with dev.step():
                    ops.gemm(A, B, C, trans_a=ta, trans_b=tb, split_k=1)
                dev.synchronize()

            times = {}
            for v in dev.gemm_variants():
                dev.set_gemm_choice(cls, v)
                try:
                    t = [timer(run, cls, v) for _ in range(warmup + repeats)][warmup:]
                except Exception as e:  # noqa: BLE001 - any failure rules the variant out, not the tuning
                    note(f"GEMM variant {v} failed on {cls} ({M}x{N}x{K}), left out: {first_line(e)}")
                    if not times:  # the default failed: nothing to compare with, the class keeps it
                        break
                    continue
                times[v] = statistics.median(t)
            results[cls] = times
            if log:
                log(cls, (M, N, K), times, winner(times, dev.gemm_variants()[0]))
    finally:
        dev.clear_gemm_choices()
        for cls, v in saved.items():
            dev.set_gemm_choice(cls, v)
    return results


def winner(times, default):
    """The fastest variant; the default unless another beats it by MARGIN (None: nothing ran)."""
    if not times:
        return None
    best = min(times, key=times.get)
    if default in times and times[best] >= times[default] * (1 - MARGIN):
        return default
    return best


def read_cache(path=None):
    """{key: {"choices": {class: variant}, ...}} from the cache file; {} when there is none, or
    with a one-line note when it cannot be used."""
    path = Path(path) if path is not None else cache_path()
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):  # no cache (yet)
        return {}
    except (OSError, UnicodeDecodeError, ValueError) as e:
        note(f"ignoring the GEMM tuning cache {path}: {first_line(e)}")
        return {}
    entries = d.get("entries") if isinstance(d, dict) and d.get("format") == FORMAT else None
    if not isinstance(entries, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("choices"), dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in e["choices"].items())
            for e in entries.values()):
        note(f"ignoring the GEMM tuning cache {path}: not a krnl GEMM tuning cache of format {FORMAT}")
        return {}
    return entries


def load(dev, path=None):
    """Sets dev's choice table from this GPU's cache entry; the entry's classes (set() where there
    is none, or dev is not tunable). An entry this build cannot apply (a variant or class it does
    not know) is ignored with a note."""
    if not tunable(dev):
        return set()
    key = cache_key(dev)
    entry = read_cache(path).get(key)
    if entry is None:
        return set()
    try:
        for cls, v in entry["choices"].items():
            dev.set_gemm_choice(cls, v)
    except ValueError as e:
        dev.clear_gemm_choices()
        note(f"ignoring the GEMM tuning cache entry for {key}: {e}")
        return set()
    return set(entry["choices"])


def store(dev, choices, path=None):
    """Merges `choices` into this GPU's cache entry, written atomically (the user's umask); the
    path, or None with a note where it cannot be written (the choices still apply this run)."""
    path = Path(path) if path is not None else cache_path()
    entries = read_cache(path)
    key = cache_key(dev)
    old = entries.get(key, {}).get("choices", {})
    entries[key] = {"choices": {**old, **choices}, "variants": list(dev.gemm_variants()), "krnl": krnl.__version__}
    text = json.dumps({"format": FORMAT, "entries": entries}, indent=1, sort_keys=True) + "\n"
    try:
        atomic_write_bytes(path, text.encode("utf-8"))
    except OSError as e:
        note(f"could not save the GEMM tuning to {path} (it applies to this run only): {e}")
        return None
    return path


def tune(dev, dtypes, timer=None, path=None, warmup=2, repeats=5, log=None):
    """Measures every class of `dtypes`, stores the winners and applies them to dev: ({class:
    variant}, the cache file, None where it could not be written)."""
    results = measure(dev, dtypes, timer, warmup, repeats, log)
    default = dev.gemm_variants()[0]
    choices = {cls: w for cls, times in results.items() if (w := winner(times, default)) is not None}
    saved = store(dev, choices, path)
    for cls, v in choices.items():
        dev.set_gemm_choice(cls, v)
    return choices, saved


def ensure_tuned(dev, dtype, no_tune=False, timer=None, path=None):
    """train's step zero: 'skipped' (--no-tune, or dev not tunable), 'cached' (this GPU's entry
    covers dtype's classes: applied) or 'tuned' (measured now, with a note saying so)."""
    if not tunable(dev):
        return "skipped"
    have = load(dev, path)
    if no_tune or dtype not in dev.capabilities()["dtypes"]:  # no kernels: the run fails on its own
        return "skipped"
    if {p[0] for p in plan(dev, [dtype])} <= have:
        return "cached"
    note(f"timing the GEMM variants for {dtype} on {cache_key(dev)}, once for this GPU (--no-tune skips it, "
         f"`krnl tune` redoes it)")
    tune(dev, [dtype], timer=timer, path=path)
    return "tuned"


def cmd_tune(args):
    dev = krnl.device(args.device)
    if not tunable(dev):
        print(f"krnl tune: {dev.name} has no GEMM variants worth timing (its capabilities' gemm_tuning is off: "
              f"only a Metal GPU is tuned)", file=sys.stderr)
        return 1
    have = dev.capabilities()["dtypes"]
    if args.dtype and args.dtype not in have:
        print(f"krnl tune: {dev.name} has no {args.dtype} kernels (its dtypes: {', '.join(have)})", file=sys.stderr)
        return 1
    dtypes = [args.dtype] if args.dtype else list(have)

    def log(cls, shape, times, best):
        cols = "  ".join(f"{v} {t * 1e3:8.3f} ms" for v, t in times.items())
        print(f"{cls:22} {'x'.join(map(str, shape)):>14}  {cols}  -> {best}", flush=True)

    print(f"krnl tune on {cache_key(dev)}: median of {args.repeats} runs per variant")
    choices, saved = tune(dev, dtypes, repeats=args.repeats, log=log)
    default = dev.gemm_variants()[0]
    changed = sum(v != default for v in choices.values())
    print(f"{len(choices)} shape classes, {changed} not on {default}" + (f"; saved to {saved}" if saved else ""))
    return 0 if saved else 1
