// Accelerate's BLAS threading, set per thread (macOS only; included by blas.h). No standard
// headers, so that tests/test_blas_threads.py can type-check it on Linux for an old-macOS target
// against tools/accelerate_stubs: it must build on an SDK without the API and call nothing
// unguarded that a macOS older than 15 lacks.
//
// BLASSetThreading / BLASGetThreading (<vecLib/thread_api.h>) arrived with the macOS 15 SDK and
// run on macOS 15+; the setting is thread-local. The header's presence is the compile-time SDK
// check, __builtin_available the run-time one (the deployment target is older).
#pragma once
#include <Accelerate/Accelerate.h>

#if __has_include(<vecLib/thread_api.h>)
#include <vecLib/thread_api.h>
#define KRNL_ACCELERATE_THREAD_API 1
#else
#define KRNL_ACCELERATE_THREAD_API 0
#endif

namespace krnl::cpu {

// Whether this thread's BLAS calls can be made single-threaded (macOS 15+, built with its SDK).
inline bool accelerate_thread_api() {
#if KRNL_ACCELERATE_THREAD_API
  if (__builtin_available(macOS 15.0, *)) return true;
#endif
  return false;
}

// While alive, BLAS calls made on this thread run on it alone (where accelerate_thread_api());
// the thread's previous setting comes back after.
class AccelerateSingleThreadHere {
 public:
  AccelerateSingleThreadHere() {
#if KRNL_ACCELERATE_THREAD_API
    if (__builtin_available(macOS 15.0, *)) {
      const auto now = BLASGetThreading();
      if (now != BLAS_THREADING_SINGLE_THREADED && BLASSetThreading(BLAS_THREADING_SINGLE_THREADED) == 0) {
        saved_ = int(now);
        restore_ = true;
      }
    }
#endif
  }
  ~AccelerateSingleThreadHere() {
#if KRNL_ACCELERATE_THREAD_API
    if (restore_) {
      if (__builtin_available(macOS 15.0, *)) BLASSetThreading(static_cast<decltype(BLASGetThreading())>(saved_));
    }
#endif
  }
  AccelerateSingleThreadHere(const AccelerateSingleThreadHere&) = delete;
  AccelerateSingleThreadHere& operator=(const AccelerateSingleThreadHere&) = delete;

  // This thread's setting as a thread count: 1 when single-threaded, 0 when Accelerate decides.
  static int threads() {
#if KRNL_ACCELERATE_THREAD_API
    if (__builtin_available(macOS 15.0, *)) return BLASGetThreading() == BLAS_THREADING_SINGLE_THREADED ? 1 : 0;
#endif
    return 0;
  }

 private:
  [[maybe_unused]] int saved_ = 0;  // unused where the SDK lacks the API
  [[maybe_unused]] bool restore_ = false;
};

}  // namespace krnl::cpu
