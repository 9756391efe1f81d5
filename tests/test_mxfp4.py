"""MXFP4 weights (krnl.quant.mxfp4; ops.quantized_matmul and ops.moe_quantized_matmul with
mode="mxfp4"): the host quantizer against mx.quantize (bit-identical codes and scales), the E8M0
and E2M1 conversions, and both products against float64 products with the dequantized weights at
awkward sizes, forward (x W^T) and input gradient (x W), beta 0 and 1, on every device (metal-sim
too: conftest's SIM_MODULES)."""

import numpy as np
import pytest

import krnl
from krnl import ops
from krnl.quant import affine, mxfp4
from krnl.quant.qweight import QuantizedArray, QuantizedWeight, expert_matmul, frozen_weight, linear, linear_grad

import conftest
from conftest import FLOAT_DTYPES, U32, UNIT_ROUNDOFF, assert_close_elementwise, empty_filled, read, to_dev, upload
from test_moe_ops import gemm_rows


def test_e2m1_and_e8m0_values():
    """E2M1: bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6; E8M0 byte e is 2^(e - 127)
    exactly (0: f32's subnormal 2^-127), 255 NaN; codes pack as affine 4-bit ones, low nibble first."""
    mags = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert mxfp4.E2M1.tolist() == mags + [-m for m in mags]
    assert np.signbit(mxfp4.E2M1[8:]).all() and not np.signbit(mxfp4.E2M1[:8]).any()
    s = mxfp4.e8m0_to_float(np.array([0, 1, 126, 127, 128, 254, 255], np.uint8))
    assert s.dtype == np.float32 and np.isnan(s[-1])
    assert [float(v) for v in s[:-1]] == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    codes = np.zeros((1, 32), np.int64)
    codes[0, :3] = [0x9, 0x7, 0xF]
    w = affine.pack(codes, 4)
    assert w.view(np.uint32)[0, 0] == 0xF79
    np.testing.assert_array_equal(mxfp4.dequantize(w, np.array([[128]], np.uint8))[0, :3], [-1.0, 12.0, -12.0])


