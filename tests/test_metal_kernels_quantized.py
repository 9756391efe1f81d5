"""krnl's quantized_matmul kernels (metal/quantized.metal) on the MSL simulator against float64 numpy.

The tiled forms (quantized_matmul_t_*, _n_*) and the few-row form (quantized_matmul_tv_*) are
dispatched directly, with the geometry csrc/metal/quantized.cpp gives them, at every bits and group
size, at sizes that put every edge in play with few elements: rows 1, 31, 33 (the 32-row tile;
the few-row form's 8-row blocks), out columns and K off the tile multiples where the layout allows
(K and I are multiples of the group size). x and out sit in NaN-filled buffers with row padding
(a read outside x, or of out at beta == 0, poisons the result; a write outside out is seen), and
every dispatch runs in the simulator's random thread order. The block interface (args.m0,
args.groups, rows split by buffer offsets) is checked to reproduce the whole product bit for bit.
Test helpers (kargs.h as ctypes, the barrier-free copy, the random-order check) are
test_metal_kernels.py's."""

import numpy as np
import pytest

from krnl.quant import affine
from test_metal_kernels import KARGS, METAL, _caught, _without_barriers, build_all

QuantizedMatmulArgs = KARGS["QuantizedMatmulArgs"]
rng = np.random.default_rng(8642)
U32 = 2.0 ** -24
U16 = 2.0 ** -11
DT = {"f32": (np.float32, np.float32), "f16": (np.float16, np.float16), "f16_sf32": (np.float16, np.float32)}
TILE, ROWS_BLOCK, ROWS_COLS = 32, 8, 8   # the tiled form's tile; the few-row form's rows, out columns


def test_kargs_layout_quantized_matmul():
    assert [f for f, _ in QuantizedMatmulArgs._fields_] == ["N", "M", "K", "words", "group_size", "beta", "ldx",
                                                            "ldo", "m0", "groups"]


@pytest.fixture(scope="module")
def libs():
    return build_all(dict(plain=dict(source=METAL / "quantized.metal"), nobarrier=_without_barriers("quantized")))


