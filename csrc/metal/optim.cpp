// Optimizer ops on the Metal kernels (metal/optimizer.metal): AdamW, Adam, 8-bit AdamW, SGD, Lion,
// Adafactor, Muon's two (with the working-copy refresh), sumsq (partials per chunk, then one threadgroup sums them) and the non-finite flag.
#include <algorithm>
#include <cmath>
#include <string>

#include "metal/metal_ops.h"
#include "metal/ops_common.h"

namespace krnl::metal {

// ---- optimizer

namespace {

constexpr uint32_t kReduceChunk = 16384;  // elements per threadgroup in sumsq's first pass

}  // namespace

namespace {

// The buffers every optimizer kernel shares: params, grads (muon_update's update) and the state vector at 0..2 (adamw's
// v at 3), the working copy at 4 and hyper, sq, flag at 6..8 (dummies, never read, where absent:
// the kernels read them only as their args say). Returns whether the scalars come from hyper.
template <typename A>
bool bind_update(Dispatch& d, const A& a, const Tensor& grads, const Tensor& state) {
  bind(d, 0, a.params), bind(d, 1, grads), bind(d, 2, state.defined() ? state : a.params);
  const bool working = a.working.defined(), dev = a.hyper.defined(), flag = a.flag.defined();
  bind(d, 4, working ? a.working : a.params, working ? a.working.nbytes() : 0);
  bind(d, 6, dev ? a.hyper : a.params, dev ? a.hyper.nbytes() : 0);
  bind(d, 7, dev ? a.sq : a.params, dev ? a.sq.nbytes() : 0);
  bind(d, 8, flag ? a.flag : a.params, flag ? a.flag.nbytes() : 0);
  return dev;
}

std::string update_kernel(const Emit& e, const char* op, const Tensor& working) {
  return working.defined() ? std::string(op) + "_working_" + e.sfx(working.dtype()) : std::string(op);
}

}  // namespace

void MetalOps::adamw_update(const AdamWArgs& a) {
  Emit e{this, "adamw_update"};
  const int64_t n = a.params.numel();
  if (n == 0) return;
  Dispatch d = e.make("optimizer", update_kernel(e, "adamw_update", a.working));
  const bool dev = bind_update(d, a, a.grads, a.m);
  bind(d, 3, a.v);
  // Bias corrections in double on the host, as the CPU backend computes them.
  const double bc1 = 1.0 - std::pow(double(a.beta1), double(a.step));
  const double bc2 = 1.0 - std::pow(double(a.beta2), double(a.step));
  const float decay = a.decoupled ? a.lr * a.weight_decay : a.weight_decay;
  d.set_args(5, AdamwArgs{u32(e.op, n, "n"), float(double(a.lr) / bc1), float(std::sqrt(bc2)), decay, a.beta1,
                          a.beta2, a.eps, a.grad_scale, dev ? 1u : 0u, a.flag.defined() ? 1u : 0u,
                          a.decoupled ? 0u : 1u});
  ew_geometry(d, n);
  encode(std::move(d));
}

void MetalOps::sgd_update(const SgdUpdateArgs& a) {
  Emit e{this, "sgd_update"};
  const int64_t n = a.params.numel();
  if (n == 0) return;
  Dispatch d = e.make("optimizer", update_kernel(e, "sgd_update", a.working));
  const bool momentum = a.momentum != 0.f, first = a.step == 1;
  const bool dev = bind_update(d, a, a.grads, momentum ? a.buf : Tensor());
  d.set_args(5, SgdArgs{u32(e.op, n, "n"), a.lr, first ? 0.f : a.momentum, first ? 1.f : 1.f - a.dampening,
                        a.weight_decay, a.momentum, a.grad_scale, momentum ? 1u : 0u, a.nesterov ? 1u : 0u,
                        dev ? 1u : 0u, a.flag.defined() ? 1u : 0u});
  ew_geometry(d, n);
  encode(std::move(d));
}

void MetalOps::lion_update(const LionUpdateArgs& a) {
  Emit e{this, "lion_update"};
  const int64_t n = a.params.numel();
  if (n == 0) return;
  Dispatch d = e.make("optimizer", update_kernel(e, "lion_update", a.working));
  const bool dev = bind_update(d, a, a.grads, a.m);
  d.set_args(5, LionArgs{u32(e.op, n, "n"), a.lr, a.lr * a.weight_decay, a.beta1, a.beta2, a.grad_scale,
                         dev ? 1u : 0u, a.flag.defined() ? 1u : 0u});
  ew_geometry(d, n);
  encode(std::move(d));
}

void MetalOps::adafactor_update(const AdafactorUpdateArgs& a) {
  Emit e{this, "adafactor_update"};
  const Shape& s = a.params.shape();
  const int64_t n = a.params.numel(), C = s.back(), R = s[s.size() - 2];
  if (n == 0) return;
  const int64_t B = n / (R * C), rows = B * R;
  Tensor work = empty({2 * rows + B + 2}, DType::f32);
  const AdafactorArgs args{u32(e.op, B, "B"), u32(e.op, R, "R"), u32(e.op, C, "C"), a.rho, a.beta2t, a.decay, a.eps1,
                           a.eps2, a.d, a.grad_scale, a.hyper.defined() ? 1u : 0u, a.flag.defined() ? 1u : 0u};
  u32(e.op, n, "n");
  // the six passes (optimizer.metal), each with every buffer bound
  const char* passes[] = {"adafactor_rows", "adafactor_cols", "adafactor_stats", "adafactor_unorm", "adafactor_finish",
                          "adafactor_apply"};
  for (const char* pass : passes) {
    const bool last = pass == passes[5];
    Dispatch d = e.make("optimizer", last ? update_kernel(e, pass, a.working) : std::string(pass));
    bind_update(d, a, a.grads, a.row);
    bind(d, 3, a.col), bind(d, 9, work);
    d.set_args(5, args);
    if (pass == passes[0] || pass == passes[3]) {  // a threadgroup per row
      d.grid = {uint32_t(rows), 1, 1};
      d.threads = {256, 1, 1};
    } else if (pass == passes[2] || pass == passes[4]) {  // one threadgroup
      d.grid = {1, 1, 1};
      d.threads = {256, 1, 1};
    } else {
      ew_geometry(d, pass == passes[1] ? B * C : n);
    }
    encode(std::move(d));
  }
}

void MetalOps::muon_momentum(const MuonMomentumArgs& a) {
  Emit e{this, "muon_momentum"};
  const int64_t n = a.grads.numel();
  if (n == 0) return;
  const bool dev = a.hyper.defined(), flag = a.flag.defined();
  const MuonArgs args{u32(e.op, n, "n"), a.momentum, a.eps, a.grad_scale, a.nesterov ? 1u : 0u, dev ? 1u : 0u,
                      flag ? 1u : 0u};
  auto scalars = [&](Dispatch& d) {
    d.set_args(5, args);
    bind(d, 6, dev ? a.hyper : a.out, dev ? a.hyper.nbytes() : 0);
    bind(d, 7, dev ? a.sq : a.out, dev ? a.sq.nbytes() : 0);
    bind(d, 8, flag ? a.flag : a.out, flag ? a.flag.nbytes() : 0);
  };
  Dispatch d = e.make("optimizer", "muon_momentum");
  bind(d, 0, a.grads), bind(d, 1, a.buf), bind(d, 2, a.out);
  scalars(d);
  ew_geometry(d, n);
  encode(std::move(d));
  Tensor total = empty({1}, DType::f32);
  sumsq(a.out, total);  // the norm of the update (a stale one on a skipped step, never used)
  Dispatch f = e.make("optimizer", "muon_momentum_normalize");
  bind(f, 2, a.out), bind(f, 9, total);
  scalars(f);
  ew_geometry(f, n);
  encode(std::move(f));
}

void MetalOps::muon_update(const MuonUpdateArgs& a) {
  Emit e{this, "muon_update"};
  const int64_t n = a.params.numel();
  if (n == 0) return;
  Dispatch d = e.make("optimizer", update_kernel(e, "muon_update", a.working));
  const bool dev = bind_update(d, a, a.update, Tensor());
  d.set_args(5, MuonUpdateKArgs{u32(e.op, n, "n"), a.lr, a.decay, a.scale, dev ? 1u : 0u, a.flag.defined() ? 1u : 0u});
  ew_geometry(d, n);
  encode(std::move(d));
}

void MetalOps::adamw8bit_update(const AdamW8bitArgs& a) {
  Emit e{this, "adamw8bit_update"};
  const int64_t n = a.params.numel();
  if (n == 0) return;
  Dispatch d = e.make("optimizer", update_kernel(e, "adamw8bit_update", a.working));
  const bool dev = bind_update(d, a, a.grads, a.m_codes);
  bind(d, 3, a.v_codes), bind(d, 9, a.m_absmax), bind(d, 10, a.v_absmax), bind(d, 11, a.m_map), bind(d, 12, a.v_map);
  const double bc1 = 1.0 - std::pow(double(a.beta1), double(a.step));
  const double bc2 = 1.0 - std::pow(double(a.beta2), double(a.step));
  const float c1 = a.beta1_complement > 0.f ? a.beta1_complement : 1.f - a.beta1;
  const float c2 = a.beta2_complement > 0.f ? a.beta2_complement : 1.f - a.beta2;
  d.set_args(5, Adamw8bitArgs{u32(e.op, n, "n"), float(double(a.lr) / bc1), float(std::sqrt(bc2)),
                              a.lr * a.weight_decay, a.beta1, a.beta2, c1, c2, a.eps, a.grad_scale, dev ? 1u : 0u,
                              a.flag.defined() ? 1u : 0u});
  d.grid = {uint32_t((n + 255) / 256), 1, 1};  // a threadgroup of 256 per block
  d.threads = {256, 1, 1};
  encode(std::move(d));
}

void MetalOps::sumsq(const Tensor& x, const Tensor& out) {
  Emit e{this, "sumsq"};
  const int64_t n = x.numel();
  const uint32_t groups = std::max<uint32_t>(1, ceil_div(n, kReduceChunk));
  const ReduceArgs args{u32(e.op, n, "n"), kReduceChunk, groups};
  Tensor partials = empty({int64_t(groups)}, DType::f32);
  Dispatch d = e.make("optimizer", "sumsq_partial_" + e.sfx(x.dtype()));
  bind(d, 0, x), bind(d, 1, partials);
  d.set_args(2, args);
  d.grid = {groups, 1, 1};
  d.threads = {256, 1, 1};
  encode(std::move(d));
  Dispatch f = e.make("optimizer", "sumsq_finish");
  bind(f, 0, partials), bind(f, 1, out);
  f.set_args(2, args);
  f.grid = {1, 1, 1};
  f.threads = {256, 1, 1};
  encode(std::move(f));
}

void MetalOps::nonfinite(const Tensor& x, const Tensor& flag) {
  Emit e{this, "nonfinite"};
  Dispatch d = e.make("optimizer", "nonfinite_" + e.sfx(x.dtype()));
  const int64_t n = x.numel();
  if (n == 0) return;
  bind(d, 0, x), bind(d, 1, flag);
  d.set_args(2, ReduceArgs{u32(e.op, n, "n"), 0, 0});
  ew_geometry(d, n);
  encode(std::move(d));
}

}  // namespace krnl::metal
