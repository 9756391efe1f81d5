// quantized_matmul and quantized_embedding's entry points: the packed table (op_list.h has its
// layout) checked against the activations.
#include <string>

#include "ops_common.h"

namespace krnl::ops {

namespace {

// The quantized table W (O, I) of quantized_matmul and quantized_embedding: packed codes, scales
// and biases (null in mode mxfp4) checked against each other and against `act` (x or out: scales
// in its dtype or f32). Returns I.
int64_t check_quantized(Check& c, const Tensor& w, const Tensor& scales, const Tensor* biases, const char* act_name,
                        const Tensor& act, int64_t group_size, int64_t bits, int64_t mode) {
  c.tensor("w", w), c.tensor("scales", scales);
  if (mode == kQuantMxfp4) {
    if (bits != 4 || group_size != 32)
      c.fail("mode mxfp4 takes bits 4 and group_size 32, got bits " + std::to_string(bits) + ", group_size " +
             std::to_string(group_size));
    if (biases) c.fail("biases must be None in mode mxfp4 (W = scale * e2m1(q)), got " + biases->describe());
    // E8M0's scales 2^-127 .. 2^127: f32 and bf16 hold every one, f16 only 2^-24 .. 2^15
    if (scales.dtype() == DType::f16)
      c.fail("scales must be f32 or bf16 in mode mxfp4 (f16 cannot hold E8M0's powers of two below 2^-24 or above "
             "2^15), got " + scales.describe());
  } else if (mode == kQuantAffine) {
    if (!biases) c.fail("biases are required in mode affine");
    c.tensor("biases", *biases);
    if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8)
      c.fail("bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
    if (group_size != 16 && group_size != 32 && group_size != 64 && group_size != 128)
      c.fail("group_size must be 16, 32, 64 or 128, got " + std::to_string(group_size));
  } else {
    c.fail("mode must be 0 (affine) or 1 (mxfp4), got " + std::to_string(mode));
  }
  c.floating(act_name, act);
  c.dtype("w", w, {DType::i32});
  if (w.dim() != 2 || (w.size(1) * 32) % bits)
    c.fail("w must be 2-D (O, I * bits / 32) of packed " + std::to_string(bits) + "-bit codes, got " + w.describe());
  const int64_t O = w.size(0), I = w.size(1) * 32 / bits, G = I / group_size;
  if (scales.dim() != 2 || scales.size(0) != O || scales.size(1) * group_size != I)
    c.fail("scales must be (" + std::to_string(O) + ", " + std::to_string(G) + ") for w " + w.describe() +
           " at " + std::to_string(bits) + " bits and group_size " + std::to_string(group_size) + ", got " +
           scales.describe());
  if (scales.dtype() != act.dtype() && scales.dtype() != DType::f32)
    c.fail("scales must be " + (act.dtype() == DType::f32 ? std::string("f32")
                                                         : std::string(dtype_name(act.dtype())) + " (" + act_name +
                                                               "'s dtype) or f32") +
           ", got " + scales.describe());
  if (biases) c.shape("biases", *biases, scales.shape()), c.same_dtype("biases", *biases, "scales", scales);
  return I;
}

// The profile's label of a layout: q<bits>g<group_size>, or mxfp4.
std::string layout_label(int64_t group_size, int64_t bits, int64_t mode) {
  return mode == kQuantMxfp4 ? "mxfp4" : "q" + std::to_string(bits) + "g" + std::to_string(group_size);
}

}  // namespace

void quantized_matmul(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor* biases, const Tensor& out,
                      bool transpose, int64_t group_size, int64_t bits, float beta, int64_t mode) {
  Check c{"quantized_matmul"};
  // x and out may be row-strided 2-D views (column blocks of a fused q|k|v projection).
  c.rows("x", x), c.rows("out", out);
  const int64_t I = check_quantized(c, w, scales, biases, "x", x, group_size, bits, mode), O = w.size(0);
  if (x.dim() != 2) c.fail("x must be 2-D (N, I) or (N, O), got " + x.describe());
  const int64_t N = x.size(0), K = transpose ? I : O, M = transpose ? O : I;
  if (x.size(1) != K)
    c.fail("x must be (N, " + std::to_string(K) + ") for " + (transpose ? "out = x W^T" : "out = x W") + " with W (" +
           std::to_string(O) + ", " + std::to_string(I) + "), got " + x.describe());
  c.shape("out", out, {N, M}), c.same_dtype("out", out, "x", x);
  if (out.storage() == x.storage() && out.numel() > 0) c.fail("out must not share memory with x");
  run(c, shape_str(x.shape()) + (transpose ? " W^T " : " W ") + "(" + std::to_string(O) + ", " + std::to_string(I) +
             ") " + layout_label(group_size, bits, mode),
      2.0 * double(N) * double(O) * double(I), nbytes({&x, &w, &scales, biases, &out}), x.dtype(),
      [&] { c.dev->quantized_matmul(x, w, scales, biases, out, transpose, group_size, bits, beta, mode); });
}

void moe_quantized_matmul(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor* biases,
                          const Tensor& offsets, const Tensor& out, bool transpose, int64_t group_size, int64_t bits,
                          float beta, int64_t mode) {
  Check c{"moe_quantized_matmul"};
  c.tensor("x", x), c.tensor("out", out), c.tensor("offsets", offsets), c.tensor("w", w);
  c.dtype("offsets", offsets, {DType::i32});
  if (offsets.dim() != 1 || offsets.size(0) < 2) c.fail("offsets must be (E + 1,) with E >= 1, got " + offsets.describe());
  const int64_t E = offsets.size(0) - 1;
  if (w.dim() != 3 || w.size(0) != E || scales.dim() != 3 || scales.size(0) != E || (biases && biases->dim() != 3))
    c.fail("w, scales and biases must be (E, ...) with E = " + std::to_string(E) + " (offsets' length - 1), got " +
           w.describe() + ", " + scales.describe() + (biases ? ", " + biases->describe() : std::string()));
  // Expert 0's table stands for all: they share one layout.
  const Tensor b0 = biases ? biases->select(0, 0) : Tensor();
  const int64_t I = check_quantized(c, w.select(0, 0), scales.select(0, 0), biases ? &b0 : nullptr, "x", x,
                                    group_size, bits, mode);
  if (biases) c.shape("biases", *biases, scales.shape());
  const int64_t O = w.size(1), K = transpose ? I : O, M = transpose ? O : I;
  if (x.dim() != 2 || x.size(1) != K)
    c.fail("x must be (P, " + std::to_string(K) + ") for " + (transpose ? "out = x W_e^T" : "out = x W_e") +
           " with W_e (" + std::to_string(O) + ", " + std::to_string(I) + "), got " + x.describe());
  c.shape("out", out, {x.size(0), M}), c.same_dtype("out", out, "x", x);
  run(c, shape_str(x.shape()) + (transpose ? " W^T " : " W ") + "(" + std::to_string(E) + ", " + std::to_string(O) +
             ", " + std::to_string(I) + ") " + layout_label(group_size, bits, mode),
      2.0 * double(x.size(0)) * double(O) * double(I), nbytes({&x, &w, &scales, biases, &out}), x.dtype(),
      [&] {
        c.dev->moe_quantized_matmul(x, w, scales, biases, offsets, out, transpose, group_size, bits, beta, mode);
      });
}

void quantized_embedding(const Tensor& ids, const Tensor& w, const Tensor& scales, const Tensor& biases,
                         const Tensor& out, int64_t group_size, int64_t bits) {
  Check c{"quantized_embedding"};
  c.tensor("ids", ids), c.tensor("out", out);
  c.dtype("ids", ids, {DType::i32});
  const int64_t C = check_quantized(c, w, scales, &biases, "out", out, group_size, bits, kQuantAffine);
  Shape want = ids.shape();
  want.push_back(C);
  c.shape("out", out, want);
  run(c, shape_str(out.shape()) + " " + layout_label(group_size, bits, kQuantAffine), 0,
      2.0 * nbytes({&out}), out.dtype(), [&] { c.dev->quantized_embedding(ids, w, scales, biases, out, group_size, bits); });
}

}  // namespace krnl::ops
