// What the memsets in krnl's recorded steps are, and whether a recording can carry them as kernel
// nodes instead. cuBLAS issues a small memset ahead of some of its kernels, and in W3's replayed
// step most of the GPU's idle time sat around them. This probe records W3's frozen GEMMs as krnl
// calls them (cublasGemmStridedBatchedEx, bf16, f32 compute), lists the recording's nodes (type,
// memset parameters, the edges' types around each memset), then rewrites each memset node as a
// kernel node doing the same fill, checking every graph call, and times both graphs and compares
// their outputs.
//
// cuBLAS is opened at run time, as krnl opens it (the machine has its library, not its headers).
//
//   nvcc -O2 -arch=sm_90 -o /tmp/memset_probe dev/cuda/memset_probe.cu -ldl
//   /tmp/memset_probe LIBCUBLAS [workspace]
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <library_types.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_check.h"

// What a memset node does, as a kernel: elements of 1, 2 or 4 bytes over a 2-D pitched region.
__global__ void fill_kernel(char* dst, size_t pitch, unsigned value, unsigned elem, size_t width, size_t height) {
  const size_t n = width * height;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    char* p = dst + (i / width) * pitch + (i % width) * elem;
    if (elem == 4) *reinterpret_cast<unsigned*>(p) = value;
    else if (elem == 2) *reinterpret_cast<unsigned short*>(p) = (unsigned short)value;
    else *p = (char)value;
  }
}

// cuBLAS's C ABI for the calls used (cublas_api.h): opaque handle, int status and enums.
using Handle = void*;
enum { OP_N = 0, OP_T = 1, COMPUTE_32F = 68, GEMM_DEFAULT = -1 };
static int (*cublasCreate)(Handle*);
static int (*cublasSetStream)(Handle, cudaStream_t);
static int (*cublasSetWorkspace)(Handle, void*, size_t);
static int (*cublasGemmStridedBatchedEx)(Handle, int, int, int, int, int, const void*, const void*, cudaDataType, int,
                                         long long, const void*, cudaDataType, int, long long, const void*, void*,
                                         cudaDataType, int, long long, int, int, int);

struct Gemm {  // y (rows, out) = x (rows, in) W^T, or dx (rows, in) = dy (rows, out) W
  const char* name;
  int rows, out, in;
  bool backward;
};

static const char* type_name(cudaGraphNodeType t) {
  switch (t) {
    case cudaGraphNodeTypeKernel: return "kernel";
    case cudaGraphNodeTypeMemset: return "memset";
    case cudaGraphNodeTypeMemcpy: return "memcpy";
    case cudaGraphNodeTypeEmpty: return "empty";
    case cudaGraphNodeTypeMemAlloc: return "mem-alloc";  // stream-ordered allocation inside the recording
    case cudaGraphNodeTypeMemFree: return "mem-free";
    case cudaGraphNodeTypeEventRecord: return "event-record";
    case cudaGraphNodeTypeWaitEvent: return "event-wait";
    default: return "other";
  }
}

