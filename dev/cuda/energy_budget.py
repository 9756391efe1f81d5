"""A training step's energy by part, at the power cap. Under the H200's cap a step's time is its
energy over about 700 W (docs/performance.md, 'The power cap'), so a goal in time is a goal in
joules. This probe records each part of one step at a train shape as its own graph: the frozen
products (the seven projections' forward and input-gradient GEMMs of every layer, and the LM
head's in 1024-row chunks) and the fused attention (forward and backward of every layer), with
W3's layer recorded whole beside them. Each graph is replayed back to back for a few seconds,
the parts round-robin, with NVML's energy counter read alongside (krnl.bench.gpu_power): joules
a replay = mean power x time a replay. The step's own joules come from krnl bench's train row
in the same call; what it has beyond the two parts is everything else (the LoRA products, the
norms, SwiGLU, rope, the loss, the idle gaps).

    PYTHONPATH=python python3 dev/cuda/energy_budget.py [seconds] [rounds]   (on a CUDA machine)
"""
import sys
import time

import numpy as np

import krnl
from krnl import _core
from krnl.bench import gpu_power, w2

ops = _core.ops
d = krnl.device("cuda")
# the train benchmark's 8b shape (8 layers, B=2 x T=4096 rows) and W3's one layer (T=4096)
SHAPES = {"8b": dict(L=8, B=2, T=4096, C=4096, F=14336, H=32, KV=8, D=128, V=32000, chunk=1024),
          "w3": dict(L=1, B=1, T=4096, C=4096, F=14336, H=32, KV=8, D=128, V=0, chunk=0)}


def normal(rng, shape, sd):
    return d.tensor(rng.normal(0, sd, shape).astype(np.float32), "bf16")


def frozen_products(s, rng):
    """A graph body: every frozen GEMM of one step, forward and input gradient, at shape s."""
    N, C, F, QKV = s["B"] * s["T"], s["C"], s["F"], (s["H"] + 2 * s["KV"]) * s["D"]
    # (out, in) weights as the model stores them, and each product's input and output
    pairs = [(QKV, C), (C, C), (2 * F, C), (C, F)]                  # q|k|v, o, gate|up, down
    W = {p: normal(rng, p, 0.02) for p in pairs}
    act = {w: normal(rng, (N, w), 1.0) for w in {C, F, 2 * F, QKV}}  # (N, width)
    out = {w: d.empty((N, w), "bf16") for w in {C, F, 2 * F, QKV}}
    head = normal(rng, (s["V"], C), 0.02) if s["V"] else None      # (V, C)
    logits = d.empty((s["chunk"], s["V"]), "bf16") if s["V"] else None

    def body():
        for _ in range(s["L"]):
            for o, i in pairs:
                ops.gemm(act[i], W[(o, i)], out[o], trans_b=True)    # y = x W^T    (N, o)
            for o, i in reversed(pairs):
                ops.gemm(act[o], W[(o, i)], out[i])                 # dx = dy W    (N, i)
        if head is None:
            return
        for r0 in range(0, N, s["chunk"]):
            r1 = min(N, r0 + s["chunk"])
            ops.gemm(act[C][r0:r1], head, logits[0:r1 - r0], trans_b=True)  # logits = xn H^T
            ops.gemm(logits[0:r1 - r0], head, out[C][r0:r1])                  # dxn = dlogits H
    return body


def attention_calls(s, rng):
    """A graph body: the fused attention's forward and backward for every layer, on token-major
    views of one (B T, (H + 2 KV) D) buffer as the model passes them."""
    B, T, H, KV, D = s["B"], s["T"], s["H"], s["KV"], s["D"]
    NH = H + 2 * KV
    qkv = normal(rng, (B * T, NH * D), 1.3).reshape(B, T, NH, D)
    dqkv = d.empty((B * T, NH * D), "bf16").reshape(B, T, NH, D)
    out = d.empty((B * T, H * D), "bf16").reshape(B, T, H, D)
    dout = normal(rng, (B * T, H * D), 0.01).reshape(B, T, H, D)
    lse = d.empty((B, H, T), "f32")
    q, k, v = qkv[:, :, :H], qkv[:, :, H:H + KV], qkv[:, :, H + KV:]
    dq, dk, dv = dqkv[:, :, :H], dqkv[:, :, H:H + KV], dqkv[:, :, H + KV:]
    scale = 1.0 / np.sqrt(D)

    def body():
        for _ in range(s["L"]):
            ops.attention_forward(q, k, v, out, lse, scale, None, 0)
            ops.attention_backward(q, k, v, out, dout, lse, dq, dk, dv, scale, None, 0)
    return body


def sustained(graph, meter, seconds):
    """(ms a replay, the meter's window) over `seconds` of back-to-back replays, after a fifth of
    that as warm-up; replays go in blocks of about 0.1 s, each waited for."""
    t0 = time.perf_counter()
    graph.replay()
    d.synchronize()
    block = max(1, int(0.1 / max(time.perf_counter() - t0, 1e-4)))
    a = None
    n, end = 0, time.perf_counter() + 1.2 * seconds
    while time.perf_counter() < end:
        if a is None and time.perf_counter() > end - seconds:
            a, n = time.perf_counter(), 0
        for _ in range(block):
            graph.replay()
        d.synchronize()
        n += block
    b = time.perf_counter()
    return 1e3 * (b - a) / n, meter.window([(a, b)])


def main(seconds=2.5, rounds=3):
    parts = {}
    for name, s in SHAPES.items():
        rng = np.random.default_rng(0)
        parts[f"{name} frozen products"] = d.capture(frozen_products(s, rng))
        parts[f"{name} attention"] = d.capture(attention_calls(s, rng))
    case = w2.Case.of(w2.W3, device="cuda", dtype="bf16")
    parts["w3 whole step"] = w2.build_krnl_graph(case)[0].graph
    rows = {k: [] for k in parts}
    with gpu_power.metered(d) as (meter, why):
        if meter is None:
            sys.exit(f"energy_budget: {why}")
        time.sleep(1.0)
        idle = meter.window([(time.perf_counter() - 0.9, time.perf_counter())])
        print(f"idle: SM {idle['sm_mhz']} MHz, {idle['watts'] or 0:.0f} W", flush=True)
        for r in range(rounds):
            for name, g in parts.items():
                ms, w = sustained(g, meter, seconds)
                rows[name].append((ms, w["watts"], w["watts"] * ms / 1e3, w["sm_mhz"]))
                print(f"round {r} {name:<22} {ms:8.3f} ms  {w['watts']:5.0f} W  {w['watts'] * ms / 1e3:7.2f} J"
                      f"  SM {w['sm_mhz']} MHz  capped {100 * w['capped']:3.0f}%", flush=True)
    print("median over rounds:")
    for name, rs in rows.items():
        m = np.median(np.array(rs), axis=0)
        print(f"{name:<24} {m[0]:8.3f} ms  {m[1]:5.0f} W  {m[2]:7.2f} J a replay  SM {m[3]:.0f} MHz", flush=True)


if __name__ == "__main__":
    main(*(float(a) if i == 0 else int(a) for i, a in enumerate(sys.argv[1:])))
