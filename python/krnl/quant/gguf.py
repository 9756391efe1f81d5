"""ggml's block quantizations turned, exactly, into krnl's affine layout (krnl.quant.affine): codes q in
[0, 2^bits), one scale s and one bias b per group of a row, such that s * q + b in float32 is
bit for bit the value ggml dequantizes (ggml-quants.c, gguf-py's quants.py).

    type  block bytes  ggml value                        krnl: bits  group  code        scale   bias
    Q8_0   32     34   d * q           (q int8)                 8     32    q + 128     d       -128 d
    Q4_0   32     18   d * (q - 8)     (q 4 bits)               4     32    q           d       -8 d
    Q4_1   32     20   d * q + m                                4     32    q           d       m
    Q4_K  256    144   (d sc_j) q - (dmin m_j)  (sc, m 6 bits)  4     32    q           d sc_j  -(dmin m_j)
    Q5_K  256    176   same with 5-bit q                        5     32    q           d sc_j  -(dmin m_j)
    Q6_K  256    210   (d sc_j) (q - 32)  (sc int8, q 6 bits)   6     16    q           d sc_j  -32 (d sc_j)

Why exact: d is an f16 (11 significant bits). Where a scale multiplies, it has at most 7 bits
(Q6_K's int8; 6 for the K-quants' 6-bit scales) and q at most 6 (5 in Q5_K, 4 in Q4_K); Q8_0
multiplies d by an 8-bit q alone. So every product has at most 24 significant bits and is exact
in float32; the one rounding left is the final addition, which ggml and s * q + b perform alike.
(For Q6_K, s q and 32 s are both exact, and so is their difference s (q - 32), at most 24 bits.)
The one difference is the sign of a zero: ggml's d * 0 with a negative d is -0, s * q + b is +0.

No Python loop runs per block: each type is a few whole-array numpy operations."""

import numpy as np

from . import affine

QK_K = 256

# type name -> (elements per block, bytes per block, bits, group size)
LAYOUTS = {
    "Q8_0": (32, 34, 8, 32),
    "Q4_0": (32, 18, 4, 32),
    "Q4_1": (32, 20, 4, 32),
    "Q4_K": (QK_K, 144, 4, 32),
    "Q5_K": (QK_K, 176, 5, 32),
    "Q6_K": (QK_K, 210, 6, 16),
}


def _f16(b):
    """(..., 2) uint8 -> (...) float32 of the little-endian f16 they hold."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _k_scales(s):
    """The 8 six-bit scales and mins of a K-quant super-block from its 12 bytes (..., 12):
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high)."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _nibbles(qs):
    """(..., n, 32) bytes -> (..., n, 2, 32): low nibbles (the first 32 values), then high."""
    return np.stack([qs & 15, qs >> 4], axis=-2)


def _q8_0(bl):
    d = _f16(bl[..., 0:2])                                              # (O, nb)
    codes = bl[..., 2:].view(np.int8).astype(np.int16) + 128            # (O, nb, 32)
    return codes, d, np.float32(-128) * d


def _q4_0(bl):
    d = _f16(bl[..., 0:2])
    codes = _nibbles(bl[..., None, 2:18])                               # (O, nb, 1, 2, 16)
    return codes, d, np.float32(-8) * d


def _q4_1(bl):
    d, m = _f16(bl[..., 0:2]), _f16(bl[..., 2:4])
    return _nibbles(bl[..., None, 4:20]), d, m


def _q4_k(bl):
    d, dmin = _f16(bl[..., 0:2])[..., None], _f16(bl[..., 2:4])[..., None]
    sc, mn = _k_scales(bl[..., 4:16])                                   # (O, nb, 8)
    O, nb = bl.shape[:2]
    codes = _nibbles(bl[..., 16:144].reshape(O, nb, 4, 32))            # (O, nb, 4, 2, 32): sub-blocks 2i, 2i+1
    return codes, d * sc, -(dmin * mn)


def _q5_k(bl):
    d, dmin = _f16(bl[..., 0:2])[..., None], _f16(bl[..., 2:4])[..., None]
    sc, mn = _k_scales(bl[..., 4:16])
    O, nb = bl.shape[:2]
    qh = bl[..., 16:48]                                                 # (O, nb, 32): bit j -> sub-block j
    low = _nibbles(bl[..., 48:176].reshape(O, nb, 4, 32)).reshape(O, nb, 8, 32)
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return low | (high << 4), d * sc, -(dmin * mn)


