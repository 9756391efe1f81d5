"""Every non-GEMM op of the backend contract (docs/architecture.md, 'The op contract') against a float64 numpy oracle
at awkward sizes and one realistic size, in every dtype the op accepts; backward ops also
against central finite differences taken through the device's own forward op; attention
causality, GQA folding and packed-sample segments built from the ops."""

import math

import numpy as np
import pytest

import krnl
from krnl import ops

from conftest import (FLOAT_DTYPES, device_dtypes, OUT_RTOL, SUBNORMAL, U32, UNIT_ROUNDOFF, assert_close,
                      assert_close_elementwise, attention_ops_missing, bf16_bits, bf16_value, empty_filled, read,
                      to_dev, upload)

# Shapes of row-wise ops (rows..., C): awkward row counts and widths, a 3-D one, a realistic one.
ROW_SHAPES = [(1, 1), (31, 33), (33, 127), (127, 31), (2, 3, 33), (256, 2048)]
ROW_IDS = ["1x1", "31x33", "33x127", "127x31", "2x3x33", "256x2048"]
# Sizes of elementwise ops: awkward, and one past a power of two at realistic scale.
SIZES = (1, 31, 33, 127, 100_003)

# Finite differences through the device's f32 forward op: L = sum(out * cotangent) in float64.
# With eps = 1e-2 the f32 rounding noise of L divided by 2*eps stays ~1e-4 of the gradient and
# the O(eps^2) truncation error as small; a wrong formula is off by O(1).
FD_EPS = 1e-2
FD_RTOL = 1e-2


def reduction_rtol(n):
    """Error of an f32 sum of n terms relative to the sum of their magnitudes: rounding errors
    add up like a random walk (sqrt(n) * 2^-24); 4x covers any summation order."""
    return 4.0 * math.sqrt(max(n, 1)) * U32


def fd_grad(f, x, eps=FD_EPS):
    """Central differences of the scalar function f (of a float32 array) at x, each step taken
    between the actually representable float32 points x +- eps."""
    x = np.asarray(x, dtype=np.float32)
    g = np.empty(x.shape)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += np.float32(eps)
        xm[i] -= np.float32(eps)
        g[i] = (f(xp) - f(xm)) / (float(xp[i]) - float(xm[i]))
    return g


def assert_fd(analytic, numeric, what):
    assert_close(analytic, numeric, rtol=FD_RTOL, atol=1e-6, what=what)
    # and not vacuously: the gradient is not all zeros
    assert np.max(np.abs(numeric)) > 1e-3, f"{what}: zero gradient, the check says nothing"


# ---------------------------------------------------------------------------------- RMSNorm


def rmsnorm_ref(x, w, eps):
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * rstd * w, rstd[..., 0]


def rmsnorm_backward_ref(dy, x, w, rstd):
    """dx and dw of y = x*rstd*w, rstd = (mean(x^2)+eps)^-1/2 given (as saved by the forward)."""
    r = rstd[..., None]
    xhat = x * r
    g = dy * w
    m = np.mean(g * xhat, axis=-1, keepdims=True)
    dx = r * (g - xhat * m)
    dw = (dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0)
    # magnitude of the terms before cancellation, for the error bound
    mag = r * (np.abs(g) + np.abs(xhat) * np.mean(np.abs(g * xhat), axis=-1, keepdims=True))
    dw_mag = np.abs(dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0)
    return dx, dw, mag, dw_mag


RMS_FWD_DTYPES = [("f32", "f32", "f32"), ("f16", "f16", "f16"), ("bf16", "bf16", "bf16"),
                  ("f16", "f32", "f16"), ("bf16", "f32", "bf16"), ("bf16", "f32", "f32")]


@pytest.mark.parametrize("xdt,wdt,ydt", RMS_FWD_DTYPES, ids=["-".join(d) for d in RMS_FWD_DTYPES])
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ROW_IDS)
def test_rmsnorm_forward(dev, shape, xdt, wdt, ydt):
    rng = np.random.default_rng(10)
    C = shape[-1]
    w, wf = upload(dev, 1.0 + 0.5 * rng.standard_normal(C), wdt)
    # x at unit scale and at 1e-3 (mean(x^2) ~ 1e-6 < eps: eps inside the sqrt matters there)
    for mag, eps in ((1.0, 1e-5), (1e-3, 1e-5), (3.0, 1e-6)):
        x, xf = upload(dev, mag * rng.standard_normal(shape), xdt)
        y = empty_filled(dev, shape, ydt)
        rstd = empty_filled(dev, shape[:-1], "f32")
        ops.rmsnorm_forward(x, w, y, rstd, eps=eps)
        ref, rstd_ref = rmsnorm_ref(xf, wf, np.float64(np.float32(eps)))
        r_tol = reduction_rtol(C) + 4 * U32  # f32 sum of squares, sqrt, divide
        assert_close_elementwise(read(rstd), rstd_ref, rtol=r_tol, what=f"rstd mag={mag}")
        assert_close_elementwise(read(y), ref, rtol=OUT_RTOL[ydt] + r_tol, atol=SUBNORMAL[ydt],
                                 what=f"y mag={mag} eps={eps}")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("rows,C,extra", [(1, 8, 8), (31, 64, 48), (33, 127, 1), (127, 256, 32)])
def test_rmsnorm_forward_strided_out(dev, dt, rows, C, extra):
    """y as the first C columns of a (rows, C + extra) buffer (lora_fold.py writes the norm there):
    those columns equal a contiguous call's bit for bit, the other columns keep their contents."""
    rng = np.random.default_rng(11)
    w, _ = upload(dev, 1.0 + 0.5 * rng.standard_normal(C), dt)
    x, _ = upload(dev, rng.standard_normal((rows, C)), dt)
    wide = dev.tensor(np.full((rows, C + extra), 7.0, np.float32), dt)
    r1, r2 = empty_filled(dev, (rows,), "f32"), empty_filled(dev, (rows,), "f32")
    y = empty_filled(dev, (rows, C), dt)
    ops.rmsnorm_forward(x, w, y, r1, eps=1e-5)
    ops.rmsnorm_forward(x, w, wide[:, :C], r2, eps=1e-5)
    got = np.array(wide.numpy(), copy=True)
    check_bits(got[:, :C], np.array(y.numpy(), copy=True), "strided y")
    check_bits(np.array(r2.numpy(), copy=True), np.array(r1.numpy(), copy=True), "rstd")
    assert np.all(got[:, C:] == 7.0)


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("rows,C", [(1, 8), (31, 64), (33, 127), (127, 256)])
def test_rmsnorm_forward_residual(dev, dt, rows, C):
    """With residual, x += residual in place and the norm reads the sum: x, y and rstd equal an
    add followed by the plain norm bit for bit, and x the float64 sum to the dtype's rounding."""
    rng = np.random.default_rng(13)
    w, _ = upload(dev, 1.0 + 0.5 * rng.standard_normal(C), dt)
    x0, xf = upload(dev, rng.standard_normal((rows, C)), dt)
    res, rf = upload(dev, rng.standard_normal((rows, C)), dt)
    x1, x2 = dev.tensor(read(x0), dt), dev.tensor(read(x0), dt)
    y1, y2 = empty_filled(dev, (rows, C), dt), empty_filled(dev, (rows, C), dt)
    r1, r2 = empty_filled(dev, (rows,), "f32"), empty_filled(dev, (rows,), "f32")
    ops.add(x1, res, x1)
    ops.rmsnorm_forward(x1, w, y1, r1, eps=1e-5)
    ops.rmsnorm_forward(x2, w, y2, r2, eps=1e-5, residual=res)
    for got, want, what in ((x2, x1, "x"), (y2, y1, "y"), (r2, r1, "rstd")):
        check_bits(np.array(got.numpy(), copy=True), np.array(want.numpy(), copy=True), what)
    assert_close_elementwise(read(x2), xf + rf, rtol=UNIT_ROUNDOFF[dt], atol=SUBNORMAL[dt], what="x + residual")
    with pytest.raises(ValueError, match=r"^\[rmsnorm_forward\] residual must have shape"):
        ops.rmsnorm_forward(x2, w, y2, r2, eps=1e-5, residual=dev.empty((rows, C + 1), dt))


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("rows,C,extra", [(1, 8, 0), (31, 64, 16), (33, 127, 1), (127, 256, 32)])
def test_rmsnorm_backward_residual(dev, dt, rows, C, extra):
    """With residual, dx = the norm's gradient + residual: equal to rmsnorm_backward followed by
    axpy bit for bit. With extra > 0, dx and residual are the first C columns of (rows, C + extra)
    buffers (a LoRA fold's widened gradients) whose other columns keep their contents."""
    rng = np.random.default_rng(14)
    x, _ = upload(dev, rng.standard_normal((rows, C)), dt)
    w, _ = upload(dev, 1.0 + 0.5 * rng.standard_normal(C), dt)
    dy, _ = upload(dev, rng.standard_normal((rows, C)), dt)
    rstd = empty_filled(dev, (rows,), "f32")
    ops.rmsnorm_forward(x, w, empty_filled(dev, (rows, C), dt), rstd, eps=1e-5)
    res_wide = dev.tensor(rng.standard_normal((rows, C + extra)).astype(np.float32), dt)
    dx_wide = dev.tensor(np.full((rows, C + extra), 7.0, np.float32), dt)
    res, dx = res_wide[:, :C], dx_wide[:, :C]
    want = empty_filled(dev, (rows, C), dt)
    ops.rmsnorm_backward(dy, x, w, rstd, want)
    ops.axpy(1.0, dev.tensor(read(res), dt), want)
    ops.rmsnorm_backward(dy, x, w, rstd, dx, residual=res)
    got = np.array(dx_wide.numpy(), copy=True)
    check_bits(got[:, :C], np.array(want.numpy(), copy=True), "dx + residual")
    assert np.all(got[:, C:] == 7.0)


RMS_BWD_DTYPES = [("f32", "f32", "f32", "f32"), ("f16", "f16", "f16", "f16"), ("bf16", "bf16", "bf16", "bf16"),
                  ("f16", "f32", "f16", "f16"), ("bf16", "f32", "bf16", "bf16"), ("bf16", "f32", "f32", "f32")]


@pytest.mark.parametrize("xdt,wdt,dydt,dxdt", RMS_BWD_DTYPES, ids=["-".join(d) for d in RMS_BWD_DTYPES])
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ROW_IDS)
def test_rmsnorm_backward(dev, shape, xdt, wdt, dydt, dxdt):
    """dx overwritten, dw (f32) accumulated onto its previous contents, against the float64
    analytic gradient."""
    rng = np.random.default_rng(11)
    C = shape[-1]
    eps = 1e-5
    x, xf = upload(dev, rng.standard_normal(shape), xdt)
    w, wf = upload(dev, 1.0 + 0.5 * rng.standard_normal(C), wdt)
    dy, dyf = upload(dev, rng.standard_normal(shape), dydt)
    _, rstd64 = rmsnorm_ref(xf, wf, eps)
    rstd, rstdf = upload(dev, rstd64, "f32")
    dw, dw0 = upload(dev, rng.standard_normal(C), "f32")
    dx = empty_filled(dev, shape, dxdt, 123.0)
    ops.rmsnorm_backward(dy, x, w, rstd, dx, dw)
    ref_dx, ref_dw, mag, dw_mag = rmsnorm_backward_ref(dyf, xf, wf, rstdf)
    got_dx = read(dx)
    err_tol = (reduction_rtol(C) + 8 * U32) * mag + SUBNORMAL[dxdt]
    assert_close_elementwise(got_dx, ref_dx, rtol=UNIT_ROUNDOFF[dxdt], atol=err_tol, what="dx")
    rows = int(np.prod(shape[:-1]))
    dw_tol = (reduction_rtol(rows) + 4 * U32) * (dw_mag + np.abs(dw0))
    assert_close_elementwise(read(dw), dw0 + ref_dw, rtol=0.0, atol=dw_tol, what="dw accumulated")
    # a second call accumulates again; dx is overwritten with the same values; dw optional
    ops.rmsnorm_backward(dy, x, w, rstd, dx, dw)
    assert_close_elementwise(read(dw), dw0 + 2 * ref_dw, rtol=0.0, atol=2 * dw_tol, what="dw twice")
    np.testing.assert_array_equal(read(dx), got_dx)
    dx2 = empty_filled(dev, shape, dxdt)
    ops.rmsnorm_backward(dy, x, w, rstd, dx2)
    np.testing.assert_array_equal(read(dx2), got_dx)


def test_rmsnorm_backward_finite_differences(dev):
    """dx and dw from rmsnorm_backward against central differences of the device's own f32
    rmsnorm_forward, loss L = sum(y * dy)."""
    rng = np.random.default_rng(12)
    shape, eps = (3, 33), 1e-5
    x0 = rng.standard_normal(shape).astype(np.float32)
    w0 = (1.0 + 0.5 * rng.standard_normal(shape[-1])).astype(np.float32)
    ct = rng.standard_normal(shape)

    def loss(xv, wv):
        y, rstd = dev.empty(shape), dev.empty(shape[:-1])
        ops.rmsnorm_forward(to_dev(dev, xv), to_dev(dev, wv), y, rstd, eps=eps)
        return float(np.sum(read(y) * ct))

    x, w = to_dev(dev, x0), to_dev(dev, w0)
    y, rstd = dev.empty(shape), dev.empty(shape[:-1])
    ops.rmsnorm_forward(x, w, y, rstd, eps=eps)
    dx, dw = dev.empty(shape), dev.zeros(shape[-1])
    ops.rmsnorm_backward(to_dev(dev, ct), x, w, rstd, dx, dw)
    assert_fd(read(dx), fd_grad(lambda xv: loss(xv, w0), x0), "dx")
    assert_fd(read(dw), fd_grad(lambda wv: loss(x0, wv), w0), "dw")


# ----------------------------------------------------------------------------------- SwiGLU

SWIGLU_SHAPES = [(1,), (31,), (33, 127), (127, 33), (256, 5632)]
SWIGLU_IDS = ["1", "31", "33x127", "127x33", "256x5632"]


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=SWIGLU_IDS)
def test_swiglu_forward(dev, shape, dt):
    rng = np.random.default_rng(13)
    g, gf = upload(dev, 3 * rng.standard_normal(shape), dt)
    u, uf = upload(dev, rng.standard_normal(shape), dt)
    s = empty_filled(dev, shape, dt)
    ops.swiglu_forward(g, u, s)
    ref = gf * sigmoid(gf) * uf
    assert_close_elementwise(read(s), ref, rtol=OUT_RTOL[dt], atol=SUBNORMAL[dt], what="s")


def swiglu_backward_ref(ds, g, u):
    sg = sigmoid(g)
    factor = 1.0 + g * (1.0 - sg)  # cancels near g = -1.28: bound its terms separately
    dg = ds * u * sg * factor
    du = ds * g * sg
    dg_mag = np.abs(ds * u * sg) * (1.0 + np.abs(g * (1.0 - sg)))
    return dg, du, dg_mag


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=SWIGLU_IDS)
def test_swiglu_backward(dev, shape, dt):
    rng = np.random.default_rng(14)
    g, gf = upload(dev, 3 * rng.standard_normal(shape), dt)
    u, uf = upload(dev, rng.standard_normal(shape), dt)
    ds, dsf = upload(dev, rng.standard_normal(shape), dt)
    dg, du = empty_filled(dev, shape, dt), empty_filled(dev, shape, dt)
    ops.swiglu_backward(ds, g, u, dg, du)
    ref_dg, ref_du, dg_mag = swiglu_backward_ref(dsf, gf, uf)
    assert_close_elementwise(read(dg), ref_dg, rtol=UNIT_ROUNDOFF[dt], atol=16 * U32 * dg_mag + SUBNORMAL[dt],
                             what="dg")
    assert_close_elementwise(read(du), ref_du, rtol=OUT_RTOL[dt], atol=SUBNORMAL[dt], what="du")


def test_swiglu_backward_finite_differences(dev):
    rng = np.random.default_rng(15)
    shape = (3, 31)
    g0 = (2 * rng.standard_normal(shape)).astype(np.float32)
    u0 = rng.standard_normal(shape).astype(np.float32)
    ct = rng.standard_normal(shape)

    def loss(gv, uv):
        s = dev.empty(shape)
        ops.swiglu_forward(to_dev(dev, gv), to_dev(dev, uv), s)
        return float(np.sum(read(s) * ct))

    dg, du = dev.empty(shape), dev.empty(shape)
    ops.swiglu_backward(to_dev(dev, ct), to_dev(dev, g0), to_dev(dev, u0), dg, du)
    assert_fd(read(dg), fd_grad(lambda gv: loss(gv, u0), g0), "dg")
    assert_fd(read(du), fd_grad(lambda uv: loss(g0, uv), u0), "du")


SWIGLU_ALPHA, SWIGLU_LIMIT = float(np.float32(1.702)), 7.0  # gpt-oss's, alpha as the op receives it


def clamped_swiglu_inputs(dev, rng, shape, dt):
    """g and u over (-2 limit, 2 limit), a tenth of each exactly at +limit and a tenth at -limit."""
    g, u = (2 * SWIGLU_LIMIT * (2 * rng.random(shape) - 1) for _ in range(2))
    for x, off in ((g, 0), (u, 3)):
        x.flat[off::10], x.flat[off + 5::10] = SWIGLU_LIMIT, -SWIGLU_LIMIT
    return upload(dev, g, dt), upload(dev, u, dt)


def clamped_swiglu_ref(g, u, alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT):
    """float64 s, ds-free dg and du of gpt-oss's clamped SwiGLU (transformers' GptOssExperts), the
    gradients passing torch.clamp where its input lies within the bounds, bounds included; and the
    size of the terms that f32 rounds (u + 1 cancels near u = -1, 1 + alpha x (1 - sg) near x = -0.75)."""
    x, v = np.minimum(g, limit), np.clip(u, -limit, limit) + 1
    sg = sigmoid(alpha * x)
    grad_x = np.where(g <= limit, v * sg * (1 + alpha * x * (1 - sg)), 0.0)
    grad_u = np.where(np.abs(u) <= limit, x * sg, 0.0)
    mag = np.abs(x * sg) * (np.abs(v) + 2) * (1 + np.abs(alpha * x))
    return x * sg * v, grad_x, grad_u, mag


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=SWIGLU_IDS)
def test_swiglu_forward_clamped(dev, shape, dt):
    """limit > 0: gpt-oss's clamped form, inputs straddling +-limit and exactly on both bounds."""
    (g, gf), (u, uf) = clamped_swiglu_inputs(dev, np.random.default_rng(16), shape, dt)
    s = empty_filled(dev, shape, dt)
    ops.swiglu_forward(g, u, s, SWIGLU_ALPHA, SWIGLU_LIMIT)
    ref, _, _, mag = clamped_swiglu_ref(gf, uf)
    assert_close_elementwise(read(s), ref, rtol=OUT_RTOL[dt], atol=32 * U32 * mag + SUBNORMAL[dt], what="s")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=SWIGLU_IDS)
def test_swiglu_backward_clamped(dev, shape, dt):
    """dg, du of the clamped form: zero past the clamps, passed on the bounds themselves."""
    rng = np.random.default_rng(17)
    (g, gf), (u, uf) = clamped_swiglu_inputs(dev, rng, shape, dt)
    ds, dsf = upload(dev, rng.standard_normal(shape), dt)
    dg, du = empty_filled(dev, shape, dt), empty_filled(dev, shape, dt)
    ops.swiglu_backward(ds, g, u, dg, du, SWIGLU_ALPHA, SWIGLU_LIMIT)
    _, grad_x, grad_u, mag = clamped_swiglu_ref(gf, uf)
    atol = 32 * U32 * np.abs(dsf) * mag + SUBNORMAL[dt]
    assert_close_elementwise(read(dg), dsf * grad_x, rtol=OUT_RTOL[dt], atol=atol, what="dg")
    assert_close_elementwise(read(du), dsf * grad_u, rtol=OUT_RTOL[dt], atol=atol, what="du")
    assert np.all(read(dg)[gf > SWIGLU_LIMIT] == 0) and np.all(read(du)[np.abs(uf) > SWIGLU_LIMIT] == 0)
    on = (gf == SWIGLU_LIMIT) & (np.abs(dsf * grad_x) > 1e-3)  # clear of f16's underflow
    assert on.sum() > 0 and np.all(read(dg)[on] != 0), "the bound itself passes the gradient"


