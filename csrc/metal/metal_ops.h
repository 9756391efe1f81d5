// The Metal backend's op logic, portable (docs/architecture.md, 'The Metal backend'): every op of the contract becomes
// Dispatch records (dispatch.h) handed to encode(). Kernel choice, grids, argument structs
// (metal/kargs.h), split-K routing, head batching by buffer offset and the CPU/GPU row split are
// decided here, so they run in CI on the metal-sim device. So is the submission of a step
// (submission.cpp): its cut into command buffers, the ordering of host records and host writes,
// completion and failures. A subclass only executes command buffers: the Objective-C++ layer on
// macOS (device.mm), the simulator's worker thread elsewhere (metal_sim.cpp).
#pragma once
#include <atomic>
#include <deque>
#include <functional>
#include <initializer_list>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/backend.h"
#include "metal/dispatch.h"
#include "metal/policy.h"

namespace krnl::metal {

// The CPU/GPU row split of large GEMMs (KRNL report): off unless enabled; the planner
// (core/split_k.h) sizes the CPU share from the two engines' rates so both finish together.
struct RowSplitConfig {
  bool enabled = false;
  double cpu_gflops = 0;       // measured sgemm rate of the CPU (calibration)
  double gpu_gflops = 0;       // measured GEMM rate of the GPU
  double overhead_ms = 0;      // fixed cost the GPU side pays per split GEMM (commit, wait)
  int64_t min_flops = int64_t(1) << 30;  // smaller GEMMs are not worth a split
};

// The ordering rules of a step on an asynchronous device (submission.cpp). Each can be switched
// off by tests only, to show that the rule is what their test needs; never off otherwise.
struct OrderingRules {
  bool host_after_earlier = true;  // a host record waits for every earlier record but its own GPU half
  bool upload_in_order = true;     // a host write waits for the encoded or running work that uses the buffer
  bool split_steps = true;         // a step is cut into command buffers by the CommandBufferPolicy
};

struct GemmKernel;     // gemm.cpp: one of gemm.metal's plain variants
struct AttentionArgs;  // metal/kargs.h

// One dispatch of an attention kernel over part of its grid (policy.h plan_row_blocks): its
// heads and rows (row blocks of `tile`), counted flops and bytes, and estimate.
enum class AttentionKernel { forward, dq, dkv };
struct AttentionPart {
  GridPart part;
  int64_t tile = 0;
  double flops = 0, bytes = 0, ms = 0;
};
std::vector<AttentionPart> attention_parts(const CommandBufferPolicy& p, AttentionKernel which, int64_t Hq, int64_t Hk,
                                           int64_t T, int64_t D, int64_t window, size_t dtype_bytes);

class MetalOps : public Backend {
 public:
  MetalOps(std::string name, GpuDescription gpu);
  ~MetalOps() override;
  bool host_visible() const override { return true; }  // unified memory: shared-storage buffers
  bool synchronous() const override { return false; }
  // Every access runs in call order, so a buffer released inside a step may serve the step's later
  // ops (docs/architecture.md, 'Memory'): one queue runs the command buffers in commit order, each
  // one's dispatches serially (MTLDispatchTypeSerial, tracked buffers); a host record starts after
  // every earlier record but its own GPU half, and a host write waits for the encoded or running
  // work that binds its buffer (OrderingRules; submission.cpp).
  bool queue_ordered() const override { return true; }
  Capabilities capabilities() const override;
  SplitKConfig split_k_config() const override;
  void set_row_split(const RowSplitConfig& c) { row_split_ = c; }
  const RowSplitConfig& row_split() const { return row_split_; }
  const GpuDescription& gpu() const { return gpu_; }
  void set_command_buffer_policy(const CommandBufferPolicy& p) {
    cb_policy_ = p;
    cutter_ = CommandBufferCutter(p);
  }
  const CommandBufferPolicy& command_buffer_policy() const { return cb_policy_; }
  void set_ordering_rules(const OrderingRules& r) { rules_ = r; }
  // The head sizes D of the fused attention kernels (metal/attention.metal instantiates each).
  static std::vector<int64_t> attention_head_dims();

  // ---- GEMM variants (metal/gemm.metal's header says what each trades). gemm_plain runs, for
  // each call, the variant chosen for its shape class: the class's own entry, else the "*"
  // entry, else tile32. `krnl tune` measures the variants on the user's GPU and fills the table.
  static const std::vector<std::string>& gemm_variants();  // tile32 (the default) first
  // "<operand dtype>[_f32 when C widens].<nn|nt|tn>.<skinny|shallow|medium|large>": skinny
  // min(M, N) <= 64 (LoRA products with the rank as M or N), shallow K <= 64 (the rank as K),
  // else by outputs: large from 2^20 (M N batch), medium below.
  static std::string gemm_shape_class(int64_t M, int64_t N, int64_t K, int64_t batch, bool trans_a, bool trans_b,
                                      DType a, DType c);
  static std::vector<std::string> gemm_shape_classes();  // every class, in a fixed order
  // variant "" removes the entry; std::invalid_argument for an unknown class or variant.
  void set_gemm_choice(const std::string& shape_class, const std::string& variant);
  const std::map<std::string, std::string>& gemm_choices() const { return gemm_choice_; }
  void clear_gemm_choices() { gemm_choice_.clear(); }
  // Records of the last committed step (GPU and host, in call order) and the dispatch counts of
  // its command buffers, kept while enabled (metal-sim's tests of the host logic).
  void keep_step_log(bool on) { keep_log_ = on; }
  const std::vector<Dispatch>& last_step_records() const { return last_log_; }
  const std::vector<size_t>& last_step_command_buffers() const { return last_cbs_; }

