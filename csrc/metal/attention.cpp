// RoPE, the materialised attention softmax and the fused attention (metal/attention.metal) on the
// Metal kernels; the fused kernels' grids cut into parts under the per-dispatch budget.
#include <functional>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "metal/metal_ops.h"
#include "metal/ops_common.h"

namespace krnl::metal {

// ---- RoPE and the materialised attention softmax

void MetalOps::rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, float sign, bool) {
  // token_major never arrives: Metal lists no token-major operands (the core refuses them).
  Emit e{this, "rope"};
  Dispatch d = e.make("rope", "rope_" + e.sfx(x.dtype()));
  const int64_t T = x.size(-2), D = x.size(-1), R = inv_freq.numel(), rows = D ? x.numel() / D : 0;
  if (rows == 0 || T == 0) return;
  bind(d, 0, x), bind(d, 1, positions), bind(d, 2, inv_freq);
  d.set_args(3, RopeArgs{u32(e.op, rows, "rows"), uint32_t(T), uint32_t(D), uint32_t(R), sign});
  ew_geometry(d, rows * R);
  encode(std::move(d));
}

void MetalOps::softmax_causal_forward(const Tensor& S, const Tensor& P, float scale, const Tensor* segments,
                                      int64_t window, const Tensor* sinks) {
  Emit e{this, "softmax_causal_forward"};
  Dispatch d = e.make("softmax", "softmax_causal_forward_" + e.sfx(S.dtype()));
  const int64_t tq = S.size(-2), tk = S.size(-1), rows = tk ? S.numel() / tk : 0;
  if (rows == 0) return;
  bind(d, 0, S), bind(d, 1, P);
  bind_optional(d, 2, segments, S);
  bind_optional(d, 4, sinks, S);
  // A window of tk keys or more masks nothing: as 0 it fits the kernel's u32.
  const uint32_t win = window > 0 && window < tk ? uint32_t(window) : 0u;
  d.set_args(3, SoftmaxArgs{u32(e.op, rows, "rows"), uint32_t(tq), uint32_t(tk), scale, segments ? 1u : 0u, win,
                            sinks ? 1u : 0u});
  d.grid = {uint32_t(rows), 1, 1};
  d.threads = {row_threads(tk), 1, 1};
  encode(std::move(d));
}

void MetalOps::softmax_backward(const Tensor& P, const Tensor& dP, const Tensor& dS, float scale) {
  Emit e{this, "softmax_backward"};
  Dispatch d = e.make("softmax", "softmax_backward_" + e.sfx(P.dtype()));
  const int64_t cols = P.size(-1), rows = cols ? P.numel() / cols : 0;
  if (rows == 0) return;
  bind(d, 0, P), bind(d, 1, dP), bind(d, 2, dS);
  d.set_args(3, SoftmaxBackwardArgs{u32(e.op, rows, "rows"), u32(e.op, cols, "cols"), scale});
  d.grid = {uint32_t(rows), 1, 1};
  d.threads = {row_threads(cols), 1, 1};
  encode(std::move(d));
}

// ---- fused attention (metal/attention.metal)

