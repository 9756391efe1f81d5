"""krnl's Metal kernels for the loss, the embedding and the optimizer step (metal/cross_entropy.metal,
metal/embedding.metal, metal/optimizer.metal) on the MSL simulator (tools/mslsim) against float64
numpy.

Same approach as test_metal_kernels.py, whose helpers (kargs.h parsed into ctypes, the barrier-
free copies of a kernel file, the thread orders) are reused: each .metal file is built once per
module in parallel (cached by content hash under MSLSIM_CACHE), sizes 1, 31, 33, 127 plus one
realistic, f32 and f16, reductions under the simulator's random thread order and bit for bit
across orders where the kernel promises determinism."""

import numpy as np
import pytest

from test_metal_kernels import DT, KARGS, METAL, ORDERS, SIZES, _caught, _without_barriers, build_all, f64

CrossEntropyArgs, EmbeddingArgs, AdamwArgs, ReduceArgs = (
    KARGS[n] for n in ("CrossEntropyArgs", "EmbeddingArgs", "AdamwArgs", "ReduceArgs"))

rng = np.random.default_rng(2468)
U32 = 2.0 ** -24  # unit roundoff of float
U16 = 2.0 ** -11  # unit roundoff of half
def test_kargs_layout_loss_optim():
    assert [f for f, _ in CrossEntropyArgs._fields_] == ["rows", "V", "ignore_index", "scale", "write_grad",
                                                       "scale_by"]
    assert [f for f, _ in EmbeddingArgs._fields_] == ["n", "C", "V"]
    assert [f for f, _ in AdamwArgs._fields_] == ["n", "step_size", "bc2_sqrt", "decay", "beta1", "beta2", "eps",
                                                  "grad_scale", "device_scalars", "use_flag", "l2"]
    assert [f for f, _ in ReduceArgs._fields_] == ["n", "chunk", "groups"]


@pytest.fixture(scope="module")
def libs():
    builds = {name: dict(source=METAL / f"{name}.metal") for name in ("cross_entropy", "embedding", "optimizer")}
    builds.update(cross_entropy_nobarrier=_without_barriers("cross_entropy"))
    return build_all(builds)


# ---------------------------------------------------------------------------------------------
# cross_entropy
# ---------------------------------------------------------------------------------------------
IGNORE = -100


def ce_ref(x, y, scale, ignore=IGNORE):
    """float64 oracle: loss (rows,), dlogits (rows, V); ignored rows 0 and 0."""
    x = f64(x)
    ign = y == ignore
    yc = np.where(ign, 0, y)
    mx = x.max(1, keepdims=True)
    e = np.exp(x - mx)
    se = e.sum(1, keepdims=True)
    loss = mx[:, 0] + np.log(se[:, 0]) - x[np.arange(len(y)), yc]
    d = e / se
    d[np.arange(len(y)), yc] -= 1
    d *= scale
    loss[ign] = 0
    d[ign] = 0
    return loss, d


def ce_inputs(dt, rows, V, ignore_every=5, spread=3.0):
    x = (spread * rng.standard_normal((rows, V))).astype(DT[dt])
    y = rng.integers(0, V, rows).astype(np.int32)
    if ignore_every:
        y[2::ignore_every] = IGNORE
    return x, y


def ce_run(lib, dt, x, y, scale=1.0, tg=256, write_grad=True, extra_groups=0, out=None, scale_by=None, **kw):
    """scale_by (a float) goes in as the (1,) f32 buffer(5); without it that buffer is empty, so a
    read of it would hit the guard."""
    rows, V = x.shape
    loss = np.full(rows, np.nan, np.float32)
    d = np.full((rows, V), np.nan, x.dtype) if out is None else out
    sb = np.zeros(0, np.float32) if scale_by is None else np.array([scale_by], np.float32)
    lib.dispatch(f"cross_entropy_{dt}", grid=(rows + extra_groups, 1, 1), threads=(tg, 1, 1),
                 buffers=[x, y, loss, d, CrossEntropyArgs(rows, V, IGNORE, scale, int(write_grad),
                                                          int(scale_by is not None)), sb], **kw)
    return loss, d


