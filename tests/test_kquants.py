"""krnl's K-quant writer (krnl.quant.kquants): its bytes read back alike through gguf-py, krnl's GGUF
reader and a decoder written here from the block layouts; its error matches a float64 rendering of
llama.cpp's reference quantizers written here as plain loops; with llama-cpp-python installed
(marker `llama`) its bytes are ggml's own (ggml_quantize_chunk, no importance matrix); bad input
raises one-line errors."""

import ctypes

import numpy as np
import pytest

from krnl.quant import gguf as gguf_quants
from krnl.quant.kquants import BLOCK_BYTES, quantize
from krnl.quant.qweight import QuantizedArray

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

TYPES = {"q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}


def _bf16(a):
    """float32 rounded to bf16 values (ties to even): what real weights are, with many exact ties."""
    u = np.asarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def _weights(kind, rows, cols, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(rows, cols)) * 0.02
    if kind == "outliers":  # 1% of the values 20x larger, as in attention and MLP weights
        w *= np.where(rng.random((rows, cols)) < 0.01, 20.0, 1.0)
    return w.astype(np.float32)


# ---- layout ----------------------------------------------------------------------------------


def _where_bits_live(qtype):
    """For each of a block's 256 values: (byte of its low 4 bits, their shift, byte of its high
    bits, their shift, mask of the high bits, its sub-block). Written from the layouts: Q4_K and
    Q5_K keep 64 values in 32 bytes (value 64 c + l in byte 32 c + l, low nibble; 64 c + 32 + l
    high nibble) and Q5_K the fifth bit of value 32 j + l at bit j of byte l; Q6_K keeps a half
    of 128 values in 64 low bytes (quarters 0, 1 in the low nibbles, 2, 3 in the high) and 32
    high bytes (quarter k's top 2 bits at bit 2k)."""
    table = []
    for i in range(256):
        if qtype == "q6_k":
            h, k, l = i // 128, i % 128 // 32, i % 32
            table.append((64 * h + 32 * (k % 2) + l, 4 * (k // 2), 32 * h + l, 2 * k, 3, i // 16))
        else:
            c, half, l = i // 64, i % 64 // 32, i % 32
            table.append((32 * c + l, 4 * half, l, i // 32, 1 if qtype == "q5_k" else 0, i // 32))
    return np.array(table).T


def _decode(raw, qtype):
    """float64 values of blocks (N, bytes) of `qtype`, read by the layouts above."""
    b = raw.reshape(-1, BLOCK_BYTES[qtype]).astype(np.int64)

    def f16(at):
        return raw.reshape(b.shape)[:, at:at + 2].copy().view("<f2")[:, 0].astype(np.float64)

    low_at, low_shift, high_at, high_shift, high_mask, sub = _where_bits_live(qtype)
    if qtype == "q6_k":
        ql, qh = b[:, :128], b[:, 128:192]
        scales = b[:, 192:208].astype(np.uint8).view(np.int8).astype(np.float64)
        q = ((ql[:, low_at] >> low_shift) & 15) | (((qh[:, high_at] >> high_shift) & 3) << 4)
        return f16(208)[:, None] * scales[:, sub] * (q - 32)
    s = b[:, 4:16]
    sc = [s[:, j] & 63 if j < 4 else (s[:, j + 4] & 15) | (s[:, j - 4] >> 6) << 4 for j in range(8)]
    mn = [s[:, j + 4] & 63 if j < 4 else (s[:, j + 4] >> 4) | (s[:, j] >> 6) << 4 for j in range(8)]
    sc, mn = np.stack(sc, axis=1).astype(np.float64), np.stack(mn, axis=1).astype(np.float64)
    qs = b[:, 48:176] if qtype == "q5_k" else b[:, 16:144]
    q = (qs[:, low_at] >> low_shift) & 15
    if qtype == "q5_k":
        q |= ((b[:, 16:48][:, high_at] >> high_shift) & high_mask) << 4
    return f16(0)[:, None] * sc[:, sub] * q - f16(2)[:, None] * mn[:, sub]


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 31, 33, 127])
@pytest.mark.parametrize("cols", [256, 512])
def test_bytes_read_back_alike(qtype, rows, cols):
    w = _weights("outliers", rows, cols, seed=rows + cols)
    w[0, :32] = 0.0     # an all-zero sub-block
    w[-1, -64:] = -0.5  # a flat negative one
    raw = quantize(w, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (rows, cols // 256 * BLOCK_BYTES[qtype])
    name = TYPES[qtype]
    ours = _decode(raw, qtype).reshape(rows, cols)
    theirs = dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(rows, cols)
    a = QuantizedArray(*gguf_quants.convert(name, raw, rows, cols))
    krnl_read = np.asarray(a, np.float32)
    # Each product of d, a scale and a code is exact in float32 and the one rounding left is the
    # final subtraction, so the float64 values rounded once are gguf-py's and krnl's bit for bit.
    assert np.array_equal(theirs, ours.astype(np.float32))
    assert np.array_equal(krnl_read, theirs)
    assert np.sqrt(np.mean((theirs - w) ** 2)) < 0.1 * np.sqrt(np.mean(w ** 2))


def test_special_blocks():
    w = np.zeros((4, 512), np.float32)
    w[1] = -0.25                                 # constant negative: all in the min
    w[2, 3] = 1.0                                # one value in a zero block
    w[3] = np.linspace(-1, 1, 512, dtype=np.float32)
    for qtype, name in TYPES.items():
        raw = quantize(w, qtype)
        got = dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(w.shape)
        assert np.array_equal(got[0], w[0]), qtype  # zero stays zero
        np.testing.assert_allclose(got[1:3], w[1:3], atol=2e-3, err_msg=qtype)
        np.testing.assert_allclose(got[3], w[3], atol=0.07, err_msg=qtype)
    assert not quantize(w[:1], "q6_k").any()  # ggml writes an all-zero Q6_K block as zero bytes


# ---- quality against llama.cpp's algorithm in float64 -----------------------------------------


def _f16(v):
    return float(np.float16(v))


def _ref_qkx2(x, w, nmax, rmin, rdelta, nstep):
    """make_qkx2_quants: (codes, scale, min) with value = scale * code - min."""
    lo, hi = min(x.min(), 0.0), x.max()
    if hi == lo:
        return np.zeros_like(x), 0.0, -lo
    sum_w, sum_x = w.sum(), (w * x).sum()
    scale = (hi - lo) / nmax
    L = np.clip(np.rint(nmax / (hi - lo) * (x - lo)), 0, nmax)
    best = (w * (scale * L + lo - x) ** 2).sum()
    for k in range(nstep + 1):
        l = np.clip(np.rint((rmin + rdelta * k + nmax) / (hi - lo) * (x - lo)), 0, nmax)
        sl, sl2, sxl = (w * l).sum(), (w * l * l).sum(), (w * l * x).sum()
        D = sum_w * sl2 - sl * sl
        if D <= 0:
            continue
        s, m = (sum_w * sxl - sum_x * sl) / D, (sl2 * sum_x - sl * sxl) / D
        if m > 0:
            s, m = sxl / sl2, 0.0
        err = (w * (s * l + m - x) ** 2).sum()
        if err < best:
            L, best, scale, lo = l, err, s, m  # ggml measures later steps from this min
    return L, scale, -lo


def _ref_q45(block, nmax, rmin, rdelta, nstep):
    subs = block.reshape(8, 32)
    fits = [_ref_qkx2(x, np.sqrt(np.mean(x * x)) + np.abs(x), nmax, rmin, rdelta, nstep) for x in subs]
    scales, mins = np.array([f[1] for f in fits]), np.array([f[2] for f in fits])
    out = []
    top_s, top_m = max(scales.max(), 0.0), max(mins.max(), 0.0)
    d, dmin = _f16(top_s / 63), _f16(top_m / 63)
    for x, (L, s, m) in zip(subs, fits):
        ls = min(np.rint(63 * s / top_s), 63) if top_s > 0 else 0
        lm = min(np.rint(63 * m / top_m), 63) if top_m > 0 else 0
        if d * ls:
            L = np.clip(np.rint((x + dmin * lm) / (d * ls)), 0, nmax)
        out.append(d * ls * L - dmin * lm)
    return np.concatenate(out)


def _ref_qx(x, nmax=32):
    """make_qx_quants, weights x^2: (codes in [0, 2 nmax), scale), value = scale * (code - nmax)."""
    mx = x[np.argmax(np.abs(x))]
    if abs(mx) < 1e-15:
        return np.zeros_like(x), 0.0
    w = x * x

    def fit(iscale):
        l = np.clip(np.rint(iscale * x), -nmax, nmax - 1)
        return l, (w * x * l).sum(), (w * l * l).sum()

    L, slx, sl2 = fit(-nmax / mx)
    scale = slx / sl2 if sl2 else 0.0
    best = scale * slx
    for k in [k for k in range(-9, 10) if k]:
        l, slx, sl2 = fit(-(nmax + 0.1 * k) / mx)
        if sl2 > 0 and slx * slx > best * sl2:
            L, scale, best = l, slx / sl2, slx * slx / sl2
    return L + nmax, scale


def _ref_q6(block):
    subs = block.reshape(16, 16)
    fits = [_ref_qx(x) for x in subs]
    scales = np.array([f[1] for f in fits])
    top = scales[np.argmax(np.abs(scales))]
    if abs(top) < 1e-15:
        return np.zeros(256)
    d = _f16(top / -128)
    out = []
    for x, (L, _), s in zip(subs, fits, scales):
        dl = d * min(np.rint(-128 / top * s), 127)
        if dl:
            L = np.clip(np.rint(x / dl), -32, 31) + 32
        out.append(dl * (L - 32))
    return np.concatenate(out)


REFERENCE = {"q4_k": lambda b: _ref_q45(b, 15, -1.0, 0.1, 20), "q5_k": lambda b: _ref_q45(b, 31, -0.5, 0.1, 15),
             "q6_k": _ref_q6}


def _rms(a, w):
    return float(np.sqrt(np.mean((np.asarray(a, np.float64) - w) ** 2)))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("kind", ["gaussian", "outliers"])
def test_error_matches_llama_cpp_algorithm(qtype, kind):
    w = _weights(kind, 16, 1024, seed=7)
    got = dequantize(quantize(w, qtype), gguf.GGMLQuantizationType[TYPES[qtype]]).reshape(w.shape)
    w64 = w.astype(np.float64)
    ref = np.stack([REFERENCE[qtype](b) for b in w64.reshape(-1, 256)]).reshape(w.shape)
    ratio = _rms(got, w64) / _rms(ref, w64)
    assert ratio <= 1.02, f"{qtype} {kind}: RMS error {ratio:.4f}x the float64 reference's"


# ---- llama.cpp itself ---------------------------------------------------------------------------


def _ggml_quantize(w, qtype):
    """ggml_quantize_chunk of llama-cpp-python's ggml, no importance matrix: what llama-quantize
    writes for a tensor of this type without --imatrix."""
    lib = pytest.importorskip("llama_cpp._ggml").libggml
    fn = lib.ggml_quantize_chunk
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    fn.restype = ctypes.c_size_t
    w = np.ascontiguousarray(w, np.float32)
    out = np.zeros((w.shape[0], w.shape[1] // 256 * BLOCK_BYTES[qtype]), np.uint8)
    ggml_type = int(gguf.GGMLQuantizationType[TYPES[qtype]])  # gguf-py's numbering is ggml's enum
    assert fn(ggml_type, w.ctypes.data, out.ctypes.data, 0, w.shape[0], w.shape[1], None) == out.size
    return out


@pytest.mark.llama
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("kind", ["gaussian", "outliers", "bf16", "edges"])
def test_same_bytes_as_ggml(qtype, kind):
    w = _weights({"bf16": "gaussian", "edges": "outliers"}.get(kind, kind), 64, 2048, seed=3)
    if kind == "bf16":
        w = _bf16(w)
    if kind == "edges":  # zero, flat, huge, tiny and one-hot blocks
        w[0], w[1], w[2, :256], w[3] = 0.0, -0.3, 3e4, w[3] * 1e-30
        w[4], w[4, 5] = 0.0, 1.0
    theirs = _ggml_quantize(w, qtype)
    ours = quantize(w, qtype)
    gtype = gguf.GGMLQuantizationType[TYPES[qtype]]
    ratio = _rms(dequantize(ours, gtype), w) / _rms(dequantize(theirs, gtype), w)
    assert ratio <= 1.05, f"{qtype} {kind}: RMS error {ratio:.4f}x ggml's"
    blocks = (ours.reshape(-1, BLOCK_BYTES[qtype]) != theirs.reshape(-1, BLOCK_BYTES[qtype])).any(axis=1)
    assert not blocks.any(), f"{qtype} {kind}: {blocks.sum()} of {blocks.size} blocks differ from ggml's"


# ---- errors -----------------------------------------------------------------------------------


def test_errors():
    w = np.zeros((2, 256), np.float32)
    with pytest.raises(ValueError, match=r"\[kquants\] qtype must be one of .*'q4_0'"):
        quantize(w, "q4_0")
    with pytest.raises(ValueError, match=r"\[kquants\] q4_k: columns must be a multiple of 256, got 300"):
        quantize(np.zeros((2, 300), np.float32), "q4_k")
    with pytest.raises(ValueError, match=r"\[kquants\] q5_k: the weight must be 2-D"):
        quantize(np.zeros(256, np.float32), "q5_k")
    for bad in (np.nan, np.inf, -np.inf):
        w[1, 7] = bad
        with pytest.raises(ValueError, match=r"\[kquants\] q6_k: the weight has non-finite values"):
            quantize(w, "q6_k")
