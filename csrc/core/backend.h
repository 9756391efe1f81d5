// The backend contract (docs/architecture.md, 'The op contract'). The core validates every op call once (ops.cpp)
// and then calls one of these virtuals with checked, contiguous tensors on this device.
// A backend overrides what it implements; the rest throw "[op] not implemented on <device>".
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "buffer_pool.h"
#include "op_list.h"
#include "split_k.h"
#include "tensor.h"

namespace krnl {

// Thrown for an op a backend does not have; Python sees NotImplementedError.
struct NotImplementedError : std::logic_error {
  using std::logic_error::logic_error;
};

// gemm: C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b] for b < batch; matrices at element
// offsets b*stride_*; stride 0 broadcasts one matrix. Accumulation is fp32. The only strided
// views any op accepts are 2-D row-strided GEMM operands (unit column stride, row stride ld).
struct GemmArgs {
  Tensor A, B, C;
  bool trans_a = false, trans_b = false;
  float alpha = 1.f, beta = 0.f;
  int64_t M = 0, N = 0, K = 0;  // C is (M, N); op(A) is (M, K); op(B) is (K, N)
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // elements
  // Row strides of the stored matrices (elements): their column counts for contiguous operands,
  // larger for a 2-D column-block view (e.g. the q part of a fused (T, q|k|v) projection).
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t split_k = 1;  // resolved by the router: 1 = plain, s > 1 = s K-slices + reduce
};

struct AdamWArgs {
  Tensor params, grads, m, v;  // f32, same length
  Tensor working;              // optional f16/bf16/f32 copy of params refreshed after the update
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.f;
  int64_t step = 1;         // 1-based, for bias correction
  float grad_scale = 1.f;   // folded into the gradient read: clip scale / loss scale
  // Device-resident per-step scalars (a replayed graph's scalars are frozen). With hyper, lr,
  // weight_decay, step and grad_scale are ignored: hyper (5,) f32 = [step_size = lr / (1 - b1^t),
  // bc2_sqrt = sqrt(1 - b2^t), decay = lr * weight_decay, inv_denom = 1 / (loss_scale * n_micro),
  // max_norm (0: no clipping)]; sq (1,) f32 the sum of squares of the grads as accumulated;
  // grad_scale = clip * inv_denom with clip from norm = sqrt(sq) * inv_denom. Nothing is written
  // when sq[0] is not finite or flag (1,) i32, where given, is nonzero.
  Tensor hyper, sq, flag;
  // false: torch.optim.Adam's L2 instead of decoupled decay, g = grads * grad_scale + weight_decay * p
  // (with hyper, its decay entry is then weight_decay itself, not lr * weight_decay).
  bool decoupled = true;
};

// sgd_update (torch.optim.SGD): g = grads * grad_scale + weight_decay * p; with momentum, buf =
// keep * buf + in * g (keep = momentum and in = 1 - dampening, or 0 and 1 on the first step: buf
// starts as g), g = nesterov ? g + momentum * buf : buf; p -= lr * g. Without momentum buf is
// unused (may be undefined). hyper (5,) f32 = [lr, keep, in, inv_denom, max_norm] replaces lr,
// step and grad_scale as adamw_update's does (the same clipping and skip).
struct SgdUpdateArgs {
  Tensor params, grads, buf, working;
  float lr = 1e-3f, momentum = 0.f, dampening = 0.f, weight_decay = 0.f;
  bool nesterov = false;
  int64_t step = 1;  // 1-based; step 1 starts buf as g
  float grad_scale = 1.f;
  Tensor hyper, sq, flag;
};

// lion_update (Chen et al. 2023, lion-pytorch): g = grads * grad_scale; p -= decay * p;
// p -= lr * sign(beta1 m + (1 - beta1) g); m = beta2 m + (1 - beta2) g. decay = lr * weight_decay.
// hyper (5,) f32 = [lr, decay, unused, inv_denom, max_norm] as adamw_update's.
struct LionUpdateArgs {
  Tensor params, grads, m, working;
  float lr = 1e-4f, beta1 = 0.9f, beta2 = 0.99f, weight_decay = 0.f;
  float grad_scale = 1.f;
  Tensor hyper, sq, flag;
};

// adafactor_update (torch.optim.Adafactor) over one parameter of >= 2 dims, (B..., R, C) with its
// second moment factored over the last two: row (B, R) and col (B, C), f32. g = grads * grad_scale;
// alpha = max(eps2, rms(params)) * rho; params *= 1 - decay; row = lerp(row, mean_C(g^2), beta2t),
// col = lerp(col, mean_R(g^2), beta2t); v = row col / max(mean_R(row), eps1) per batch entry;
// u = g / sqrt(max(v, eps1^2)); params -= alpha / max(1, rms(u) / d) u. hyper (5,) f32 = [rho,
// beta2t, decay, inv_denom, max_norm] replaces rho, beta2t, decay and grad_scale as adamw_update's.
struct AdafactorUpdateArgs {
  Tensor params, grads, row, col, working;
  float rho = 1e-2f, beta2t = 1.f, decay = 0.f, eps1 = 1.1920929e-07f, eps2 = 1e-3f, d = 1.f;
  float grad_scale = 1.f;
  Tensor hyper, sq, flag;
};

// adamw8bit_update (bitsandbytes' 8-bit blockwise AdamW) over one parameter of n elements: m and v
// held as one 8-bit code per element (m_codes, v_codes: (ceil(n / 4),) i32, element i in byte
// i % 4 of word i / 4, little-endian) and an f32 absmax per block of 256 (m_absmax, v_absmax:
// (ceil(n / 256),)); m = m_map[code] * absmax (m_map, v_map (256,) f32, sorted: bitsandbytes'
// signed and unsigned dynamic maps). Per block: dequantize, bitsandbytes' AdamW step (params *=
// 1 - decay; m, v; params -= step_size m / (sqrt(v) / bc2_sqrt + eps)), then requantize as
// bitsandbytes defines it (its pure-PyTorch quantize_blockwise): absmax = max |x| over the block;
// code = the number of the map's midpoints below x / absmax clamped to [-1, 1], its nearest entry
// (a partial last block divides and stores absmax floored at 1e-38, a full one multiplies by the
// reciprocal). hyper as adamw_update's.
struct AdamW8bitArgs {
  Tensor params, grads, m_codes, v_codes, m_absmax, v_absmax, m_map, v_map, working;
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.f;
  // 1 - beta1 and 1 - beta2 as the caller forms them: bitsandbytes rounds them once from its
  // double betas (0.1f for 0.9), which 1.f - 0.9f is not; <= 0: formed from the f32 betas.
  float beta1_complement = 0.f, beta2_complement = 0.f;
  int64_t step = 1;
  float grad_scale = 1.f;
  Tensor hyper, sq, flag;
};

// Muon (torch.optim.Muon) around its Newton-Schulz iteration, which callers run with gemm.
// muon_momentum: g = grads * grad_scale; buf = lerp(buf, g, 1 - momentum); u = nesterov ?
// lerp(g, buf, momentum) : buf; out = u / max(||u||_F, eps) (the iteration's start). muon_update:
// params = params * (1 - decay) - lr * scale * update. hyper (5,) f32 replaces grad_scale
// (muon_momentum: [-, -, -, inv_denom, max_norm]) or lr and decay (muon_update: [lr, -, decay, -, -]),
// and both skip (write nothing) on a non-finite step as adamw_update does.
struct MuonMomentumArgs {
  Tensor grads, buf, out;
  float momentum = 0.95f, eps = 1e-7f;
  bool nesterov = true;
  float grad_scale = 1.f;
  Tensor hyper, sq, flag;
};

struct MuonUpdateArgs {
  Tensor params, update, working;
  float lr = 1e-3f, decay = 0.f, scale = 1.f;
  Tensor hyper, sq, flag;
};

// A step recorded once and replayed whole (CUDA graphs: csrc/cuda/cuda_graph.cpp). It owns every
// storage the recorded work touches: recorded device addresses stay valid and unshared while it
// exists.
class Graph {
 public:
  virtual ~Graph() = default;
  // Queues the recorded work once, inside the open step or as its own step; returns that step's
  // seq, or 0 when it joined an open one.
  virtual uint64_t replay() = 0;
  // Hands the recorded work and its storages back (the pool reuses them only after the replays
  // queued so far complete). replay() throws afterwards.
  virtual void release() = 0;
  virtual bool released() const = 0;
};

// What a backend can do, answered by the backend itself: the model, the
// trainer, the CLI, krnl bench and the tests read it instead of deriving policy from a name.
struct Capabilities {
  std::string kind;                  // "cpu", "cuda", "metal", or a test device's kind ("metal-sim")
  std::vector<DType> dtypes;         // float compute dtypes whose kernels run here
  DType compute_dtype = DType::f32;  // the training default
  std::vector<DType> fused_attention_dtypes;  // where attention_forward/backward beat the materialised path
  bool fused_attention_segments = false;      // ... also with packed segments
  bool fused_attention_window = false;        // ... also with a sliding window
  bool fused_attention_sinks = false;         // ... also with attention sinks (gpt-oss)
  std::vector<int64_t> fused_attention_head_dims;  // ... for these head sizes D (empty: any)
  bool fused_attention_token_major = false;   // ... on token-major (B, T, H, D) views, and rope over them
  // Bytes attention_backward's workspace takes from the pool per (B, H, T, D) element of q and per
  // (B, H, T) row, for the memory plan (python/krnl/train/memory.py); 0 where it takes none.
  int64_t fused_attention_workspace_element = 0, fused_attention_workspace_row = 0;
  bool graphs = false;         // capture() records a step that replays whole
  bool host_visible = true;    // tensors' memory is readable by the CPU (zero-copy numpy views)
  bool synchronous = true;     // ops complete when they return
  bool queue_ordered = true;   // every memory access runs in call order (reuse within a step)
  int64_t attention_block = 0; // query rows per block of the materialised attention (0: all at once)
  // Timing the device's GEMM variants (krnl tune) measures something real: only a physical GPU
  // with more than one variant (Metal); never a simulator.
  bool gemm_tuning = false;
  // Libraries that sum tensors across processes on this device's own queue, without a host copy
  // ("nccl" on CUDA): data-parallel training takes them where every rank has one (krnl.train.dist.nccl).
  // Whether the library itself loads on this machine is the loader's answer, not this one's.
  std::vector<std::string> collectives;
  // Fold each LoRA's second product into its frozen GEMM's K (python/krnl/models/lora_fold.py): one pass
  // over the output instead of two, where passes over memory are what a GEMM this size costs.
  bool lora_fold = false;
  // Facts about the hardware behind the device (GPU name, GPU family, ...), for people.
  std::vector<std::pair<std::string, std::string>> details;
};

class Backend {
 public:
  explicit Backend(std::string name);
  virtual ~Backend();
  const std::string& name() const { return name_; }
  virtual bool host_visible() const { return true; }
  virtual bool synchronous() const { return true; }  // ops complete when they return (CPU)
  // Every access to this device's memory (ops, uploads, downloads) runs in call order on one
  // queue, or at once: a buffer released inside a step may then serve later ops of the same step.
  virtual bool queue_ordered() const { return synchronous(); }
  // attention_forward/backward take token-major (B, T, H, D) views (columns of the projections,
  // no head transposes) and rope turns them in place (op_list.h).
  virtual bool token_major_attention() const { return false; }

