// CK(call): a CUDA runtime call that exits the (standalone) probe with the call's text on failure.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                             \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "%s:%d %s: %s (%s)\n", __FILE__, __LINE__, #x, cudaGetErrorName(e_), \
              cudaGetErrorString(e_));                                                    \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)
