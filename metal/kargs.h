// Kernel argument structs shared by the host (csrc/metal, C++) and the kernels (metal/*.metal, MSL).
// Bound as `constant XxxArgs& args [[buffer(i)]]` on the kernel side and as the raw struct bytes on
// the host side (setBytes). Only 4-byte fields, so the layout is identical on both sides.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstdint>
#endif

#ifdef __cplusplus
#ifndef __METAL_VERSION__
namespace krnl::metal {
#endif
#endif

// fill (x = alpha), add (out = a + b), axpy (y += alpha * x), scale (out = alpha * x), cast.
struct ElementwiseArgs {
    uint32_t n;      // number of elements
    float    alpha;
    float    beta;   // reserved (0)
};

// rmsnorm_forward: x, y (rows, cols); w (cols,); rstd (rows,) f32.
struct RmsnormArgs {
    uint32_t rows;
    uint32_t cols;
    float    eps;
};

// softmax_causal_forward: S, P (rows, tk) with rows = batch * tq; query row r sits at position
// r % tq + tk - tq. has_segments != 0: buffer(2) holds (tk,) i32 segment ids (tq == tk); when 0
// buffer(2) must still be bound (any buffer) and is not read.
struct SoftmaxArgs {
    uint32_t rows;
    uint32_t tq;
    uint32_t tk;
    float    scale;
    uint32_t has_segments;
};

// swiglu_forward (s = silu(g) * u) and swiglu_backward (dg, du from ds, g, u): flat buffers of n
// elements.
struct SwigluArgs {
    uint32_t n;
};

// rope: x (rows, D) in place with rows = batch * T, row r at time t = r % T; positions (T,) i32,
// inv_freq (R,) f32 with 2 * R <= D; theta = sign * positions[t] * inv_freq[i].
struct RopeArgs {
    uint32_t rows;
    uint32_t T;
    uint32_t D;
    uint32_t R;
    float    sign;
};

// rmsnorm_backward: dy, x, dx (rows, cols); w (cols,); rstd (rows,) f32 from the forward.
struct RmsnormBackwardArgs {
    uint32_t rows;
    uint32_t cols;
};

// softmax_backward: P, dP, dS (rows, cols); dS = P * (dP - rowsum(dP * P)) * scale.
struct SoftmaxBackwardArgs {
    uint32_t rows;
    uint32_t cols;
    float    scale;
};

#ifdef __cplusplus
#ifndef __METAL_VERSION__
}  // namespace krnl::metal
#endif
#endif