@pytest.mark.parametrize("alias", ["s=g", "s=u", "dg=ds", "du=ds", "dg=g,du=u"])
def test_swiglu_clamped_in_place(dev, alias):
    """Outputs may alias inputs in the clamped form too (every input of an element is read first)."""
    rng = np.random.default_rng(18)
    shape = (33, 31)
    (g, gf), (u, uf) = clamped_swiglu_inputs(dev, rng, shape, "f32")
    ds, dsf = upload(dev, rng.standard_normal(shape))
    s_ref, grad_x, grad_u, mag = clamped_swiglu_ref(gf, uf)
    atol = 32 * U32 * mag * np.maximum(1, np.abs(dsf))
    if alias.startswith("s="):
        s = g if alias == "s=g" else u
        ops.swiglu_forward(g, u, s, SWIGLU_ALPHA, SWIGLU_LIMIT)
        assert_close_elementwise(read(s), s_ref, rtol=OUT_RTOL["f32"], atol=atol, what=alias)
        return
    other = empty_filled(dev, shape, "f32")
    dg, du = {"dg=ds": (ds, other), "du=ds": (other, ds), "dg=g,du=u": (g, u)}[alias]
    ops.swiglu_backward(ds, g, u, dg, du, SWIGLU_ALPHA, SWIGLU_LIMIT)
    assert_close_elementwise(read(dg), dsf * grad_x, rtol=OUT_RTOL["f32"], atol=atol, what=f"dg ({alias})")
    assert_close_elementwise(read(du), dsf * grad_u, rtol=OUT_RTOL["f32"], atol=atol, what=f"du ({alias})")


def test_swiglu_clamped_finite_differences(dev):
    """The clamped form's backward is the gradient of sum(s * ct) through its own forward, away
    from the kinks at +-limit (where central differences straddle two slopes)."""
    rng = np.random.default_rng(19)
    shape, alpha, limit = (3, 31), 1.5, 2.0
    g0, u0 = ((3 * rng.standard_normal(shape)).astype(np.float32) for _ in range(2))
    for x in (g0, u0):
        x[np.abs(np.abs(x) - limit) < 0.05] += np.float32(0.1)
    ct = rng.standard_normal(shape)

    def loss(gv, uv):
        s = dev.empty(shape)
        ops.swiglu_forward(to_dev(dev, gv), to_dev(dev, uv), s, alpha, limit)
        return float(np.sum(read(s) * ct))

    dg, du = dev.empty(shape), dev.empty(shape)
    ops.swiglu_backward(to_dev(dev, ct), to_dev(dev, g0), to_dev(dev, u0), dg, du, alpha, limit)
    assert_fd(read(dg), fd_grad(lambda gv: loss(gv, u0), g0), "dg")
    assert_fd(read(du), fd_grad(lambda uv: loss(g0, uv), u0), "du")


def test_swiglu_bad_clamp(dev):
    """alpha belongs to the clamped form only; the limit must be finite."""
    x = dev.empty((4,))
    with pytest.raises(ValueError, match=r"\[swiglu_forward\] alpha=1.702000 needs limit > 0"):
        ops.swiglu_forward(x, x, x, 1.702)
    with pytest.raises(ValueError, match=r"\[swiglu_backward\] alpha=2.000000 needs limit > 0"):
        ops.swiglu_backward(x, x, x, x, x, 2.0, -1.0)
    with pytest.raises(ValueError, match=r"\[swiglu_forward\] limit must be finite"):
        ops.swiglu_forward(x, x, x, 1.0, math.inf)


# ------------------------------------------------------------------- GeGLU and soft-capping

GELU_K, GELU_A = math.sqrt(2.0 / math.pi), 0.044715
GEGLU_SHAPES = [(1,), (31,), (33, 127), (127, 33), (100_003,)]
GEGLU_IDS = ["1", "31", "33x127", "127x33", "100003"]
# f32 math cannot give gelu values below ~1e-38 (g < -13: exp(-2z) overflows, the sigmoid is 0),
# which bf16 could hold: an absolute allowance far below anything a model feels.
GEGLU_ATOL = 2.0**-100


def geglu_ref(g, u):
    """s = gelu_tanh(g) u in float64 (transformers' gelu_pytorch_tanh: 0.5 x (1 + tanh(k (x + a x^3)))),
    with the pieces the error bounds need: gelu'(g) and the magnitude of its two terms (they cancel
    near g = -0.75), and cond, the relative error f32 gets from a few-ulp error in z = k (g + a g^3),
    which the sigmoid/tanh amplifies by |2 z| (1 - sigmoid(2 z)) for negative g."""
    z = GELU_K * (g + GELU_A * g ** 3)
    # (1 + tanh z) / 2 as the sigmoid of 2z: 1 + tanh(z) cancels even in float64 for z < -10
    sg = 1.0 / (1.0 + np.exp(-2.0 * z))
    assert np.allclose(sg[np.abs(z) < 3], 0.5 * (1.0 + np.tanh(z[np.abs(z) < 3])), rtol=1e-12, atol=0)
    gelu = g * sg
    second = 2.0 * g * sg * (1.0 - sg) * GELU_K * (1.0 + 3.0 * GELU_A * g * g)  # 0.5 g (1 - t^2) k (1 + 3 a g^2)
    dgelu = sg + second
    cond = 1.0 + np.abs(2.0 * z) * (1.0 - sg)
    return gelu * u, gelu, dgelu, sg + np.abs(second), cond


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", GEGLU_SHAPES, ids=GEGLU_IDS)
def test_geglu_forward(dev, shape, dt):
    rng = np.random.default_rng(113)
    g, gf = upload(dev, 3 * rng.standard_normal(shape), dt)
    u, uf = upload(dev, rng.standard_normal(shape), dt)
    s = empty_filled(dev, shape, dt)
    ops.geglu_forward(g, u, s)
    ref, _, _, _, cond = geglu_ref(gf, uf)
    atol = GEGLU_ATOL + SUBNORMAL[dt]
    assert_close_elementwise(read(s), ref, rtol=UNIT_ROUNDOFF[dt] + 16 * U32 * cond, atol=atol, what="s")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", GEGLU_SHAPES, ids=GEGLU_IDS)
def test_geglu_backward(dev, shape, dt):
    rng = np.random.default_rng(114)
    g, gf = upload(dev, 3 * rng.standard_normal(shape), dt)
    u, uf = upload(dev, rng.standard_normal(shape), dt)
    ds, dsf = upload(dev, rng.standard_normal(shape), dt)
    dg, du = empty_filled(dev, shape, dt), empty_filled(dev, shape, dt)
    ops.geglu_backward(ds, g, u, dg, du)
    _, gelu, dgelu, dgelu_mag, cond = geglu_ref(gf, uf)
    atol = GEGLU_ATOL + SUBNORMAL[dt]
    assert_close_elementwise(read(dg), dsf * uf * dgelu, rtol=UNIT_ROUNDOFF[dt],
                             atol=16 * U32 * cond * np.abs(dsf * uf) * dgelu_mag + atol, what="dg")
    assert_close_elementwise(read(du), dsf * gelu, rtol=UNIT_ROUNDOFF[dt] + 16 * U32 * cond, atol=atol, what="du")


@pytest.mark.parametrize("alias", ["dg", "du"])
def test_geglu_backward_in_place(dev, alias):
    """dg or du may be ds itself (every input of an element is read before its outputs are written)."""
    rng = np.random.default_rng(115)
    shape = (33, 31)
    g, gf = upload(dev, 3 * rng.standard_normal(shape))
    u, uf = upload(dev, rng.standard_normal(shape))
    ds, dsf = upload(dev, rng.standard_normal(shape))
    other = empty_filled(dev, shape, "f32")
    dg, du = (ds, other) if alias == "dg" else (other, ds)
    ops.geglu_backward(ds, g, u, dg, du)
    _, gelu, dgelu, dgelu_mag, cond = geglu_ref(gf, uf)
    atol = GEGLU_ATOL + SUBNORMAL["f32"]
    assert_close_elementwise(read(dg), dsf * uf * dgelu, rtol=U32,
                             atol=16 * U32 * cond * np.abs(dsf * uf) * dgelu_mag + atol, what="dg")
    assert_close_elementwise(read(du), dsf * gelu, rtol=U32 + 16 * U32 * cond, atol=atol, what="du")


def test_geglu_backward_finite_differences(dev):
    rng = np.random.default_rng(116)
    shape = (3, 31)
    g0 = (2 * rng.standard_normal(shape)).astype(np.float32)
    u0 = rng.standard_normal(shape).astype(np.float32)
    ct = rng.standard_normal(shape)

    def loss(gv, uv):
        s = dev.empty(shape)
        ops.geglu_forward(to_dev(dev, gv), to_dev(dev, uv), s)
        return float(np.sum(read(s) * ct))

    dg, du = dev.empty(shape), dev.empty(shape)
    ops.geglu_backward(to_dev(dev, ct), to_dev(dev, g0), to_dev(dev, u0), dg, du)
    assert_fd(read(dg), fd_grad(lambda gv: loss(gv, u0), g0), "dg")
    assert_fd(read(du), fd_grad(lambda uv: loss(g0, uv), u0), "du")


@pytest.mark.torch
def test_geglu_matches_transformers(dev):
    """The activation is transformers' "gelu_pytorch_tanh" (Gemma's hidden_activation), forward and
    gradient through torch's autograd, in f32: the formula, not just self-consistency."""
    torch = pytest.importorskip("torch")
    act = pytest.importorskip("transformers.activations").ACT2FN["gelu_pytorch_tanh"]
    rng = np.random.default_rng(122)
    shape = (33, 31)
    g0, u0, ds0 = (rng.standard_normal(shape).astype(np.float32) * c for c in (3, 1, 1))
    tg, tu = torch.tensor(g0, requires_grad=True), torch.tensor(u0, requires_grad=True)
    ts = act(tg) * tu
    ts.backward(torch.tensor(ds0))
    s, dg, du = (dev.empty(shape) for _ in range(3))
    ops.geglu_forward(to_dev(dev, g0), to_dev(dev, u0), s)
    ops.geglu_backward(to_dev(dev, ds0), to_dev(dev, g0), to_dev(dev, u0), dg, du)
    for got, want, what in ((s, ts, "s"), (dg, tg.grad, "dg"), (du, tu.grad, "du")):
        assert_close(read(got), want.detach().numpy().astype(np.float64), rtol=1e-5, what=what)


def softcap_inputs(rng, shape, cap):
    """Scores across the whole curve: tiny (|x| ~ 1e-3 cap, where tanh is near linear and needs
    relative accuracy), moderate, and saturated (|x| several caps)."""
    x = cap * rng.standard_normal(shape) * rng.choice([1e-3, 0.3, 1.0, 4.0], size=shape)
    return x


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", GEGLU_SHAPES, ids=GEGLU_IDS)
def test_softcap(dev, shape, dt):
    rng = np.random.default_rng(117)
    for cap in (50.0, 30.0, 0.7):
        x, xf = upload(dev, softcap_inputs(rng, shape, cap), dt)
        out = empty_filled(dev, shape, dt)
        ops.softcap(x, cap, out)
        ref = cap * np.tanh(xf / cap)  # cap: 50, 30 and 0.7 in f32 differ from float64 by < 1 ulp
        assert_close_elementwise(read(out), ref, rtol=OUT_RTOL[dt], atol=SUBNORMAL[dt], what=f"cap={cap}")


def test_softcap_in_place(dev):
    rng = np.random.default_rng(118)
    x, xf = upload(dev, softcap_inputs(rng, (127, 33), 30.0))
    ops.softcap(x, 30.0, x)
    assert_close_elementwise(read(x), 30.0 * np.tanh(xf / 30.0), rtol=OUT_RTOL["f32"], atol=SUBNORMAL["f32"])


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", GEGLU_SHAPES, ids=GEGLU_IDS)
def test_softcap_backward(dev, shape, dt):
    """dx = dy (1 - (y / cap)^2) from the output y; near saturation 1 - r^2 cancels, so the bound
    carries the rounding of r^2 (a few ulp of r^2) beside the output's."""
    rng = np.random.default_rng(119)
    cap = 30.0
    y, yf = upload(dev, cap * np.tanh(softcap_inputs(rng, shape, cap) / cap), dt)
    dy, dyf = upload(dev, rng.standard_normal(shape), dt)
    dx = empty_filled(dev, shape, dt)
    ops.softcap_backward(dy, y, cap, dx)
    r = yf / cap
    ref = dyf * (1.0 - r * r)
    assert_close_elementwise(read(dx), ref, rtol=OUT_RTOL[dt], atol=8 * U32 * np.abs(dyf) * r * r + SUBNORMAL[dt],
                             what="dx")


@pytest.mark.parametrize("alias", ["dy", "y"])
def test_softcap_backward_in_place(dev, alias):
    rng = np.random.default_rng(120)
    cap, shape = 50.0, (31, 33)
    y, yf = upload(dev, cap * np.tanh(softcap_inputs(rng, shape, cap) / cap))
    dy, dyf = upload(dev, rng.standard_normal(shape))
    ops.softcap_backward(dy, y, cap, dy if alias == "dy" else y)
    r = yf / cap
    got = read(dy if alias == "dy" else y)
    assert_close_elementwise(got, dyf * (1.0 - r * r), rtol=OUT_RTOL["f32"],
                             atol=8 * U32 * np.abs(dyf) * r * r + SUBNORMAL["f32"])


def test_softcap_backward_finite_differences(dev):
    """softcap_backward(ct, softcap(x)) is the gradient of L = sum(softcap(x) * ct), differences
    taken through the device's forward."""
    rng = np.random.default_rng(121)
    shape, cap = (3, 31), 5.0
    x0 = (4 * rng.standard_normal(shape)).astype(np.float32)
    ct = rng.standard_normal(shape)

    def loss(xv):
        out = dev.empty(shape)
        ops.softcap(to_dev(dev, xv), cap, out)
        return float(np.sum(read(out) * ct))

    y = dev.empty(shape)
    ops.softcap(to_dev(dev, x0), cap, y)
    dx = dev.empty(shape)
    ops.softcap_backward(to_dev(dev, ct), y, cap, dx)
    assert_fd(read(dx), fd_grad(loss, x0), "dx")


def assert_bad_calls(cases):
    """Each (op, call, needle): call() raises one line starting with [op] and naming needle."""
    for op, call, needle in cases:
        with pytest.raises(ValueError) as e:
            call()
        msg = str(e.value)
        assert msg.startswith(f"[{op}] ") and needle in msg and "\n" not in msg, msg


def test_geglu_and_softcap_bad_calls(dev):
    """Bad shapes, dtypes and caps raise one-line ValueErrors naming the op and the argument."""
    z = lambda shape, dt="f32": dev.zeros(shape, dt)  # noqa: E731
    cases = [
        ("geglu_forward", lambda: ops.geglu_forward(z((3, 4)), z((3, 5)), z((3, 4))), "u"),
        ("geglu_forward", lambda: ops.geglu_forward(z((3, 4)), z((3, 4), "f16"), z((3, 4))), "u"),
        ("geglu_forward", lambda: ops.geglu_forward(z((3, 4), "i32"), z((3, 4), "i32"), z((3, 4), "i32")), "g"),
        ("geglu_backward", lambda: ops.geglu_backward(z((3, 4)), z((3, 4)), z((3, 4)), z((4, 3)), z((3, 4))), "dg"),
        ("geglu_backward", lambda: ops.geglu_backward(z((3, 4), "f16"), z((3, 4)), z((3, 4)), z((3, 4)), z((3, 4))),
         "ds"),
        ("softcap", lambda: ops.softcap(z((5,)), 30.0, z((6,))), "out"),
        ("softcap", lambda: ops.softcap(z((5,)), 30.0, z((5,), "bf16")), "out"),
        ("softcap", lambda: ops.softcap(z((5,)), 0.0, z((5,))), "cap"),
        ("softcap", lambda: ops.softcap(z((5,)), -1.0, z((5,))), "cap"),
        ("softcap", lambda: ops.softcap(z((5,)), float("inf"), z((5,))), "cap"),
        ("softcap_backward", lambda: ops.softcap_backward(z((5,)), z((5,)), 50.0, z((4,))), "dx"),
        ("softcap_backward", lambda: ops.softcap_backward(z((5,), "f16"), z((5,)), 50.0, z((5,))), "dy"),
        ("softcap_backward", lambda: ops.softcap_backward(z((5,)), z((5,)), float("nan"), z((5,))), "cap"),
        ("softmax_causal_forward", lambda: ops.softmax_causal_forward(z((4, 4)), z((4, 4)), 1.0, window=-1),
         "window"),
    ]
    assert_bad_calls(cases)


# ------------------------------------------------------------------ DoRA's column scale, norm

# (rows, columns) of the column ops; a view: the operands are columns 3.. of wider buffers (q|k|v blocks)
COLUMN_SHAPES = [(1, 1), (31, 33), (33, 127), (127, 31)]
COLUMN_IDS = ["1x1", "31x33", "33x127", "127x31"]


def column_operand(dev, rng, shape, dt, view, scale=1.0):
    """(tensor, float64 copy) of random (rows, cols): contiguous, or columns 3.. of a wider buffer
    (the rest NaN, which an op reading past its columns would spread)."""
    t, ref = upload(dev, scale * rng.standard_normal(shape), dt)
    if not view:
        return t, ref
    wide = empty_filled(dev, (shape[0], shape[1] + 5), dt)
    ops.scale_columns(t, to_dev(dev, np.ones(shape[1])), wide[:, 3:3 + shape[1]])
    return wide[:, 3:3 + shape[1]], ref


@pytest.mark.parametrize("view", [False, True], ids=["contiguous", "view"])
@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", COLUMN_SHAPES, ids=COLUMN_IDS)
def test_scale_columns(dev, shape, dt, view):
    rng = np.random.default_rng(130)
    x, xf = column_operand(dev, rng, shape, dt, view)
    v = rng.standard_normal(shape[1]).astype(np.float32)
    out = column_operand(dev, rng, shape, dt, view)[0] if view else empty_filled(dev, shape, dt)
    ops.scale_columns(x, to_dev(dev, v), out)
    assert_close_elementwise(read(out), xf * v, rtol=OUT_RTOL[dt], atol=SUBNORMAL[dt])


def test_scale_columns_in_place(dev):
    rng = np.random.default_rng(131)
    x, xf = upload(dev, rng.standard_normal((33, 127)))
    v = rng.standard_normal(127).astype(np.float32)
    ops.scale_columns(x, to_dev(dev, v), x)
    assert_close_elementwise(read(x), xf * v, rtol=OUT_RTOL["f32"])


