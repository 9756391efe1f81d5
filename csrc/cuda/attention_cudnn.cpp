// Fused causal attention on CUDA through cuDNN's SDPA graphs (flash attention: the scores stay
// on chip; backward recomputes them from q, k and the saved log-sum-exp). Built when CMake finds
// cudnn.h and the header-only cuDNN frontend (KRNL_HAS_CUDNN); libcudnn itself is opened at run
// time like cuBLAS, so a machine without it still has the "cuda" device, on the materialised path.
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <cudnn_frontend.h>

#include "cuda_backend.h"

// The frontend's dynamic-loading mode resolves every cuDNN call with dlsym on this handle (its
// contract: the program defines it and opens the library).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}

namespace krnl::cuda {
namespace fe = cudnn_frontend;

namespace {

std::string g_cudnn_error;

// NVRTC first: cuDNN's attention engines are compiled at run time and cuDNN opens libnvrtc by
// soname, which a library loaded here by path then satisfies (also when RTLD_LOCAL).
void preload_nvrtc() {
  std::vector<std::string> names;
  if (const char* p = std::getenv("KRNL_NVRTC"); p && *p) names.push_back(p);
  for (const char* n : {"libnvrtc.so.13", "libnvrtc.so.12", "/usr/local/cuda/lib64/libnvrtc.so.13",
                        "/usr/local/cuda/lib64/libnvrtc.so.12"})
    names.push_back(n);
  for (const auto& n : names)
    if (dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL)) return;
}

// KRNL_CUDNN (a path; krnl's Python package sets it to an installed nvidia-cudnn wheel's library)
// first, then the soname on the loader's path. cuDNN 9 or newer: the SDPA graphs with GQA.
bool load_cudnn() {
  if (const char* e = std::getenv("KRNL_DISABLE_CUDNN"); e && *e == '1') {
    g_cudnn_error = "KRNL_DISABLE_CUDNN=1";
    return false;
  }
  std::vector<std::string> names;
  if (const char* p = std::getenv("KRNL_CUDNN"); p && *p) names.push_back(p);
  names.push_back("libcudnn.so.9");
  for (const auto& n : names)
    if ((fe::cudnn_dlhandle = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
  if (!fe::cudnn_dlhandle) {
    const char* e = dlerror();
    g_cudnn_error = std::string("cannot open libcudnn (tried KRNL_CUDNN, libcudnn.so.9): ") + (e ? e : "");
    return false;
  }
  preload_nvrtc();
  try {
    const size_t v = fe::detail::get_backend_version();
    if (v < 90000) {
      g_cudnn_error = "cuDNN " + std::to_string(v) + " is older than 9.0";
      return false;
    }
  } catch (const std::exception& ex) {
    g_cudnn_error = ex.what();
    return false;
  }
  return true;
}

bool cudnn_loaded() {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] { ok = load_cudnn(); });
  return ok;
}

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// The dtypes cuDNN's flash attention takes (f32 keeps the materialised path).
bool fused_dtype(DType dt) { return dt == DType::bf16 || dt == DType::f16; }

fe::DataType_t fe_dtype(DType dt) { return dt == DType::bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF; }

// (1, H, T, D) over a contiguous (H, T, D) tensor; D = 1 for the (H, T) log-sum-exp.
fe::graph::Tensor_attributes& place(fe::graph::Tensor_attributes& t, int64_t uid, int64_t H, int64_t T, int64_t D) {
  return t.set_uid(uid).set_dim({1, H, T, D}).set_stride({H * T * D, T * D, D, 1});
}

fe::graph::Tensor_attributes input(const char* name, int64_t uid, int64_t H, int64_t T, int64_t D) {
  fe::graph::Tensor_attributes t;
  place(t.set_name(name), uid, H, T, D);
  return t;
}

}  // namespace

