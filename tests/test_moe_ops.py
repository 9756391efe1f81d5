"""The mixture-of-experts ops (op_list.h's notes) against float64 numpy references: routing (top-k
of the softmax, ties, the normalised weights, the backward by finite differences), grouping by
expert, the weighted combine, and the grouped GEMMs, at awkward sizes: one token, empty experts,
every token on one expert, E not a power of two."""

import numpy as np
import pytest

from krnl import ops

from conftest import (FLOAT_DTYPES, SUBNORMAL, U32, UNIT_ROUNDOFF, assert_close, assert_close_elementwise, read, to_dev,
                      upload)
from test_ops import assert_fd, fd_grad, reduction_rtol


def softmax64(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def separated_logits(rng, N, E, spread=0.05):
    """(N, E) logits whose values differ by at least `spread` within a row: no rounding of any
    dtype reorders them, so the top-k is the reference's."""
    return np.stack([rng.permutation(E) * spread + rng.uniform(0, 0.2 * spread) for _ in range(N)]) - E * spread / 2


def route_ref(lg, K, norm):
    p = softmax64(lg)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :K]  # a tie to the lower expert
    w = np.take_along_axis(p, ids, -1)
    return ids, (w / w.sum(-1, keepdims=True) if norm else w), p


def route(dev, lg, K, norm):
    N = lg.shape[0]
    ids, w = dev.empty((N, K), "i32"), dev.empty((N, K), "f32")
    ops.moe_route(lg, ids, w, norm)
    return read(ids, np.int64), read(w)


NEK = [(1, 1, 1), (31, 3, 2), (33, 60, 8), (127, 128, 8), (5, 7, 7)]


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("norm", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("N,E,K", NEK, ids=[f"{n}x{e}top{k}" for n, e, k in NEK])
def test_moe_route(dev, N, E, K, norm, dt):
    rng = np.random.default_rng(N * 1000 + E)
    lg, l64 = upload(dev, separated_logits(rng, N, E), dt)
    ids, w = route(dev, lg, K, norm)
    rid, rw, _ = route_ref(l64, K, norm)
    np.testing.assert_array_equal(ids, rid)
    assert_close_elementwise(w, rw, rtol=32 * U32 + 4 * E * U32, what="weights")


def test_moe_route_ties_go_to_the_lower_expert(dev):
    """Equal logits (equal probabilities) pick the lower expert first: a fixed rule on every backend
    (torch.topk leaves the order of ties unspecified; its CPU kernel picks [2, 4, 1] in row 0)."""
    lg = np.array([[0.0, 1.0, 1.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0], [-1.0, 0.5, -1.0, 0.5, 3.0]], np.float32)
    ids, w = route(dev, to_dev(dev, lg), 3, False)
    np.testing.assert_array_equal(ids, [[1, 2, 4], [0, 1, 2], [4, 1, 3]])
    assert_close(w, route_ref(lg.astype(np.float64), 3, False)[1], rtol=8 * U32, what="weights")


@pytest.mark.parametrize("norm", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("with_dprobs", [False, True], ids=["plain", "dprobs"])
@pytest.mark.parametrize("N,E,K", [(1, 1, 1), (31, 5, 2), (33, 60, 8)], ids=["1x1top1", "31x5top2", "33x60top8"])
def test_moe_route_backward(dev, N, E, K, norm, with_dprobs):
    """dlogits against the float64 chain rule through the weights (and dprobs into every p)."""
    rng = np.random.default_rng(7 + N + E)
    lg, l64 = upload(dev, separated_logits(rng, N, E))
    ids, _ = route(dev, lg, K, norm)
    dw, dw64 = upload(dev, rng.standard_normal((N, K)))
    dp_all, dp64 = upload(dev, rng.standard_normal(E))
    dl = dev.empty((N, E), "f32")
    ops.moe_route_backward(lg, to_dev(dev, ids.astype(np.int32), "i32"), dw, dl, norm,
                           dp_all if with_dprobs else None)
    p = softmax64(l64)
    dp = np.tile(dp64, (N, 1)) if with_dprobs else np.zeros((N, E))
    for t in range(N):
        sel = p[t, ids[t]]
        if norm:
            s = sel.sum()
            dp[t, ids[t]] += (dw64[t] - (dw64[t] * sel / s).sum()) / s
        else:
            dp[t, ids[t]] += dw64[t]
    ref = p * (dp - (p * dp).sum(-1, keepdims=True))
    mag = p * (np.abs(dp) + (p * np.abs(dp)).sum(-1, keepdims=True))
    atol = 64 * K * U32 * (mag + np.abs(dp).max() * 1e-3)
    assert_close_elementwise(read(dl), ref, rtol=0.0, atol=atol, what="dlogits")


@pytest.mark.parametrize("norm", [False, True], ids=["raw", "norm"])
def test_moe_route_backward_finite_differences(dev, norm):
    rng = np.random.default_rng(11)
    N, E, K = 3, 6, 3
    l0 = separated_logits(rng, N, E, spread=0.5).astype(np.float32)
    ct = rng.standard_normal((N, K)).astype(np.float32)

    def loss(lv):
        return float(np.sum(route(dev, to_dev(dev, lv), K, norm)[1] * ct))

    ids, _ = route(dev, to_dev(dev, l0), K, norm)
    dl = dev.empty((N, E), "f32")
    ops.moe_route_backward(to_dev(dev, l0), to_dev(dev, ids.astype(np.int32), "i32"), to_dev(dev, ct), dl, norm)
    assert_fd(read(dl), fd_grad(loss, l0), "dlogits")


def sort_ref(ids, E):
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    slot = np.empty_like(order)
    slot[order] = np.arange(flat.size)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=E))])
    return order // ids.shape[1], slot.reshape(ids.shape), offsets


