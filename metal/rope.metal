// msl: 3.0 (krnl's floor; newest feature used: 64-bit indices (ulong), MSL 2.x)
// rope: rotary position embedding in place on x (rows, D), rows = batch * T, row r at time
// t = r % T. rotate_half on the first 2R dims (R = number of inv_freq entries):
//   a = x[i], b = x[i + R], theta = sign * positions[t] * inv_freq[i]
//   x[i] = a * cos(theta) - b * sin(theta),  x[i + R] = b * cos(theta) + a * sin(theta)
// dims >= 2R are never touched; sign = -1 is the backward (the inverse rotation).
// The angle is computed in float (Apple GPUs have no double): one rounding of the product, so
// theta carries an absolute error up to about |theta| * 2^-24 (positions 1e5 with inv_freq 1:
// ~6e-3 rad), against the CPU backend's double angles. precise::cos/sin then add ~1 ulp.
// One thread per (row, i) pair, i < R: a grid-stride loop over rows * R, any grid. Each pair is
// read and written by the same thread, so there is nothing to synchronise.
#include <metal_stdlib>
#include "kargs.h"
using namespace metal;

template <typename T>
kernel void rope(device T*             x         [[buffer(0)]],
                 device const int*     positions [[buffer(1)]],
                 device const float*   inv_freq  [[buffer(2)]],
                 constant RopeArgs&    args      [[buffer(3)]],
                 uint gid [[thread_position_in_grid]],
                 uint gsz [[threads_per_grid]])
{
    const uint R = args.R;
    const ulong total = (ulong)args.rows * R;
    for (ulong k = gid; k < total; k += gsz) {
        const uint r = uint(k / R), i = uint(k % R);
        const float theta = args.sign * float(positions[r % args.T]) * inv_freq[i];
        const float c = precise::cos(theta), s = precise::sin(theta);
        device T* xr = x + (ulong)r * args.D;
        const float a = float(xr[i]), b = float(xr[i + R]);
        xr[i]     = T(a * c - b * s);
        xr[i + R] = T(b * c + a * s);
    }
}

template [[host_name("rope_f32")]] [[kernel]] decltype(rope<float>) rope<float>;
template [[host_name("rope_f16")]] [[kernel]] decltype(rope<half>)  rope<half>;
#if KRNL_BF16
template [[host_name("rope_bf16")]] [[kernel]] decltype(rope<bfloat>) rope<bfloat>;
#endif