def ce_check(dt, x, y, scale, loss, d):
    """loss (f32 in both dtypes: half logits are exact in float) = mx + log(se) - x_y: a rounding
    of each of mx + log(se) and its difference with x_y (a few ulps of |mx| + |x_y|), plus log's
    absolute error ~ the relative error of se, which is a float sum of exps along chains of at
    most V / tg + 32 + 32 terms, each exp a couple of ulps: (V / 32 + 70) * 2^-24 bounds it for
    tg >= 32. dlogits: p = exp * (1/se) carries the same relative error (plus ~4 ulps), p - 1
    adds an absolute ulp of 1; f16 adds one output rounding (2^-11 relative, half subnormal
    spacing 2^-24 absolute)."""
    ref_loss, ref_d = ce_ref(x, y, scale)
    ign = y == IGNORE
    assert np.all(loss[ign] == 0) and np.all(d[ign] == 0) and not np.signbit(d[ign]).any()  # exact +0
    V = x.shape[1]
    chain = (V / 32 + 70) * U32
    xf = f64(x)
    mag = np.abs(xf).max(1) + np.abs(np.log(np.exp(xf - xf.max(1, keepdims=True)).sum(1)))
    tol = 4 * U32 * mag + chain
    err = np.abs(f64(loss) - ref_loss)
    assert np.all(err <= tol), float((err - tol).max())
    dtol = abs(scale) * ((chain + 4 * U32) * np.abs(ref_d / scale) + 2 * U32)
    if dt == "f16":
        dtol = dtol + U16 * np.abs(ref_d) + 2.0 ** -24
    derr = np.abs(f64(d) - ref_d)
    assert np.all(derr <= dtol), float((derr - dtol).max())


# (rows, V, threads per threadgroup); (16, 2048) is the realistic one
CE_SHAPES = [(1, 1, 32), (31, 33, 32), (33, 31, 64), (1, 127, 32), (127, 1, 32), (7, 127, 96), (16, 2048, 256)]


@pytest.mark.parametrize("rows,V,tg", CE_SHAPES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_cross_entropy_metal(libs, dt, rows, V, tg):
    x, y = ce_inputs(dt, rows, V)
    loss, d = ce_run(libs["cross_entropy"], dt, x, y, 0.37, tg=tg, extra_groups=1, random_order=True, seed=rows)
    ce_check(dt, x, y, 0.37, loss, d)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_cross_entropy_metal_vocab_32000(libs, dt):
    """A Llama-sized vocabulary, one threadgroup of 1024 and one of 256 per row."""
    x, y = ce_inputs(dt, 2, 32000, ignore_every=0)
    for tg in (1024, 256):
        loss, d = ce_run(libs["cross_entropy"], dt, x, y, 1 / 2, tg=tg, random_order=True, seed=tg)
        ce_check(dt, x, y, 1 / 2, loss, d)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_cross_entropy_metal_scale_by(libs, dt):
    """scale_by: the factor scale * scale_by[0] in f32, the same bits as passing that product as
    scale; the loss does not change."""
    x, y = ce_inputs(dt, 7, 45)
    ref_loss, ref = ce_run(libs["cross_entropy"], dt, x, y, float(np.float32(3.0) * np.float32(1 / 37)), tg=32)
    loss, d = ce_run(libs["cross_entropy"], dt, x, y, 3.0, tg=32, scale_by=1 / 37, random_order=True)
    np.testing.assert_array_equal(loss.view(np.uint32), ref_loss.view(np.uint32))
    np.testing.assert_array_equal(d.view(np.uint16 if dt == "f16" else np.uint32),
                                  ref.view(np.uint16 if dt == "f16" else np.uint32))
    assert np.any(d != 0)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_cross_entropy_metal_no_grad(libs, dt):
    """write_grad = 0: the loss only, buffer(3) bound and left untouched."""
    x, y = ce_inputs(dt, 9, 70)
    sentinel = np.full(x.shape, 7, x.dtype)
    loss, d = ce_run(libs["cross_entropy"], dt, x, y, 1.0, tg=32, write_grad=False, out=sentinel, random_order=True)
    np.testing.assert_array_equal(d, 7)
    ce_check(dt, x, y, 1.0, loss, ce_ref(x, y, 1.0)[1].astype(x.dtype))


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_cross_entropy_metal_in_place(libs, dt):
    """dlogits aliasing logits (unguarded buffers share the numpy memory), random thread order:
    bit-identical to the out-of-place result."""
    x, y = ce_inputs(dt, 6, 1000, ignore_every=3)
    ref_loss, ref = ce_run(libs["cross_entropy"], dt, x.copy(), y, 0.25, tg=64)
    for seed in range(3):  # x_y read after a neighbour overwrote it shows in the loss
        xi = x.copy()
        loss, _ = ce_run(libs["cross_entropy"], dt, xi, y, 0.25, tg=64, out=xi, guard=False, random_order=True,
                         seed=seed)
        np.testing.assert_array_equal(loss, ref_loss)
        np.testing.assert_array_equal(xi, ref)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_cross_entropy_metal_large_logits(libs, dt):
    """Offsets of +-1e4 (f32; 3e4 fits half too): the max is subtracted before every exp, so
    nothing overflows; the loss keeps a few ulps of |logit| (2^-10 at 1e4 in f32)."""
    off = np.array([[1e4], [-1e4], [3e4], [0]])
    x = (off + 3 * rng.standard_normal((4, 500))).astype(DT[dt])
    x[3, :3] = [1e4, -3e4, 2e4]  # one dominating logit: p = 1 exactly, the others 0
    y = np.array([7, 499, 0, 2], np.int32)
    loss, d = ce_run(libs["cross_entropy"], dt, x, y, 1.0, tg=128, random_order=True)
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(f64(d)))
    ce_check(dt, x, y, 1.0, loss, d)
    assert loss[3] == 0 and d[3, 2] == 0 and d[3, 0] == 0