def sorted_pairs(dev, ids, E):
    N, K = ids.shape
    tokens, slot, offsets = dev.empty((N * K,), "i32"), dev.empty((N, K), "i32"), dev.empty((E + 1,), "i32")
    ops.moe_sort(to_dev(dev, ids.astype(np.int32), "i32"), tokens, slot, offsets)
    return tokens, slot, offsets


def random_ids(rng, N, E, K, kind):
    if kind == "one":  # every token on the same experts: the others empty
        return np.tile(np.arange(K)[::-1] + (E - K) // 2, (N, 1))
    return np.stack([rng.choice(E, K, replace=False) for _ in range(N)])


CASES = [(1, 1, 1, "spread"), (31, 7, 2, "spread"), (33, 60, 8, "spread"), (127, 5, 3, "one"), (2, 128, 8, "spread")]
CASE_IDS = [f"{n}x{e}top{k}-{kind}" for n, e, k, kind in CASES]


@pytest.mark.parametrize("N,E,K,kind", CASES, ids=CASE_IDS)
def test_moe_sort(dev, N, E, K, kind):
    ids = random_ids(np.random.default_rng(N + E), N, E, K, kind)
    tokens, slot, offsets = sorted_pairs(dev, ids, E)
    rt, rs, ro = sort_ref(ids, E)
    np.testing.assert_array_equal(read(tokens, np.int64), rt)
    np.testing.assert_array_equal(read(slot, np.int64), rs)
    np.testing.assert_array_equal(read(offsets, np.int64), ro)


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("N,E,K,kind", CASES, ids=CASE_IDS)
def test_moe_gather(dev, N, E, K, kind, dt):
    """Rows by moe_sort's tokens, copied exactly (tokens written by the sort, in the same step)."""
    rng = np.random.default_rng(N * K)
    ids = random_ids(rng, N, E, K, kind)
    x, x64 = upload(dev, rng.standard_normal((N, 31)), dt)
    with dev.step():
        tokens, _, _ = sorted_pairs(dev, ids, E)
        out = dev.empty((N * K, 31), dt)
        ops.moe_gather(x, tokens, out)
    np.testing.assert_array_equal(read(out), x64[sort_ref(ids, E)[0]])


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "gather-backward"])
@pytest.mark.parametrize("N,E,K,kind", CASES[1:], ids=CASE_IDS[1:])
def test_moe_combine(dev, N, E, K, kind, weighted, dt):
    rng = np.random.default_rng(3 * N + K)
    C = 33
    ids = random_ids(rng, N, E, K, kind)
    _, slot, _ = sorted_pairs(dev, ids, E)
    s = read(slot, np.int64)
    ys, y64 = upload(dev, rng.standard_normal((N * K, C)), dt)
    w, w64 = upload(dev, rng.uniform(0, 1, (N, K)) if weighted else np.ones((N, K)))
    out, o64 = upload(dev, rng.standard_normal((N, C)), dt)
    ops.moe_combine(ys, slot, w if weighted else None, out, 0.5)
    ref = 0.5 * o64 + np.einsum("nk,nkc->nc", w64, y64[s])
    mag = 0.5 * np.abs(o64) + np.einsum("nk,nkc->nc", np.abs(w64), np.abs(y64[s]))
    assert_close_elementwise(read(out), ref, rtol=0.0, atol=(UNIT_ROUNDOFF[dt] + 8 * (K + 1) * U32) * mag, what="out")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("N,E,K,kind", CASES, ids=CASE_IDS)