  // Fields a backend leaves alone come from the virtuals above (host_visible, synchronous,
  // queue_ordered); backends override this to add the rest.
  virtual Capabilities capabilities() const;

  // ---- memory
  // Past the pool's limit this may wait for committed work (whose released buffers then return):
  // callers must not hold a lock the device's completion needs (bindings: the GIL).
  Tensor empty(const Shape& shape, DType dt);
  // While on, empty() takes buffers of their own size (BufferPool::acquire's exact) outside a
  // recording: a model's build, whose buffers live for the run. Returns the previous setting.
  bool set_exact_sizes(bool on) { return std::exchange(exact_sizes_, on); }
  // Wraps memory owned elsewhere (e.g. a numpy array): zero-copy on host-visible devices.
  Tensor wrap(void* ptr, const Shape& shape, DType dt, std::function<void()> release);
  void release_buffer(const Buffer& b);  // called by Storage
  BufferPool& pool() { return *pool_; }
  // The pool's ceiling, 0 for none: Device.set_memory_limit's value (0 lifts it), else
  // KRNL_MAX_MEMORY's (read when the device is made), else the device's own default
  // (set_default_memory_limit: Metal's recommended working set; none elsewhere).
  void set_memory_limit(size_t bytes);
  virtual void upload(const Tensor& dst, const void* src);   // dst is contiguous
  virtual void download(const Tensor& src, void* dst);

