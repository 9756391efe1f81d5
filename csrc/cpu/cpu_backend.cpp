// CPU backend: memory, registration and split-K parameters; the ops are in the files by op family
// beside this one (gemm.cpp, norm.cpp, attention.cpp, elementwise.cpp, loss.cpp, quantized.cpp,
// optim.cpp).
#include "cpu_backend.h"

#include <algorithm>
#include <cstdlib>
#if defined(_WIN32)
#include <malloc.h>
#endif
#include <string>
#include <vector>

#include "blas.h"
#include "core/thread_pool.h"

namespace krnl::cpu {

CpuBackend::CpuBackend(const char* name) : Backend(name) {}

void* CpuBackend::raw_alloc(size_t bytes) {
  // 64-byte alignment: cache lines and any vector width; aligned_alloc wants a size multiple.
  const size_t n = std::max<size_t>(64, (bytes + 63) / 64 * 64);
#if defined(_WIN32)
  return _aligned_malloc(n, 64);  // MSVC has no std::aligned_alloc
#else
  return std::aligned_alloc(64, n);
#endif
}

void CpuBackend::raw_free(void* p, size_t) {
#if defined(_WIN32)
  _aligned_free(p);
#else
  std::free(p);
#endif
}

Capabilities CpuBackend::capabilities() const {
  Capabilities c = Backend::capabilities();
  c.dtypes = {DType::f32, DType::f16, DType::bf16};
  c.compute_dtype = DType::f32;  // the kernels compute in f32 whatever the operands: 16-bit saves no time
  // The reference loops take every feature of the contract (never chosen: no fused dtypes).
  c.fused_attention_segments = c.fused_attention_window = c.fused_attention_sinks = true;
  // Causal query row blocks skip the score blocks above the diagonal at the cost of more, smaller
  // GEMMs: measured, blocks of 128 took W2's attention from 71 to 53 ms.
  c.attention_block = 128;
  c.details = {{"blas", blas_name()}, {"threads", std::to_string(ThreadPool::global().size())}};
  return c;
}

SplitKConfig CpuBackend::split_k_config() const {
  // One BLAS call per 64x64 tile keeps a core busy; outputs with fewer than two tiles per pool
  // thread split K, but only when each slice keeps >= 512 of K (else the reduce dominates), and
  // only where the slices' BLAS calls can each keep to one thread (blas_fan_out).
  SplitKConfig c;
  c.tile_m = 64;
  c.tile_n = 64;
  // Never in the sample order (gemm_row_block): a split chosen by M's tiles and the thread count
  // would change a row's bits with them.
  c.min_tiles = blas_fan_out() && gemm_row_block() == 0 ? 2 * int64_t(ThreadPool::global().size()) : 0;
  c.k_unit = 64;
  c.max_splits = 8;
  c.min_k_per_split = 512;
  return c;
}

void register_backend() {
  register_device("cpu", 0, []() -> Backend* { return new CpuBackend("cpu"); });
}

void register_second_backend() {
  register_device("cpu:1", -1, []() -> Backend* { return new CpuBackend("cpu:1"); });
}

std::vector<int> probe_blas_threads() {
  ThreadPool& pool = ThreadPool::global();
  std::vector<int> seen(size_t(pool.size()) * 4 + 2);
  seen.front() = blas_threads_here();
  {
    BlasSingleThread one_thread(pool.size() > 1);  // as gemm_split_k holds them
    pool.parallel_for(int64_t(seen.size()) - 2, 1, [&](int64_t b, int64_t e) {
      BlasSingleThreadHere here;
      for (int64_t i = b; i < e; ++i) seen[size_t(i) + 1] = blas_threads_here();
    });
  }
  seen.back() = blas_threads_here();
  return seen;
}

bool blas_fans_out() { return blas_fan_out(); }

}  // namespace krnl::cpu