@pytest.mark.parametrize("blocks", ["one", "per row"])
@pytest.mark.parametrize("view", [False, True], ids=["contiguous", "view"])
@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", COLUMN_SHAPES, ids=COLUMN_IDS)
def test_scale_columns_backward(dev, shape, dt, view, blocks):
    """dx = dy * v elementwise; dv's block sums within an f32 reduction's error of the float64 sums,
    judged against the sum of the terms' magnitudes (cancellation)."""
    rng = np.random.default_rng(132)
    N, M = shape
    S = 1 if blocks == "one" else N
    dy, dyf = column_operand(dev, rng, shape, dt, view)
    x, xf = column_operand(dev, rng, shape, dt, view)
    v = rng.standard_normal(M).astype(np.float32)
    dx = column_operand(dev, rng, shape, dt, view)[0] if view else empty_filled(dev, shape, dt)
    dv = empty_filled(dev, (S, M), "f32")
    ops.scale_columns_backward(dy, x, to_dev(dev, v), dx, dv)
    assert_close_elementwise(read(dx), dyf * v, rtol=OUT_RTOL[dt], atol=SUBNORMAL[dt], what="dx")
    prod = (dyf * xf).reshape(S, N // S, M)
    assert_close_elementwise(read(dv), prod.sum(1), rtol=0.0, atol=reduction_rtol(N // S) * np.abs(prod).sum(1),
                             what="dv")


def test_scale_columns_backward_per_sample(dev):
    """dv's rows are the samples' sums, each the same whatever the count of samples in the call (the
    sample order's requirement): a block alone gives the bits it gives among others."""
    rng = np.random.default_rng(133)
    T, S, M = 9, 4, 33
    dy, x = (to_dev(dev, rng.standard_normal((S * T, M))) for _ in range(2))
    v = to_dev(dev, rng.standard_normal(M))
    dv, dx = dev.empty((S, M)), dev.empty((S * T, M))
    ops.scale_columns_backward(dy, x, v, dx, dv)
    one, dx1 = dev.empty((1, M)), dev.empty((T, M))
    ops.scale_columns_backward(dy[2 * T:3 * T], x[2 * T:3 * T], v, dx1, one)
    np.testing.assert_array_equal(read(one)[0], read(dv)[2])


def test_scale_columns_backward_in_place_and_finite_differences(dev):
    """dv is the gradient of L = sum(scale_columns(x, v) * dy) in v (differences through the device's
    forward), and dx = dy * v written over dy."""
    rng = np.random.default_rng(134)
    shape = (31, 7)
    x0, ct = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape)
    v0 = rng.standard_normal(shape[1]).astype(np.float32)

    def loss(vv):
        out = dev.empty(shape)
        ops.scale_columns(to_dev(dev, x0), to_dev(dev, vv), out)
        return float(np.sum(read(out) * ct))

    dy, dv = to_dev(dev, ct), dev.empty((1, shape[1]))
    ops.scale_columns_backward(dy, to_dev(dev, x0), to_dev(dev, v0), dy, dv)
    assert_fd(read(dv)[0], fd_grad(loss, v0), "dv")
    assert_close_elementwise(read(dy), np.float32(ct) * v0, rtol=OUT_RTOL["f32"])


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("M", [1, 31, 33, 127])
@pytest.mark.parametrize("r", [1, 8])
def test_dora_norm(dev, M, r, dt):
    """From Q = A W^T + (s / 2) A A^T B^T and alpha = 2 s: the row norms of W + s B A (float64),
    scale = m / norm and inv_norm = 1 / norm."""
    rng = np.random.default_rng(135 + M + r)
    K, s = 45, 1.7
    W, A = rng.standard_normal((M, K)), rng.standard_normal((r, K)) / np.sqrt(K)
    B, Bf = upload(dev, 0.5 * rng.standard_normal((M, r)), dt)
    m, mf = upload(dev, 1 + rng.random(M), dt)
    Q = A @ W.T + s / 2 * (A @ A.T) @ Bf.T
    w2 = (W * W).sum(1)
    scale, inv = empty_filled(dev, (M,), "f32"), empty_filled(dev, (M,), "f32")
    ops.dora_norm(to_dev(dev, w2), B, to_dev(dev, Q), m, 2 * s, scale, inv)
    norm = np.linalg.norm(W + s * Bf @ A, axis=1)
    # Q and w2 enter rounded to f32, the dot of r terms in f32: a few ulp of the terms' sizes
    tol = 64 * U32 * (w2 + 2 * s * (np.abs(Bf) * np.abs(Q).T).sum(1)) / norm ** 2
    assert_close_elementwise(read(inv), 1 / norm, rtol=tol, what="inv_norm")
    assert_close_elementwise(read(scale), mf / norm, rtol=tol, what="scale")


def test_dora_and_column_ops_bad_calls(dev):
    """Bad shapes and dtypes raise one-line ValueErrors naming the op and the argument."""
    z = lambda shape, dt="f32": dev.zeros(shape, dt)  # noqa: E731
    cases = [
        ("scale_columns", lambda: ops.scale_columns(z((3, 4)), z((5,)), z((3, 4))), "v"),
        ("scale_columns", lambda: ops.scale_columns(z((3, 4)), z((4,), "f16"), z((3, 4))), "v"),
        ("scale_columns", lambda: ops.scale_columns(z((3, 4)), z((4,)), z((3, 4), "f16")), "out"),
        ("scale_columns", lambda: ops.scale_columns(z((12,)), z((12,)), z((12,))), "x"),
        ("scale_columns", lambda: ops.scale_columns(z((3, 4)), z((4,)), z((4, 3))), "out"),
        ("scale_columns_backward", lambda: ops.scale_columns_backward(z((6, 4)), z((6, 4)), z((4,)), z((6, 4)),
                                                                      z((4, 4))), "dv"),
        ("scale_columns_backward", lambda: ops.scale_columns_backward(z((6, 4)), z((6, 4)), z((4,)), z((6, 4)),
                                                                      z((2, 4), "f16")), "dv"),
        ("scale_columns_backward", lambda: ops.scale_columns_backward(z((6, 4), "f16"), z((6, 4)), z((4,)),
                                                                      z((6, 4)), z((1, 4))), "dy"),
        ("scale_columns_backward", lambda: ops.scale_columns_backward(z((6, 4)), z((6, 4)), z((4,)), z((6, 5)),
                                                                      z((1, 4))), "dx"),
        ("dora_norm", lambda: ops.dora_norm(z((5,)), z((5, 2)), z((5, 2)), z((5,)), 1.0, z((5,)), z((5,))), "Q"),
        ("dora_norm", lambda: ops.dora_norm(z((5,)), z((5, 2)), z((2, 5)), z((5,), "f16"), 1.0, z((5,)), z((5,))),
         "m"),
        ("dora_norm", lambda: ops.dora_norm(z((4,)), z((5, 2)), z((2, 5)), z((5,)), 1.0, z((5,)), z((5,))), "w2"),
        ("dora_norm", lambda: ops.dora_norm(z((5,)), z((5, 2)), z((2, 5)), z((5,)), 1.0, z((5,), "f16"), z((5,))),
         "scale"),
        ("dora_norm", lambda: ops.dora_norm(z((5,)), z((5, 2)), z((2, 5)), z((5,)), float("nan"), z((5,)), z((5,))),
         "alpha"),
    ]
    assert_bad_calls(cases)


# ------------------------------------------------------------------------------------- RoPE


def hf_inv_freq(rot_dim, theta=10000.0):
    """HF Llama: inv_freq = 1 / theta^(arange(0, dim, 2) / dim), as the f32 table krnl takes."""
    return (1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)).astype(np.float32)


def rope_ref(x, pos, inv_freq, sign=1.0):
    """HF's apply_rotary_pos_emb on the first 2R dims: x*cos + rotate_half(x)*sin with
    cos/sin = cat(freqs, freqs), rotate_half(x) = cat(-x2, x1); the tail passes through."""
    R = len(inv_freq)
    freqs = sign * pos[:, None].astype(np.float64) * inv_freq[None, :].astype(np.float64)  # (T, R)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    xr = x[..., :2 * R]
    x1, x2 = xr[..., :R], xr[..., R:]
    rotated = np.concatenate([-x2, x1], axis=-1)
    out = x.copy()
    out[..., :2 * R] = xr * cos + rotated * sin
    return out


def rope_bound(dt, x, ref, pos, inv_freq):
    """Output rounding plus f32 arithmetic on a*cos - b*sin, with the angle pos*inv_freq allowed
    f32 rounding (an implementation may form it in float): |theta| * 2^-24 of phase error."""
    max_theta = float(np.max(np.abs(pos))) * float(np.max(inv_freq))
    return UNIT_ROUNDOFF[dt] * float(np.max(np.abs(ref))) + (8 + 2 * max_theta) * U32 * 2 * float(np.max(np.abs(x)))


ROPE_CASES = [  # (heads, T, D, rotary dims, positions kind)
    (1, 1, 2, 2, "arange"),
    (3, 31, 64, 64, "offset"),
    (2, 33, 128, 128, "packed"),
    (4, 127, 32, 32, "arange"),
    (2, 33, 33, 16, "offset"),  # partial rotary, odd D
    (16, 256, 128, 128, "arange"),  # realistic: 16 heads of 128, T = 256
    ((2, 3), 31, 64, 48, "packed"),  # 4-D (B, H, T, D), partial rotary
]
ROPE_IDS = [f"H{h}T{t}D{d}r{r}-{k}".replace(" ", "") for h, t, d, r, k in ROPE_CASES]


def lead(h):
    return h if isinstance(h, tuple) else (h,)


def positions_of(kind, T):
    if kind == "arange":
        return np.arange(T, dtype=np.int32)
    if kind == "offset":  # decoding deep into a sequence
        return np.arange(T, dtype=np.int32) + 1000
    # packed samples: positions restart at each sample boundary
    cut = T // 3
    return np.concatenate([np.arange(cut), np.arange(T - cut)]).astype(np.int32)


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("H,T,D,rot,kind", ROPE_CASES, ids=ROPE_IDS)
def test_rope_forward(dev, H, T, D, rot, kind, dt):
    rng = np.random.default_rng(16)
    pos = positions_of(kind, T)
    inv_freq = hf_inv_freq(rot, theta=500000.0 if D == 128 else 10000.0)
    x, xf = upload(dev, rng.standard_normal(lead(H) + (T, D)), dt)
    ops.rope(x, to_dev(dev, pos, "i32"), to_dev(dev, inv_freq, "f32"))
    ref = rope_ref(xf, pos, inv_freq)
    assert_close(read(x), ref, rtol=0.0, atol=rope_bound(dt, xf, ref, pos, inv_freq), what="rope")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("H,T,D,rot,kind", ROPE_CASES, ids=ROPE_IDS)
def test_rope_backward_inverts_forward(dev, H, T, D, rot, kind, dt):
    """sign=-1 matches the oracle's inverse rotation and undoes the forward to tolerance (two
    roundings into the dtype)."""
    rng = np.random.default_rng(17)
    pos = positions_of(kind, T)
    inv_freq = hf_inv_freq(rot)
    pos_t, inv_t = to_dev(dev, pos, "i32"), to_dev(dev, inv_freq, "f32")
    x, xf = upload(dev, rng.standard_normal(lead(H) + (T, D)), dt)
    ops.rope(x, pos_t, inv_t, sign=-1.0)
    ref = rope_ref(xf, pos, inv_freq, sign=-1.0)
    assert_close(read(x), ref, rtol=0.0, atol=rope_bound(dt, xf, ref, pos, inv_freq), what="rope sign=-1")
    x, xf = upload(dev, rng.standard_normal(lead(H) + (T, D)), dt)
    ops.rope(x, pos_t, inv_t, sign=1.0)
    ops.rope(x, pos_t, inv_t, sign=-1.0)
    assert_close(read(x), xf, rtol=0.0, atol=2 * rope_bound(dt, xf, xf, pos, inv_freq), what="forward+backward")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_rope_partial_rotary_tail_untouched(dev, dt):
    """Dims from 2*len(inv_freq) on are left bit for bit as they were, whatever they hold
    (inf, NaN, -0.0, subnormals, extremes)."""
    rng = np.random.default_rng(18)
    H, T, D, R = 2, 31, 40, 12
    x0 = rng.standard_normal((H, T, D)).astype(np.float32)
    tiny = {"f32": 1e-42, "f16": 3e-7, "bf16": 1e-40}[dt]
    big = {"f32": 3e38, "f16": 65504.0, "bf16": 3e38}[dt]
    specials = np.array([np.inf, -np.inf, np.nan, -0.0, tiny, -tiny, big, -big], dtype=np.float32)
    x0[..., 2 * R:] = np.resize(specials, x0[..., 2 * R:].shape)
    x = to_dev(dev, x0, dt)
    before = np.array(x.numpy(), copy=True)
    ops.rope(x, to_dev(dev, np.arange(T, dtype=np.int32) + 7, "i32"), to_dev(dev, hf_inv_freq(2 * R), "f32"))
    after = np.array(x.numpy(), copy=True)
    bits = np.uint16 if dt == "f16" else np.uint32
    np.testing.assert_array_equal(after[..., 2 * R:].view(bits), before[..., 2 * R:].view(bits))
    assert np.any(after[..., 1:2 * R] != before[..., 1:2 * R]), "rotary part unchanged"


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_rope_head_view(dev, dt):
    """rope on one head of a head-major (H, T, D) tensor (a view by offset) rotates that head
    only."""
    rng = np.random.default_rng(118)
    H, T, D = 3, 33, 64
    pos = np.arange(T, dtype=np.int32) + 3
    inv_freq = hf_inv_freq(D)
    x, xf = upload(dev, rng.standard_normal((H, T, D)), dt)
    ops.rope(x[1], to_dev(dev, pos, "i32"), to_dev(dev, inv_freq, "f32"))
    got = read(x)
    ref = rope_ref(xf[1], pos, inv_freq)
    assert_close(got[1], ref, rtol=0.0, atol=rope_bound(dt, xf[1], ref, pos, inv_freq), what="head 1")
    np.testing.assert_array_equal(got[[0, 2]], xf[[0, 2]], err_msg="other heads changed")


def test_rope_backward_finite_differences(dev):
    """rope(cotangent, sign=-1) is the gradient of L = sum(rope(x) * cotangent), differences
    taken through the device's forward rope (partial rotary: the tail's gradient is identity)."""
    rng = np.random.default_rng(19)
    shape, R = (2, 5, 10), 3
    pos = np.array([0, 3, 17, 2, 400], dtype=np.int32)
    inv_freq = hf_inv_freq(2 * R, theta=100.0)
    pos_t, inv_t = to_dev(dev, pos, "i32"), to_dev(dev, inv_freq, "f32")
    x0 = rng.standard_normal(shape).astype(np.float32)
    ct = rng.standard_normal(shape).astype(np.float32)

    def loss(xv):
        x = to_dev(dev, xv)
        ops.rope(x, pos_t, inv_t)
        return float(np.sum(read(x) * ct))

    g = to_dev(dev, ct)
    ops.rope(g, pos_t, inv_t, sign=-1.0)
    assert_fd(read(g), fd_grad(loss, x0), "rope backward")


# ------------------------------------------------------------------------- causal softmax


def causal_softmax_ref(S, scale, segments=None, window=0, sinks=None):
    """P over the last dim: query row i sits at position i + Tk - Tq and sees key j iff j <= that
    position (and, with segments, seg[j] == seg[position]; with window > 0, position - j < window);
    sinks (one per (Tq, Tk) matrix) join each row as an unscaled column, dropped afterwards (as
    transformers' gpt-oss does); returns P and the visibility mask."""
    Tq, Tk = S.shape[-2:]
    qpos = np.arange(Tq) + (Tk - Tq)
    mask = np.arange(Tk)[None, :] <= qpos[:, None]
    if window:
        mask = mask & (qpos[:, None] - np.arange(Tk)[None, :] < window)
    if segments is not None:
        mask = mask & (segments[None, :] == segments[qpos][:, None])
    z = np.where(mask, scale * S, -np.inf)
    if sinks is not None:
        z = np.concatenate([z, np.broadcast_to(np.reshape(sinks, S.shape[:-2] + (1, 1)), S.shape[:-1] + (1,))], -1)
    z = z - np.max(z, axis=-1, keepdims=True)
    e = np.exp(z)
    return (e / np.sum(e, axis=-1, keepdims=True))[..., :Tk], np.broadcast_to(mask, S.shape)


def softmax_rtol(dt, S, scale, mask):
    """Per-element relative error of P: output rounding, the f32 error of exp's argument
    scale*(s - max) (relative to its size) and of the row sum."""
    z = np.where(mask, scale * S, np.nan)
    spread = float(np.nanmax(np.nanmax(z, axis=-1) - np.nanmin(z, axis=-1)))
    big = float(np.nanmax(np.abs(z)))
    return UNIT_ROUNDOFF[dt] + (16 + 2 * spread + 2 * big) * U32 + reduction_rtol(S.shape[-1])


def check_softmax(got, S, scale, dt, segments=None, what="", window=0, sinks=None):
    ref, mask = causal_softmax_ref(S, scale, segments, window, sinks)
    masked = got[~mask]
    assert np.all(masked == 0), f"{what}: {np.count_nonzero(masked)} masked entries are not exactly 0"
    # a sink shifts exp's argument by up to |sink| (its f32 error, relative to its size)
    rtol = softmax_rtol(dt, S, scale, mask) + (0 if sinks is None else 8 * float(np.max(np.abs(sinks))) * U32)
    assert_close_elementwise(got, ref, rtol=rtol, atol=SUBNORMAL[dt], what=what)


SOFTMAX_SHAPES = [(1, 1, 1), (2, 31, 31), (3, 33, 33), (1, 127, 127), (2, 256, 256), (4, 1, 33), (2, 5, 127),
                  (31, 64)]
SOFTMAX_IDS = ["-".join(map(str, s)) for s in SOFTMAX_SHAPES]


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=SOFTMAX_IDS)
def test_softmax_causal_forward(dev, shape, dt):
    """Square and Tq < Tk (decode-style rows: query i at position i + Tk - Tq)."""
    rng = np.random.default_rng(20)
    S, Sf = upload(dev, 3 * rng.standard_normal(shape), dt)
    for scale in (1.0 / math.sqrt(128), 1.0, 2.5):
        P = empty_filled(dev, shape, dt)
        ops.softmax_causal_forward(S, P, scale)
        check_softmax(read(P), Sf, np.float64(np.float32(scale)), dt, what=f"scale={scale}")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_softmax_causal_forward_stable(dev, dt):
    """Scores of large magnitude (a naive exp overflows to inf or underflows to 0/0) give the
    same probabilities; masked entries stay exact zeros."""
    rng = np.random.default_rng(21)
    shape = (3, 33, 33)
    offset = {"f32": 1e4, "f16": 1e4, "bf16": 1e4}[dt]
    base = 4 * rng.standard_normal(shape)
    base[0] += offset
    base[1] -= offset
    base[2] *= 50  # wide spread: most probabilities underflow, the row max dominates
    S, Sf = upload(dev, base, dt)
    P = empty_filled(dev, shape, dt)
    ops.softmax_causal_forward(S, P, 1.0)
    got = read(P)
    assert np.all(np.isfinite(got))
    ref, mask = causal_softmax_ref(Sf, 1.0)
    assert np.all(got[~mask] == 0)
    # argument s - max is exact for the offset rows (Sterbenz); rounding into the dtype and f32 exp
    assert_close(got, ref, rtol=2 * UNIT_ROUNDOFF[dt] + 1e-5, what="large scores")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_softmax_causal_forward_segments(dev, dt):
    """Packed samples: keys of another segment are masked (exact 0) like future keys."""
    rng = np.random.default_rng(22)
    for seg in (np.repeat([0, 1], [13, 20]), np.repeat([0, 1, 2], [10, 1, 22]), np.repeat([5, 9, 7, 0], [1, 40, 60, 27])):
        T = len(seg)
        S, Sf = upload(dev, 3 * rng.standard_normal((2, T, T)), dt)
        P = empty_filled(dev, (2, T, T), dt)
        ops.softmax_causal_forward(S, P, 0.7, to_dev(dev, seg.astype(np.int32), "i32"))
        check_softmax(read(P), Sf, np.float64(np.float32(0.7)), dt, seg, what=f"segments {np.unique(seg)}")


SOFTMAX_WINDOW_CASES = [((1, 1, 1), 1), ((2, 31, 31), 1), ((2, 31, 31), 5), ((3, 33, 33), 32), ((3, 33, 33), 33),
                        ((1, 33, 33), 1000), ((4, 1, 33), 7), ((2, 5, 127), 16), ((1, 127, 127), 31), ((31, 64), 3)]


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape,window", SOFTMAX_WINDOW_CASES,
                         ids=["-".join(map(str, s)) + f"-w{w}" for s, w in SOFTMAX_WINDOW_CASES])
def test_softmax_causal_forward_window(dev, shape, window, dt):
    """A sliding window: query at position q = i + Tk - Tq sees keys q - window < j <= q (the mask
    of attention_forward), so Tq < Tk rows (a query row block scored against keys :r1) measure
    the window from their true position. Masked entries are exact zeros; P may be S."""
    rng = np.random.default_rng(28)
    S, Sf = upload(dev, 3 * rng.standard_normal(shape), dt)
    for scale in (1.0 / math.sqrt(128), 2.5):
        P = empty_filled(dev, shape, dt)
        ops.softmax_causal_forward(S, P, scale, window=window)
        check_softmax(read(P), Sf, np.float64(np.float32(scale)), dt, what=f"scale={scale}", window=window)
    S2, _ = upload(dev, Sf, dt)
    ops.softmax_causal_forward(S2, S2, 0.5, None, window)
    check_softmax(read(S2), Sf, 0.5, dt, what="in place", window=window)


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_softmax_causal_forward_window_and_segments(dev, dt):
    """Both masks at once: a key must be in the window and in the query's sample."""
    rng = np.random.default_rng(29)
    seg = np.repeat([0, 1, 2], [10, 1, 22])
    T = len(seg)
    S, Sf = upload(dev, 3 * rng.standard_normal((2, T, T)), dt)
    for window in (1, 4, 12):
        P = empty_filled(dev, (2, T, T), dt)
        ops.softmax_causal_forward(S, P, 0.7, to_dev(dev, seg.astype(np.int32), "i32"), window)
        check_softmax(read(P), Sf, np.float64(np.float32(0.7)), dt, seg, what=f"window={window}", window=window)