def test_quantize_picks_the_nearest_value_and_the_least_scale():
    """Each weight comes back as the E2M1 value times its group's scale nearest to it (ties to the
    smaller magnitude), the scale the least power of two with amax <= 6 scale; an all-zero group
    gets 2^0; zero and negative values below the first midpoint keep code 0 (never -0)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((5, 96)) * np.exp2(rng.integers(-30, 30, (5, 1)))).astype(np.float32)
    w[1, 32:64] = 0
    w[2, :32] = np.float32([6, -5, 5, 3.5, -2.5, 0.75, -0.25, 1.75] * 4)  # ties at scale 1
    q, e = mxfp4.quantize(w)
    assert q.shape == (5, 12) and q.dtype == np.int32 and e.shape == (5, 3) and e.dtype == np.uint8
    s = mxfp4.e8m0_to_float(e).astype(np.float64)
    g = np.abs(w.astype(np.float64)).reshape(5, 3, 32).max(axis=2)
    assert np.all((g <= 6 * s) & ((g > 3 * s) | (g == 0))) and e[1, 1] == 127
    back = mxfp4.dequantize(q, e).astype(np.float64)
    grid = np.repeat(s, 32, axis=1)[..., None] * mxfp4.E2M1[:8]
    nearest = np.abs(np.abs(w)[..., None] - grid).min(axis=-1)
    np.testing.assert_array_equal(np.abs(back - w), nearest)
    assert back[2, :8].tolist() == [6, -4, 4, 3, -2, 0.5, 0, 1.5]
    assert (affine.unpack(q, 4)[2, :8] != 8).all()


@pytest.mark.mlx
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_quantize_matches_mlx(dtype):
    """Codes and E8M0 scales bit-identical to mx.quantize(mode="mxfp4") on random weights of many
    magnitudes (f16's kept inside its normal range: mx.quantize divides in w's dtype), ties and
    all-zero groups; mx.dequantize agrees with mxfp4.dequantize."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(3)
    span = 8 if dtype == "float16" else 100
    for t in range(20):
        w = (rng.standard_normal((7, 160)) * np.exp2(rng.integers(-span, span, (7, 1)))).astype(np.float32)
        w[:, :32] = np.round(w[:, :32] * 4) / 4 if t % 2 else w[:, :32]
        w[1, 32:64] = 0
        w[2] = rng.choice(mxfp4.E2M1, 160) * np.float32(2.0 ** rng.integers(-8, 8))
        wm = mx.array(w).astype(getattr(mx, dtype))
        q, s = mx.quantize(wm, group_size=32, bits=4, mode="mxfp4")
        pq, ps = mxfp4.quantize(np.array(wm.astype(mx.float32)))
        assert np.array_equal(np.array(q).view(np.int32), pq) and np.array_equal(np.array(s), ps), t
        back = mx.dequantize(q, s, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
        assert np.array_equal(np.array(back), mxfp4.dequantize(pq, ps)), t


# ------------------------------------------------------------------------------------ the products


def mxfp4_inputs(dev, shape, sdt, seed, exps=(118, 136)):
    """(w, scales) on dev and W float64 (shape (..., O, I)) as the device sees it: random codes,
    E8M0 bytes in [exps) held as floats in sdt (exact in f32 and bf16)."""
    rng = np.random.default_rng(seed)
    *lead, O, I = shape
    codes = rng.integers(0, 16, (*lead, O, I))
    e = rng.integers(*exps, (*lead, O, I // 32)).astype(np.uint8)
    s, s64 = upload(dev, mxfp4.e8m0_to_float(e), sdt)
    assert np.array_equal(s64, mxfp4.e8m0_to_float(e))  # no scale rounded
    W = np.repeat(s64, 32, axis=-1) * mxfp4.E2M1[codes]
    packed = np.stack([affine.pack(c, 4) for c in codes.reshape(-1, O, I)]).reshape(*lead, O, I // 8)
    return to_dev(dev, packed, "i32"), s, W


def scale_dtypes(dt):
    """The scales' dtypes mode mxfp4 takes with x in dt: f32 always, bf16 with bf16 x."""
    return ("f32", "bf16") if dt == "bf16" else ("f32",)


# (N, O, I): 1, 31, 33 and 127 rows (Metal's 32-row tiles; 8 and 9 its few-row form's last and the
# tiled form's first), O odd, I a multiple of 32 but not of 64 or 128; 17 rows: CUDA's cuBLAS path
QCASES = [(1, 1, 32), (31, 33, 96), (33, 17, 160), (127, 45, 96), (8, 9, 160), (9, 3, 32), (17, 31, 64)]


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("transpose", [True, False], ids=["xWt", "xW"])
@pytest.mark.parametrize("N,O,I", QCASES, ids=[f"{n}x{o}x{i}" for n, o, i in QCASES])
def test_quantized_matmul_mxfp4(dev, N, O, I, transpose, dt):
    """out = x W^T or x W with W = scale e2m1(code), against float64 from the same rounded inputs;
    beta 0 never reads out (NaN there), beta 1 adds it. Every weight s e2m1(q) is exact in dt, so
    the bound is quantized_matmul's f32 sum plus out's one rounding."""
    for sdt in scale_dtypes(dt):
        w, s, W = mxfp4_inputs(dev, (O, I), sdt, seed=N * O + I)
        K, M = (I, O) if transpose else (O, I)
        x, xf = upload(dev, np.random.default_rng(O).standard_normal((N, K)), dt)
        Wop = W.T if transpose else W
        ref, mag = xf @ Wop, np.abs(xf) @ np.abs(Wop)
        tol = (K + 4) * U32 * mag
        out = empty_filled(dev, (N, M), dt)
        ops.quantized_matmul(x, w, s, None, out, transpose, 32, 4, 0.0, "mxfp4")
        got = read(out)
        assert_close_elementwise(got, ref, UNIT_ROUNDOFF[dt], tol, what=f"out, scales {sdt}")
        ops.quantized_matmul(x, w, s, None, out, transpose, 32, 4, beta=1.0, mode="mxfp4")
        assert_close_elementwise(read(out), ref + got, 2 * UNIT_ROUNDOFF[dt], 2 * tol, what=f"beta 1, scales {sdt}")


@pytest.mark.parametrize("N", [20, 3])
def test_quantized_matmul_mxfp4_column_blocks(dev, N):
    """x and out may be row-strided column blocks of wider matrices (3 rows: Metal's few-row form);
    only the block is read and written."""
    O, I = 24, 64
    w, s, W = mxfp4_inputs(dev, (O, I), "f32", seed=N)
    rng = np.random.default_rng(5)
    wide_x = rng.standard_normal((N, 100)).astype(np.float32)
    wide_out = rng.standard_normal((N, 90)).astype(np.float32)
    xd, od = dev.tensor(wide_x, "f32"), dev.tensor(wide_out, "f32")
    ops.quantized_matmul(xd[:, 7:7 + I], w, s, None, od[:, 30:30 + O], True, 32, 4, mode="mxfp4")   # x W^T
    want, mag = wide_out.astype(np.float64), np.zeros(wide_out.shape)
    want[:, 30:30 + O] = wide_x[:, 7:7 + I].astype(np.float64) @ W.T
    mag[:, 30:30 + O] = (I + 4) * U32 * (np.abs(wide_x[:, 7:7 + I]) @ np.abs(W.T))
    got = read(od)
    assert_close_elementwise(got, want, U32, mag, what="x W^T")  # and untouched outside the block
    ops.quantized_matmul(od[:, 30:30 + O], w, s, None, xd[:, 7:7 + I], False, 32, 4, 1.0, "mxfp4")  # + out W
    want_x, mag_x = wide_x.astype(np.float64), np.zeros(wide_x.shape)
    want_x[:, 7:7 + I] += got[:, 30:30 + O] @ W
    mag_x[:, 7:7 + I] = (O + 4) * U32 * (np.abs(wide_x[:, 7:7 + I]) + np.abs(got[:, 30:30 + O]) @ np.abs(W))
    assert_close_elementwise(read(xd), want_x, U32, mag_x, what="x + out W")


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_quantized_matmul_mxfp4_wide_scales(dev, dt):
    """Scales across E8M0's range, 2^-100 .. 2^100 (bf16 x holds every weight as f32 does; f16's
    range is far narrower), both products."""
    for sdt in scale_dtypes(dt):
        w, s, W = mxfp4_inputs(dev, (5, 64), sdt, seed=7, exps=(27, 228))
        for transpose in (True, False):
            x, x64 = upload(dev, np.random.default_rng(8).standard_normal((3, 64 if transpose else 5)), dt)
            Wop = W.T if transpose else W
            out = dev.empty((3, Wop.shape[1]), dt)
            ops.quantized_matmul(x, w, s, None, out, transpose, 32, 4, mode="mxfp4")
            mag = np.abs(x64) @ np.abs(Wop)
            assert_close_elementwise(read(out), x64 @ Wop, UNIT_ROUNDOFF[dt], (len(Wop) + 4) * U32 * mag,
                                     what=f"transpose {transpose}, scales {sdt}")


def test_quantized_matmul_mxfp4_errors(dev):
    """mxfp4 takes bits 4, group_size 32, no biases and f32 (or x's bf16) scales; affine still needs
    biases; an unknown mode is refused; each in one line naming the op."""
    x, w, s = dev.zeros((2, 64)), dev.zeros((3, 8), "i32"), dev.zeros((3, 2))
    out = dev.empty((2, 3))
    q = lambda *a, **k: ops.quantized_matmul(x, w, *a, **k)
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] biases must be None in mode mxfp4"):
        q(s, s, out, True, 32, 4, mode="mxfp4")
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] mode mxfp4 takes bits 4 and group_size 32, got bits "
                                         r"4, group_size 64"):
        q(dev.zeros((3, 1)), None, out, True, 64, 4, mode="mxfp4")
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] scales must be f32 or bf16 in mode mxfp4 \(f16 "):
        ops.quantized_matmul(dev.zeros((2, 64), "f16"), w, dev.zeros((3, 2), "f16"), None, dev.empty((2, 3), "f16"),
                             mode="mxfp4", group_size=32)
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] scales must be f16 \(x's dtype\) or f32, got"):
        ops.quantized_matmul(dev.zeros((2, 64), "f16"), w, dev.zeros((3, 2), "bf16"), None, dev.empty((2, 3), "f16"),
                             mode="mxfp4", group_size=32)
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] biases are required in mode affine"):
        q(s, None, out, True, 32, 4)
    with pytest.raises(ValueError, match=r'\[quantized_matmul\] mode must be "affine" or "mxfp4", got "nf4"'):
        q(s, None, out, True, 32, 4, mode="nf4")
    offsets = to_dev(dev, np.array([0, 2], np.int32), "i32")
    with pytest.raises(ValueError, match=r"\[moe_quantized_matmul\] biases must be None in mode mxfp4"):
        ops.moe_quantized_matmul(x, dev.zeros((1, 3, 8), "i32"), dev.zeros((1, 3, 2)), dev.zeros((1, 3, 2)), offsets,
                                 out, group_size=32, mode="mxfp4")


