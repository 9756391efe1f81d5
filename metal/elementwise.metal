// msl: 3.0 (krnl's floor; newest feature used: 64-bit integers in rng.h's hash, MSL 2.x)
// Elementwise ops over flat contiguous buffers: fill (f32, f16, bf16, i32), add, axpy, scale, cast
// (between any two of f32, f16, bf16, and same-dtype copies), dropout, DoRA's column scaling and
// norm (row-strided 2-D views, their own geometry: see each). The bf16 kernels sit
// behind KRNL_BF16 (MSL 3.1, compiled only for GPUs with native bf16).
// Any n: a grid-stride loop with a bounds check, so the host may launch any 1-D grid (one thread
// per element or fewer). Half operands are computed in float and rounded once on the store.
// transpose_heads: a 3-D grid, x over D (grid-stride, vectorised by 4 when D % 4 == 0), y over B,
// z over A (bounds-checked): dispatchThreads((tx, B, A), ...) with any tx >= 1, e.g.
// min(D / 4 or D, 32).
// The host compiles this file with include dirs metal/ (kargs.h) and csrc/core/ (rng.h).
#include <metal_stdlib>
#include "kargs.h"
#include "rng.h"
using namespace metal;

// x[i] = alpha
template <typename T>
kernel void ew_fill(device T*                      x    [[buffer(0)]],
                    constant ElementwiseArgs&      args [[buffer(1)]],
                    uint gid [[thread_position_in_grid]],
                    uint gsz [[threads_per_grid]])
{
    const T v = T(args.alpha);
    for (uint i = gid; i < args.n; i += gsz) x[i] = v;
}

// out[i] = a[i] + b[i]
template <typename T>
kernel void ew_add(device const T*                 a    [[buffer(0)]],
                   device const T*                 b    [[buffer(1)]],
                   device T*                       out  [[buffer(2)]],
                   constant ElementwiseArgs&       args [[buffer(3)]],
                   uint gid [[thread_position_in_grid]],
                   uint gsz [[threads_per_grid]])
{
    for (uint i = gid; i < args.n; i += gsz) out[i] = T(float(a[i]) + float(b[i]));
}

// y[i] += alpha * x[i]
template <typename X, typename T>  // x may be f16 while y is f32 (and back): gradient accumulation
kernel void ew_axpy(device const X*                x    [[buffer(0)]],
                    device T*                      y    [[buffer(1)]],
                    constant ElementwiseArgs&      args [[buffer(2)]],
                    uint gid [[thread_position_in_grid]],
                    uint gsz [[threads_per_grid]])
{
    const float alpha = args.alpha;
    for (uint i = gid; i < args.n; i += gsz) y[i] = T(fma(alpha, float(x[i]), float(y[i])));
}

// out[i] = alpha * x[i]
template <typename T>
kernel void ew_scale(device const T*               x    [[buffer(0)]],
                     device T*                     out  [[buffer(1)]],
                     constant ElementwiseArgs&     args [[buffer(2)]],
                     uint gid [[thread_position_in_grid]],
                     uint gsz [[threads_per_grid]])
{
    const float alpha = args.alpha;
    for (uint i = gid; i < args.n; i += gsz) out[i] = T(alpha * float(x[i]));
}

// out[i] = D(x[i]) (round to nearest even); S == D is a plain copy (bits kept, NaNs included)
template <typename S, typename D>
kernel void ew_cast(device const S*                x    [[buffer(0)]],
                    device D*                      out  [[buffer(1)]],
                    constant ElementwiseArgs&      args [[buffer(2)]],
                    uint gid [[thread_position_in_grid]],
                    uint gsz [[threads_per_grid]])
{
    for (uint i = gid; i < args.n; i += gsz) out[i] = D(x[i]);
}

// out[i] = D(float(x[i])): casts to or from bfloat go through float (exact from f16 and bf16), so
// each is one rounding into D, and no half <-> bfloat conversion is needed
template <typename S, typename D>
kernel void ew_cast_via_float(device const S*           x    [[buffer(0)]],
                              device D*                 out  [[buffer(1)]],
                              constant ElementwiseArgs& args [[buffer(2)]],
                              uint gid [[thread_position_in_grid]],
                              uint gsz [[threads_per_grid]])
{
    for (uint i = gid; i < args.n; i += gsz) out[i] = D(float(x[i]));
}

