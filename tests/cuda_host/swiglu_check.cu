// Host-side check of the CUDA SwiGLU functors (csrc/cuda/swiglu.cuh), the very arithmetic of
// elementwise.cu's gated kernels, for machines with nvcc but no GPU (tests/test_cuda_host.py
// builds and runs it): the plain and gpt-oss's clamped form against float64 references, inputs
// straddling +-limit and exactly on both bounds, where torch.clamp passes the gradient.
#include <cmath>
#include <cstdio>
#include <random>

#include "cuda/swiglu.cuh"

using krnl::cuda::Swiglu;
using krnl::cuda::SwigluClamped;

namespace {

int failures = 0;

void expect_close(double got, double want, double mag, const char* what, float g, float u) {
  // f32 arithmetic: a few dozen roundings of terms no larger than mag
  if (std::fabs(got - want) <= 64 * 0x1p-24 * (mag + std::fabs(want)) + 1e-37) return;
  if (++failures <= 20) std::printf("FAIL %s at g=%.9g u=%.9g: got %.9g, want %.9g\n", what, g, u, got, want);
}

// float64 s, ds/dg, ds/du of the clamped form (the plain one where limit <= 0), and the size of
// the rounded terms.
void reference(double g, double u, double alpha, double limit, double& s, double& dg, double& du, double& mag) {
  const bool clamp = limit > 0;
  const double x = clamp ? std::fmin(g, limit) : g, v = clamp ? std::fmax(-limit, std::fmin(u, limit)) + 1 : u;
  const double a = clamp ? alpha : 1.0, sg = 1 / (1 + std::exp(-a * x));
  s = x * sg * v;
  dg = clamp && g > limit ? 0.0 : v * sg * (1 + a * x * (1 - sg));
  du = clamp && std::fabs(u) > limit ? 0.0 : x * sg;
  mag = std::fabs(x * sg) * (std::fabs(v) + 2) * (1 + std::fabs(a * x));
}

template <class Act>
void check(const Act& act, float alpha, float limit, float g, float u, float d) {
  double s, dg, du, mag;
  reference(g, u, alpha, limit, s, dg, du, mag);
  float got_dg, got_du;
  act.backward(d, g, u, got_dg, got_du);
  expect_close(act.forward(g, u), s, mag, "s", g, u);
  expect_close(got_dg, d * dg, std::fabs(d) * mag, "dg", g, u);
  expect_close(got_du, d * du, std::fabs(d) * mag, "du", g, u);
  if (limit > 0 && ((g > limit && got_dg != 0.f) || (std::fabs(u) > limit && got_du != 0.f)))
    if (++failures <= 20) std::printf("FAIL a gradient passes a clamp at g=%.9g u=%.9g\n", g, u);
  if (limit > 0 && g == limit && d * dg != 0.0 && got_dg == 0.f)  // the bound itself passes
    if (++failures <= 20) std::printf("FAIL dg is 0 on the bound g=%.9g\n", g);
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> wide(-14.f, 14.f), grad(-2.f, 2.f);
  const float alpha = 1.702f, limit = 7.f;
  const float bounds[] = {limit, -limit, std::nextafter(limit, 0.f), std::nextafter(limit, 20.f), -1.f, 0.f};
  for (int i = 0; i < 20000; ++i) {
    float g = wide(rng), u = wide(rng);
    if (i % 7 == 0) g = bounds[(i / 7) % 6];
    if (i % 5 == 0) u = bounds[(i / 5) % 6];
    check(SwigluClamped{alpha, limit}, alpha, limit, g, u, grad(rng));
    check(Swiglu{}, 1.f, 0.f, g / 2, u, grad(rng));
  }
  if (failures) {
    std::printf("swiglu_check: %d failures\n", failures);
    return 1;
  }
  std::printf("swiglu_check: ok\n");
  return 0;
}
