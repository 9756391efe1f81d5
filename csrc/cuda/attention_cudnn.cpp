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

// An attention operand as cuDNN's (B, H, T, D) with strides: a head-major (H, T, D) tensor is one
// sequence; a token-major (B, T, H, D) view keeps its own strides (no transposes).
struct Dims {
  int64_t B, H, T, D, sb, sh, st;
};

Dims dims_of(const Tensor& x) {
  if (x.dim() == 3) return {1, x.size(0), x.size(1), x.size(2), x.numel(), x.size(1) * x.size(2), x.size(2)};
  const Shape& s = x.strides();
  return {x.size(0), x.size(2), x.size(1), x.size(3), s[0], s[2], s[1]};
}

fe::graph::Tensor_attributes& place(fe::graph::Tensor_attributes& t, int64_t uid, const Dims& d) {
  return t.set_uid(uid).set_dim({d.B, d.H, d.T, d.D}).set_stride({d.sb, d.sh, d.st, 1});
}

// The (B, H, T) log-sum-exp, contiguous, as a (B, H, T, 1) tensor.
fe::graph::Tensor_attributes& place_stats(fe::graph::Tensor_attributes& t, const Dims& q) {
  return t.set_uid(kStats).set_dim({q.B, q.H, q.T, 1}).set_stride({q.H * q.T, q.T, 1, 1}).set_data_type(
      fe::DataType_t::FLOAT);
}

fe::graph::Tensor_attributes input(const char* name, int64_t uid, const Dims& d) {
  fe::graph::Tensor_attributes t;
  place(t.set_name(name), uid, d);
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
  // direction, dtype, scale, window, then each operand's dims and strides
  using Key = std::tuple<bool, int, float, int64_t, std::vector<int64_t>>;
  std::map<Key, Plan> plans;

  ~CudnnState() {
    if (handle) fe::detail::destroy_handle(handle);
  }

  // ops: q, k, v, o (forward) and dout, dq, dk, dv (backward) as cuDNN sees them.
  // window > 0: key j visible to query i only where i - j < window (cuDNN's left bound: j + window > i).
  const Plan& plan(bool backward, DType dt, const std::vector<Dims>& ops, float scale, int64_t window,
                   const char* op) {
    std::vector<int64_t> shape;
    for (const Dims& d : ops) shape.insert(shape.end(), {d.B, d.H, d.T, d.D, d.sb, d.sh, d.st});
    const Key key{backward, int(dt), scale, window, shape};
    if (auto it = plans.find(key); it != plans.end()) return it->second;
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe_dtype(dt))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto q = g->tensor(input("q", kQ, ops[0]));
    auto k = g->tensor(input("k", kK, ops[1]));
    auto v = g->tensor(input("v", kV, ops[2]));
    if (!backward) {
      auto opts = fe::graph::SDPA_attributes().set_name("attention_forward").set_generate_stats(true).set_attn_scale(
          scale);
      opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
      if (window > 0) opts.set_diagonal_band_left_bound(int(window));
      auto [o, lse] = g->sdpa(q, k, v, opts);
      place(o->set_output(true), kO, ops[3]);
      place_stats(lse->set_output(true), ops[0]);
    } else {
      auto o = g->tensor(input("o", kO, ops[3]));
      auto dO = g->tensor(input("dout", kDO, ops[4]));
      fe::graph::Tensor_attributes stats;
      auto lse = g->tensor(place_stats(stats.set_name("lse"), ops[0]));
      auto opts = fe::graph::SDPA_backward_attributes().set_name("attention_backward").set_attn_scale(scale);
      opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
      if (window > 0) opts.set_diagonal_band_left_bound(int(window));
      auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dO, lse, opts);
      place(dq->set_output(true), kDQ, ops[5]);
      place(dk->set_output(true), kDK, ops[6]);
      place(dv->set_output(true), kDV, ops[7]);
    }
    auto err = g->build(handle, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
    if (!err.is_good())
      throw std::runtime_error(std::string("[") + op + "] cuDNN has no attention engine for q (B, H, T, D) = (" +
                               std::to_string(ops[0].B) + ", " + std::to_string(ops[0].H) + ", " +
                               std::to_string(ops[0].T) + ", " + std::to_string(ops[0].D) + "), " +
                               std::to_string(ops[1].H) + " KV heads, " + dtype_name(dt) + ": " + err.get_message());
    Plan p{g, 0};
    if (!g->get_workspace_size(p.workspace).is_good())
      throw std::runtime_error(std::string("[") + op + "] cuDNN: cannot size the workspace");
    return plans.emplace(key, std::move(p)).first->second;
  }
};

bool CudaBackend::token_major_attention() const { return cudnn_loaded(); }

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
void check_fused(DType dt, const Tensor* segments, int64_t window, const char* op, const Tensor* sinks = nullptr) {
  if (!fused_dtype(dt))
    throw NotImplementedError(std::string("[") + op + "] cuDNN's fused attention takes bf16 or f16 on cuda, got " +
                              dtype_name(dt) + " (f32 takes the materialised path)");
  // Packed rows would be cuDNN's ragged layout over token-major rows; the head-major operands here
  // are not, so the model keeps those rows materialised (capabilities: segments false).
  if (segments)
    throw NotImplementedError(std::string("[") + op + "] packed segments are not implemented in cuda's fused "
                              "attention (they take the materialised path)");
  // cuDNN's SDPA takes no extra softmax column (capabilities: sinks false); softmax_causal_forward does.
  if (sinks)
    throw NotImplementedError(std::string("[") + op + "] attention sinks are not implemented in cuda's fused "
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
                                    const Tensor& lse, float scale, const Tensor* segments, int64_t window,
                                    const Tensor* sinks) {
  check_fused(q.dtype(), segments, window, "attention_forward", sinks);
  if (q.numel() == 0) return;
  if (window >= q.size(1)) window = 0;  // a window as long as the row masks nothing: one plan (T: axis 1 both ways)
  CudnnState& s = cudnn("attention_forward");
  const auto& p =
      s.plan(false, q.dtype(), {dims_of(q), dims_of(k), dims_of(v), dims_of(o)}, scale, window, "attention_forward");
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
  if (q.size(1) == 1) {  // one token: cuDNN's backward refuses T = 1 (attention.cu)
    OpTimer timer(this);
    return attention_backward_one_token(dout, dq, dk, dv);
  }
  CudnnState& s = cudnn("attention_backward");
  const auto& p = s.plan(true, q.dtype(),
                         {dims_of(q), dims_of(k), dims_of(v), dims_of(o), dims_of(dout), dims_of(dq), dims_of(dk),
                          dims_of(dv)},
                         scale, window, "attention_backward");
  OpTimer timer(this);
  Tensor ws = p.workspace ? scratch((p.workspace + 3) / 4) : Tensor();
  std::unordered_map<int64_t, void*> pack{{kQ, q.data()},   {kK, k.data()},      {kV, v.data()},
                                          {kO, o.data()},   {kDO, dout.data()},  {kStats, lse.data()},
                                          {kDQ, dq.data()}, {kDK, dk.data()},    {kDV, dv.data()}};
  execute(*p.graph, s.handle, pack, ws.defined() ? ws.data() : nullptr, "attention_backward");
}

}  // namespace krnl::cuda
