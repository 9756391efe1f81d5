"""The Metal backend's mixture-of-experts ops beyond the op suite (tests/test_moe_ops.py runs that
on metal-sim too): the grouped GEMMs (moe_gemm, moe_gemm_weight_grad, moe_quantized_matmul) in
blocks under the per-dispatch budget, moe_quantized_matmul's codes that straddle words and f32
scales with 16-bit x (quantized_matmul's numbers per expert), moe_sort with many pairs per thread,
and a routing that no host checked (ids, slot, tokens and offsets come from earlier kernels of the
step) kept inside every buffer."""
import numpy as np
import pytest

import krnl
from krnl import ops

import conftest
from conftest import U32, UNIT_ROUNDOFF, assert_close_elementwise, dispatch_budget, empty_filled, read, to_dev, upload
from test_moe_ops import random_ids, sort_ref, sorted_pairs

GPU = dict(apple_family=9)  # the GPU metal-sim stands for in the suite


@pytest.fixture
def sim():
    if conftest.METAL_SIM is None:
        pytest.skip("metal-sim is not registered")
    return krnl.device("metal-sim")


def last_records(prefix):
    return [r for r in krnl._core.testing.metal_sim_last_step() if r["kernel"].startswith(prefix)]


def within_budget(r, budget):
    """A block's estimate fits the budget, or it is one tile (nothing smaller can be dispatched)."""
    ms = krnl._core.testing.metal_estimate_ms(GPU, r["flops"], r["bytes"], r["rate"])
    return ms <= budget or r["grid"][:2] == (1, 1)


def binding_offset(r, index):
    return {i: off for i, _, _, _, off in r["buffers"]}[index]


