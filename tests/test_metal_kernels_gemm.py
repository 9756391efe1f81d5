"""krnl's GEMM kernels (metal/gemm.metal) on the MSL simulator (tools/mslsim) against float64 numpy.

Same approach as test_metal_kernels.py, whose helpers (kargs.h parsed into ctypes, the barrier-
free copy of a kernel file, the thread orders) are reused. Three builds of gemm.metal, made in
parallel and cached by content hash: unaligned (function constant gemm_aligned unset, every edge
checked), aligned (gemm_aligned = true) and one without its threadgroup barriers (must be caught).

Matrices live in flat NaN-filled buffers addressed through (batch stride, row stride, 1), so a
read outside the stored matrices (row padding, batch gaps) poisons the result and a write there
is seen; C of beta == 0 is NaN-filled as well (it must not be read)."""

import numpy as np
import pytest

from test_metal_kernels import KARGS, METAL, ORDERS, _caught, _without_barriers, build_all, mslsim

GemmArgs, GemmReduceArgs = KARGS["GemmArgs"], KARGS["GemmReduceArgs"]

rng = np.random.default_rng(2468)
U32 = 2.0 ** -24   # unit roundoff of float
U16 = 2.0 ** -11   # unit roundoff of half
TILE = 32

# dtype suffix -> (operand dtype, C dtype)
DTYPES = {"f32": (np.float32, np.float32), "f16": (np.float16, np.float16), "f16_f32": (np.float16, np.float32)}
OPS = ["nn", "nt", "tn"]
# (M, N, K): each dimension at 1, 31, 33, 127 and a tile multiple (64), K below the 16-deep K
# step and M, N below the 32x32 output tile included; not the full product (the simulator runs
# every GPU thread as a fiber).
SHAPES = [(1, 1, 1), (31, 33, 127), (33, 127, 1), (127, 1, 33), (64, 31, 33),
          (1, 64, 31), (31, 127, 64), (127, 33, 31), (33, 64, 64), (64, 1, 127)]


def test_kargs_layout_gemm():
    assert [f for f, _ in GemmArgs._fields_] == ["M", "N", "K", "lda", "ldb", "ldc", "stride_a", "stride_b",
                                                 "stride_c", "k_split", "alpha", "beta"]
    assert [f for f, _ in GemmReduceArgs._fields_] == ["M", "N", "ldc", "splits", "alpha", "beta"]


@pytest.fixture(scope="module")
def libs():
    builds = dict(plain=dict(source=METAL / "gemm.metal"),
                  aligned=dict(source=METAL / "gemm.metal", constants={"gemm_aligned": True}),
                  nobarrier=_without_barriers("gemm"))
    return build_all(builds)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
class Mat:
    """`batch` (rows, cols) matrices with row stride ld at element offsets b * stride (0: one
    matrix broadcast) inside a flat buffer that ends right after the last element (the simulator
    guards the end) and is NaN everywhere else."""

    def __init__(self, dtype, rows, cols, ld=None, batch=1, stride=None, fill=True):
        self.ld = ld or cols
        self.stride = (rows - 1) * self.ld + cols if stride is None else stride
        self.batch, self.rows, self.cols = batch, rows, cols
        nb = batch if self.stride else 1
        self.flat = np.full((nb - 1) * self.stride + (rows - 1) * self.ld + cols, np.nan, dtype)
        isz = self.flat.itemsize
        self.own = np.lib.stride_tricks.as_strided(self.flat, (nb, rows, cols), (self.stride * isz, self.ld * isz, isz))
        if fill:
            self.own[...] = rng.standard_normal(self.own.shape).astype(dtype)

    def view(self):
        """(batch, rows, cols) float64 copy, broadcast matrices repeated."""
        return np.broadcast_to(self.own.astype(np.float64), (self.batch, self.rows, self.cols)).copy()

    def padding_untouched(self):
        mask = np.ones(self.flat.shape, bool)
        idx = np.arange(self.flat.size)
        mask[np.lib.stride_tricks.as_strided(idx, self.own.shape, tuple(s // self.flat.itemsize * idx.itemsize
                                                                         for s in self.own.strides)).ravel()] = False
        return bool(np.isnan(self.flat[mask].astype(np.float64)).all())