# (N tokens, K experts each, routing) over E = 3 experts: one token, every token on one expert
# (the other two empty), each token on every expert, a spread
MOE_CASES = [(1, 1, "spread"), (33, 1, "one"), (31, 3, "spread"), (127, 2, "spread")]


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("transpose", [True, False], ids=["linear", "input-grad"])
@pytest.mark.parametrize("N,K,kind", MOE_CASES, ids=[f"{n}top{k}-{kd}" for n, k, kd in MOE_CASES])
def test_moe_quantized_matmul_mxfp4(dev, N, K, kind, transpose, dt):
    """Each expert's rows times its W_e = scale e2m1(code), beta 0 (out NaN, never read) then 1,
    against float64 per expert: quantized_matmul's bound."""
    E, O, I = 3, 33, 96
    offsets, off, P = gemm_rows(dev, N, E, K, kind, N + K)
    for sdt in scale_dtypes(dt):
        w, s, W = mxfp4_inputs(dev, (E, O, I), sdt, seed=N * K)
        x, x64 = upload(dev, np.random.default_rng(N).standard_normal((P, I if transpose else O)), dt)
        out = empty_filled(dev, (P, O if transpose else I), dt)
        ops.moe_quantized_matmul(x, w, s, None, offsets, out, transpose, 32, 4, mode="mxfp4")
        ref, mag = np.zeros(out.shape), np.zeros(out.shape)
        for e in range(E):
            r, We = slice(off[e], off[e + 1]), W[e].T if transpose else W[e]
            ref[r], mag[r] = x64[r] @ We, np.abs(x64[r]) @ np.abs(We)
        tol = ((I if transpose else O) + 4) * U32 * mag
        got = read(out)
        assert_close_elementwise(got, ref, UNIT_ROUNDOFF[dt], tol, what=f"out, scales {sdt}")
        ops.moe_quantized_matmul(x, w, s, None, offsets, out, transpose, 32, 4, 1.0, "mxfp4")
        assert_close_elementwise(read(out), ref + got, 2 * UNIT_ROUNDOFF[dt], 2 * tol, what=f"beta 1, {sdt}")


