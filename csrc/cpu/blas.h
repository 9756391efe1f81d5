// The only file that names the BLAS: Accelerate on macOS, the scipy-openblas32 wheel elsewhere
// (its symbols carry a scipy_ prefix so they never clash with numpy's own OpenBLAS).
#pragma once
#include <cstdint>
#include <mutex>

#if defined(KRNL_ACCELERATE)
#include <Accelerate/Accelerate.h>
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

// Keeps the BLAS on one thread while alive, for GEMMs issued from krnl's own pool workers (split-K
// slices) so the two pools do not oversubscribe the cores. The wheel's pthreads OpenBLAS declares
// openblas_set_num_threads_local but does not export it (and in OpenMP builds it only acts inside
// OpenMP regions), so this lowers the process-wide count: a plain store in OpenBLAS, reference
// counted so overlapping scopes from several caller threads restore the count only once.
// Accelerate has no portable knob: a no-op there.
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

// Which BLAS this build calls, for people (Device.capabilities()["details"]["blas"]).
inline const char* blas_name() {
#if defined(KRNL_ACCELERATE)
  return "Accelerate";
#else
  return scipy_openblas_get_config();  // "OpenBLAS 0.3.x DYNAMIC_ARCH ... <core> MAX_THREADS=n"
#endif
}

}  // namespace krnl::cpu