def _q6_k(bl):
    O, nb = bl.shape[:2]
    ql = bl[..., 0:128].reshape(O, nb, 2, 64)                          # two halves of 128 values
    qh = bl[..., 128:192].reshape(O, nb, 2, 32)
    sc = bl[..., 192:208].view(np.int8).astype(np.float32)              # (O, nb, 16)
    d = _f16(bl[..., 208:210])[..., None]
    # A half's values: low nibbles of ql[0:32], ql[32:64], then high nibbles of both; the top 2 bits
    # of value l + 32 k come from bits 2k, 2k + 1 of qh[l].
    low = _nibbles(ql.reshape(O, nb, 2, 2, 32)).swapaxes(-3, -2).reshape(O, nb, 2, 4, 32)
    high = (qh[..., None, :] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    s = d * sc
    return low | (high << 4), s, np.float32(-32) * s


_CONVERT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def _pack(codes, bits):
    """affine.pack's layout built bytewise: the row's bit stream in little-endian 32-bit words is
    the same stream in bytes, and g = 8 / gcd(bits, 8) codes fill g * bits / 8 whole bytes
    (one code a byte at 8 bits, two at 4, four codes in three bytes at 6, eight in five at 5)."""
    O, I = codes.shape
    if bits == 8:
        return np.ascontiguousarray(codes, np.uint8).view("<i4")
    if bits == 4:  # in uint8, faster than the general path's uint64
        c = np.ascontiguousarray(codes, np.uint8).reshape(O, -1, 2)
        return np.ascontiguousarray(c[..., 0] | (c[..., 1] << 4)).view("<i4")
    g = 8 // np.gcd(bits, 8)
    nb = g * bits // 8
    dt = np.uint32 if nb <= 4 else np.uint64
    c = np.asarray(codes, dt).reshape(O, I // g, g)
    v = np.zeros((O, I // g), dt)
    for k in range(g):
        v |= c[..., k] << dt(bits * k)
    out = np.empty((O, I // g, nb), np.uint8)
    for k in range(nb):
        out[..., k] = v >> dt(8 * k)  # the low byte (the cast to uint8 drops the rest)
    return out.reshape(O, -1).view("<i4")


def convert(type_name, raw, rows, cols):
    """(packed codes (rows, cols * bits / 32) int32, scales (rows, cols / gs) f32, biases, bits,
    group size, scale dtype) of a ggml tensor of `type_name` whose rows of `cols` values are the
    rows of `raw` (uint8, rows * bytes per row). The scale dtype is "f16" when every scale and
    bias is an f16 value (the file's d as it is), else "f32": nothing is ever rounded."""
    qk, nbytes, bits, gs = LAYOUTS[type_name]
    if cols % qk:
        raise ValueError(f"[gguf] a {type_name} row of {cols} values is not whole blocks of {qk}")
    bl = np.ascontiguousarray(raw, np.uint8).reshape(rows, cols // qk, nbytes)
    codes, scales, biases = _CONVERT[type_name](bl)
    with np.errstate(over="ignore", invalid="ignore"):
        scales = np.ascontiguousarray(scales, np.float32).reshape(rows, cols // gs)
        biases = np.ascontiguousarray(biases, np.float32).reshape(rows, cols // gs)
        f16 = all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in (scales, biases))
    return (_pack(codes.reshape(rows, cols), bits), scales, biases, bits, gs, "f16" if f16 else "f32")


def convert_mxfp4(raw, rows, cols):
    """(packed codes (rows, cols / 8) int32, E8M0 scales (rows, cols / 32) uint8) of ggml's MXFP4 blocks
    (a scale byte, then 16 bytes whose low nibbles are the block's first 16 E2M1 codes and whose
    high nibbles its last 16): the same codes in krnl.quant.mxfp4's order, nothing dequantized."""
    if cols % 32:
        raise ValueError(f"[gguf] an MXFP4 row of {cols} values is not whole blocks of 32")
    bl = np.ascontiguousarray(raw, np.uint8).reshape(rows, cols // 32, 17)
    codes = np.concatenate([bl[..., 1:] & 15, bl[..., 1:] >> 4], axis=-1)  # (rows, blocks, 32)
    return _pack(codes.reshape(rows, cols), 4), np.ascontiguousarray(bl[..., 0])