@pytest.mark.torch
def test_softmax_causal_forward_window_matches_transformers(dev):
    """The window is transformers' sliding window (Gemma 2/3, Mistral): its causal mask with
    sliding_window_overlay, key kv visible to query q iff kv <= q and kv > q - sliding_window;
    the op's nonzero pattern is that mask, rows of a later query block (Tq < Tk) included."""
    pytest.importorskip("torch")
    overlay = pytest.importorskip("transformers.masking_utils").sliding_window_overlay
    rng = np.random.default_rng(32)
    T, window = 33, 6
    sees = overlay(window)
    want = np.array([[kv <= q and bool(sees(0, 0, q, kv)) for kv in range(T)] for q in range(T)])
    for r0 in (0, 20):  # the whole matrix, and the query block 20:33 against keys :33
        S = to_dev(dev, rng.standard_normal((2, T - r0, T)).astype(np.float32))
        P = dev.empty((2, T - r0, T))
        ops.softmax_causal_forward(S, P, 0.5, window=window)
        np.testing.assert_array_equal(read(P) != 0, np.broadcast_to(want[r0:], (2, T - r0, T)))


def test_softmax_backward_finite_differences_window(dev):
    """Through a windowed forward (rows with Tq < Tk): keys outside the window get exactly zero
    gradient, from P's zeros alone (softmax_backward knows no mask)."""
    rng = np.random.default_rng(30)
    shape, scale, window = (2, 5, 9), 0.7, 3
    s0 = rng.standard_normal(shape).astype(np.float32)
    ct = rng.standard_normal(shape).astype(np.float32)

    def loss(sv):
        P = dev.empty(shape)
        ops.softmax_causal_forward(to_dev(dev, sv), P, scale, window=window)
        return float(np.sum(read(P) * ct))

    P = dev.empty(shape)
    ops.softmax_causal_forward(to_dev(dev, s0), P, scale, window=window)
    dS = dev.empty(shape)
    ops.softmax_backward(P, to_dev(dev, ct), dS, scale)
    numeric = fd_grad(loss, s0)
    _, mask = causal_softmax_ref(s0.astype(np.float64), scale, window=window)
    assert np.all(numeric[~mask] == 0) and np.all(read(dS)[~mask] == 0)
    assert_fd(read(dS), numeric, "dS")


def sink_values(rng, n):
    """n f32 attention sinks (gpt-oss): a large positive one that takes nearly all of its rows, a
    large negative one that takes nothing, and moderate ones, each moved a little."""
    return (np.resize([30.0, -40.0, 0.7, 3.0, -1.5], n) + 0.1 * rng.standard_normal(n)).astype(np.float32)


# (shape, packed, window): leading dims of 0, 1 and 2 axes, one key, Tq < Tk (decode rows), masks
SINK_SOFTMAX_CASES = [((1, 1, 1), False, 0), ((2, 31, 31), True, 0), ((5, 33, 33), False, 8), ((2, 5, 127), False, 0),
                      ((2, 3, 1, 33), False, 0), ((31, 64), False, 0), ((1, 127, 127), True, 40)]
SINK_SOFTMAX_IDS = ["1", "packed-31", "window8-33", "5x127", "2x3-decode", "2d-31x64", "packed-window40-127"]


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape,packed,window", SINK_SOFTMAX_CASES, ids=SINK_SOFTMAX_IDS)
def test_softmax_causal_forward_sinks(dev, shape, packed, window, dt):
    """Each score matrix's sink joins its rows' softmax as an unscaled column without output: P
    against the float64 reference (the column concatenated, then dropped), masks kept exact zeros;
    in place (P = S) too."""
    rng = np.random.default_rng(33)
    S, Sf = upload(dev, 3 * rng.standard_normal(shape), dt)
    sinks = sink_values(rng, int(np.prod(shape[:-2])))
    seg = packed_segments(shape[-1], 34) if packed else None
    sd = None if seg is None else to_dev(dev, seg, "i32")
    for scale in (1.0 / math.sqrt(128), 2.5):
        P = empty_filled(dev, shape, dt)
        ops.softmax_causal_forward(S, P, scale, sd, window, to_dev(dev, sinks))
        check_softmax(read(P), Sf, np.float64(np.float32(scale)), dt, seg, f"scale={scale}", window, sinks)
    ops.softmax_causal_forward(S, S, 0.5, sd, window, to_dev(dev, sinks))
    check_softmax(read(S), Sf, 0.5, dt, seg, "in place", window, sinks)


def test_softmax_backward_finite_differences_sinks(dev):
    """softmax_backward takes no sinks: from the P of a forward with sinks (rows summing to < 1) it
    is still the gradient of sum(P * ct), the sink's column having no output (f32, window, Tq < Tk)."""
    rng = np.random.default_rng(35)
    shape, scale, window = (3, 5, 9), 0.7, 4
    s0 = rng.standard_normal(shape).astype(np.float32)
    ct = rng.standard_normal(shape).astype(np.float32)
    sinks = to_dev(dev, np.array([1.5, -0.5, 0.2], np.float32))

    def forward(sv):
        P = dev.empty(shape)
        ops.softmax_causal_forward(to_dev(dev, sv), P, scale, window=window, sinks=sinks)
        return P

    P = forward(s0)
    assert np.all(read(P).sum(-1) < 1)
    dS = dev.empty(shape)
    ops.softmax_backward(P, to_dev(dev, ct), dS, scale)
    assert_fd(read(dS), fd_grad(lambda sv: float(np.sum(read(forward(sv)) * ct)), s0), "dS")


@pytest.mark.parametrize("block", [0, 8, 13])
def test_materialised_attention_window(dev, block):
    """krnl.models.attention's materialised path with a sliding window, in query row blocks (each scored
    against keys :r1, so the op must place row i of a block at query r0 + i), GQA (4 query heads
    on 2 KV heads): output and dq, dk, dv against float64 attention under the window's mask."""
    from krnl.models import attention as attn

    rng = np.random.default_rng(31)
    H, Hk, T, D, window = 4, 2, 33, 8, 5
    g = H // Hk
    scale = 1.0 / math.sqrt(D)
    shapes = ((H, T, D), (Hk, T, D), (Hk, T, D), (H, T, D))
    q0, k0, v0, do0 = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    q, k, v, dout = (to_dev(dev, a) for a in (q0, k0, v0, do0))
    out = empty_filled(dev, (H, T, D), "f32")
    saved = attn.materialised_forward(q, k, v, out, scale, block=block, window=window)
    dq, dk, dv = (empty_filled(dev, s, "f32") for s in ((H, T, D), (Hk, T, D), (Hk, T, D)))
    saved.backward(dout, dq, dk, dv)

    mask = attention_mask(T, window=window)
    Q, K, V, dO = (a.astype(np.float64) for a in (q0, k0, v0, do0))
    Kh, Vh = np.repeat(K, g, axis=0), np.repeat(V, g, axis=0)  # query head h reads KV head h // g
    P, _ = causal_softmax_ref(Q @ np.swapaxes(Kh, 1, 2), scale, window=window)
    O = P @ Vh
    dP = dO @ np.swapaxes(Vh, 1, 2)
    dS = P * (dP - np.sum(dP * P, -1, keepdims=True)) * scale
    dQ = dS @ Kh
    dK = (np.swapaxes(dS, 1, 2) @ Q).reshape(Hk, g, T, D).sum(1)
    dV = (np.swapaxes(P, 1, 2) @ dO).reshape(Hk, g, T, D).sum(1)
    assert np.all(P[:, ~mask] == 0) and np.any(~mask & (np.arange(T)[None, :] <= np.arange(T)[:, None]))
    for got, ref, what in ((out, O, "out"), (dq, dQ, "dq"), (dk, dK, "dk"), (dv, dV, "dv")):
        assert_close(read(got), ref, rtol=1e-5, what=what)
    # the window mattered: without it the output differs
    full = empty_filled(dev, (H, T, D), "f32")
    attn.materialised_forward(q, k, v, full, scale, block=block)
    assert np.max(np.abs(read(full) - O)) > 1e-2


def attention(dev, Q, K, V, dt, scale, segments=None):
    """Materialised causal attention from the ops (docs/architecture.md, 'Attention'), head-major (H, T, D)."""
    H, T, D = Q.shape
    S = empty_filled(dev, (H, T, T), dt)
    P = empty_filled(dev, (H, T, T), dt)
    O = empty_filled(dev, (H, T, D), dt)
    ops.gemm(Q, K, S, trans_b=True, batch=H)
    ops.softmax_causal_forward(S, P, scale, segments)
    ops.gemm(P, V, O, batch=H)
    return read(P), read(O)


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_softmax_causal_forward_attention_causality(dev, dt):
    """Changing K and V at the last position leaves every earlier output row bit for bit the same
    (masked scores do not even perturb the rounding) and changes the last row."""
    rng = np.random.default_rng(23)
    H, T, D = 2, 33, 16
    q, k, v = (rng.standard_normal((H, T, D)).astype(np.float32) for _ in range(3))
    scale = 1.0 / math.sqrt(D)
    P0, O0 = attention(dev, to_dev(dev, q, dt), to_dev(dev, k, dt), to_dev(dev, v, dt), dt, scale)
    k2, v2 = k.copy(), v.copy()
    k2[:, -1] += 3.0
    v2[:, -1] -= 2.0
    for kk, vv, what in ((k2, v, "K"), (k, v2, "V"), (k2, v2, "K and V")):
        P1, O1 = attention(dev, to_dev(dev, q, dt), to_dev(dev, kk, dt), to_dev(dev, vv, dt), dt, scale)
        np.testing.assert_array_equal(P1[:, :-1], P0[:, :-1], err_msg=f"{what}: earlier P rows moved")
        np.testing.assert_array_equal(O1[:, :-1], O0[:, :-1], err_msg=f"{what}: earlier output rows moved")
        for h in range(H):
            assert np.any(O1[h, -1] != O0[h, -1]), f"{what}: last row of head {h} did not change"


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_softmax_causal_forward_gqa_folding(dev, dt):
    """GQA without copies: H = 4 query heads, Hk = 2 KV heads, Q stored (Hk, g*T, D) with a
    group's heads contiguous, so S = Q K^T and O = P V are one batched GEMM each with batch = Hk.
    Each stage is checked against a per-head float64 oracle fed the stage's exact inputs."""
    from test_gemm import gemm_bound

    rng = np.random.default_rng(24)
    H, Hk, T, D = 4, 2, 31, 16
    g = H // Hk
    scale = 1.0 / math.sqrt(D)
    Q, qf = upload(dev, rng.standard_normal((Hk, g * T, D)), dt)
    K, kf = upload(dev, rng.standard_normal((Hk, T, D)), dt)
    V, vf = upload(dev, rng.standard_normal((Hk, T, D)), dt)
    S = empty_filled(dev, (Hk, g * T, T), dt)
    ops.gemm(Q, K, S, trans_b=True, batch=Hk)
    P = empty_filled(dev, (H, T, T), dt)
    ops.softmax_causal_forward(S.reshape(H, T, T), P, scale)
    O = empty_filled(dev, (Hk, g * T, D), dt)
    ops.gemm(P.reshape(Hk, g * T, T), V, O, batch=Hk)
    s_got, p_got, o_got = read(S).reshape(H, T, T), read(P), read(O).reshape(H, T, D)
    q_heads = qf.reshape(H, T, D)
    for h in range(H):
        kv = h // g  # query head h reads KV head h / (H / Hk)
        s_ref = q_heads[h] @ kf[kv].T
        assert np.max(np.abs(s_got[h] - s_ref)) <= gemm_bound(D, dt, s_ref, 1.0, q_heads[h], kf[kv].T), f"S head {h}"
        check_softmax(p_got[h], s_got[h], np.float64(np.float32(scale)), dt, what=f"P head {h}")
        o_ref = p_got[h] @ vf[kv]
        assert np.max(np.abs(o_got[h] - o_ref)) <= gemm_bound(T, dt, o_ref, 1.0, p_got[h], vf[kv]), f"O head {h}"


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_softmax_causal_forward_segments_isolate_samples(dev, dt):
    """Packed samples [0, 13) and [13, 33): perturbing a token of one sample moves no output row
    of the other (bit for bit), but does move later rows of its own sample."""
    rng = np.random.default_rng(25)
    H, T, D, cut = 2, 33, 16, 13
    seg = to_dev(dev, np.repeat([0, 1], [cut, T - cut]).astype(np.int32), "i32")
    q, k, v = (rng.standard_normal((H, T, D)).astype(np.float32) for _ in range(3))
    scale = 1.0 / math.sqrt(D)
    run = lambda kk, vv: attention(dev, to_dev(dev, q, dt), to_dev(dev, kk, dt), to_dev(dev, vv, dt), dt, scale, seg)
    P0, O0 = run(k, v)
    ref, mask = causal_softmax_ref(read(to_dev(dev, q, dt)) @ np.swapaxes(read(to_dev(dev, k, dt)), -1, -2),
                                   scale, np.repeat([0, 1], [cut, T - cut]))
    assert np.all(P0[~mask] == 0), "masked entries (future or other sample) not exactly 0"
    assert np.all(P0[mask] > 0)
    for tok, same, other in ((5, slice(5, cut), slice(cut, T)), (20, slice(20, T), slice(0, 20))):
        k2, v2 = k.copy(), v.copy()
        k2[:, tok] += 3.0
        v2[:, tok] -= 2.0
        P1, O1 = run(k2, v2)
        np.testing.assert_array_equal(O1[:, other], O0[:, other], err_msg=f"token {tok} leaked across samples")
        np.testing.assert_array_equal(P1[:, other], P0[:, other])
        assert np.all(np.any(O1[:, same] != O0[:, same], axis=-1)), f"token {tok}: own sample's rows unchanged"


# ------------------------------------------------------------------------ softmax backward


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (31,), (2, 33, 33), (127, 31), (4, 256, 256)], ids=str)
def test_softmax_backward(dev, shape, dt):
    """dS = P * (dP - rowsum(dP * P)) * scale, P a real softmax (rows sum to 1)."""
    rng = np.random.default_rng(26)
    z = 2 * rng.standard_normal(shape)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    P, pf = upload(dev, p, dt)
    dP, dpf = upload(dev, rng.standard_normal(shape), dt)
    for scale in (0.125, 1.0):
        dS = empty_filled(dev, shape, dt)
        ops.softmax_backward(P, dP, dS, scale)
        pd = np.sum(dpf * pf, axis=-1, keepdims=True)
        ref = pf * (dpf - pd) * scale
        L = shape[-1]
        mag = scale * np.abs(pf) * ((reduction_rtol(L) + 4 * U32) * np.sum(np.abs(dpf * pf), -1, keepdims=True)
                                    + 4 * U32 * (np.abs(dpf) + np.abs(pd)))
        assert_close_elementwise(read(dS), ref, rtol=UNIT_ROUNDOFF[dt], atol=mag + SUBNORMAL[dt], what=f"scale={scale}")


def test_softmax_backward_finite_differences(dev):
    """softmax_backward(P, dP, scale) is the gradient of L = sum(P(S) * dP) with P from the
    device's softmax_causal_forward (rows with Tq < Tk; masked entries have zero gradient)."""
    rng = np.random.default_rng(27)
    shape, scale = (2, 5, 9), 0.7
    s0 = rng.standard_normal(shape).astype(np.float32)
    ct = rng.standard_normal(shape).astype(np.float32)

    def loss(sv):
        P = dev.empty(shape)
        ops.softmax_causal_forward(to_dev(dev, sv), P, scale)
        return float(np.sum(read(P) * ct))

    P = dev.empty(shape)
    ops.softmax_causal_forward(to_dev(dev, s0), P, scale)
    dS = dev.empty(shape)
    ops.softmax_backward(P, to_dev(dev, ct), dS, scale)
    numeric = fd_grad(loss, s0)
    _, mask = causal_softmax_ref(s0.astype(np.float64), scale)
    assert np.all(numeric[~mask] == 0) and np.all(read(dS)[~mask] == 0)
    assert_fd(read(dS), numeric, "dS")


# ------------------------------------------------------------------------- fused attention