def test_mxfp4_kernels_on_metal():
    """On Metal, mode mxfp4 takes the affine products' forms under _mxfp4 names: few-row (x W^T,
    at most 8 rows), tiled, and the experts' tiled; f32 scales with 16-bit x the _sf32 ones."""
    if conftest.METAL_SIM is None:
        pytest.skip("metal-sim is not registered")
    sim = krnl.device("metal-sim")
    w, s, _ = mxfp4_inputs(sim, (40, 64), "f32", seed=0)
    for N, transpose, form in ((8, True, "tv"), (9, True, "t"), (3, False, "n")):
        x = to_dev(sim, np.ones((N, 64 if transpose else 40)), "f16")
        with sim.step():
            ops.quantized_matmul(x, w, s, None, sim.empty((N, 40 if transpose else 64), "f16"), transpose, 32, 4,
                                 mode="mxfp4")
        (rec,) = krnl._core.testing.metal_sim_last_step()
        assert rec["kernel"] == f"quantized_matmul_{form}_f16_sf32_mxfp4", rec["kernel"]
    w, s, _ = mxfp4_inputs(sim, (2, 40, 64), "f32", seed=1)
    offsets = to_dev(sim, np.array([0, 3, 5], np.int32), "i32")
    with sim.step():
        ops.moe_quantized_matmul(to_dev(sim, np.ones((5, 64)), "f32"), w, s, None, offsets, sim.empty((5, 40)),
                                 True, 32, 4, mode="mxfp4")
    assert [r["kernel"] for r in krnl._core.testing.metal_sim_last_step()] == ["moe_quantized_matmul_t_f32_mxfp4"]