namespace {

// The head sizes attention.metal instantiates (its ATTN_ALL_SIZES), and its tiles per size: the
// SIMD-groups of 8 rows per threadgroup of each kernel (AttnTile there).
constexpr int64_t kAttentionHeadDims[] = {4, 8, 16, 32, 64, 80, 96, 128, 256};
struct AttentionTiles {
  uint32_t fwd_sg, dq_sg, dkv_sg;
};
AttentionTiles attention_tiles(int64_t D) {
  const int64_t dp = (D + 7) / 8 * 8;
  return {dp <= 128 ? 4u : 2u, dp <= 64 ? 4u : (dp <= 128 ? 2u : 1u), dp <= 128 ? 2u : 1u};
}

// The kernel-name stem of head size D, or NotImplementedError naming the sizes there are.
std::string attention_size(const char* op, const std::string& device, int64_t D) {
  for (int64_t d : kAttentionHeadDims)
    if (d == D) return "_d" + std::to_string(D) + "_";
  std::string sizes;
  for (int64_t d : kAttentionHeadDims) sizes += (sizes.empty() ? "" : ", ") + std::to_string(d);
  throw NotImplementedError(std::string("[") + op + "] head size D = " + std::to_string(D) + " not implemented on " +
                            device + " (Metal kernels for D in " + sizes + ")");
}

// The causal (and windowed) query-key pairs of query rows [r0, r1): the FLOPs of one product
// are 2 D times this. Query i sees min(i + 1, window) keys.
double query_pairs(int64_t r0, int64_t r1, int64_t window) {
  auto upto = [window](int64_t n) {  // rows [0, n)
    if (window <= 0 || n <= window) return double(n) * double(n + 1) / 2.0;
    return double(window) * double(window + 1) / 2.0 + double(n - window) * double(window);
  };
  return upto(r1) - upto(r0);
}
// The same of key rows [r0, r1) of T: key j is seen by min(T - j, window) queries.
double key_pairs(int64_t r0, int64_t r1, int64_t T, int64_t window) { return query_pairs(T - r1, T - r0, window); }

// The argument struct shared by the kernels (sinks: the forward's only).
AttentionArgs attention_args(const char* op, const Tensor& q, const Tensor& k, float scale, const Tensor* segments,
                             int64_t window, const Tensor* sinks = nullptr) {
  return AttentionArgs{u32(op, q.size(0), "Hq"), u32(op, k.size(0), "Hk"), u32(op, q.size(1), "T"),
                       u32(op, q.size(2), "D"),  u32(op, window, "window"), segments ? 1u : 0u, scale, 0u, 0u,
                       sinks ? 1u : 0u};
}

}  // namespace

std::vector<int64_t> MetalOps::attention_head_dims() {
  return std::vector<int64_t>(std::begin(kAttentionHeadDims), std::end(kAttentionHeadDims));
}

void MetalOps::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                                 float scale, const Tensor* segments, int64_t window, const Tensor* sinks) {
  Emit e{this, "attention_forward"};
  const int64_t Hq = q.size(0), T = q.size(1), D = q.size(2);
  Dispatch d = e.make("attention", "attention_forward" + attention_size(e.op, name(), D) + e.sfx(q.dtype()));
  const AttentionArgs args = attention_args(e.op, q, k, scale, segments, window, sinks);
  if (T == 0 || Hq == 0) return;
  const AttentionTiles t = attention_tiles(D);
  bind(d, 0, q), bind(d, 1, k), bind(d, 2, v), bind(d, 3, o), bind(d, 4, lse);
  bind_optional(d, 5, segments, q), bind_optional(d, 7, sinks, q);
  d.threads = {32 * t.fwd_sg, 1, 1};
  encode_parts(std::move(d), 6, args,
               attention_parts(cb_policy_, AttentionKernel::forward, Hq, k.size(0), T, D, window, dtype_size(q.dtype())));
}

std::vector<AttentionPart> attention_parts(const CommandBufferPolicy& p, AttentionKernel which, int64_t Hq, int64_t Hk,
                                           int64_t T, int64_t D, int64_t window, size_t dtype_bytes) {
  const AttentionTiles t = attention_tiles(D);
  const double es = double(dtype_bytes), group = double(Hq / Hk), d = double(D);
  // Each part's flops and bytes: the rows it computes, the rows of the other side they see.
  std::function<std::pair<double, double>(int64_t, int64_t, int64_t)> cost;
  int64_t heads = Hq, tile = 0;
  switch (which) {
    case AttentionKernel::forward:  // S = Q K^T, P V; q and o rows, the k and v rows seen
      tile = 8 * t.fwd_sg;
      cost = [=](int64_t h, int64_t r0, int64_t r1) {
        return std::make_pair(4.0 * double(h) * d * query_pairs(r0, r1, window),
                              es * d * double(h) * (2.0 * double(r1 - r0) + 2.0 * double(r1) / group));
      };
      break;
    case AttentionKernel::dq:  // S, dP, dS K; q, dout and dq rows, the k and v rows seen
      tile = 8 * t.dq_sg;
      cost = [=](int64_t h, int64_t r0, int64_t r1) {
        return std::make_pair(6.0 * double(h) * d * query_pairs(r0, r1, window),
                              es * d * double(h) * (3.0 * double(r1 - r0) + 2.0 * double(r1) / group));
      };
      break;
    case AttentionKernel::dkv:  // per KV head, over its query heads: S^T, dP^T, P^T dO, dS^T Q
      heads = Hk, tile = 8 * t.dkv_sg;
      cost = [=](int64_t h, int64_t r0, int64_t r1) {
        return std::make_pair(8.0 * double(h) * group * d * key_pairs(r0, r1, T, window),
                              es * d * double(h) * (4.0 * double(r1 - r0) + 2.0 * group * double(T - r0)));
      };
      break;
  }
  auto ms = [&](int64_t h, int64_t r0, int64_t r1) {
    const auto [flops, bytes] = cost(h, r0, r1);
    return estimate_ms(flops, bytes, RateClass::attention, p);
  };
  std::vector<AttentionPart> parts;
  for (const GridPart& g : plan_row_blocks(heads, T, tile, p.max_dispatch_ms, ms)) {
    const auto [flops, bytes] = cost(g.heads, g.row0, g.row0 + g.rows);
    parts.push_back({g, tile, flops, bytes, ms(g.heads, g.row0, g.row0 + g.rows)});
  }
  return parts;
}

