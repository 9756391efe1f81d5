// mslcuda_rt.cu -- the memory and the queue of the metal-cuda device, one copy per process
// (every kernel library launches on the stream this library owns, so the work of a command
// buffer runs in order; each library links the CUDA runtime on its own, and the stream handle is
// what they share). Memory is managed: visible to the host like Apple's shared storage.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

namespace {
cudaStream_t g_stream = nullptr;  // the device's queue
cudaStream_t g_fill = nullptr;    // fills of new allocations, waited for at once
thread_local char g_error[512];

const char* fail(const char* what, cudaError_t e) {
  std::snprintf(g_error, sizeof g_error, "%s: %s", what, cudaGetErrorString(e));
  return g_error;
}
}  // namespace

extern "C" {

const char* mslcuda_init() {
  cudaError_t e = cudaSetDevice(0);
  if (e == cudaSuccess && !g_stream) e = cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking);
  if (e == cudaSuccess && !g_fill) e = cudaStreamCreateWithFlags(&g_fill, cudaStreamNonBlocking);
  return e == cudaSuccess ? nullptr : fail("cudaStreamCreate", e);
}

void* mslcuda_stream() { return g_stream; }

// New memory reads as 0xFF bytes (NaN in every float type), as metal-sim's does: an output a
// kernel leaves unwritten shows in the tests.
void* mslcuda_alloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMallocManaged(&p, bytes ? bytes : 1) != cudaSuccess) return nullptr;
  if (cudaMemsetAsync(p, 0xFF, bytes, g_fill) != cudaSuccess || cudaStreamSynchronize(g_fill) != cudaSuccess) {
    cudaFree(p);
    return nullptr;
  }
  return p;
}

void mslcuda_free(void* p) { cudaFree(p); }

// Waits for everything launched so far; the error of a failed kernel, or null.
const char* mslcuda_synchronize() {
  const cudaError_t e = cudaStreamSynchronize(g_stream);
  return e == cudaSuccess ? nullptr : fail("kernel execution", e);
}

// Whether the GPU can read and write p (managed or device memory, or any host memory where the
// system lets the GPU page it in): an executor refuses plain host memory elsewhere instead of
// faulting the context.
int mslcuda_device_accessible(const void* p) {
  cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (a.type == cudaMemoryTypeManaged || a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeHost) return 1;
  int pageable = 0;
  cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, 0);
  return pageable;
}

const char* mslcuda_device_name() {
  static cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "no CUDA device";
  return prop.name;
}
}
