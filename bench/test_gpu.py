"""krnl's GPU backends next to their peers on the same GPU, in one session of krnl.bench per GPU
device (the code of `krnl bench --device cuda|metal`): W1, W2 and W3 (docs/performance.md, 'Workloads') in the
device's compute dtype (bf16 on CUDA, f16 on Metal), krnl eager and, on CUDA, krnl with the step
replayed as a CUDA graph, PyTorch eager, torch.compile (and with CUDA graphs on CUDA), MLX and
mx.compile where their GPU builds are installed, each checked against krnl at a small size before
it is timed; the square GEMMs and W3's skinny LoRA GEMMs against their bandwidth bound. Then
CUDA's split-K table and W3 with the fused attention against the materialised one.

Run (needs a GPU device; skipped otherwise):
    PYTHONPATH=python python -m pytest bench/test_gpu.py -s -q
KRNL_BENCH_JSON=path also writes the session as `krnl bench --json` does (for --from-json --readme).
"""

import math
import os
import time

import numpy as np
import pytest

import krnl
from krnl.bench import report
from krnl.bench.session import Session
from krnl.bench.targets import has_graphs, is_gpu, torch_target, Unavailable
from krnl.bench.w2 import W3

T, R = W3["T"], W3["r"]
GPUS = [d for d in krnl.devices() if is_gpu(d)]


def _median_ms(fn, sync, warmup=2, rounds=7):
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts)), 1e3 * float(np.min(ts)), 1e3 * float(np.max(ts))


@pytest.mark.parametrize("device", GPUS or [pytest.param("gpu", marks=pytest.mark.skip(reason="no GPU device"))])
def test_gpu_session(benchmark, results, device):
    """The whole session; every implementation is timed or listed with its reason, krnl's graph
    replay (CUDA) and PyTorch (where it has this GPU) pass their checks against krnl. The session
    times itself (interleaved rounds): the benchmark fixture runs it once, so that
    `pytest bench --benchmark-only` includes it."""
    s = Session(device, rounds=5, log=print)
    res = benchmark.pedantic(s.run, args=(["w1", "w2", "w3", "gemm", "lora"],), kwargs={"profile": True},
                             rounds=1, iterations=1)
    table = report.format_table(res)
    print("\n" + table + "\n\n" + report.format_profile(res["profile"]))
    results.setdefault("_lines", []).extend(table.splitlines())
    if os.environ.get("KRNL_BENCH_JSON"):
        report.write_json(res, os.environ["KRNL_BENCH_JSON"])
    rows = {(r["workload"], r["impl"]): r for r in res["rows"]}
    for wl in ("w1", "w2", "w3"):
        assert rows[(wl, "krnl")]["status"] == "ok" and math.isfinite(rows[(wl, "krnl")]["ms"])
        if has_graphs(device):
            assert rows[(wl, "krnl graph")]["status"] == "ok", rows[(wl, "krnl graph")]["reason"]
        for impl in ("numpy", "torch", "torch.compile", "compile+cudagraphs", "mlx", "mx.compile"):
            r = rows[(wl, impl)]
            assert r["status"] == "ok" or r["reason"], (wl, impl)  # never dropped without a reason
            assert "failed its check" not in (r["reason"] or ""), (wl, impl, r["reason"])
    pytest.importorskip("torch")
    try:
        torch_target(device, s.dtype)
    except Unavailable:
        return  # this torch has no backend for this GPU: its rows say so
    assert rows[("w3", "torch")]["status"] == "ok", rows[("w3", "torch")]["reason"]