int main(int argc, char** argv) {
  const int T = 4096, C = 4096, F = 14336, QKV = 6144;
  std::vector<Gemm> gemms = {{"qkv fwd", T, QKV, C, false}, {"o fwd", T, C, C, false},     {"gate fwd", T, F, C, false},
                             {"up fwd", T, F, C, false},     {"down fwd", T, C, F, false},   {"down dx", T, C, F, true},
                             {"gate dx", T, F, C, true},     {"up dx (+=)", T, F, C, true},  {"o dx", T, C, C, true},
                             {"qkv dx", T, QKV, C, true}};
  void* lib = dlopen(argc > 1 ? argv[1] : "libcublas.so.13", RTLD_NOW);
  if (!lib) {
    std::printf("dlopen: %s\n", dlerror());
    return 1;
  }
  cublasCreate = reinterpret_cast<decltype(cublasCreate)>(dlsym(lib, "cublasCreate_v2"));
  cublasSetStream = reinterpret_cast<decltype(cublasSetStream)>(dlsym(lib, "cublasSetStream_v2"));
  cublasSetWorkspace = reinterpret_cast<decltype(cublasSetWorkspace)>(dlsym(lib, "cublasSetWorkspace_v2"));
  cublasGemmStridedBatchedEx =
      reinterpret_cast<decltype(cublasGemmStridedBatchedEx)>(dlsym(lib, "cublasGemmStridedBatchedEx"));
  const bool workspace = argc > 2 && std::strcmp(argv[2], "workspace") == 0;
  Handle h;
  cublasCreate(&h);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cublasSetStream(h, s);
  void* ws = nullptr;
  if (workspace) {  // a workspace of our own, as PyTorch sets one
    CK(cudaMalloc(&ws, 32 << 20));
    std::printf("cublasSetWorkspace 32 MiB: %d\n", int(cublasSetWorkspace(h, ws, 32 << 20)));
  }
  const size_t big = size_t(T) * F;
  __nv_bfloat16 *x, *W, *y[2];
  CK(cudaMalloc(&x, big * 2));
  CK(cudaMalloc(&W, size_t(F) * C * 2));
  CK(cudaMalloc(&y[0], big * 2));
  CK(cudaMalloc(&y[1], big * 2));
  {
    std::vector<__nv_bfloat16> hx(big), hw(size_t(F) * C);
    for (size_t i = 0; i < big; ++i) hx[i] = __float2bfloat16(float((i * 2654435761u) % 1000) / 1000.f - 0.5f);
    for (size_t i = 0; i < hw.size(); ++i) hw[i] = __float2bfloat16(float((i * 40503u) % 1000) / 20000.f - 0.025f);
    CK(cudaMemcpy(x, hx.data(), big * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(W, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice));
  }
  const float one = 1.f, zero = 0.f;
  auto run = [&](__nv_bfloat16* out) {
    for (const Gemm& g : gemms) {
      const float* beta = std::strstr(g.name, "+=") ? &one : &zero;
      int st;
      if (!g.backward)  // column-major: y^T (out, rows) = W (out, in) x^T
        st = cublasGemmStridedBatchedEx(h, OP_T, OP_N, g.out, g.rows, g.in, &one, W, CUDA_R_16BF, g.in, 0,
                                        x, CUDA_R_16BF, g.in, 0, beta, out, CUDA_R_16BF, g.out, 0, 1,
                                        COMPUTE_32F, GEMM_DEFAULT);
      else  // dx^T (in, rows) = W^T dy^T
        st = cublasGemmStridedBatchedEx(h, OP_N, OP_N, g.in, g.rows, g.out, &one, W, CUDA_R_16BF, g.in, 0,
                                        x, CUDA_R_16BF, g.out, 0, beta, out, CUDA_R_16BF, g.in, 0, 1,
                                        COMPUTE_32F, GEMM_DEFAULT);
      if (st != 0) {
        std::printf("cublas %s: %d\n", g.name, int(st));
        std::exit(1);
      }
    }
  };
  run(y[0]);  // warm: cuBLAS's own set-up outside the recording
  CK(cudaStreamSynchronize(s));

  cudaGraph_t graph[2];
  for (int k = 0; k < 2; ++k) {
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    run(y[k]);
    CK(cudaStreamEndCapture(s, &graph[k]));
  }
  size_t n = 0;
  CK(cudaGraphGetNodes(graph[1], nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  CK(cudaGraphGetNodes(graph[1], nodes.data(), &n));
  std::printf("recording: %zu nodes\n", n);
  int memsets = 0, rewritten = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType t;
    CK(cudaGraphNodeGetType(node, &t));
    size_t nd = 0, nu = 0;
    CK(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &nd));
    CK(cudaGraphNodeGetDependentNodes(node, nullptr, nullptr, &nu));
    std::vector<cudaGraphNode_t> dep(nd), use(nu);
    std::vector<cudaGraphEdgeData> dep_e(nd), use_e(nu);
    CK(cudaGraphNodeGetDependencies(node, dep.data(), dep_e.data(), &nd));
    CK(cudaGraphNodeGetDependentNodes(node, use.data(), use_e.data(), &nu));
    auto edges = [](const std::vector<cudaGraphEdgeData>& e) {
      static char buf[256];
      buf[0] = 0;
      for (const auto& d : e)
        std::snprintf(buf + std::strlen(buf), sizeof buf - std::strlen(buf), " type %d from_port %d to_port %d;",
                      int(d.type), int(d.from_port), int(d.to_port));
      return buf;
    };
    if (t == cudaGraphNodeTypeKernel) {
      cudaKernelNodeParams kp{};
      cudaError_t e = cudaGraphKernelNodeGetParams(node, &kp);
      cudaLaunchAttributeValue v{};
      cudaError_t ea = cudaGraphKernelNodeGetAttribute(node, cudaLaunchAttributeProgrammaticStreamSerialization, &v);
      std::printf("  kernel grid %ux%ux%u block %ux%ux%u smem %u (params %s; programmatic %d, %s); in:%s out:%s\n",
                  kp.gridDim.x, kp.gridDim.y, kp.gridDim.z, kp.blockDim.x, kp.blockDim.y, kp.blockDim.z,
                  kp.sharedMemBytes, cudaGetErrorName(e), int(v.programmaticStreamSerializationAllowed),
                  cudaGetErrorName(ea), edges(dep_e), edges(use_e));
      continue;
    }
    std::printf("  %s; in:%s out:%s\n", type_name(t), edges(dep_e), edges(use_e));
    if (t != cudaGraphNodeTypeMemset) continue;
    ++memsets;
    cudaMemsetParams mp{};
    CK(cudaGraphMemsetNodeGetParams(node, &mp));
    std::printf("    memset dst %p pitch %zu value %u elem %u width %zu height %zu; %zu in, %zu out\n", mp.dst, mp.pitch,
                mp.value, mp.elementSize, mp.width, mp.height, nd, nu);
    // The same fill as a kernel node between the same neighbours, each edge keeping its data.
    char* dst = static_cast<char*>(mp.dst);
    size_t pitch = mp.pitch, width = mp.width, height = mp.height;
    unsigned value = mp.value, elem = mp.elementSize;
    void* args[] = {&dst, &pitch, &value, &elem, &width, &height};
    cudaGraphNodeParams np{};
    np.type = cudaGraphNodeTypeKernel;
    np.kernel.func = reinterpret_cast<void*>(fill_kernel);
    np.kernel.gridDim = dim3(unsigned(std::min<size_t>((width * height + 255) / 256, 1024)));
    np.kernel.blockDim = dim3(256);
    np.kernel.kernelParams = args;
    cudaGraphNode_t fill;
    cudaError_t e = cudaGraphAddNode(&fill, graph[1], dep.data(), dep_e.data(), nd, &np);
    std::printf("    cudaGraphAddNode (kernel, %zu deps): %s\n", nd, cudaGetErrorName(e));
    if (e != cudaSuccess) continue;
    for (size_t i = 0; i < nu; ++i) {
      e = cudaGraphAddDependencies(graph[1], &fill, &use[i], &use_e[i], 1);
      if (e != cudaSuccess) std::printf("    cudaGraphAddDependencies -> dependent %zu: %s\n", i, cudaGetErrorName(e));
    }
    e = cudaGraphDestroyNode(node);
    std::printf("    cudaGraphDestroyNode (the memset): %s\n", cudaGetErrorName(e));
    if (e == cudaSuccess) ++rewritten;
  }
  std::printf("memsets: %d, rewritten: %d\n", memsets, rewritten);

  cudaGraphExec_t exec[2];
  for (int k = 0; k < 2; ++k) {
    cudaError_t e = cudaGraphInstantiate(&exec[k], graph[k], 0);
    std::printf("instantiate graph %s: %s\n", k ? "rewritten" : "as recorded", cudaGetErrorName(e));
    if (e != cudaSuccess) return 1;
  }
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  float ms[2][5];
  for (int round = 0; round < 5; ++round)
    for (int k = 0; k < 2; ++k) {
      CK(cudaGraphLaunch(exec[k], s));
      CK(cudaEventRecord(a, s));
      for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(exec[k], s));
      CK(cudaEventRecord(b, s));
      CK(cudaEventSynchronize(b));
      CK(cudaEventElapsedTime(&ms[k][round], a, b));
    }
  for (int k = 0; k < 2; ++k) {
    std::printf("%s: us a replay:", k ? "rewritten" : "as recorded");
    for (int r = 0; r < 5; ++r) std::printf(" %.1f", 1000.f * ms[k][r] / 20);
    std::printf("\n");
  }
  std::vector<unsigned short> h0(big), h1(big);
  CK(cudaMemcpy(h0.data(), y[0], big * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h1.data(), y[1], big * 2, cudaMemcpyDeviceToHost));
  std::printf("outputs %s\n", std::memcmp(h0.data(), h1.data(), big * 2) ? "DIFFER" : "identical");
  return 0;
}