// x[i] = alpha converted to int32 as CpuBackend::fill does: NaN gives 0, out-of-range values
// saturate, the rest truncate toward zero. Decided on the bits rather than with isnan/compares,
// which fast math (Metal's default) may fold away.
kernel void fill_i32(device int*                   x    [[buffer(0)]],
                     constant ElementwiseArgs&     args [[buffer(1)]],
                     uint gid [[thread_position_in_grid]],
                     uint gsz [[threads_per_grid]])
{
    const float a    = args.alpha;
    const uint  bits = as_type<uint>(a);
    const uint  mag  = bits & 0x7fffffffu;
    int v;
    if (mag > 0x7f800000u)       v = 0;                                                    // NaN
    else if (mag >= 0x4f000000u) v = (bits >> 31) ? as_type<int>(0x80000000u) : 0x7fffffff;  // |a| >= 2^31
    else                         v = int(a);                                               // truncates
    for (uint i = gid; i < args.n; i += gsz) x[i] = v;
}

// out[i] = keep ? x[i] * keep_scale : 0, keep = krnl::dropout_keep(seed, i, p): the mask is a pure
// function of (seed, flat index), identical to every other backend's and to the backward's.
// With args.use_offset, the seed adds offset (2,) i32 (low, high word) from the device; with a
// row_width too, offset[2] is x's first row in its batch and the index starts at it.
template <typename T>
kernel void ew_dropout(device const T*             x      [[buffer(0)]],
                       device T*                   out    [[buffer(1)]],
                       constant DropoutArgs&       args   [[buffer(2)]],
                       device const int*           offset [[buffer(3)]],
                       uint gid [[thread_position_in_grid]],
                       uint gsz [[threads_per_grid]])
{
    const uint64_t host_seed = uint64_t(args.seed_lo) | (uint64_t(args.seed_hi) << 32);
    const uint64_t seed = args.use_offset != 0 ? krnl::dropout_seed(host_seed, uint(offset[0]), uint(offset[1]))
                                               : host_seed;
    const uint64_t base  = args.use_offset != 0 && args.row_width != 0
                               ? krnl::dropout_base(uint(offset[2]), uint64_t(args.row_width)) : 0;
    const float    p     = args.p;
    const float    scale = args.keep_scale;
    for (uint i = gid; i < args.n; i += gsz)
        out[i] = krnl::dropout_keep(seed, base + uint64_t(i), p) ? T(float(x[i]) * scale) : T(0.0f);
}

// out (B, A, D) = x (A, B, D): thread (tx, b, a) copies row x[a, b, :] to out[b, a, :], striding
// over D by the grid's x extent. Whole rows move, so a row of 4-element vectors when D % 4 == 0
// (rows then start 4-element aligned). A row of a head h < rotate instead moves as rope's pairs
// (i, i + R), turned on the way by theta = sign * positions[t] * inv_freq[i], computed as
// rope.metal computes it, then dims >= 2R copy.
template <typename T>
kernel void transpose_heads(device const T*              x         [[buffer(0)]],
                            device T*                    out       [[buffer(1)]],
                            constant TransposeHeadsArgs& args      [[buffer(2)]],
                            device const int*            positions [[buffer(3)]],
                            device const float*          inv_freq  [[buffer(4)]],
                            uint3 gid [[thread_position_in_grid]],
                            uint3 gsz [[threads_per_grid]])
{
    using T4 = vec<T, 4>;
    const uint A = args.A, B = args.B, D = args.D;
    const uint b = gid.y, a = gid.z;
    if (a >= A || b >= B) return;
    device const T* src = x + ((ulong)a * B + b) * D;
    device T*       dst = out + ((ulong)b * A + a) * D;
    const uint h = args.heads_axis == 1 ? b : a;
    if (h < args.rotate) {
        const uint R = args.R, t = args.heads_axis == 1 ? a : b;
        for (uint i = gid.x; i < R; i += gsz.x) {
            const float theta = args.sign * float(positions[t]) * inv_freq[i];
            const float c = precise::cos(theta), s = precise::sin(theta);
            const float lo = float(src[i]), hi = float(src[i + R]);
            dst[i]     = T(lo * c - hi * s);
            dst[i + R] = T(hi * c + lo * s);
        }
        for (uint i = 2 * R + gid.x; i < D; i += gsz.x) dst[i] = src[i];
    } else if ((D & 3) == 0) {
        device const T4* s4 = (device const T4*)src;
        device T4*       d4 = (device T4*)dst;
        for (uint i = gid.x; i < D / 4; i += gsz.x) d4[i] = s4[i];
    } else {
        for (uint i = gid.x; i < D; i += gsz.x) dst[i] = src[i];
    }
}

// ---- DoRA (python/krnl/models/dora.py): a per-column scale of (rows, cols) views with row strides,
// and the per-output norm of W + s B A. In place is safe: each element is read before the same
// thread writes it.