  // ---- submission
  void begin_step();
  uint64_t commit();
  void wait(uint64_t seq);
  void synchronize() { wait(last_committed_); }
  uint64_t completed_seq();
  bool in_step() const { return in_step_; }
  uint64_t last_committed() const { return last_committed_; }

  // ---- graph capture. fn(false) runs first as one ordinary step (warm-up), fn(true) is then
  // recorded into the returned Graph. Backends without graphs throw NotImplementedError.
  virtual std::unique_ptr<Graph> capture(const std::function<void(bool recording)>& fn);
  bool capturing() const { return capture_keep_ != nullptr; }
  // While capturing: the graph will own s (called for every op operand and every new buffer).
  // Buffers made in this recording need no keeping: the arena owns them (backend.h, GraphArena).
  void keep_for_capture(const std::shared_ptr<Storage>& s) {
    if (capture_keep_ && !arena_.recording.count(s->id())) capture_keep_->insert(s);
  }
  // Live graphs: the arena lives while one does (a backend's Graph calls these).
  void graph_created() { ++arena_.graphs; }
  void graph_released();
  size_t arena_bytes() const { return arena_.bytes; }

  // ---- routing parameters (pure data for the core's routers)
  virtual SplitKConfig split_k_config() const { return {}; }

  // ---- the sample reduce order (krnl.models.sample_sums sets it for its training calls): the rows of
  // one sample, 0 when off. While set, the CPU backend computes each GEMM's output in blocks of
  // that many rows with calls whose shapes do not depend on M or the thread count (gemm.cpp), so
  // that a sample's rows get the same bits whichever process holds it; other backends ignore it.
  void set_gemm_row_block(int64_t rows) { gemm_row_block_ = rows > 0 ? rows : 0; }
  int64_t gemm_row_block() const { return gemm_row_block_; }

