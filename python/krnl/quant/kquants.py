"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) written by krnl: what llama.cpp's quantizers produce without an
importance matrix (ggml-quants.c's quantize_row_q4_K_ref, _q5_K_ref, _q6_K_ref), byte for byte.

    Q4_K, Q5_K  8 sub-blocks of 32: make_qkx2_quants fits each a scale and a min (codes 0..15 or 0..31)
                with weights av_x + |x|, searching the step over (nmax + rmin + rdelta k) / (max - min);
                the scales and the mins are then coded in 6 bits against d = max scale / 63 and
                dmin = max min / 63 (both f16), and every value is coded again against them.
    Q6_K        16 sub-blocks of 16: make_qx_quants (weights x^2) fits each a signed scale, searching
                the step over (32 + 0.1 k) / max|x|, k = -9..9; the scales become int8 against
                d = max|scale| / 128 (f16), and every value is coded again, in -32..31.

Why the bytes are ggml's: every step is the same float32 operation in the same order (numpy's
float32 ufuncs round each operation as C does where the compiler fuses no multiply-add, as in
x86-64 builds of ggml-base; an arm64 build may fuse some and differ in rare blocks), sums
over a sub-block are folded left to right as ggml's loops add (numpy's own sum pairs terms and can
differ in the last bit, and then a tie in the search can go the other way), nearest_int is ggml's
bit trick, f16 rounding is to nearest even in both, and integer narrowing wraps as C's does.

The work is vectorised over sub-blocks: each sub-block is a column of a (32, n) or (16, n) array,
so one numpy operation advances every sub-block by one element or one search step. The blocks go
through in chunks, small enough to stay in cache and to bound the temporaries."""

import numpy as np

from .gguf import LAYOUTS, QK_K

QTYPES = {"q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}
BLOCK_BYTES = {q: LAYOUTS[name][1] for q, name in QTYPES.items()}
_CHUNK = 512  # super-blocks per chunk: 128K values, 512 KB a float32 temporary, fits in cache
_F = np.float32
_EPS = _F(1e-15)  # ggml's GROUP_MAX_EPS: a sub-block with no |x| above it is all zero


def _nearest_int(v):
    """ggml's nearest_int of float32 v as int32: the low mantissa bits of v + 1.5 * 2^23, which is
    v rounded half to even for |v| < 2^22 and, beyond, the same meaningless number ggml gets."""
    t = np.asarray(v, np.float32) + _F(12582912.0)
    return (t.view(np.int32) & 0x7FFFFF) - 0x400000


def _code(v, lo, hi):
    """nearest_int(v) clamped to [lo, hi], as float32 for the products that follow."""
    return np.clip(_nearest_int(v), lo, hi).astype(np.float32)


def _fold(a):
    """The sum over axis 0, added left to right as ggml's loops add (from +0: a sum of -0s is +0)."""
    s = a[0] + _F(0)
    for row in a[1:]:
        s += row
    return s


