"""The LM head and the loss alone, as LlamaModel.forward_backward_mean runs them, at the train
benchmark's shapes (8192 rows, vocabulary 32000, bf16): for each chunk of rows, logits = xn W^T,
cross_entropy (dlogits in place), dxn = dlogits W. Chunk sizes are timed round-robin (the power
cap lowers the clock under a sustained load, so shapes timed one after another do not compare),
whole and op by op, each recorded as a graph and replayed.

    PYTHONPATH=python python3 dev/cuda/head_loss_probe.py        (on a CUDA machine)
"""
import time

import numpy as np

import krnl
from krnl import _core

ops = _core.ops
d = krnl.device("cuda")
N, V, REPS, ROUNDS = 8192, 32000, 8, 5
CHUNKS = (1024, 2048, 4096, 8192)


def case(C):
    rng = np.random.default_rng(0)
    xn = d.tensor(rng.normal(0, 1, (N, C)).astype(np.float32), "bf16")
    W = d.tensor(rng.normal(0, 0.02, (V, C)).astype(np.float32), "bf16")
    targets = d.tensor(rng.integers(0, V, N).astype(np.int32), "i32")
    return xn, W, targets, d.empty((N,), "f32"), d.empty((N, C), "bf16")


def head_loss(c, chunk, part=None):
    xn, W, targets, loss, dxn = c
    buf = d.empty((chunk, V), "bf16")
    for r0 in range(0, N, chunk):
        r1 = min(N, r0 + chunk)
        logits = buf[0:r1 - r0]
        if part in (None, "fwd"):
            ops.gemm(xn[r0:r1], W, logits, trans_b=True)
        if part in (None, "ce"):
            ops.cross_entropy(logits, targets[r0:r1], loss[r0:r1], logits, -100, 1.0 / N)
        if part in (None, "dx"):
            ops.gemm(logits, W, dxn[r0:r1])


def timed(graph):
    graph.replay()
    d.synchronize()
    t0 = time.perf_counter()
    for _ in range(REPS):
        graph.replay()
    d.synchronize()
    return 1e6 * (time.perf_counter() - t0) / REPS


for name, C in (("1b", 2048), ("8b", 4096)):
    c = case(C)
    # recorded as graphs, as the Trainer replays its step: eagerly, cross_entropy reads the targets
    # on the host to check them, a wait per chunk
    graphs = {(k, p): d.capture(lambda k=k, p=p: head_loss(c, k, p)) for k in CHUNKS for p in (None, "fwd", "ce", "dx")}
    res = {}
    for _ in range(ROUNDS):
        for key, g in graphs.items():
            res.setdefault(key, []).append(timed(g))
    for g in graphs.values():
        g.release()
    gf = 2.0 * N * C * V / 1e9  # one product over all rows
    for chunk in CHUNKS:
        m = {p: float(np.median(res[(chunk, p)])) for p in (None, "fwd", "ce", "dx")}
        print(f"{name} C={C} chunk {chunk:5d}: all {m[None]:8.1f} us | head fwd {m['fwd']:7.1f} us "
              f"({gf / m['fwd'] * 1e3:5.0f} TFLOP/s) | loss {m['ce']:6.1f} us "
              f"({4.0 * N * V / m['ce'] / 1e6:4.2f} TB/s) | head dx {m['dx']:7.1f} us "
              f"({gf / m['dx'] * 1e3:5.0f} TFLOP/s) | buffer {chunk * V * 2 / 2**20:5.0f} MiB", flush=True)