  // ---- ops (validated by the core before they get here): one virtual per entry of op_list.h.
#define KRNL_BACKEND_OP(name, params) virtual void name params;
  KRNL_OPS(KRNL_BACKEND_OP)
#undef KRNL_BACKEND_OP
// A backend declares its overrides from the list as well (KRNL_OPS(KRNL_OVERRIDE_OP) in its
// class): `override` keeps the compiler checking each signature against the virtual above.
#define KRNL_OVERRIDE_OP(name, params) void name params override;

  // ---- profiling: one record per op while enabled
  struct OpRecord {
    std::string op, shape, dtype;
    double ms = 0;
    double flops = 0, bytes = 0;
  };
  void set_profiling(bool on) { profiling_ = on; }
  bool profiling() const { return profiling_; }
  void add_record(OpRecord r) { records_.push_back(std::move(r)); }
  // What an op record's ms measures. The core times each op call on the host (ops.cpp run()):
  // on a synchronous backend (CPU) that is the op. An asynchronous backend's call only encodes,
  // so one that can time its own execution returns true here and, while profiling, reports the
  // execution time of each op's work with add_device_ms (Metal: its dispatches run one command
  // buffer each, waited, GPUEndTime - GPUStartTime); run() then records that sum instead of the
  // host time, never both, so nothing is counted twice. Backends returning false (CPU, metal-sim)
  // keep the host time.
  virtual bool profiles_device_time() const { return false; }
  void add_device_ms(double ms) { device_ms_ += ms; }
  double take_device_ms() {
    const double ms = device_ms_;
    device_ms_ = 0;
    return ms;
  }
  const std::vector<OpRecord>& records() const { return records_; }
  void clear_records() { records_.clear(); }

