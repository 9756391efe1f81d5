"""W3 (python/krnl/bench/w2.py) replayed as one CUDA graph per LoRA path, timed side by side in
one process on one GPU: the step recorded once with each setting of KRNL_LORA_GROUPS (lora_group.py)
and KRNL_LORA_FIRST (lora.py), then replayed in interleaved rounds; also
each variant's loss and gradients against the first's. Usage (on a CUDA machine, krnl built):
    python3 dev/cuda/w3_lora_variants.py [--rounds 7] [--steps 20] [--json PATH]"""

import argparse
import json
import os
import statistics
import time

import numpy as np

from krnl.bench import w2

VARIANTS = {  # name: (KRNL_LORA_GROUPS, KRNL_LORA_FIRST)
    "one by one, frozen first": ("0", "0"),
    "groups": ("1", "0"),
    "lora first": ("0", "1"),
    "groups, lora first (default)": ("1", "1"),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json")
    a = p.parse_args()
    case = w2.Case.of(w2.W3, device="cuda", dtype="bf16")
    steps, outs = {}, {}
    for name, (groups, first) in VARIANTS.items():
        os.environ.update(KRNL_LORA_GROUPS=groups, KRNL_LORA_FIRST=first)
        step, result = w2.build_krnl_graph(case)  # captured now, with this setting
        outs[name] = result()
        steps[name] = step
    first = next(iter(VARIANTS))
    for name, o in outs.items():
        worst = max(float(np.max(np.abs(o[k] - outs[first][k])) / (np.max(np.abs(outs[first][k])) + 1e-30))
                    for k in o if k != "loss")
        print(f"{name:28s} loss {float(o['loss']):.6f}  max relative difference to '{first}': {worst:.2e}")
    times = {n: [] for n in VARIANTS}
    for _ in range(a.rounds):
        for name, step in steps.items():
            step()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step()
            times[name].append((time.perf_counter() - t0) / a.steps * 1e3)
    res = {n: statistics.median(t) for n, t in times.items()}
    for n, ms in res.items():
        print(f"W3 krnl graph, {n:30s} {ms:.3f} ms (median of {a.rounds} rounds of {a.steps} replays; "
              f"min {min(times[n]):.3f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"median_ms": res, "rounds_ms": times}, f, indent=1)


if __name__ == "__main__":
    main()
