// The only file that names the BLAS: Accelerate on macOS, the scipy-openblas32 wheel elsewhere
// (its symbols carry a scipy_ prefix so they never clash with numpy's own OpenBLAS).
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(KRNL_ACCELERATE)
#include <Accelerate/Accelerate.h>

#include "cpu/accelerate_threads.h"
#elif defined(KRNL_SCIPY_OPENBLAS)
#include "cblas.h"
#else
#error "krnl's CPU backend needs a BLAS: define KRNL_ACCELERATE or KRNL_SCIPY_OPENBLAS"
#endif

namespace krnl::cpu {

// Row-major C = alpha * op(A) * op(B) + beta * C; C is (M, N), op(A) (M, K), op(B) (K, N);
// ld* are the row lengths of the matrices as stored.
inline void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                  const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const auto TA = ta ? CblasTrans : CblasNoTrans, TB = tb ? CblasTrans : CblasNoTrans;
#if defined(KRNL_ACCELERATE)
  cblas_sgemm(CblasRowMajor, TA, TB, int(M), int(N), int(K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
#else
  scipy_cblas_sgemm(CblasRowMajor, TA, TB, int(M), int(N), int(K), alpha, A, int(lda), B, int(ldb), beta, C,
                    int(ldc));
#endif
}

// GEMMs issued from krnl's own pool threads (split-K slices, attention heads) must each run on
// their thread alone, or the two pools oversubscribe the cores. Two scopes, one per BLAS's knob:
// BlasSingleThread around the parallel region (OpenBLAS: a process-wide count) and
// BlasSingleThreadHere inside each chunk a pool thread runs (Accelerate: a per-thread setting).
//
// OpenBLAS: the wheel's pthreads build declares openblas_set_num_threads_local but does not export
// it (and in OpenMP builds it only acts inside OpenMP regions), so this lowers the process-wide
// count: a plain store in OpenBLAS, reference counted so overlapping scopes from several caller
// threads restore the count only once. A no-op with Accelerate.
class BlasSingleThread {
 public:
  explicit BlasSingleThread(bool on = true) : on_(on) {
#if defined(KRNL_SCIPY_OPENBLAS)
    if (!on_) return;
    std::lock_guard<std::mutex> lk(state().mu);
    if (state().depth++ == 0) {
      state().saved = scipy_openblas_get_num_threads();
      scipy_openblas_set_num_threads(1);
    }
#endif
  }
  ~BlasSingleThread() {
#if defined(KRNL_SCIPY_OPENBLAS)
    if (!on_) return;
    std::lock_guard<std::mutex> lk(state().mu);
    if (--state().depth == 0) scipy_openblas_set_num_threads(state().saved);
#else
    (void)on_;
#endif
  }
  BlasSingleThread(const BlasSingleThread&) = delete;
  BlasSingleThread& operator=(const BlasSingleThread&) = delete;

 private:
  struct State {
    std::mutex mu;
    int depth = 0, saved = 1;
  };
  static State& state() {
    static State s;
    return s;
  }
  bool on_;
};

// Accelerate (macOS 15+): this thread's BLAS calls single-threaded while alive (accelerate_threads.h).
// A no-op with OpenBLAS, whose count BlasSingleThread has lowered for every thread.
class BlasSingleThreadHere {
 public:
  BlasSingleThreadHere() {}  // user-provided: a scope object, never "unused"
  ~BlasSingleThreadHere() {}
  BlasSingleThreadHere(const BlasSingleThreadHere&) = delete;
  BlasSingleThreadHere& operator=(const BlasSingleThreadHere&) = delete;

 private:
#if defined(KRNL_ACCELERATE)
  AccelerateSingleThreadHere here_;
#endif
};

// Whether BLAS calls may run side by side on the pool's threads, each on its own thread. OpenBLAS:
// always (BlasSingleThread). Accelerate: where BLASSetThreading exists (macOS 15+), or where
// the user started the process with VECLIB_MAXIMUM_THREADS=1 (Accelerate reads it once, when it
// loads, and numpy may have loaded it before krnl: krnl cannot set it itself in time). Elsewhere
// each Accelerate call threads itself, so the CPU backend issues them one at a time instead
// (no split-K, no per-head fan-out): the same results, no oversubscription.
inline bool blas_fan_out() {
#if defined(KRNL_ACCELERATE)
  static const bool ok = [] {
    const char* v = std::getenv("VECLIB_MAXIMUM_THREADS");
    return accelerate_thread_api() || (v && std::strcmp(v, "1") == 0);
  }();
  return ok;
#else
  return true;
#endif
}

// The BLAS's own thread count as this thread sees it: OpenBLAS's process-wide count; Accelerate's
// per-thread setting, 1 when single-threaded, 0 when Accelerate decides (tests only).
inline int blas_threads_here() {
#if defined(KRNL_ACCELERATE)
  return AccelerateSingleThreadHere::threads();
#else
  return scipy_openblas_get_num_threads();
#endif
}

// Which BLAS this build calls, for people (Device.capabilities()["details"]["blas"]).
inline const char* blas_name() {
#if defined(KRNL_ACCELERATE)
  return "Accelerate";
#else
  return scipy_openblas_get_config();  // "OpenBLAS 0.3.x DYNAMIC_ARCH ... <core> MAX_THREADS=n"
#endif
}

}  // namespace krnl::cpu
