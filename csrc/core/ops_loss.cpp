// Embedding forward/backward and cross-entropy's entry points. The values of ids and targets are
// data: the backends check them as they read them (check_ids).
#include <string>

#include "ops_common.h"

namespace krnl::ops {

void embedding_forward(const Tensor& ids, const Tensor& table, const Tensor& out) {
  Check c{"embedding_forward"};
  c.tensor("ids", ids), c.tensor("table", table), c.tensor("out", out);
  c.dtype("ids", ids, {DType::i32});
  if (table.dim() != 2) c.fail("table must be 2-D (V, C), got " + table.describe());
  c.floating("table", table);
  Shape want = ids.shape();
  want.push_back(table.size(1));
  c.shape("out", out, want);
  c.same_dtype("out", out, "table", table);
  run(c, shape_str(out.shape()), 0, 2.0 * nbytes({&out}), table.dtype(),
      [&] { c.dev->embedding_forward(ids, table, out); });
}

void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable) {
  Check c{"embedding_backward"};
  c.tensor("ids", ids), c.tensor("dout", dout), c.tensor("dtable", dtable);
  c.dtype("ids", ids, {DType::i32});
  if (dtable.dim() != 2) c.fail("dtable must be 2-D (V, C), got " + dtable.describe());
  c.dtype("dtable", dtable, {DType::f32});
  Shape want = ids.shape();
  want.push_back(dtable.size(1));
  c.shape("dout", dout, want);
  c.floating("dout", dout);
  run(c, shape_str(dout.shape()), double(dout.numel()), 3.0 * nbytes({&dout}), dout.dtype(),
      [&] { c.dev->embedding_backward(ids, dout, dtable); });
}

void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& loss, const Tensor* dlogits,
                   int32_t ignore_index, float scale, const Tensor* scale_by) {
  Check c{"cross_entropy"};
  c.tensor("logits", logits), c.tensor("targets", targets), c.tensor("loss", loss);
  if (logits.dim() != 2) c.fail("logits must be 2-D (T, V), got " + logits.describe());
  c.floating("logits", logits);
  const int64_t T = logits.size(0);
  c.shape("targets", targets, {T});
  c.dtype("targets", targets, {DType::i32});
  c.shape("loss", loss, {T});
  c.dtype("loss", loss, {DType::f32});
  if (dlogits) {
    c.tensor("dlogits", *dlogits);
    c.shape("dlogits", *dlogits, logits.shape());
    c.same_dtype("dlogits", *dlogits, "logits", logits);
  }
  if (scale_by) {
    c.tensor("scale_by", *scale_by);
    c.shape("scale_by", *scale_by, {1});
    c.dtype("scale_by", *scale_by, {DType::f32});
  }
  run(c, shape_str(logits.shape()), 5.0 * double(logits.numel()), nbytes({&logits, dlogits}), logits.dtype(),
      [&] { c.dev->cross_entropy(logits, targets, loss, dlogits, ignore_index, scale, scale_by); });
}

}  // namespace krnl::ops
