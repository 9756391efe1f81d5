"""krnl's Metal kernels (metal/*.metal) on the MSL simulator (tools/mslsim) against float64 numpy.

Each .metal file is built once per module (module-scoped fixture, the builds run in parallel and
are cached by content hash under MSLSIM_CACHE). Sizes are the awkward ones (1, 31, 33, 127) plus
one realistic (64 x 2048), f32 and f16. The reduction kernels run with the simulator's random
thread order (a new order after every barrier and SIMD-group function) on top of its always-on
checks (threadgroup memory poisoned with NaN, barriers reached by all threads, guarded buffer
ends); dedicated tests compare several orders and worker counts bit for bit.

The kargs.h structs are mirrored as ctypes structures parsed from the header itself, so host and
kernel layouts cannot drift apart here."""
import ctypes
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "mslsim"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import mslsim  # noqa: E402

METAL = ROOT / "metal"
rng = np.random.default_rng(4321)

# ---------------------------------------------------------------------------------------------
# kargs.h -> ctypes
# ---------------------------------------------------------------------------------------------
_CTYPES = {"uint32_t": ctypes.c_uint32, "int32_t": ctypes.c_int32, "float": ctypes.c_float}


def _parse_kargs():
    text = re.sub(r"//[^\n]*", "", (METAL / "kargs.h").read_text())
    structs = {}
    for sm in re.finditer(r"\bstruct\s+(\w+)\s*\{(.*?)\};", text, re.S):
        fields = re.findall(r"(\w+)\s+(\w+)\s*;", sm.group(2))
        fields = [(n, _CTYPES[t]) for t, n in fields]
        structs[sm.group(1)] = type(sm.group(1), (ctypes.Structure,), {"_fields_": fields})
    return structs


KARGS = _parse_kargs()
ElementwiseArgs, RmsnormArgs, SoftmaxArgs = (KARGS[n] for n in ("ElementwiseArgs", "RmsnormArgs", "SoftmaxArgs"))


def test_kargs_layout():
    assert [f for f, _ in ElementwiseArgs._fields_][:3] == ["n", "alpha", "beta"]
    assert [f for f, _ in RmsnormArgs._fields_] == ["rows", "cols", "eps", "ldy", "vec4"]
    assert [f for f, _ in SoftmaxArgs._fields_] == ["rows", "tq", "tk", "scale", "has_segments", "window", "has_sinks"]
    for s in KARGS.values():  # 4-byte fields only: no padding, identical in MSL and C++
        assert ctypes.sizeof(s) == 4 * len(s._fields_)


# ---------------------------------------------------------------------------------------------
# builds
# ---------------------------------------------------------------------------------------------
# the host compiles metal/*.metal with include dirs metal/ and csrc/core/ (rng.h, for dropout)
INCLUDE_DIRS = [ROOT / "csrc" / "core"]
BUILDS = {name: dict(source=METAL / f"{name}.metal", include_dirs=INCLUDE_DIRS)
          for name in ("elementwise", "rmsnorm", "softmax")}
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


def _write_if_changed(path: Path, text: str):
    if not path.exists() or path.read_text() != text:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def _without_barriers(name):
    """A copy of metal/<name>.metal with every threadgroup barrier removed: the race that the
    random-order tests must be able to see. Written to a fixed folder in the simulator cache
    (the preprocessed source names its path, so a fresh temporary folder would miss the cache)."""
    src = (METAL / f"{name}.metal").read_text()
    assert BARRIER in src
    d = mslsim.cache_dir() / "test_metal_kernels"
    d.mkdir(parents=True, exist_ok=True)
    _write_if_changed(d / "kargs.h", (METAL / "kargs.h").read_text())
    _write_if_changed(d / f"{name}_nobarrier.metal", src.replace(BARRIER, ";"))
    return dict(source=d / f"{name}_nobarrier.metal")


