// Helpers shared by the Metal backend's op files (gemm.cpp, norm.cpp, ..., optim.cpp): 32-bit size
// checks, grid sizes, the kernel dtype suffix (Emit) and buffer bindings. Each op there: the
// kernel, its buffers (indices as in metal/kargs.h), its geometry.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/dtype.h"
#include "kargs.h"  // metal/kargs.h, shared with the kernels
#include "metal/metal_ops.h"

namespace krnl::metal {

inline constexpr uint32_t kEwThreads = 256;   // threads per threadgroup of the grid-stride kernels
inline constexpr uint32_t kEwMaxGroups = 1024;
inline constexpr uint32_t kGemmTile = 32;     // gemm.metal's output tile (one SIMD-group per tile)

inline uint32_t u32(const char* op, int64_t v, const char* what) {
  if (v < 0 || v > int64_t(std::numeric_limits<uint32_t>::max()))
    throw std::invalid_argument(std::string("[") + op + "] " + what + " = " + std::to_string(v) +
                                " does not fit the Metal kernels' 32-bit sizes");
  return uint32_t(v);
}

inline uint32_t ceil_div(int64_t a, int64_t b) { return uint32_t((a + b - 1) / b); }

// Threads per threadgroup of the one-row-per-threadgroup kernels: enough lanes for the row, in
// whole SIMD-groups, at most 256 (more buys nothing for rows of a few thousand elements).
inline uint32_t row_threads(int64_t cols) {
  const int64_t lanes = std::max<int64_t>(32, std::min<int64_t>(256, (cols + 3) / 4));
  return uint32_t((lanes + 31) / 32 * 32);
}

inline uint32_t ew_groups(int64_t n) { return std::max<uint32_t>(1, std::min<uint32_t>(kEwMaxGroups, ceil_div(n, kEwThreads))); }

// metal/ has bf16 kernels (inside `#if KRNL_BF16`, on from MSL 3.1: metal/kargs.h); the policy
// offers them only where the GPU runs bf16 natively, and device.mm compiles MSL 3.1 there.
inline constexpr bool kBf16Kernels = true;

// ---- helpers shared by every op

struct Emit {
  MetalOps* self;
  const char* op;

  // Kernel dtype suffix. bf16 only where the GPU has it natively (see ops.cpp's file comment): the
  // library is then compiled as MSL 3.1 and holds the _bf16 kernels.
  std::string sfx(DType d) const {
    switch (d) {
      case DType::f32: return "f32";
      case DType::f16: return "f16";
      case DType::i32: return "i32";
      case DType::bf16:
        if (kBf16Kernels && native_bf16(self->gpu())) return "bf16";
        break;
    }
    throw NotImplementedError(std::string("[") + op + "] bf16 not implemented on " + self->name() +
                              ": this GPU emulates bf16 (~40x slower than f16; native from Apple9, M3); use f16");
  }
  Dispatch make(const char* library, std::string kernel) const {
    Dispatch d;
    d.op = op;
    d.library = library;
    d.kernel = std::move(kernel);
    return d;
  }
};

inline void bind(Dispatch& d, uint32_t index, const Tensor& t, size_t extent_bytes) {
  d.bind(index, t.storage()->ptr(), t.offset(), extent_bytes);
}
inline void bind(Dispatch& d, uint32_t index, const Tensor& t) { bind(d, index, t, t.nbytes()); }
// An optional operand: t where given, else `stand_in` with no extent (a kernel's buffer must be
// bound; its flag in the arguments keeps it unread).
inline void bind_optional(Dispatch& d, uint32_t index, const Tensor* t, const Tensor& stand_in) {
  t ? bind(d, index, *t) : bind(d, index, stand_in, 0);
}

// A grid-stride dispatch over n elements.
inline void ew_geometry(Dispatch& d, int64_t n) {
  d.grid = {ew_groups(n), 1, 1};
  d.threads = {kEwThreads, 1, 1};
}

inline int64_t extent_elems(int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t batch) {
  if (rows == 0 || cols == 0) return 0;
  return (batch - 1) * stride + (rows - 1) * ld + cols;
}

}  // namespace krnl::metal