def _qkx2(x, w, nmax, rmin, rdelta, nstep):
    """make_qkx2_quants for the sub-blocks in the columns of x (n, B) with weights w: (codes (n, B)
    float32, scales (B,), mins (B,), the mins positive: the value is scale * code - min)."""
    lo = np.minimum(x.min(axis=0), _F(0))
    hi = x.max(axis=0)
    flat = hi == lo
    sum_w, sum_x = _fold(w), _fold(w * x)
    iscale = _F(nmax) / (hi - lo)
    scale = _F(1) / iscale
    L = _code(iscale * (x - lo), 0, nmax)
    best = _fold(w * np.square(scale * L + lo - x))
    for k in range(nstep + 1):
        # ggml moves `min` to each better fit, so later steps measure from the fitted min.
        step = _F(rmin) + _F(rdelta) * _F(k) + _F(nmax)
        l = _code(step / (hi - lo) * (x - lo), 0, nmax)
        wl = w * l
        sum_l, sum_l2, sum_xl = _fold(wl), _fold(wl * l), _fold(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0  # a positive min is not codable: fit the scale alone
        this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        this_min = np.where(pos, _F(0), this_min)
        err = _fold(w * np.square(this_scale * l + this_min - x))
        better = (D > 0) & (err < best)
        L = np.where(better, l, L)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        lo = np.where(better, this_min, lo)
    return np.where(flat, _F(0), L), np.where(flat, _F(0), scale), -lo


def _qx(x, nmax):
    """make_qx_quants with rmse_type 1 (weights x^2) for the sub-blocks in the columns of x (n, B):
    (codes (n, B) in [0, 2 nmax) as float32, scales (B,)); the value is scale * (code - nmax)."""
    B = x.shape[1]
    mx = x[np.argmax(np.abs(x), axis=0), np.arange(B)]  # the first value of largest |x|
    w = x * x
    wx = w * x

    def fit(iscale):
        l = _code(iscale * x, -nmax, nmax - 1)
        wl = w * l
        return l, _fold(wx * l), _fold(wl * l)

    L, sumlx, suml2 = fit(_F(-nmax) / mx)
    scale = np.where(suml2 != 0, sumlx / suml2, _F(0))
    best = scale * sumlx
    for k in range(-9, 10):
        if k:
            l, slx, sl2 = fit(-(_F(nmax) + _F(0.1) * _F(k)) / mx)
            better = (sl2 > 0) & (slx * slx > best * sl2)
            L = np.where(better, l, L)
            scale = np.where(better, slx / sl2, scale)
            best = np.where(better, scale * slx, best)
    zero = np.abs(mx) < _EPS
    return np.where(zero, _F(0), L + _F(nmax)), np.where(zero, _F(0), scale)


def _f16_bytes(v):
    """(n,) float32 -> (n, 2) uint8: the little-endian f16 nearest v (ties to even, as ggml's)."""
    return np.ascontiguousarray(v.astype("<f2")).view(np.uint8).reshape(-1, 2)


def _sub_blocks(x, n):
    """(N, 256) -> (n, N * 256 / n): each sub-block of n values a column."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def _k_fit(x, nmax, rmin, rdelta, nstep):
    """The shared half of Q4_K and Q5_K for super-blocks x (N, 256): (codes (N, 256) uint8, the
    12 scale bytes (N, 12), d and dmin as f16 bytes (N, 2) each)."""
    N = x.shape[0]
    xs = _sub_blocks(x, 32)
    av_x = np.sqrt(_fold(xs * xs) / _F(32))
    L, scales, mins = _qkx2(xs, av_x + np.abs(xs), nmax, rmin, rdelta, nstep)

    def six_bits(v):  # per super-block: codes of v against its largest, then that largest / 63 as f16
        v = v.reshape(N, 8)
        top = np.fmax.reduce(v, axis=1, initial=_F(0))  # fmax: a NaN never wins, as in ggml's `>`
        inv = np.where(top > 0, _F(63) / top, _F(0))
        q = np.minimum(_nearest_int(inv[:, None] * v) & 0xFF, 63).astype(np.uint8)  # C's uint8_t wraps
        return q, (top / _F(63)).astype(np.float16)

    ls, d = six_bits(scales)
    lm, dmin = six_bits(mins)
    # Code every value again against the 6-bit scales and mins; a sub-block whose scale codes to 0
    # keeps its codes from the fit (ggml skips it).
    dl = (d.astype(np.float32)[:, None] * ls.astype(np.float32)).reshape(-1)
    ml = (dmin.astype(np.float32)[:, None] * lm.astype(np.float32)).reshape(-1)
    L = np.where(dl != 0, _code((xs + ml) / dl, 0, nmax), L)
    codes = L.T.reshape(N, QK_K).astype(np.uint8)
    # Scale bytes 0-3: scales 0-3 and, in the top 2 bits, bits 4-5 of scales 4-7; bytes 4-7 the same
    # for the mins; bytes 8-11: the low nibbles of scales 4-7, and of mins 4-7 above them.
    sb = np.concatenate([ls[:, :4] | (ls[:, 4:] >> 4) << 6, lm[:, :4] | (lm[:, 4:] >> 4) << 6,
                         (ls[:, 4:] & 15) | (lm[:, 4:] & 15) << 4], axis=1)
    return codes, sb, _f16_bytes(d), _f16_bytes(dmin)


def _low_nibbles(codes):
    """(N, 256) codes -> (N, 128): byte 32 c + l holds value 64 c + l's low 4 bits and, above them,
    value 64 c + 32 + l's."""
    c = (codes & 15).reshape(-1, 4, 2, 32)
    return (c[:, :, 0] | c[:, :, 1] << 4).reshape(-1, 128)


def _q4_k(x):
    codes, sb, d, dmin = _k_fit(x, 15, -1.0, 0.1, 20)
    return np.concatenate([d, dmin, sb, _low_nibbles(codes)], axis=1)


def _q5_k(x):
    codes, sb, d, dmin = _k_fit(x, 31, -0.5, 0.1, 15)
    # High bits: bit j of byte l is value 32 j + l's fifth bit.
    high = (codes >> 4).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]
    return np.concatenate([d, dmin, sb, np.bitwise_or.reduce(high, axis=1), _low_nibbles(codes)], axis=1)