def build_all(builds):
    """{name: Library} for {name: mslsim.build keyword arguments}, built in parallel (one compiler
    per core) and cached by content hash: every test module's `libs` fixture goes through here."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {name: pool.submit(mslsim.build, **kw) for name, kw in builds.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def libs():
    return build_all(dict(BUILDS, rmsnorm_nobarrier=_without_barriers("rmsnorm"),
                          softmax_nobarrier=_without_barriers("softmax")))


DT = {"f32": np.float32, "f16": np.float16}
SIZES = [1, 31, 33, 127, 64 * 2048]
TG = 256  # threads per threadgroup for the elementwise ops


def ew_dispatch(lib, name, n, buffers, max_groups=64, **kw):
    # at most max_groups threadgroups: the large size also exercises the grid-stride loop
    grid = max(1, min(-(-n // TG), max_groups))
    lib.dispatch(name, grid=(grid, 1, 1), threads=(TG, 1, 1), buffers=buffers, **kw)


def f64(a):
    return np.asarray(a, np.float64)


# elementwise: f32 results are one float rounding of float64 (1e-6); f16 ones are computed in
# float and rounded once to half (2^-11 relative, 1e-3 with slack; atol for cancellation).
EW_TOL = {"f32": dict(rtol=1e-6, atol=1e-6), "f16": dict(rtol=1e-3, atol=2e-3)}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_fill_metal(libs, dt, n):
    x = np.full(n, np.nan, DT[dt])
    ew_dispatch(libs["elementwise"], f"fill_{dt}", n, [x, ElementwiseArgs(n, 0.3, 0.0)])
    np.testing.assert_array_equal(x, np.full(n, np.float32(0.3)).astype(DT[dt]))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_add_metal(libs, dt, n):
    a, b = (rng.standard_normal(n).astype(DT[dt]) for _ in range(2))
    out = np.full(n, np.nan, DT[dt])
    ew_dispatch(libs["elementwise"], f"add_{dt}", n, [a, b, out, ElementwiseArgs(n, 0.0, 0.0)])
    np.testing.assert_allclose(out.astype(np.float64), a.astype(np.float64) + b, **EW_TOL[dt])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_axpy_metal(libs, dt, n):
    x, y = (rng.standard_normal(n).astype(DT[dt]) for _ in range(2))
    ref = y.astype(np.float64) - 0.75 * x.astype(np.float64)
    ew_dispatch(libs["elementwise"], f"axpy_{dt}", n, [x, y, ElementwiseArgs(n, -0.75, 0.0)])
    np.testing.assert_allclose(y.astype(np.float64), ref, **EW_TOL[dt])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_scale_metal(libs, dt, n):
    x = rng.standard_normal(n).astype(DT[dt])
    out = np.full(n, np.nan, DT[dt])
    ew_dispatch(libs["elementwise"], f"scale_{dt}", n, [x, out, ElementwiseArgs(n, 1.7, 0.0)])
    np.testing.assert_allclose(out.astype(np.float64), 1.7 * x.astype(np.float64), **EW_TOL[dt])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("src,dst", [("f32", "f16"), ("f16", "f32")])
def test_cast_metal(libs, src, dst, n):
    x = (rng.standard_normal(n) * 1000).astype(DT[src])
    specials = np.array([0.0, -0.0, 1e-6, -3e-8, 65504.0, 65520.0, -1e5, np.inf, -np.inf, np.nan], np.float32)
    k = min(n, len(specials))
    with np.errstate(over="ignore"):
        x[:k] = specials[:k].astype(DT[src])  # subnormals, overflow to inf, ties, inf and nan
        out = np.full(n, 7, DT[dst])
        ew_dispatch(libs["elementwise"], f"cast_{src}_{dst}", n, [x, out, ElementwiseArgs(n, 0.0, 0.0)])
        # round to nearest even, as numpy: exact
        np.testing.assert_array_equal(out, x.astype(DT[dst]))


def test_elementwise_extra_threads_write_nothing(libs):
    """More threads than elements: the bounds check keeps them off the (guarded) buffer end."""
    n = 5
    out = np.zeros(n + 3, np.float16)
    libs["elementwise"].dispatch("fill_f16", grid=(3, 1, 1), threads=(64, 1, 1),
                                 buffers=[out, ElementwiseArgs(n, 2.0, 0.0)])
    np.testing.assert_array_equal(out, [2] * n + [0] * 3)


# ---------------------------------------------------------------------------------------------
# rmsnorm_forward
# ---------------------------------------------------------------------------------------------
# 1 and 2 workers, two random thread orders: must all give bit-identical outputs
ORDERS = [dict(workers=1), dict(workers=2), dict(random_order=True, seed=1), dict(random_order=True, seed=2)]
SHAPES = [(1, 1), (31, 33), (33, 31), (1, 127), (127, 1), (3, 128), (64, 2048)]


def rmsnorm_inputs(dt, rows, cols):
    return rng.standard_normal((rows, cols)).astype(DT[dt]), (1 + 0.5 * rng.standard_normal(cols)).astype(DT[dt])


def rmsnorm_run(lib, dt, x, w, tg, eps=1e-5, extra_groups=0, **kw):
    rows, cols = x.shape
    y = np.full((rows, cols), np.nan, DT[dt])
    rstd = np.full(rows, np.nan, np.float32)
    lib.dispatch(f"rmsnorm_forward_{dt}", grid=(rows + extra_groups, 1, 1), threads=(tg, 1, 1),
                 buffers=[x, w, y, rstd, RmsnormArgs(rows, cols, eps, cols, int(cols % 4 == 0))], **kw)
    return y, rstd


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("tg", [32, 256])
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_rmsnorm_forward_metal(libs, dt, rows, cols, tg):
    eps = 1e-5
    x, w = rmsnorm_inputs(dt, rows, cols)
    y, rstd = rmsnorm_run(libs["rmsnorm"], dt, x, w, tg, eps, extra_groups=1, random_order=True, seed=rows)
    xf = x.astype(np.float64)
    rstd_ref = 1 / np.sqrt((xf ** 2).mean(1) + eps)
    # rstd: a float sum of cols squares of exactly representable inputs, one sqrt, one divide
    np.testing.assert_allclose(rstd, rstd_ref, rtol=2e-6)
    # y: f32 a few float roundings; f16 one rounding of the half output (2^-11) with slack
    tol = dict(rtol=1e-5, atol=1e-5) if dt == "f32" else dict(rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(y.astype(np.float64), xf * rstd_ref[:, None] * w.astype(np.float64), **tol)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_rmsnorm_forward_metal_race_free(libs, dt):
    """Random thread orders and 1 or 2 workers, with a ragged threadgroup size (100 threads: a
    partial last SIMD-group) and the full 1024: bit-identical outputs."""
    for rows, cols, tg in [(5, 333, 100), (4, 4096, 1024)]:
        x, w = rmsnorm_inputs(dt, rows, cols)
        outs = [rmsnorm_run(libs["rmsnorm"], dt, x, w, tg, **kw)
                for kw in ORDERS]
        for o in outs[1:]:
            np.testing.assert_array_equal(o[0], outs[0][0])
            np.testing.assert_array_equal(o[1], outs[0][1])


# ---------------------------------------------------------------------------------------------
# softmax_causal_forward
# ---------------------------------------------------------------------------------------------
def softmax_ref(S, scale, segments=None):
    """float64 oracle: (..., Tq, Tk), query i at position i + Tk - Tq; returns (P, visible)."""
    Tq, Tk = S.shape[-2:]
    q = np.arange(Tq)[:, None] + (Tk - Tq)
    vis = np.arange(Tk)[None, :] <= q
    if segments is not None:
        vis = vis & (segments[None, :] == segments[q])
    vis = np.broadcast_to(vis, S.shape)
    z = np.where(vis, scale * S.astype(np.float64), -np.inf)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True), vis


def make_segments(tk):
    cuts = np.sort(rng.choice(np.arange(1, max(tk, 2)), size=min(3, max(tk - 1, 0)), replace=False))
    seg = np.zeros(tk, np.int32)
    for c in cuts:
        seg[c:] += 1
    return seg


def softmax_run(lib, dt, S, scale, segments=None, tg=256, extra_groups=0, out=None, **kw):
    Tq, Tk = S.shape[-2:]
    rows = S.size // Tk
    P = np.full(S.shape, np.nan, S.dtype) if out is None else out
    seg = segments if segments is not None else np.zeros(1, np.int32)
    sinks = np.zeros(1, np.float32)  # bound, not read (has_sinks 0); test_ops.py runs the kernel with sinks
    lib.dispatch(f"softmax_causal_forward_{dt}", grid=(rows + extra_groups, 1, 1), threads=(tg, 1, 1),
                 buffers=[S, P, seg, SoftmaxArgs(rows, Tq, Tk, scale, int(segments is not None)), sinks], **kw)
    return P


# f32: float exp and sums (1e-5); f16: half inputs exactly in float, one rounding of the half
# output (2^-11 relative) with slack; masked entries must be exact zeros in both.
SM_TOL = {"f32": dict(rtol=1e-5, atol=1e-7), "f16": dict(rtol=2e-3, atol=1e-5)}
SM_SHAPES = [(1, 1, 1), (1, 31, 31), (2, 33, 33), (1, 127, 127), (3, 1, 33), (2, 5, 31), (1, 64, 2048)]
# segments need square scores (Tq == Tk), as the op contract says
SM_CASES = [(*s, False) for s in SM_SHAPES] + [(*s, True) for s in SM_SHAPES if s[1] == s[2]] + [(1, 256, 256, True)]


@pytest.mark.parametrize("B,Tq,Tk,segmented", SM_CASES)
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_softmax_causal_forward_metal(libs, dt, B, Tq, Tk, segmented):
    S = (3 * rng.standard_normal((B, Tq, Tk))).astype(DT[dt])
    seg = make_segments(Tk) if segmented else None
    tg = 32 if Tk < 64 else 256
    P = softmax_run(libs["softmax"], dt, S, 0.7, seg, tg=tg, extra_groups=1, random_order=True, seed=Tk)
    ref, vis = softmax_ref(S, 0.7, seg)
    assert np.all(P[~vis] == 0) and not np.signbit(P[~vis]).any()  # exact +0
    np.testing.assert_allclose(P.astype(np.float64), ref, **SM_TOL[dt])


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_softmax_causal_forward_metal_in_place(libs, dt):
    """P aliasing S (unguarded buffers share the numpy memory): same result as out of place."""
    S = rng.standard_normal((2, 40, 40)).astype(DT[dt])
    seg = make_segments(40)
    ref = softmax_run(libs["softmax"], dt, S.copy(), 1.3, seg)
    softmax_run(libs["softmax"], dt, S, 1.3, seg, tg=64, out=S, guard=False, random_order=True, seed=5)
    np.testing.assert_array_equal(S, ref)


def test_softmax_causal_forward_metal_large_scores(libs):
    """Scores far beyond exp's range: the row max is subtracted first, nothing overflows."""
    S = np.array([[[1e4, -3e4, 2e4]] * 3], np.float32)
    P = softmax_run(libs["softmax"], "f32", S, 1.0, tg=32)
    np.testing.assert_array_equal(P[0], [[1, 0, 0], [1, 0, 0], [0, 0, 1]])


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_softmax_causal_forward_metal_race_free(libs, dt):
    S = rng.standard_normal((3, 50, 300)).astype(DT[dt])
    seg = None
    outs = [softmax_run(libs["softmax"], dt, S, 0.5, seg, tg=tg, **kw)
            for tg in (100, 1024)
            for kw in ORDERS]
    for o in outs[1:4]:
        np.testing.assert_array_equal(o, outs[0])
    for o in outs[5:]:
        np.testing.assert_array_equal(o, outs[4])


