// msl: 3.0 (krnl's floor; newest feature used: nothing past MSL 2.0)
// GeGLU, Gemma's gated MLP, over flat contiguous buffers of n elements (g, u, s, ds, dg, du all
// the same shape). gelu_tanh(x) = 0.5 x (1 + t), t = tanh(k (x + a x^3)), k = sqrt(2/pi),
// a = 0.044715 (transformers' "gelu_pytorch_tanh").
// With sg = sigmoid(2 k (x + a x^3)), 1 + t = 2 sg and 1 - t^2 = 4 sg (1 - sg), so tanh is never
// formed: 1 + t straight from the sigmoid keeps its relative accuracy for very negative x, where
// 1 + tanh(z) would cancel.
// geglu_forward:  s = gelu_tanh(g) * u = g * sg * u.
// geglu_backward: du = ds * g * sg; dg = ds * u * (sg + 2 g sg (1 - sg) k (1 + 3 a g^2)).
// Any n: a grid-stride loop with a bounds check. Half operands are computed in float and rounded
// once on the store. In the backward every input of an element is read before either output is
// written, so dg and/or du may alias ds (each element is owned by one thread).
#include <metal_stdlib>
#include "kargs.h"
using namespace metal;

#define GELU_K 0.7978845608028654f  // sqrt(2 / pi)
#define GELU_A 0.044715f

// exp(-2 z), z = k (x + a x^3): sg = 1 / (1 + e). The argument is capped at 80 (e ~ 5.5e34) so
// that no infinity is formed, which fast math does not promise to handle (it passes 88 already
// for x < -10); sg is then ~2e-35 instead of smaller, and x sg below ~1e-32 either way.
inline float gelu_exp(float x) {
    return exp(min(-2.0f * GELU_K * (x + GELU_A * x * x * x), 80.0f));
}

template <typename T>
kernel void geglu_forward(device const T*     g    [[buffer(0)]],
                          device const T*     u    [[buffer(1)]],
                          device T*           s    [[buffer(2)]],
                          constant GegluArgs& args [[buffer(3)]],
                          uint gid [[thread_position_in_grid]],
                          uint gsz [[threads_per_grid]])
{
    for (uint i = gid; i < args.n; i += gsz) {
        const float x = float(g[i]), ui = float(u[i]);
        s[i] = T(x / (1.0f + gelu_exp(x)) * ui);
    }
}

template <typename T>
kernel void geglu_backward(device const T*     ds   [[buffer(0)]],
                           device const T*     g    [[buffer(1)]],
                           device const T*     u    [[buffer(2)]],
                           device T*           dg   [[buffer(3)]],
                           device T*           du   [[buffer(4)]],
                           constant GegluArgs& args [[buffer(5)]],
                           uint gid [[thread_position_in_grid]],
                           uint gsz [[threads_per_grid]])
{
    for (uint i = gid; i < args.n; i += gsz) {
        const float d = float(ds[i]), x = float(g[i]), ui = float(u[i]);  // all reads first
        const float e = gelu_exp(x), sg = 1.0f / (1.0f + e);
        const float om = sg < 0.5f ? 1.0f - sg : e * sg;  // 1 - sg, without cancelling where sg ~ 1
        const float dgelu = sg + 2.0f * x * sg * om * GELU_K * (1.0f + 3.0f * GELU_A * x * x);
        dg[i] = T(d * ui * dgelu);
        du[i] = T(d * x * sg);
    }
}

template [[host_name("geglu_forward_f32")]]  [[kernel]] decltype(geglu_forward<float>)  geglu_forward<float>;
template [[host_name("geglu_forward_f16")]]  [[kernel]] decltype(geglu_forward<half>)   geglu_forward<half>;
template [[host_name("geglu_backward_f32")]] [[kernel]] decltype(geglu_backward<float>) geglu_backward<float>;
template [[host_name("geglu_backward_f16")]] [[kernel]] decltype(geglu_backward<half>)  geglu_backward<half>;
#if KRNL_BF16
template [[host_name("geglu_forward_bf16")]]  [[kernel]] decltype(geglu_forward<bfloat>)  geglu_forward<bfloat>;
template [[host_name("geglu_backward_bf16")]] [[kernel]] decltype(geglu_backward<bfloat>) geglu_backward<bfloat>;
#endif
