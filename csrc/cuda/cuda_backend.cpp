// CUDA backend: registration, memory, submission (stream + one event per step) and the cuBLAS
// loader. The ops live in the .cu files beside this one.
#include "cuda_backend.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cublas_api.h"

namespace krnl::cuda {

void check(cudaError_t e, const char* op) {
  if (e == cudaSuccess) return;
  throw std::runtime_error(std::string("[") + op + "] CUDA error " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

// ---- cuBLAS, opened lazily: KRNL_CUBLAS (a path) first, then the sonames of CUDA 13 and 12 on
// the loader's path, then the toolkit's usual folder (often not on the loader's path).

namespace {
std::string g_cublas_error;

const CublasApi* load_cublas() {
  std::vector<std::string> names;
  if (const char* p = std::getenv("KRNL_CUBLAS"); p && *p) names.push_back(p);
  for (const char* n : {"libcublas.so.13", "libcublas.so.12", "libcublas.so", "/usr/local/cuda/lib64/libcublas.so.13",
                        "/usr/local/cuda/lib64/libcublas.so.12"})
    names.push_back(n);
  void* lib = nullptr;
  for (const auto& n : names)
    if ((lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
  if (!lib) {
    const char* e = dlerror();
    g_cublas_error = std::string("cannot open libcublas (tried KRNL_CUBLAS, libcublas.so.13/.12, /usr/local/cuda/lib64): ") +
                     (e ? e : "");
    return nullptr;
  }
  static CublasApi api;
  auto sym = [&](const char* name) {
    void* f = dlsym(lib, name);
    if (!f) g_cublas_error = std::string("libcublas lacks ") + name;
    return f;
  };
  api.create = reinterpret_cast<decltype(api.create)>(sym("cublasCreate_v2"));
  api.destroy = reinterpret_cast<decltype(api.destroy)>(sym("cublasDestroy_v2"));
  api.set_stream = reinterpret_cast<decltype(api.set_stream)>(sym("cublasSetStream_v2"));
  api.gemm_strided_batched = reinterpret_cast<decltype(api.gemm_strided_batched)>(sym("cublasGemmStridedBatchedEx"));
  if (!api.create || !api.destroy || !api.set_stream || !api.gemm_strided_batched) return nullptr;
  return &api;
}
}  // namespace

const CublasApi* cublas() {
  static std::once_flag once;
  static const CublasApi* api = nullptr;
  std::call_once(once, [] { api = load_cublas(); });
  return api;
}

const char* cublas_error() { return g_cublas_error.c_str(); }

// ---- registration

// Which GPU this process takes: KRNL_CUDA_DEVICE (an ordinal) when set; else, among the ranks of a
// data-parallel run that share this machine, the rank's place on it (KRNL_LOCAL_RANK, which
// krnl.train.dist.world sets before the device is made) modulo the GPUs, so that ranks take distinct GPUs
// where there are enough; else GPU 0. CUDA_VISIBLE_DEVICES, read by the driver, comes first.
static int chosen_device(int count) {
  if (const char* e = std::getenv("KRNL_CUDA_DEVICE"); e && *e) {
    char* end = nullptr;
    const long d = std::strtol(e, &end, 10);
    if (*end || d < 0 || d >= count)
      throw std::invalid_argument(std::string("[cuda] KRNL_CUDA_DEVICE=") + e + ": this machine has " +
                                  std::to_string(count) + " CUDA device(s), 0 to " + std::to_string(count - 1));
    return int(d);
  }
  if (const char* e = std::getenv("KRNL_LOCAL_RANK"); e && *e) {
    const long r = std::strtol(e, nullptr, 10);
    return r > 0 ? int(r % count) : 0;
  }
  return 0;
}

void register_backend() {
  if (const char* e = std::getenv("KRNL_DISABLE_CUDA"); e && *e == '1') {
    register_unavailable("cuda", "KRNL_DISABLE_CUDA=1");
    return;
  }
  int n = 0;
  // No driver, no device, a driver too old for this runtime: all just mean "no cuda device".
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n < 1) {
    register_unavailable("cuda", e != cudaSuccess
                                     ? std::string("no usable CUDA driver/device: ") + cudaGetErrorString(e)
                                     : std::string("no CUDA device"));
    cudaGetLastError();  // clear the non-sticky error so later runtime calls start clean
    return;
  }
  if (!cublas()) {
    register_unavailable("cuda", cublas_error());
    return;
  }
  register_device("cuda", 100, []() -> Backend* {
    int count = 0;
    check(cudaGetDeviceCount(&count), "cuda");
    return new CudaBackend(chosen_device(count));
  });
}

// ---- the backend

CudaBackend::CudaBackend(int device) : Backend("cuda"), device_(device) {
  check(cudaSetDevice(device_), "cuda");
  check(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_), "cuda");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device_), "cuda");
  gpu_name_ = prop.name;
  compute_capability_ = std::to_string(prop.major) + "." + std::to_string(prop.minor);
  char bus[32] = {};
  check(cudaDeviceGetPCIBusId(bus, sizeof bus, device_), "cuda");
  pci_bus_id_ = bus;  // with the host name, which GPU this is: data-parallel ranks must not share one
  // Non-blocking: the legacy default stream (used by other libraries in the process) must not
  // serialise against our steps.
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cuda");
  const CublasApi* api = cublas();
  if (!api) throw std::runtime_error(std::string("[cuda] ") + cublas_error());
  cublasHandle h = nullptr;
  if (api->create(&h) != 0) throw std::runtime_error("[cuda] cublasCreate failed");
  if (api->set_stream(h, stream_) != 0) throw std::runtime_error("[cuda] cublasSetStream failed");
  cublas_ = h;
}

CudaBackend::~CudaBackend() {
  // Devices live until exit (the registry leaks them); nothing to tear down in order.
}

Capabilities CudaBackend::capabilities() const {
  Capabilities c = Backend::capabilities();
  c.dtypes = {DType::f32, DType::f16, DType::bf16};
  c.compute_dtype = DType::bf16;  // tensor-core GEMMs with f32's exponent range: no loss scaling
#ifdef KRNL_HAS_CUDNN
  c.fused_attention_dtypes = fused_attention_dtypes();  // packed segments stay materialised
  c.fused_attention_window = !c.fused_attention_dtypes.empty();  // cuDNN's diagonal band
  // cuDNN's backward workspace (the forward takes none), measured through the pool on an H200 with
  // 32 query heads on 8 of 128: 640 and 1280 MiB classes at T = 16384 and 32768
  // (dev/cuda/attention_workspace.py), i.e. just over 8 bytes an element of q.
  c.fused_attention_workspace_element = 8;
  c.fused_attention_workspace_row = 4;
  // sinks stay false: cuDNN's SDPA graphs take no extra softmax column, and krnl has no fused
  // attention kernel of its own on CUDA; gpt-oss attention takes the materialised path there.
#endif
  c.graphs = true;  // capture() (cuda_graph.cpp)
  // Causal query row blocks skip the score blocks above the diagonal at the cost of more, smaller
  // GEMMs. H200, W3 (T=4096) replayed: 10.04 ms with one block, 9.50 / 9.36 / 9.49 / 10.04 with
  // blocks of 2048 / 1024 / 512 / 256.
  c.attention_block = 1024;
  c.collectives = {"nccl"};  // NcclComm (nccl_comm.h) on this stream, where libnccl loads
  c.lora_fold = true;         // +1.9% on the H200's 1b step: docs/performance.md, 'The LoRA folded into K'
  c.details = {{"gpu", gpu_name_}, {"compute_capability", compute_capability_},
               {"sm_count", std::to_string(sm_count_)}, {"device", std::to_string(device_)},
               {"pci_bus_id", pci_bus_id_}};
  return c;
}

SplitKConfig CudaBackend::split_k_config() const {
  // Auto-routing never splits (min_tiles 0): cuBLAS picks its own split-K for skinny outputs, and
  // on the H200 it beat every forced split of W3's LoRA GEMMs (bench/test_gpu.py, split-K test: e.g.
  // (4096, 16) = x (4096, 14336) A^T: 33.4 us plain, 35.1 us split 2, 35.3 us split 4). Forced
  // splits (GemmArgs.split_k > 1) still run as slices + reduce (gemm.cu).
  SplitKConfig c;
  c.tile_m = 128;
  c.tile_n = 128;
  c.min_tiles = 0;
  c.k_unit = 128;
  c.max_splits = 16;
  c.min_k_per_split = 512;
  return c;
}

void* CudaBackend::raw_alloc(size_t bytes) {
  void* p = nullptr;
  if (capturing()) {
    // A buffer the warm-up did not leave in the pool. cudaMalloc is no stream operation, but a
    // thread-local capture forbids it: relax this thread's mode for the call. Never nullptr here:
    // the pool's retry would cudaFree its cache, which a capture cannot survive.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    const cudaError_t e = cudaMalloc(&p, bytes);
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error("[capture] cudaMalloc of " + std::to_string(bytes) +
                               " bytes failed while recording a graph: " + cudaGetErrorString(e));
    }
    return p;
  }
  // Plain device memory (never managed). A failure returns nullptr so the pool can give its
  // cache back and retry before reporting exhaustion.
  if (cudaMalloc(&p, bytes) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

void CudaBackend::raw_free(void* p, size_t) {
  // The pool hands back only buffers whose step has completed (or that no step used). cudaFree
  // synchronises, which would invalidate an open capture: then it waits for the capture's end.
  if (capturing()) return defer(0, [p] { cudaFree(p); });
  cudaFree(p);
}

void CudaBackend::upload(const Tensor& dst, const void* src) {
  if (dst.nbytes() == 0) return;
  const size_t slot = (dst.nbytes() + 255) / 256 * 256;
  if (capturing()) {
    // Recorded as a copy from pinned staging that every replay repeats: the data is the one given
    // now (a constant of the graph); a copy from pageable memory could not be recorded at all.
    if (!staging_ || staging_used_ + slot > staging_size_)
      throw std::runtime_error("[upload] the recorded call uploads more than its warm-up call did (" +
                               std::to_string(staging_used_ + slot) + " > " + std::to_string(staging_size_) +
                               " bytes): fn must do the same work on both calls");
    char* s = staging_ + staging_used_;
    staging_used_ += slot;
    std::memcpy(s, src, dst.nbytes());
    check(cudaMemcpyAsync(dst.data(), s, dst.nbytes(), cudaMemcpyHostToDevice, stream_), "upload");
    return;
  }
  if (probing_) probe_bytes_ += slot;
  // Stream-ordered after the queued work; a pageable source is staged before this returns, so
  // the caller may free it at once.
  check(cudaMemcpyAsync(dst.data(), src, dst.nbytes(), cudaMemcpyHostToDevice, stream_), "upload");
}

void CudaBackend::download(const Tensor& src, void* dst) {
  if (capturing())
    throw std::runtime_error("[download] cannot read cuda memory on the host inside a graph capture "
                             "(the recorded work has not run): read outputs after replay()");
  if (src.nbytes() == 0) return;
  check(cudaMemcpyAsync(dst, src.data(), src.nbytes(), cudaMemcpyDeviceToHost, stream_), "download");
  check(cudaStreamSynchronize(stream_), "download");
}

std::vector<int32_t> CudaBackend::read_i32(const void* p, int64_t n, const char* op) {
  if (capturing())
    throw std::runtime_error(std::string("[") + op + "] reads device data on the host, which a graph capture cannot record");
  std::vector<int32_t> h(size_t(n > 0 ? n : 0));
  if (n <= 0) return h;
  check(cudaMemcpyAsync(h.data(), p, size_t(n) * 4, cudaMemcpyDeviceToHost, stream_), op);
  check(cudaStreamSynchronize(stream_), op);
  return h;
}

// Not while recording: the timer waits for its event, which a capture cannot do.
CudaBackend::OpTimer::OpTimer(CudaBackend* d)
    : dev_(d), on_(d->profiling() && d->timer_depth_ == 0 && !d->capturing()) {
  if (on_) {
    if (!dev_->prof_start_) {
      check(cudaEventCreate(&dev_->prof_start_), "profile");
      check(cudaEventCreate(&dev_->prof_end_), "profile");
    }
    check(cudaEventRecord(dev_->prof_start_, dev_->stream_), "profile");
  }
  ++dev_->timer_depth_;  // last: a constructor that throws runs no destructor
}

CudaBackend::OpTimer::~OpTimer() {
  --dev_->timer_depth_;
  if (!on_) return;
  // A destructor must not throw: a failure here leaves the op's time out of the record; the
  // error itself resurfaces at the next synchronisation.
  float ms = 0.f;
  if (cudaEventRecord(dev_->prof_end_, dev_->stream_) == cudaSuccess &&
      cudaEventSynchronize(dev_->prof_end_) == cudaSuccess &&
      cudaEventElapsedTime(&ms, dev_->prof_start_, dev_->prof_end_) == cudaSuccess)
    dev_->add_device_ms(double(ms));
}

// ---- submission: ops are queued as they are called; a commit records one event.

void CudaBackend::on_commit(uint64_t seq) {
  check(cudaGetLastError(), "commit");
  cudaEvent_t ev;
  if (!spare_events_.empty()) {
    ev = spare_events_.back();
    spare_events_.pop_back();
  } else {
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "commit");
  }
  check(cudaEventRecord(ev, stream_), "commit");
  inflight_.emplace_back(seq, ev);
}

uint64_t CudaBackend::query_completed() {
  // No event queries while recording (thread-local capture forbids them); the answer is only
  // conservative. Steps complete in stream order: pop finished events from the front.
  if (capturing()) return completed_;
  while (!inflight_.empty()) {
    cudaError_t e = cudaEventQuery(inflight_.front().second);
    if (e == cudaErrorNotReady) break;
    check(e, "step");
    completed_ = inflight_.front().first;
    spare_events_.push_back(inflight_.front().second);
    inflight_.pop_front();
  }
  if (inflight_.empty()) completed_ = last_committed();
  run_deferred();
  return completed_;
}

void CudaBackend::defer(uint64_t seq, std::function<void()> f) {
  deferred_.emplace_back(seq, std::move(f));
  if (!capturing()) query_completed();
}

void CudaBackend::run_deferred() {
  if (capturing() || deferred_.empty()) return;
  std::vector<std::function<void()>> due;
  for (size_t i = 0; i < deferred_.size();) {
    if (deferred_[i].first <= completed_) {
      due.push_back(std::move(deferred_[i].second));
      deferred_.erase(deferred_.begin() + long(i));
    } else {
      ++i;
    }
  }
  for (auto& f : due) f();  // after the scan: f may free memory whose release lands here again
}

void CudaBackend::on_wait(uint64_t seq) {
  for (auto& [s, ev] : inflight_) {
    if (s >= seq) {
      check(cudaEventSynchronize(ev), "wait");
      break;
    }
  }
  query_completed();
}

}  // namespace krnl::cuda