def test_moe_combine_backward(dev, N, E, K, kind, dt):
    rng = np.random.default_rng(5 * N + K)
    C = 31
    ids = random_ids(rng, N, E, K, kind)
    _, slot, _ = sorted_pairs(dev, ids, E)
    s = read(slot, np.int64)
    dout, d64 = upload(dev, rng.standard_normal((N, C)), dt)
    ys, y64 = upload(dev, rng.standard_normal((N * K, C)), dt)
    w, w64 = upload(dev, rng.uniform(0, 1, (N, K)))
    dys, dw = dev.empty((N * K, C), dt), dev.empty((N, K), "f32")
    ops.moe_combine_backward(dout, ys, slot, w, dys, dw)
    ref = np.empty((N * K, C))
    ref[s.reshape(-1)] = (w64[:, :, None] * d64[:, None, :]).reshape(N * K, C)
    assert_close_elementwise(read(dys), ref, rtol=UNIT_ROUNDOFF[dt] + 2 * U32, atol=SUBNORMAL[dt], what="dys")
    rdw = np.einsum("nc,nkc->nk", d64, y64[s])
    mag = np.einsum("nc,nkc->nk", np.abs(d64), np.abs(y64[s]))
    assert_close_elementwise(read(dw), rdw, rtol=0.0, atol=reduction_rtol(C) * mag, what="dweights")


def gemm_rows(dev, N, E, K, kind, seed):
    """offsets of a routing of N tokens (moe_sort's) and P = N K."""
    ids = random_ids(np.random.default_rng(seed), N, E, K, kind)
    _, _, offsets = sorted_pairs(dev, ids, E)
    return offsets, read(offsets, np.int64), N * K


# Each routing case at 37 x 33 (per element), and routings of whole 16-byte units (multiples of
# 8), which take the GPUs' vector paths (CUDA's cp.async tiles): 16 or 24 columns (the narrow
# tiles of a LoRA's r), 136 (two column tiles), k of 264 (a last partial step) or 24 (under one
# step); 300 tokens top-2 over 5 experts average 120 rows an expert (128-row tiles), 33 tokens
# top-2 over 60 few (64-row tiles).
UNIT_ROWS = [(300, 5, 2, "spread"), (33, 60, 2, "spread"), (127, 5, 3, "one")]


def gemm_sizes(odd, units):
    """(N, E, K, kind, rows, cols) cases and their ids: CASES at `odd`, UNIT_ROWS at each of `units`."""
    cases = [(*c, *odd) for c in CASES] + [(*u, *rc) for u in UNIT_ROWS for rc in units]
    return cases, [f"{n}x{e}top{k}-{kind}-{r}x{c}" for n, e, k, kind, r, c in cases]


