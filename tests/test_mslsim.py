"""The MSL simulator (tools/mslsim) against float64 numpy: its fixture kernels in
tests/mslsim_kernels (GEMM nt, RMSNorm, softmax, language features) and the bugs it must report
(missing barrier, barrier after an early return, divergent SIMD-group call, out-of-bounds access,
threadgroup memory limit, unbound buffer), plus the clang check of Objective-C++ host code where
clang++ exists. Each .metal build is done once per module (module-scoped fixtures) and cached by
content hash under MSLSIM_CACHE, so a warm run compiles nothing."""
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MSLSIM = Path(__file__).resolve().parents[1] / "tools" / "mslsim"
sys.path.insert(0, str(MSLSIM))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import mslsim  # noqa: E402

K = Path(__file__).resolve().parent / "mslsim_kernels"
rng = np.random.default_rng(1234)


# Every library the tests use: built together, one compile per core at a time, so that a cold
# cache costs about the sum of the compiles divided by the cores.
BUILDS = {
    "gemm_lib": dict(source=K / "gemm_nt.metal", constants={"use_bias": False}),
    "gemm_lib_bias_alpha": dict(source=K / "gemm_nt.metal", constants={"use_bias": True, "alpha": 0.5}),
    "rms_lib": dict(source=K / "rmsnorm.metal"),
    "softmax_lib": dict(source=K / "softmax.metal"),
    "feat": dict(source=K / "features.metal", constants={"fc_mode": 2}),
    "buggy": dict(source=K / "buggy.metal"),
    "buggy_nobarrier": dict(source=K / "buggy.metal", defines={"BUGGY": 1}, name="buggy_nobarrier"),
}


@pytest.fixture(scope="module")
def libs():
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {name: pool.submit(mslsim.build, **kw) for name, kw in BUILDS.items()}
        return {name: f.result() for name, f in futures.items()}


def gemm_ref(A, B, bias=None, alpha=None):
    C = A.astype(np.float64) @ B.astype(np.float64).T
    if alpha is not None:
        C *= alpha
    if bias is not None:
        C += bias
    return C


