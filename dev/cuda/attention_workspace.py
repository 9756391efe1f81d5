"""The pool bytes the fused attention (cuDNN) takes beyond its operands at the long row's shape
(32 query heads on 8 KV heads of 128, bf16, token-major as the model calls it): the plan
(krnl.train.memory) counts the operands and lse, not cuDNN's workspace, which comes from the pool.

    python3 dev/cuda/attention_workspace.py [T ...]     # on a CUDA machine (h200_check.sh's build)
"""
import sys

import numpy as np

import krnl
from krnl import ops


def main(lengths):
    d = krnl.device("cuda")
    H, Hk, D, NH = 32, 8, 128, 48
    for T in lengths:
        rng = np.random.default_rng(0)
        qkv = d.tensor(rng.standard_normal((T, NH * D)).astype(np.float32) * 0.5, "bf16").reshape(1, T, NH, D)
        att, dout = d.empty((1, T, H, D), "bf16"), d.tensor(rng.standard_normal((T, H * D)).astype(np.float32),
                                                            "bf16").reshape(1, T, H, D)
        dqkv = d.empty((1, T, NH, D), "bf16")
        lse = d.empty((1, H, T), "f32")
        q, k, v = qkv[:, :, :H], qkv[:, :, H:H + Hk], qkv[:, :, H + Hk:]
        d.synchronize()
        d.trim()
        d.reset_peak()
        base = d.pool_stats()["in_use"]
        ops.attention_forward(q, k, v, att, lse, D ** -0.5)
        d.synchronize()
        fwd = d.pool_stats()["peak_in_use"] - base
        d.reset_peak()
        ops.attention_backward(q, k, v, att, dout, lse, dqkv[:, :, :H], dqkv[:, :, H:H + Hk], dqkv[:, :, H + Hk:],
                               D ** -0.5)
        d.synchronize()
        bwd = d.pool_stats()["peak_in_use"] - base
        mib = 1 << 20
        print(f"T {T}: forward workspace {fwd / mib:.1f} MiB, backward {bwd / mib:.1f} MiB "
              f"(B H T D 4 bytes: {H * T * D * 4 / mib:.1f} MiB)", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [2048, 4096, 16384, 32768])
