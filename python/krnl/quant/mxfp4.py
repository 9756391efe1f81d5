"""MXFP4 (OCP microscaling FP4) in numpy: what `mx.quantize(w, group_size=32, bits=4, mode="mxfp4")`
writes, gpt-oss's checkpoints hold, and `ops.quantized_matmul(..., mode="mxfp4")` reads.

A weight W (O, I) is cut into groups of 32 consecutive inputs of a row; each group keeps one scale
2^(e - 127), e an unsigned byte (E8M0, 255 is NaN), and each weight a 4-bit E2M1 code: bit 3 the
sign, bits 0-2 index the magnitudes E2M1[:8]. Codes are packed as krnl.quant.affine packs 4-bit codes
(element j of a row at bit 4 j of its little-endian bit stream), so w is (O, I / 8) int32; no biases.
The devices take the scales as floats: e8m0_to_float's exact powers of two in f32 (or a bf16
compute dtype's bf16, which holds them all; f16 cannot)."""

import numpy as np

from . import affine

BITS = 4
GROUP_SIZE = 32
# The E2M1 values of the 16 codes: bit 3 the sign
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
# Magnitudes rounded to E2M1: a|w| above the k-th midpoint takes at least code k + 1; a tie keeps
# the smaller magnitude (as mx.quantize rounds)
_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5], np.float32)


def check(shape, what="W"):
    """One-line errors for a shape mxfp4 cannot hold."""
    if len(shape) != 2 or shape[1] % GROUP_SIZE:
        raise ValueError(f"[quantize] {what} must be 2-D with its last dimension a multiple of {GROUP_SIZE} "
                         f"for mxfp4, got shape {tuple(shape)}")


def e8m0_to_float(e):
    """E8M0 bytes (uint8 or any integer array) -> their scales 2^(e - 127) as float32, exact (2^-127 a
    subnormal); 255 is NaN."""
    e = np.asarray(e).astype(np.int32)
    s = np.ldexp(np.float32(1), np.minimum(e, 254) - 127).astype(np.float32)
    return np.where(e == 255, np.float32(np.nan), s)


def scales_as_float(scales):
    """Scales as the devices take them: E8M0 bytes (uint8, as MLX and gpt-oss store them) converted,
    floats passed through as float32."""
    s = np.asarray(scales)
    return e8m0_to_float(s) if s.dtype == np.uint8 else s.astype(np.float32)


def quantize(w):
    """(packed codes (O, I / 8) int32, scales (O, I / 32) uint8 E8M0 bytes) of w (O, I) as
    mx.quantize's mxfp4 makes them (from float32): a group's scale is the smallest power of two
    2^k >= amax / 6 (amax its largest magnitude; 2^0 for an all-zero group), each code the E2M1
    value nearest to w / 2^k, a tie to the smaller magnitude, and zero never negative. mx.quantize
    divides amax by 6 in w's dtype, so for a 16-bit w whose amax / 6 is subnormal there (f16: amax
    < 6 2^-14) the two may pick scales a power of two apart; below 2^-126 (f32's subnormals)
    mx.quantize's scales are not meaningful, and this one clamps to 2^-127."""
    w = np.asarray(w, np.float32)
    check(w.shape)
    O, I = w.shape
    g = w.reshape(O, I // GROUP_SIZE, GROUP_SIZE)
    amax = np.abs(g).max(axis=2)
    m, ex = np.frexp(amax / np.float32(6))                   # amax / 6 = m 2^ex, m in [0.5, 1)
    k = np.where(m == 0.5, ex - 1, ex)                        # round up to a power of two (0: k = 0)
    k = np.clip(k, -127, 127).astype(np.int32)
    a = np.abs(g) * np.ldexp(np.float32(1), -k)[..., None].astype(np.float32)  # exact: a power of two
    mag = (a[..., None] > _MIDPOINTS).sum(axis=-1).astype(np.uint32)
    codes = mag | np.where((g < 0) & (mag > 0), np.uint32(8), np.uint32(0))
    # C order whatever w's: writers (safetensors among them) take the buffer as it lies
    return affine.pack(codes.reshape(O, I), BITS), np.ascontiguousarray(k + 127, dtype=np.uint8)


def dequantize(w, scales):
    """W (O, I) float32 from its packed codes and scales (E8M0 bytes or floats)."""
    codes = affine.unpack(w, BITS)
    O, I = codes.shape
    check((O, I))
    s = np.repeat(scales_as_float(scales), GROUP_SIZE, axis=1)
    if s.shape != (O, I):
        raise ValueError(f"[quantize] scales {np.shape(scales)} do not match mxfp4 codes ({O}, {I})")
    return s * E2M1[codes]
