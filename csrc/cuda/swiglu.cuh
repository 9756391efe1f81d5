// SwiGLU's two forms as functors of elementwise.cu's gated kernels (forward: s from g, u;
// backward: dg, du from ds, g, u, in that expression order, which fixes the rounding), written as
// __host__ __device__ code so that tests/cuda_host/swiglu_check.cu runs the very same arithmetic
// on the host against a float64 reference, where no GPU is at hand.
#pragma once
#include <cuda_runtime.h>

#include <cmath>

#ifndef KRNL_HD
#define KRNL_HD __host__ __device__ __forceinline__
#endif

namespace krnl::cuda {

// s = silu(g) u, the sigmoid as 1 / (1 + exp(-g)) like the CPU backend.
struct Swiglu {
  static constexpr const char* fwd_name = "swiglu_forward";
  static constexpr const char* bwd_name = "swiglu_backward";
  KRNL_HD float forward(float g, float u) const { return g / (1.f + expf(-g)) * u; }
  KRNL_HD void backward(float d, float g, float u, float& dg, float& du) const {
    const float sig = 1.f / (1.f + expf(-g));
    dg = d * u * sig * (1.f + g * (1.f - sig));
    du = d * g * sig;
  }
};

// gpt-oss's clamped form (limit > 0): x = min(g, limit), v = clamp(u, -limit, limit) + 1,
// s = x sigmoid(alpha x) v. The gradients pass each clamp where its input lies within the bounds,
// bounds included (torch.clamp's), and are 0 elsewhere. NaN inputs stay NaN through the clamps.
struct SwigluClamped {
  static constexpr const char* fwd_name = "swiglu_forward";
  static constexpr const char* bwd_name = "swiglu_backward";
  float alpha, limit;
  KRNL_HD float x(float g) const { return g > limit ? limit : g; }
  KRNL_HD float v(float u) const { return (u > limit ? limit : (u < -limit ? -limit : u)) + 1.f; }
  KRNL_HD float forward(float g, float u) const {
    const float xg = x(g);
    return xg / (1.f + expf(-alpha * xg)) * v(u);
  }
  KRNL_HD void backward(float d, float g, float u, float& dg, float& du) const {
    const float xg = x(g), vu = v(u), sig = 1.f / (1.f + expf(-alpha * xg));
    dg = g <= limit ? d * vu * sig * (1.f + alpha * xg * (1.f - sig)) : 0.f;
    du = u >= -limit && u <= limit ? d * xg * sig : 0.f;
  }
};

}  // namespace krnl::cuda