def test_cross_entropy_metal_bad_target(libs):
    """A target outside [0, V) that is not ignore_index (the host checks these) is never read out
    of range (guarded buffers): NaN loss, no one-hot term; the other rows are unaffected."""
    x, y = ce_inputs("f32", 4, 33, ignore_every=0)
    y[1], y[2] = 33, -5
    loss, d = ce_run(libs["cross_entropy"], "f32", x, y, 1.0, tg=32, random_order=True)
    assert np.isnan(loss[1]) and np.isnan(loss[2])
    ok = np.array([0, 3])
    ce_check("f32", x[ok], y[ok], 1.0, loss[ok], d[ok])
    p = np.exp(f64(x[1:3]) - f64(x[1:3]).max(1, keepdims=True))
    np.testing.assert_allclose(f64(d[1:3]), p / p.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_cross_entropy_metal_race_free(libs, dt):
    """Random thread orders and 1 or 2 workers, a ragged threadgroup (100 threads: a partial last
    SIMD-group) and the full 1024: bit-identical loss and gradient."""
    x, y = ce_inputs(dt, 5, 3000)
    for tg in (100, 1024):
        outs = [ce_run(libs["cross_entropy"], dt, x, y, 0.5, tg=tg, **kw) for kw in ORDERS]
        for o in outs[1:]:
            np.testing.assert_array_equal(o[0], outs[0][0])
            np.testing.assert_array_equal(o[1], outs[0][1])


def test_cross_entropy_metal_missing_barrier_detected(libs):
    x, y = ce_inputs("f32", 4, 1000, ignore_every=0)
    ref = ce_run(libs["cross_entropy"], "f32", x, y, 1.0, random_order=True)
    bad = libs["cross_entropy_nobarrier"]

    def run(seed):
        loss, d = ce_run(bad, "f32", x, y, 1.0, random_order=True, seed=seed)
        return np.concatenate([loss, d.ravel()])

    assert _caught(run, np.concatenate([ref[0], ref[1].ravel()]))


# ---------------------------------------------------------------------------------------------
# embedding
# ---------------------------------------------------------------------------------------------
EMB_TG = 64
# (n tokens, C, V); (256, 512, 1000) is the realistic one
EMB_SHAPES = [(1, 1, 1), (31, 33, 5), (33, 31, 40), (127, 127, 3), (5, 127, 127), (256, 512, 1000)]


def emb_grid(total, max_groups=64):
    # 1D over the n * C outputs, 64 groups at most: the large shape walks the grid-stride loop
    return (max(1, min(-(-total // EMB_TG), max_groups)), 1, 1)


@pytest.mark.parametrize("n,C,V", EMB_SHAPES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_embedding_forward_metal(libs, dt, n, C, V):
    table = rng.standard_normal((V, C)).astype(DT[dt])
    ids = rng.integers(0, V, n).astype(np.int32)
    out = np.full((n, C), np.nan, DT[dt])
    libs["embedding"].dispatch(f"embedding_forward_{dt}", grid=emb_grid(n * C), threads=(EMB_TG, 1, 1),
                               buffers=[ids, table, out, EmbeddingArgs(n, C, V)], random_order=True)
    np.testing.assert_array_equal(out, table[ids])  # a copy: exact


def emb_bwd_run(lib, dt, ids, dout, dtable, groups=None, **kw):
    n, C = dout.shape
    groups = groups or -(-C // EMB_TG)
    lib.dispatch(f"embedding_backward_{dt}", grid=(groups, 1, 1), threads=(EMB_TG, 1, 1),
                 buffers=[ids, dout, dtable, EmbeddingArgs(n, C, dtable.shape[0])], **kw)
    return dtable


def emb_bwd_serial(ids, dout, dtable):
    """The CPU backend's loop in float32: tokens in order, dtable[id] += dout[t]."""
    out = dtable.copy()
    for t, i in enumerate(ids):
        out[i] += dout[t].astype(np.float32)
    return out


@pytest.mark.parametrize("n,C,V", EMB_SHAPES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_embedding_backward_metal(libs, dt, n, C, V):
    """Repeated ids (V small against n) into a nonzero dtable: bit-identical to the CPU's serial
    float loop, and within the float-sum bound of float64: an element hit k times is k roundings,
    so |err| <= k * 2^-24 * (|dtable0| + sum |dout|)."""
    ids = rng.integers(0, V, n).astype(np.int32)
    if n > 2:
        ids[:3] = ids[n - 1]  # at least 4 hits of one id, first and last token included
    dout = rng.standard_normal((n, C)).astype(DT[dt])
    dtable0 = rng.standard_normal((V, C)).astype(np.float32)
    # fewer threads than columns for the large shape: the grid-stride loop over columns
    groups = 3 if C > 3 * EMB_TG else None
    dtable = emb_bwd_run(libs["embedding"], dt, ids, dout, dtable0.copy(), groups=groups, random_order=True)
    np.testing.assert_array_equal(dtable, emb_bwd_serial(ids, dout, dtable0))
    ref, mag = f64(dtable0).copy(), np.abs(f64(dtable0))
    hits = np.zeros(V)
    np.add.at(ref, ids, f64(dout))
    np.add.at(mag, ids, np.abs(f64(dout)))
    np.add.at(hits, ids, 1)
    assert np.all(np.abs(f64(dtable) - ref) <= hits[:, None] * U32 * mag)


def test_embedding_backward_metal_race_free(libs):
    ids = rng.integers(0, 7, 300).astype(np.int32)
    dout = rng.standard_normal((300, 200)).astype(np.float16)
    dtable0 = rng.standard_normal((7, 200)).astype(np.float32)
    outs = [emb_bwd_run(libs["embedding"], "f16", ids, dout, dtable0.copy(), groups=2, **kw) for kw in ORDERS]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_embedding_metal_bad_ids(libs, dt):
    """Ids are checked on the host; one that slips through still never reads or writes out of
    range (guarded buffers): a NaN row in the forward, skipped in the backward."""
    V, C = 6, 40
    ids = np.array([0, 6, 5, -1, 2], np.int32)
    table = rng.standard_normal((V, C)).astype(DT[dt])
    out = np.zeros((5, C), DT[dt])
    libs["embedding"].dispatch(f"embedding_forward_{dt}", grid=emb_grid(5 * C), threads=(EMB_TG, 1, 1),
                               buffers=[ids, table, out, EmbeddingArgs(5, C, V)])
    assert np.all(np.isnan(f64(out[[1, 3]])))
    np.testing.assert_array_equal(out[[0, 2, 4]], table[[0, 5, 2]])
    dout = rng.standard_normal((5, C)).astype(DT[dt])
    dtable = emb_bwd_run(libs["embedding"], dt, ids, dout, np.zeros((V, C), np.float32))
    ok = np.array([0, 2, 4])
    np.testing.assert_array_equal(dtable, emb_bwd_serial(ids[ok], dout[ok], np.zeros((V, C), np.float32)))


# ---------------------------------------------------------------------------------------------
# adamw_update
# ---------------------------------------------------------------------------------------------
def adamw_args(n, lr=3e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.1, step=3, grad_scale=0.5):
    """As the host computes them (csrc/cpu: bias corrections in double, then rounded to float)."""
    step_size = np.float32(lr / (1 - b1 ** step))
    bc2_sqrt = np.float32(np.sqrt(1 - b2 ** step))
    decay = np.float32(lr) * np.float32(wd)
    return AdamwArgs(n, step_size, bc2_sqrt, decay, b1, b2, eps, grad_scale)


# hyper, sq, flag (buffers 6..8) when device_scalars is 0: empty, so a read would hit the guard
NO_SCALARS = (np.zeros(0, np.float32), np.zeros(0, np.float32), np.zeros(0, np.int32))


def adamw_ref(p, g, m, v, a):
    """kargs.h's formula in float64 on the float32 argument values."""
    p, g, m, v = f64(p), f64(g) * a.grad_scale, f64(m), f64(v)
    p = p - a.decay * p
    m = a.beta1 * m + (1 - a.beta1) * g
    v = a.beta2 * v + (1 - a.beta2) * g * g
    upd = a.step_size * m / (np.sqrt(v) / a.bc2_sqrt + a.eps)
    return p - upd, m, v, upd


def adamw_inputs(n):
    p = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    m = (0.1 * rng.standard_normal(n)).astype(np.float32)
    v = (0.01 * rng.random(n)).astype(np.float32)
    v[::7] = 0  # fresh second moments
    return p, g, m, v


def adamw_check(p, m, v, p0, g0, m0, v0, a):
    """Each result is a handful of float operations on exact float inputs: the error is a few
    ulps of the magnitudes that meet in it (no cancellation is amplified beyond them): m, v: 4
    ulps of |b m| + |(1 - b) g|; p: 4 ulps of |p| plus 8 ulps of the step (sqrt, two divides, the
    sum with eps, the product, plus the ulps of m and v it inherits)."""
    rp, rm, rv, upd = adamw_ref(p0, g0, m0, v0, a)
    gs = f64(g0) * a.grad_scale
    tm = 4 * U32 * (np.abs(a.beta1 * f64(m0)) + np.abs((1 - a.beta1) * gs))
    tv = 4 * U32 * (a.beta2 * f64(v0) + (1 - a.beta2) * gs * gs)
    tp = 4 * U32 * np.abs(f64(p0)) + 12 * U32 * np.abs(upd)
    for out, ref, tol in ((m, rm, tm), (v, rv, tv), (p, rp, tp)):
        err = np.abs(f64(out) - ref)
        assert np.all(err <= tol), float((err - tol).max())


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("working", [None, "f32", "f16"])
def test_adamw_update_metal(libs, working, n):
    p0, g0, m0, v0 = adamw_inputs(n)
    p, g, m, v = p0.copy(), g0.copy(), m0.copy(), v0.copy()
    a = adamw_args(n)
    w = None if working is None else np.full(n, np.nan, DT[working])
    name = "adamw_update" if working is None else f"adamw_update_working_{working}"
    grid = max(1, min(-(-n // 256), 64))  # 64 groups at most: the grid-stride loop
    libs["optimizer"].dispatch(name, grid=(grid, 1, 1), threads=(256, 1, 1), buffers=[p, g, m, v, w, a, *NO_SCALARS])
    np.testing.assert_array_equal(g, g0)
    adamw_check(p, m, v, p0, g0, m0, v0, a)
    if working is not None:
        np.testing.assert_array_equal(w, p.astype(DT[working]))  # one rounding of the new p


@pytest.mark.parametrize("skip", [None, "flag", "sq_inf", "sq_nan"])
def test_adamw_update_metal_device_scalars(libs, skip):
    """device_scalars: step_size, bc2_sqrt and decay from hyper, grad_scale = clip * inv_denom with
    the clip from sqrt(sq) (clipping active here); a set flag or a non-finite sq writes nothing."""
    n = 45
    p0, g0, m0, v0 = adamw_inputs(n)
    p, m, v, w = p0.copy(), m0.copy(), v0.copy(), np.full(n, 5.0, np.float32)
    ref = adamw_args(n)
    sq0 = np.float32(np.sum(f64(g0) ** 2))
    inv_denom, max_norm = np.float32(0.25), np.float32(0.1)
    hyper = np.array([ref.step_size, ref.bc2_sqrt, ref.decay, inv_denom, max_norm], np.float32)
    sq = np.array([{None: sq0, "flag": sq0, "sq_inf": np.inf, "sq_nan": np.nan}[skip]], np.float32)
    flag = np.array([1 if skip == "flag" else 0], np.int32)
    a = AdamwArgs(n, 99.0, 99.0, 99.0, ref.beta1, ref.beta2, ref.eps, 99.0, 1, 1)  # host scalars ignored
    libs["optimizer"].dispatch("adamw_update_working_f32", grid=(1, 1, 1), threads=(32, 1, 1),
                               buffers=[p, g0, m, v, w, a, hyper, sq, flag], random_order=True)
    if skip:
        for got, was in ((p, p0), (m, m0), (v, v0)):
            np.testing.assert_array_equal(got.view(np.uint32), was.view(np.uint32))
        assert np.all(w == 5.0)
        return
    norm = np.sqrt(np.float64(sq0)) * inv_denom
    clip = min(1.0, float(max_norm) / (norm + 1e-6))
    assert clip < 0.5
    want = AdamwArgs(n, ref.step_size, ref.bc2_sqrt, ref.decay, ref.beta1, ref.beta2, ref.eps, clip * float(inv_denom))
    # the f32 clip (sqrt, product, sum, divide, product) is a few ulps off the float64 one
    rp, rm, rv, upd = adamw_ref(p0, g0, m0, v0, want)
    for got, r, tol in ((m, rm, 16 * U32 * (np.abs(f64(m0)) + np.abs(rm))), (v, rv, 16 * U32 * (f64(v0) + np.abs(rv))),
                        (p, rp, 4 * U32 * np.abs(f64(p0)) + 32 * U32 * np.abs(upd))):
        assert np.all(np.abs(f64(got) - r) <= tol + 1e-30), float(np.max(np.abs(f64(got) - r) - tol))
    np.testing.assert_array_equal(w, p)


def test_adamw_update_metal_first_step_no_decay(libs):
    """Step 1 with m = v = 0 and no weight decay: the update is lr * sign(g) (up to eps)."""
    n = 33
    p0, g0, _, _ = adamw_inputs(n)
    m, v, p = np.zeros(n, np.float32), np.zeros(n, np.float32), p0.copy()
    a = adamw_args(n, lr=1e-2, wd=0.0, step=1, grad_scale=1.0, eps=1e-12)
    libs["optimizer"].dispatch("adamw_update", grid=(1, 1, 1), threads=(32, 1, 1),
                               buffers=[p, g0, m, v, None, a, *NO_SCALARS])
    adamw_check(p, m, v, p0, g0, np.zeros(n, np.float32), np.zeros(n, np.float32), a)
    np.testing.assert_allclose(f64(p), f64(p0) - 1e-2 * np.sign(g0), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# sumsq (two passes) and nonfinite
# ---------------------------------------------------------------------------------------------
def sumsq_run(lib, dt, x, tg=256, chunk=None, finish_tg=64, **kw):
    n = x.size
    chunk = chunk or 4 * tg
    groups = -(-n // chunk)
    partials = np.full(groups, np.nan, np.float32)
    out = np.full(1, np.nan, np.float32)
    args = ReduceArgs(n, chunk, groups)
    lib.dispatch(f"sumsq_partial_{dt}", grid=(groups + 1, 1, 1), threads=(tg, 1, 1),  # + 1: extra group returns
                 buffers=[x, partials, args], **kw)
    lib.dispatch("sumsq_finish", grid=(1, 1, 1), threads=(finish_tg, 1, 1), buffers=[partials, out, args], **kw)
    return out[0], partials


def sumsq_tol(n, tg, chunk, finish_tg):
    """A float sum of non-negative terms along a chain of L additions has relative error
    <= L * 2^-24 (to first order). Longest chain: chunk / tg fma per thread, simd_sum (at most
    31 additions), one per SIMD-group; then the same for the groups in the finish. Squares of
    half are exact in float; those of float round inside the fma (counted)."""
    groups = -(-n // chunk)
    L = -(-chunk // tg) + 31 + -(-tg // 32) + -(-groups // finish_tg) + 31 + -(-finish_tg // 32)
    return L * U32


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_sumsq_metal(libs, dt, n):
    x = (2 * rng.standard_normal(n)).astype(DT[dt])
    got, partials = sumsq_run(libs["optimizer"], dt, x, random_order=True, seed=n)
    ref = float((f64(x) ** 2).sum())
    assert abs(got - ref) <= sumsq_tol(n, 256, 1024, 64) * ref
    assert partials.size == -(-n // 1024) and np.all(np.isfinite(partials))


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_sumsq_metal_host_geometry(libs, dt):
    """csrc/metal/optim.cpp's geometry: chunk 16384, 256 threads in both passes, groups =
    max(1, ceil(n / chunk)); n = 0 still writes 0 (one empty group)."""
    x = rng.standard_normal(3 * 16384 + 5).astype(DT[dt])
    got, _ = sumsq_run(libs["optimizer"], dt, x, tg=256, chunk=16384, finish_tg=256, random_order=True)
    ref = float((f64(x) ** 2).sum())
    assert abs(got - ref) <= sumsq_tol(x.size, 256, 16384, 256) * ref
    partials, out = np.full(1, np.nan, np.float32), np.full(1, np.nan, np.float32)
    args = ReduceArgs(0, 16384, 1)
    lib = libs["optimizer"]
    lib.dispatch(f"sumsq_partial_{dt}", grid=(1, 1, 1), threads=(256, 1, 1),
                 buffers=[np.zeros(0, DT[dt]), partials, args])
    lib.dispatch("sumsq_finish", grid=(1, 1, 1), threads=(256, 1, 1), buffers=[partials, out, args])
    assert partials[0] == 0 and out[0] == 0


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_sumsq_metal_deterministic(libs, dt):
    """Fixed chunk and threadgroup sizes: bit-identical across thread orders and worker counts,
    for a ragged threadgroup (100) and a full one (1024)."""
    x = rng.standard_normal(50000).astype(DT[dt])
    for tg, chunk in ((100, 700), (1024, 4096)):
        outs = [sumsq_run(libs["optimizer"], dt, x, tg=tg, chunk=chunk, finish_tg=tg, **kw)[0] for kw in ORDERS]
        assert all(o == outs[0] for o in outs[1:]), outs
        ref = float((f64(x) ** 2).sum())
        assert abs(outs[0] - ref) <= sumsq_tol(x.size, tg, chunk, tg) * ref


NF_BITS = {"f32": (np.uint32, {"inf": 0x7F800000, "-inf": 0xFF800000, "nan": 0x7FC00000, "snan": 0x7F800001}),
           "f16": (np.uint16, {"inf": 0x7C00, "-inf": 0xFC00, "nan": 0x7E00, "snan": 0x7C01})}


def nonfinite_run(lib, dt, x, flag0=0, **kw):
    flag = np.array([flag0], np.int32)
    grid = max(1, min(-(-x.size // 256), 64))
    lib.dispatch(f"nonfinite_{dt}", grid=(grid, 1, 1), threads=(256, 1, 1),
                 buffers=[x, flag, ReduceArgs(x.size, 0, 0)], random_order=True, **kw)
    return int(flag[0])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_nonfinite_metal(libs, dt, n):
    lib = libs["optimizer"]
    utype, bits = NF_BITS[dt]
    x = rng.standard_normal(n).astype(DT[dt])
    x[: min(n, 3)] = [np.finfo(DT[dt]).max, -np.finfo(DT[dt]).max, np.finfo(DT[dt]).tiny][: min(n, 3)]
    assert nonfinite_run(lib, dt, x) == 0  # large, small, none: flag untouched
    assert nonfinite_run(lib, dt, x, flag0=1) == 1  # never cleared
    for pos in sorted({0, n - 1}):
        for name, b in bits.items():
            y = x.copy()
            y.view(utype)[pos] = b
            assert nonfinite_run(lib, dt, y, seed=pos) == 1, (name, pos)