GEMM_SIZES, GEMM_IDS = gemm_sizes((37, 33), [(16, 264), (136, 24), (24, 136)])
GRAD_SIZES, GRAD_IDS = gemm_sizes((17, 33), [(16, 264), (136, 16), (40, 136)])


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("transpose", [True, False], ids=["linear", "input-grad"])
@pytest.mark.parametrize("N,E,K,kind,O,I", GEMM_SIZES, ids=GEMM_IDS)
def test_moe_gemm(dev, N, E, K, kind, O, I, transpose, dt):
    rng = np.random.default_rng(N + 2 * E + K + O)
    offsets, off, P = gemm_rows(dev, N, E, K, kind, N * E)
    w, w64 = upload(dev, rng.standard_normal((E, O, I)) / np.sqrt(I), dt)
    x, x64 = upload(dev, rng.standard_normal((P, I if transpose else O)), dt)
    out, o64 = upload(dev, rng.standard_normal((P, O if transpose else I)), dt)
    ops.moe_gemm(x, w, offsets, out, transpose, alpha=1.5, beta=0.25)
    ref, mag = 0.25 * o64, 0.25 * np.abs(o64)
    for e in range(E):
        r = slice(off[e], off[e + 1])
        We = w64[e].T if transpose else w64[e]
        ref[r] += 1.5 * x64[r] @ We
        mag[r] += 1.5 * np.abs(x64[r]) @ np.abs(We)
    assert_close_elementwise(read(out), ref, rtol=0.0, atol=(UNIT_ROUNDOFF[dt] + reduction_rtol(max(O, I))) * mag,
                             what="out")


@pytest.mark.parametrize("dt,odt", [("f32", "f32"), ("f16", "f32"), ("bf16", "f32"), ("bf16", "bf16")])
@pytest.mark.parametrize("N,E,K,kind,M,Nc", GRAD_SIZES, ids=GRAD_IDS)
def test_moe_gemm_weight_grad(dev, N, E, K, kind, M, Nc, dt, odt):
    rng = np.random.default_rng(N + 3 * E + K + M)
    offsets, off, P = gemm_rows(dev, N, E, K, kind, N * E + 1)
    a, a64 = upload(dev, rng.standard_normal((P, M)), dt)
    b, b64 = upload(dev, rng.standard_normal((P, Nc)), dt)
    out, o64 = upload(dev, rng.standard_normal((E, M, Nc)), odt)
    ops.moe_gemm_weight_grad(a, b, offsets, out, alpha=2.0, beta=0.5)
    ref, mag = 0.5 * o64, 0.5 * np.abs(o64)
    for e in range(E):
        r = slice(off[e], off[e + 1])
        ref[e] += 2.0 * a64[r].T @ b64[r]
        mag[e] += 2.0 * np.abs(a64[r]).T @ np.abs(b64[r])
    n = int(np.diff(off).max())
    assert_close_elementwise(read(out), ref, rtol=0.0, atol=(UNIT_ROUNDOFF[odt] + reduction_rtol(n + 1)) * mag,
                             what="out")
    empty = np.diff(off) == 0
    if empty.any():  # an expert without rows: beta * out exactly
        np.testing.assert_array_equal(read(out)[empty], (0.5 * o64)[empty].astype(np.float32))


