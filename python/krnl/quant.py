"""Affine group quantization in MLX's layout (what `mlx_lm.convert -q` writes and
`ops.quantized_matmul` reads), in numpy.

A weight W (O, I) is cut into groups of `group_size` consecutive inputs of a row; each group
keeps a scale and a bias and codes q in [0, 2^bits), W ~ scale * q + bias. The codes of a row are
packed 32 / bits to a 32-bit word, element j in word j // (32 / bits) at bit (j % (32 / bits)) *
bits, stored as int32 (krnl has no unsigned dtype; the bits are the same)."""

import numpy as np

BITS = (2, 4, 8)
GROUP_SIZES = (32, 64, 128)


def check(shape, bits, group_size, what="W"):
    """One-line errors for a layout quantized_matmul cannot take."""
    if bits not in BITS:
        raise ValueError(f"[quantize] bits must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"[quantize] group_size must be one of {GROUP_SIZES}, got {group_size}")
    if len(shape) != 2 or shape[1] % group_size:
        raise ValueError(f"[quantize] {what} must be 2-D with its last dimension a multiple of group_size "
                         f"{group_size}, got shape {tuple(shape)}")


def pack(codes, bits):
    """(O, I) integer codes in [0, 2^bits) -> (O, I * bits / 32) int32 words."""
    codes = np.asarray(codes)
    per = 32 // bits
    O, I = codes.shape
    if I % per:
        raise ValueError(f"[quantize] a row of {I} codes does not fill whole 32-bit words at {bits} bits")
    c = codes.astype(np.uint32).reshape(O, I // per, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(c << shifts, axis=2).view(np.int32)


def unpack(w, bits):
    """(O, words) int32 (or uint32) words -> (O, words * 32 / bits) codes as uint32."""
    per = 32 // bits
    u = np.ascontiguousarray(w).view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    return ((u[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)).reshape(u.shape[0], -1)


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
