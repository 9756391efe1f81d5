"""lora_b_backward (csrc/cuda/lora.cu) against the two cuBLAS GEMMs it replaces, on a CUDA GPU: at
the train shapes' dy (rows, out) alone, each variant recorded as a graph of 10 calls and replayed
in interleaved rounds; then W3 (python/krnl/bench/w2.py) replayed with KRNL_LORA_B_FUSED on and
off. Usage (krnl built): python3 tools/device/lora_b_alone.py [--rounds 7]"""

import argparse
import os
import statistics
import time

import numpy as np

import krnl
from krnl import ops
from krnl.bench import w2
from krnl.bench.targets import replayed

SHAPES = {  # name: (rows, out, dy's row stride), r = 16
    "8b gate|up": (8192, 14336, 14336), "8b q": (8192, 4096, 6144), "8b k|v": (8192, 1024, 6144),
    "8b o|down": (8192, 4096, 4096), "w3 gate|up": (4096, 14336, 14336), "1b gate|up": (8192, 8192, 8192),
}


def calls(dev, rows, out, ld, fused, reps=10, r=16):
    rng = np.random.default_rng(0)
    wide = dev.tensor(rng.standard_normal((rows, ld)).astype(np.float32), "bf16")
    dy = wide[:, :out]
    t = dev.tensor(rng.standard_normal((rows, r)).astype(np.float32), "bf16")
    B = dev.tensor(rng.standard_normal((out, r)).astype(np.float32), "bf16")
    gB, dt = dev.zeros((out, r), "f32"), dev.empty((rows, r), "bf16")

    def body():
        for _ in range(reps):
            if fused:
                ops.lora_b_backward(dy, t, B, gB, dt, 0.5, 1.0)
            else:
                ops.gemm(dy, t, gB, trans_a=True, alpha=0.5, beta=1.0)
                ops.gemm(dy, B, dt, alpha=0.5)
    return body, (dy, t, B, gB, dt)


def rounds(steps, n_rounds, per):
    times = {k: [] for k in steps}
    for _ in range(n_rounds):
        for k, step in steps.items():
            step()
            t0 = time.perf_counter()
            for _ in range(per):
                step()
            times[k].append((time.perf_counter() - t0) / per * 1e3)
    return {k: (statistics.median(v), min(v)) for k, v in times.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    dev = krnl.device("cuda")
    for name, (rows, out, ld) in SHAPES.items():
        steps, keep = {}, []
        for fused in (True, False):
            body, tensors = calls(dev, rows, out, ld, fused)
            step, graph = replayed(dev, body)
            steps["fused" if fused else "two GEMMs"] = step
            keep.append((graph, tensors))
        res = rounds(steps, a.rounds, 5)
        f, g = res["fused"][0] * 100, res["two GEMMs"][0] * 100  # us per call (10 calls a replay)
        print(f"{name:11s} dy ({rows}, {out}) ld {ld}: fused {f:7.1f} us, two GEMMs {g:7.1f} us, "
              f"ratio {g / f:.2f}x; fused reads dy at {rows * out * 2 / (f * 1e6):.2f} TB/s", flush=True)
    case = w2.Case.of(w2.W3, device="cuda", dtype="bf16")
    steps, outs = {}, {}
    for env in ("1", "0"):
        os.environ["KRNL_LORA_B_FUSED"] = env
        step, result = w2.build_krnl_graph(case)
        outs[env], steps[f"KRNL_LORA_B_FUSED={env}"] = result(), step
    worst = max(float(np.max(np.abs(outs["1"][k] - outs["0"][k])) / (np.max(np.abs(outs["0"][k])) + 1e-30))
                for k in outs["0"] if k != "loss")
    print(f"W3 loss fused {float(outs['1']['loss']):.6f}, two GEMMs {float(outs['0']['loss']):.6f}; "
          f"largest relative difference of a gradient: {worst:.2e}")
    for k, (med, lo) in rounds(steps, a.rounds, 20).items():
        print(f"W3 replayed, {k}: {med:.3f} ms (median of {a.rounds} rounds of 20; min {lo:.3f})")


if __name__ == "__main__":
    main()
