// Elementwise ops over flat contiguous buffers: fill, add, axpy, scale, cast (f32 <-> f16).
// Any n: a grid-stride loop with a bounds check, so the host may launch any grid (one thread per
// element or fewer). Half operands are computed in float and rounded once on the store.
#include <metal_stdlib>
#include "kargs.h"
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
template <typename T>
kernel void ew_axpy(device const T*                x    [[buffer(0)]],
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

// out[i] = D(x[i]) (round to nearest even)
template <typename S, typename D>
kernel void ew_cast(device const S*                x    [[buffer(0)]],
                    device D*                      out  [[buffer(1)]],
                    constant ElementwiseArgs&      args [[buffer(2)]],
                    uint gid [[thread_position_in_grid]],
                    uint gsz [[threads_per_grid]])
{
    for (uint i = gid; i < args.n; i += gsz) out[i] = D(x[i]);
}

template [[host_name("fill_f32")]]  [[kernel]] decltype(ew_fill<float>)  ew_fill<float>;
template [[host_name("fill_f16")]]  [[kernel]] decltype(ew_fill<half>)   ew_fill<half>;
template [[host_name("add_f32")]]   [[kernel]] decltype(ew_add<float>)   ew_add<float>;
template [[host_name("add_f16")]]   [[kernel]] decltype(ew_add<half>)    ew_add<half>;
template [[host_name("axpy_f32")]]  [[kernel]] decltype(ew_axpy<float>)  ew_axpy<float>;
template [[host_name("axpy_f16")]]  [[kernel]] decltype(ew_axpy<half>)   ew_axpy<half>;
template [[host_name("scale_f32")]] [[kernel]] decltype(ew_scale<float>) ew_scale<float>;
template [[host_name("scale_f16")]] [[kernel]] decltype(ew_scale<half>)  ew_scale<half>;
template [[host_name("cast_f32_f16")]] [[kernel]] decltype(ew_cast<float, half>) ew_cast<float, half>;
template [[host_name("cast_f16_f32")]] [[kernel]] decltype(ew_cast<half, float>) ew_cast<half, float>;
