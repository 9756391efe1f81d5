// msl: 3.0 (krnl's floor; newest feature used: nothing past MSL 2.0)
// SwiGLU over flat contiguous buffers of n elements (g, u, s, ds, dg, du all the same shape).
// swiglu_forward:  s = silu(g) * u, silu(g) = g * sig(g), sig(g) = 1 / (1 + exp(-g)).
// swiglu_backward: du = ds * silu(g); dg = ds * u * sig * (1 + g * (1 - sig)).
// args.limit > 0: gpt-oss's clamped form, x = min(g, limit), v = clamp(u, -limit, limit) + 1,
// s = x * sig(alpha x) * v; dg = ds * v * sig * (1 + alpha x (1 - sig)) where g <= limit, du =
// ds * x * sig where |u| <= limit (torch.clamp's gradient, bounds included), else 0.
// Any n: a grid-stride loop with a bounds check. Half operands are computed in float and rounded
// once on the store. In the backward every input of an element is read before either output is
// written, so dg and/or du may alias ds (each element is owned by one thread).
#include <metal_stdlib>
#include "kargs.h"
using namespace metal;

// The clamped form's inputs: x = min(g, limit), v = clamp(u, -limit, limit) + 1 (NaN stays NaN).
inline float swiglu_x(float g, float limit) { return g > limit ? limit : g; }
inline float swiglu_v(float u, float limit) { return (u > limit ? limit : (u < -limit ? -limit : u)) + 1.0f; }

template <typename T>
kernel void swiglu_forward(device const T*      g    [[buffer(0)]],
                           device const T*      u    [[buffer(1)]],
                           device T*            s    [[buffer(2)]],
                           constant SwigluArgs& args [[buffer(3)]],
                           uint gid [[thread_position_in_grid]],
                           uint gsz [[threads_per_grid]])
{
    if (args.limit > 0.0f) {
        for (uint i = gid; i < args.n; i += gsz) {
            const float x = swiglu_x(float(g[i]), args.limit);
            s[i] = T(x / (1.0f + exp(-args.alpha * x)) * swiglu_v(float(u[i]), args.limit));
        }
        return;
    }
    for (uint i = gid; i < args.n; i += gsz) {
        const float gi = float(g[i]), ui = float(u[i]);
        s[i] = T(gi / (1.0f + exp(-gi)) * ui);
    }
}

template <typename T>
kernel void swiglu_backward(device const T*      ds   [[buffer(0)]],
                            device const T*      g    [[buffer(1)]],
                            device const T*      u    [[buffer(2)]],
                            device T*            dg   [[buffer(3)]],
                            device T*            du   [[buffer(4)]],
                            constant SwigluArgs& args [[buffer(5)]],
                            uint gid [[thread_position_in_grid]],
                            uint gsz [[threads_per_grid]])
{
    const float limit = args.limit, alpha = args.alpha;
    if (limit > 0.0f) {
        for (uint i = gid; i < args.n; i += gsz) {
            const float d = float(ds[i]), gi = float(g[i]), ui = float(u[i]);  // all reads first
            const float x = swiglu_x(gi, limit), v = swiglu_v(ui, limit);
            const float sig = 1.0f / (1.0f + exp(-alpha * x));
            dg[i] = T(gi <= limit ? d * v * sig * (1.0f + alpha * x * (1.0f - sig)) : 0.0f);
            du[i] = T(ui >= -limit && ui <= limit ? d * x * sig : 0.0f);
        }
        return;
    }
    for (uint i = gid; i < args.n; i += gsz) {
        const float d = float(ds[i]), gi = float(g[i]), ui = float(u[i]);  // all reads first
        const float sig = 1.0f / (1.0f + exp(-gi));
        dg[i] = T(d * ui * sig * (1.0f + gi * (1.0f - sig)));
        du[i] = T(d * gi * sig);
    }
}

template [[host_name("swiglu_forward_f32")]]  [[kernel]] decltype(swiglu_forward<float>)  swiglu_forward<float>;
template [[host_name("swiglu_forward_f16")]]  [[kernel]] decltype(swiglu_forward<half>)   swiglu_forward<half>;
template [[host_name("swiglu_backward_f32")]] [[kernel]] decltype(swiglu_backward<float>) swiglu_backward<float>;
template [[host_name("swiglu_backward_f16")]] [[kernel]] decltype(swiglu_backward<half>)  swiglu_backward<half>;
#if KRNL_BF16
template [[host_name("swiglu_forward_bf16")]]  [[kernel]] decltype(swiglu_forward<bfloat>)  swiglu_forward<bfloat>;
template [[host_name("swiglu_backward_bf16")]] [[kernel]] decltype(swiglu_backward<bfloat>) swiglu_backward<bfloat>;
#endif