def test_moe_expert_block_finite_differences(dev):
    """The ops chained as a model uses them (route, sort, gather, two grouped GEMMs, combine) and
    their backward give the gradient of x and of the routing logits that finite differences give."""
    rng = np.random.default_rng(5)
    N, E, K, C, F = 4, 5, 2, 6, 3
    x0 = rng.standard_normal((N, C)).astype(np.float32)
    l0 = separated_logits(rng, N, E, spread=0.5).astype(np.float32)
    W1 = to_dev(dev, rng.standard_normal((E, F, C)) / np.sqrt(C))
    W2 = to_dev(dev, rng.standard_normal((E, C, F)) / np.sqrt(F))
    ct = rng.standard_normal((N, C)).astype(np.float32)

    def forward(xv, lv):
        x, lg = to_dev(dev, xv), to_dev(dev, lv)
        ids, w = dev.empty((N, K), "i32"), dev.empty((N, K), "f32")
        ops.moe_route(lg, ids, w, True)
        tokens, slot, offsets = dev.empty((N * K,), "i32"), dev.empty((N, K), "i32"), dev.empty((E + 1,), "i32")
        ops.moe_sort(ids, tokens, slot, offsets)
        xs, h, ys, out = (dev.empty(s, "f32") for s in ((N * K, C), (N * K, F), (N * K, C), (N, C)))
        ops.moe_gather(x, tokens, xs)
        ops.moe_gemm(xs, W1, offsets, h)
        ops.moe_gemm(h, W2, offsets, ys)
        ops.moe_combine(ys, slot, w, out)
        return dict(x=x, lg=lg, ids=ids, w=w, slot=slot, offsets=offsets, h=h, ys=ys, out=out)

    s = forward(x0, l0)
    dys, dw = dev.empty((N * K, C), "f32"), dev.empty((N, K), "f32")
    ops.moe_combine_backward(to_dev(dev, ct), s["ys"], s["slot"], s["w"], dys, dw)
    dh, dxs, dx, dl = dev.empty((N * K, F)), dev.empty((N * K, C)), dev.empty((N, C)), dev.empty((N, E))
    ops.moe_gemm(dys, W2, s["offsets"], dh, transpose=False)
    ops.moe_gemm(dh, W1, s["offsets"], dxs, transpose=False)
    ops.moe_combine(dxs, s["slot"], None, dx)
    ops.moe_route_backward(s["lg"], s["ids"], dw, dl, True)
    assert_fd(read(dx), fd_grad(lambda xv: float(np.sum(read(forward(xv, l0)["out"]) * ct)), x0), "dx")
    assert_fd(read(dl), fd_grad(lambda lv: float(np.sum(read(forward(x0, lv)["out"]) * ct)), l0), "dlogits")


def test_moe_bad_calls(dev):
    x, w = dev.zeros((4, 8)), dev.zeros((3, 5, 8))
    offsets = to_dev(dev, np.array([0, 1, 3, 4], np.int32), "i32")
    with pytest.raises(ValueError, match=r"\[moe_gemm\] w must be \(E, O, I\) with E = 2"):
        ops.moe_gemm(x, w, to_dev(dev, np.array([0, 2, 4], np.int32), "i32"), dev.zeros((4, 5)))
    with pytest.raises(ValueError, match=r"\[moe_gemm\] x must be \(P, 5\)"):
        ops.moe_gemm(x, w, offsets, dev.zeros((4, 8)), transpose=False)
    with pytest.raises(ValueError, match=r"\[moe_route\] ids must hold 1 to E = 3"):
        ops.moe_route(dev.zeros((2, 3)), dev.empty((2, 4), "i32"), dev.empty((2, 4)))
    with pytest.raises(ValueError, match=r"\[moe_combine\] ys must have N K = 4 rows"):
        ops.moe_combine(dev.zeros((5, 8)), dev.zeros((2, 2), "i32"), None, dev.zeros((2, 8)))
    with pytest.raises(ValueError, match=r"\[moe_gemm_weight_grad\] out must have shape \(3, 8, 5\)"):
        ops.moe_gemm_weight_grad(x, dev.zeros((4, 5)), offsets, dev.zeros((3, 5, 8)))


