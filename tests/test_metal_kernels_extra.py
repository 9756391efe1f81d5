"""krnl's Metal dropout, transpose_heads, same-dtype casts, fill_i32 (metal/elementwise.metal) and
rmsnorm_backward_dw (metal/rmsnorm.metal) on the MSL simulator (tools/mslsim) against numpy.

Same approach as test_metal_kernels.py, whose helpers (kargs.h parsed into ctypes, the barrier-
free copy of a kernel file, the thread orders) are reused: each .metal file is built once per
module (cached by content hash under MSLSIM_CACHE), sizes 1, 31, 33, 127 plus one realistic,
f32 and f16. Copies and masks are checked bit for bit; dropout's mask against a numpy
reimplementation of csrc/core/rng.h (uint64 arithmetic); the dw reduction against float64 under
random thread orders, and bit for bit across orders."""

import numpy as np
import pytest

from test_metal_kernels import (DT, KARGS, METAL, ORDERS, ROOT, SIZES, _caught, _without_barriers, build_all,
                                ew_dispatch, f64)

ElementwiseArgs, DropoutArgs, TransposeHeadsArgs, RmsnormBackwardArgs = (
    KARGS[n] for n in ("ElementwiseArgs", "DropoutArgs", "TransposeHeadsArgs", "RmsnormBackwardArgs"))

rng = np.random.default_rng(2468)
U32 = 2.0 ** -24  # float unit roundoff
INCLUDE_DIRS = [ROOT / "csrc" / "core"]  # rng.h, as the host compiles metal/*.metal


def test_kargs_layout_extra():
    assert [f for f, _ in DropoutArgs._fields_] == ["n", "seed_lo", "seed_hi", "p", "keep_scale", "use_offset",
                                                   "row_width"]
    assert [f for f, _ in TransposeHeadsArgs._fields_] == ["A", "B", "D", "rotate", "R", "heads_axis", "sign"]


@pytest.fixture(scope="module")
def libs():
    builds = {name: dict(source=METAL / f"{name}.metal", include_dirs=INCLUDE_DIRS)
              for name in ("elementwise", "rmsnorm")}
    builds.update(rmsnorm_nobarrier=_without_barriers("rmsnorm"))
    return build_all(builds)


def bits(a):
    return a.view(np.uint16 if a.dtype == np.float16 else np.uint32)


def random_bits(dt, shape):
    """Every bit pattern, NaN payloads and infinities included: a copy must move bits."""
    u = np.uint16 if dt == "f16" else np.uint32
    return rng.integers(0, np.iinfo(u).max, size=shape, dtype=u, endpoint=True).view(DT[dt])


# ---------------------------------------------------------------------------------------------
# dropout: numpy reimplementation of csrc/core/rng.h
# ---------------------------------------------------------------------------------------------
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x):
    x = x + GOLDEN  # uint64 arrays wrap modulo 2^64, as the C++
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keep_mask(seed, n, p):
    """krnl::dropout_keep(seed, i, p) for i in [0, n)."""
    idx = np.arange(n, dtype=np.uint64)
    h = splitmix64(np.uint64(seed) ^ (idx * GOLDEN)) >> np.uint64(32)
    threshold = int(np.float32(p) * np.float32(2.0 ** 32))  # exact product, truncated
    return h >= np.uint64(threshold)


def test_splitmix64_oracle_known_answers():
    """The oracle is the published splitmix64: its first outputs from state 0."""
    out = splitmix64(np.arange(3, dtype=np.uint64) * GOLDEN)
    assert [int(v) for v in out] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def dropout_run(lib, dt, x, p, seed, keep_scale=None, offset=None, **kw):
    """offset (a uint64) goes in as the (2,) i32 buffer(3); without it that buffer is empty, so a
    read of it would hit the guard."""
    n = x.size
    out = np.full(n, np.nan, DT[dt])
    ks = 1.0 / (1.0 - p) if keep_scale is None else keep_scale
    args = DropoutArgs(n, seed & 0xFFFFFFFF, seed >> 32, p, np.float32(ks), int(offset is not None))
    off = (np.zeros(0, np.int32) if offset is None
           else np.array([offset & 0xFFFFFFFF, offset >> 32], np.uint32).view(np.int32))
    ew_dispatch(lib, f"dropout_{dt}", n, [x, out, args, off], **kw)
    return out, np.float32(ks)


def dropout_inputs(dt, n):
    # nonzero inputs, so a kept element is never 0 and the mask reads off the output
    return (rng.uniform(0.5, 2.0, n) * rng.choice([-1, 1], n)).astype(DT[dt])


