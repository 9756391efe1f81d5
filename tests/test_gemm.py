"""ops.gemm against a float64 numpy oracle: every transpose variant at awkward sizes, alpha/beta,
batching (3-D operands, stride-0 broadcast, explicit strides), f32 output from f16/bf16
operands, and split-K (forced and auto-routed) against the plain path."""

import itertools
import math

import numpy as np
import pytest

import krnl
from krnl import ops

from conftest import FLOAT_DTYPES, U32, device_dtypes, UNIT_ROUNDOFF, empty_filled, read, upload

AWKWARD = (1, 31, 33, 127)
TRANS = {"nn": (False, False), "nt": (False, True), "tn": (True, False), "tt": (True, True)}
# (A/B dtype, C dtype): C is A's dtype, or f32 for LoRA gradients from f16/bf16 operands.
DTYPE_PAIRS = [("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("f16", "f32"), ("bf16", "f32")]
PAIR_IDS = [f"{a}->{c}" for a, c in DTYPE_PAIRS]

# fp32 accumulation: the rounding errors of a K-term dot product add up like a random walk, so
# relative to the typical output size sqrt(K)*rms(A)*rms(B) the error grows like sqrt(K)*2^-24.
# A factor 4 leaves room for any summation order (blocked, FMA, split-K partials); fp16
# accumulation (2^-11) or one dropped or doubled term lands orders of magnitude outside.
GEMM_ACC = 4.0


def rms(x):
    return float(np.sqrt(np.mean(np.square(x)))) if np.size(x) else 0.0


def gemm_bound(K, c_dtype, ref, alpha, a, b, beta=0.0, c=None):
    """Error bound of one GEMM output: one rounding into C's dtype of the largest output, plus
    the fp32 accumulation error relative to the output magnitude (the larger of the largest
    output and the typical one, so that a near-zero output cannot make the bound vanish)."""
    typical = abs(alpha) * math.sqrt(K) * rms(a) * rms(b)
    if c is not None and beta != 0:
        typical += abs(beta) * float(np.max(np.abs(c)))
    mag = max(float(np.max(np.abs(ref))) if ref.size else 0.0, typical)
    return (UNIT_ROUNDOFF[c_dtype] + GEMM_ACC * math.sqrt(max(K, 1)) * U32) * mag


def operands(dev, rng, M, N, K, ta, tb, dt, batch=None):
    """A stored (M, K) or (K, M), B stored (K, N) or (N, K) (leading batch dim if given); returns
    tensors and the float64 op(A), op(B) the device holds."""
    lead = () if batch is None else (batch,)
    a_shape = lead + ((K, M) if ta else (M, K))
    b_shape = lead + ((N, K) if tb else (K, N))
    A, a = upload(dev, rng.standard_normal(a_shape), dt)
    B, b = upload(dev, rng.standard_normal(b_shape), dt)
    opa = np.swapaxes(a, -1, -2) if ta else a
    opb = np.swapaxes(b, -1, -2) if tb else b
    return A, B, opa, opb


def check(C, ref, K, c_dtype, alpha, opa, opb, beta=0.0, c0=None, what=""):
    got = read(C)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output"
    err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
    bound = gemm_bound(K, c_dtype, ref, alpha, opa, opb, beta, c0)
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("trans", list(TRANS), ids=list(TRANS))
@pytest.mark.parametrize("dt,cdt", DTYPE_PAIRS, ids=PAIR_IDS)
def test_gemm_awkward_sizes(dev, trans, dt, cdt):
    """All 64 (M, N, K) in {1, 31, 33, 127}^3, plain routing (auto and forced plain)."""
    ta, tb = TRANS[trans]
    rng = np.random.default_rng(1)
    for M, N, K in itertools.product(AWKWARD, AWKWARD, AWKWARD):
        A, B, opa, opb = operands(dev, rng, M, N, K, ta, tb, dt)
        ref = opa @ opb
        for split_k in (-1, 1):
            C = empty_filled(dev, (M, N), cdt, 7.0)  # beta = 0: the old contents must not leak in
            ops.gemm(A, B, C, trans_a=ta, trans_b=tb, split_k=split_k)
            check(C, ref, K, cdt, 1.0, opa, opb, what=f"{trans} M={M} N={N} K={K} split_k={split_k}")


@pytest.mark.parametrize("dt,cdt", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (0.75, 0.5), (-1.5, -1.25), (0.0, 2.0), (2.0, 0.0)])
def test_gemm_alpha_beta(dev, dt, cdt, alpha, beta):
    """C = alpha*op(A)*op(B) + beta*C; beta != 0 reads C (its dtype-rounded contents)."""
    rng = np.random.default_rng(2)
    for trans, (M, N, K) in zip(TRANS, [(31, 33, 127), (127, 1, 33), (1, 127, 31), (33, 31, 1)]):
        ta, tb = TRANS[trans]
        A, B, opa, opb = operands(dev, rng, M, N, K, ta, tb, dt)
        C, c0 = upload(dev, rng.standard_normal((M, N)), cdt)
        ops.gemm(A, B, C, trans_a=ta, trans_b=tb, alpha=alpha, beta=beta)
        ref = alpha * (opa @ opb) + beta * c0
        check(C, ref, K, cdt, alpha, opa, opb, beta, c0, what=f"{trans} alpha={alpha} beta={beta}")


@pytest.mark.parametrize("dt,cdt", DTYPE_PAIRS, ids=PAIR_IDS)
def test_gemm_beta_zero_ignores_c(dev, dt, cdt):
    """beta = 0 must not read C (BLAS rule): NaN or inf garbage in C does not reach the output."""
    rng = np.random.default_rng(3)
    M, N, K = 33, 31, 127
    A, B, opa, opb = operands(dev, rng, M, N, K, False, True, dt)
    for garbage in (np.nan, np.inf):
        for split_k in (1, -1):
            C = empty_filled(dev, (M, N), cdt, garbage)
            ops.gemm(A, B, C, trans_b=True, alpha=1.0, beta=0.0, split_k=split_k)
            check(C, opa @ opb, K, cdt, 1.0, opa, opb, what=f"C={garbage} split_k={split_k}")
    # forced split-K (K = 127 is prime: use K = 128)
    A, B, opa, opb = operands(dev, rng, M, N, 128, False, True, dt)
    C = empty_filled(dev, (M, N), cdt, np.nan)
    ops.gemm(A, B, C, trans_b=True, split_k=4)
    check(C, opa @ opb, 128, cdt, 1.0, opa, opb, what="C=nan split_k=4")


@pytest.mark.parametrize("dt,cdt", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("trans", list(TRANS), ids=list(TRANS))
def test_gemm_batched_3d(dev, dt, cdt, trans):
    """3-D operands (batch, rows, cols): each batch entry is its own GEMM."""
    ta, tb = TRANS[trans]
    rng = np.random.default_rng(4)
    batch, M, N, K = 3, 33, 31, 127
    A, B, opa, opb = operands(dev, rng, M, N, K, ta, tb, dt, batch=batch)
    C, c0 = upload(dev, rng.standard_normal((batch, M, N)), cdt)
    ops.gemm(A, B, C, trans_a=ta, trans_b=tb, alpha=0.5, beta=-1.0, batch=batch)
    ref = 0.5 * (opa @ opb) - c0
    check(C, ref, K, cdt, 0.5, opa, opb, -1.0, c0, what=f"batched {trans}")


@pytest.mark.parametrize("dt,cdt", DTYPE_PAIRS, ids=PAIR_IDS)
def test_gemm_broadcast_stride0(dev, dt, cdt):
    """A 2-D B with batch > 1 is broadcast (default stride 0); so is a 3-D (1, K, N) B with an
    explicit stride_b=0, and a 2-D A."""
    rng = np.random.default_rng(5)
    batch, M, N, K = 4, 31, 33, 127
    A, _, opa, _ = operands(dev, rng, M, N, K, False, False, dt, batch=batch)
    B2, b2 = upload(dev, rng.standard_normal((K, N)), dt)
    C = empty_filled(dev, (batch, M, N), cdt)
    ops.gemm(A, B2, C, batch=batch)
    check(C, opa @ b2, K, cdt, 1.0, opa, b2, what="2-D B broadcast")

    B3 = B2.reshape(1, K, N)
    C = empty_filled(dev, (batch, M, N), cdt)
    ops.gemm(A, B3, C, batch=batch, stride_b=0)
    check(C, opa @ b2, K, cdt, 1.0, opa, b2, what="3-D B stride_b=0")

    # nt with B transposed and broadcast (one weight matrix for every batch entry)
    Bt, bt = upload(dev, rng.standard_normal((N, K)), dt)
    C = empty_filled(dev, (batch, M, N), cdt)
    ops.gemm(A, Bt, C, trans_b=True, batch=batch)
    check(C, opa @ bt.T, K, cdt, 1.0, opa, bt.T, what="nt 2-D B broadcast")

    # broadcast A instead
    A2, a2 = upload(dev, rng.standard_normal((M, K)), dt)
    B, b = upload(dev, rng.standard_normal((batch, K, N)), dt)
    C = empty_filled(dev, (batch, M, N), cdt)
    ops.gemm(A2, B, C, batch=batch, stride_a=0)
    check(C, a2 @ b, K, cdt, 1.0, a2, b, what="A stride_a=0")


@pytest.mark.parametrize("dt,cdt", DTYPE_PAIRS, ids=PAIR_IDS)
def test_gemm_explicit_strides(dev, dt, cdt):
    """stride_* in elements: A uses every other matrix of a (2*batch, M, K) tensor, B overlapping
    windows one row apart of a (batch, K, N) tensor, C every other matrix of (2*batch, M, N)
    (the matrices in between stay untouched, bit for bit)."""
    rng = np.random.default_rng(6)
    batch, M, N, K = 3, 33, 31, 127
    A, a = upload(dev, rng.standard_normal((2 * batch, M, K)), dt)
    B, b = upload(dev, rng.standard_normal((batch, K, N)), dt)
    C, c0 = upload(dev, rng.standard_normal((2 * batch, M, N)), cdt)
    ops.gemm(A, B, C, alpha=1.0, beta=0.5, batch=batch, stride_a=2 * M * K, stride_b=N, stride_c=2 * M * N)
    bflat = b.reshape(-1, N)
    got = read(C)
    for i in range(batch):
        opa = a[2 * i]
        opb = bflat[i:i + K]  # rows i .. i+K-1 of the flat (batch*K, N) storage
        ref = opa @ opb + 0.5 * c0[2 * i]
        err = float(np.max(np.abs(got[2 * i] - ref)))
        assert err <= gemm_bound(K, cdt, ref, 1.0, opa, opb, 0.5, c0[2 * i]), f"batch entry {i}: error {err:.3e}"
        np.testing.assert_array_equal(got[2 * i + 1], c0[2 * i + 1], err_msg=f"C matrix {2 * i + 1} was written")


@pytest.mark.parametrize("dt,cdt", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("trans", list(TRANS), ids=list(TRANS))
def test_gemm_split_k_forced_matches_plain(dev, dt, cdt, trans):
    """split_k = s > 1 (s K-slices reduced in fp32) equals the plain path (split_k = 1) to fp32
    rounding and both match the oracle, with alpha/beta and batching."""
    ta, tb = TRANS[trans]
    rng = np.random.default_rng(7)
    for batch, M, N, K, splits in [(1, 33, 31, 1024, (2, 4)), (2, 31, 1, 512, (2, 8)), (1, 1, 127, 99, (3, 9))]:
        A, B, opa, opb = operands(dev, rng, M, N, K, ta, tb, dt, batch=batch if batch > 1 else None)
        c_init = rng.standard_normal((batch, M, N) if batch > 1 else (M, N))
        C1, c0 = upload(dev, c_init, cdt)
        ops.gemm(A, B, C1, trans_a=ta, trans_b=tb, alpha=0.5, beta=0.25, batch=batch, split_k=1)
        plain = read(C1)
        ref = 0.5 * (opa @ opb) + 0.25 * c0
        bound = gemm_bound(K, cdt, ref, 0.5, opa, opb, 0.25, c0)
        assert float(np.max(np.abs(plain - ref))) <= bound
        for s in splits:
            Cs, _ = upload(dev, c_init, cdt)
            assert ops.gemm_plan(A, B, Cs, trans_a=ta, trans_b=tb, batch=batch, split_k=s) == (s, K // s)
            ops.gemm(A, B, Cs, trans_a=ta, trans_b=tb, alpha=0.5, beta=0.25, batch=batch, split_k=s)
            got = read(Cs)
            what = f"{trans} batch={batch} M={M} N={N} K={K} split_k={s}"
            assert float(np.max(np.abs(got - ref))) <= bound, what
            # plain vs split: two fp32 summation orders (+ one output ulp apart after rounding)
            assert float(np.max(np.abs(got - plain))) <= 2 * bound, what


def test_gemm_split_k_must_divide_k(dev):
    A = dev.zeros((4, 100))
    B = dev.zeros((100, 5))
    C = dev.zeros((4, 5))
    with pytest.raises(ValueError, match=r"\[gemm\].*split_k"):
        ops.gemm(A, B, C, split_k=3)


def test_gemm_auto_split_k_lora_shape(dev):
    """The router splits K for a skinny LoRA-shaped output (M = N = 32, K = 8192) per the
    device's split_k_config, keeps a large square GEMM plain, and the split result equals the
    plain path."""
    cfg = dev.split_k_config
    M, N, K = 32, 32, 8192
    rng = np.random.default_rng(8)
    A, B, opa, opb = operands(dev, rng, M, N, K, False, True, "f32")
    C = dev.empty((M, N))
    splits, kps = ops.gemm_plan(A, B, C, trans_b=True)
    assert (splits, kps) == krnl._core.testing.plan_split_k(M, N, K, 1, **cfg)
    assert splits * kps == K
    if dev.capabilities()["kind"] == "cpu":
        assert cfg["min_tiles"] > 0
        assert splits > 1, f"skinny {M}x{N}x{K} not split on cpu (config {cfg})"

    big = dev.empty((1024, 1024))
    assert ops.gemm_plan(big, big, big) == (1, 1024)

    ref = opa @ opb
    bound = gemm_bound(K, "f32", ref, 1.0, opa, opb)
    C_auto, C_plain = dev.empty((M, N)), dev.empty((M, N))
    ops.gemm(A, B, C_auto, trans_b=True)  # auto
    ops.gemm(A, B, C_plain, trans_b=True, split_k=1)
    auto, plain = read(C_auto), read(C_plain)
    assert float(np.max(np.abs(auto - ref))) <= bound
    assert float(np.max(np.abs(plain - ref))) <= bound
    assert float(np.max(np.abs(auto - plain))) <= bound

    # the same routing in every dtype, f32 C from f16/bf16 (LoRA gradient case)
    for dt, cdt in [(a, c) for a, c in DTYPE_PAIRS[1:] if a in device_dtypes(dev)]:
        A, B, opa, opb = operands(dev, rng, M, N, K, False, True, dt)
        C = empty_filled(dev, (M, N), cdt)
        assert ops.gemm_plan(A, B, C, trans_b=True)[0] == splits
        ops.gemm(A, B, C, trans_b=True)
        check(C, opa @ opb, K, cdt, 1.0, opa, opb, what=f"auto {dt}->{cdt}")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_gemm_lora_shapes(dev, dt):
    """The LoRA forward/backward GEMMs (docs/architecture.md, 'LoRA') at T=256, in=2048, out=5632, R=32,
    auto-routed, plus the large frozen-weight product y = x*W^T."""
    rng = np.random.default_rng(9)
    T, IN, OUT, R = 256, 2048, 5632, 32
    x, xf = upload(dev, rng.standard_normal((T, IN)), dt)
    a, af = upload(dev, rng.standard_normal((R, IN)) / 16, dt)
    dy, dyf = upload(dev, rng.standard_normal((T, OUT)), dt)
    bmat, bf = upload(dev, rng.standard_normal((OUT, R)) / 16, dt)
    s = 2.0
    # a (T, R) activation standing in for both t (forward) and dt (backward), made on the host
    t_dev, t_f = upload(dev, rng.standard_normal((T, R)), dt)
    cases = [  # (what, A, B, trans_a, trans_b, alpha, C shape, reference, op(A), op(B), K)
        ("t = x A^T (nt)", x, a, False, True, 1.0, (T, R), xf @ af.T, xf, af.T, IN),
        ("dB = s dy^T t (tn)", dy, t_dev, True, False, s, (OUT, R), s * dyf.T @ t_f, dyf.T, t_f, T),
        ("dt = s dy B (nn)", dy, bmat, False, False, s, (T, R), s * dyf @ bf, dyf, bf, OUT),
        ("dA = dt^T x (tn)", t_dev, x, True, False, 1.0, (R, IN), t_f.T @ xf, t_f.T, xf, T),
    ]
    for what, A, B, ta, tb, alpha, shape, ref, opa, opb, K in cases:
        for cdt in sorted({dt, "f32"}):
            C = empty_filled(dev, shape, cdt)
            ops.gemm(A, B, C, trans_a=ta, trans_b=tb, alpha=alpha)
            check(C, ref, K, cdt, alpha, opa, opb, what=f"{what} -> {cdt}")
    # y = x W^T with the frozen weight (out, in), as stored in checkpoints
    w, wf = upload(dev, rng.standard_normal((OUT, IN)) / 32, dt)
    y = empty_filled(dev, (T, OUT), dt)
    ops.gemm(x, w, y, trans_b=True)
    check(y, xf @ wf.T, IN, dt, 1.0, xf, wf.T, what="y = x W^T")


# (M, N, K): one side at most 64 wide (a LoRA rank, or q|k|v's 3 ranks grouped), the other or K
# long, as lora_group.py issues them; sizes that are and are not multiples of 16.
SKINNY = [(16, 16, 16), (33, 16, 272), (130, 48, 48), (96, 64, 1040), (48, 144, 272), (16, 257, 32), (31, 1, 48)]


@pytest.mark.parametrize("trans", list(TRANS), ids=list(TRANS))
@pytest.mark.parametrize("dt,cdt", DTYPE_PAIRS[1:], ids=PAIR_IDS[1:])
def test_gemm_skinny_shapes(dev, trans, dt, cdt):
    """The LoRA-shaped products with alpha and beta, into a prefilled C and into a column block."""
    if dt not in device_dtypes(dev):
        pytest.skip(f"{dt} not on {dev.name}")
    ta, tb = TRANS[trans]
    rng = np.random.default_rng(11)
    for M, N, K in SKINNY:
        A, B, opa, opb = operands(dev, rng, M, N, K, ta, tb, dt)
        C, c0 = upload(dev, rng.standard_normal((M, N)), cdt)
        ops.gemm(A, B, C, trans_a=ta, trans_b=tb, alpha=0.5, beta=-1.25)
        check(C, 0.5 * opa @ opb - 1.25 * c0, K, cdt, 0.5, opa, opb, -1.25, c0, what=f"{trans} {M}x{N}x{K}")
        # C as columns 16:16+N of a wider buffer (q|k|v's t blocks), beta 0 over NaNs
        wide = empty_filled(dev, (M, N + 32), cdt)
        ops.gemm(A, B, wide[:, 16:16 + N], trans_a=ta, trans_b=tb)
        got = read(wide)
        assert np.all(np.isnan(got[:, :16])) and np.all(np.isnan(got[:, 16 + N:])), f"{trans} {M}x{N}x{K}: wrote outside"
        check(wide[:, 16:16 + N], opa @ opb, K, cdt, 1.0, opa, opb, what=f"{trans} {M}x{N}x{K} block")


@pytest.mark.parametrize("dt,cdt", DTYPE_PAIRS, ids=PAIR_IDS)
def test_gemm_offset_views(dev, dt, cdt):
    """Operands that are views by offset into larger buffers (a row range, one matrix of a
    stack): the op reads and writes exactly its window."""
    rng = np.random.default_rng(10)
    M, N, K = 31, 33, 127
    bigA, a = upload(dev, rng.standard_normal((M + 8, K)), dt)
    stackB, b = upload(dev, rng.standard_normal((3, N, K)), dt)
    stackC, c = upload(dev, rng.standard_normal((4, M, N)), cdt)
    A, B, C = bigA[5:5 + M], stackB[1], stackC[2]
    ops.gemm(A, B, C, trans_b=True, alpha=1.0, beta=-0.5)
    opa, opb = a[5:5 + M], b[1].T
    ref = opa @ opb - 0.5 * c[2]
    got = read(stackC)
    assert float(np.max(np.abs(got[2] - ref))) <= gemm_bound(K, cdt, ref, 1.0, opa, opb, -0.5, c[2])
    np.testing.assert_array_equal(got[[0, 1, 3]], c[[0, 1, 3]], err_msg="write outside the C view")
    # batched over a slice of a stack
    stackA, a3 = upload(dev, rng.standard_normal((4, M, K)), dt)
    out, c3 = upload(dev, rng.standard_normal((5, M, N)), cdt)
    ops.gemm(stackA[1:3], stackB[0:2], out[2:4], trans_b=True, batch=2)
    ref = a3[1:3] @ np.swapaxes(b[0:2], -1, -2)
    got = read(out)
    assert float(np.max(np.abs(got[2:4] - ref))) <= gemm_bound(K, cdt, ref, 1.0, a3[1:3], b[0:2])
    np.testing.assert_array_equal(got[[0, 1, 4]], c3[[0, 1, 4]], err_msg="write outside the batched C view")


@pytest.mark.parametrize("trans", list(TRANS), ids=list(TRANS))
@pytest.mark.parametrize("dt,cdt", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("split_k", [1, 3])
def test_gemm_row_strided_views(dev, trans, dt, cdt, split_k):
    """Column blocks of wider matrices (row stride > columns), as the fused q|k|v projection
    uses: each operand a block of a wider tensor; C's block is written with beta != 0 and
    nothing outside it moves."""
    ta, tb = TRANS[trans]
    rng = np.random.default_rng(11)
    M, N, K = 31, 33, 99
    a_shape, b_shape = ((K, M) if ta else (M, K)), ((N, K) if tb else (K, N))
    wideA, a = upload(dev, rng.standard_normal((a_shape[0], a_shape[1] + 7)), dt)
    wideB, b = upload(dev, rng.standard_normal((b_shape[0], b_shape[1] + 5)), dt)
    wideC, c = upload(dev, rng.standard_normal((M, N + 9)), cdt)
    A, B, C = wideA[:, 3:3 + a_shape[1]], wideB[:, 5:], wideC[:, 4:4 + N]
    assert not (A.is_contiguous() or B.is_contiguous() or C.is_contiguous())
    ops.gemm(A, B, C, trans_a=ta, trans_b=tb, alpha=0.75, beta=0.5, split_k=split_k)
    sa, sb = a[:, 3:3 + a_shape[1]], b[:, 5:]
    opa, opb = (sa.T if ta else sa), (sb.T if tb else sb)
    ref = 0.75 * opa @ opb + 0.5 * c[:, 4:4 + N]
    got = read(wideC)
    assert float(np.max(np.abs(got[:, 4:4 + N] - ref))) <= gemm_bound(K, cdt, ref, 0.75, opa, opb, 0.5, c[:, 4:4 + N])
    outside = np.ones(c.shape, bool)
    outside[:, 4:4 + N] = False
    np.testing.assert_array_equal(got[outside], c[outside], err_msg="write outside the C block")


def test_gemm_row_strided_operand_broadcast_over_a_batch(dev):
    rng = np.random.default_rng(12)
    wide, w = upload(dev, rng.standard_normal((5, 12)), "f32")
    stackB, b = upload(dev, rng.standard_normal((3, 8, 4)), "f32")
    out = dev.empty((3, 5, 4))
    ops.gemm(wide[:, 2:10], stackB, out, batch=3)  # the (5, 8) block times each of 3 matrices
    np.testing.assert_allclose(read(out), w[:, 2:10] @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trans", list(TRANS), ids=list(TRANS))
@pytest.mark.parametrize("dt,cdt", DTYPE_PAIRS, ids=PAIR_IDS)
def test_gemm_strided_3d_views(dev, trans, dt, cdt):
    """3-D views of row and column ranges of every matrix of a stack (causal attention's query
    row blocks and key prefixes): batch entries at the view's leading stride, rows at its row
    stride; C's windows are written with beta != 0 and nothing outside them moves."""
    ta, tb = TRANS[trans]
    rng = np.random.default_rng(13)
    batch, M, N, K = 5, 17, 13, 29
    a_shape, b_shape = ((K, M) if ta else (M, K)), ((N, K) if tb else (K, N))
    bigA, a = upload(dev, rng.standard_normal((batch, a_shape[0] + 6, a_shape[1] + 3)), dt)
    bigB, b = upload(dev, rng.standard_normal((batch, b_shape[0] + 2, b_shape[1])), dt)
    bigC, c = upload(dev, rng.standard_normal((batch, M + 4, N + 5)), cdt)
    A = bigA[:, 6:, 1:1 + a_shape[1]]
    B = bigB[:, :b_shape[0]]
    C = bigC[:, 4:, 5:]
    assert not (A.is_contiguous() or B.is_contiguous() or C.is_contiguous())
    ops.gemm(A, B, C, trans_a=ta, trans_b=tb, alpha=0.5, beta=-0.75, batch=batch)
    sa, sb = a[:, 6:, 1:1 + a_shape[1]], b[:, :b_shape[0]]
    opa, opb = (np.swapaxes(sa, -1, -2) if ta else sa), (np.swapaxes(sb, -1, -2) if tb else sb)
    c0 = c[:, 4:, 5:]
    ref = 0.5 * (opa @ opb) - 0.75 * c0
    got = read(bigC)
    assert float(np.max(np.abs(got[:, 4:, 5:] - ref))) <= gemm_bound(K, cdt, ref, 0.5, opa, opb, -0.75, c0)
    outside = np.ones(c.shape, bool)
    outside[:, 4:, 5:] = False
    np.testing.assert_array_equal(got[outside], c[outside], err_msg="write outside the C windows")
    with pytest.raises(ValueError, match="leading dimension must equal batch"):
        ops.gemm(A, B, C, trans_a=ta, trans_b=tb, batch=batch - 1)
