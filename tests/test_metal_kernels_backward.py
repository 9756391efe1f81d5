"""krnl's Metal kernels for SwiGLU, RoPE and the rmsnorm/softmax backwards (metal/swiglu.metal,
metal/rope.metal, metal/rmsnorm.metal, metal/softmax.metal) on the MSL simulator (tools/mslsim)
against float64 numpy.

Same approach as test_metal_kernels.py, whose helpers (kargs.h parsed into ctypes, the barrier-
free copies of a kernel file, the thread orders) are reused: each .metal file is built once per
module in parallel (cached by content hash under MSLSIM_CACHE), sizes 1, 31, 33, 127 plus one
realistic, f32 and f16, reductions under the simulator's random thread order."""

import numpy as np
import pytest

from test_metal_kernels import DT, KARGS, METAL, ORDERS, SIZES, _caught, _without_barriers, build_all, ew_dispatch, f64

SwigluArgs, RopeArgs, RmsnormBackwardArgs, SoftmaxBackwardArgs = (
    KARGS[n] for n in ("SwigluArgs", "RopeArgs", "RmsnormBackwardArgs", "SoftmaxBackwardArgs"))

rng = np.random.default_rng(8765)
U32 = 2.0 ** -24


def test_kargs_layout_backward():
    assert [f for f, _ in SwigluArgs._fields_] == ["n", "alpha", "limit"]
    assert [f for f, _ in RopeArgs._fields_] == ["rows", "T", "D", "R", "sign"]
    assert [f for f, _ in RmsnormBackwardArgs._fields_] == ["rows", "cols", "ldx", "ldr", "has_residual"]
    assert [f for f, _ in SoftmaxBackwardArgs._fields_] == ["rows", "cols", "scale"]


@pytest.fixture(scope="module")
def libs():
    builds = {name: dict(source=METAL / f"{name}.metal") for name in ("swiglu", "rope", "rmsnorm", "softmax")}
    builds.update(rmsnorm_nobarrier=_without_barriers("rmsnorm"), softmax_nobarrier=_without_barriers("softmax"))
    return build_all(builds)


# ---------------------------------------------------------------------------------------------
# swiglu
# ---------------------------------------------------------------------------------------------
def sig64(g):
    return 1 / (1 + np.exp(-g))


# f32: exp plus a handful of float roundings (rtol 1e-5); atol covers the cancellation in
# 1 + g * (1 - sig) (zero near g = -1.28): ~ulp(1) times |ds * u * sig| (inputs ~ N(0, 2^2)).
# f16: inputs exact in float, one rounding of the half output (2^-11) with slack.
SW_TOL = {"f32": dict(rtol=1e-5, atol=1e-5), "f16": dict(rtol=2e-3, atol=2e-3)}


