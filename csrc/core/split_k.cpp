#include "split_k.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace krnl {

SplitKPlan plan_split_k(int64_t M, int64_t N, int64_t K, int64_t batch, const SplitKConfig& cfg) {
  SplitKPlan plan;
  plan.k_per_split = K;
  if (cfg.min_tiles <= 0 || M <= 0 || N <= 0 || K <= 0) return plan;
  const int64_t tiles = ((M + cfg.tile_m - 1) / cfg.tile_m) * ((N + cfg.tile_n - 1) / cfg.tile_n) * batch;
  if (tiles >= cfg.min_tiles) return plan;
  const int64_t want = (cfg.min_tiles + tiles - 1) / tiles;
  auto fits = [&](int64_t s) { return K % s == 0 && (K / s) % cfg.k_unit == 0 && K / s >= cfg.min_k_per_split; };
  int64_t chosen = 1;
  for (int64_t s = std::max<int64_t>(2, want); s <= cfg.max_splits && chosen == 1; ++s)
    if (fits(s)) chosen = s;
  // No equal split reaches the target: take the largest one below it, if any.
  for (int64_t s = std::min(want - 1, cfg.max_splits); s >= 2 && chosen == 1; --s)
    if (fits(s)) chosen = s;
  plan.splits = chosen;
  plan.k_per_split = K / chosen;
  return plan;
}

RowSplitPlan plan_row_split(int64_t M, double t_cpu, double t_gpu, double overhead, int64_t tile_m) {
  if (M < 0 || tile_m <= 0) throw std::invalid_argument("[plan_row_split] M must be >= 0 and tile_m > 0");
  if (!(t_cpu > 0) || !(t_gpu > 0) || !(overhead >= 0))
    throw std::invalid_argument("[plan_row_split] t_cpu and t_gpu must be > 0 and overhead >= 0");
  RowSplitPlan r;
  double p = (overhead + t_gpu) / (t_cpu + t_gpu);
  p = std::min(1.0, std::max(0.0, p));
  r.cpu_fraction = p;
  // Nearest row count among the tile multiples and M itself (a last partial tile is allowed).
  const double want = p * double(M);
  const int64_t lo = std::min(M, int64_t(want / double(tile_m)) * tile_m);
  const int64_t hi = std::min(M, lo + tile_m);
  r.cpu_rows = (want - double(lo) <= double(hi) - want) ? lo : hi;
  r.gpu_rows = M - r.cpu_rows;
  return r;
}

}  // namespace krnl