 protected:
  [[noreturn]] void not_implemented(const char* op) const;
  // The device's own ceiling and where it comes from; ignored once KRNL_MAX_MEMORY or
  // set_memory_limit has set one.
  void set_default_memory_limit(size_t bytes, const std::string& origin);
  virtual void* raw_alloc(size_t bytes) = 0;
  virtual void raw_free(void* p, size_t bytes) = 0;
  // Submission hooks: a synchronous backend needs none of them.
  virtual void on_begin_step() {}
  virtual void on_commit(uint64_t /*seq*/) {}
  virtual void on_wait(uint64_t /*seq*/) {}
  virtual uint64_t query_completed() { return last_committed_; }
  // A backend's capture() brackets its recording with these: keep_for_capture collects storages
  // in `keep` meanwhile.
  void begin_recording(std::unordered_set<std::shared_ptr<Storage>>* keep) {
    capture_keep_ = keep;
    arena_.recording.clear();
  }
  void end_recording() {
    capture_keep_ = nullptr;
    arena_.recording.clear();
  }
  // Gives the arena's free buffers back to the pool when no graph is left (after a failed capture).
  void settle_arena();

  // The graph arena: every buffer made while recording comes from here. A graph replays on the
  // device's one queue after everything queued before it, and reads none of its temporaries
  // before writing them, so a buffer released while recording (a temporary of this graph) or
  // after (an output nobody holds any more) may serve a later tensor of this recording or of
  // another graph: graphs of different shapes then share one set of temporaries (the largest
  // recording's working set, not the sum of all) instead of each keeping everything it ever
  // allocated. A graph's outputs stay valid until another graph replays.
  struct GraphArena {
    std::multimap<size_t, Buffer> free;  // class size -> released buffers
    std::unordered_set<uint64_t> owned;  // ids of every buffer the arena holds (free or in a tensor)
    std::unordered_set<uint64_t> recording;  // ids handed out in the open recording
    size_t bytes = 0;                    // held from the pool
    int graphs = 0;
  };

 private:
  std::string name_;
  std::unique_ptr<BufferPool> pool_;
  bool limit_chosen_ = false;  // by KRNL_MAX_MEMORY or set_memory_limit: defaults leave it alone
  GraphArena arena_;
  std::unordered_set<std::shared_ptr<Storage>>* capture_keep_ = nullptr;
  bool in_step_ = false;
  bool exact_sizes_ = false;
  uint64_t last_committed_ = 0;
  int64_t gemm_row_block_ = 0;
  bool profiling_ = false;
  double device_ms_ = 0;
  std::vector<OpRecord> records_;
};

// Registry of the devices this build can create, by name ("cpu", ...), in order of preference
// (best first). Each backend folder registers itself; devices are created on first use and
// live until exit.
void register_device(const std::string& name, int priority, Backend* (*make)());
// A device this build has but this machine cannot run, with a one-line reason ("metal: the GPU
// lacks Apple7 features"): `krnl devices` prints it; the device stays out of available_devices().
void register_unavailable(const std::string& name, const std::string& reason);
std::vector<std::pair<std::string, std::string>> unavailable_devices();
std::vector<std::string> available_devices();
Backend* get_device(const std::string& name);

}  // namespace krnl