def attention_mask(T, segments=None, window=0):
    """(T, T) bool: query i sees key j (the op contract, written independently of the kernels)."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    m = j <= i
    if window:
        m &= i - j < window
    if segments is not None:
        m &= segments[:, None] == segments[None, :]
    return m


def attention_ref(q, k, v, scale, segments=None, window=0, sinks=None):
    """float64 causal attention with GQA (query head h reads KV head h // g): o, lse, P. sinks
    (Hq,): an unscaled column of each head's scores without a value (transformers' gpt-oss)."""
    Hq, T, _ = q.shape
    kk, vv = (np.repeat(x, Hq // k.shape[0], axis=0) for x in (k, v))
    S = scale * np.einsum("htd,hsd->hts", q, kk)
    S = np.where(attention_mask(T, segments, window), S, -np.inf)
    Sx = S if sinks is None else np.concatenate([S, np.broadcast_to(np.reshape(sinks, (Hq, 1, 1)), (Hq, T, 1))], -1)
    m = Sx.max(-1, keepdims=True)
    e = np.exp(Sx - m)
    lse = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
    P = np.exp(S - lse[..., None])
    return P @ vv, lse, P


def attention_backward_ref(q, k, v, do, scale, segments=None, window=0, sinks=None):
    """float64 dq, dk, dv of attention_ref (dk, dv summed over each KV head's query heads). The
    sink's column has no value, so its dP is 0 and it adds nothing to the row's sum of P dP."""
    Hq, Hk = q.shape[0], k.shape[0]
    g = Hq // Hk
    kk, vv = (np.repeat(x, g, axis=0) for x in (k, v))
    _, _, P = attention_ref(q, k, v, scale, segments, window, sinks)
    dP = do @ vv.transpose(0, 2, 1)
    dS = P * (dP - np.sum(dP * P, -1, keepdims=True)) * scale
    dq = dS @ kk
    dk = (dS.transpose(0, 2, 1) @ q).reshape(Hk, g, *k.shape[1:]).sum(1)
    dv = (P.transpose(0, 2, 1) @ do).reshape(Hk, g, *v.shape[1:]).sum(1)
    return dq, dk, dv


def require_attention(dev, dt, head_dim=None):
    """The fused attention ops exist on the CPU (the reference loops, every dtype), on CUDA
    with cuDNN (bf16/f16) and on Metal (f32/f16, the head sizes its capabilities list); elsewhere
    the model takes the materialised path."""
    why = attention_ops_missing(dev, dt, head_dim)
    if why:
        pytest.skip(f"attention_forward does not run on {dev.name} in {dt}: {why}")


# Output error of the fused kernels: 16-bit P and dS in their products, fp32 accumulation.
ATTN_TOL = {"f32": 1e-5, "f16": 4 * UNIT_ROUNDOFF["f16"], "bf16": 4 * UNIT_ROUNDOFF["bf16"]}
# (Hq, Hk, T, D): one token, awkward lengths, GQA with 2 and 4 query heads per KV head, MQA with 3,
# MHA, the head sizes 80, 96, 128 and 256 (short rows: 256 is the slowest on a simulator).
ATTN_CASES = [(1, 1, 1, 8), (2, 1, 31, 16), (4, 2, 33, 64), (8, 2, 65, 64), (4, 4, 127, 128), (3, 1, 33, 80),
              (2, 2, 31, 96), (2, 1, 33, 256)]
ATTN_IDS = ["1x1x1x8", "2x1x31x16", "4x2x33x64", "8x2x65x64", "4x4x127x128", "3x1x33x80", "2x2x31x96", "2x1x33x256"]


def attention_inputs(dev, Hq, Hk, T, D, dt, seed):
    rng = np.random.default_rng(seed)
    return [upload(dev, rng.standard_normal(s), dt) for s in ((Hq, T, D), (Hk, T, D), (Hk, T, D))]


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("Hq,Hk,T,D", ATTN_CASES, ids=ATTN_IDS)
def test_attention_forward(dev, Hq, Hk, T, D, dt):
    """o and lse of the fused op against float64 attention on the same (rounded) inputs."""
    require_attention(dev, dt, D)
    (q, qf), (k, kf), (v, vf) = attention_inputs(dev, Hq, Hk, T, D, dt, 40)
    scale = 1.0 / math.sqrt(D)
    o, lse = empty_filled(dev, (Hq, T, D), dt), empty_filled(dev, (Hq, T), "f32")
    ops.attention_forward(q, k, v, o, lse, scale)
    o_ref, lse_ref, _ = attention_ref(qf, kf, vf, scale)
    tol = ATTN_TOL[dt]
    assert_close(read(o), o_ref, rtol=tol, atol=tol * np.max(np.abs(vf)), what="o")
    assert_close(read(lse), lse_ref, rtol=0, atol=1e-5 if dt == "f32" else 2e-3, what="lse")
    if T > 1:  # causal: query 0 sees key 0 only, so o[:, 0] is v[kv(h), 0] up to rounding
        assert_close(read(o)[:, 0], np.repeat(vf, Hq // Hk, axis=0)[:, 0], rtol=tol, atol=tol, what="o row 0")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("Hq,Hk,T,D", ATTN_CASES, ids=ATTN_IDS)
def test_attention_backward(dev, Hq, Hk, T, D, dt):
    """dq, dk, dv from the device's own o and lse against float64 gradients."""
    require_attention(dev, dt, D)
    check_attention_backward(dev, Hq, Hk, T, D, dt, 41)


# (B, Hq, Hk, T, D): token-major views of B sequences; one token (the backward's special case).
TM_CASES = [(2, 4, 2, 33, 64), (3, 2, 1, 31, 16), (2, 1, 1, 1, 8), (1, 8, 2, 65, 128)]


def token_major_views(dev, B, T, heads, D, dt, extra=0, fill=None, seed=0):
    """(views, the whole buffer, its float64 copy): columns of one (B T, (sum(heads) + extra) D)
    projection as token-major (B, T, h, D) views, as the layer cuts q, k and v from qkv."""
    width = sum(heads) + extra
    if fill is None:
        buf, bf = upload(dev, np.random.default_rng(seed).standard_normal((B * T, width * D)), dt)
    else:
        buf, bf = empty_filled(dev, (B * T, width * D), dt, fill), None
    four, views, h0 = buf.reshape(B, T, width, D), [], 0
    for h in heads:
        views.append(four[:, :, h0:h0 + h])
        h0 += h
    return views, buf, bf


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("B,Hq,Hk,T,D", TM_CASES)
def test_attention_token_major(dev, B, Hq, Hk, T, D, dt):
    """q, k, v as columns of one projection and o as columns of a wider one, B sequences in one
    call: o, lse, dq, dk, dv against float64 attention of each sequence, and every column outside
    the views untouched. A device that lists no token-major operands refuses them by name."""
    (q, k, v), _, xf = token_major_views(dev, B, T, (Hq, Hk, Hk), D, dt, seed=B + T)
    (o,), obuf, _ = token_major_views(dev, B, T, (Hq,), D, dt, extra=1, fill=7.0)
    lse = dev.empty((B, Hq, T), "f32")
    scale = 1.0 / math.sqrt(D)
    if not dev.capabilities()["fused_attention"]["token_major"]:
        with pytest.raises(NotImplementedError, match=r"^\[attention_forward\] .* takes no token-major"):
            ops.attention_forward(q, k, v, o, lse, scale)
        return
    require_attention(dev, dt, D)
    ops.attention_forward(q, k, v, o, lse, scale)
    (dq, dk, dv), dbuf, _ = token_major_views(dev, B, T, (Hq, Hk, Hk), D, dt, extra=1, fill=7.0)
    do, dof = upload(dev, np.random.default_rng(T).standard_normal((B, T, Hq, D)), dt)
    ops.attention_backward(q, k, v, o, do, lse, dq, dk, dv, scale)
    x4 = xf.reshape(B, T, Hq + 2 * Hk, D).transpose(0, 2, 1, 3)              # (B, heads, T, D)
    o4 = read(obuf).reshape(B, T, Hq + 1, D).transpose(0, 2, 1, 3)
    d4 = read(dbuf).reshape(B, T, Hq + 2 * Hk + 1, D).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(o4[:, Hq], 7.0)                            # outside the views
    np.testing.assert_array_equal(d4[:, -1], 7.0)
    tol = ATTN_TOL[dt]
    for b in range(B):
        qf, kf, vf = x4[b, :Hq], x4[b, Hq:Hq + Hk], x4[b, Hq + Hk:]
        o_ref, lse_ref, _ = attention_ref(qf, kf, vf, scale)
        assert_close(o4[b, :Hq], o_ref, rtol=tol, atol=tol * np.max(np.abs(vf)), what=f"o of row {b}")
        assert_close(read(lse)[b], lse_ref, rtol=0, atol=1e-5 if dt == "f32" else 2e-3, what=f"lse of row {b}")
        refs = attention_backward_ref(qf, kf, vf, dof[b].transpose(1, 0, 2), scale)
        got = (d4[b, :Hq], d4[b, Hq:Hq + Hk], d4[b, Hq + Hk:Hq + 2 * Hk])
        for name, g, ref in zip(("dq", "dk", "dv"), got, refs):
            assert_close(g, ref, rtol=2 * tol, atol=2 * tol * 1e-2, what=f"{name} of row {b}")


def check_attention_backward(dev, Hq, Hk, T, D, dt, seed, seg=None, window=0, sinks=None):
    """dq, dk, dv of the fused op (from its own o and lse; seg a (T,) numpy array or None; sinks
    (Hq,) or None, the forward's only) against float64 gradients under the same mask."""
    (q, qf), (k, kf), (v, vf) = attention_inputs(dev, Hq, Hk, T, D, dt, seed)
    do, dof = upload(dev, np.random.default_rng(seed + 1).standard_normal((Hq, T, D)), dt)
    sd = None if seg is None else to_dev(dev, seg, "i32")
    scale = 1.0 / math.sqrt(D)
    o, lse = dev.empty((Hq, T, D), dt), dev.empty((Hq, T), "f32")
    ops.attention_forward(q, k, v, o, lse, scale, sd, window, None if sinks is None else to_dev(dev, sinks))
    dq, dk, dv = (empty_filled(dev, s, dt) for s in ((Hq, T, D), (Hk, T, D), (Hk, T, D)))
    ops.attention_backward(q, k, v, o, do, lse, dq, dk, dv, scale, sd, window)
    tol = 2 * ATTN_TOL[dt]
    refs = attention_backward_ref(qf, kf, vf, dof, scale, seg, window, sinks)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
        assert_close(read(got), ref, rtol=tol, atol=tol * 1e-2, what=name)


def check_attention_finite_differences(dev, Hq, Hk, T, D, scale, seed, seg=None, window=0, sinks=None):
    """attention_backward is the gradient of L = sum(o * ct) through the device's own forward (f32)."""
    rng = np.random.default_rng(seed)
    x0 = [rng.standard_normal(s).astype(np.float32) for s in ((Hq, T, D), (Hk, T, D), (Hk, T, D))]
    ct = rng.standard_normal((Hq, T, D)).astype(np.float32)
    sd = None if seg is None else to_dev(dev, seg, "i32")
    sk = None if sinks is None else to_dev(dev, sinks)

    def forward(q, k, v):
        o, lse = dev.empty((Hq, T, D)), dev.empty((Hq, T))
        ops.attention_forward(to_dev(dev, q), to_dev(dev, k), to_dev(dev, v), o, lse, scale, sd, window, sk)
        return o, lse

    o, lse = forward(*x0)
    grads = [dev.empty(x.shape) for x in x0]
    ops.attention_backward(*(to_dev(dev, x) for x in x0), o, to_dev(dev, ct), lse, *grads, scale, sd, window)
    for i, name in enumerate(("dq", "dk", "dv")):
        def loss(xi):
            args = list(x0)
            args[i] = xi
            return float(np.sum(read(forward(*args)[0]) * ct))
        assert_fd(read(grads[i]), fd_grad(loss, x0[i]), name)


def test_attention_backward_finite_differences(dev):
    """The gradient check of the fused op: GQA with two query heads per KV head, f32."""
    require_attention(dev, "f32", 4)
    check_attention_finite_differences(dev, 2, 1, 5, 4, 0.6, 43)


def require_attention_masks(dev, dt, segments, window, head_dim=None):
    """The fused op takes packed segments / a window where the capabilities say so (the CPU's
    reference loops always)."""
    require_attention(dev, dt, head_dim)
    fa = dev.capabilities()["fused_attention"]
    if segments and not fa["segments"]:
        pytest.skip(f"{dev.name}'s fused attention lists no packed segments")
    if window and not fa["window"]:
        pytest.skip(f"{dev.name}'s fused attention lists no sliding window")


def packed_segments(T, seed):
    """(T,) i32 ids of packed samples of random lengths (1 included), ids increasing."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < T:
        lengths.append(int(rng.integers(1, max(2, T // 3) + 1)))
    seg = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[:T]
    return seg


# (Hq, Hk, T, D, packed, window): windows shorter than, equal to and longer than the row
ATTN_MASK_CASES = [(2, 1, 31, 16, True, 0), (4, 2, 33, 64, False, 8), (4, 1, 65, 64, True, 16),
                   (2, 2, 33, 16, False, 33), (2, 1, 1, 8, True, 1), (4, 2, 127, 128, True, 40),
                   (3, 1, 31, 96, False, 5), (2, 1, 33, 256, True, 9)]
ATTN_MASK_IDS = ["packed-31", "window8-33", "packed-window16-65", "window33-33", "packed-window1-1",
                 "packed-window40-127", "window5-31-d96", "packed-window9-33-d256"]


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("Hq,Hk,T,D,packed,window", ATTN_MASK_CASES, ids=ATTN_MASK_IDS)
def test_attention_forward_masks(dev, Hq, Hk, T, D, packed, window, dt):
    """Packed segments and a sliding window: o and lse against float64 attention under the same mask."""
    require_attention_masks(dev, dt, packed, window, D)
    (q, qf), (k, kf), (v, vf) = attention_inputs(dev, Hq, Hk, T, D, dt, 44)
    seg = packed_segments(T, 45) if packed else None
    scale = 1.0 / math.sqrt(D)
    o, lse = empty_filled(dev, (Hq, T, D), dt), empty_filled(dev, (Hq, T), "f32")
    ops.attention_forward(q, k, v, o, lse, scale, None if seg is None else to_dev(dev, seg, "i32"), window)
    o_ref, lse_ref, _ = attention_ref(qf, kf, vf, scale, seg, window)
    tol = ATTN_TOL[dt]
    assert_close(read(o), o_ref, rtol=tol, atol=tol * np.max(np.abs(vf)), what="o")
    assert_close(read(lse), lse_ref, rtol=0, atol=1e-5 if dt == "f32" else 2e-3, what="lse")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("Hq,Hk,T,D,packed,window", ATTN_MASK_CASES, ids=ATTN_MASK_IDS)
def test_attention_backward_masks(dev, Hq, Hk, T, D, packed, window, dt):
    """dq, dk, dv under packed segments and a sliding window against float64 gradients."""
    require_attention_masks(dev, dt, packed, window, D)
    check_attention_backward(dev, Hq, Hk, T, D, dt, 46, packed_segments(T, 48) if packed else None, window)


def test_attention_masks_finite_differences(dev):
    """With segments and a window, attention_backward is the gradient of sum(o * ct) through the
    device's own forward (f32, GQA)."""
    Hq, Hk, T, D, scale, window = 2, 1, 7, 4, 0.6, 3
    require_attention_masks(dev, "f32", True, True, D)
    check_attention_finite_differences(dev, Hq, Hk, T, D, scale, 49, np.array([0, 0, 0, 0, 1, 1, 2], np.int32), window)


def require_attention_sinks(dev, dt, segments, window, head_dim=None):
    """The fused op takes sinks where the capabilities say so; where they do not, it refuses them
    by name instead of computing something else."""
    require_attention_masks(dev, dt, segments, window, head_dim)
    if not dev.capabilities()["fused_attention"]["sinks"]:
        q, lse = dev.empty((1, 1, head_dim or 8), dt), dev.empty((1, 1))
        with pytest.raises(NotImplementedError, match=r"^\[attention_forward\] attention sinks"):
            ops.attention_forward(q, q, q, q, lse, 1.0, sinks=dev.zeros((1,)))
        pytest.skip(f"{dev.name}'s fused attention lists no sinks")


# (Hq, Hk, T, D, packed, window): one token, GQA and MQA at awkward lengths, masks, D 128
ATTN_SINK_CASES = [(1, 1, 1, 8, False, 0), (4, 2, 31, 16, False, 0), (5, 1, 33, 64, True, 0),
                   (4, 2, 33, 16, False, 8), (2, 2, 127, 128, True, 40)]
ATTN_SINK_IDS = ["1x1x1x8", "4x2x31x16", "mqa5-packed-33x64", "window8-4x2x33", "packed-window40-127x128"]


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("Hq,Hk,T,D,packed,window", ATTN_SINK_CASES, ids=ATTN_SINK_IDS)
def test_attention_forward_sinks(dev, Hq, Hk, T, D, packed, window, dt):
    """o and lse (which then includes the sink) against float64 attention with each head's sink
    as an extra unscaled column without a value; then dq, dk, dv from that lse."""
    require_attention_sinks(dev, dt, packed, window, D)
    (q, qf), (k, kf), (v, vf) = attention_inputs(dev, Hq, Hk, T, D, dt, 50)
    sinks = sink_values(np.random.default_rng(51), Hq)
    seg = packed_segments(T, 52) if packed else None
    scale = 1.0 / math.sqrt(D)
    o, lse = empty_filled(dev, (Hq, T, D), dt), empty_filled(dev, (Hq, T), "f32")
    ops.attention_forward(q, k, v, o, lse, scale, None if seg is None else to_dev(dev, seg, "i32"), window,
                          to_dev(dev, sinks))
    o_ref, lse_ref, _ = attention_ref(qf, kf, vf, scale, seg, window, sinks)
    tol = ATTN_TOL[dt]
    assert_close(read(o), o_ref, rtol=tol, atol=tol * np.max(np.abs(vf)), what="o")
    assert_close(read(lse), lse_ref, rtol=0, atol=(1e-5 if dt == "f32" else 2e-3) + 2 * 40 * U32, what="lse")
    check_attention_backward(dev, Hq, Hk, T, D, dt, 53, seg, window, sinks)


def test_attention_sinks_finite_differences(dev):
    """With sinks, attention_backward (which takes none: the forward's lse holds them) is the
    gradient of sum(o * ct) through the device's own forward (f32, GQA, a window)."""
    require_attention_sinks(dev, "f32", False, True, 4)
    check_attention_finite_differences(dev, 4, 2, 7, 4, 0.6, 54, None, 5, np.array([1.0, -0.5, 2.0, 0.1], np.float32))


def test_attention_token_major_sinks(dev):
    """Token-major views of two sequences with sinks: o and lse of each against float64 attention."""
    B, Hq, Hk, T, D, dt = 2, 4, 2, 33, 16, "f32"
    if not dev.capabilities()["fused_attention"]["token_major"]:
        pytest.skip(f"{dev.name} takes no token-major operands")
    require_attention_sinks(dev, dt, False, False, D)
    (q, k, v), _, xf = token_major_views(dev, B, T, (Hq, Hk, Hk), D, dt, seed=55)
    (o,), obuf, _ = token_major_views(dev, B, T, (Hq,), D, dt, extra=1, fill=7.0)
    lse, scale, sinks = dev.empty((B, Hq, T), "f32"), 1.0 / math.sqrt(D), sink_values(np.random.default_rng(56), Hq)
    ops.attention_forward(q, k, v, o, lse, scale, sinks=to_dev(dev, sinks))
    x4 = xf.reshape(B, T, Hq + 2 * Hk, D).transpose(0, 2, 1, 3)
    o4 = read(obuf).reshape(B, T, Hq + 1, D).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(o4[:, Hq], 7.0)
    for b in range(B):
        o_ref, lse_ref, _ = attention_ref(x4[b, :Hq], x4[b, Hq:Hq + Hk], x4[b, Hq + Hk:], scale, sinks=sinks)
        assert_close(o4[b, :Hq], o_ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(x4)), what=f"o of row {b}")
        assert_close(read(lse)[b], lse_ref, rtol=0, atol=1e-5 + 2 * 40 * U32, what=f"lse of row {b}")


def test_sinks_errors(dev):
    """sinks must be f32, 1-D, one per head (attention) or per score matrix (softmax)."""
    q, k, o, lse = dev.empty((4, 8, 16)), dev.empty((2, 8, 16)), dev.empty((4, 8, 16)), dev.empty((4, 8))
    with pytest.raises(ValueError, match=r"\[attention_forward\] sinks must have shape \(4,\), got .*\(2,\)"):
        ops.attention_forward(q, k, k, o, lse, 0.25, sinks=dev.zeros((2,)))
    with pytest.raises(ValueError, match=r"\[attention_forward\] sinks must be f32, got .*f16"):
        ops.attention_forward(q, k, k, o, lse, 0.25, sinks=dev.zeros((4,), "f16"))
    with pytest.raises(ValueError, match=r"\[attention_forward\] sinks must have shape \(4,\)"):
        ops.attention_forward(q, k, k, o, lse, 0.25, sinks=dev.zeros((4, 1)))
    S = dev.empty((2, 3, 5, 5))
    with pytest.raises(ValueError, match=r"\[softmax_causal_forward\] sinks must have shape \(6,\)"):
        ops.softmax_causal_forward(S, S, 1.0, sinks=dev.zeros((2,)))
    with pytest.raises(ValueError, match=r"\[softmax_causal_forward\] sinks must be f32"):
        ops.softmax_causal_forward(S, S, 1.0, sinks=dev.zeros((6,), "i32"))


def test_attention_errors(dev):
    """Bad operands name the op and the argument."""
    q, k = dev.empty((4, 8, 16)), dev.empty((3, 8, 16))
    o, lse = dev.empty((4, 8, 16)), dev.empty((4, 8))
    with pytest.raises(ValueError, match=r"\[attention_forward\] k must be \(Hk, 8, 16\) with Hk dividing Hq = 4"):
        ops.attention_forward(q, k, k, o, lse, 0.25)
    k = dev.empty((2, 8, 16))
    with pytest.raises(ValueError, match=r"\[attention_forward\] lse must have shape \(4, 8\)"):
        ops.attention_forward(q, k, k, o, dev.empty((4, 7)), 0.25)
    with pytest.raises(ValueError, match=r"\[attention_forward\] scale must be > 0"):
        ops.attention_forward(q, k, k, o, lse, 0.0)
    with pytest.raises(ValueError, match=r"\[attention_backward\] dk must have shape \(2, 8, 16\)"):
        ops.attention_backward(q, k, k, o, o, lse, o, o, k, 0.25)
    with pytest.raises(ValueError, match=r"\[attention_forward\] segments must have shape \(8,\)"):
        ops.attention_forward(q, k, k, o, lse, 0.25, dev.zeros((7,), "i32"))
    with pytest.raises(ValueError, match=r"\[attention_forward\] segments must be i32, got f32"):
        ops.attention_forward(q, k, k, o, lse, 0.25, dev.zeros((8,)))
    with pytest.raises(ValueError, match=r"\[attention_backward\] window must be >= 0"):
        ops.attention_backward(q, k, k, o, o, lse, o, k, k, 0.25, None, -1)


# -------------------------------------------------------------------------------- embedding


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("V,C,ids_shape", [(1, 1, (1,)), (33, 31, (127,)), (127, 33, (3, 31)), (4096, 2048, (256,))],
                         ids=["1x1", "33x31", "127x33-batched", "4096x2048"])
