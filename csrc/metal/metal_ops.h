// The Metal backend's op logic, portable (DESIGN section 7): every op of the contract becomes
// Dispatch records (dispatch.h) handed to encode(). Kernel choice, grids, argument structs
// (metal/kargs.h), split-K routing, head batching by buffer offset and the CPU/GPU row split are
// decided here, so they run in CI on the metal-sim device; a subclass only executes records:
// the Objective-C++ layer on macOS (device.mm), the simulator elsewhere (metal_sim.cpp).
#pragma once
#include <initializer_list>
#include <string>

#include "core/backend.h"
#include "metal/dispatch.h"

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

class MetalOps : public Backend {
 public:
  explicit MetalOps(std::string name);
  ~MetalOps() override;
  bool host_visible() const override { return true; }  // unified memory: shared-storage buffers
  bool synchronous() const override { return false; }
  SplitKConfig split_k_config() const override;
  void set_row_split(const RowSplitConfig& c) { row_split_ = c; }
  const RowSplitConfig& row_split() const { return row_split_; }

  void gemm(const krnl::GemmArgs& a) override;
  void rmsnorm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd, float eps) override;
  void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dx,
                        const Tensor* dw) override;
  void swiglu_forward(const Tensor& g, const Tensor& u, const Tensor& s) override;
  void swiglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du) override;
  void rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, float sign) override;
  void softmax_causal_forward(const Tensor& S, const Tensor& P, float scale, const Tensor* segments) override;
  void softmax_backward(const Tensor& P, const Tensor& dP, const Tensor& dS, float scale) override;
  void embedding_forward(const Tensor& ids, const Tensor& table, const Tensor& out) override;
  void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable) override;
  void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& loss, const Tensor* dlogits,
                     int32_t ignore_index, float scale) override;
  void add(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void axpy(float alpha, const Tensor& x, const Tensor& y) override;
  void scale(const Tensor& x, float alpha, const Tensor& out) override;
  void cast(const Tensor& x, const Tensor& out) override;
  void transpose_heads(const Tensor& x, const Tensor& out) override;
  void fill(const Tensor& x, double value) override;
  void dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed) override;
  void adamw_update(const AdamWArgs& a) override;
  void sumsq(const Tensor& x, const Tensor& out) override;
  void nonfinite(const Tensor& x, const Tensor& flag) override;

 protected:
  // Executes (or queues, until commit) one dispatch of the open step.
  virtual void encode(Dispatch&& d) = 0;

 private:
  void elementwise(const char* op, const std::string& kernel, std::initializer_list<const Tensor*> tensors, int64_t n,
                   float alpha);
  void gemm_plain(const krnl::GemmArgs& a, int64_t row0, int64_t rows);
  void gemm_split_k(const krnl::GemmArgs& a);
  void gemm_row_split(const krnl::GemmArgs& a, int64_t cpu_rows);
  RowSplitConfig row_split_;
};

}  // namespace krnl::metal