# ---------------------------------------------------------------------------------------------
# the race checks above can fail: the same kernels without their barriers are caught
# ---------------------------------------------------------------------------------------------
def _caught(run, ref):
    """True when some random thread order gives a result that differs from ref (a read of the
    NaN-poisoned threadgroup memory before another SIMD-group wrote it, or a stale value)."""
    for seed in range(4):
        out = run(seed)
        if not np.array_equal(out, ref, equal_nan=False):
            return True
    return False


def test_rmsnorm_forward_metal_missing_barrier_detected(libs):
    x, w = rmsnorm_inputs("f32", 4, 1000)
    ref = rmsnorm_run(libs["rmsnorm"], "f32", x, w, 256, random_order=True)[0]
    bad = libs["rmsnorm_nobarrier"]
    assert _caught(lambda seed: rmsnorm_run(bad, "f32", x, w, 256, random_order=True, seed=seed)[0], ref)


def test_softmax_causal_forward_metal_missing_barrier_detected(libs):
    S = rng.standard_normal((1, 8, 1000)).astype(np.float32)
    ref = softmax_run(libs["softmax"], "f32", S, 1.0, random_order=True)
    bad = libs["softmax_nobarrier"]
    assert _caught(lambda seed: softmax_run(bad, "f32", S, 1.0, random_order=True, seed=seed), ref)