def test_embedding_forward(dev, V, C, ids_shape, dt):
    """out = table[ids], an exact copy of the rows (repeated ids, first and last row)."""
    rng = np.random.default_rng(28)
    table, tf = upload(dev, rng.standard_normal((V, C)), dt)
    ids = rng.integers(0, V, size=ids_shape).astype(np.int32)
    ids.reshape(-1)[0], ids.reshape(-1)[-1] = V - 1, 0
    out = empty_filled(dev, ids_shape + (C,), dt)
    ops.embedding_forward(to_dev(dev, ids, "i32"), table, out)
    np.testing.assert_array_equal(read(out), tf[ids])


@pytest.mark.parametrize("bad", [-1, 33, 1 << 30])
def test_embedding_forward_rejects_bad_id(dev, bad):
    table = dev.zeros((33, 4))
    out = dev.empty((3, 4))
    with pytest.raises(ValueError, match="embedding_forward"):
        ops.embedding_forward(to_dev(dev, np.array([0, bad, 1], np.int32), "i32"), table, out)


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("V,C,T", [(1, 1, 1), (17, 31, 300), (127, 33, 31), (4096, 2048, 256)],
                         ids=["1x1x1", "17x31x300", "127x33x31", "4096x2048x256"])
def test_embedding_backward(dev, V, C, T, dt):
    """dtable (f32) += scatter-add of dout rows by id: repeated ids sum, untouched rows keep their
    previous contents exactly."""
    rng = np.random.default_rng(29)
    ids = rng.integers(0, V, size=T).astype(np.int32)
    dout, df = upload(dev, rng.standard_normal((T, C)), dt)
    dtable, d0 = upload(dev, rng.standard_normal((V, C)), "f32")
    ops.embedding_backward(to_dev(dev, ids, "i32"), dout, dtable)
    ref, mag = d0.copy(), np.abs(d0)
    np.add.at(ref, ids, df)
    np.add.at(mag, ids, np.abs(df))
    counts = np.bincount(ids, minlength=V)[:, None]
    got = read(dtable)
    assert_close_elementwise(got, ref, rtol=0.0, atol=(reduction_rtol(int(counts.max()) + 1) + U32) * mag, what="dtable")
    np.testing.assert_array_equal(got[counts[:, 0] == 0], d0[counts[:, 0] == 0])


def test_embedding_backward_finite_differences(dev):
    rng = np.random.default_rng(30)
    V, C = 7, 5
    ids = to_dev(dev, np.array([3, 0, 3, 6, 3, 1, 0, 2, 6, 6, 3], np.int32), "i32")
    t0 = rng.standard_normal((V, C)).astype(np.float32)
    ct = rng.standard_normal((11, C)).astype(np.float32)

    def loss(tv):
        out = dev.empty((11, C))
        ops.embedding_forward(ids, to_dev(dev, tv), out)
        return float(np.sum(read(out) * ct))

    dtable = dev.zeros((V, C))
    ops.embedding_backward(ids, to_dev(dev, ct), dtable)
    numeric = fd_grad(loss, t0)
    assert np.all(numeric[[4, 5]] == 0)  # ids 4 and 5 never occur
    assert_fd(read(dtable), numeric, "dtable")


# ---------------------------------------------------------------------------- cross entropy


def cross_entropy_ref(x, targets, ignore_index, scale):
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - m)
    lse = m[:, 0] + np.log(np.sum(e, axis=-1))
    keep = targets != ignore_index
    t = np.where(keep, targets, 0)
    loss = np.where(keep, lse - x[np.arange(len(x)), t], 0.0)
    d = e / np.sum(e, axis=-1, keepdims=True)
    d[np.arange(len(x)), t] -= 1.0
    d = np.where(keep[:, None], scale * d, 0.0)
    return loss, d


def check_cross_entropy(loss_got, d_got, x, targets, ignore_index, scale, dt, what):
    ref_loss, ref_d = cross_entropy_ref(x, targets, ignore_index, scale)
    V = x.shape[1]
    keep = targets != ignore_index
    # loss = max + log(sum exp) - x[t] in f32: each term's rounding, plus the sum's relative error
    spread = np.max(x, -1) - np.min(x, -1)
    loss_tol = (8 * U32 * (np.max(np.abs(x), -1) + math.log(max(V, 2))) + reduction_rtol(V) + 8 * U32 * spread)
    assert_close_elementwise(loss_got, ref_loss, rtol=0.0, atol=loss_tol, what=f"{what} loss")
    assert np.all(loss_got[~keep] == 0), f"{what}: ignored rows' loss not 0"
    if d_got is not None:
        assert np.all(d_got[~keep] == 0), f"{what}: ignored rows' dlogits not 0"
        # softmax entries: output rounding + f32 exp argument/sum error; the target entry p - 1
        # cancels, so an absolute scale * few ulp of 1.0
        f32_rel = (16 + 2 * float(np.max(spread))) * U32 + reduction_rtol(V)
        rtol = UNIT_ROUNDOFF[dt] + f32_rel
        atol = abs(scale) * f32_rel + SUBNORMAL[dt]
        assert_close_elementwise(d_got, ref_d, rtol=rtol, atol=atol, what=f"{what} dlogits")


# (64, 32000): a row held in registers on CUDA; (2, 151936): Qwen's vocabulary, too long for that
CE_SHAPES = [(1, 1), (31, 127), (33, 31), (127, 33), (1, 31), (33, 1), (64, 32000), (2, 151936)]


def _ce_inputs(dev, T, V, dt, seed, every):
    """(logits on dev, their float64 values, targets with every `every`-th row ignored, targets on dev)."""
    rng = np.random.default_rng(seed)
    x, xf = upload(dev, 2 * rng.standard_normal((T, V)), dt)
    targets = rng.integers(0, V, size=T).astype(np.int32)
    if T > 1:
        targets[::every] = -100
    return x, xf, targets, to_dev(dev, targets, "i32")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("T,V", CE_SHAPES, ids=[f"{t}x{v}" for t, v in CE_SHAPES])
def test_cross_entropy(dev, T, V, dt):
    """loss[t] = logsumexp - logit[target]; dlogits = scale*(softmax - onehot); some rows ignored."""
    x, xf, targets, tg = _ce_inputs(dev, T, V, dt, 31, 5)
    for scale in (1.0, 1.0 / 37, 2.5):
        loss = empty_filled(dev, (T,), "f32")
        d = empty_filled(dev, (T, V), dt, 5.0)
        ops.cross_entropy(x, tg, loss, d, scale=scale)
        check_cross_entropy(read(loss), read(d), xf, targets, -100, np.float64(np.float32(scale)), dt,
                            f"scale={scale}")
    loss = empty_filled(dev, (T,), "f32")
    ops.cross_entropy(x, tg, loss)  # loss only
    check_cross_entropy(read(loss), None, xf, targets, -100, 1.0, dt, "loss only")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("T,V", [(1, 1), (31, 33), (33, 127)], ids=["1x1", "31x33", "33x127"])
def test_cross_entropy_scale_by(dev, T, V, dt):
    """scale_by (1,) f32 on the device: with scale 1, dlogits equal the scale=s call bit for bit
    (and float64); with scale != 1 the factor is the f32 product scale * scale_by[0], formed once;
    the loss never changes."""
    x, xf, targets, tg = _ce_inputs(dev, T, V, dt, 36, 7)

    def run(scale, scale_by=None):
        loss, d = empty_filled(dev, (T,), "f32"), empty_filled(dev, (T, V), dt, 5.0)
        ops.cross_entropy(x, tg, loss, d, scale=scale,
                          scale_by=None if scale_by is None else to_dev(dev, np.array([scale_by], np.float32)))
        return np.array(loss.numpy(), copy=True), np.array(d.numpy(), copy=True)

    base_loss, _ = run(1.0)
    for s in (1.0 / 37, 2.5, 3e-5):
        s32 = np.float32(s)
        want_loss, want_d = run(float(s32))
        got_loss, got_d = run(1.0, s32)
        check_bits(got_d, want_d, f"scale_by={s}")
        check_bits(got_loss, base_loss, f"loss with scale_by={s}")
        check_cross_entropy(got_loss.astype(np.float64), got_d.astype(np.float64), xf, targets, -100,
                            np.float64(s32), dt, f"scale_by={s}")
        # scale 3 times scale_by: one f32 product (3 * s32 rounds), the same as passing it as scale
        prod = np.float32(np.float32(3.0) * s32)
        _, got3 = run(3.0, s32)
        _, want3 = run(float(prod))
        check_bits(got3, want3, f"scale=3, scale_by={s}")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_cross_entropy_ignore_index(dev, dt):
    """A custom ignore_index (a valid class id, 3) masks rows: loss 0 and dlogits rows 0 even
    over garbage; -100 is then an ordinary (out-of-range) target."""
    rng = np.random.default_rng(32)
    T, V = 33, 31
    x, xf = upload(dev, rng.standard_normal((T, V)), dt)
    targets = rng.integers(0, V, size=T).astype(np.int32)
    targets[[0, 7, 32]] = 3
    loss, d = empty_filled(dev, (T,), "f32", 9.0), empty_filled(dev, (T, V), dt, np.nan)
    ops.cross_entropy(x, to_dev(dev, targets, "i32"), loss, d, ignore_index=3)
    check_cross_entropy(read(loss), read(d), xf, targets, 3, 1.0, dt, "ignore_index=3")
    assert np.all(read(loss)[targets != 3] > 0)
    targets[1] = -100
    with pytest.raises(ValueError, match="cross_entropy"):
        ops.cross_entropy(x, to_dev(dev, targets, "i32"), loss, d, ignore_index=3)


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_cross_entropy_dlogits_aliases_logits(dev, dt):
    """dlogits may be the logits tensor itself (gradient written in place)."""
    rng = np.random.default_rng(33)
    T, V = 33, 127
    x, xf = upload(dev, 2 * rng.standard_normal((T, V)), dt)
    targets = rng.integers(0, V, size=T).astype(np.int32)
    targets[4] = -100
    loss = empty_filled(dev, (T,), "f32")
    ops.cross_entropy(x, to_dev(dev, targets, "i32"), loss, x, scale=0.5)
    check_cross_entropy(read(loss), read(x), xf, targets, -100, 0.5, dt, "aliased")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("V", [32000, 128256])
def test_cross_entropy_large_logits_stable(dev, dt, V):
    """V = 32000 and Llama 3's 128256 with logits offset by +-1e4 and spread by 100: no overflow,
    same loss/grad."""
    rng = np.random.default_rng(34)
    T = 8
    base = rng.standard_normal((T, V))
    base[0:3] += 1e4
    base[3:6] -= 1e4
    base[6:] *= 100
    x, xf = upload(dev, base, dt)
    targets = rng.integers(0, V, size=T).astype(np.int32)
    targets[6] = int(np.argmax(xf[6]))  # a confident row: loss ~ 0
    loss, d = empty_filled(dev, (T,), "f32"), empty_filled(dev, (T, V), dt)
    ops.cross_entropy(x, to_dev(dev, targets, "i32"), loss, d)
    got_loss, got_d = read(loss), read(d)
    ref_loss, ref_d = cross_entropy_ref(xf, targets, -100, 1.0)
    # |logit| ~ 1e4: f32 holds it to 1e4 * 2^-24 ~ 6e-4 absolute; the loss is a difference of two
    # such numbers (log-sum-exp and the target logit)
    assert_close_elementwise(got_loss, ref_loss, rtol=0.0, atol=8 * U32 * np.max(np.abs(xf), -1) + 1e-4, what="loss")
    assert_close(got_d, ref_d, rtol=2 * UNIT_ROUNDOFF[dt] + 1e-4, what="dlogits")
    assert np.all(np.abs(got_d.sum(-1)) < 1e-2), "gradient rows must sum to ~0"


@pytest.mark.parametrize("bad", [31, -1, 1000])
def test_cross_entropy_rejects_out_of_range_target(dev, bad):
    x = dev.zeros((3, 31))
    loss = dev.empty((3,))
    with pytest.raises(ValueError, match="cross_entropy"):
        ops.cross_entropy(x, to_dev(dev, np.array([0, bad, 2], np.int32), "i32"), loss, x)


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_cross_entropy_chunked_views(dev, dt):
    """The caller chunks over tokens (docs/architecture.md, 'The op contract'): each call gets row-range views of one
    logits/targets/loss buffer, gradient written in place; the result equals the whole."""
    rng = np.random.default_rng(136)
    T, V, chunk = 40, 127, 16
    x, xf = upload(dev, 2 * rng.standard_normal((T, V)), dt)
    targets = rng.integers(0, V, size=T).astype(np.int32)
    targets[[3, 17, 39]] = -100
    tg = to_dev(dev, targets, "i32")
    loss = empty_filled(dev, (T,), "f32")
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        ops.cross_entropy(x[c0:c1], tg[c0:c1], loss[c0:c1], x[c0:c1], scale=1.0 / T)
    check_cross_entropy(read(loss), read(x), xf, targets, -100, np.float64(np.float32(1.0 / T)), dt, "chunked")


def test_cross_entropy_finite_differences(dev):
    """dlogits is the gradient of sum(loss) (differences of the device's own loss), ignored rows
    get zero gradient."""
    rng = np.random.default_rng(35)
    T, V = 4, 11
    x0 = (2 * rng.standard_normal((T, V))).astype(np.float32)
    targets = to_dev(dev, np.array([3, -100, 0, 10], np.int32), "i32")

    def loss_sum(xv):
        loss = dev.empty((T,))
        ops.cross_entropy(to_dev(dev, xv), targets, loss)
        return float(np.sum(read(loss)))

    loss, d = dev.empty((T,)), dev.empty((T, V))
    ops.cross_entropy(to_dev(dev, x0), targets, loss, d, scale=1.0)
    numeric = fd_grad(loss_sum, x0)
    assert np.all(numeric[1] == 0)
    assert_fd(read(d), numeric, "dlogits")


# ----------------------------------------------------------------------------- elementwise


def rand_like_size(rng, n, spread=True):
    """n values over many binades (including some below f16's normal range)."""
    x = rng.standard_normal(n)
    if spread:
        x *= 10.0 ** rng.uniform(-5, 3, n)
    return x


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_add(dev, n, dt):
    rng = np.random.default_rng(40)
    a, af = upload(dev, rand_like_size(rng, n), dt)
    b, bf = upload(dev, rand_like_size(rng, n), dt)
    out = empty_filled(dev, (n,), dt)
    ops.add(a, b, out)
    ref = af + bf
    # one rounding of the exact sum (f32 computation can add one more, relative 2^-24)
    assert_close_elementwise(read(out), ref, rtol=UNIT_ROUNDOFF[dt] + 2 * U32, atol=SUBNORMAL[dt], what="add")
    if dt == "f32":  # f32 add is correctly rounded: bit-exact against numpy
        np.testing.assert_array_equal(read(out, np.float32), af.astype(np.float32) + bf.astype(np.float32))


AXPY_PAIRS = [(x, y) for x in FLOAT_DTYPES for y in FLOAT_DTYPES]


@pytest.mark.parametrize("xdt,ydt", AXPY_PAIRS, ids=[f"{x}-{y}" for x, y in AXPY_PAIRS])
@pytest.mark.parametrize("n", SIZES)
def test_axpy(dev, n, xdt, ydt):
    """y += alpha * x, x and y in any float dtypes."""
    rng = np.random.default_rng(41)
    x, xf = upload(dev, rand_like_size(rng, n), xdt)
    y, yf = upload(dev, rand_like_size(rng, n), ydt)
    alpha = np.float32(-0.3721)
    ops.axpy(float(alpha), x, y)
    ref = yf + np.float64(alpha) * xf
    mag = np.abs(yf) + np.abs(np.float64(alpha) * xf)  # cancellation: bound f32 error by the terms
    assert_close_elementwise(read(y), ref, rtol=UNIT_ROUNDOFF[ydt], atol=4 * U32 * mag + SUBNORMAL[ydt], what="axpy")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_scale(dev, n, dt):
    rng = np.random.default_rng(42)
    x, xf = upload(dev, rand_like_size(rng, n), dt)
    for alpha in (0.5, -3.0, 1.0 / 3.0, 0.0):
        out = empty_filled(dev, (n,), dt)
        ops.scale(x, alpha, out)
        ref = np.float64(np.float32(alpha)) * xf
        assert_close_elementwise(read(out), ref, rtol=UNIT_ROUNDOFF[dt] + 2 * U32, atol=SUBNORMAL[dt],
                                 what=f"alpha={alpha}")


def f32_specials():
    """float32 values that exercise rounding into f16/bf16: ties, subnormal boundaries,
    overflow thresholds, signed zeros, inf, NaN."""
    b = lambda u: np.array(u, dtype=np.uint32).view(np.float32)
    return np.concatenate([
        np.array([0.0, -0.0, np.inf, -np.inf, 1.0, -1.0,
                  65504.0, 65519.99, 65520.0, -65520.0, 70000.0, 1e30,  # f16 max, rounds to max, to inf
                  2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-26, 2.0**-25 + 2.0**-40,  # f16 subnormal ties
                  6.0e-8, -5.9e-8, 1e-10, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-11 + 2.0**-20,
                  3.3895314e38, 3.4028235e38, 1e-45, -1e-45, 1.17549435e-38], dtype=np.float32),
        b([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7F8000, 0x7F7F7FFF, 0x00008000,
           0x00018000, 0x807FFFFF, 0x7FC00000, 0xFFC00001, 0x7F800001]),  # bf16 ties, edges, NaNs
    ])


