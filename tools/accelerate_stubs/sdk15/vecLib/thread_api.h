// Stand-in for the macOS 15 SDK's <vecLib/thread_api.h>, with its availability (macOS 15.0): the
// enumeration's values are 0, 1 and 2 in Apple's header. tests/test_blas_threads.py only.
#pragma once
enum BLAS_THREADING : unsigned int {
  BLAS_THREADING_MULTI_THREADED = 0,
  BLAS_THREADING_SINGLE_THREADED = 1,
  BLAS_THREADING_MAX_OPTIONS = 2
} __attribute__((availability(macos, introduced = 15.0)));
extern "C" int BLASSetThreading(const enum BLAS_THREADING threading) __attribute__((availability(macos, introduced = 15.0)));
extern "C" enum BLAS_THREADING BLASGetThreading(void) __attribute__((availability(macos, introduced = 15.0)));
