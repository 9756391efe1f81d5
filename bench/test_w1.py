"""W1 (docs/performance.md, 'Workloads'): one LoRA training step of the KRNL MLP block, krnl's CPU backend next to
the peers of krnl.bench (float32 numpy, PyTorch eager and compiled, MLX eager and compiled) and the
machine's sgemm rate measured in the same run. The workload and every peer live in krnl/bench/w1.py
(shared with `krnl bench`); this file only times them with pytest-benchmark.
Run: pytest bench/ --benchmark-only (add -s to see the ratios as they are made)."""

import time

import numpy as np
import pytest

import krnl
from krnl.bench.w1 import C, F, FLOPS, R, T, Problem, build_krnl, numpy_w1_step
from krnl.bench.workloads import W1


@pytest.fixture(scope="module")
def params():
    return Problem(dict(T=T, C=C, F=F, R=R))


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_w1_numpy(benchmark, params):
    benchmark.group = "W1 step (CPU)"
    benchmark.extra_info["gflop"] = FLOPS / 1e9
    benchmark.pedantic(numpy_w1_step, args=(params,), rounds=5, warmup_rounds=1)


def test_w1_krnl_cpu(benchmark, params):
    step, result = build_krnl(params)
    # Same numbers as the numpy step before it is timed.
    out = result()
    y_ref, dx_ref, g_ref = numpy_w1_step(params)
    np.testing.assert_allclose(out["y"], y_ref, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(out["dx"], dx_ref, rtol=1e-3, atol=1e-4)
    for k in g_ref:
        ref = g_ref[k]
        assert np.max(np.abs(out[k] - ref)) <= 1e-3 * np.max(np.abs(ref))

    benchmark.group = "W1 step (CPU)"
    benchmark.extra_info["gflop"] = FLOPS / 1e9
    benchmark.pedantic(step, rounds=5, warmup_rounds=1)


@pytest.mark.parametrize("peer", ["torch", "torch.compile", "mlx", "mx.compile"])
def test_w1_peer(benchmark, params, peer, time_peer):
    time_peer(benchmark, W1, params, peer, "W1 step (CPU)")


def test_w1_interleaved_rounds(benchmark, params, results):
    """Records the ratios, from rounds that interleave krnl's step, numpy's step and the machine's
    sgemm (krnl's gemm, i.e. the BLAS it calls, on the step's four large shapes and on 2048^3), so
    that drift of a shared machine hits all of them alike. Medians over rounds. What it asserts is
    the record's structure; speed is reported, never asserted."""
    dev = krnl.device("cpu")
    step = build_krnl(params)[0]
    E = lambda *shape: dev.tensor(np.ones(shape, np.float32))
    h, a, w_fc, w_cf = E(T, C), E(T, F), E(F, C), E(C, F)
    g_out, y_out = dev.empty((T, F)), dev.empty((T, C))
    sq, sq_out = E(2048, 2048), dev.empty((2048, 2048))
    gemm = krnl.ops.gemm

    def step_shapes():  # forward gate/up and down (nt), backward da and dh (nn)
        gemm(h, w_fc, g_out, trans_b=True)
        gemm(a, w_cf, y_out, trans_b=True)
        gemm(y_out, w_cf, g_out)
        gemm(a, w_fc, y_out)

    rounds = []

    def one_round():
        rounds.append([_timed(step), _timed(lambda: numpy_w1_step(params)), _timed(step_shapes),
                       _timed(lambda: gemm(sq, sq, sq_out))])

    benchmark.group = "W1 interleaved round (krnl, numpy, sgemm)"
    benchmark.pedantic(one_round, rounds=7, warmup_rounds=1)
    r = np.array(rounds[1:])  # the first is the warm-up
    krnl_s, numpy_s = np.median(r[:, 0]), np.median(r[:, 1])
    step_rate = FLOPS / r[:, 0]
    shapes_rate = 4 * 2 * T * C * F / r[:, 2]
    square_rate = 2 * 2048**3 / r[:, 3]
    vs_shapes = float(np.median(step_rate / shapes_rate))
    vs_best = float(np.median(step_rate / np.maximum(shapes_rate, square_rate)))
    # A shared machine: rounds that spread more than 25% mark the figures untrusted.
    spread = float(np.max(r.max(0) / r.min(0)))
    trust = "" if spread <= 1.25 else f" [UNTRUSTED: rounds spread {spread:.2f}x, the machine was busy]"
    lines = results.setdefault("_lines", [])
    lines += [
        f"W1 step (median of {len(r)} interleaved rounds, {krnl.num_threads()} threads): krnl cpu {krnl_s * 1e3:.1f} ms "
        f"= {FLOPS / krnl_s / 1e9:.1f} GFLOP/s; numpy float32 {numpy_s * 1e3:.1f} ms",
        f"krnl / numpy speed: {float(np.median(r[:, 1] / r[:, 0])):.2f}x",
        f"sgemm: step's large shapes {np.median(shapes_rate) / 1e9:.1f} GFLOP/s; square 2048^3 "
        f"{np.median(square_rate) / 1e9:.1f} GFLOP/s",
        f"W1 step rate / sgemm rate: {vs_shapes:.2f} of the step's shapes, {vs_best:.2f} of the best{trust}",
    ]
    print("\n" + "\n".join(lines))
    benchmark.extra_info.update(krnl_ms=krnl_s * 1e3, numpy_ms=numpy_s * 1e3, vs_shapes=vs_shapes, vs_best=vs_best,
                                spread=spread)
    # Seven timed rounds of four timings each, all measured (the step's numbers were checked
    # against numpy in test_w1_krnl_cpu).
    assert r.shape == (7, 4) and np.all(np.isfinite(r)) and np.all(r > 0), r
