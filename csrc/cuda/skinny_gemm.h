// Which GEMMs the CUDA backend runs with its own skinny kernel (skinny_gemm.cuh) instead of
// cuBLAS: the LoRA products whose output has one side of at most 64 (the rank r, or q|k|v's ranks
// grouped) and whose reduction is long. They stream one big operand once and do little
// arithmetic on it; cuBLAS ran them at 2-3 TB/s on the H200.
//   rows mode     t = x A^T, dt = dy B          N <= 64, A (M, K) the big one: 16 of its rows a block
//   columns mode  dB = dy^T t                    N <= 64, A stored (K, M): 128 of its columns a block
//                 dA = dt^T x                    M <= 64, B stored (K, N): 128 of its columns a block
// A fixed rule of the shape alone (never timing), so a shape takes the same path, and the same
// summation order, on every call of a process: replayed steps stay bit-identical to eager ones.
// Plain C++ (no CUDA types): the testing bindings call the planner too.
#pragma once
#include <cstdint>

namespace krnl::cuda {

enum class SkinnyMode : int { none = 0, rows = 1, columns = 2 };

struct SkinnyPlan {
  SkinnyMode mode = SkinnyMode::none;
  int frags = 0;         // 16-wide fragments across the narrow side (1..4)
  bool narrow_n = true;  // N is the narrow side, else M
  int splits = 1;        // K slices over blocks (f32 partials + the ordered reduce when > 1)
  int64_t tiles = 0;     // blocks along the long side (16 rows, or 128 columns, each)
};

constexpr int64_t kSkinnyRowsK = 128;   // rows mode: K per pipeline stage
constexpr int64_t kSkinnyColsK = 16;    // columns mode: K per pipeline stage
constexpr int64_t kSkinnyColsW = 128;   // columns mode: long-side columns per block

// ta && tb, 32-bit operands, batches, sizes off the mode's grid, row strides off 8 elements (16-byte
// copies) and base addresses off 32 bytes (tensor-core fragment loads) keep cuBLAS.
inline SkinnyPlan plan_skinny_gemm(int64_t M, int64_t N, int64_t K, bool ta, bool tb, int64_t lda, int64_t ldb,
                                   int64_t batch, int elem_bytes, bool aligned32, int sm_count) {
  SkinnyPlan p;
  if (batch != 1 || elem_bytes != 2 || !aligned32 || M % 16 || N % 16 || lda % 8 || ldb % 8 || K < 256) return p;
  int64_t unit = 0;
  if (N <= 64 && !ta && K % kSkinnyRowsK == 0) {
    p.mode = SkinnyMode::rows, p.narrow_n = true, p.frags = int(N / 16), p.tiles = M / 16, unit = kSkinnyRowsK;
  } else if (N <= 64 && ta && !tb && M % kSkinnyColsW == 0 && K % kSkinnyColsK == 0) {
    p.mode = SkinnyMode::columns, p.narrow_n = true, p.frags = int(N / 16), p.tiles = M / kSkinnyColsW;
    unit = kSkinnyColsK;
  } else if (M <= 64 && N > 64 && !tb && N % kSkinnyColsW == 0 && K % kSkinnyColsK == 0) {
    p.mode = SkinnyMode::columns, p.narrow_n = false, p.frags = int(M / 16), p.tiles = N / kSkinnyColsW;
    unit = kSkinnyColsK;
  } else {
    return p;
  }
  // Enough blocks for two per SM: halve K over blocks while the slices stay >= 256 on the stage grid.
  while (p.tiles * p.splits < 2 * int64_t(sm_count) && p.splits < 64 && K % (2 * p.splits) == 0 &&
         (K / (2 * p.splits)) % unit == 0 && K / (2 * p.splits) >= 256)
    p.splits *= 2;
  return p;
}

}  // namespace krnl::cuda
