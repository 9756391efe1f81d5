"""metal/rmsnorm.metal's row-strided forms on the MSL simulator (tools/mslsim) against float64
numpy: the forward writing y into the first cols columns of a wider (rows, ldy) buffer and the
backward writing dx at row stride ldx with the residual (row stride ldr) added, what a LoRA fold
asks for (python/krnl/models/lora_fold.py). Every dtype combination the kernels have (bf16 buffers as
uint16 bits), awkward sizes, random thread order; the columns past cols must keep their contents."""

import numpy as np
import pytest

from conftest import bf16_bits, bf16_value
from test_metal_kernels import KARGS, METAL, build_all

RmsnormArgs, RmsnormBackwardArgs = KARGS["RmsnormArgs"], KARGS["RmsnormBackwardArgs"]

rng = np.random.default_rng(5150)

# kernel suffix: (x, w, y) dtypes of the forward, (x, w, dy = dx = residual) of the backward
FORWARD = {"f32": ("f32", "f32", "f32"), "f16": ("f16", "f16", "f16"), "f16_wf32": ("f16", "f32", "f16"),
           "bf16": ("bf16", "bf16", "bf16"), "bf16_wf32": ("bf16", "f32", "bf16"),
           "bf16_wf32_yf32": ("bf16", "f32", "f32")}
BACKWARD = {"f32": ("f32", "f32", "f32"), "f16": ("f16", "f16", "f16"), "f16_wf32": ("f16", "f32", "f16"),
            "bf16": ("bf16", "bf16", "bf16"), "bf16_wf32": ("bf16", "f32", "bf16"),
            "bf16_wf32_dyf32": ("bf16", "f32", "f32")}
# Output rounding, with slack for the float arithmetic before it: f32 a few float roundings of
# O(1) values; f16 2^-11 and bf16 2^-8 relative, once (twice with the residual added).
TOL = {"f32": 1e-5, "f16": 2e-3, "bf16": 1e-2}
# (rows, cols, extra columns): the awkward sizes; cols 128 with a row stride that is a multiple
# of 4 (vector loads and stores) and one that is not (scalar)
SHAPES = [(r, c, e) for i, (r, c) in enumerate((r, c) for r in (1, 31, 33) for c in (31, 33, 127))
          for e in [(1, 5, 16)[i % 3]]] + [(33, 128, 4), (31, 128, 1)]


@pytest.fixture(scope="module")
def lib():
    return build_all({"rmsnorm": dict(source=METAL / "rmsnorm.metal")})["rmsnorm"]


def to_kernel(a, dt):
    """float values -> the array the kernel reads (bf16 as its bits), and the float64 values it holds."""
    a = np.asarray(a, np.float32)
    k = bf16_bits(a) if dt == "bf16" else a.astype({"f32": np.float32, "f16": np.float16}[dt])
    return k, values(k, dt)


def values(k, dt):
    return (bf16_value(k) if dt == "bf16" else k).astype(np.float64)


def wide_buffer(rows, ld, dt, fill):
    """(rows, ld) of dt holding `fill` everywhere: the columns past cols must keep it."""
    return to_kernel(np.full((rows, ld), fill, np.float32), dt)[0]


def round_to(a, dt):
    """float32 values rounded to dt, to nearest even, as dt's kernel array."""
    a = np.asarray(a, np.float32)
    return bf16_bits(a) if dt == "bf16" else a.astype({"f32": np.float32, "f16": np.float16}[dt])


def rstd_of(x, eps):
    return 1 / np.sqrt((x ** 2).mean(1) + eps)


@pytest.mark.parametrize("rows,cols,extra", SHAPES)
@pytest.mark.parametrize("kern", FORWARD)
def test_rmsnorm_forward_strided(lib, kern, rows, cols, extra):
    xd, wd, yd = FORWARD[kern]
    eps, ldy = 1e-5, cols + extra
    x, xf = to_kernel(rng.standard_normal((rows, cols)), xd)
    w, wf = to_kernel(1 + 0.5 * rng.standard_normal(cols), wd)
    y = wide_buffer(rows, ldy, yd, 7.0)
    rstd = np.full(rows, np.nan, np.float32)
    vec4 = int(cols % 4 == 0 and ldy % 4 == 0)
    lib.dispatch(f"rmsnorm_forward_{kern}", grid=(rows + 1, 1, 1), threads=(32 if cols < 64 else 64, 1, 1),
                 buffers=[x, w, y, rstd, RmsnormArgs(rows, cols, eps, ldy, vec4)], random_order=True, seed=rows)
    r = rstd_of(xf, eps)
    np.testing.assert_allclose(rstd, r, rtol=2e-6)
    got = values(y, yd)
    np.testing.assert_allclose(got[:, :cols], xf * r[:, None] * wf, rtol=TOL[yd], atol=TOL[yd])
    assert np.all(got[:, cols:] == 7.0), "a column past cols was written"