SEEDS = [0x123456789ABCDEF0, 7, 0xFFFFFFFF00000001]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_dropout_metal(libs, dt, p, n):
    seed = SEEDS[n % len(SEEDS)]
    x = dropout_inputs(dt, n)
    out, ks = dropout_run(libs["elementwise"], dt, x, p, seed)
    mask = keep_mask(seed, n, p)
    np.testing.assert_array_equal(out != 0, mask)  # bit-identical mask
    assert not np.signbit(out[~mask]).any()        # dropped: exact +0
    # kept: float(x) * keep_scale rounded once to the dtype, as CpuBackend::dropout: exact
    ref = (x.astype(np.float32) * ks).astype(DT[dt])
    np.testing.assert_array_equal(bits(out[mask]), bits(ref[mask]))
    # and against float64: one float rounding (f32), one half rounding on top (f16)
    tol = dict(rtol=2 * U32) if dt == "f32" else dict(rtol=2.0 ** -11 + 2 * U32)
    np.testing.assert_allclose(f64(out[mask]), f64(x[mask]) / (1.0 - np.float64(np.float32(p))), **tol)
    if n >= 4096:  # keep fraction ~ 1 - p: binomial, 5 standard deviations
        assert abs(mask.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_dropout_metal_p0_identity(libs, dt):
    """p = 0: threshold 0, every element kept, keep_scale 1: out == x bit for bit (-0, inf)."""
    n = 1000
    x = rng.standard_normal(n).astype(DT[dt])
    x[:4] = [-0.0, np.inf, -np.inf, 0.0]
    out, _ = dropout_run(libs["elementwise"], dt, x, 0.0, SEEDS[0])
    np.testing.assert_array_equal(bits(out), bits(x))


def test_dropout_metal_seed_halves_and_index(libs):
    """Both 32-bit halves of the seed enter the hash; the mask is per flat index, so any grid
    (one thread per element, or a few threads striding) gives the same output."""
    n, p = 5000, 0.3
    x = dropout_inputs("f32", n)
    lib = libs["elementwise"]
    a, _ = dropout_run(lib, "f32", x, p, 0x0000000100000005)
    b, _ = dropout_run(lib, "f32", x, p, 0x0000000200000005)
    c, _ = dropout_run(lib, "f32", x, p, 0x0000000100000006)
    assert (a != 0).tolist() != (b != 0).tolist() and (a != 0).tolist() != (c != 0).tolist()
    one_group, _ = dropout_run(lib, "f32", x, p, 0x0000000100000005, max_groups=1)
    np.testing.assert_array_equal(bits(one_group), bits(a))


@pytest.mark.parametrize("seed,offset", [(5, 0x0000000100000007), ((1 << 64) - 3, 5), (0x7FFFFFFFFFFFFFFF, 2),
                                         (11, 0xFFFFFFFF80000000)])
def test_dropout_metal_seed_offset(libs, seed, offset):
    """use_offset: the mask of (seed + offset) mod 2^64 with bit 63 cleared (krnl::dropout_seed),
    bit for bit the host-seed dispatch with that seed and the numpy oracle's mask."""
    n, p = 777, 0.4
    x = dropout_inputs("f32", n)
    eff = ((seed + offset) % (1 << 64)) & ((1 << 63) - 1)
    got, _ = dropout_run(libs["elementwise"], "f32", x, p, seed, offset=offset)
    want, _ = dropout_run(libs["elementwise"], "f32", x, p, eff)
    np.testing.assert_array_equal(bits(got), bits(want))
    np.testing.assert_array_equal(got != 0, keep_mask(eff, n, p))


@pytest.mark.parametrize("rows,width,first", [(1, 1, 0), (3, 33, 5), (2, 127, 1), (4, 31, 0xFFFFFFF0)])
def test_dropout_metal_first_row(libs, rows, width, first):
    """row_width with a (3,) offset: element i draws krnl::dropout_keep of index
    first * row_width + i (the whole batch's bit), the numpy oracle's mask."""
    n, p, seed, offset = rows * width, 0.4, 9, 0x0000000100000007
    x = dropout_inputs("f32", n)
    out = np.full(n, np.nan, np.float32)
    args = DropoutArgs(n, seed, 0, p, np.float32(1 / (1 - p)), 1, width)
    off = np.array([offset & 0xFFFFFFFF, offset >> 32, first], np.uint32).view(np.int32)
    ew_dispatch(libs["elementwise"], "dropout_f32", n, [x, out, args, off])
    eff = (seed + offset) & ((1 << 63) - 1)
    idx = np.uint64(first) * np.uint64(width) + np.arange(n, dtype=np.uint64)
    h = splitmix64(np.uint64(eff) ^ (idx * GOLDEN)) >> np.uint64(32)
    np.testing.assert_array_equal(out != 0, h >= np.uint64(int(np.float32(p) * np.float32(2.0 ** 32))))


def test_dropout_metal_extra_threads_write_nothing(libs):
    n = 5
    x = np.ones(n, np.float16)
    out = np.full(n + 3, 9, np.float16)
    libs["elementwise"].dispatch("dropout_f16", grid=(3, 1, 1), threads=(64, 1, 1),
                                 buffers=[x, out, DropoutArgs(n, 1, 2, 0.5, 2.0, 0), np.zeros(0, np.int32)])
    np.testing.assert_array_equal(out[n:], 9)
    np.testing.assert_array_equal(out[:n], np.where(keep_mask(1 | 2 << 32, n, 0.5), 2.0, 0.0))


# ---------------------------------------------------------------------------------------------
# transpose_heads
# ---------------------------------------------------------------------------------------------
TH_SHAPES = [(1, 1, 1), (3, 5, 1), (2, 31, 31), (33, 2, 33), (4, 3, 128), (1, 127, 8), (31, 1, 127),
             (3, 7, 2), (8, 256, 64)]


UNBOUND = np.zeros(1, np.int32)  # positions and inv_freq's slots when nothing turns (never read)


def transpose_run(lib, dt, x, tx, ty=4, rope=None):
    """rope: (positions, inv_freq, rotate, sign, heads_axis) or None for a plain move."""
    A, B, D = x.shape
    out = np.full((B, A, D), np.nan, DT[dt])
    pos, inv, rot, sign, axis = rope or (UNBOUND, UNBOUND.view(np.float32), 0, 1.0, 1)
    lib.dispatch_threads(f"transpose_heads_{dt}", (tx, B, A), (tx, min(ty, B), 1),
                         [x, out, TransposeHeadsArgs(A, B, D, rot, len(inv) if rope else 0, axis, sign), pos, inv])
    return out


@pytest.mark.parametrize("A,B,D", TH_SHAPES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_transpose_heads_metal(libs, dt, A, B, D):
    x = random_bits(dt, (A, B, D))
    tx = min(D // 4 if D % 4 == 0 else D, 32)  # the host's choice
    out = transpose_run(libs["elementwise"], dt, x, tx)
    np.testing.assert_array_equal(bits(out), bits(np.ascontiguousarray(x.transpose(1, 0, 2))))


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_transpose_heads_metal_any_x_extent(libs, dt):
    """The x extent only sets the stride over D: 1 thread, fewer or more threads than D."""
    for D in (1, 6, 31, 128):
        x = random_bits(dt, (3, 5, D))
        ref = bits(np.ascontiguousarray(x.transpose(1, 0, 2)))
        for tx in (1, 3, 64):
            np.testing.assert_array_equal(bits(transpose_run(libs["elementwise"], dt, x, tx, ty=2)), ref)


@pytest.mark.parametrize("dt", ["f32", "f16"])
@pytest.mark.parametrize("axis", [1, 0])
def test_transpose_heads_metal_rope_any_x_extent(libs, dt, axis):
    """RoPE on the way (heads h < rotate): the x extent only sets the stride over the pairs and
    the copied tail, so every extent gives the same bits; the turned rows match a float64
    rotate_half within f32 arithmetic plus the output's rounding, the other rows are moved."""
    T, H, D, R, rot = 7, 5, 20, 6, 3
    shape = (T, H, D) if axis == 1 else (H, T, D)
    x = random_bits(dt, shape)
    x[~np.isfinite(x)] = 1.0
    pos = (np.arange(T, dtype=np.int32) * 37 + 5)
    inv = (1.0 / 10000.0 ** (np.arange(R) / R)).astype(np.float32)
    sign = 1.0 if axis == 1 else -1.0
    runs = [transpose_run(libs["elementwise"], dt, x, tx, ty=2, rope=(pos, inv, rot, sign, axis)) for tx in (1, 4, 64)]
    for r in runs[1:]:
        np.testing.assert_array_equal(bits(r), bits(runs[0]))
    heads = (x.transpose(1, 0, 2) if axis == 1 else x).astype(np.float64)   # (H, T, D)
    got = runs[0] if axis == 1 else runs[0].transpose(1, 0, 2)
    th = sign * pos[:, None].astype(np.float64) * inv[None, :]
    c, s_ = np.cos(th), np.sin(th)
    a, b = heads[:rot, :, :R], heads[:rot, :, R:2 * R]
    ref = np.concatenate([a * c - b * s_, b * c + a * s_, heads[:rot, :, 2 * R:]], axis=-1)
    tol = (1e-3 if dt == "f16" else 1e-6) * np.max(np.abs(heads))
    np.testing.assert_allclose(got[:rot].astype(np.float64), ref, rtol=0, atol=tol)
    np.testing.assert_array_equal(bits(np.ascontiguousarray(got[rot:])), bits(np.ascontiguousarray(heads[rot:].astype(DT[dt]))))


def test_transpose_heads_metal_extra_threads_write_nothing(libs):
    """dispatchThreadgroups past A and B (and D): the bounds checks keep off the guarded ends."""
    A, B, D = 3, 5, 7
    x = random_bits("f16", (A, B, D))
    out = np.zeros(B * A * D + 8, np.float16)
    libs["elementwise"].dispatch("transpose_heads_f16", grid=(1, 2, 2), threads=(16, 4, 2),
                                 buffers=[x, out, TransposeHeadsArgs(A, B, D), UNBOUND, UNBOUND])
    np.testing.assert_array_equal(bits(out[:B * A * D]), bits(np.ascontiguousarray(x.transpose(1, 0, 2))).ravel())
    np.testing.assert_array_equal(out[B * A * D:], 0)


# ---------------------------------------------------------------------------------------------
# same-dtype casts (copies) and fill_i32
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_cast_same_dtype_metal(libs, dt, n):
    x = random_bits(dt, n)
    out = np.full(n, 7, DT[dt])
    ew_dispatch(libs["elementwise"], f"cast_{dt}_{dt}", n, [x, out, ElementwiseArgs(n, 0.0, 0.0)])
    np.testing.assert_array_equal(bits(out), bits(x))  # a copy: every bit, NaN payloads too


def fill_i32_ref(alpha):
    """CpuBackend::fill for i32 given the float the host stores in ElementwiseArgs.alpha: NaN
    gives 0, the rest is clamped to the int32 range in double and truncated toward zero."""
    v = float(np.float32(alpha))
    if np.isnan(v):
        return 0
    return int(min(max(v, -2.0 ** 31), 2.0 ** 31 - 1))


FILL_I32_VALUES = [0.0, -0.0, 0.3, -0.7, 5.5, -5.5, 123456.0, 16777216.0, 2147483520.0, 2147483647.0,
                   2147483648.0, 1e10, -2147483520.0, -2147483648.0, -2147483904.0, -1e10,
                   np.inf, -np.inf, np.nan, 1e-40, 3e38]


@pytest.mark.parametrize("n", SIZES)
def test_fill_i32_metal(libs, n):
    for alpha in FILL_I32_VALUES if n in (1, 33) else FILL_I32_VALUES[::5]:
        x = np.full(n, 7, np.int32)
        ew_dispatch(libs["elementwise"], "fill_i32", n, [x, ElementwiseArgs(n, alpha, 0.0)])
        np.testing.assert_array_equal(x, np.full(n, fill_i32_ref(alpha), np.int32), err_msg=f"alpha={alpha}")


def test_fill_i32_metal_ref_is_cpu_semantics():
    assert [fill_i32_ref(a) for a in (np.nan, np.inf, -np.inf, 2147483647.0, -0.7, 5.9)] == \
        [0, 2 ** 31 - 1, -2 ** 31, 2 ** 31 - 1, 0, 5]


def test_fill_i32_metal_extra_threads_write_nothing(libs):
    n = 5
    x = np.zeros(n + 3, np.int32)
    libs["elementwise"].dispatch("fill_i32", grid=(3, 1, 1), threads=(64, 1, 1),
                                 buffers=[x, ElementwiseArgs(n, -3.0, 0.0)])
    np.testing.assert_array_equal(x, [-3] * n + [0] * 3)


# ---------------------------------------------------------------------------------------------
# rmsnorm_backward_dw
# ---------------------------------------------------------------------------------------------
DW_SHAPES = [(1, 1), (31, 33), (33, 31), (1, 127), (127, 1), (127, 33), (512, 1024)]
DW_GEOMS = [(32, 1), (32, 8), (64, 16)]  # (columns, row strands) per threadgroup


def dw_inputs(dt, rows, cols, eps=1e-5):
    x = rng.standard_normal((rows, cols)).astype(DT[dt])
    dy = rng.standard_normal((rows, cols)).astype(DT[dt])
    rstd = (1 / np.sqrt((f64(x) ** 2).mean(1) + eps)).astype(np.float32)
    dw0 = rng.standard_normal(cols).astype(np.float32)
    return dy, x, rstd, dw0


def dw_run(lib, dt, dy, x, rstd, dw, geom, groups=None, extra_groups=0, **kw):
    rows, cols = x.shape
    tx, ty = geom
    grid = (groups or -(-cols // tx)) + extra_groups
    lib.dispatch(f"rmsnorm_backward_dw_{dt}", grid=(grid, 1, 1), threads=(tx, ty, 1),
                 buffers=[dy, x, rstd, dw, RmsnormBackwardArgs(rows, cols)], **kw)
    return dw


def dw_check(dw, dw0, dy, x, rstd, times=1):
    terms = f64(dy) * f64(x) * f64(rstd)[:, None]
    ref = f64(dw0) + times * terms.sum(0)
    # half inputs are exact in float. Each term: one rounding of x * rstd, one per fma (a strand of
    # rows / ty terms), ty - 1 strand additions, one for dw +=: (rows + 3) roundings of at most
    # u * (sum |terms| + |dw0|) each, per accumulation.
    atol = times * (x.shape[0] + 3) * U32 * (np.abs(terms).sum(0) + np.abs(f64(dw0)))
    err = np.abs(f64(dw) - ref)
    assert np.all(err <= atol), f"max excess {np.max(err - atol)}"


# every geometry at the awkward sizes, one at the realistic size
DW_CASES = [(*s, g) for s in DW_SHAPES[:-1] for g in DW_GEOMS] + [(*DW_SHAPES[-1], (32, 8))]


@pytest.mark.parametrize("rows,cols,geom", DW_CASES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_rmsnorm_backward_dw_metal(libs, dt, rows, cols, geom):
    dy, x, rstd, dw0 = dw_inputs(dt, rows, cols)
    dw = dw_run(libs["rmsnorm"], dt, dy, x, rstd, dw0.copy(), geom, extra_groups=1,
                random_order=True, seed=rows + cols)
    dw_check(dw, dw0, dy, x, rstd)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_rmsnorm_backward_dw_metal_accumulates(libs, dt):
    """dw += like CpuBackend::rmsnorm_backward: two dispatches add the sum twice; fewer
    threadgroups than column blocks stride over the blocks."""
    dy, x, rstd, dw0 = dw_inputs(dt, 70, 200)
    dw = dw0.copy()
    for _ in range(2):
        dw_run(libs["rmsnorm"], dt, dy, x, rstd, dw, (32, 4), groups=2, random_order=True, seed=3)
    dw_check(dw, dw0, dy, x, rstd, times=2)


def test_rmsnorm_backward_dw_metal_row_order(libs):
    """ty = 1: each column is summed in row order, fma by fma, from zero, then added to dw."""
    dy, x, rstd, dw0 = dw_inputs("f32", 40, 50)
    dw = dw_run(libs["rmsnorm"], "f32", dy, x, rstd, dw0.copy(), (32, 1))
    s = np.zeros(50, np.float64)
    for r in range(40):  # float fma: the exact product and sum rounded once (float64 holds the product)
        p = f64(x[r].astype(np.float32) * rstd[r])
        s = (f64(dy[r]) * p + s).astype(np.float32).astype(np.float64)
    ref = (dw0 + s.astype(np.float32)).astype(np.float32)
    # the float64 add of an exact 48-bit product and a float can round twice: a few ulps at most
    np.testing.assert_allclose(dw, ref, rtol=0, atol=4 * U32 * np.abs(f64(dw0) + s).max() + 1e-30)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_rmsnorm_backward_dw_metal_race_free(libs, dt):
    """Random thread orders and 1 or 2 workers, ragged threadgroups: bit-identical dw."""
    dy, x, rstd, dw0 = dw_inputs(dt, 100, 70)
    for geom in [(32, 8), (16, 64)]:
        outs = [dw_run(libs["rmsnorm"], dt, dy, x, rstd, dw0.copy(), geom, **kw) for kw in ORDERS]
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])


def test_rmsnorm_backward_dw_metal_missing_barrier_detected(libs):
    dy, x, rstd, dw0 = dw_inputs("f32", 64, 40)
    ref = dw_run(libs["rmsnorm"], "f32", dy, x, rstd, dw0.copy(), (32, 8), random_order=True)
    bad = libs["rmsnorm_nobarrier"]
    assert _caught(lambda seed: dw_run(bad, "f32", dy, x, rstd, dw0.copy(), (32, 8),
                                       random_order=True, seed=seed), ref)