  // Host writes in call order: waits for the encoded or running work that
  // binds dst's buffer, then copies.
  void upload(const Tensor& dst, const void* src) override;

  // Every op of op_list.h, one file per family (gemm.cpp, norm.cpp, ...).
  KRNL_OPS(KRNL_OVERRIDE_OP)

  // Waits until every library of metal/ is compiled (compiling those not yet started) and returns
  // each one's compile time in ms; the first that failed is thrown. Only "metal" compiles
  // libraries (device.mm, in the background from device creation): the simulators' kernels are
  // compiled by their Python executors, so NotImplementedError here.
  virtual std::map<std::string, double> compile_libraries();

  // Called by an executor, from any thread, once submission `id` has completed (error: its
  // failure, else null; gpu_ms: its GPU time where measured). Calls after the first are ignored.
  void submission_done(uint64_t id, const std::string* error, double gpu_ms);

 protected:
  // ---- the executor: device.mm (Metal command buffers) or metal-sim (a worker thread)
  // Checks a GPU record when it is encoded (device.mm builds its pipeline here, so that a kernel
  // that does not compile fails the op that asked for it).
  virtual void prepare(const Dispatch& /*d*/) {}
  // Commits one command buffer of GPU records as submission `id` (ids count up from 1). The
  // executor reports its completion with submission_done(id, ...). `timed`: profiling wants its
  // GPU time.
  virtual void submit(uint64_t id, std::vector<Dispatch>&& records, bool timed) = 0;
  // Blocks until submission `id` and every earlier one have completed and been reported.
  virtual void wait_submission(uint64_t id) = 0;

  // The GPU this device stands for, and the policy that follows from it (metal-sim's tests only:
  // a real device keeps the GPU it was made for). Call with no work in flight.
  void set_gpu(const GpuDescription& g) {
    gpu_ = g;
    set_command_buffer_policy(metal::command_buffer_policy(g));
    apply_working_set();
  }

  // Queues one record of the open step (the output of the op files: gemm.cpp, norm.cpp, ...).
  void encode(Dispatch&& d);
  // Every submission up to this id has completed and been reported.
  uint64_t submissions_done() const { return done_upto_.load(std::memory_order_acquire); }

 private:
  void apply_working_set();  // the pool's default ceiling from gpu_ (ops.cpp)

  // ---- submission (submission.cpp)
  void on_begin_step() override;
  void on_commit(uint64_t seq) override;
  void on_wait(uint64_t seq) override;
  uint64_t query_completed() override;
  uint64_t flush(bool timed = false);  // submits the open command buffer; returns its id (0: empty)
  void wait_all();                     // every submission so far
  void run_host(Dispatch& d);
  void raise_failures(uint64_t upto_step);


  void elementwise(const char* op, const std::string& kernel, std::initializer_list<const Tensor*> tensors, int64_t n,
                   float alpha);
  void encode_parts(Dispatch&& d, uint32_t args_index, const AttentionArgs& args, const std::vector<AttentionPart>& parts);
  // Encodes a product over (rows, cols) as one dispatch, or as blocks of whole tiles where one is
  // estimated over the per-dispatch budget (policy.h plan_blocks); block(r0, rows, c0, cols) makes
  // the dispatch of one block. Returns the number of dispatches encoded.
  size_t encode_blocks(int64_t rows, int64_t cols, int64_t tile_rows, int64_t tile_cols,
                       const std::function<Dispatch(int64_t, int64_t, int64_t, int64_t)>& block);
  size_t gemm_plain(const krnl::GemmArgs& a, int64_t row0, int64_t rows);
  Dispatch gemm_block(const krnl::GemmArgs& a, const GemmKernel* kern, int64_t row0, int64_t rows, int64_t col0,
                      int64_t cols);
  void gemm_split_k(const krnl::GemmArgs& a);
  void gemm_row_split(const krnl::GemmArgs& a, int64_t cpu_rows);

  GpuDescription gpu_;
  std::map<std::string, std::string> gemm_choice_;  // shape class (or "*") -> variant
  RowSplitConfig row_split_;
  CommandBufferPolicy cb_policy_;
  OrderingRules rules_;

  // The open step (caller's thread only).
  uint64_t open_step_ = 0;      // its seq once committed
  std::vector<Dispatch> open_;  // GPU records of the open command buffer
  CommandBufferCutter cutter_{cb_policy_};
  uint32_t step_cbs_ = 0;  // command buffers of the open step so far
  uint64_t submitted_ = 0;  // newest submission id
  // Buffer base -> newest step whose records bind it (open or running), for upload ordering.
  std::unordered_map<void*, uint64_t> last_use_;
  bool keep_log_ = false;
  std::vector<Dispatch> log_, last_log_;
  std::vector<size_t> cbs_, last_cbs_;

  // Completion, reported by executor threads.
  struct Pending {
    uint64_t step;
    uint32_t index;          // of the command buffer within its step, from 1
    bool timed;
    std::string first, last;  // ops (kernels) of its first and last records
  };
  struct Failure {
    uint64_t step;
    std::string message;
  };
  std::mutex done_mu_;
  std::map<uint64_t, Pending> pending_;       // submitted, not yet reported
  std::set<uint64_t> done_ahead_;             // reported before an earlier one
  std::atomic<uint64_t> done_upto_{0};        // every submission up to here is reported
  std::map<uint64_t, double> timed_ms_;       // GPU time of timed submissions
  std::vector<Failure> failures_;             // not yet raised
  std::deque<std::pair<uint64_t, uint64_t>> step_ends_;  // (step, its last submission), not yet complete
  uint64_t completed_step_ = 0;
};

}  // namespace krnl::metal