def backward_ref(dyf, xf, wf, r):
    g = dyf * wf
    xhat = xf * r[:, None]
    return r[:, None] * (g - xhat * (g * xhat).mean(1, keepdims=True))


def run_backward(lib, kern, dy, x, w, rstd, dx, ldx, res=None, ldr=0):
    rows, cols = x.shape
    args = RmsnormBackwardArgs(rows, cols, ldx, ldr, int(res is not None))
    lib.dispatch(f"rmsnorm_backward_{kern}", grid=(rows + 1, 1, 1), threads=(32 if cols < 64 else 64, 1, 1),
                 buffers=[dy, x, w, rstd, dx, args, dy if res is None else res], random_order=True, seed=cols)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("rows,cols,extra", SHAPES)
@pytest.mark.parametrize("kern", BACKWARD)
def test_rmsnorm_backward_strided(lib, kern, rows, cols, extra, residual):
    """dx at row stride cols + extra, the residual (NaN past its cols columns, so a read there
    shows) at another stride: against float64, and with the residual bit for bit what the
    contiguous kernel's dx leaves after the float add an axpy makes."""
    xd, wd, gd = BACKWARD[kern]
    eps, ldx, ldr = 1e-5, cols + extra, cols + 2 * extra + 1
    x, xf = to_kernel(rng.standard_normal((rows, cols)), xd)
    w, wf = to_kernel(1 + 0.5 * rng.standard_normal(cols), wd)
    dy, dyf = to_kernel(rng.standard_normal((rows, cols)), gd)
    rstd = rstd_of(xf, eps).astype(np.float32)
    ref = backward_ref(dyf, xf, wf, rstd.astype(np.float64))
    dx = wide_buffer(rows, ldx, gd, 7.0)
    res = None
    if residual:
        res = wide_buffer(rows, ldr, gd, np.nan)
        res[:, :cols], resf = to_kernel(rng.standard_normal((rows, cols)), gd)
        ref = ref + resf
    res_before = None if res is None else res.copy()
    run_backward(lib, kern, dy, x, w, rstd, dx, ldx, res, ldr)
    got = values(dx, gd)
    tol = TOL[gd] * (2 if residual else 1)
    np.testing.assert_allclose(got[:, :cols], ref, rtol=tol, atol=tol)
    assert np.all(got[:, cols:] == 7.0), "a column past cols was written"
    if residual:
        np.testing.assert_array_equal(res, res_before)
        plain = wide_buffer(rows, cols, gd, np.nan)
        run_backward(lib, kern, dy, x, w, rstd, plain, cols)
        want = round_to(values(plain, gd).astype(np.float32) + values(res[:, :cols], gd).astype(np.float32), gd)
        np.testing.assert_array_equal(dx[:, :cols], want)


@pytest.mark.parametrize("kern", ["f32", "f16"])
def test_rmsnorm_backward_residual_in_place(lib, kern):
    """dx aliasing the residual (both at one row stride): dx = the norm's gradient + the old dx."""
    rows, cols, ld = 5, 33, 40
    xd, wd, gd = BACKWARD[kern]
    x, xf = to_kernel(rng.standard_normal((rows, cols)), xd)
    w, _ = to_kernel(1 + 0.5 * rng.standard_normal(cols), wd)
    dy, _ = to_kernel(rng.standard_normal((rows, cols)), gd)
    rstd = rstd_of(xf, 1e-5).astype(np.float32)
    buf = wide_buffer(rows, ld, gd, 3.0)
    buf[:, :cols] = to_kernel(rng.standard_normal((rows, cols)), gd)[0]
    want = buf.copy()
    run_backward(lib, kern, dy, x, w, rstd, want, ld, buf.copy(), ld)
    args = RmsnormBackwardArgs(rows, cols, ld, ld, 1)
    lib.dispatch(f"rmsnorm_backward_{kern}", grid=(rows, 1, 1), threads=(32, 1, 1),
                 buffers=[dy, x, w, rstd, buf, args, buf], guard=False, random_order=True, seed=9)
    np.testing.assert_array_equal(buf, want)