def weights(O, I, bits, gs, sdt):
    """Packed codes (O, I bits / 32) as uint32, scales and biases (O, I / gs) in sdt, and W (O, I)
    float64 as the kernels see it."""
    codes = rng.integers(0, 1 << bits, (O, I))
    s = (rng.uniform(0.01, 0.2, (O, I // gs)) * rng.choice([-1.0, 1.0], (O, I // gs))).astype(sdt)
    b = rng.standard_normal((O, I // gs)).astype(sdt)
    W = np.repeat(s.astype(np.float64), gs, 1) * codes + np.repeat(b.astype(np.float64), gs, 1)
    return np.ascontiguousarray(affine.pack(codes, bits).view(np.uint32)), s, b, W


def padded(rows, cols, ld, dtype, fill):
    """A flat NaN buffer holding a (rows, cols) matrix of row stride ld (filled from `fill` unless
    None) and the matrix as a strided view of it."""
    flat = np.full((rows - 1) * ld + cols, np.nan, dtype)
    view = np.lib.stride_tricks.as_strided(flat, (rows, cols), (ld * flat.itemsize, flat.itemsize))
    if fill is not None:
        view[...] = fill
    return flat, view


def run(lib, form, dt, bits, gs, x_flat, ldx, w, s, b, out_flat, ldo, N, M, K, beta=0.0, m0=0, seed=0):
    """One dispatch of form 't', 'n' or 'tv' over the block of N rows and M out columns from m0
    (x_flat and out_flat already start at the block's first row; out_flat at its column m0)."""
    args = QuantizedMatmulArgs(N, M, K, w.shape[1], gs, beta, ldx, ldo, m0, s.shape[1])
    if form == "tv":
        grid, threads = (-(-M // ROWS_COLS), -(-N // ROWS_BLOCK), 1), (64, 1, 1)
    else:
        grid, threads = (-(-M // TILE), -(-N // TILE), 1), (128, 1, 1)
    lib.dispatch(f"quantized_matmul_{form}_{dt}_b{bits}", grid=grid, threads=threads,
                 buffers=[x_flat, w, s, b, out_flat, args], random_order=True, seed=seed)


def product(lib, form, dt, bits, gs, N, O, I, beta=0.0, pad=3, seed=0):
    """out = x op(W) (+ beta out) through the kernel; returns (out, reference, |x| |op(W)|, out's
    buffer) with the reference in float64 from the same rounded inputs."""
    xt, st = DT[dt]
    w, s, b, W = weights(O, I, bits, gs, st)
    K, M = (I, O) if form != "n" else (O, I)
    Wop = W.T if form != "n" else W
    x_flat, x = padded(N, K, K + pad, xt, rng.standard_normal((N, K)))
    out0 = rng.standard_normal((N, M)).astype(xt) if beta else None
    out_flat, out = padded(N, M, M + pad + 1, xt, out0)
    run(lib, form, dt, bits, gs, x_flat, K + pad, w, s, b, out_flat, M + pad + 1, N, M, K, beta, seed=seed)
    xf = x.astype(np.float64)
    ref = xf @ Wop + (beta * out0.astype(np.float64) if beta else 0)
    return out.astype(np.float64), ref, np.abs(xf) @ np.abs(Wop), out_flat


def check(got, ref, mag, dt, K, out_flat, N, M):
    # the f32 sum over K terms; 16-bit x also rounds each dequantized weight (the tiled form) and
    # the output once
    tol = (K + 4) * U32 * mag + (2 * U16 * mag + U16 * np.abs(ref) if dt != "f32" else 0)
    assert np.isfinite(got).all(), "out read where beta == 0, or x read outside its rows"
    bad = np.abs(got - ref) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} off; first {np.argwhere(bad)[:3].tolist()}"
    assert np.isnan(out_flat).sum() == out_flat.size - N * M, "written outside out"


# (N, O, I) per form: rows across the tile or row-block edges, out columns off the tile, K not
# a multiple of the 32-deep step where the group size allows (I = 3 groups at 16, O odd in `n`)
CASES = {"t": [(33, 45, 3), (31, 9, 2)], "n": [(33, 37, 2), (1, 70, 3)], "tv": [(1, 17, 3), (9, 3, 2)]}


@pytest.mark.parametrize("gs", affine.GROUP_SIZES)
@pytest.mark.parametrize("bits", affine.BITS)
@pytest.mark.parametrize("form", ["t", "n", "tv"])
def test_quantized_matmul_metal(libs, form, bits, gs):
    """Every bits and group size, each form, f32, at two shapes (I in groups)."""
    for N, O, groups in CASES[form]:
        I = groups * gs   # `n`: K = O, odd, below and across the 32-deep step
        if bits in (3, 5) and I % 32:   # their rows fill whole words every 32 codes
            I += gs
        got, ref, mag, out_flat = product(libs["plain"], form, "f32", bits, gs, N, O, I)
        check(got, ref, mag, "f32", O if form == "n" else I, out_flat, N, I if form == "n" else O)


@pytest.mark.parametrize("dt", ["f16", "f16_sf32"])
@pytest.mark.parametrize("form", ["t", "n", "tv"])
def test_quantized_matmul_metal_16_bit(libs, form, dt):
    """Half x and out, scales in half or f32, with beta: 3 and 6 bits (codes straddle words)."""
    for bits, (N, O, I, gs) in ((3, (33, 40, 96, 32)), (6, (31, 33, 128, 64))):
        if form == "tv":
            N = 7
        got, ref, mag, out_flat = product(libs["plain"], form, dt, bits, gs, N, O, I, beta=-0.5)
        check(got, ref, mag, dt, O if form == "n" else I, out_flat, N, I if form == "n" else O)


@pytest.mark.parametrize("form", ["t", "n", "tv"])
def test_quantized_matmul_metal_beta(libs, form):
    """beta != 0 adds beta out; beta == 0 never reads out (NaN there stays out of the result)."""
    N = 5 if form == "tv" else 33
    got, ref, mag, out_flat = product(libs["plain"], form, "f32", 4, 32, N, 35, 64, beta=0.75)
    check(got, ref, mag, "f32", 35 if form == "n" else 64, out_flat, N, 64 if form == "n" else 35)


@pytest.mark.parametrize("form", ["t", "n", "tv"])
def test_quantized_matmul_metal_blocks(libs, form):
    """The block interface: out's columns [m0, m0 + M) with args.m0 (rows of W in `t`, columns in
    `n`) and rows split by binding x and out at a later row reproduce the whole product bit for
    bit: the four quarters (split at an off-tile row and column) equal one dispatch."""
    bits, gs = 5, 16
    N, O, I = (11, 45, 96) if form == "tv" else (45, 45, 96)
    w, s, b, W = weights(O, I, bits, gs, np.float32)
    K, M = (O, I) if form == "n" else (I, O)
    ldx, ldo = K + 2, M + 5
    x_flat, _ = padded(N, K, ldx, np.float32, rng.standard_normal((N, K)))
    whole, _ = padded(N, M, ldo, np.float32, None)
    run(libs["plain"], form, "f32", bits, gs, x_flat, ldx, w, s, b, whole, ldo, N, M, K)
    parts, _ = padded(N, M, ldo, np.float32, None)
    nsplit = 5 if form == "tv" else 19
    msplit = 48 if form == "n" else 13   # `n`: a multiple of 8 (and of 16: a group boundary)
    for r0, rows in ((0, nsplit), (nsplit, N - nsplit)):
        for c0, cols in ((0, msplit), (msplit, M - msplit)):
            run(libs["plain"], form, "f32", bits, gs, x_flat[r0 * ldx:], ldx, w, s, b, parts[r0 * ldo + c0:], ldo,
                rows, cols, K, m0=c0)
    np.testing.assert_array_equal(parts, whole)
    assert np.isfinite(whole[np.arange(N)[:, None] * ldo + np.arange(M)]).all()


@pytest.mark.parametrize("form", ["t", "n"])
def test_quantized_matmul_metal_missing_barrier_detected(libs, form):
    """Without its barriers the tiled form reads tiles before (or after) they are staged: some
    random thread order must show it."""
    w, s, b, W = weights(40, 64, 4, 32, np.float32)
    K, M = (64, 40) if form == "t" else (40, 64)
    x = rng.standard_normal((33, K)).astype(np.float32)

    def go(lib, seed):
        out = np.full((33, M), np.nan, np.float32)
        run(lib, form, "f32", 4, 32, x, K, w, s, b, out, M, 33, M, K, seed=seed)
        return out
    ref = go(libs["plain"], 0)
    assert np.isfinite(ref).all()
    assert _caught(lambda seed: go(libs["nobarrier"], seed), ref)