def operands(op, dt, M, N, K, pad=0, batch=1, stride_a=None, stride_b=None):
    """A stored (M, K), or (K, M) for tn; B stored (K, N), or (N, K) for nt; row padding `pad`."""
    tin = DTYPES[dt][0]
    ar, ac = (K, M) if op[0] == "t" else (M, K)
    br, bc = (N, K) if op[1] == "t" else (K, N)
    A = Mat(tin, ar, ac, ac + pad, batch, stride_a)
    B = Mat(tin, br, bc, bc + pad, batch, stride_b)
    return A, B


def op_views(op, A, B):
    a, b = A.view(), B.view()
    return (a.transpose(0, 2, 1) if op[0] == "t" else a), (b.transpose(0, 2, 1) if op[1] == "t" else b)


def args(M, N, K, A, B, C, alpha, beta, k_split=None):
    return GemmArgs(M, N, K, A.ld, B.ld, C.ld, A.stride if A.batch > 1 else 0, B.stride if B.batch > 1 else 0,
                    C.stride if C.batch > 1 else 0, K if k_split is None else k_split, alpha, beta)


def run_gemm(lib, op, dt, M, N, K, A, B, C, alpha=1.0, beta=0.0, extra_groups=0, **kw):
    lib.dispatch(f"gemm_{op}_{dt}", grid=(-(-N // TILE) + extra_groups, -(-M // TILE) + extra_groups, C.batch),
                 threads=(32, 1, 1), buffers=[A.flat, B.flat, C.flat, args(M, N, K, A, B, C, alpha, beta)], **kw)


def run_splitk(lib, op, dt, M, N, K, A, B, C, splits, k_split, alpha=1.0, beta=0.0, **kw):
    """split-K partials (dense (splits, M, N) f32, NaN-filled first) then the reduce into C."""
    P = np.full((splits, M, N), np.nan, np.float32)
    # partial kernels are named by the operand dtype only (f16_f32 -> f16)
    lib.dispatch(f"gemm_splitk_{op}_{dt.split('_')[0]}", grid=(-(-N // TILE), -(-M // TILE), splits),
                 threads=(32, 1, 1),
                 buffers=[A.flat, B.flat, P, args(M, N, K, A, B, C, alpha, beta, k_split)], **kw)
    cdt = "f32" if C.flat.dtype == np.float32 else "f16"
    # 2-D reduce: thread (n, m), threadgroups of 32 x 8
    lib.dispatch(f"gemm_reduce_{cdt}", grid=(-(-N // 32), -(-M // 8), 1), threads=(32, 8, 1),
                 buffers=[P, C.flat, GemmReduceArgs(M, N, C.ld, splits, alpha, beta)], **kw)
    return P


def reference(op, A, B, C0, alpha, beta):
    """float64 result and its error bound. fp32 accumulation of K products in any order, fused
    or not: |err| <= K u sum_k |a||b| (Higham's gamma_K, u = 2^-24); +4 u for the alpha scaling,
    the beta product and the fma that combines them. A half C adds its own rounding (2^-11
    relative to the computed value, 2^-25 absolute in the subnormal range). Half operands are
    exact in float64, so the oracle uses the very values the kernel saw."""
    a, b = op_views(op, A, B)
    K = a.shape[2]
    c0 = np.nan_to_num(C0, nan=0.0) if beta == 0 else C0
    ref = alpha * a @ b + beta * c0
    bound = (K + 4) * U32 * (abs(alpha) * (np.abs(a) @ np.abs(b)) + abs(beta) * np.abs(c0))
    return ref, bound


def check(out, ref, bound, half_out):
    if half_out:
        bound = bound + U16 * (np.abs(ref) + bound) + 2.0 ** -25
    err = np.abs(out - ref)
    bad = ~(err <= bound)  # NaN counts as bad
    assert not bad.any(), (f"{bad.sum()} of {bad.size} outside the bound; first at {np.argwhere(bad)[0]}: "
                           f"got {out[bad][0]}, want {ref[bad][0]} +- {bound[bad][0]}")


def gemm_case(lib, op, dt, M, N, K, alpha, beta, pad=0, batch=1, stride_a=None, stride_b=None, **kw):
    A, B = operands(op, dt, M, N, K, pad, batch, stride_a, stride_b)
    C = Mat(DTYPES[dt][1], M, N, N + pad, batch, fill=beta != 0)
    C0 = C.view()
    run_gemm(lib, op, dt, M, N, K, A, B, C, alpha, beta, **kw)
    ref, bound = reference(op, A, B, C0, alpha, beta)
    check(C.view(), ref, bound, DTYPES[dt][1] == np.float16)
    assert A.padding_untouched() and B.padding_untouched() and C.padding_untouched()
    return C


# ---------------------------------------------------------------------------------------------
# plain kernels
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_gemm_metal(libs, op, dt, shape):
    """alpha != 1, beta = 0 on a NaN-filled C: C's old contents are never read."""
    gemm_case(libs["plain"], op, dt, *shape, alpha=1.5, beta=0.0)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_gemm_metal_alpha_beta(libs, op, dt):
    for shape, (alpha, beta) in [((33, 31, 45), (-0.75, 0.5)), ((1, 64, 127), (1.0, 1.0)), ((31, 1, 1), (0.0, -2.0))]:
        gemm_case(libs["plain"], op, dt, *shape, alpha=alpha, beta=beta)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_gemm_metal_row_strided(libs, op, dt):
    """lda/ldb/ldc above the column counts (odd, so rows are not 4-aligned); the NaN padding
    must neither be read nor written."""
    gemm_case(libs["plain"], op, dt, 33, 31, 45, alpha=1.0, beta=0.25, pad=3)
    gemm_case(libs["plain"], op, dt, 64, 64, 32, alpha=1.0, beta=0.0, pad=5)


@pytest.mark.parametrize("dt", ["f32", "f16"])
@pytest.mark.parametrize("op", OPS)
def test_gemm_metal_batched(libs, op, dt):
    """grid.z = batch with element strides (gaps between the matrices) and stride 0 broadcasts."""
    M, N, K = 33, 31, 20
    ar, ac = (K, M) if op[0] == "t" else (M, K)
    br, bc = (N, K) if op[1] == "t" else (K, N)
    gap = 7  # matrices do not touch: the NaN between them must not be read
    gemm_case(libs["plain"], op, dt, M, N, K, 0.5, 0.0, batch=3, stride_a=ar * ac + gap, stride_b=0)
    gemm_case(libs["plain"], op, dt, M, N, K, 1.0, -1.0, batch=2, stride_a=0, stride_b=br * bc + gap, pad=2)


def test_gemm_metal_extra_threadgroups_write_nothing(libs):
    """A grid larger than ceil(N/32) x ceil(M/32): the extra tiles are entirely out of range and
    store nothing (C's buffer ends at its last element, so a stray write would raise)."""
    gemm_case(libs["plain"], "nt", "f16", 31, 33, 17, 1.0, 0.0, extra_groups=1)


def test_gemm_metal_thread_orders_bit_identical(libs):
    """Each output element is one fixed sequence of fp32 operations: the same bits for every
    worker count and random thread order (a new order after every barrier and SIMD-group call),
    and within the bound of the oracle."""
    M, N, K = 33, 40, 50
    A, B = operands("nt", "f16", M, N, K, pad=1)
    outs = []
    for kw in ORDERS:
        C = Mat(np.float16, M, N, fill=False)
        run_gemm(libs["plain"], "nt", "f16", M, N, K, A, B, C, 1.0, 0.0, **kw)
        outs.append(C.view())
    ref, bound = reference("nt", A, B, outs[0], 1.0, 0.0)
    check(outs[0], ref, bound, True)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_gemm_metal_aligned_build_bit_identical(libs, op, dt):
    """gemm_aligned = true (no edge checks, vector loads and stores) computes the same bits as the
    unaligned build on a problem that satisfies its promise (M, N, K multiples of 32, ld % 4 == 0)."""
    M = N = K = 64
    A, B = operands(op, dt, M, N, K)
    outs = []
    for name in ("plain", "aligned"):
        C = Mat(DTYPES[dt][1], M, N, N + 4, fill=False)
        C.own[...] = np.linspace(-1, 1, M * N).reshape(1, M, N)
        C0 = C.view()
        run_gemm(libs[name], op, dt, M, N, K, A, B, C, 0.75, 0.5)
        outs.append(C.view())
    ref, bound = reference(op, A, B, C0, 0.75, 0.5)
    check(outs[1], ref, bound, DTYPES[dt][1] == np.float16)
    np.testing.assert_array_equal(outs[1], outs[0])


# ---------------------------------------------------------------------------------------------
# split-K partials + reduce
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("M,N,K,splits", [(33, 17, 1024, 4), (31, 33, 96, 3)])
def test_gemm_splitk_metal(libs, op, dt, M, N, K, splits):
    """Partials + reduce equal the plain kernel within tolerance (the host routes only divisible
    K: 1024 / 4, 96 / 3). The reduce adds `splits` roundings to the bound; the two results may
    differ by both bounds. beta = 0 on a NaN-filled C; then alpha, beta on a real C with a row
    stride above N. f16_f32: half partial kernels, f32 reduce (the LoRA gradient path)."""
    half_out = dt == "f16"
    A, B = operands(op, dt, M, N, K)
    a, b = op_views(op, A, B)
    S = np.abs(a) @ np.abs(b)
    ks = K // splits
    for alpha, beta in [(1.0, 0.0), (0.5, -1.5)]:
        ldc = N if beta == 0 else N + 3
        C = Mat(DTYPES[dt][1], M, N, ldc, fill=beta != 0)
        C_plain = Mat(DTYPES[dt][1], M, N, ldc, fill=False)
        C_plain.flat[...] = C.flat
        C0 = C.view()
        P = run_splitk(libs["plain"], op, dt, M, N, K, A, B, C, splits, ks, alpha, beta)
        run_gemm(libs["plain"], op, dt, M, N, K, A, B, C_plain, alpha, beta)
        ref, bound = reference(op, A, B, C0, alpha, beta)
        bound_split = bound + splits * U32 * abs(alpha) * S
        check(C.view(), ref, bound_split, half_out)
        # both within their bounds of ref (each half C rounded once more: 2 U16 |ref|)
        check(C.view(), C_plain.view(), bound_split + bound + (2 * U16 * np.abs(ref) if half_out else 0), half_out)
        assert C.padding_untouched()
        # each partial is the alpha-free product over its K slice
        for s in range(splits):
            sl = slice(s * ks, (s + 1) * ks)
            check(P[s][None].astype(np.float64), a[:, :, sl] @ b[:, sl, :],
                  (ks + 4) * U32 * (np.abs(a[:, :, sl]) @ np.abs(b[:, sl, :])), False)


def test_gemm_splitk_metal_ragged_slices(libs):
    """The kernel itself takes any k_split: slices [0, 34), [34, 68), [68, 100) and an empty
    fourth slice (past K) that writes zeros."""
    M, N, K = 31, 33, 100
    A, B = operands("tn", "f32", M, N, K)
    C = Mat(np.float32, M, N, fill=False)
    P = run_splitk(libs["plain"], "tn", "f32", M, N, K, A, B, C, 4, 34)
    np.testing.assert_array_equal(P[3], 0)
    ref, bound = reference("tn", A, B, C.view(), 1.0, 0.0)
    check(C.view(), ref, bound + 4 * bound / (K + 4), False)


def test_gemm_splitk_metal_thread_orders_and_aligned_bit_identical(libs):
    """Partials and reduce: the same bits under every thread order and for the aligned build
    (M, N multiples of 32, k_split = 32)."""
    M, N, K, splits = 64, 32, 96, 3
    A, B = operands("nt", "f16", M, N, K)
    outs = []
    for name, kw in [("plain", ORDERS[0]), ("plain", ORDERS[1]), ("plain", ORDERS[2]), ("aligned", ORDERS[3])]:
        C = Mat(np.float16, M, N, fill=False)
        P = run_splitk(libs[name], "nt", "f16", M, N, K, A, B, C, splits, K // splits, **kw)
        outs.append((P, C.view()))
    for P, c in outs[1:]:
        np.testing.assert_array_equal(P, outs[0][0])
        np.testing.assert_array_equal(c, outs[0][1])


# ---------------------------------------------------------------------------------------------
# the checks above can fail: the same kernels without their threadgroup barriers are caught
# ---------------------------------------------------------------------------------------------
def test_gemm_metal_missing_barrier_detected(libs):
    M, N, K = 33, 31, 45
    A, B = operands("nt", "f32", M, N, K)

    def run(lib, seed):
        C = Mat(np.float32, M, N, fill=False)
        try:
            run_gemm(lib, "nt", "f32", M, N, K, A, B, C, random_order=True, seed=seed)
        except mslsim.MslsimError:  # a simulator error (e.g. a race it detects) is caught too
            return None
        return C.view()

    ref = run(libs["plain"], 0)
    assert ref is not None
    assert _caught(lambda seed: run(libs["nobarrier"], seed), ref)


# ---------------------------------------------------------------------------------------------
# multi-SIMD-group variants (steel64: 64x64 tile, steel32: 32x32 tile; 4 SIMD-groups each)
# ---------------------------------------------------------------------------------------------
VARIANT_TILE = {"steel64": 64, "steel32": 32}
# 65 and 127 leave ragged 64-tiles; 64 is whole; 1, 31, 33 are below or past one tile.
VARIANT_SHAPES = [(1, 1, 1), (31, 33, 127), (65, 127, 33), (127, 65, 1), (64, 64, 31), (33, 1, 65), (1, 65, 64)]


def run_variant(lib, v, op, dt, M, N, K, A, B, C, alpha=1.0, beta=0.0, **kw):
    t = VARIANT_TILE[v]
    lib.dispatch(f"gemm_{v}_{op}_{dt}", grid=(-(-N // t), -(-M // t), C.batch), threads=(128, 1, 1),
                 buffers=[A.flat, B.flat, C.flat, args(M, N, K, A, B, C, alpha, beta)], **kw)


def variant_case(lib, v, op, dt, M, N, K, alpha, beta, pad=0, batch=1, stride_a=None, stride_b=None, **kw):
    A, B = operands(op, dt, M, N, K, pad, batch, stride_a, stride_b)
    C = Mat(DTYPES[dt][1], M, N, N + pad, batch, fill=beta != 0)
    C0 = C.view()
    run_variant(lib, v, op, dt, M, N, K, A, B, C, alpha, beta, **kw)
    ref, bound = reference(op, A, B, C0, alpha, beta)
    check(C.view(), ref, bound, DTYPES[dt][1] == np.float16)
    assert A.padding_untouched() and B.padding_untouched() and C.padding_untouched()
    return A, B, C0, C


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("v", list(VARIANT_TILE))
def test_gemm_variant_metal(libs, v, op, dt):
    """Awkward sizes, alpha != 1 and beta = 0 on a NaN-filled C; then beta != 0 with row strides
    (odd: rows not 4-aligned) whose NaN padding must be neither read nor written."""
    for shape in VARIANT_SHAPES:
        variant_case(libs["plain"], v, op, dt, *shape, alpha=1.5, beta=0.0)
    variant_case(libs["plain"], v, op, dt, 65, 33, 45, alpha=-0.75, beta=0.5, pad=3)
    variant_case(libs["plain"], v, op, dt, 31, 64, 1, alpha=0.0, beta=-2.0, pad=1)


@pytest.mark.parametrize("dt", ["f32", "f16"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("v", list(VARIANT_TILE))
def test_gemm_variant_metal_batched(libs, v, op, dt):
    """grid.z = batch with gaps between the matrices and stride-0 broadcasts."""
    M, N, K = 65, 31, 20
    ar, ac = (K, M) if op[0] == "t" else (M, K)
    br, bc = (N, K) if op[1] == "t" else (K, N)
    variant_case(libs["plain"], v, op, dt, M, N, K, 0.5, 0.0, batch=3, stride_a=ar * ac + 7, stride_b=0)
    variant_case(libs["plain"], v, op, dt, M, N, K, 1.0, -1.0, batch=2, stride_a=0, stride_b=br * bc + 7, pad=2)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_gemm_variants_bit_identical_to_tile32(libs, op, dt):
    """Every variant sums k in tile32's order and applies alpha, beta with its fma: the same bits,
    unaligned on a ragged problem and aligned (gemm_aligned = true: vector loads and stores) on
    one that keeps the promise (M, N multiples of 64, K of 32, ld % 4 == 0)."""
    for lib, (M, N, K), pad in [("plain", (65, 33, 47), 1), ("aligned", (64, 128, 64), 4)]:
        A, B = operands(op, dt, M, N, K, pad)
        C = Mat(DTYPES[dt][1], M, N, N + pad, fill=True)
        C0, c0 = C.flat.copy(), C.view()
        outs = {}
        for v in ["tile32"] + list(VARIANT_TILE):
            C.flat[...] = C0
            if v == "tile32":
                run_gemm(libs[lib], op, dt, M, N, K, A, B, C, 0.75, 0.5)
            else:
                run_variant(libs[lib], v, op, dt, M, N, K, A, B, C, 0.75, 0.5)
            outs[v] = C.flat.copy()
        ref, bound = reference(op, A, B, c0, 0.75, 0.5)
        C.flat[...] = outs["steel64"]
        check(C.view(), ref, bound, DTYPES[dt][1] == np.float16)
        for v in VARIANT_TILE:
            np.testing.assert_array_equal(outs[v], outs["tile32"], err_msg=f"{v} ({lib})")


def test_gemm_variant_metal_thread_orders_bit_identical(libs):
    """The same bits for every worker count and random thread order (4 SIMD-groups share the
    staged tiles: a missing barrier would show as a difference)."""
    M, N, K = 65, 40, 50
    A, B = operands("tn", "f16", M, N, K, pad=1)
    for v in VARIANT_TILE:
        outs = []
        for kw in ORDERS:
            C = Mat(np.float16, M, N, fill=False)
            run_variant(libs["plain"], v, "tn", "f16", M, N, K, A, B, C, 1.0, 0.0, **kw)
            outs.append(C.view())
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])


@pytest.mark.parametrize("v", list(VARIANT_TILE))
def test_gemm_variant_metal_missing_barrier_detected(libs, v):
    M, N, K = 65, 31, 45
    A, B = operands("nn", "f32", M, N, K)

    def run(lib, seed):
        C = Mat(np.float32, M, N, fill=False)
        try:
            run_variant(lib, v, "nn", "f32", M, N, K, A, B, C, random_order=True, seed=seed)
        except mslsim.MslsimError:
            return None
        return C.view()

    ref = run(libs["plain"], 0)
    assert ref is not None
    assert _caught(lambda seed: run(libs["nobarrier"], seed), ref)