@pytest.mark.parametrize("transpose", [True, False], ids=["linear", "input-grad"])
def test_moe_gemm_over_the_dispatch_budget_runs_in_blocks(sim, transpose):
    """moe_gemm estimated over the per-dispatch budget runs as blocks of the experts' row tiles
    (numbered across experts: the host never sees the offsets) and of output columns, each within
    the budget, together covering the grid once; the result is the one-dispatch result bit for bit."""
    rng = np.random.default_rng(3)
    N, E, K, O, I = 70, 5, 2, 70, 45
    _, _, offsets = sorted_pairs(sim, random_ids(rng, N, E, K, "spread"), E)
    P, cols = N * K, O if transpose else I
    w, _ = upload(sim, rng.standard_normal((E, O, I)), "f16")
    x, _ = upload(sim, rng.standard_normal((P, I if transpose else O)), "f16")
    out0 = rng.standard_normal((P, cols))
    whole, split = to_dev(sim, out0, "f16"), to_dev(sim, out0, "f16")
    ops.moe_gemm(x, w, offsets, whole, transpose, alpha=1.5, beta=0.25)
    (one,) = last_records("moe_gemm")
    budget = 0.3 * krnl._core.testing.metal_estimate_ms(GPU, one["flops"], one["bytes"], one["rate"])
    with dispatch_budget(sim, budget):
        ops.moe_gemm(x, w, offsets, split, transpose, alpha=1.5, beta=0.25)
        recs = last_records("moe_gemm")
    assert len(recs) > 1 and {r["kernel"] for r in recs} == {one["kernel"]} and one["rate"] == "gemm"
    tiles, col_tiles = one["grid"][1], one["grid"][0]
    cover = np.zeros((tiles, col_tiles), np.int32)
    for r in recs:
        assert within_budget(r, budget), r["grid"]
        a = np.frombuffer(r["args"], np.uint32)  # MoeGemmArgs: E, P, M, N, ..., tile0 at 10
        c0 = (binding_offset(r, 2) - binding_offset(one, 2)) // 2
        assert c0 % 32 == 0 and int(a[3]) == min(cols - c0, 32 * r["grid"][0])
        cover[int(a[10]):int(a[10]) + r["grid"][1], c0 // 32:c0 // 32 + r["grid"][0]] += 1
    assert (cover == 1).all()
    np.testing.assert_array_equal(read(split), read(whole))


def test_moe_gemm_weight_grad_over_the_dispatch_budget_runs_in_blocks(sim):
    """moe_gemm_weight_grad over the budget runs as blocks of rows and columns of every out[e]
    (grid.z the experts, an empty one among them), covering out once, bit for bit as one dispatch."""
    rng = np.random.default_rng(4)
    N, E, K, M, Nc = 60, 7, 2, 70, 45
    _, _, offsets = sorted_pairs(sim, random_ids(rng, N, E, K, "one"), E)
    assert (np.diff(read(offsets, np.int64)) == 0).any()
    a, _ = upload(sim, rng.standard_normal((N * K, M)), "bf16")
    b, _ = upload(sim, rng.standard_normal((N * K, Nc)), "bf16")
    out0 = rng.standard_normal((E, M, Nc))
    whole, split = to_dev(sim, out0), to_dev(sim, out0)
    ops.moe_gemm_weight_grad(a, b, offsets, whole, alpha=2.0, beta=0.5)
    (one,) = last_records("moe_gemm_weight_grad")
    budget = 0.3 * krnl._core.testing.metal_estimate_ms(GPU, one["flops"], one["bytes"], one["rate"])
    with dispatch_budget(sim, budget):
        ops.moe_gemm_weight_grad(a, b, offsets, split, alpha=2.0, beta=0.5)
        recs = last_records("moe_gemm_weight_grad")
    assert len(recs) > 1 and {r["kernel"] for r in recs} == {"moe_gemm_weight_grad_bf16_f32"}
    cover = np.zeros((M, Nc), np.int32)
    for r in recs:
        assert within_budget(r, budget) and r["grid"][2] == E, r["grid"]
        a_ = np.frombuffer(r["args"], np.uint32)  # MoeGemmArgs: E, P, M, N first
        r0, c0 = divmod((binding_offset(r, 2) - binding_offset(one, 2)) // 4, Nc)
        assert r0 % 32 == 0 and c0 % 32 == 0
        cover[r0:r0 + int(a_[2]), c0:c0 + int(a_[3])] += 1
    assert (cover == 1).all()
    np.testing.assert_array_equal(read(split), read(whole))


def qweights(dev, rng, E, O, I, bits, gs, sdt):
    """Experts' packed codes (E, O, I bits / 32) i32, scales and biases (E, O, I / gs) in sdt on
    dev, and codes, scales and biases as float64 (what the device holds)."""
    from krnl.quant import affine
    codes = rng.integers(0, 1 << bits, (E, O, I))
    s, s64 = upload(dev, rng.uniform(0.01, 0.2, (E, O, I // gs)) * rng.choice([-1.0, 1.0], (E, O, I // gs)), sdt)
    b, b64 = upload(dev, rng.standard_normal((E, O, I // gs)), sdt)
    w = to_dev(dev, np.stack([affine.pack(codes[e], bits) for e in range(E)]), "i32")
    return w, s, b, (codes, s64, b64)


# MoeQuantizedMatmulArgs (metal/kargs.h) as uint32: E, P, M, K, words, group_size, groups, beta, ldx,
# ldo, m0, tile0, stride_w, stride_s
QARG = {f: i for i, f in enumerate(["E", "P", "M", "K", "words", "group_size", "groups", "beta", "ldx", "ldo", "m0",
                                    "tile0", "stride_w", "stride_s"])}


@pytest.mark.parametrize("transpose", [True, False], ids=["linear", "input-grad"])
def test_moe_quantized_matmul_over_the_dispatch_budget_runs_in_blocks(sim, transpose):
    """moe_quantized_matmul over the per-dispatch budget runs as blocks of the experts' row tiles
    (args.tile0) and of out columns (args.m0, out bound there), each within the budget, together
    covering the grid once; the result is the one-dispatch result bit for bit. 3-bit codes (they
    straddle words) with f32 scales and f16 x; K ragged in the input gradient (K = O = 70)."""
    rng = np.random.default_rng(5)
    N, E, K, O, I, bits, gs = 70, 5, 2, 70, 96, 3, 32
    _, _, offsets = sorted_pairs(sim, random_ids(rng, N, E, K, "spread"), E)
    P, cols = N * K, O if transpose else I
    w, s, b, _ = qweights(sim, rng, E, O, I, bits, gs, "f32")
    x, _ = upload(sim, rng.standard_normal((P, I if transpose else O)), "f16")
    out0 = rng.standard_normal((P, cols))
    whole, split = to_dev(sim, out0, "f16"), to_dev(sim, out0, "f16")
    ops.moe_quantized_matmul(x, w, s, b, offsets, whole, transpose, gs, bits, beta=0.25)
    (one,) = last_records("moe_quantized_matmul")
    assert one["kernel"] == f"moe_quantized_matmul_{'t' if transpose else 'n'}_f16_sf32_b3"
    assert one["rate"] == "quantized_tiled" and one["threads"] == (128, 1, 1)
    budget = 0.3 * krnl._core.testing.metal_estimate_ms(GPU, one["flops"], one["bytes"], one["rate"])
    with dispatch_budget(sim, budget):
        ops.moe_quantized_matmul(x, w, s, b, offsets, split, transpose, gs, bits, beta=0.25)
        recs = last_records("moe_quantized_matmul")
    assert len(recs) > 1 and {r["kernel"] for r in recs} == {one["kernel"]}
    tiles, col_tiles = one["grid"][1], one["grid"][0]
    assert tiles == (P + 31 * E) // 32
    cover = np.zeros((tiles, col_tiles), np.int32)
    for r in recs:
        assert within_budget(r, budget), r["grid"]
        a = np.frombuffer(r["args"], np.uint32)
        c0 = (binding_offset(r, 4) - binding_offset(one, 4)) // 2
        assert c0 % 32 == 0 and int(a[QARG["m0"]]) == c0 and int(a[QARG["M"]]) == min(cols - c0, 32 * r["grid"][0])
        t0 = int(a[QARG["tile0"]])
        cover[t0:t0 + r["grid"][1], c0 // 32:c0 // 32 + r["grid"][0]] += 1
    assert (cover == 1).all()
    np.testing.assert_array_equal(read(split), read(whole))


QSTRADDLE = [(3, 16, "f16", True), (5, 64, "bf16", False), (6, 128, "f16", False), (5, 32, "bf16", True),
             (6, 16, "bf16", True), (3, 128, "f16", False)]


@pytest.mark.parametrize("beta", [0.0, 0.5], ids=["beta0", "beta"])
@pytest.mark.parametrize("bits,gs,dt,transpose", QSTRADDLE,
                         ids=[f"q{b}g{g}-{d}-{'linear' if t else 'input-grad'}" for b, g, d, t in QSTRADDLE])
def test_moe_quantized_matmul_straddling_codes_f32_scales(sim, bits, gs, dt, transpose, beta):
    """3, 5 and 6-bit codes (straddling words) with f32 scales and biases and 16-bit x (the _sf32
    kernels), at every group size: each expert's rows get exactly what quantized_matmul gives them
    (the same tile; where it takes its tiled form too), and the float64 product of x with W_e
    dequantized in f32 and rounded to x's dtype (as the kernels stage it), within f32
    accumulation and out's one rounding. beta == 0 never reads out (NaN there)."""
    rng = np.random.default_rng(bits * 100 + gs)
    N, E, K, O, I = 45, 6, 2, 40, 256
    ids = random_ids(rng, N, E, K, "spread")
    ids[ids == 4] = 5  # expert 4 without rows
    ids[:, 1] = np.where(ids[:, 0] == ids[:, 1], (ids[:, 0] + 1) % 4, ids[:, 1])
    _, _, offsets = sorted_pairs(sim, ids, E)
    off = read(offsets, np.int64)
    P = N * K
    w, s, b, (codes, s64, b64) = qweights(sim, rng, E, O, I, bits, gs, "f32")
    W32 = (np.repeat(s64, gs, axis=2) * codes + np.repeat(b64, gs, axis=2)).astype(np.float32)  # fma in f32
    _, W = upload(sim, W32, dt)  # rounded to x's dtype, as each staged tile is
    x, x64 = upload(sim, rng.standard_normal((P, I if transpose else O)), dt)
    cols = O if transpose else I
    if beta == 0.0:
        out, o64 = empty_filled(sim, (P, cols), dt), np.zeros((P, cols))
    else:
        out, o64 = upload(sim, rng.standard_normal((P, cols)), dt)
    ref_dev = to_dev(sim, o64, dt) if beta else empty_filled(sim, (P, cols), dt)
    ops.moe_quantized_matmul(x, w, s, b, offsets, out, transpose, gs, bits, beta)
    ref, mag = beta * o64, beta * np.abs(o64)
    tiled = []
    for e in range(E):
        r = slice(int(off[e]), int(off[e + 1]))
        We = W[e].T if transpose else W[e]
        ref[r] += x64[r] @ We
        mag[r] += np.abs(x64[r]) @ np.abs(We)
        if off[e + 1] - off[e] > (8 if transpose else 0):  # quantized_matmul's tiled form
            ops.quantized_matmul(x[r], w[e], s[e], b[e], ref_dev[r], transpose, gs, bits, beta)
            tiled.append(r)
    assert off[5] - off[4] == 0 and len(tiled) >= 3
    got = read(out)
    k = I if transpose else O
    assert_close_elementwise(got, ref, UNIT_ROUNDOFF[dt], (k + 4) * U32 * mag, what="out")
    want = read(ref_dev)
    for r in tiled:
        np.testing.assert_array_equal(got[r], want[r])


def test_moe_sort_many_pairs_per_thread(sim):
    """More pairs than moe_sort's 256 threads, on few experts (one empty): each thread counts and
    places a run of pairs, and the pairs still keep their (t, k) order inside every expert."""
    rng = np.random.default_rng(8)
    N, E, K = 700, 6, 3
    ids = np.stack([rng.choice(E - 1, K, replace=False) for _ in range(N)])  # expert 5 empty
    tokens, slot, offsets = sorted_pairs(sim, ids, E)
    rt, rs, ro = sort_ref(ids, E)
    np.testing.assert_array_equal(read(tokens, np.int64), rt)
    np.testing.assert_array_equal(read(slot, np.int64), rs)
    np.testing.assert_array_equal(read(offsets, np.int64), ro)


def test_moe_routing_out_of_range_stays_in_bounds(sim):
    """GPUs trust the routing their own kernels wrote; a bad one still touches no memory outside
    its buffers (metal-sim guards each bound range) and shows: a pair whose expert is out of range
    gets slot -1 and no position (token -1 there), the gather copies a NaN row for such a token,
    the combine reads NaN for such a slot, and offsets that do not rise are clamped."""
    ids = to_dev(sim, np.array([[0, 3], [-1, 1]], np.int32), "i32")
    tokens, slot, offsets = sim.empty((4,), "i32"), sim.empty((2, 2), "i32"), sim.empty((3,), "i32")
    ops.moe_sort(ids, tokens, slot, offsets)
    np.testing.assert_array_equal(read(slot, np.int64), [[0, -1], [-1, 1]])
    np.testing.assert_array_equal(read(tokens, np.int64), [0, 1, -1, -1])
    np.testing.assert_array_equal(read(offsets, np.int64), [0, 1, 2])
    x = to_dev(sim, np.arange(6, dtype=np.float32).reshape(2, 3))
    xs = sim.empty((4, 3))
    ops.moe_gather(x, tokens, xs)
    assert np.isnan(read(xs)[2:]).all() and (read(xs)[:2] == [[0, 1, 2], [3, 4, 5]]).all()
    out = sim.empty((2, 3))
    ops.moe_combine(xs, slot, None, out)
    assert np.isnan(read(out)).all()  # every token has a pair without a slot
    dys, dw = sim.empty((4, 3)), sim.empty((2, 2))
    ops.moe_combine_backward(x, xs, slot, sim.zeros((2, 2)), dys, dw)
    assert np.isnan(read(dw)[[0, 1], [1, 0]]).all()
    bad = to_dev(sim, np.array([0, 9, 1], np.int32), "i32")  # rises past P = 4, then falls
    ops.moe_gemm(xs, sim.zeros((2, 5, 3)), bad, sim.empty((4, 5)))
    ops.moe_gemm_weight_grad(xs, xs, bad, sim.empty((2, 3, 3)))
    # 4-bit codes, I = 32, one group; scales and biases apart (bindings that overlap run unguarded)
    qw, qs, qb = sim.zeros((2, 5, 4), "i32"), sim.zeros((2, 5, 1)), sim.zeros((2, 5, 1))
    ops.moe_quantized_matmul(sim.zeros((4, 32)), qw, qs, qb, bad, sim.empty((4, 5)), True, 32, 4)
    ops.moe_quantized_matmul(sim.zeros((4, 5)), qw, qs, qb, bad, sim.empty((4, 32)), False, 32, 4)
    sim.synchronize()