def run_gemm(lib, kname, M, N, K_, dtype, bias=None, **kw):
    A = rng.standard_normal((M, K_)).astype(dtype)
    B = rng.standard_normal((N, K_)).astype(dtype)
    C = np.full((M, N), np.nan, np.float32)
    P = np.array([M, N, K_, K_, K_, N], np.uint32)
    bufs = {0: A, 1: B, 2: C, 3: P}
    if bias is not None:
        bufs[4] = bias
    lib.dispatch(kname, grid=(-(-N // 32), -(-M // 32), 1), threads=(32, 1, 1), buffers=bufs, **kw)
    return A, B, C


@pytest.fixture(scope="module")
def gemm_lib(libs):
    return libs["gemm_lib"]


@pytest.fixture(scope="module")
def gemm_lib_bias_alpha(libs):
    return libs["gemm_lib_bias_alpha"]


SHAPES = [(32, 32, 16), (64, 96, 48), (1, 1, 1), (37, 45, 29), (33, 31, 17), (100, 7, 130), (256, 256, 256)]


@pytest.mark.parametrize("M,N,K_", SHAPES)
@pytest.mark.parametrize("kname,dtype", [("gemm_nt_f16", np.float16), ("gemm_nt_f32", np.float32)])
def test_gemm_nt(gemm_lib, kname, dtype, M, N, K_):
    A, B, C = run_gemm(gemm_lib, kname, M, N, K_, dtype)
    ref = gemm_ref(A, B)
    # fp16 products are exact in fp32; only the fp32 accumulation order differs from numpy
    np.testing.assert_allclose(C, ref, rtol=1e-5, atol=1e-4 * np.sqrt(K_))


@pytest.mark.parametrize("M,N,K_", [(45, 70, 33), (64, 64, 64)])
def test_gemm_function_constants(gemm_lib_bias_alpha, M, N, K_):
    bias = rng.standard_normal(N).astype(np.float32)
    A, B, C = run_gemm(gemm_lib_bias_alpha, "gemm_nt_f16", M, N, K_, np.float16, bias=bias)
    np.testing.assert_allclose(C, gemm_ref(A, B, bias, 0.5), rtol=1e-5, atol=1e-4 * np.sqrt(K_))


def test_gemm_bias_buffer_required(gemm_lib_bias_alpha):
    with pytest.raises(mslsim.MslsimError, match=r"buffer\(4\)"):
        run_gemm(gemm_lib_bias_alpha, "gemm_nt_f16", 32, 32, 32, np.float16)


def test_gemm_random_order_and_workers(gemm_lib):
    """Shuffled fiber order after every sync point and 1 vs 2 workers give bit-identical results."""
    A = rng.standard_normal((70, 50)).astype(np.float16)
    B = rng.standard_normal((90, 50)).astype(np.float16)
    P = np.array([70, 90, 50, 50, 50, 90], np.uint32)
    outs = []
    for kw in [dict(workers=1), dict(workers=2), dict(random_order=True, seed=7), dict(random_order=True, seed=8)]:
        C = np.zeros((70, 90), np.float32)
        gemm_lib.dispatch("gemm_nt_f16", grid=(3, 3, 1), threads=(32, 1, 1), buffers=[A, B, C, P], **kw)
        outs.append(C)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.fixture(scope="module")
def rms_lib(libs):
    return libs["rms_lib"]


@pytest.mark.parametrize("rows,D,tg", [(3, 7, 64), (5, 1000, 256), (4, 4096, 1024), (2, 13, 32), (1, 64, 96), (2, 3, 1024)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rmsnorm(rms_lib, rows, D, tg, dtype):
    x = rng.standard_normal((rows, D)).astype(dtype)
    w = rng.standard_normal(D).astype(dtype)
    y = np.zeros_like(x)
    name = "rmsnorm_f32" if dtype == np.float32 else "rmsnorm_f16"
    rms_lib.dispatch(name, grid=(rows, 1, 1), threads=(tg, 1, 1), buffers=[x, w, y, np.uint32(D), np.float32(1e-5)],
                     random_order=True)
    xf = x.astype(np.float64)
    ref = xf / np.sqrt((xf ** 2).mean(1, keepdims=True) + 1e-5) * w.astype(np.float64)
    # f32: a few roundings of a D-term f32 sum; f16: one rounding of the f16 output (2^-11)
    # plus the f16 inputs' products, ~4 ulps of f16
    tol = 1e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(y.astype(np.float64), ref, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def softmax_lib(libs):
    return libs["softmax_lib"]


def test_softmax(softmax_lib):
    lib = softmax_lib
    # one rounding of the f16 output (2^-11 relative) plus fast::exp: 2e-3 relative
    for D in (1, 31, 77, 300):
        x = rng.standard_normal((6, D)).astype(np.float16)
        y = np.zeros_like(x)
        lib.dispatch("softmax_row", grid=(6, 1, 1), threads=(32, 1, 1), buffers=[x, y, np.uint32(D)])
        e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
        np.testing.assert_allclose(y, e / e.sum(1, keepdims=True), rtol=2e-3, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# language / runtime features
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def feat(libs):
    return libs["feat"]


def test_vec_ops(feat):
    a = rng.standard_normal((64, 4)).astype(np.float32)
    out = np.zeros_like(a)
    bits = np.zeros(64, np.uint32)
    feat.dispatch("vec_ops", grid=(2, 1, 1), threads=(32, 1, 1), buffers=[a, out, bits])
    b = np.stack([2 * a[:, 2], 2 * a[:, 3], a[:, 1] + 1, a[:, 0] + 2], 1)
    hx = (np.float16(a[:, 0].astype(np.float16) * np.float16(1.5)) + np.float16(0.25)).astype(np.float16)
    c = np.stack([a[:, 1], -a[:, 0], 0 * a[:, 0]], 1)
    d = (a * b).sum(1) + np.linalg.norm(c, axis=1)
    r = np.abs(np.stack([b[:, 0], b[:, 1], hx.astype(np.float32), d], 1))
    r[:, 3] = np.clip(r[:, 3], -100, 100) + 11.5 + 1000.0
    # column 2 is half arithmetic: g++ rounds after every _Float16 operation, clang keeps float excess
    # precision within an expression (and Apple's compiler may fuse into a half FMA): 1 ulp of slack
    np.testing.assert_allclose(out[:, [0, 1, 3]], r[:, [0, 1, 3]], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:, 2], r[:, 2], rtol=1e-3)
    np.testing.assert_array_equal(bits, a[:, 0].view(np.uint32))


def test_simd_ops(feat):
    v = rng.standard_normal(64).astype(np.float32)
    out = np.zeros(64 * 8, np.float32)
    feat.dispatch("simd_ops", grid=(1, 1, 1), threads=(64, 1, 1), buffers=[v, out])
    out = out.reshape(64, 8)
    for s in range(2):
        g = v[32 * s:32 * s + 32].astype(np.float64)
        o = out[32 * s:32 * s + 32]
        np.testing.assert_allclose(o[:, 0], g.sum(), rtol=1e-5)
        np.testing.assert_array_equal(o[:, 1], np.float32(g.max()))
        np.testing.assert_array_equal(o[:, 2], np.float32(g.min()))
        np.testing.assert_allclose(o[:, 3], np.concatenate([[0], np.cumsum(g)[:-1]]), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(o[:, 4], np.float32(np.concatenate([g[3:], g[29:]])))
        np.testing.assert_array_equal(o[:, 5], np.float32(g[5]))
        np.testing.assert_allclose(o[:, 6], np.repeat(g.reshape(8, 4).sum(1), 4), rtol=1e-5, atol=1e-6)
        ballot = sum(1 << i for i in range(16) if g[i] > 0)
        np.testing.assert_array_equal(o[:, 7], ballot + np.array([0.5] + [0] * 31))


def test_early_exit_simd_sum(feat):
    v = rng.standard_normal(64).astype(np.float32)
    out = np.zeros(64, np.float32)
    feat.dispatch("early_exit_sum", grid=(1, 1, 1), threads=(64, 1, 1), buffers=[v, out, np.uint32(40)])
    np.testing.assert_allclose(out[:32], v[:32].sum(), rtol=1e-5)
    np.testing.assert_allclose(out[32:40], v[32:40].sum(), rtol=1e-5)
    np.testing.assert_array_equal(out[40:], 0)


def test_atomics_dispatch_threads(feat):
    W, H = 10, 7
    counter = np.zeros(1, np.uint32)
    ids = np.zeros(W * H, np.uint32)
    feat.dispatch_threads("atomics_2d", (W, H, 1), (4, 4, 1), [counter, ids], threadgroup_memory={0: 64})
    assert counter[0] == W * H
    xs, ys = np.meshgrid(np.arange(W), np.arange(H))
    sx = np.minimum(4, W - (xs // 4) * 4)
    sy = np.minimum(4, H - (ys // 4) * 4)
    np.testing.assert_array_equal(ids.reshape(H, W), sx * sy)


def test_vector_predicates_and_host_name(feat):
    assert "predicates" in feat.kernel_names and "predicates_impl" not in feat.kernel_names
    v = np.array([[np.nan, np.inf, -np.inf, -0.0], [1.0, -2.0, 0.0, np.float32(-np.nan)]], np.float32)
    out = np.full_like(v, -1.0)
    feat.dispatch("predicates", grid=(1, 1, 1), threads=(2, 1, 1), buffers=[v, out])
    np.testing.assert_array_equal(out, 1.0 * np.isnan(v) + 2.0 * np.isinf(v) + 4.0 * np.signbit(v))


def test_simdgroup_matrix_thread_elements(feat):
    A = rng.standard_normal((8, 8)).astype(np.float32)
    B = rng.standard_normal((8, 8)).astype(np.float32)
    C = np.zeros((8, 8), np.float32)
    feat.dispatch("sgmat_elements", grid=(1, 1, 1), threads=(32, 1, 1), buffers=[A, B, C], random_order=True)
    np.testing.assert_allclose(C, (A @ B).T, rtol=1e-5, atol=1e-5)


def _bf16_rne(x32):
    """float32 -> bfloat16 bits, round to nearest even on the bits; NaN keeps its sign and top
    payload bits and is made quiet."""
    u = x32.view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, (u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def test_bfloat(feat):
    """The shim's bfloat (MSL 3.1: mslsim compiles as __METAL_VERSION__ 310): round to nearest even from float,
    ties both ways, overflow to inf, NaN kept; exact widening; arithmetic rounds once per operation."""
    special = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0xFF7F8000, 0x00008000,
                        0x00018000, 0x7FC00000, 0xFF800001, 0x7F800000, 0x80000000], np.uint32).view(np.float32)
    x = np.concatenate([special, rng.standard_normal(116).astype(np.float32) * 1e3]).astype(np.float32)
    n = x.size // 2
    bits = np.zeros(3 * n, np.uint16)
    back = np.zeros(n, np.float32)
    feat.dispatch("bfloat_ops", grid=(1, 1, 1), threads=(n, 1, 1), buffers=[x, bits, back])
    bits = bits.reshape(n, 3)
    a, b = _bf16_rne(x[0::2]), _bf16_rne(x[1::2])
    np.testing.assert_array_equal(bits[:, 0], a)
    widen = lambda h: (h.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    np.testing.assert_array_equal(back.view(np.uint32), widen(a).view(np.uint32))
    with np.errstate(invalid="ignore", over="ignore"):
        np.testing.assert_array_equal(bits[:, 1], _bf16_rne((widen(a) + widen(b)).astype(np.float32)))
        np.testing.assert_array_equal(bits[:, 2], _bf16_rne((widen(b) * np.float32(2)).astype(np.float32)))


def test_simdgroup_bfloat_matrix(feat):
    A = _bf16_rne(rng.standard_normal((8, 8)).astype(np.float32))
    B = _bf16_rne(rng.standard_normal((8, 8)).astype(np.float32))
    C = np.zeros((8, 8), np.float32)
    feat.dispatch("sgmat_bfloat", grid=(1, 1, 1), threads=(32, 1, 1), buffers=[A, B, C], random_order=True)
    widen = lambda h: (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)  # noqa: E731
    np.testing.assert_allclose(C, widen(A) @ widen(B) + 1.0, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# bugs that must be reported
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def buggy(libs):
    return libs["buggy"]


@pytest.fixture(scope="module")
def buggy_nobarrier(libs):
    return libs["buggy_nobarrier"]


def test_missing_barrier_detected(buggy, buggy_nobarrier):
    good, bad = buggy, buggy_nobarrier
    x = rng.standard_normal(128).astype(np.float32)
    ref = x.reshape(2, 64)[:, ::-1].ravel()
    y = np.zeros_like(x)
    good.dispatch("missing_barrier", grid=(2, 1, 1), threads=(64, 1, 1), buffers=[x, y], random_order=True)
    np.testing.assert_array_equal(y, ref)
    y = np.zeros_like(x)
    bad.dispatch("missing_barrier", grid=(2, 1, 1), threads=(64, 1, 1), buffers=[x, y])
    assert np.isnan(y).any()  # reads of not-yet-written threadgroup memory see the NaN poison


def test_exit_before_barrier(buggy):
    with pytest.raises(mslsim.MslsimError, match="threadgroup_barrier reached by only 20 of 32"):
        buggy.dispatch("exit_before_barrier", (1, 1, 1), (32, 1, 1), [np.zeros(32, np.float32), np.uint32(20)])


def test_divergent_simd(buggy):
    with pytest.raises(mslsim.MslsimError, match="divergent SIMD-group"):
        buggy.dispatch("divergent_simd", (1, 1, 1), (32, 1, 1), [np.zeros(32, np.float32)])


def test_out_of_bounds(buggy):
    with pytest.raises(mslsim.MslsimError, match=r"out-of-bounds access to buffer\(0\)"):
        buggy.dispatch("out_of_bounds", (1, 1, 1), (1024, 1, 1), [np.zeros(1024, np.float32), np.zeros(1024, np.float32)])


def test_threadgroup_memory_limit(buggy):
    with pytest.raises(mslsim.MslsimError, match="exceeds the limit"):
        buggy.dispatch("too_much_tg", (1, 1, 1), (32, 1, 1), [np.zeros(32, np.float32)])


def test_unbound_buffer(buggy):
    with pytest.raises(mslsim.MslsimError, match="not bound"):
        buggy.dispatch("out_of_bounds", (1, 1, 1), (32, 1, 1), [np.zeros(32, np.float32)])


# ---------------------------------------------------------------------------------------------
# source errors reported by the rewrite (no compile needed)
# ---------------------------------------------------------------------------------------------
def test_threadgroup_multi_declaration_rejected():
    src = "kernel void k(device float* o [[buffer(0)]]) { threadgroup float a[4], b[4]; o[0] = a[0] + b[0]; }"
    with pytest.raises(mslsim.MslsimError, match="one threadgroup variable per statement"):
        mslsim.transform(src)


def test_undeclared_function_constant_parameter_rejected():
    src = "kernel void k(device float* o [[buffer(0), function_constant(nope)]]) { }"
    with pytest.raises(mslsim.MslsimError, match=r"function_constant\(nope\)"):
        mslsim.transform(src)


def test_unknown_function_constant_value_rejected():
    src = "constant bool a [[function_constant(0)]];\nkernel void k(device float* o [[buffer(0)]]) { }"
    with pytest.raises(mslsim.MslsimError, match="not declared"):
        mslsim.transform(src, constants={"b": True})


# ---------------------------------------------------------------------------------------------
# Objective-C++ host code: clang syntax/type check against tools/mslsim/objc/stubs
# ---------------------------------------------------------------------------------------------
def _clang():
    names = ["clang++"] + [f"clang++-{v}" for v in range(30, 13, -1)]
    return next((p for p in map(shutil.which, names) if p), None)


def _objc_check(clang, mm):
    flags = (MSLSIM / "objc" / "flags.txt").read_text().split()
    cmd = [clang, *flags, f"-I{MSLSIM / 'objc' / 'stubs'}", str(mm)]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.skipif(_clang() is None, reason="no clang++ on PATH: the Objective-C++ check needs clang")
def test_objc_host_code_check():
    clang = _clang()
    ok = _objc_check(clang, K / "gemm_host.mm")
    assert ok.returncode == 0, ok.stderr
    bad = _objc_check(clang, K / "gemm_host_bad.mm")
    # each of its lines 4-9 holds one mistake (missing argument, misspelt selector, id for void*,
    # unknown method, void* arithmetic, wrong type) that the stubs must turn into an error
    assert bad.returncode != 0
    for line in range(4, 10):
        assert re.search(rf"gemm_host_bad\.mm:{line}:\d+: error:", bad.stderr), bad.stderr
