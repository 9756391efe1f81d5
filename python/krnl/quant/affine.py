"""Affine group quantization in MLX's layout (what `mlx_lm.convert -q` writes and
`ops.quantized_matmul` reads), in numpy.

A weight W (O, I) is cut into groups of `group_size` consecutive inputs of a row; each group
keeps a scale and a bias and codes q in [0, 2^bits), W ~ scale * q + bias. The codes of a row are
one little-endian bit stream, element j at bit j * bits (for 2, 4 and 8 bits: 32 / bits codes to
a word, element j in word j // (32 / bits) at bit (j % (32 / bits)) * bits; 3, 5 and 6 bits
straddle words), stored as 32-bit words typed int32 (krnl has no unsigned dtype; the bits are the
same). Group size 16 is krnl's own (GGUF's Q6_K); MLX takes 32, 64 and 128."""

import math

import numpy as np

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (16, 32, 64, 128)
MLX_GROUP_SIZES = (32, 64, 128)


def check(shape, bits, group_size, what="W"):
    """One-line errors for a layout quantized_matmul cannot take."""
    if bits not in BITS:
        raise ValueError(f"[quantize] bits must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"[quantize] group_size must be one of {GROUP_SIZES}, got {group_size}")
    if len(shape) != 2 or shape[1] % group_size or shape[1] * bits % 32:
        raise ValueError(f"[quantize] {what} must be 2-D with its last dimension a multiple of group_size "
                         f"{group_size} (and whole 32-bit words of {bits}-bit codes), got shape {tuple(shape)}")


def _period(bits):
    """(codes, words) of the shortest run of codes that fills whole 32-bit words."""
    p = 32 // math.gcd(bits, 32)
    return p, p * bits // 32


def pack(codes, bits):
    """(O, I) integer codes in [0, 2^bits) -> (O, I * bits / 32) int32 words."""
    codes = np.asarray(codes)
    O, I = codes.shape
    P, W = _period(bits)
    if I % P:
        raise ValueError(f"[quantize] a row of {I} codes does not fill whole 32-bit words at {bits} bits")
    c = codes.astype(np.uint64).reshape(O, I // P, P)
    words = np.zeros((O, I // P, W), np.uint64)
    for k in range(P):  # code k of each period: its low bits in word wi, the rest in wi + 1
        wi, sh = divmod(k * bits, 32)
        v = c[:, :, k] << np.uint64(sh)
        words[:, :, wi] |= v & np.uint64(0xFFFFFFFF)
        if sh + bits > 32:
            words[:, :, wi + 1] |= v >> np.uint64(32)
    return words.astype(np.uint32).reshape(O, -1).view(np.int32)


def unpack(w, bits):
    """(O, words) int32 (or uint32) words -> (O, words * 32 / bits) codes as uint32."""
    u = np.ascontiguousarray(w).view(np.uint32)
    P, W = _period(bits)
    O = u.shape[0]
    if u.shape[1] % W:
        raise ValueError(f"[quantize] a row of {u.shape[1]} words does not hold whole codes at {bits} bits")
    u = u.reshape(O, -1, W).astype(np.uint64)
    out = np.empty((O, u.shape[1], P), np.uint32)
    mask = np.uint64((1 << bits) - 1)
    for k in range(P):
        wi, sh = divmod(k * bits, 32)
        v = u[:, :, wi] >> np.uint64(sh)
        if sh + bits > 32:
            v |= u[:, :, wi + 1] << np.uint64(32 - sh)
        out[:, :, k] = v & mask
    return out.reshape(O, -1)


def quantize(w, bits=4, group_size=64):
    """(packed codes (O, I * bits / 32) int32, scales (O, G) f32, biases (O, G) f32) of w (O, I), as
    mx.quantize computes them in float32: per group the end of larger magnitude is represented
    exactly (it becomes the bias, q = 0 there) and the step is the range / (2^bits - 1), adjusted
    so that the other end falls on a whole number of steps from it. Round `scales` and `biases` to
    the model dtype afterwards as MLX stores them (its quantize returns them in w's dtype)."""
    w = np.asarray(w, np.float32)
    check(w.shape, bits, group_size)
    O, I = w.shape
    g = w.reshape(O, I // group_size, group_size)
    n_bins = np.float32((1 << bits) - 1)
    lo, hi = g.min(axis=2), g.max(axis=2)
    from_lo = np.abs(lo) > np.abs(hi)
    step = np.maximum((hi - lo) / n_bins, np.float32(1e-7))
    step = np.where(from_lo, step, -step).astype(np.float32)  # negative: codes count down from hi
    edge = np.where(from_lo, lo, hi)
    q0 = np.rint(edge / step)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(q0 != 0, edge / q0, step).astype(np.float32)
    biases = np.where(q0 != 0, edge, np.float32(0)).astype(np.float32)
    q = np.rint((g - biases[..., None]) / scales[..., None])
    codes = np.clip(q, 0, n_bins).astype(np.uint32).reshape(O, I)
    return pack(codes, bits), scales, biases


def dequantize(w, scales, biases, bits, group_size):
    """W (O, I) float32 from its packed codes, scales and biases (any float dtype)."""
    codes = unpack(w, bits).astype(np.float32)
    O, I = codes.shape
    check((O, I), bits, group_size)
    s = np.repeat(np.asarray(scales, np.float32), group_size, axis=1)
    b = np.repeat(np.asarray(biases, np.float32), group_size, axis=1)
    if s.shape != (O, I):
        raise ValueError(f"[quantize] scales {np.shape(scales)} do not match codes ({O}, {I}) at group_size "
                         f"{group_size}")
    return s * codes + b
