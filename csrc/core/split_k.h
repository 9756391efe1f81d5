// Split-K routing and the CPU/GPU row-split planner: pure functions, tested from Python.
#pragma once
#include <cstdint>

namespace krnl {

struct SplitKConfig {
  int64_t tile_m = 32, tile_n = 32;  // the backend's output tile
  int64_t min_tiles = 0;             // outputs with fewer tiles than this are split (0: never)
  int64_t k_unit = 32;               // each K slice is a multiple of this
  int64_t max_splits = 16;
  int64_t min_k_per_split = 256;     // below this a slice is not worth a partial
};

struct SplitKPlan {
  int64_t splits = 1;  // 1: plain GEMM
  int64_t k_per_split = 0;
};

// Route one GEMM: split K when the output has too few tiles to fill the device and K divides
// into equal slices that are multiples of k_unit. Picks the smallest split count that brings
// tiles * splits to min_tiles, within max_splits.
SplitKPlan plan_split_k(int64_t M, int64_t N, int64_t K, int64_t batch, const SplitKConfig& cfg);

struct RowSplitPlan {
  int64_t cpu_rows = 0, gpu_rows = 0;
  double cpu_fraction = 0;  // unrounded p
};

// CPU/GPU row split of one GEMM (KRNL report): the CPU takes the fraction
//   p = (O + T_gpu) / (T_cpu + T_gpu)
// of the M rows, where T_cpu and T_gpu are each engine's time for the whole GEMM and O the
// fixed cost the GPU side pays (sync, launch), so that p*T_cpu = O + (1-p)*T_gpu: both finish
// together. Rows are rounded to the tile height; p is clamped to [0, 1].
RowSplitPlan plan_row_split(int64_t M, double t_cpu, double t_gpu, double overhead, int64_t tile_m);

}  // namespace krnl
