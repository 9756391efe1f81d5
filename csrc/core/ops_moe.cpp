// Mixture-of-experts entry points (op_list.h's notes): routing, grouping by expert, the grouped
// GEMMs and the weighted combine. Expert ids and offsets are data: the CPU checks them as it
// reads them, GPUs trust moe_sort's.
#include <string>

#include "ops_common.h"

namespace krnl::ops {

namespace {

// ids (N, K) i32 (named name) and a (N, K) companion of the given dtype; returns K.
int64_t check_pairs(Check& c, const char* name, const Tensor& ids, int64_t N, const char* other, const Tensor* t,
                    DType dt) {
  if (ids.dim() != 2 || ids.size(0) != N)
    c.fail(std::string(name) + " must be (N, K) with N = " + std::to_string(N) + ", got " + ids.describe());
  c.dtype(name, ids, {DType::i32});
  if (t) {
    c.tensor(other, *t);
    c.shape(other, *t, ids.shape());
    c.dtype(other, *t, {dt});
  }
  return ids.size(1);
}

// offsets (E + 1,) i32 for E >= 1 experts; returns E.
int64_t check_offsets(Check& c, const Tensor& offsets) {
  c.tensor("offsets", offsets);
  c.dtype("offsets", offsets, {DType::i32});
  if (offsets.dim() != 1 || offsets.size(0) < 2) c.fail("offsets must be (E + 1,) with E >= 1, got " + offsets.describe());
  return offsets.size(0) - 1;
}

}  // namespace

void moe_route(const Tensor& logits, const Tensor& ids, const Tensor& weights, bool norm) {
  Check c{"moe_route"};
  c.tensor("logits", logits), c.tensor("ids", ids), c.tensor("weights", weights);
  if (logits.dim() != 2) c.fail("logits must be 2-D (N, E), got " + logits.describe());
  c.floating("logits", logits);
  const int64_t K = check_pairs(c, "ids", ids, logits.size(0), "weights", &weights, DType::f32);
  if (K < 1 || K > logits.size(1))
    c.fail("ids must hold 1 to E = " + std::to_string(logits.size(1)) + " experts per row, got " + ids.describe());
  run(c, shape_str(logits.shape()), 5.0 * double(logits.numel()), nbytes({&logits, &ids, &weights}), logits.dtype(),
      [&] { c.dev->moe_route(logits, ids, weights, norm); });
}

void moe_route_backward(const Tensor& logits, const Tensor& ids, const Tensor& dweights, const Tensor& dlogits,
                        bool norm, const Tensor* dprobs) {
  Check c{"moe_route_backward"};
  c.tensor("logits", logits), c.tensor("ids", ids), c.tensor("dweights", dweights), c.tensor("dlogits", dlogits);
  if (logits.dim() != 2) c.fail("logits must be 2-D (N, E), got " + logits.describe());
  c.floating("logits", logits);
  const int64_t K = check_pairs(c, "ids", ids, logits.size(0), "dweights", &dweights, DType::f32);
  if (K < 1 || K > logits.size(1))
    c.fail("ids must hold 1 to E = " + std::to_string(logits.size(1)) + " experts per row, got " + ids.describe());
  c.shape("dlogits", dlogits, logits.shape());
  c.same_dtype("dlogits", dlogits, "logits", logits);
  if (dprobs) {
    c.tensor("dprobs", *dprobs);
    c.shape("dprobs", *dprobs, {logits.size(1)});
    c.dtype("dprobs", *dprobs, {DType::f32});
  }
  run(c, shape_str(logits.shape()), 8.0 * double(logits.numel()), nbytes({&logits, &dlogits, &dweights}),
      logits.dtype(), [&] { c.dev->moe_route_backward(logits, ids, dweights, dlogits, norm, dprobs); });
}

void moe_sort(const Tensor& ids, const Tensor& tokens, const Tensor& slot, const Tensor& offsets) {
  Check c{"moe_sort"};
  c.tensor("ids", ids), c.tensor("tokens", tokens), c.tensor("slot", slot);
  check_offsets(c, offsets);
  check_pairs(c, "ids", ids, ids.dim() == 2 ? ids.size(0) : -1, "slot", &slot, DType::i32);
  c.shape("tokens", tokens, {ids.numel()});
  c.dtype("tokens", tokens, {DType::i32});
  run(c, shape_str(ids.shape()), 0, nbytes({&ids, &tokens, &slot, &offsets}), DType::i32,
      [&] { c.dev->moe_sort(ids, tokens, slot, offsets); });
}

void moe_gather(const Tensor& x, const Tensor& tokens, const Tensor& out) {
  Check c{"moe_gather"};
  c.tensor("x", x), c.tensor("tokens", tokens), c.tensor("out", out);
  if (x.dim() != 2) c.fail("x must be 2-D (N, C), got " + x.describe());
  c.floating("x", x);
  if (tokens.dim() != 1) c.fail("tokens must be 1-D (P,), got " + tokens.describe());
  c.dtype("tokens", tokens, {DType::i32});
  c.shape("out", out, {tokens.size(0), x.size(1)});
  c.same_dtype("out", out, "x", x);
  run(c, shape_str(out.shape()), 0, 2.0 * nbytes({&out}), x.dtype(), [&] { c.dev->moe_gather(x, tokens, out); });
}

void moe_combine(const Tensor& ys, const Tensor& slot, const Tensor* weights, const Tensor& out, float beta) {
  Check c{"moe_combine"};
  c.tensor("ys", ys), c.tensor("slot", slot), c.tensor("out", out);
  if (ys.dim() != 2) c.fail("ys must be 2-D (P, C), got " + ys.describe());
  c.floating("ys", ys);
  if (out.dim() != 2 || out.size(1) != ys.size(1)) c.fail("out must be (N, C) with ys' C, got " + out.describe());
  c.same_dtype("out", out, "ys", ys);
  check_pairs(c, "slot", slot, out.size(0), "weights", weights, DType::f32);
  if (slot.numel() != ys.size(0)) c.fail("ys must have N K = " + std::to_string(slot.numel()) + " rows, got " + ys.describe());
  run(c, shape_str(out.shape()), 2.0 * double(ys.numel()), nbytes({&ys, &out}), ys.dtype(),
      [&] { c.dev->moe_combine(ys, slot, weights, out, beta); });
}

void moe_combine_backward(const Tensor& dout, const Tensor& ys, const Tensor& slot, const Tensor& weights,
                          const Tensor& dys, const Tensor& dweights) {
  Check c{"moe_combine_backward"};
  c.tensor("dout", dout), c.tensor("ys", ys), c.tensor("slot", slot), c.tensor("dys", dys);
  if (ys.dim() != 2) c.fail("ys must be 2-D (P, C), got " + ys.describe());
  c.floating("ys", ys);
  if (dout.dim() != 2 || dout.size(1) != ys.size(1)) c.fail("dout must be (N, C) with ys' C, got " + dout.describe());
  c.same_dtype("dout", dout, "ys", ys);
  c.shape("dys", dys, ys.shape());
  c.same_dtype("dys", dys, "ys", ys);
  check_pairs(c, "slot", slot, dout.size(0), "weights", &weights, DType::f32);
  check_pairs(c, "slot", slot, dout.size(0), "dweights", &dweights, DType::f32);
  if (slot.numel() != ys.size(0)) c.fail("ys must have N K = " + std::to_string(slot.numel()) + " rows, got " + ys.describe());
  run(c, shape_str(ys.shape()), 4.0 * double(ys.numel()), nbytes({&dout, &ys, &dys}), ys.dtype(),
      [&] { c.dev->moe_combine_backward(dout, ys, slot, weights, dys, dweights); });
}

void moe_gemm(const Tensor& x, const Tensor& w, const Tensor& offsets, const Tensor& out, bool transpose, float alpha,
              float beta) {
  Check c{"moe_gemm"};
  c.tensor("x", x), c.tensor("w", w), c.tensor("out", out);
  const int64_t E = check_offsets(c, offsets);
  if (w.dim() != 3 || w.size(0) != E)
    c.fail("w must be (E, O, I) with E = " + std::to_string(E) + " (offsets' length - 1), got " + w.describe());
  c.floating("x", x);
  c.same_dtype("w", w, "x", x);
  c.same_dtype("out", out, "x", x);
  const int64_t O = w.size(1), I = w.size(2), in = transpose ? I : O, on = transpose ? O : I;
  if (x.dim() != 2 || x.size(1) != in) c.fail("x must be (P, " + std::to_string(in) + "), got " + x.describe());
  c.shape("out", out, {x.size(0), on});
  run(c, shape_str(x.shape()) + "x" + shape_str(w.shape()), 2.0 * double(x.size(0)) * O * I, nbytes({&x, &w, &out}),
      x.dtype(), [&] { c.dev->moe_gemm(x, w, offsets, out, transpose, alpha, beta); });
}

void moe_gemm_weight_grad(const Tensor& a, const Tensor& b, const Tensor& offsets, const Tensor& out, float alpha,
                          float beta) {
  Check c{"moe_gemm_weight_grad"};
  c.tensor("a", a), c.tensor("b", b), c.tensor("out", out);
  const int64_t E = check_offsets(c, offsets);
  if (a.dim() != 2) c.fail("a must be 2-D (P, M), got " + a.describe());
  if (b.dim() != 2 || b.size(0) != a.size(0)) c.fail("b must be (P, N) with a's P, got " + b.describe());
  c.floating("a", a);
  c.same_dtype("b", b, "a", a);
  c.shape("out", out, {E, a.size(1), b.size(1)});
  if (out.dtype() != DType::f32) c.same_dtype("out", out, "a", a);
  run(c, shape_str(a.shape()) + "x" + shape_str(b.shape()), 2.0 * double(a.size(0)) * a.size(1) * b.size(1),
      nbytes({&a, &b, &out}), a.dtype(), [&] { c.dev->moe_gemm_weight_grad(a, b, offsets, out, alpha, beta); });
}

}  // namespace krnl::ops
