// Embedding forward/backward and cross-entropy on the Metal kernels. Ids and targets come from
// uploads: they are checked on the host when the op is encoded.
#include <string>

#include "core/ops.h"
#include "metal/metal_ops.h"
#include "metal/ops_common.h"

namespace krnl::metal {

// ---- embedding and loss

void MetalOps::embedding_forward(const Tensor& ids, const Tensor& table, const Tensor& out) {
  Emit e{this, "embedding_forward"};
  Dispatch d = e.make("embedding", "embedding_forward_" + e.sfx(table.dtype()));
  const int64_t V = table.size(0), C = table.size(1), n = ids.numel();
  // ids come from uploads, never from an earlier kernel of the step: host-visible and final
  ops::check_ids(e.op, "id", "position", ids.ptr<int32_t>(), n, V);
  if (n == 0 || C == 0) return;
  bind(d, 0, ids), bind(d, 1, table), bind(d, 2, out);
  d.set_args(3, EmbeddingArgs{u32(e.op, n, "n"), u32(e.op, C, "C"), u32(e.op, V, "V")});
  ew_geometry(d, n * C);
  encode(std::move(d));
}

void MetalOps::embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable) {
  Emit e{this, "embedding_backward"};
  Dispatch d = e.make("embedding", "embedding_backward_" + e.sfx(dout.dtype()));
  const int64_t V = dtable.size(0), C = dtable.size(1), n = ids.numel();
  // ids come from uploads, never from an earlier kernel of the step: host-visible and final
  ops::check_ids(e.op, "id", "position", ids.ptr<int32_t>(), n, V);
  if (n == 0 || C == 0) return;
  bind(d, 0, ids), bind(d, 1, dout), bind(d, 2, dtable);
  d.set_args(3, EmbeddingArgs{u32(e.op, n, "n"), u32(e.op, C, "C"), u32(e.op, V, "V")});
  ew_geometry(d, C);  // one thread per column, tokens in order
  encode(std::move(d));
}

void MetalOps::cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& loss, const Tensor* dlogits,
                             int32_t ignore_index, float scale, const Tensor* scale_by) {
  Emit e{this, "cross_entropy"};
  Dispatch d = e.make("cross_entropy", "cross_entropy_" + e.sfx(logits.dtype()));
  const int64_t T = logits.size(0), V = logits.size(1);
  ops::check_ids(e.op, "target", "row", targets.ptr<int32_t>(), T, V, &ignore_index);
  if (T == 0) return;
  bind(d, 0, logits), bind(d, 1, targets), bind(d, 2, loss), bind(d, 3, dlogits ? *dlogits : logits);
  if (scale_by)
    bind(d, 5, *scale_by);
  else
    bind(d, 5, loss, 0);  // must be bound; not read
  d.set_args(4, CrossEntropyArgs{uint32_t(T), u32(e.op, V, "V"), ignore_index, scale, dlogits ? 1u : 0u,
                                 scale_by ? 1u : 0u});
  d.grid = {uint32_t(T), 1, 1};
  d.threads = {row_threads(V), 1, 1};
  encode(std::move(d));
}

}  // namespace krnl::metal
