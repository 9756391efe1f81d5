// Shared by the CUDA op files: error checks, launch sizing and the per-dtype element access that
// lets each kernel be written once for f32/f16/bf16 (computing in float, as the CPU backend does).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/dtype.h"
#include "cuda_backend.h"

namespace krnl::cuda {

constexpr int kThreads = 256;

// Grid for a grid-stride loop over n items: enough blocks to fill the device, never more than
// the work needs (a launch of 0 blocks is an error, so at least 1).
inline unsigned grid_for(int64_t n, int per_thread = 1) {
  const int64_t want = (n + int64_t(kThreads) * per_thread - 1) / (int64_t(kThreads) * per_thread);
  const int64_t cap = 132 * 16;  // enough resident blocks for any current part
  return unsigned(want < 1 ? 1 : (want > cap ? cap : want));
}

// Launch errors (bad configuration, missing kernel image) surface here, named by op.
inline void check_launch(const char* op) { check(cudaGetLastError(), op); }

// ---- element access: dtype is uniform across a launch, so the switch never diverges.

__device__ __forceinline__ float ld(DType dt, const void* p, int64_t i) {
  switch (dt) {
    case DType::f16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::bf16: return __uint_as_float(uint32_t(static_cast<const uint16_t*>(p)[i]) << 16);
    default: return static_cast<const float*>(p)[i];
  }
}

// Round-to-nearest-even like dtype.h's host conversions, NaN payloads included, so the CPU and
// CUDA backends store bit-identical values for the same float.
__device__ __forceinline__ uint16_t to_f16_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t(((u >> 16) & 0x8000u) | 0x7e00u);
  return __half_as_ushort(__float2half_rn(f));
}
__device__ __forceinline__ uint16_t to_bf16_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

__device__ __forceinline__ void st(DType dt, void* p, int64_t i, float v) {
  switch (dt) {
    case DType::f16: static_cast<uint16_t*>(p)[i] = to_f16_bits(v); break;
    case DType::bf16: static_cast<uint16_t*>(p)[i] = to_bf16_bits(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

// ---- block reductions (blockDim.x a multiple of 32, at most 1024)

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Every thread gets the block's sum (max). `sh` holds 32 floats; safe to call back to back.
__device__ __forceinline__ float block_sum(float v, float* sh) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // sh may still be read by a previous reduction
  if (lane == 0) sh[w] = v;
  __syncthreads();
  v = lane < nw ? sh[lane] : 0.f;
  return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* sh) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  v = lane < nw ? sh[lane] : -3.402823466e38f;
  return warp_max(v);
}

// Threads per block for a kernel that gives one block to each row of `cols` elements.
inline int row_threads(int64_t cols) {
  int t = 32;
  while (t < 1024 && t < cols) t *= 2;
  return t;
}

// ---- 16-byte vectors: 8 bf16/f16 or 4 f32 elements per load/store. The row kernels keep a whole
// row in registers (each thread NV vectors), so a row is read once and written once.

template <bool W16>
__device__ __forceinline__ float half_bits_to_float(DType dt, uint32_t h) {
  return dt == DType::bf16 ? __uint_as_float(h << 16) : __half2float(__ushort_as_half(uint16_t(h)));
}

// v[0..VEC) = elements i..i+VEC of p (i a multiple of VEC, p 16-byte aligned).
template <bool W16>
__device__ __forceinline__ void load_vec(DType dt, const void* p, int64_t i, float* v) {
  const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const char*>(p) + i * (W16 ? 2 : 4));
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (W16) {
      v[2 * k] = half_bits_to_float<W16>(dt, w[k] & 0xffffu);
      v[2 * k + 1] = half_bits_to_float<W16>(dt, w[k] >> 16);
    } else {
      v[k] = __uint_as_float(w[k]);
    }
  }
}

template <bool W16>
__device__ __forceinline__ void store_vec(DType dt, void* p, int64_t i, const float* v) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (W16) {
      const uint32_t lo = dt == DType::bf16 ? to_bf16_bits(v[2 * k]) : to_f16_bits(v[2 * k]);
      const uint32_t hi = dt == DType::bf16 ? to_bf16_bits(v[2 * k + 1]) : to_f16_bits(v[2 * k + 1]);
      w[k] = lo | (hi << 16);
    } else {
      w[k] = __float_as_uint(v[k]);
    }
  }
  *reinterpret_cast<uint4*>(static_cast<char*>(p) + i * (W16 ? 2 : 4)) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Elements of dt in a 16-byte vector.
inline int64_t vec_width(DType dt) { return dt == DType::f32 ? 4 : 8; }

// Whether n elements of dt at every pointer can go as whole 16-byte vectors.
inline bool vectorizable(DType dt, int64_t n, std::initializer_list<const void*> ptrs) {
  if (n % vec_width(dt)) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16) return false;
  return true;
}

// Launch shape of the register path for rows of n elements, or threads = 0 where it does not
// apply (unaligned, a row length not a multiple of the vector, or too long a row).
struct RegPlan {
  int threads = 0, nv = 0;
};
inline RegPlan reg_plan(DType dt, int64_t n, std::initializer_list<const void*> ptrs) {
  if (n <= 0 || !vectorizable(dt, n, ptrs)) return {};
  const int64_t nvec = n / vec_width(dt);
  for (int nv : {1, 2, 4, 8}) {  // at most 256 threads where a few vectors each will do
    const int64_t t = (nvec + nv - 1) / nv;
    if (t <= 256) return {row_threads(t), nv};
  }
  if ((nvec + 7) / 8 <= 1024) return {row_threads((nvec + 7) / 8), 8};
  return {};
}

// Runs CALL(W16, NV) with compile-time arguments for a RegPlan's vector count.
#define KRNL_DISPATCH_REG(w16, nv, CALL)  \
  switch ((nv) * 2 + ((w16) ? 1 : 0)) {    \
    case 2: CALL(false, 1); break;         \
    case 3: CALL(true, 1); break;          \
    case 4: CALL(false, 2); break;         \
    case 5: CALL(true, 2); break;          \
    case 8: CALL(false, 4); break;         \
    case 9: CALL(true, 4); break;          \
    case 16: CALL(false, 8); break;        \
    default: CALL(true, 8); break;         \
  }

// The 16-byte-vector twin of KRNL_DISPATCH_REG: CALL(true) for 16-bit dtypes, CALL(false) for f32.
#define KRNL_DISPATCH_VEC(w16, CALL) \
  if (w16) {                         \
    CALL(true);                      \
  } else {                           \
    CALL(false);                     \
  }

}  // namespace krnl::cuda