@pytest.mark.skipif("cuda" not in krnl.devices(), reason="no cuda device")
def test_w3_lora_gemm_times_by_split(benchmark):
    """Records the skinny LoRA GEMMs of W3 (T=4096, r=16, in/out 4096 or 14336), bf16 with f32 or
    bf16 output, timed with split_k = 1 (cuBLAS alone), 2 and 4 and as routed: the data behind
    CudaBackend::split_k_config. Asserts that every split computes the same product as split 1
    (within the output dtype's rounding and fp32 summation order), never a speed."""
    from krnl import ops

    def measure():
        dev = krnl.device("cuda")
        rng = np.random.default_rng(4)
        up = lambda *s: dev.tensor(rng.standard_normal(s).astype(np.float32), "bf16")
        cases = []
        for n_in in (4096, 14336):
            X, A, dt = up(T, n_in), up(R, n_in), up(T, R)
            cases += [(f"t = x A^T   nt M={T} N={R} K={n_in}", X, A, dev.empty((T, R), "bf16"), False, True),
                      (f"dA = dt^T x tn M={R} N={n_in} K={T}", dt, X, dev.empty((R, n_in), "f32"), True, False)]
            dy, B = up(T, n_in), up(n_in, R)
            cases.append((f"dt = dy B    nn M={T} N={R} K={n_in}", dy, B, dev.empty((T, R), "bf16"), False, False))
        lines = ["W3 LoRA GEMMs, us per call (median of 5 batches of 50):"]
        for name, a, b, c, ta, tb in cases:
            row, outputs = [], []
            for s in (1, 2, 4, -1):
                def run():
                    with dev.step():
                        for _ in range(50):
                            ops.gemm(a, b, c, trans_a=ta, trans_b=tb, split_k=s)
                med, _, _ = _median_ms(run, dev.synchronize, warmup=1, rounds=5)
                row.append(f"split {s if s > 0 else 'auto=' + str(ops.gemm_plan(a, b, c, trans_a=ta, trans_b=tb)[0])}: "
                           f"{med * 1e3 / 50:6.1f}")
                outputs.append(np.array(c.numpy(), np.float64))
            # bf16 outputs round once (2^-8 relative); f32 ones differ by summation order only
            tol = 2.0**-7 if c.dtype == "bf16" else 1e-4
            scale = float(np.max(np.abs(outputs[0])))
            for s, o in zip((2, 4, "auto"), outputs[1:]):
                assert float(np.max(np.abs(o - outputs[0]))) <= tol * scale, f"{name}: split {s} differs from split 1"
            lines.append(f"  {name:36s} " + "  ".join(row))
        return lines

    lines = benchmark.pedantic(measure, rounds=1, iterations=1)
    print("\n" + "\n".join(lines))
    assert len(lines) == 1 + 6  # every case of the table was measured and checked


@pytest.mark.skipif("cuda" not in krnl.devices()
                    or "bf16" not in krnl.device("cuda").capabilities()["fused_attention"]["dtypes"],
                    reason="no cuda device with the fused (cuDNN) attention")
def test_w3_fused_attention(benchmark):
    """W3 in bf16 with the fused attention (the default on CUDA with cuDNN) and with
    `model.fused_attention = False` in one process: eager and replayed step times (interleaved
    rounds), the pool's live peak of each path, and their outputs against each other."""
    from krnl.bench.w2 import Case, _as_dict, build_krnl_graph

    def measure():
        c = Case.of(W3, "cuda", "bf16")
        dev, m = c.dev, c.model
        out, steps, peak = {}, {}, {}
        for fused in (True, False):
            m.fused_attention = fused
            c.krnl_step()
            dev.synchronize()
            dev.trim()
            base = dev.pool_stats()["in_use"]
            dev.reset_peak()
            out[fused] = _as_dict(*c.krnl_result())
            peak[fused] = (dev.pool_stats()["peak_in_use"] - base) / 2**30
            steps[(fused, "eager")] = c.krnl_step
            steps[(fused, "graph")] = build_krnl_graph(c)[0]
        times = {k: [] for k in steps}
        for _ in range(5):
            for k, f in steps.items():
                times[k].append(_median_ms(f, dev.synchronize, warmup=1, rounds=5)[0])
        return out, peak, {k: float(np.median(v)) for k, v in times.items()}

    out, peak, ms = benchmark.pedantic(measure, rounds=1, iterations=1)
    name = {True: "fused", False: "materialised"}
    print("\nW3 attention, ms per step (median of 5 rounds) and live pool peak:")
    for f in (True, False):
        print(f"  {name[f]:12s} eager {ms[(f, 'eager')]:6.2f}  graph {ms[(f, 'graph')]:6.2f}  peak {peak[f]:.2f} GiB")
    a, b = out[True], out[False]
    assert abs(float(a["loss"]) - float(b["loss"])) <= 1e-3 * abs(float(b["loss"]))
    for k in b:  # bf16 activations: the two paths round differently
        assert np.max(np.abs(a[k] - b[k])) <= 5e-2 * np.max(np.abs(b[k])), k
    assert peak[True] < peak[False]  # the (H, T, T) scores are never stored