def test_moe_data_errors_on_the_cpu():
    """Expert ids and offsets are data: the CPU names the bad one (GPUs trust moe_sort's)."""
    import krnl
    dev = krnl.device("cpu")
    ids = to_dev(dev, np.array([[0, 3]], np.int32), "i32")
    with pytest.raises(ValueError, match=r"\[moe_sort\] expert 3 at pair 1 is out of range \[0, 3\)"):
        ops.moe_sort(ids, dev.empty((2,), "i32"), dev.empty((1, 2), "i32"), dev.empty((4,), "i32"))
    with pytest.raises(ValueError, match=r"\[moe_gemm\] offsets must rise from 0 to 4"):
        ops.moe_gemm(dev.zeros((4, 8)), dev.zeros((2, 5, 8)), to_dev(dev, np.array([0, 3, 2], np.int32), "i32"),
                     dev.zeros((4, 5)))


QCASES = [(1, 1, 1, "spread", 4, 32), (31, 7, 2, "spread", 4, 64), (33, 60, 8, "spread", 3, 32),
          (127, 5, 3, "one", 8, 16)]


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("transpose", [True, False], ids=["linear", "input-grad"])
@pytest.mark.parametrize("N,E,K,kind,bits,gs", QCASES,
                         ids=[f"{n}x{e}top{k}-{kd}-q{b}g{g}" for n, e, k, kd, b, g in QCASES])
def test_moe_quantized_matmul(dev, N, E, K, kind, bits, gs, transpose, dt):
    """Each expert's rows times its dequantized W_e (MLX's affine codes), beta accumulating, against
    float64 from the same rounded inputs: quantized_matmul's bound per expert."""
    from krnl.quant import affine

    rng = np.random.default_rng(N + E + bits)
    O, I = 40, 64
    offsets, off, P = gemm_rows(dev, N, E, K, kind, N * E + 2)
    codes = rng.integers(0, 1 << bits, (E, O, I))
    s, s64 = upload(dev, rng.uniform(0.01, 0.2, (E, O, I // gs)) * rng.choice([-1.0, 1.0], (E, O, I // gs)), dt)
    b, b64 = upload(dev, rng.standard_normal((E, O, I // gs)), dt)
    W = np.repeat(s64, gs, axis=2) * codes + np.repeat(b64, gs, axis=2)   # (E, O, I)
    w = to_dev(dev, np.stack([affine.pack(codes[e], bits) for e in range(E)]), "i32")
    x, x64 = upload(dev, rng.standard_normal((P, I if transpose else O)), dt)
    out, o64 = upload(dev, rng.standard_normal((P, O if transpose else I)), dt)
    ops.moe_quantized_matmul(x, w, s, b, offsets, out, transpose, gs, bits, beta=0.5)
    ref, mag = 0.5 * o64, 0.5 * np.abs(o64)
    for e in range(E):
        r = slice(off[e], off[e + 1])
        We = W[e].T if transpose else W[e]
        ref[r] += x64[r] @ We
        mag[r] += np.abs(x64[r]) @ np.abs(We)
    k = I if transpose else O
    tol = (k + 4) * U32 * mag + (2 * UNIT_ROUNDOFF[dt] * mag if dt != "f32" else 0)
    assert_close_elementwise(read(out), ref, UNIT_ROUNDOFF[dt], tol, what="out")


def test_moe_quantized_matmul_bad_calls(dev):
    offsets = to_dev(dev, np.array([0, 1, 4], np.int32), "i32")
    w, s = dev.zeros((2, 8, 8), "i32"), dev.zeros((2, 8, 2))
    with pytest.raises(ValueError, match=r"\[moe_quantized_matmul\] w, scales and biases must be \(E, \.\.\.\) "
                                         r"with E = 2"):
        ops.moe_quantized_matmul(dev.zeros((4, 64)), dev.zeros((3, 8, 8), "i32"), s, s, offsets, dev.zeros((4, 8)))
    with pytest.raises(ValueError, match=r"\[moe_quantized_matmul\] x must be \(P, 64\)"):
        ops.moe_quantized_matmul(dev.zeros((4, 32)), w, s, s, offsets, dev.zeros((4, 8)), group_size=32)