def random_f32_bits(rng, n):
    """n float32 values with uniformly random bit patterns (every exponent, both signs)."""
    return rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def bf16_rne_frexp(x):
    """An independent bf16 rounding in float64 arithmetic (8 significant bits, subnormals
    below 2^-126 on a 2^-133 grid, overflow past the bf16 max to inf), numpy's rint = RNE."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        m, e = np.frexp(x)
        normal = np.ldexp(np.rint(np.ldexp(m, 8)), e - 8)
        sub = np.rint(x * 2.0**133) * 2.0**-133
        out = np.where(np.abs(x) < 2.0**-126, sub, normal)
        out = np.where(np.abs(out) > 3.3895313892515355e38, np.copysign(np.inf, x), out)
    return np.where(np.isfinite(x), out, x)


def check_bits(got, ref, what):
    """Bit-exact equality of float arrays (same width), any NaN matching any NaN."""
    nan_ref, nan_got = np.isnan(ref), np.isnan(got)
    np.testing.assert_array_equal(nan_got, nan_ref, err_msg=f"{what}: NaN positions differ")
    ui = np.uint16 if got.dtype == np.float16 else np.uint32
    g, r = got[~nan_ref].view(ui), ref[~nan_ref].view(ui)
    bad = np.flatnonzero(g != r)
    assert bad.size == 0, (f"{what}: {bad.size} values differ, e.g. input index {bad[:5].tolist()}: "
                           f"got {got[~nan_ref][bad[:5]]} want {ref[~nan_ref][bad[:5]]}")


def test_cast_oracle_self_check():
    """The two bf16 references agree (bits RNE vs float64 frexp/rint) on random bit patterns."""
    x = random_f32_bits(np.random.default_rng(43), 200_000)
    x = np.concatenate([x, f32_specials()])
    a = bf16_value(bf16_bits(x)).astype(np.float64)
    with np.errstate(invalid="ignore"):
        b = bf16_rne_frexp(x.astype(np.float64))
    ok = np.isnan(x) | (a == b) & (np.signbit(a) == np.signbit(b))
    assert np.all(ok), x[~ok][:5]


@pytest.mark.parametrize("n", [1, 33, 100_003])
def test_cast_f32_to_f16(dev, n):
    """f32 -> f16 round to nearest even, bit-exact against numpy's astype(float16), including
    subnormals, overflow to inf and NaN; f16 -> f32 back is exact."""
    rng = np.random.default_rng(44)
    x = np.concatenate([f32_specials(), random_f32_bits(rng, n), rng.standard_normal(n).astype(np.float32)])
    x = np.concatenate([x, np.float32(2.0**-24) * rng.integers(-2048, 2048, n).astype(np.float32) / 4])  # subnormal grid ties
    src = to_dev(dev, x, "f32")
    h = empty_filled(dev, x.shape, "f16")
    ops.cast(src, h)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    got = np.array(h.numpy(), copy=True)
    check_bits(got, want, "f32->f16")
    back = empty_filled(dev, x.shape, "f32")
    ops.cast(h, back)
    check_bits(read(back, np.float32), want.astype(np.float32), "f16->f32")


@pytest.mark.parametrize("n", [1, 33, 100_003])
def test_cast_f32_to_bf16(dev, n):
    """f32 -> bf16 round to nearest even, bit-exact against an RNE on the uint32 bits, including
    ties, subnormals, overflow to inf and NaN; bf16 -> f32 back is exact."""
    rng = np.random.default_rng(45)
    x = np.concatenate([f32_specials(), random_f32_bits(rng, n), rng.standard_normal(n).astype(np.float32)])
    src = to_dev(dev, x, "f32")
    b = empty_filled(dev, x.shape, "bf16")
    ops.cast(src, b)
    got = read(b, np.float32)  # exact widening of the stored bits
    want = bf16_value(bf16_bits(x))
    check_bits(got, want, "f32->bf16")
    back = empty_filled(dev, x.shape, "f32")
    ops.cast(b, back)
    check_bits(read(back, np.float32), want, "bf16->f32")


def test_cast_between_f16_and_bf16(dev):
    """f16 <-> bf16 through the exact f32 value, one rounding."""
    rng = np.random.default_rng(46)
    h_bits = np.concatenate([rng.integers(0, 2**16, 50_000, dtype=np.uint32).astype(np.uint16),
                             np.array([0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0x7C00, 0xFC00, 0x8000], np.uint16)])
    h = h_bits.view(np.float16)
    H = dev.tensor(h, "f16")
    B = empty_filled(dev, h.shape, "bf16")
    ops.cast(H, B)
    check_bits(read(B, np.float32), bf16_value(bf16_bits(h.astype(np.float32))), "f16->bf16")

    b_vals = bf16_value(rng.integers(0, 2**16, 50_000, dtype=np.uint32).astype(np.uint16))
    b_vals = np.concatenate([b_vals, bf16_value(np.array([0x477F, 0x4780, 0x3380, 0x3300, 0x0001], np.uint16))])
    Bs = to_dev(dev, b_vals, "bf16")  # exactly representable: stored as given
    Hs = empty_filled(dev, b_vals.shape, "f16")
    ops.cast(Bs, Hs)
    with np.errstate(over="ignore"):
        check_bits(np.array(Hs.numpy(), copy=True), b_vals.astype(np.float16), "bf16->f16")
    out = empty_filled(dev, Bs.shape, "bf16")
    ops.cast(Bs, out)  # same dtype: a bit copy
    np.testing.assert_array_equal(np.array(out.numpy(), copy=True).view(np.uint32), np.array(Bs.numpy(), copy=True).view(np.uint32))


def test_cast_same_dtype_copies(dev):
    """Same-dtype casts copy the bits (NaN payloads, -0, subnormals); i32 copies, i32 <-> float refused."""
    rng = np.random.default_rng(47)
    h = rng.integers(0, 2**16, 50_000, dtype=np.uint32).astype(np.uint16).view(np.float16)
    for dt, src in (("f16", dev.tensor(h, "f16")), ("f32", to_dev(dev, random_f32_bits(rng, 1000), "f32"))):
        out = empty_filled(dev, src.shape, dt)
        ops.cast(src, out)
        ui = np.uint16 if dt == "f16" else np.uint32
        np.testing.assert_array_equal(np.array(out.numpy(), copy=True).view(ui), np.array(src.numpy(), copy=True).view(ui))
    ids = to_dev(dev, np.arange(-5, 28, dtype=np.int32), "i32")
    out = dev.empty((33,), "i32")
    ops.cast(ids, out)
    np.testing.assert_array_equal(read(out, np.int32), np.arange(-5, 28))
    with pytest.raises(ValueError, match="cast"):
        ops.cast(ids, dev.empty((33,), "f32"))


@pytest.mark.parametrize("dt", FLOAT_DTYPES + ("i32",))
@pytest.mark.parametrize("n", SIZES)
def test_fill(dev, n, dt):
    x = dev.empty((n,), dt)
    values = (7.0, -3.0, 0.0) if dt == "i32" else (1.0 / 3.0, -2.5, 0.0, 1e-6, 70000.0, -np.inf)
    for v in values:
        ops.fill(x, v)
        got = np.array(x.numpy(), copy=True)
        if dt == "i32":
            want = np.full(n, int(v), np.int32)
        else:
            with np.errstate(over="ignore"):
                want = np.full(n, round_value(v, dt), np.float64)
            got = got.astype(np.float64)
        np.testing.assert_array_equal(got, want, err_msg=f"fill {v}")
        if v == 0.0 and dt != "i32":
            assert not np.any(np.signbit(got))


def round_value(v, dt):
    v32 = np.float32(v)
    if dt == "f32":
        return float(v32)
    if dt == "f16":
        return float(v32.astype(np.float16))
    return float(bf16_value(bf16_bits(v32)))


# ---------------------------------------------------------------------------------- dropout


def nonzero_values(rng, n):
    """Magnitudes in [0.5, 2), random signs: an output is 0 exactly where the element dropped."""
    return rng.uniform(0.5, 2.0, n) * rng.choice([-1.0, 1.0], n)


def sigma_bound(p, n, k=5.0):
    """k standard deviations of the kept fraction of n Bernoulli(1 - p) draws."""
    return k * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout(dev, p, dt):
    rng = np.random.default_rng(50)
    n = 100_003
    x, xf = upload(dev, nonzero_values(rng, n), dt)
    out = empty_filled(dev, (n,), dt)
    ops.dropout(x, out, p, 1234)
    got = read(out)
    keep = got != 0
    # kept fraction ~ 1 - p overall and in each of 8 contiguous blocks (no index-dependent bias)
    assert abs(keep.mean() - (1 - p)) <= sigma_bound(p, n), f"kept {keep.mean():.4f}, want {1 - p}"
    for blk in np.array_split(keep, 8):
        assert abs(blk.mean() - (1 - p)) <= sigma_bound(p, len(blk))
    # kept values scaled by 1/(1 - p) (p as the f32 the op receives)
    p32 = np.float64(np.float32(p))
    assert_close_elementwise(got[keep], xf[keep] / (1 - p32), rtol=UNIT_ROUNDOFF[dt] + 4 * U32, what="kept values")
    # same seed: same mask and values; the backward on dy drops exactly the same positions
    out2 = empty_filled(dev, (n,), dt)
    ops.dropout(x, out2, p, 1234)
    np.testing.assert_array_equal(read(out2), got)
    dy, dyf = upload(dev, nonzero_values(rng, n), dt)
    dx = empty_filled(dev, (n,), dt)
    ops.dropout(dy, dx, p, 1234)
    gdx = read(dx)
    np.testing.assert_array_equal(gdx != 0, keep)
    assert_close_elementwise(gdx[keep], dyf[keep] / (1 - p32), rtol=UNIT_ROUNDOFF[dt] + 4 * U32, what="backward")
    # other seeds (also differing only in the high 32 bits): masks disagree on ~2p(1-p) of elements
    for seed in (1235, 1234 + (1 << 40), (1 << 64) - 1):
        o = empty_filled(dev, (n,), dt)
        ops.dropout(x, o, p, seed)
        k2 = read(o) != 0
        disagree = np.mean(k2 != keep)
        want = 2 * p * (1 - p)
        assert abs(disagree - want) <= 5 * math.sqrt(want * (1 - want) / n), f"seed {seed}: disagreement {disagree:.4f}"


def test_dropout_mask_depends_only_on_seed_and_index(dev):
    """The mask is a function of (seed, element index): the same for every dtype and for any
    prefix of a longer tensor."""
    rng = np.random.default_rng(51)
    n, p, seed = 4099, 0.3, 987654321
    vals = nonzero_values(rng, n)
    masks = {}
    for dt in device_dtypes(dev):
        x = to_dev(dev, vals, dt)
        out = empty_filled(dev, (n,), dt)
        ops.dropout(x, out, p, seed)
        masks[dt] = read(out) != 0
    for dt in masks:
        np.testing.assert_array_equal(masks[dt], masks["f32"], err_msg=dt)
    for m in (1, 33, 127):
        out = empty_filled(dev, (m,), "f32")
        ops.dropout(to_dev(dev, vals[:m]), out, p, seed)
        np.testing.assert_array_equal(read(out) != 0, masks["f32"][:m])
    # 2-D shape: flat row-major index
    out = empty_filled(dev, (1, n), "f32")
    ops.dropout(to_dev(dev, vals.reshape(1, n)), out, p, seed)
    np.testing.assert_array_equal(read(out)[0] != 0, masks["f32"])


U64 = (1 << 64) - 1
MASK63 = (1 << 63) - 1


def seed_offset_tensor(dev, offset):
    """A uint64 offset as dropout's seed_offset: (2,) i32 (low 32 bits, high 32 bits)."""
    words = np.array([offset & 0xFFFFFFFF, offset >> 32], np.uint32).view(np.int32)
    return to_dev(dev, words, "i32")


# (seed, offset): the high word set, sums that wrap mod 2^64, sums with bit 63 set (masked off),
# an offset whose words are negative as i32, and Python's (call_seed * 1000003 + tag) split into
# seed = tag, offset = call_seed * 1000003 & MASK63
SEED_OFFSETS = [(5, 0x0000000100000007), (0x7FFFFFFFFFFFFFFF, 2), (U64 - 2, 5), (123, U64),
                (9, 0x8000000000000000), (0xDEADBEEF, 0xFFFFFFFF00000001),
                (7, ((1 << 62) + 12345) * 1000003 & MASK63)]


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_dropout_seed_offset(dev, dt):
    """seed_offset on the device: the mask of seed (seed + offset) mod 2^64 & (2^63 - 1), bit for
    bit the host-seed call with that effective seed, for the forward and the backward alike."""
    rng = np.random.default_rng(53)
    n, p = 1029, 0.4
    x, _ = upload(dev, nonzero_values(rng, n), dt)
    for seed, offset in SEED_OFFSETS:
        eff = ((seed + offset) & U64) & MASK63
        got, want = empty_filled(dev, (n,), dt), empty_filled(dev, (n,), dt)
        ops.dropout(x, got, p, seed, seed_offset=seed_offset_tensor(dev, offset))
        ops.dropout(x, want, p, eff)
        g, w = np.array(got.numpy(), copy=True), np.array(want.numpy(), copy=True)
        check_bits(g, w, f"seed {seed:#x} + offset {offset:#x}")
        # not vacuous: a real mask, and another than the seed's alone where the seeds differ
        assert 0.45 < np.mean(g != 0) < 0.75, f"kept fraction {np.mean(g != 0):.3f}"
        if eff != seed:
            alone = empty_filled(dev, (n,), dt)
            ops.dropout(x, alone, p, seed)
            assert np.any((read(alone) != 0) != (g != 0)), "the offset did not change the mask"
    # Python's seed formula: (call_seed * 1000003 + tag) & MASK63 == tag + (call_seed * 1000003 & MASK63)
    call_seed, tag = (1 << 62) + 12345, 7
    assert (call_seed * 1000003 + tag) & MASK63 == ((tag + (call_seed * 1000003 & MASK63)) & U64) & MASK63


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_dropout_seed_offset_first_row(dev, dt):
    """A (3,) seed_offset whose third word is r0: dropout of rows r0.. of a (R, C) batch draws,
    bit for bit, the rows the whole batch's (2,) call draws (a data-parallel rank's slice)."""
    rng = np.random.default_rng(54)
    R, C, p, seed, offset = 7, 33, 0.35, 11, 0x0000000300000005
    vals = nonzero_values(rng, R * C).reshape(R, C)
    full = empty_filled(dev, (R, C), dt)
    ops.dropout(upload(dev, vals, dt)[0], full, p, seed, seed_offset=seed_offset_tensor(dev, offset))
    full = np.array(full.numpy(), copy=True)
    assert 0.5 < np.mean(full != 0) < 0.8
    for r0, r1 in ((0, 7), (3, 7), (6, 7), (2, 5)):
        words = np.array([offset & 0xFFFFFFFF, offset >> 32, r0], np.uint32).view(np.int32)
        part = empty_filled(dev, (r1 - r0, C), dt)
        ops.dropout(upload(dev, vals[r0:r1], dt)[0], part, p, seed, seed_offset=to_dev(dev, words, "i32"))
        check_bits(np.array(part.numpy(), copy=True), full[r0:r1], f"rows {r0}:{r1}")
        if r0:  # not vacuous: the (2,) call on the slice alone draws another mask
            alone = empty_filled(dev, (r1 - r0, C), dt)
            ops.dropout(upload(dev, vals[r0:r1], dt)[0], alone, p, seed, seed_offset=seed_offset_tensor(dev, offset))
            assert np.any((read(alone) != 0) != (full[r0:r1] != 0))


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_dropout_p0_identity(dev, n, dt):
    rng = np.random.default_rng(52)
    x, xf = upload(dev, rng.standard_normal(n), dt)
    out = empty_filled(dev, (n,), dt)
    ops.dropout(x, out, 0.0, 42)
    np.testing.assert_array_equal(read(out), xf)


def test_dropout_rejects_bad_p(dev):
    x = dev.zeros((4,))
    for p in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="dropout"):
            ops.dropout(x, dev.empty((4,)), p, 0)


# ---------------------------------------------------------------------------------- AdamW


def adamw_ref(p, g, m, v, lr, b1, b2, eps, wd, step, grad_scale):
    """PyTorch's AdamW step in float64 (torch/optim/adamw.py, single-tensor path)."""
    p = p * (1.0 - lr * wd)  # decoupled weight decay, applied first
    g = g * grad_scale
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    bc1 = 1.0 - b1**step
    bc2 = 1.0 - b2**step
    denom = np.sqrt(v) / math.sqrt(bc2) + eps  # eps outside the sqrt of the bias-corrected v
    p = p - (lr / bc1) * m / denom
    return p, m, v


ADAMW_HYPER = [  # lr, beta1, beta2, eps, weight_decay, grad_scale
    (1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0),
    (0.1, 0.9, 0.95, 1e-6, 0.5, 0.25),  # large lr * wd: decay-before-update order is visible
    (3e-4, 0.8, 0.99, 1e-8, 0.0, 2.0**-16),  # loss-scale reciprocal folded into the grad read
]


@pytest.mark.parametrize("hyper", ADAMW_HYPER, ids=["default", "strong-decay", "loss-scaled"])
@pytest.mark.parametrize("n", [1, 33, 1027, 100_003])
def test_adamw_update(dev, n, hyper):
    """Steps 1..5, each compared to the float64 formula from the device's previous state; half
    the gradients are ~1e-8 so eps (and where it sits) matters; grads are left untouched."""
    lr, b1, b2, eps, wd, gs = hyper
    f32 = lambda v: float(np.float32(v))
    rng = np.random.default_rng(53)
    params = to_dev(dev, rng.standard_normal(n))
    m, v = dev.zeros((n,)), dev.zeros((n,))
    for step in range(1, 6):
        g = rng.standard_normal(n) / gs
        g[::2] *= 1e-8
        grads = to_dev(dev, g)
        p0, m0, v0, g0 = read(params), read(m), read(v), read(grads)
        ops.adamw_update(params, grads, m, v, lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step,
                         grad_scale=gs)
        rp, rm, rv = adamw_ref(p0, g0, m0, v0, f32(lr), f32(b1), f32(b2), f32(eps), f32(wd), step, f32(gs))
        # a few f32 operations each, judged against the terms (b1*m and (1-b1)*g may cancel; so
        # may the decayed param and its update, whose own error is relative to its size)
        gsc = g0 * f32(gs)
        m_mag = np.abs(f32(b1) * m0) + np.abs((1 - f32(b1)) * gsc)
        assert_close_elementwise(read(m), rm, rtol=0.0, atol=8 * U32 * m_mag + SUBNORMAL["f32"], what=f"m step {step}")
        assert_close_elementwise(read(v), rv, rtol=8 * U32, atol=SUBNORMAL["f32"], what=f"v step {step}")
        # the update lr/bc1 * m/denom inherits m's error (relative to m_mag, not m) and its own;
        # bias corrections 1 - beta^t formed in f32 (no double on some GPUs) are off by
        # ~2^-24 / (1 - beta^t) relative
        bc1, bc2 = 1 - f32(b1) ** step, 1 - f32(b2) ** step
        denom = np.sqrt(rv) / math.sqrt(bc2) + f32(eps)
        upd_mag = f32(lr) / bc1 * (m_mag + np.abs(rm)) / denom
        upd_rel = 16 * U32 + 2 * U32 * (1 / bc1 + 1 / bc2)
        assert_close_elementwise(read(params), rp, rtol=0.0, atol=4 * U32 * np.abs(p0) + upd_rel * upd_mag
                                 + SUBNORMAL["f32"], what=f"params step {step}")
        np.testing.assert_array_equal(read(grads), g0, err_msg="grads modified")


@pytest.mark.parametrize("wdt", FLOAT_DTYPES)
def test_adamw_update_working_copy(dev, wdt):
    """`working` receives the updated params cast to its dtype (round to nearest even)."""
    rng = np.random.default_rng(54)
    n = 10_007
    params = to_dev(dev, rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 4, n))
    grads = to_dev(dev, rng.standard_normal(n))
    m, v = dev.zeros((n,)), dev.zeros((n,))
    working = empty_filled(dev, (n,), wdt)
    for step in (1, 2, 3):
        ops.adamw_update(params, grads, m, v, 1e-2, weight_decay=0.1, step=step, working=working)
        p32 = read(params, np.float32)
        got = np.array(working.numpy(), copy=True)
        if wdt == "f32":
            check_bits(got, p32, "working f32")
        elif wdt == "f16":
            check_bits(got, p32.astype(np.float16), "working f16")
        else:
            check_bits(got, bf16_value(bf16_bits(p32)), "working bf16")


@pytest.mark.torch
def test_adamw_update_matches_torch(dev):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(55)
    n, lr, betas, eps, wd, gs = 1027, 1e-2, (0.9, 0.99), 1e-8, 0.1, 0.5
    p0 = rng.standard_normal(n).astype(np.float32)
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.AdamW([tp], lr=lr, betas=betas, eps=eps, weight_decay=wd)
    params, m, v = to_dev(dev, p0), dev.zeros((n,)), dev.zeros((n,))
    for step in range(1, 6):
        g = rng.standard_normal(n).astype(np.float32)
        g[::3] *= 1e-7
        tp.grad = torch.from_numpy(g * np.float32(gs))
        opt.step()
        ops.adamw_update(params, to_dev(dev, g), m, v, lr, beta1=betas[0], beta2=betas[1], eps=eps,
                         weight_decay=wd, step=step, grad_scale=gs)
        want = tp.detach().numpy().astype(np.float64)
        # both f32; torch forms m with lerp_ (another rounding order) and its bias corrections in
        # double: states drift by a few ulp per step, far below a formula error (O(lr))
        assert_close_elementwise(read(params), want, rtol=16 * U32, atol=256 * U32 * lr, what=f"step {step}")


# AdamW with its per-step scalars on the device: hyper (5,) f32, sq (1,) f32, flag (1,) i32

def adamw_hyper(lr, b1, b2, wd, step, inv_denom, max_norm):
    """hyper as the host forms it: [lr / (1 - b1^t), sqrt(1 - b2^t), lr * wd, inv_denom, max_norm]
    in f32, the bias corrections in double from the f32 betas, as the scalar path does."""
    lr32, b1_, b2_ = np.float32(lr), float(np.float32(b1)), float(np.float32(b2))
    return np.array([float(lr32) / (1.0 - b1_**step), math.sqrt(1.0 - b2_**step), lr32 * np.float32(wd),
                     inv_denom, max_norm], np.float32)


def adamw_clip_ref(hyper, sq):
    """float64 grad scale of the device-scalar path: clip by the global norm sqrt(sq) * inv_denom."""
    inv_denom, max_norm = float(hyper[3]), float(hyper[4])
    norm = math.sqrt(sq) * inv_denom
    clip = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
    return clip, clip * inv_denom