// The handle and one built graph per (direction, dtype, shape, scale): building picks and
// compiles an engine (tens of milliseconds), executing only launches it.
struct CudaBackend::CudnnState {
  cudnnHandle_t handle = nullptr;
  struct Plan {
    std::shared_ptr<fe::graph::Graph> graph;
    int64_t workspace = 0;
  };
  using Key = std::tuple<bool, int, int64_t, int64_t, int64_t, int64_t, float, int64_t>;
  std::map<Key, Plan> plans;

  ~CudnnState() {
    if (handle) fe::detail::destroy_handle(handle);
  }

  // window > 0: key j visible to query i only where i - j < window (cuDNN's left bound: j + window > i).
  const Plan& plan(bool backward, DType dt, int64_t Hq, int64_t Hk, int64_t T, int64_t D, float scale,
                   int64_t window, const char* op) {
    const Key key{backward, int(dt), Hq, Hk, T, D, scale, window};
    if (auto it = plans.find(key); it != plans.end()) return it->second;
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe_dtype(dt))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto q = g->tensor(input("q", kQ, Hq, T, D));
    auto k = g->tensor(input("k", kK, Hk, T, D));
    auto v = g->tensor(input("v", kV, Hk, T, D));
    if (!backward) {
      auto opts = fe::graph::SDPA_attributes().set_name("attention_forward").set_generate_stats(true).set_attn_scale(
          scale);
      opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
      if (window > 0) opts.set_diagonal_band_left_bound(int(window));
      auto [o, lse] = g->sdpa(q, k, v, opts);
      place(o->set_output(true), kO, Hq, T, D);
      place(lse->set_output(true).set_data_type(fe::DataType_t::FLOAT), kStats, Hq, T, 1);
    } else {
      auto o = g->tensor(input("o", kO, Hq, T, D));
      auto dO = g->tensor(input("dout", kDO, Hq, T, D));
      auto lse = g->tensor(input("lse", kStats, Hq, T, 1).set_data_type(fe::DataType_t::FLOAT));
      auto opts = fe::graph::SDPA_backward_attributes().set_name("attention_backward").set_attn_scale(scale);
      opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
      if (window > 0) opts.set_diagonal_band_left_bound(int(window));
      auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dO, lse, opts);
      place(dq->set_output(true), kDQ, Hq, T, D);
      place(dk->set_output(true), kDK, Hk, T, D);
      place(dv->set_output(true), kDV, Hk, T, D);
    }
    auto err = g->build(handle, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
    if (!err.is_good())
      throw std::runtime_error(std::string("[") + op + "] cuDNN has no attention engine for q (" + std::to_string(Hq) +
                               ", " + std::to_string(T) + ", " + std::to_string(D) + "), k/v (" + std::to_string(Hk) +
                               ", ...) " + dtype_name(dt) + ": " + err.get_message());
    Plan p{g, 0};
    if (!g->get_workspace_size(p.workspace).is_good())
      throw std::runtime_error(std::string("[") + op + "] cuDNN: cannot size the workspace");
    return plans.emplace(key, std::move(p)).first->second;
  }
};

std::vector<DType> CudaBackend::fused_attention_dtypes() const {
  std::vector<DType> v;
  if (!cudnn_loaded()) return v;
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    if (fused_dtype(dt)) v.push_back(dt);
  return v;
}

CudaBackend::CudnnState& CudaBackend::cudnn(const char* op) {
  if (!cudnn_loaded()) throw NotImplementedError(std::string("[") + op + "] needs cuDNN on cuda: " + g_cudnn_error);
  if (!cudnn_) {
    auto s = std::make_shared<CudnnState>();
    if (fe::detail::create_handle(&s->handle) != CUDNN_STATUS_SUCCESS)
      throw std::runtime_error(std::string("[") + op + "] cudnnCreate failed");
    cudnn_ = std::move(s);
  }
  if (fe::detail::set_stream(cudnn_->handle, stream_) != CUDNN_STATUS_SUCCESS)
    throw std::runtime_error(std::string("[") + op + "] cudnnSetStream failed");
  return *cudnn_;
}

