// msl: 3.0 (krnl's floor; newest feature used: nothing past MSL 2.0)
// Soft-capping (Gemma 2's attention scores and final logits) over flat contiguous buffers of n
// elements.
// softcap:          out = cap * tanh(x / cap).
// softcap_backward: dx = dy * (1 - (y / cap)^2), from the forward's output y (x is not kept).
// Any n: a grid-stride loop with a bounds check; float math, one rounding on the store. Each
// element is read and then written by one thread, so out may alias x and dx may alias dy or y.
#include <metal_stdlib>
#include "kargs.h"
using namespace metal;

// cap * tanh(x / cap). Near 0 tanh(z) ~ z needs relative accuracy (small capped scores stay
// small), which 1 - 2 / (e^{2z} + 1) loses to cancellation: there the odd series z - z^3/3 +
// 2 z^5/15 - 17 z^7/315, whose next term is below 2^-24 z for |z| < 0.125; e^{-2|z|} elsewhere,
// which never overflows.
inline float softcap_tanh(float z) {
    const float az = z < 0.0f ? -z : z;
    if (az < 0.125f) {
        const float z2 = z * z;
        return z * (1.0f + z2 * (-1.0f / 3.0f + z2 * (2.0f / 15.0f + z2 * (-17.0f / 315.0f))));
    }
    const float e = exp(-2.0f * az);
    const float t = (1.0f - e) / (1.0f + e);
    return z < 0.0f ? -t : t;
}

template <typename T>
kernel void softcap(device const T*       x    [[buffer(0)]],
                    device T*             out  [[buffer(1)]],
                    constant SoftcapArgs& args [[buffer(2)]],
                    uint gid [[thread_position_in_grid]],
                    uint gsz [[threads_per_grid]])
{
    const float cap = args.cap;
    for (uint i = gid; i < args.n; i += gsz)
        out[i] = T(cap * softcap_tanh(float(x[i]) / cap));
}

template <typename T>
kernel void softcap_backward(device const T*       dy   [[buffer(0)]],
                             device const T*       y    [[buffer(1)]],
                             device T*             dx   [[buffer(2)]],
                             constant SoftcapArgs& args [[buffer(3)]],
                             uint gid [[thread_position_in_grid]],
                             uint gsz [[threads_per_grid]])
{
    const float cap = args.cap;
    for (uint i = gid; i < args.n; i += gsz) {
        const float d = float(dy[i]), r = float(y[i]) / cap;  // both read before dx is written
        dx[i] = T(d * (1.0f - r * r));
    }
}

template [[host_name("softcap_f32")]]          [[kernel]] decltype(softcap<float>)          softcap<float>;
template [[host_name("softcap_f16")]]          [[kernel]] decltype(softcap<half>)           softcap<half>;
template [[host_name("softcap_backward_f32")]] [[kernel]] decltype(softcap_backward<float>) softcap_backward<float>;
template [[host_name("softcap_backward_f16")]] [[kernel]] decltype(softcap_backward<half>)  softcap_backward<half>;
#if KRNL_BF16
template [[host_name("softcap_bf16")]]          [[kernel]] decltype(softcap<bfloat>)          softcap<bfloat>;
template [[host_name("softcap_backward_bf16")]] [[kernel]] decltype(softcap_backward<bfloat>) softcap_backward<bfloat>;
#endif
