"""W1 (DESIGN section 6): one LoRA training step of the KRNL MLP block, krnl's CPU backend next to
a float32 numpy implementation of the same step, and the machine's sgemm rate measured in the
same run. Run: pytest bench/ --benchmark-only (add -s to see the ratios as they are made)."""

import time

import numpy as np
import pytest

import krnl
from krnl.mlp_block import MLPBlock, make_w1_params, w1_flops

T, C, F, R = 512, 2048, 5632, 32
SCALE = 2.0
FLOPS = w1_flops(T, C, F, R)


def numpy_w1_step(P, s=SCALE, eps=1e-5):
    """The same step in float32 numpy: forward, dX and the four LoRA gradients."""
    x, dy, w = P["x"], P["dy"], P["w_norm"]
    f = np.float32
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + f(eps))
    h = x * rstd * w
    tg, tu = h @ P["Ag"].T, h @ P["Au"].T
    g = h @ P["Wg"].T + (f(s) * tg) @ P["Bg"].T
    u = h @ P["Wu"].T + (f(s) * tu) @ P["Bu"].T
    sg = 1.0 / (1.0 + np.exp(-g))
    a = g * sg * u
    y = x + a @ P["Wd"].T
    da = dy @ P["Wd"]
    du = da * g * sg
    dg = da * u * sg * (1.0 + g * (1.0 - sg))
    grads = {"Bg": f(s) * dg.T @ tg, "Bu": f(s) * du.T @ tu}
    dtg, dtu = f(s) * dg @ P["Bg"], f(s) * du @ P["Bu"]
    grads["Ag"], grads["Au"] = dtg.T @ h, dtu.T @ h
    dh = dg @ P["Wg"] + dtg @ P["Ag"] + du @ P["Wu"] + dtu @ P["Au"]
    gw = dh * w
    xhat = x * rstd
    dx = rstd * (gw - xhat * np.mean(gw * xhat, axis=-1, keepdims=True)) + dy
    return y, dx, grads


@pytest.fixture(scope="module")
def params():
    return make_w1_params(T, C, F, R, seed=0)


def _rate(fn, flops, reps=5):
    fn()
    best = min(_timed(fn) for _ in range(reps))
    return flops / best


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_w1_numpy(benchmark, params, results):
    benchmark.group = "W1 step (CPU)"
    benchmark.extra_info["gflop"] = FLOPS / 1e9
    benchmark.pedantic(numpy_w1_step, args=(params,), rounds=5, warmup_rounds=1)
    results["numpy_s"] = benchmark.stats.stats.median


def test_w1_krnl_cpu(benchmark, params, results):
    dev = krnl.device("cpu")
    block = MLPBlock(dev, params, T, scale=SCALE)
    x, dy = dev.tensor(params["x"]), dev.tensor(params["dy"])

    def step():
        with dev.step():
            block.forward(x)
            block.backward(x, dy)
        dev.synchronize()

    # Same numbers as the numpy step before it is timed.
    step()
    y_ref, dx_ref, g_ref = numpy_w1_step(params)
    np.testing.assert_allclose(block.y.numpy(), y_ref, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(block.dx.numpy(), dx_ref, rtol=1e-3, atol=1e-4)
    for k in g_ref:
        ref = g_ref[k]
        assert np.max(np.abs(block.grads[k].numpy() - ref)) <= 1e-3 * np.max(np.abs(ref))

    benchmark.group = "W1 step (CPU)"
    benchmark.extra_info["gflop"] = FLOPS / 1e9
    benchmark.pedantic(step, rounds=5, warmup_rounds=1)
    krnl_s = benchmark.stats.stats.median

    # The machine's sgemm rate, in this run, through krnl's gemm (the BLAS it calls): the step's
    # four large GEMM shapes, and a square 2048^3 one, best of several each.
    E = lambda *shape: dev.tensor(np.ones(shape, np.float32))
    h, a, w_fc, w_cf = E(T, C), E(T, F), E(F, C), E(C, F)
    g_out, y_out = dev.empty((T, F)), dev.empty((T, C))
    gemm = krnl.ops.gemm
    step_shapes = [
        _rate(lambda: gemm(h, w_fc, g_out, trans_b=True), 2 * T * C * F),  # forward gate/up
        _rate(lambda: gemm(a, w_cf, y_out, trans_b=True), 2 * T * C * F),  # forward down
        _rate(lambda: gemm(y_out, w_cf, g_out), 2 * T * C * F),            # da = dy Wd
        _rate(lambda: gemm(a, w_fc, y_out), 2 * T * C * F),                # dh = dg Wg
    ]
    sq = E(2048, 2048)
    sq_out = dev.empty((2048, 2048))
    square = _rate(lambda: gemm(sq, sq, sq_out), 2 * 2048**3)
    shapes_rate = sum(step_shapes) / len(step_shapes)
    step_rate = FLOPS / krnl_s
    lines = results.setdefault("_lines", [])
    lines.append(f"W1 step: krnl cpu {krnl_s * 1e3:.1f} ms = {step_rate / 1e9:.1f} GFLOP/s "
                 f"({krnl.num_threads()} threads)")
    lines.append(f"sgemm: step's large shapes {shapes_rate / 1e9:.1f} GFLOP/s (mean of "
                 f"{', '.join(f'{r / 1e9:.0f}' for r in step_shapes)}); square 2048^3 {square / 1e9:.1f} GFLOP/s")
    lines.append(f"W1 step / sgemm rate: {step_rate / shapes_rate:.2f} of the step's shapes, "
                 f"{step_rate / max(square, shapes_rate):.2f} of the best rate (goal 0.85)")
    if "numpy_s" in results:
        lines.append(f"W1 step: numpy float32 {results['numpy_s'] * 1e3:.1f} ms; "
                     f"krnl speed-up over numpy = {results['numpy_s'] / krnl_s:.2f}x")
    print("\n" + "\n".join(lines))