namespace {
void check_fused(DType dt, const Tensor* segments, int64_t window, const char* op) {
  if (!fused_dtype(dt))
    throw NotImplementedError(std::string("[") + op + "] cuDNN's fused attention takes bf16 or f16 on cuda, got " +
                              dtype_name(dt) + " (f32 takes the materialised path)");
  // Packed rows would be cuDNN's ragged layout over token-major rows; the head-major operands here
  // are not, so the model keeps those rows materialised (capabilities: segments false).
  if (segments)
    throw NotImplementedError(std::string("[") + op + "] packed segments are not implemented in cuda's fused "
                              "attention (they take the materialised path)");
  if (window > int64_t(std::numeric_limits<int>::max()))
    throw std::invalid_argument(std::string("[") + op + "] window " + std::to_string(window) + " exceeds cuDNN's int");
}

void execute(fe::graph::Graph& g, cudnnHandle_t h, std::unordered_map<int64_t, void*>& pack, void* ws,
             const char* op) {
  auto err = g.execute(h, pack, ws);
  if (!err.is_good()) throw std::runtime_error(std::string("[") + op + "] cuDNN: " + err.get_message());
}
}  // namespace

void CudaBackend::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                    const Tensor& lse, float scale, const Tensor* segments, int64_t window) {
  check_fused(q.dtype(), segments, window, "attention_forward");
  if (q.numel() == 0) return;
  if (window >= q.size(1)) window = 0;  // a window as long as the row masks nothing: one plan
  CudnnState& s = cudnn("attention_forward");
  const auto& p =
      s.plan(false, q.dtype(), q.size(0), k.size(0), q.size(1), q.size(2), scale, window, "attention_forward");
  OpTimer timer(this);
  Tensor ws = p.workspace ? scratch((p.workspace + 3) / 4) : Tensor();
  std::unordered_map<int64_t, void*> pack{
      {kQ, q.data()}, {kK, k.data()}, {kV, v.data()}, {kO, o.data()}, {kStats, lse.data()}};
  execute(*p.graph, s.handle, pack, ws.defined() ? ws.data() : nullptr, "attention_forward");
}

void CudaBackend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                     const Tensor& dout, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                     const Tensor& dv, float scale, const Tensor* segments, int64_t window) {
  check_fused(q.dtype(), segments, window, "attention_backward");
  if (q.numel() == 0) return;
  if (window >= q.size(1)) window = 0;
  if (q.size(1) == 1) {
    // One token (cuDNN's backward refuses T = 1): o = v, so dq = dk = 0 and dv[h] sums the dO
    // of its g query heads, a (1, g) x (g, D) product of ones per KV head.
    OpTimer timer(this);
    const int64_t Hk = k.size(0), g = q.size(0) / Hk, D = q.size(2);
    fill(dq, 0.0), fill(dk, 0.0);
    Tensor ones = empty({1, g}, q.dtype());
    fill(ones, 1.0);
    GemmArgs a;
    a.A = ones, a.B = dout.reshape({Hk * g, D}), a.C = dv.reshape({Hk, D});
    a.M = 1, a.N = D, a.K = g, a.batch = Hk;
    a.stride_a = 0, a.stride_b = g * D, a.stride_c = D;
    a.lda = g, a.ldb = D, a.ldc = D;
    gemm(a);
    return;
  }
  CudnnState& s = cudnn("attention_backward");
  const auto& p =
      s.plan(true, q.dtype(), q.size(0), k.size(0), q.size(1), q.size(2), scale, window, "attention_backward");
  OpTimer timer(this);
  Tensor ws = p.workspace ? scratch((p.workspace + 3) / 4) : Tensor();
  std::unordered_map<int64_t, void*> pack{{kQ, q.data()},   {kK, k.data()},      {kV, v.data()},
                                          {kO, o.data()},   {kDO, dout.data()},  {kStats, lse.data()},
                                          {kDQ, dq.data()}, {kDK, dk.data()},    {kDV, dv.data()}};
  execute(*p.graph, s.handle, pack, ws.defined() ? ws.data() : nullptr, "attention_backward");
}

}  // namespace krnl::cuda