// out[r, j] = x[r, j] * v[j]; a grid-stride loop over rows * cols (ew geometry).
template <typename T>
kernel void scale_columns(device const T*            x    [[buffer(0)]],
                          device const float*        v    [[buffer(1)]],
                          device T*                  out  [[buffer(2)]],
                          constant ScaleColumnsArgs& args [[buffer(3)]],
                          uint gid [[thread_position_in_grid]],
                          uint gsz [[threads_per_grid]])
{
    const uint n = args.rows * args.cols;
    for (uint i = gid; i < n; i += gsz) {
        const uint r = i / args.cols, j = i % args.cols;
        out[(ulong)r * args.ldo + j] = T(float(x[(ulong)r * args.ldx + j]) * v[j]);
    }
}

// Threadgroup (32, SC_LANES) over columns 32 g.x.. of row block g.y: lane y takes the block's rows
// y, y + SC_LANES, ...; dv adds the lanes' partials in lane order (the block's rows fix the sum).
#define SC_LANES 8
template <typename T>
kernel void scale_columns_backward(device const T*            dy   [[buffer(0)]],
                                   device const T*            x    [[buffer(1)]],
                                   device const float*        v    [[buffer(2)]],
                                   device T*                  dx   [[buffer(3)]],
                                   device float*              dv   [[buffer(4)]],
                                   constant ScaleColumnsArgs& args [[buffer(5)]],
                                   uint2 g   [[threadgroup_position_in_grid]],
                                   uint2 tid [[thread_position_in_threadgroup]])
{
    threadgroup float part[SC_LANES][32];
    const uint j = g.x * 32 + tid.x, r0 = g.y * args.per;
    float acc = 0.0f;
    if (j < args.cols) {
        const float vj = v[j];
        for (uint r = r0 + tid.y; r < r0 + args.per; r += SC_LANES) {
            const float d = float(dy[(ulong)r * args.ldy + j]);
            acc = fma(d, float(x[(ulong)r * args.ldx + j]), acc);
            dx[(ulong)r * args.ldo + j] = T(d * vj);
        }
    }
    part[tid.y][tid.x] = acc;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid.y == 0 && j < args.cols) {
        float total = 0.0f;
        for (uint l = 0; l < SC_LANES; ++l) total += part[l][tid.x];
        dv[(ulong)g.y * args.cols + j] = total;
    }
}

// One output o a thread (grid-stride): n = sqrt(max(w2 + alpha sum_k B[o, k] Q[k, o], 0)).
template <typename T>
kernel void dora_norm(device const float*    w2       [[buffer(0)]],
                      device const T*        B        [[buffer(1)]],
                      device const float*    Q        [[buffer(2)]],
                      device const T*        m        [[buffer(3)]],
                      device float*          scale    [[buffer(4)]],
                      device float*          inv_norm [[buffer(5)]],
                      constant DoraNormArgs& args     [[buffer(6)]],
                      uint gid [[thread_position_in_grid]],
                      uint gsz [[threads_per_grid]])
{
    for (uint o = gid; o < args.M; o += gsz) {
        float dot = 0.0f;
        for (uint k = 0; k < args.r; ++k) dot = fma(float(B[(ulong)o * args.r + k]), Q[(ulong)k * args.M + o], dot);
        const float norm = sqrt(max(fma(args.alpha, dot, w2[o]), 0.0f));
        scale[o] = float(m[o]) / norm;
        inv_norm[o] = 1.0f / norm;
    }
}

