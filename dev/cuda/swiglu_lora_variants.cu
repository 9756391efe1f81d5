// Launch shapes of swiglu_lora_kernel and swiglu_lora_rows_kernel (swiglu_lora_kernel.cuh) side by
// side at the W3 and 8b train shapes' MLP (rows 4096 and 8192, F 14336, r 16, bf16), each checked
// bit for bit against the first (a different k order moves a few of t's last bits), next to a
// plain SwiGLU pass over the same arrays: the bandwidth a fused pass could reach. In the fragment
// layout a lane holds 16, 32 or 64 bytes of each of its two rows per patch (a warp covers 64, 128
// or 256 bytes of 16 rows per array); "whole rows" issue 1 to 8 row instructions' loads at once,
// over tiles of 128 or 64 columns. Blocks hold 8 warps, 1 to 4 of them resident per SM; "split"
// gives the grid column groups as well, enough for those blocks to fill every SM. Variants go round-robin, timed with events over 20
// launches each.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc -o /tmp/slv dev/cuda/swiglu_lora_variants.cu && /tmp/slv
//   (bash dev/cuda/h200_probes.sh probes runs it)
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda_check.h"
#include "swiglu_lora_kernel.cuh"

using namespace krnl::cuda::swiglu_lora;
namespace kc = krnl::cuda;

void krnl::cuda::check(cudaError_t e, const char* op) { CK(e); (void)op; }

constexpr int R = 16;

// The plain passes: SwiGLU forward (2 arrays in, 1 out) or backward (3 in, 2 out), 8 elements a thread.
template <bool BWD>
__global__ void plain(Rows p, int64_t n8) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n8; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 a = reinterpret_cast<const uint4*>(p.in[0])[i], b = reinterpret_cast<const uint4*>(p.in[1])[i];
    uint4 c = a;
    if (BWD) c = reinterpret_cast<const uint4*>(p.in[2])[i];
    const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w}, wc[4] = {c.x, c.y, c.z, c.w};
    uint32_t o0[4], o1[4];
    for (int e = 0; e < 4; ++e) {
      uint32_t h0[2], h1[2];
      for (int k = 0; k < 2; ++k) {
        const float x = __uint_as_float((wa[e] >> (16 * k)) << 16), y = __uint_as_float((wb[e] >> (16 * k)) << 16);
        if (BWD) {
          const float z = __uint_as_float((wc[e] >> (16 * k)) << 16);
          const float sig = 1.f / (1.f + expf(-y));
          h0[k] = kc::to_bf16_bits(x * z * sig * (1.f + y * (1.f - sig)));
          h1[k] = kc::to_bf16_bits(x * y * sig);
        } else {
          h0[k] = kc::to_bf16_bits(x / (1.f + expf(-x)) * y);
          h1[k] = 0;
        }
      }
      o0[e] = h0[0] | (h0[1] << 16), o1[e] = h1[0] | (h1[1] << 16);
    }
    reinterpret_cast<uint4*>(p.out[0])[i] = make_uint4(o0[0], o0[1], o0[2], o0[3]);
    if (BWD) reinterpret_cast<uint4*>(p.out[1])[i] = make_uint4(o1[0], o1[1], o1[2], o1[3]);
  }
}

struct Variant {
  const char* name;
  void (*run)(const Rows&, cudaStream_t);
};

template <bool BWD, int CW, int MINB, bool PF, bool SPREAD = false>
void fused(const Rows& p, cudaStream_t s) { launch<true, BWD, R, CW, MINB, PF, SPREAD>(p, s, "variant"); }
template <bool BWD, int MINB, int G, int KT = 128, bool SPLIT = false>
void rows(const Rows& p, cudaStream_t s) {
  // SPLIT: column groups enough for the grid to fill MINB blocks on each of the 132 SMs
  const int blocks = int((p.N + 15) / 16), groups = SPLIT ? std::max(1, 132 * MINB / blocks) : 1;
  launch_rows<true, BWD, R, MINB, G, KT>(p, s, "variant", groups);
}
template <bool BWD>
void plain_run(const Rows& p, cudaStream_t s) {
  const int64_t n8 = p.N * p.F / 8;
  plain<BWD><<<132 * 8, 256, 0, s>>>(p, n8);
}