// Encodes `d` (an attention kernel: heads on grid.y, row blocks on grid.x) as the parts of its
// grid; args.head0 and block0 place each part.
void MetalOps::encode_parts(Dispatch&& d, uint32_t args_index, const AttentionArgs& whole,
                            const std::vector<AttentionPart>& parts) {
  d.rate = RateClass::attention;
  AttentionArgs args = whole;
  for (const AttentionPart& p : parts) {
    Dispatch part = d;
    args.head0 = uint32_t(p.part.head0), args.block0 = uint32_t(p.part.row0 / p.tile);
    part.set_args(args_index, args);
    part.flops = p.flops, part.bytes = p.bytes;
    part.grid = {ceil_div(p.part.rows, p.tile), uint32_t(p.part.heads), 1};
    encode(std::move(part));
  }
}

// Three dispatches: delta = rowsum(dout * o); dq per query block; dk and dv per key block, each
// summing over the query heads of its KV head (no float atomics).
void MetalOps::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                  const Tensor& dout, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                  const Tensor& dv, float scale, const Tensor* segments, int64_t window) {
  Emit e{this, "attention_backward"};
  const int64_t Hq = q.size(0), Hk = k.size(0), T = q.size(1), D = q.size(2);
  const std::string size = attention_size(e.op, name(), D), sfx = e.sfx(q.dtype());
  const AttentionArgs args = attention_args(e.op, q, k, scale, segments, window);
  u32(e.op, Hq * T, "Hq * T");
  if (T == 0 || Hq == 0) return;
  const AttentionTiles t = attention_tiles(D);
  const size_t es = dtype_size(q.dtype());
  Tensor delta = empty({Hq, T}, DType::f32);  // (Hq, T) released after encoding: later records may reuse it

  Dispatch dd = e.make("attention", "attention_backward_delta_" + sfx);
  bind(dd, 0, o), bind(dd, 1, dout), bind(dd, 2, delta);
  dd.set_args(3, args);
  dd.flops = 2.0 * double(Hq * T * D);
  dd.grid = {ceil_div(Hq * T, 256), 1, 1};
  dd.threads = {256, 1, 1};
  encode(std::move(dd));

  Dispatch dqd = e.make("attention", "attention_backward_dq" + size + sfx);
  bind(dqd, 0, q), bind(dqd, 1, k), bind(dqd, 2, v), bind(dqd, 3, dout), bind(dqd, 4, lse), bind(dqd, 5, delta);
  bind_optional(dqd, 6, segments, q);
  bind(dqd, 7, dq);
  dqd.threads = {32 * t.dq_sg, 1, 1};
  encode_parts(std::move(dqd), 8, args, attention_parts(cb_policy_, AttentionKernel::dq, Hq, Hk, T, D, window, es));

  Dispatch dkv = e.make("attention", "attention_backward_dkv" + size + sfx);
  bind(dkv, 0, q), bind(dkv, 1, k), bind(dkv, 2, v), bind(dkv, 3, dout), bind(dkv, 4, lse), bind(dkv, 5, delta);
  bind_optional(dkv, 6, segments, q);
  bind(dkv, 7, dk), bind(dkv, 8, dv);
  dkv.threads = {32 * t.dkv_sg, 1, 1};
  encode_parts(std::move(dkv), 9, args, attention_parts(cb_policy_, AttentionKernel::dkv, Hq, Hk, T, D, window, es));
}

}  // namespace krnl::metal