def swiglu_inputs(dt, n, k):
    return [(2 * rng.standard_normal(n)).astype(DT[dt]) for _ in range(k)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_swiglu_forward_metal(libs, dt, n):
    g, u = swiglu_inputs(dt, n, 2)
    s = np.full(n, np.nan, DT[dt])
    ew_dispatch(libs["swiglu"], f"swiglu_forward_{dt}", n, [g, u, s, SwigluArgs(n)])
    np.testing.assert_allclose(f64(s), f64(g) * sig64(f64(g)) * f64(u), **SW_TOL[dt])


def swiglu_backward_ref(ds, g, u):
    ds, g, u = f64(ds), f64(g), f64(u)
    sg = sig64(g)
    return ds * u * sg * (1 + g * (1 - sg)), ds * g * sg


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_swiglu_backward_metal(libs, dt, n):
    ds, g, u = swiglu_inputs(dt, n, 3)
    dg, du = np.full(n, np.nan, DT[dt]), np.full(n, np.nan, DT[dt])
    ew_dispatch(libs["swiglu"], f"swiglu_backward_{dt}", n, [ds, g, u, dg, du, SwigluArgs(n)])
    dg_ref, du_ref = swiglu_backward_ref(ds, g, u)
    np.testing.assert_allclose(f64(dg), dg_ref, **SW_TOL[dt])
    np.testing.assert_allclose(f64(du), du_ref, **SW_TOL[dt])


@pytest.mark.parametrize("alias", ["dg", "du"])
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_swiglu_backward_metal_in_place(libs, dt, alias):
    """dg or du aliasing ds (unguarded buffers share the numpy memory): same as out of place."""
    n = 1000
    ds, g, u = swiglu_inputs(dt, n, 3)
    dg, du = np.empty(n, DT[dt]), np.empty(n, DT[dt])
    ew_dispatch(libs["swiglu"], f"swiglu_backward_{dt}", n, [ds, g, u, dg, du, SwigluArgs(n)], max_groups=2)
    other = np.empty(n, DT[dt])
    bufs = [ds, g, u, ds, other] if alias == "dg" else [ds, g, u, other, ds]
    ew_dispatch(libs["swiglu"], f"swiglu_backward_{dt}", n, bufs + [SwigluArgs(n)], max_groups=2, guard=False)
    np.testing.assert_array_equal(ds, dg if alias == "dg" else du)
    np.testing.assert_array_equal(other, du if alias == "dg" else dg)


# ---------------------------------------------------------------------------------------------
# rope
# ---------------------------------------------------------------------------------------------
def rope_ref(x, positions, inv_freq, sign):
    """float64 oracle with float64 angles (as the CPU backend)."""
    R = inv_freq.size
    th = sign * f64(positions)[:, None] * f64(inv_freq)[None, :]  # (T, R)
    c, s = np.cos(th), np.sin(th)
    y = f64(x).copy()
    a, b = y[..., :R].copy(), y[..., R:2 * R].copy()
    y[..., :R] = a * c - b * s
    y[..., R:2 * R] = b * c + a * s
    return y, np.abs(th)


def rope_run(lib, dt, x, positions, inv_freq, sign, max_groups=16, **kw):
    T, D = x.shape[-2:]
    rows, R = x.size // D, inv_freq.size
    grid = max(1, min(-(-rows * R // 64), max_groups))
    lib.dispatch(f"rope_{dt}", grid=(grid, 1, 1), threads=(64, 1, 1),
                 buffers=[x, positions, inv_freq, RopeArgs(rows, T, D, R, sign)], **kw)


def rope_check(dt, out, x, positions, inv_freq, sign):
    """The angle is computed in float (no double on Apple GPUs): theta = sign * pos * inv_freq is
    one float rounding, |theta| * 2^-24 absolute; precise::cos/sin and the rotation add a few
    ulps. So |out - ref| <= (|a| + |b|) * (|theta| * 2^-24 + 8 * 2^-24) in f32, plus one half
    rounding (2^-11 relative, with slack) of the output in f16. Dims >= 2R are untouched."""
    R = inv_freq.size
    ref, th = rope_ref(x, positions, inv_freq, sign)
    xf = f64(x)
    amp = np.abs(xf[..., :R]) + np.abs(xf[..., R:2 * R])  # bounds |a'| and |b'| too
    tol = amp * (th * U32 + 8 * U32) + (amp * 2.0 ** -10 if dt == "f16" else 0)
    tol = np.concatenate([tol, tol], -1)
    err = np.abs(f64(out[..., :2 * R]) - ref[..., :2 * R])
    assert np.all(err <= tol), float((err - tol).max())
    np.testing.assert_array_equal(out[..., 2 * R:], x[..., 2 * R:])


def inv_freq_of(D, R, base=10000.0):
    return (1.0 / base ** (np.arange(R) * 2.0 / D)).astype(np.float32)


# (B, T, D, R): R * 2 < D leaves dims untouched (partial rotary)
ROPE_SHAPES = [(1, 1, 2, 1), (1, 31, 64, 32), (2, 33, 64, 31), (1, 127, 66, 33), (3, 1, 128, 64), (4, 33, 64, 32)]


@pytest.mark.parametrize("B,T,D,R", ROPE_SHAPES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_rope_metal(libs, dt, B, T, D, R, sign):
    x = rng.standard_normal((B, T, D)).astype(DT[dt])
    positions = rng.integers(0, 4096, T).astype(np.int32)
    inv_freq = inv_freq_of(D, R)
    out = x.copy()
    rope_run(libs["rope"], dt, out, positions, inv_freq, sign)
    rope_check(dt, out, x, positions, inv_freq, sign)


def test_rope_metal_large_positions(libs):
    """Positions up to 2e5 with inv_freq up to 1: theta ~ 2e5, where the float angle is off by up
    to ~1e-2 rad; the stated tolerance (|theta| * 2^-24 absolute) still holds."""
    x = rng.standard_normal((2, 33, 64)).astype(np.float32)
    positions = rng.integers(100000, 200000, 33).astype(np.int32)
    inv_freq = inv_freq_of(64, 32)
    out = x.copy()
    rope_run(libs["rope"], "f32", out, positions, inv_freq, 1.0)
    rope_check("f32", out, x, positions, inv_freq, 1.0)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_rope_metal_backward_inverts_forward(libs, dt):
    x = rng.standard_normal((2, 33, 64)).astype(DT[dt])
    positions = np.arange(33, dtype=np.int32)
    inv_freq = inv_freq_of(64, 24)
    y = x.copy()
    rope_run(libs["rope"], dt, y, positions, inv_freq, 1.0)
    rope_run(libs["rope"], dt, y, positions, inv_freq, -1.0)
    tol = dict(rtol=1e-5, atol=1e-5) if dt == "f32" else dict(rtol=4e-3, atol=4e-3)
    np.testing.assert_allclose(f64(y), f64(x), **tol)
    np.testing.assert_array_equal(y[..., 48:], x[..., 48:])


# ---------------------------------------------------------------------------------------------
# rmsnorm_backward (dx only; dw is not part of this kernel)
# ---------------------------------------------------------------------------------------------
RMS_SHAPES = [(1, 1), (31, 33), (33, 31), (1, 127), (127, 1), (3, 128), (64, 2048)]


def rmsnorm_bwd_inputs(dt, rows, cols, eps=1e-5):
    x = rng.standard_normal((rows, cols)).astype(DT[dt])
    w = (1 + 0.5 * rng.standard_normal(cols)).astype(DT[dt])
    dy = rng.standard_normal((rows, cols)).astype(DT[dt])
    rstd = (1 / np.sqrt((f64(x) ** 2).mean(1) + eps)).astype(np.float32)
    return dy, x, w, rstd


def rmsnorm_bwd_run(lib, dt, dy, x, w, rstd, tg, extra_groups=0, out=None, **kw):
    rows, cols = x.shape
    dx = np.full((rows, cols), np.nan, DT[dt]) if out is None else out
    lib.dispatch(f"rmsnorm_backward_{dt}", grid=(rows + extra_groups, 1, 1), threads=(tg, 1, 1),
                 buffers=[dy, x, w, rstd, dx, RmsnormBackwardArgs(rows, cols, cols, cols, 0), dy], **kw)
    return dx


def rmsnorm_bwd_ref(dy, x, w, rstd):
    r = f64(rstd)[:, None]
    g = f64(dy) * f64(w)
    xhat = f64(x) * r
    return r * (g - xhat * (g * xhat).mean(1, keepdims=True))


@pytest.mark.parametrize("rows,cols", RMS_SHAPES)
@pytest.mark.parametrize("tg", [32, 256])
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_rmsnorm_backward_metal(libs, dt, rows, cols, tg):
    dy, x, w, rstd = rmsnorm_bwd_inputs(dt, rows, cols)
    dx = rmsnorm_bwd_run(libs["rmsnorm"], dt, dy, x, w, rstd, tg, extra_groups=1, random_order=True, seed=rows)
    # f32: a float dot over the row and a few roundings, O(1) values (1e-5); f16: inputs exact
    # in float, one rounding of the half output (2^-11) with slack
    tol = dict(rtol=1e-5, atol=1e-5) if dt == "f32" else dict(rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(f64(dx), rmsnorm_bwd_ref(dy, x, w, rstd), **tol)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_rmsnorm_backward_metal_in_place(libs, dt):
    """dx aliasing dy: same result as out of place."""
    dy, x, w, rstd = rmsnorm_bwd_inputs(dt, 4, 300)
    ref = rmsnorm_bwd_run(libs["rmsnorm"], dt, dy.copy(), x, w, rstd, 64)
    rmsnorm_bwd_run(libs["rmsnorm"], dt, dy, x, w, rstd, 64, out=dy, guard=False, random_order=True, seed=3)
    np.testing.assert_array_equal(dy, ref)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_rmsnorm_backward_metal_race_free(libs, dt):
    """Random thread orders and 1 or 2 workers, ragged (100) and full (1024) threadgroups."""
    for rows, cols, tg in [(5, 333, 100), (4, 4096, 1024)]:
        args = rmsnorm_bwd_inputs(dt, rows, cols)
        outs = [rmsnorm_bwd_run(libs["rmsnorm"], dt, *args, tg, **kw) for kw in ORDERS]
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])


def test_rmsnorm_backward_metal_missing_barrier_detected(libs):
    args = rmsnorm_bwd_inputs("f32", 4, 1000)
    ref = rmsnorm_bwd_run(libs["rmsnorm"], "f32", *args, 256, random_order=True)
    bad = libs["rmsnorm_nobarrier"]
    assert _caught(lambda seed: rmsnorm_bwd_run(bad, "f32", *args, 256, random_order=True, seed=seed), ref)


# ---------------------------------------------------------------------------------------------
# softmax_backward
# ---------------------------------------------------------------------------------------------
SMB_SHAPES = [(1, 1), (31, 31), (33, 33), (127, 127), (5, 31), (64, 2048)]


def softmax_bwd_inputs(dt, rows, cols):
    """P: causal softmax rows (zeros past the diagonal) rounded to dt; dP ~ N(0, 1)."""
    S = 2 * rng.standard_normal((rows, cols))
    q = np.arange(rows)[:, None] % cols + max(cols - rows, 0)
    S = np.where(np.arange(cols)[None, :] <= q, S, -np.inf)
    e = np.exp(S - S.max(1, keepdims=True))
    P = (e / e.sum(1, keepdims=True)).astype(DT[dt])
    return P, rng.standard_normal((rows, cols)).astype(DT[dt])


def softmax_bwd_run(lib, dt, P, dP, scale, tg, extra_groups=0, out=None, **kw):
    rows, cols = P.shape
    dS = np.full((rows, cols), np.nan, DT[dt]) if out is None else out
    lib.dispatch(f"softmax_backward_{dt}", grid=(rows + extra_groups, 1, 1), threads=(tg, 1, 1),
                 buffers=[P, dP, dS, SoftmaxBackwardArgs(rows, cols, scale)], **kw)
    return dS


def softmax_bwd_ref(P, dP, scale):
    P, dP = f64(P), f64(dP)
    return P * (dP - (P * dP).sum(1, keepdims=True)) * scale


# f32: the float row dot and a few roundings, |dS| <= ~|dP| (1e-5 rel, 1e-6 abs for the
# cancellation in dP - rowsum); f16: one half rounding of the output (2^-11) with slack, atol
# for values near the half subnormals. Entries where P == 0 must be exact zeros.
SMB_TOL = {"f32": dict(rtol=1e-5, atol=1e-6), "f16": dict(rtol=2e-3, atol=1e-5)}


@pytest.mark.parametrize("rows,cols", SMB_SHAPES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_softmax_backward_metal(libs, dt, rows, cols):
    P, dP = softmax_bwd_inputs(dt, rows, cols)
    tg = 32 if cols < 64 else 256
    dS = softmax_bwd_run(libs["softmax"], dt, P, dP, 0.7, tg, extra_groups=1, random_order=True, seed=cols)
    assert np.all(dS[P == 0] == 0)
    np.testing.assert_allclose(f64(dS), softmax_bwd_ref(P, dP, 0.7), **SMB_TOL[dt])


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_softmax_backward_metal_in_place(libs, dt):
    """dS aliasing dP: same result as out of place."""
    P, dP = softmax_bwd_inputs(dt, 40, 300)
    ref = softmax_bwd_run(libs["softmax"], dt, P, dP.copy(), 1.3, 64)
    softmax_bwd_run(libs["softmax"], dt, P, dP, 1.3, 64, out=dP, guard=False, random_order=True, seed=5)
    np.testing.assert_array_equal(dP, ref)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_softmax_backward_metal_race_free(libs, dt):
    P, dP = softmax_bwd_inputs(dt, 20, 300)
    for tg in (100, 1024):
        outs = [softmax_bwd_run(libs["softmax"], dt, P, dP, 0.5, tg, **kw) for kw in ORDERS]
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])


def test_softmax_backward_metal_missing_barrier_detected(libs):
    P, dP = softmax_bwd_inputs("f32", 8, 1000)
    ref = softmax_bwd_run(libs["softmax"], "f32", P, dP, 1.0, 256, random_order=True)
    bad = libs["softmax_nobarrier"]
    assert _caught(lambda seed: softmax_bwd_run(bad, "f32", P, dP, 1.0, 256, random_order=True, seed=seed), ref)