template <bool BWD>
std::vector<Variant> variants() {
  return {{"16 B a row, 2 blocks/SM", fused<BWD, 1, 2, false>},
          {"whole rows, 2 blocks/SM, 4 row pairs", rows<BWD, 2, 4>},
          {"whole rows, 2 blocks/SM, 2 row pairs", rows<BWD, 2, 2>},
          {"whole rows, 1 block/SM, 8 row pairs", rows<BWD, 1, 8>},
          {"whole rows, 2 blocks/SM, 8 row pairs", rows<BWD, 2, 8>},
          {"whole rows, 64-col tiles, 4 blocks/SM, split", rows<BWD, 4, 2, 64, true>},
          {"whole rows, 64-col tiles, 3 blocks/SM, split", rows<BWD, 3, 2, 64, true>},
          {"whole rows, 64-col tiles, 4 blocks/SM, 1 load, split", rows<BWD, 4, 1, 64, true>},
          {"whole rows, 128-col tiles, 2 blocks/SM, split", rows<BWD, 2, 4, 128, true>},
          {"16 B a row, 1 block/SM, prefetch", fused<BWD, 1, 1, true>},
          {"16 B a row, 2 blocks/SM, prefetch", fused<BWD, 1, 2, true>},
          {"16 B a row, 3 blocks/SM", fused<BWD, 1, 3, false>},
          {"32 B a row, 2 blocks/SM", fused<BWD, 2, 2, false>},
          {"64 B a row, 2 blocks/SM", fused<BWD, 4, 2, false>},
          {"16 B, 2 blocks/SM, prefetch, spread", fused<BWD, 1, 2, true, true>},
          {"plain SwiGLU (no products)", plain_run<BWD>}};
}

uint16_t* dev_bf16(size_t n, float sd, unsigned seed) {
  std::vector<uint16_t> h(n);
  unsigned x = seed * 2654435761u + 1;
  for (auto& v : h) {  // uniform in [-sd, sd], as bf16 bits
    x = x * 1664525u + 1013904223u;
    const float f = sd * (2.f * float(x >> 8) / float(1 << 24) - 1.f);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    v = uint16_t(u >> 16);
  }
  uint16_t* d;
  CK(cudaMalloc(&d, n * 2));
  CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
  return d;
}

template <bool BWD>
void run_shape(int64_t N, int64_t F) {
  Rows p{};
  p.N = N, p.F = F;
  for (int i = 0; i < 3; ++i) p.in[i] = dev_bf16(size_t(N * F), i == 1 ? 3.f : 1.f, 1 + i);
  for (int k = 0; k < 2; ++k) {
    CK(cudaMalloc(&p.out[k], size_t(N * F) * 2));
    p.m[k] = dev_bf16(size_t(R * F), 0.01f, 7 + k);
    CK(cudaMalloc(&p.t[k], size_t(N * R) * 2));
    p.ld[k] = R, p.scale[k] = 2.f;
  }
  CK(cudaMalloc(&p.part, size_t(8) * N * 2 * R * sizeof(float)));  // up to 8 column groups
  auto vs = variants<BWD>();
  std::vector<std::vector<float>> us(vs.size());
  std::vector<uint16_t> first_t, first_o, got(size_t(N * R)), go(size_t(N * F));
  for (size_t v = 0; v + 1 < vs.size(); ++v) {  // the fused variants agree with the first
    CK(cudaMemset(p.t[0], 0xff, size_t(N * R) * 2));
    vs[v].run(p, 0);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(got.data(), p.t[BWD ? 1 : 0], got.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(go.data(), p.out[0], go.size() * 2, cudaMemcpyDeviceToHost));
    if (v == 0) first_t = got, first_o = go;
    else {
      int dt_bits = 0, o_bits = 0;  // elements that differ
      for (size_t i = 0; i < got.size(); ++i) dt_bits += got[i] != first_t[i];
      for (size_t i = 0; i < go.size(); ++i) o_bits += go[i] != first_o[i];
      if (dt_bits || o_bits) printf("  %s: %d of %zu t and %d of %zu outputs differ from the first variant's\n",
                                    vs[v].name, dt_bits, got.size(), o_bits, go.size());
    }
  }
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int round = 0; round < 5; ++round)
    for (size_t v = 0; v < vs.size(); ++v) {
      vs[v].run(p, 0);
      CK(cudaEventRecord(a));
      for (int rep = 0; rep < 20; ++rep) vs[v].run(p, 0);
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float ms;
      CK(cudaEventElapsedTime(&ms, a, b));
      us[v].push_back(1000.f * ms / 20);
    }
  const double bytes = double(N * F) * 2 * (BWD ? 5 : 3);
  for (size_t v = 0; v < vs.size(); ++v) {
    std::sort(us[v].begin(), us[v].end());
    printf("%s N=%lld F=%lld r=%d  %-28s %7.1f us  %.2f TB/s\n", BWD ? "bwd" : "fwd", (long long)N, (long long)F, R,
           vs[v].name, us[v][2], bytes / us[v][2] / 1e6);
  }
  for (int i = 0; i < 3; ++i) CK(cudaFree(const_cast<uint16_t*>(p.in[i])));
  CK(cudaFree(p.part));
  for (int k = 0; k < 2; ++k) {
    CK(cudaFree(p.out[k]));
    CK(cudaFree(const_cast<uint16_t*>(p.m[k])));
    CK(cudaFree(p.t[k]));
  }
}

int main() {
  for (int64_t N : {4096, 8192}) {
    run_shape<true>(N, 14336);
    run_shape<false>(N, 14336);
  }
  return 0;
}