@pytest.mark.parametrize("clipping", ["active", "inactive", "off"])
@pytest.mark.parametrize("n", [1, 31, 33, 127, 4099])
def test_adamw_update_device_scalars(dev, n, clipping):
    """hyper/sq/flag replace lr, weight_decay, step and grad_scale (passed as garbage here): steps
    1..3 against a float64 AdamW with global-norm clipping, sq from ops.sumsq of the accumulated
    (loss-scaled, summed over micro-batches) grads."""
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.1
    loss_scale, n_micro = 1024.0, 3
    inv_denom = np.float32(1.0 / (loss_scale * n_micro))
    rng = np.random.default_rng(56)
    params = to_dev(dev, rng.standard_normal(n))
    m, v = dev.zeros((n,)), dev.zeros((n,))
    sq, flag = dev.zeros((1,)), dev.zeros((1,), "i32")
    for step in range(1, 4):
        g = rng.standard_normal(n) * (loss_scale * n_micro)
        g[::3] *= 1e-6
        grads = to_dev(dev, g)
        ops.sumsq(grads, sq)
        p0, m0, v0, g0, sq0 = read(params), read(m), read(v), read(grads), float(read(sq)[0])
        norm = math.sqrt(sq0) * float(inv_denom)
        max_norm = {"active": 0.3 * norm, "inactive": 10.0 * norm + 1.0, "off": 0.0}[clipping]
        hyper = adamw_hyper(lr, b1, b2, wd, step, inv_denom, max_norm)
        ops.adamw_update(params, grads, m, v, 123.0, beta1=b1, beta2=b2, eps=eps, weight_decay=7.0, step=1000,
                         grad_scale=99.0, hyper=to_dev(dev, hyper), sq=sq, flag=flag if step % 2 else None)
        clip, gs = adamw_clip_ref(hyper, sq0)
        assert (clip < 0.5) if clipping == "active" else (clip == 1.0), f"clip {clip} for {clipping}"
        f32 = lambda x: float(np.float32(x))
        step_size, bc2_sqrt, decay = (float(h) for h in hyper[:3])
        rp = p0 - decay * p0
        gsc = g0 * gs
        rm = f32(b1) * m0 + (1 - f32(b1)) * gsc
        rv = f32(b2) * v0 + (1 - f32(b2)) * gsc * gsc
        denom = np.sqrt(rv) / bc2_sqrt + f32(eps)
        rp = rp - step_size * rm / denom
        # the f32 grad scale (norm, clip, product: a few roundings) adds ~8 ulp to each term of m
        # and twice that to v; the rest as test_adamw_update
        m_mag = np.abs(f32(b1) * m0) + np.abs((1 - f32(b1)) * gsc)
        assert_close_elementwise(read(m), rm, rtol=0.0, atol=24 * U32 * m_mag + SUBNORMAL["f32"], what=f"m step {step}")
        assert_close_elementwise(read(v), rv, rtol=40 * U32, atol=SUBNORMAL["f32"], what=f"v step {step}")
        upd_mag = step_size * (m_mag + np.abs(rm)) / denom
        assert_close_elementwise(read(params), rp, rtol=0.0, atol=4 * U32 * np.abs(p0) + 48 * U32 * upd_mag
                                 + SUBNORMAL["f32"], what=f"params step {step}")
        np.testing.assert_array_equal(read(grads), g0, err_msg="grads modified")


@pytest.mark.parametrize("max_norm", [0.0, 1e30], ids=["off", "inactive"])
@pytest.mark.parametrize("n", [1, 33, 4099])
def test_adamw_update_device_scalars_equal_scalar_path(dev, n, max_norm):
    """Without clipping, the device-scalar path is the scalar path with grad_scale = inv_denom, bit
    for bit: params, m, v and the f16 working copy over three steps."""
    lr, b1, b2, eps, wd = 3e-3, 0.9, 0.999, 1e-8, 0.05
    inv_denom = np.float32(1.0 / 96.0)
    rng = np.random.default_rng(57)
    p_init = rng.standard_normal(n)
    pa, pb = to_dev(dev, p_init), to_dev(dev, p_init)
    ma, mb, va, vb = dev.zeros((n,)), dev.zeros((n,)), dev.zeros((n,)), dev.zeros((n,))
    wa, wb = empty_filled(dev, (n,), "f16"), empty_filled(dev, (n,), "f16")
    sq, flag = dev.empty((1,)), dev.zeros((1,), "i32")
    for step in range(1, 4):
        grads = to_dev(dev, rng.standard_normal(n) * 96.0)
        ops.sumsq(grads, sq)
        ops.adamw_update(pa, grads, ma, va, lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step,
                         grad_scale=float(inv_denom), working=wa)
        hyper = to_dev(dev, adamw_hyper(lr, b1, b2, wd, step, inv_denom, max_norm))
        ops.adamw_update(pb, grads, mb, vb, 0.0, beta1=b1, beta2=b2, eps=eps, step=1, working=wb, hyper=hyper,
                         sq=sq, flag=flag)
        for name, a, b in (("params", pa, pb), ("m", ma, mb), ("v", va, vb), ("working", wa, wb)):
            check_bits(np.array(b.numpy(), copy=True), np.array(a.numpy(), copy=True), f"{name} step {step}")
    assert not np.array_equal(read(pa), p_init), "no update happened"


@pytest.mark.parametrize("why", ["flag", "sq_inf", "sq_nan", "sq_neg_inf"])
def test_adamw_update_device_scalars_skip(dev, why):
    """flag[0] != 0 or a non-finite sq[0]: nothing is written (params, m, v, working keep their
    bits); the same call with a clean flag and finite sq then does update."""
    n = 127
    rng = np.random.default_rng(58)
    params, grads = to_dev(dev, rng.standard_normal(n)), to_dev(dev, rng.standard_normal(n))
    m, v = to_dev(dev, rng.standard_normal(n) * 0.1), to_dev(dev, rng.uniform(0.1, 1.0, n))
    working = empty_filled(dev, (n,), "f32", 7.0)
    sq_val = {"flag": 4.0, "sq_inf": np.inf, "sq_nan": np.nan, "sq_neg_inf": -np.inf}[why]
    sq = to_dev(dev, np.array([sq_val], np.float32))
    flag = to_dev(dev, np.array([1 if why == "flag" else 0], np.int32), "i32")
    hyper = to_dev(dev, adamw_hyper(1e-2, 0.9, 0.999, 0.1, 2, np.float32(0.5), 1.0))
    before = [np.array(t.numpy(), copy=True) for t in (params, m, v, working)]
    ops.adamw_update(params, grads, m, v, 1e-2, working=working, hyper=hyper, sq=sq,
                     flag=flag if why in ("flag", "sq_nan") else None)
    for name, t, b in zip(("params", "m", "v", "working"), (params, m, v, working), before):
        check_bits(np.array(t.numpy(), copy=True), b, f"{name} after a skipped step ({why})")
    ops.adamw_update(params, grads, m, v, 1e-2, working=working, hyper=hyper,
                     sq=to_dev(dev, np.array([4.0], np.float32)), flag=dev.zeros((1,), "i32"))
    assert not np.array_equal(np.array(params.numpy(), copy=True), before[0]), "the clean step did not update"


def test_device_scalar_arguments_bad_calls(dev):
    """One-line errors naming the op and the argument: shape, dtype, device, and the pairing of
    adamw_update's hyper, sq and flag."""
    other = krnl.device("cpu:1" if dev.name == "cpu" else "cpu")
    x, tg, loss = dev.zeros((3, 5)), dev.zeros((3,), "i32"), dev.empty((3,))
    for bad, what in ((dev.zeros((2,)), "shape"), (dev.zeros((1,), "i32"), "f32"), (other.zeros((1,)), "is on")):
        with pytest.raises(ValueError, match=rf"^\[cross_entropy\] scale_by .*{what}"):
            ops.cross_entropy(x, tg, loss, x, scale_by=bad)
    y = dev.empty((3, 5))
    for bad, what in ((dev.zeros((1,), "i32"), "shape"), (dev.zeros((2,)), "i32"), (other.zeros((2,), "i32"), "is on")):
        with pytest.raises(ValueError, match=rf"^\[dropout\] seed_offset .*{what}"):
            ops.dropout(x, y, 0.5, 1, seed_offset=bad)
    p, g, m, v = (dev.zeros((4,)) for _ in range(4))
    h, sq, fl = dev.zeros((5,)), dev.zeros((1,)), dev.zeros((1,), "i32")
    cases = [(dict(hyper=dev.zeros((4,)), sq=sq), r"hyper .*shape"),
             (dict(hyper=dev.zeros((5,), "i32"), sq=sq), r"hyper .*f32"),
             (dict(hyper=h), r"sq is required"), (dict(hyper=h, sq=dev.zeros((2,))), r"sq .*shape"),
             (dict(hyper=h, sq=sq, flag=dev.zeros((1,))), r"flag .*i32"), (dict(sq=sq), r"sq is only read with hyper"),
             (dict(flag=fl), r"flag is only read with hyper"), (dict(hyper=other.zeros((5,)), sq=sq), r"hyper is on")]
    for kw, what in cases:
        with pytest.raises(ValueError, match=rf"^\[adamw_update\] {what}"):
            ops.adamw_update(p, g, m, v, 1e-3, **kw)


# --------------------------------------------------------------------------- sumsq, nonfinite


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [1, 31, 33, 127, 1_000_003])
def test_sumsq(dev, n, dt):
    """out[0] = sum(x^2), overwritten; values over many binades (f16 squares overflow f16, so
    the sum must be kept in f32 or wider)."""
    rng = np.random.default_rng(60)
    x, xf = upload(dev, rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 2.5, n), dt)
    out = to_dev(dev, np.array([123.0], np.float32))
    ops.sumsq(x, out)
    ref = float(np.sum(xf * xf))
    got = float(read(out)[0])
    # positive terms: the result's f32 rounding plus an f32 reduction's error relative to the sum
    assert abs(got - ref) <= (U32 + reduction_rtol(n)) * ref, f"sumsq {got!r} vs {ref!r}"
    ops.sumsq(x, out)  # overwrite, not accumulate
    assert abs(float(read(out)[0]) - ref) <= (U32 + reduction_rtol(n)) * ref


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_sumsq_view(dev, dt):
    """sumsq of a view by offset sums exactly its window (not the buffer's other elements)."""
    rng = np.random.default_rng(160)
    x, xf = upload(dev, rng.standard_normal(1000), dt)
    out = dev.empty((1,))
    ops.sumsq(x[100:133], out)
    ref = float(np.sum(xf[100:133] ** 2))
    assert abs(float(read(out)[0]) - ref) <= (U32 + reduction_rtol(33)) * ref


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [1, 31, 33, 127, 100_003])
def test_nonfinite(dev, n, dt):
    """flag[0] = 1 when x holds inf, -inf or NaN (at the last index, the first, or the middle);
    finite data (including the dtype's largest value) leaves 0 alone and never clears a 1."""
    rng = np.random.default_rng(61)
    base = rng.standard_normal(n).astype(np.float32)
    base[n // 2] = {"f32": 3.4028235e38, "f16": 65504.0, "bf16": 3.3895314e38}[dt]
    flag = dev.zeros((1,), "i32")
    ops.nonfinite(to_dev(dev, base, dt), flag)
    assert read(flag, np.int32)[0] == 0, "finite data raised the flag"
    for bad in (np.inf, -np.inf, np.nan):
        for pos in sorted({n - 1, 0, n // 2}):
            x = base.copy()
            x[pos] = bad
            flag = dev.zeros((1,), "i32")
            ops.nonfinite(to_dev(dev, x, dt), flag)
            assert read(flag, np.int32)[0] == 1, f"{bad} at {pos} of {n} not flagged"
            ops.nonfinite(to_dev(dev, base, dt), flag)
            assert read(flag, np.int32)[0] == 1, "flag cleared by finite data"


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_nonfinite_view(dev, dt):
    """Non-finite values just outside a view by offset are not the view's: no flag; inside: flag."""
    x0 = np.ones(129, np.float32)
    x0[0], x0[128] = np.inf, np.nan
    x = to_dev(dev, x0, dt)
    flag = dev.zeros((1,), "i32")
    ops.nonfinite(x[1:128], flag)
    assert read(flag, np.int32)[0] == 0
    ops.nonfinite(x[0:33], flag)
    assert read(flag, np.int32)[0] == 1


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_add_axpy_scale_views(dev, dt):
    """Elementwise ops on row-range views write their window only."""
    rng = np.random.default_rng(170)
    a, af = upload(dev, rng.standard_normal((8, 33)), dt)
    b, bf = upload(dev, rng.standard_normal((8, 33)), dt)
    out, of = upload(dev, rng.standard_normal((8, 33)), dt)
    ops.add(a[1:4], b[4:7], out[2:5])
    got = read(out)
    assert_close_elementwise(got[2:5], af[1:4] + bf[4:7], rtol=UNIT_ROUNDOFF[dt] + 2 * U32, atol=SUBNORMAL[dt])
    np.testing.assert_array_equal(got[[0, 1, 5, 6, 7]], of[[0, 1, 5, 6, 7]])
    ops.axpy(2.0, a[0:2], out[6:8])
    got = read(out)
    assert_close_elementwise(got[6:8], of[6:8] + 2 * af[0:2], rtol=UNIT_ROUNDOFF[dt],
                             atol=4 * U32 * (np.abs(of[6:8]) + 2 * np.abs(af[0:2])) + SUBNORMAL[dt])
    ops.scale(a[7:8], -0.5, out[0:1])
    got = read(out)
    np.testing.assert_array_equal(got[0], -0.5 * af[7])  # halving is exact (no underflow here)
    np.testing.assert_array_equal(got[1], of[1])


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16", "i32"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (31, 4, 33), (33, 2, 127), (127, 8, 64)])
def test_transpose_heads(dev, dt, shape):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape).astype(np.float32)
    if dt == "i32":
        x = (x * 1000).astype(np.int32)
    t = to_dev(dev, x, dt)
    out = dev.empty((shape[1], shape[0], shape[2]), dt)
    ops.transpose_heads(t, out)
    ref = np.swapaxes(t.numpy(), 0, 1)
    np.testing.assert_array_equal(out.numpy(), ref)  # a pure move: bit-exact
    back = dev.empty(shape, dt)
    ops.transpose_heads(out, back)
    np.testing.assert_array_equal(back.numpy(), t.numpy())


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-row"])
def test_rope_token_major(dev, dt, shared):
    """rope over token-major views (q and k's columns of one projection, B = 2 sequences of 33):
    every row (b, t, h) against the float64 oracle at its own position, positions (T,) shared by
    the rows or (B, T); v's columns and the rows' tails past 2R untouched bit for bit."""
    B, T, H, Hk, D, rot = 2, 33, 3, 1, 40, 32
    (qk, v), buf, xf = token_major_views(dev, B, T, (H + Hk, Hk), D, dt, seed=21)
    pos = positions_of("offset", T) if shared else np.stack([positions_of("packed", T), positions_of("offset", T)])
    inv_freq = hf_inv_freq(rot)
    if not dev.capabilities()["fused_attention"]["token_major"]:
        with pytest.raises(NotImplementedError, match=r"^\[rope\] .* takes no token-major"):
            ops.rope(qk, to_dev(dev, pos, "i32"), to_dev(dev, inv_freq, "f32"), token_major=True)
        return
    ops.rope(qk, to_dev(dev, pos, "i32"), to_dev(dev, inv_freq, "f32"), token_major=True)
    got, x4 = read(buf).reshape(B, T, H + 2 * Hk, D), xf.reshape(B, T, H + 2 * Hk, D)
    for b in range(B):
        p = pos if shared else pos[b]
        heads = x4[b, :, :H + Hk].transpose(1, 0, 2)                           # (H + Hk, T, D)
        ref = rope_ref(heads, p, inv_freq)
        assert_close(got[b, :, :H + Hk].transpose(1, 0, 2), ref, rtol=0.0,
                     atol=rope_bound(dt, heads, ref, p, inv_freq), what=f"row {b}")
    np.testing.assert_array_equal(got[:, :, H + Hk:], x4[:, :, H + Hk:])
    np.testing.assert_array_equal(got[..., 2 * (rot // 2):], x4[..., 2 * (rot // 2):])


TH_ROPE_CASES = [  # (T, heads, D, rotary dims, heads turned)
    (1, 1, 2, 2, 1),
    (31, 5, 64, 64, 4),       # q and k heads turned, v's copied
    (33, 3, 128, 128, 3),
    (127, 6, 32, 32, 2),
    (33, 4, 33, 16, 3),       # partial rotary, odd D: the scalar path and a copied tail
]


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("heads_axis", [1, 0])
@pytest.mark.parametrize("T,NH,D,rot,turn", TH_ROPE_CASES)
def test_transpose_heads_rope(dev, T, NH, D, rot, turn, heads_axis, dt):
    """transpose_heads with RoPE on the way: the transposed rows of heads h < rotate match the
    float64 oracle of rope (sign +1 token-major in, -1 head-major in, as the layer calls it), the
    other heads move bit for bit, and the result equals a plain transpose and ops.rope."""
    rng = np.random.default_rng(19)
    sign = 1.0 if heads_axis == 1 else -1.0
    pos = positions_of("offset", T)
    inv_freq = hf_inv_freq(rot)
    pos_t, inv_t = to_dev(dev, pos, "i32"), to_dev(dev, inv_freq, "f32")
    shape = (T, NH, D) if heads_axis == 1 else (NH, T, D)
    x, xf = upload(dev, rng.standard_normal(shape), dt)
    out = dev.empty((shape[1], shape[0], D), dt)
    ops.transpose_heads(x, out, pos_t, inv_t, turn, sign, heads_axis)
    got = read(out)
    heads = xf.transpose(1, 0, 2) if heads_axis == 1 else xf                    # (NH, T, D)
    ref = rope_ref(heads[:turn], pos, inv_freq, sign)
    got_heads = got if heads_axis == 1 else got.transpose(1, 0, 2)              # (NH, T, D)
    assert_close(got_heads[:turn], ref, rtol=0.0, atol=rope_bound(dt, heads[:turn], ref, pos, inv_freq),
                 what="turned heads")
    np.testing.assert_array_equal(got_heads[turn:], heads[turn:])
    # The unfused pair the layer used before: rope after (forward) or before (backward) the move.
    plain = dev.empty(out.shape, dt)
    if heads_axis == 1:
        ops.transpose_heads(x, plain)
        ops.rope(plain[:turn], pos_t, inv_t, sign)
    else:
        y, _ = upload(dev, xf, dt)
        ops.rope(y[:turn], pos_t, inv_t, sign)
        ops.transpose_heads(y, plain)
    one_ulp = UNIT_ROUNDOFF[dt] * 2 * float(np.max(np.abs(got)))
    assert_close(got, read(plain), rtol=0.0, atol=one_ulp, what="fused vs transpose + rope")


def test_transpose_heads_rope_rejects_bad_calls(dev):
    x, out = dev.empty((4, 3, 8)), dev.empty((3, 4, 8))
    pos, inv = to_dev(dev, np.arange(4, dtype=np.int32), "i32"), to_dev(dev, hf_inv_freq(8), "f32")
    with pytest.raises(ValueError, match=r"^\[transpose_heads\] positions and inv_freq come together"):
        ops.transpose_heads(x, out, pos, None, 2)
    with pytest.raises(ValueError, match=r"^\[transpose_heads\] rotate=2 needs positions and inv_freq"):
        ops.transpose_heads(x, out, rotate=2)
    with pytest.raises(ValueError, match=r"^\[transpose_heads\] rotate must be in \[0, 3\]"):
        ops.transpose_heads(x, out, pos, inv, 4)
    with pytest.raises(ValueError, match=r"^\[transpose_heads\] positions must have shape \(3,\)"):
        ops.transpose_heads(x, out, pos, inv, 2, -1.0, 0)  # x (H, T, D): positions index its axis 1
    with pytest.raises(ValueError, match=r"^\[transpose_heads\] heads_axis must be 0 or 1"):
        ops.transpose_heads(x, out, pos, inv, 2, 1.0, 2)
    with pytest.raises(ValueError, match=r"^\[transpose_heads\] sign must be"):
        ops.transpose_heads(x, out, pos, inv, 2, 0.5)


def test_transpose_heads_rejects_bad_calls(dev):
    x = dev.empty((4, 3, 8))
    with pytest.raises(ValueError, match=r"^\[transpose_heads\] out must have shape \(3, 4, 8\)"):
        ops.transpose_heads(x, dev.empty((4, 3, 8)))
    with pytest.raises(ValueError, match=r"^\[transpose_heads\] x must be 3-D"):
        ops.transpose_heads(dev.empty((12, 8)), dev.empty((8, 12)))
    with pytest.raises(ValueError, match=r"^\[transpose_heads\] out must not share memory"):
        ops.transpose_heads(x, x.reshape(3, 4, 8))
