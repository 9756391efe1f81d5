"""The control gate: one sgemm timed before and after a session, and against the reference stored
for this machine by `krnl bench --calibrate`. A session whose control moved more than TOLERANCE,
or sits more than TOLERANCE off the reference, is untrusted: the machine was not what it was."""

import json
import os
import platform
import time
from pathlib import Path

import numpy as np

import krnl
from krnl.io.fileio import atomic_write_bytes, read_json_object
from .targets import is_gpu
from .workloads import gemm_fn

TOLERANCE = 0.10
WHO = "krnl bench"


def control_size(device, quick=False):
    """1024^3 on the CPU (about 15 ms at 140 GFLOP/s), 4096^3 on a GPU; 256^3 for --quick."""
    if quick:
        return 256
    return 4096 if is_gpu(device) else 1024


def measure_control(dev, n, reps=9):
    """Median GFLOP/s of n^3 sgemm on `dev` over `reps` timed calls after one warm-up."""
    run = gemm_fn(dev, n, n, n, False, False)  # f32 whatever the session's dtype: one control per machine
    times = []
    time.sleep(0.3)  # as between timed steps (session.SETTLE_S): the last workload's BLAS workers may still spin
    for i in range(reps + 1):
        t0 = time.perf_counter()
        run()
        if i:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / float(np.median(times)) / 1e9


def _cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint(device_name):
    """What the reference is keyed by: a different CPU, core count, thread count or device is a
    different machine."""
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "threads": krnl.num_threads(), "device": device_name}


def fingerprint_key(fp):
    return f"{fp['cpu']} | {fp['cores']} cores | {fp['threads']} threads | {fp['device']}"


def reference_path():
    """KRNL_BENCH_REFERENCE, else $XDG_CACHE_HOME/krnl/bench_reference.json (~/.cache by default)."""
    env = os.environ.get("KRNL_BENCH_REFERENCE")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "krnl" / "bench_reference.json"


def load_references(path):
    """{fingerprint key: {"n", "gflops", "date"}}; {} if the file does not exist. A file that is
    there but unreadable is an error naming it: a silently ignored reference would mean an
    unchecked session."""
    path = Path(path)
    if not path.exists():
        return {}
    refs = read_json_object(path, WHO)
    for key, ref in refs.items():
        if not (isinstance(ref, dict) and isinstance(ref.get("n"), int) and isinstance(ref.get("gflops"), (int, float))):
            raise ValueError(f"[{WHO}] {path}: entry {key!r} must be an object with 'n' (int) and 'gflops' "
                             f"(number); delete the file and run `krnl bench --calibrate`")
    return refs


def lookup_reference(path, fp, n):
    """The stored GFLOP/s of this machine's n^3 control, or None."""
    ref = load_references(path).get(fingerprint_key(fp))
    return ref if ref and ref["n"] == n else None


def calibrate(dev, path, quick=False, measure=measure_control):
    """Measures the control twice and stores it as this machine's reference (atomically). Refuses
    when the two measurements differ by more than TOLERANCE: a busy machine is no reference."""
    fp = fingerprint(dev.name)
    n = control_size(dev, quick)
    first, second = measure(dev, n), measure(dev, n)
    moved = abs(second - first) / max(first, second)
    if moved > TOLERANCE:
        raise ValueError(f"[{WHO}] --calibrate: the control {n}^3 sgemm moved {100 * moved:.0f}% between two "
                         f"measurements ({first:.1f} -> {second:.1f} GFLOP/s); the machine is busy, nothing stored")
    refs = load_references(path)
    gflops = (first + second) / 2
    refs[fingerprint_key(fp)] = {"n": n, "gflops": round(gflops, 3), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                 **fp}
    atomic_write_bytes(path, (json.dumps(refs, indent=2, sort_keys=True) + "\n").encode())
    return {"n": n, "gflops": gflops, "key": fingerprint_key(fp), "path": str(path)}


def verdict(before, after, reference, n, tolerance=TOLERANCE, between=()):
    """The gate's decision from the control's GFLOP/s before and after the session (and at the
    `between` checkpoints, (label, GFLOP/s) pairs taken between workloads, which catch a load
    that came and went) and the stored reference (a number, or None when this machine has none):
    a dict for the JSON."""
    points = [("before", before)] + list(between) + [("after", after)]
    lo, hi = min(points, key=lambda p: p[1]), max(points, key=lambda p: p[1])
    reasons = []
    moved = (hi[1] - lo[1]) / hi[1]
    if moved > tolerance:
        reasons.append(f"the control {n}^3 sgemm moved {100 * moved:.0f}% during the session "
                       f"({hi[1]:.1f} GFLOP/s {hi[0]}, {lo[1]:.1f} {lo[0]}; limit {100 * tolerance:.0f}%)")
    off = None
    if reference is not None:
        worst = max(points, key=lambda p: abs(p[1] - reference))
        off = abs(worst[1] - reference) / reference
        if off > tolerance:
            reasons.append(f"the control {n}^3 sgemm is {100 * off:.0f}% off this machine's reference "
                           f"({worst[1]:.1f} GFLOP/s {worst[0]} vs {reference:.1f}; limit {100 * tolerance:.0f}%)")
    notes = [] if reference is not None else [
        "no stored reference for this machine: only the drift within the session was checked "
        "(run `krnl bench --calibrate` on a quiet machine)"]
    return {"control_n": n, "before_gflops": before, "after_gflops": after,
            "checkpoints": [{"at": a, "gflops": g} for a, g in points], "reference_gflops": reference,
            "moved": moved, "off_reference": off, "tolerance": tolerance, "trusted": not reasons,
            "reasons": reasons, "notes": notes}
