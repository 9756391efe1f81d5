"""krnl's own fused attention calls, alone, at the train benchmark's 1b and 8b shapes (token-major
views of one qkv buffer, as the model passes them), with three kinds of values: small ones
(0.008-0.03 in magnitude), model-like N(0, 1.3) (q = x Wq with unit x and 0.02 weights) and a
tenth of that. Compared with a training step's profile (krnl bench --profile),
it tells whether the step's attention is slower for krnl's call, for the data, or for the GPU's
state inside the step.

    PYTHONPATH=python python3 dev/cuda/attention_alone.py      (on a CUDA machine with cuDNN)
"""
import time

import numpy as np

import krnl
from krnl.models import attention

d = krnl.device("cuda")
for name, (B, T, H, Hk, D) in (("1b", (4, 2048, 32, 8, 64)), ("8b", (2, 4096, 32, 8, 128))):
    NH, C = H + 2 * Hk, H * D
    rng = np.random.default_rng(0)
    for data, sd in (("small", None), ("model", 1.3), ("model x0.1", 0.13)):
        def values(shape):
            if sd is None:
                return d.tensor((rng.uniform(0.0078, 0.03, shape) * rng.choice([-1, 1], shape)).astype(np.float32), "bf16")
            return d.tensor(rng.normal(0, sd, shape).astype(np.float32), "bf16")
        qkv, dout = values((B * T, NH * D)), values((B * T, C)).reshape(B, T, H, D)  # (B T, NH D), (B, T, H, D)
        out = d.empty((B * T, C), "bf16").reshape(B, T, H, D)
        dqkv = d.empty((B * T, NH * D), "bf16").reshape(B, T, NH, D)
        q4 = qkv.reshape(B, T, NH, D)
        q, k, v = q4[:, :, :H], q4[:, :, H:H + Hk], q4[:, :, H + Hk:]
        grads = (dqkv[:, :, :H], dqkv[:, :, H:H + Hk], dqkv[:, :, H + Hk:])
        scale = 1.0 / np.sqrt(D)
        for _ in range(3):
            saved = attention.fused_forward(q, k, v, out, scale)
            saved.backward(dout, *grads)
        d.synchronize()
        n = 20
        t0 = time.perf_counter()
        for _ in range(n):
            saved = attention.fused_forward(q, k, v, out, scale)
        d.synchronize()
        t1 = time.perf_counter()
        for _ in range(n):
            saved.backward(dout, *grads)
        d.synchronize()
        t2 = time.perf_counter()
        print(f"{name} {data:12s} forward {1e6 * (t1 - t0) / n:8.1f} us  backward {1e6 * (t2 - t1) / n:8.1f} us", flush=True)