def _q6_k(x):
    N = x.shape[0]
    xs = _sub_blocks(x, 16)
    L, scales = _qx(xs, 32)
    scales = scales.reshape(N, 16)
    top = scales[np.arange(N), np.argmax(np.abs(scales), axis=1)]  # signed, the first of largest |scale|
    zero = np.abs(top) < _EPS  # ggml writes such a block as all zero bytes
    iscale = np.where(zero, _F(0), _F(-128) / top)
    sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)  # C's int8_t wraps
    d = np.where(zero, _F(0), _F(1) / iscale).astype(np.float16)
    dl = (d.astype(np.float32)[:, None] * sc.astype(np.float32)).reshape(-1)
    L = np.where(dl != 0, _code(xs / dl, -32, 31) + _F(32), L)
    q = L.T.reshape(N, 2, 4, 32).astype(np.uint8)  # two halves of 128 values, four quarters each
    # A half's 64 low bytes: quarters 0 and 1's low nibbles, quarters 2 and 3's above them; its 32
    # high bytes: the top 2 bits of quarter k at bits 2k, 2k + 1.
    ql = (q[:, :, :2] & 15) | (q[:, :, 2:] & 15) << 4
    qh = np.bitwise_or.reduce((q >> 4) << np.array([0, 2, 4, 6], np.uint8)[:, None], axis=2)
    out = np.concatenate([ql.reshape(N, 128), qh.reshape(N, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)
    out[zero] = 0
    return out


_QUANTIZE = {"q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


def quantize(w, qtype):
    """(rows, cols / 256 * BLOCK_BYTES[qtype]) uint8: the GGUF blocks of `qtype` ("q4_k", "q5_k" or
    "q6_k") of the float32 matrix w (rows, cols), each row its own run of blocks, as llama.cpp
    quantizes it without an importance matrix. cols must be a multiple of 256. (llama-quantize
    reads an f16 file: pass the f16-rounded weights to get its bytes.)"""
    if qtype not in QTYPES:
        raise ValueError(f"[kquants] qtype must be one of {sorted(QTYPES)}, got {qtype!r}")
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"[kquants] {qtype}: the weight must be 2-D (rows, columns), got shape {w.shape}")
    rows, cols = w.shape
    if cols % QK_K:
        raise ValueError(f"[kquants] {qtype}: columns must be a multiple of {QK_K}, got {cols}")
    if not np.isfinite(w).all():
        raise ValueError(f"[kquants] {qtype}: the weight has non-finite values (inf or nan)")
    blocks = w.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], BLOCK_BYTES[qtype]), np.uint8)
    with np.errstate(all="ignore"):  # flat or all-zero sub-blocks divide by 0; their results are replaced
        for i in range(0, blocks.shape[0], _CHUNK):
            out[i:i + _CHUNK] = _QUANTIZE[qtype](blocks[i:i + _CHUNK])
    return out.reshape(rows, -1)