# ------------------------------------------------------------------- QuantizedWeight and friends


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_frozen_weights_in_mxfp4(dev, dtype):
    """quantize=(4, 32, "mxfp4") quantizes on load as mxfp4.quantize does (scales in the compute
    dtype, f32 for f16); a QuantizedArray of E8M0 bytes uploads as the same weight; linear,
    linear_grad and expert_matmul equal float64 products with the dequantized weights."""
    if dtype not in dev.capabilities()["dtypes"]:
        pytest.skip(f"{dtype} not listed by {dev.name}")
    rng = np.random.default_rng(2)
    Wf = rng.standard_normal((2, 33, 64)).astype(np.float32)
    Q = frozen_weight(dev, [Wf[0]], dtype, (4, 32, "mxfp4"))
    assert isinstance(Q, QuantizedWeight) and Q.mode == "mxfp4" and Q.biases is None
    assert Q.scales.dtype == ("f32" if dtype == "f16" else dtype) and Q.shape == (33, 64)
    q, e = mxfp4.quantize(Wf[0])
    np.testing.assert_array_equal(Q.w.numpy(), q)
    W = Q.numpy().astype(np.float64)
    np.testing.assert_array_equal(W, mxfp4.dequantize(q, e))
    A = frozen_weight(dev, [QuantizedArray(q, e, None, 4, 32, "bf16", "mxfp4")], dtype)
    assert A.mode == "mxfp4" and np.array_equal(A.numpy(), W) and Q[0:5].numpy().shape == (5, 64)
    x, x64 = upload(dev, rng.standard_normal((5, 64)), dtype)
    y = dev.empty((5, 33), dtype)
    linear(x, A, y)
    tol = lambda a, b: (len(b) + 4) * U32 * (np.abs(a) @ np.abs(b))
    assert_close_elementwise(read(y), x64 @ W.T, UNIT_ROUNDOFF[dtype], tol(x64, W.T), what="linear")
    dy, dy64 = upload(dev, rng.standard_normal((5, 33)), dtype)
    dx = dev.empty((5, 64), dtype)
    linear_grad(dy, A, dx)
    assert_close_elementwise(read(dx), dy64 @ W, UNIT_ROUNDOFF[dtype], tol(dy64, W), what="linear_grad")
    X = frozen_weight(dev, [Wf], dtype, (4, 32, "mxfp4"))  # experts (E, O, I)
    assert X.mode == "mxfp4" and X.shape == (2, 33, 64)
    We = X.numpy().astype(np.float64)
    offsets = to_dev(dev, np.array([0, 2, 5], np.int32), "i32")
    out = dev.empty((5, 33), dtype)
    expert_matmul(x, X, offsets, out)
    ref = np.concatenate([x64[:2] @ We[0].T, x64[2:] @ We[1].T])
    mag = np.concatenate([tol(x64[:2], We[0].T), tol(x64[2:], We[1].T)])
    assert_close_elementwise(read(out), ref, UNIT_ROUNDOFF[dtype], mag, what="experts")


def test_mxfp4_layout_errors():
    with pytest.raises(ValueError, match=r"\[quantize\] mxfp4 takes bits 4, group_size 32 and no biases, got bits 4, "
                                         r"group_size 64"):
        QuantizedArray(np.zeros((2, 8), np.int32), np.zeros((2, 1), np.uint8), None, 4, 64, mode="mxfp4")
    with pytest.raises(ValueError, match=r"\[quantize\] mode must be 'affine' or 'mxfp4', got 'nvfp4'"):
        QuantizedArray(np.zeros((2, 8), np.int32), np.zeros((2, 2)), None, 4, 32, mode="nvfp4")
    with pytest.raises(ValueError, match=r"\[quantize\] W must be 2-D with its last dimension a multiple of 32"):
        mxfp4.quantize(np.zeros((2, 48)))