template [[host_name("fill_f32")]]  [[kernel]] decltype(ew_fill<float>)  ew_fill<float>;
template [[host_name("fill_f16")]]  [[kernel]] decltype(ew_fill<half>)   ew_fill<half>;
template [[host_name("add_f32")]]   [[kernel]] decltype(ew_add<float>)   ew_add<float>;
template [[host_name("add_f16")]]   [[kernel]] decltype(ew_add<half>)    ew_add<half>;
template [[host_name("axpy_f32")]]  [[kernel]] decltype(ew_axpy<float, float>) ew_axpy<float, float>;
template [[host_name("axpy_f16")]]  [[kernel]] decltype(ew_axpy<half, half>)   ew_axpy<half, half>;
template [[host_name("axpy_f16_f32")]] [[kernel]] decltype(ew_axpy<half, float>) ew_axpy<half, float>;
template [[host_name("axpy_f32_f16")]] [[kernel]] decltype(ew_axpy<float, half>) ew_axpy<float, half>;
template [[host_name("scale_f32")]] [[kernel]] decltype(ew_scale<float>) ew_scale<float>;
template [[host_name("scale_f16")]] [[kernel]] decltype(ew_scale<half>)  ew_scale<half>;
template [[host_name("cast_f32_f16")]] [[kernel]] decltype(ew_cast<float, half>) ew_cast<float, half>;
template [[host_name("cast_f16_f32")]] [[kernel]] decltype(ew_cast<half, float>) ew_cast<half, float>;
template [[host_name("cast_f32_f32")]] [[kernel]] decltype(ew_cast<float, float>) ew_cast<float, float>;
template [[host_name("cast_f16_f16")]] [[kernel]] decltype(ew_cast<half, half>)   ew_cast<half, half>;
template [[host_name("dropout_f32")]] [[kernel]] decltype(ew_dropout<float>) ew_dropout<float>;
template [[host_name("dropout_f16")]] [[kernel]] decltype(ew_dropout<half>)  ew_dropout<half>;
template [[host_name("transpose_heads_f32")]] [[kernel]] decltype(transpose_heads<float>) transpose_heads<float>;
template [[host_name("transpose_heads_f16")]] [[kernel]] decltype(transpose_heads<half>)  transpose_heads<half>;
template [[host_name("scale_columns_f32")]] [[kernel]] decltype(scale_columns<float>) scale_columns<float>;
template [[host_name("scale_columns_f16")]] [[kernel]] decltype(scale_columns<half>)  scale_columns<half>;
template [[host_name("scale_columns_backward_f32")]] [[kernel]] decltype(scale_columns_backward<float>) scale_columns_backward<float>;
template [[host_name("scale_columns_backward_f16")]] [[kernel]] decltype(scale_columns_backward<half>)  scale_columns_backward<half>;
template [[host_name("dora_norm_f32")]] [[kernel]] decltype(dora_norm<float>) dora_norm<float>;
template [[host_name("dora_norm_f16")]] [[kernel]] decltype(dora_norm<half>)  dora_norm<half>;
#if KRNL_BF16
template [[host_name("fill_bf16")]]  [[kernel]] decltype(ew_fill<bfloat>)  ew_fill<bfloat>;
template [[host_name("add_bf16")]]   [[kernel]] decltype(ew_add<bfloat>)   ew_add<bfloat>;
template [[host_name("axpy_bf16")]]  [[kernel]] decltype(ew_axpy<bfloat, bfloat>) ew_axpy<bfloat, bfloat>;
template [[host_name("axpy_bf16_f32")]] [[kernel]] decltype(ew_axpy<bfloat, float>) ew_axpy<bfloat, float>;
template [[host_name("axpy_f32_bf16")]] [[kernel]] decltype(ew_axpy<float, bfloat>) ew_axpy<float, bfloat>;
template [[host_name("axpy_f16_bf16")]] [[kernel]] decltype(ew_axpy<half, bfloat>) ew_axpy<half, bfloat>;
template [[host_name("axpy_bf16_f16")]] [[kernel]] decltype(ew_axpy<bfloat, half>) ew_axpy<bfloat, half>;
template [[host_name("scale_bf16")]] [[kernel]] decltype(ew_scale<bfloat>) ew_scale<bfloat>;
template [[host_name("cast_f32_bf16")]] [[kernel]] decltype(ew_cast_via_float<float, bfloat>) ew_cast_via_float<float, bfloat>;
template [[host_name("cast_bf16_f32")]] [[kernel]] decltype(ew_cast_via_float<bfloat, float>) ew_cast_via_float<bfloat, float>;
template [[host_name("cast_f16_bf16")]] [[kernel]] decltype(ew_cast_via_float<half, bfloat>)  ew_cast_via_float<half, bfloat>;
template [[host_name("cast_bf16_f16")]] [[kernel]] decltype(ew_cast_via_float<bfloat, half>)  ew_cast_via_float<bfloat, half>;
template [[host_name("cast_bf16_bf16")]] [[kernel]] decltype(ew_cast<bfloat, bfloat>) ew_cast<bfloat, bfloat>;
template [[host_name("dropout_bf16")]] [[kernel]] decltype(ew_dropout<bfloat>) ew_dropout<bfloat>;
template [[host_name("transpose_heads_bf16")]] [[kernel]] decltype(transpose_heads<bfloat>) transpose_heads<bfloat>;
template [[host_name("scale_columns_bf16")]] [[kernel]] decltype(scale_columns<bfloat>) scale_columns<bfloat>;
template [[host_name("scale_columns_backward_bf16")]] [[kernel]] decltype(scale_columns_backward<bfloat>) scale_columns_backward<bfloat>;
template [[host_name("dora_norm_bf16")]] [[kernel]] decltype(dora_norm<bfloat>) dora_norm<bfloat>;
#endif
