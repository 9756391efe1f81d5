// Mixture-of-experts ops on the Metal kernels (metal/moe.metal; the grouped GEMMs in
// metal/gemm.metal, moe_gather on embedding.metal's forward). Expert ids, slot, tokens and offsets
// are written by earlier kernels of the same step, so nothing here reads them: the kernels trust
// moe_sort's offsets and keep any index inside its buffer. Sizes the kernels index in 32 bits are
// checked here.
#include <algorithm>
#include <string>

#include "core/dtype.h"
#include "metal/metal_ops.h"
#include "metal/ops_common.h"

namespace krnl::metal {

namespace {

constexpr uint32_t kSortThreads = 256;  // moe_sort's one threadgroup (at most; fewer for few pairs)
constexpr uint32_t kPairsPerGroup = 8;  // moe_combine_backward: one SIMD-group per pair, 256 threads

// A grid-stride kernel over n items whose index (plus the grid) stays within 32 bits.
void stride_geometry(const char* op, Dispatch& d, int64_t n) {
  u32(op, n + int64_t(kEwThreads) * kEwMaxGroups, "the element count");
  ew_geometry(d, n);
}

}  // namespace

void MetalOps::moe_route(const Tensor& logits, const Tensor& ids, const Tensor& weights, bool norm) {
  Emit e{this, "moe_route"};
  Dispatch d = e.make("moe", "moe_route_" + e.sfx(logits.dtype()));
  const int64_t N = logits.size(0), E = logits.size(1), K = ids.size(1);
  if (N == 0) return;
  bind(d, 0, logits), bind(d, 1, ids), bind(d, 2, weights);
  d.set_args(3, MoeRouteArgs{u32(e.op, N, "N"), u32(e.op, E, "E"), u32(e.op, K, "K"), norm ? 1u : 0u, 0u});
  stride_geometry(e.op, d, N);  // one thread per row
  encode(std::move(d));
}

void MetalOps::moe_route_backward(const Tensor& logits, const Tensor& ids, const Tensor& dweights,
                                  const Tensor& dlogits, bool norm, const Tensor* dprobs) {
  Emit e{this, "moe_route_backward"};
  Dispatch d = e.make("moe", "moe_route_backward_" + e.sfx(logits.dtype()));
  const int64_t N = logits.size(0), E = logits.size(1), K = ids.size(1);
  if (N == 0) return;
  bind(d, 0, logits), bind(d, 1, ids), bind(d, 2, dweights), bind(d, 3, dlogits);
  bind(d, 4, dprobs ? *dprobs : dweights);  // must be bound; read only with dprobs
  d.set_args(5, MoeRouteArgs{u32(e.op, N, "N"), u32(e.op, E, "E"), u32(e.op, K, "K"), norm ? 1u : 0u,
                             dprobs ? 1u : 0u});
  stride_geometry(e.op, d, N);
  encode(std::move(d));
}

void MetalOps::moe_sort(const Tensor& ids, const Tensor& tokens, const Tensor& slot, const Tensor& offsets) {
  Emit e{this, "moe_sort"};
  Dispatch d = e.make("moe", "moe_sort_i32");
  const int64_t P = ids.numel(), K = ids.size(1), E = offsets.numel() - 1;
  // One threadgroup (a stable sort without atomics); a few pairs take fewer threads. Its per-thread
  // expert counts live in a scratch buffer, released after encoding (later records may reuse it).
  const uint32_t threads = uint32_t(std::clamp<int64_t>((P + 31) / 32 * 32, 32, kSortThreads));
  Tensor counts = empty({int64_t(threads), E}, DType::i32);
  bind(d, 0, ids), bind(d, 1, tokens), bind(d, 2, slot), bind(d, 3, offsets), bind(d, 4, counts);
  u32(e.op, int64_t(threads) * E, "threads x E");
  d.set_args(5, MoeSortArgs{u32(e.op, P, "P"), u32(e.op, K, "K"), u32(e.op, E, "E")});
  d.grid = {1, 1, 1};
  d.threads = {threads, 1, 1};
  encode(std::move(d));
}

void MetalOps::moe_gather(const Tensor& x, const Tensor& tokens, const Tensor& out) {
  Emit e{this, "moe_gather"};
  // embedding_forward's copy by row index (a token outside [0, N) gets a NaN row), over tokens that
  // moe_sort writes in this step: not checked here, unlike an embedding's uploaded ids.
  Dispatch d = e.make("embedding", "embedding_forward_" + e.sfx(x.dtype()));
  const int64_t N = x.size(0), C = x.size(1), P = tokens.numel();
  if (P == 0 || C == 0) return;
  bind(d, 0, tokens), bind(d, 1, x), bind(d, 2, out);
  d.set_args(3, EmbeddingArgs{u32(e.op, P, "P"), u32(e.op, C, "C"), u32(e.op, N, "N")});
  ew_geometry(d, P * C);  // the kernel takes 64-bit indices where 32 bits would wrap
  encode(std::move(d));
}

void MetalOps::moe_combine(const Tensor& ys, const Tensor& slot, const Tensor* weights, const Tensor& out,
                           float beta) {
  Emit e{this, "moe_combine"};
  Dispatch d = e.make("moe", "moe_combine_" + e.sfx(ys.dtype()));
  const int64_t N = out.size(0), C = out.size(1), K = slot.size(1), P = ys.size(0);
  if (N == 0 || C == 0) return;
  bind(d, 0, ys), bind(d, 1, slot), bind(d, 3, out);
  bind(d, 2, weights ? *weights : slot);  // must be bound; read only with weights
  d.set_args(4, MoeCombineArgs{u32(e.op, N, "N"), u32(e.op, C, "C"), u32(e.op, K, "K"), u32(e.op, P, "P"), beta,
                               weights ? 1u : 0u});
  stride_geometry(e.op, d, N * C);  // one thread per output element
  encode(std::move(d));
}

void MetalOps::moe_combine_backward(const Tensor& dout, const Tensor& ys, const Tensor& slot, const Tensor& weights,
                                    const Tensor& dys, const Tensor& dweights) {
  Emit e{this, "moe_combine_backward"};
  Dispatch d = e.make("moe", "moe_combine_backward_" + e.sfx(ys.dtype()));
  const int64_t N = dout.size(0), C = dout.size(1), K = slot.size(1), P = ys.size(0);
  if (P == 0) return;
  bind(d, 0, dout), bind(d, 1, ys), bind(d, 2, slot), bind(d, 3, weights), bind(d, 4, dys), bind(d, 5, dweights);
  u32(e.op, P + int64_t(kPairsPerGroup) * kEwMaxGroups, "the pair count");
  d.set_args(6, MoeCombineArgs{u32(e.op, N, "N"), u32(e.op, C, "C"), u32(e.op, K, "K"), u32(e.op, P, "P"), 0.f, 1u});
  d.grid = {std::min<uint32_t>(kEwMaxGroups, ceil_div(P, kPairsPerGroup)), 1, 1};
  d.threads = {32 * kPairsPerGroup, 1, 1};
  encode(std::move(d));
}

// Grouped GEMMs (metal/gemm.metal's moe_gemm*, on the plain kernels' 32x32 tile). Each is cut into
// blocks under the per-dispatch budget as gemm is (encode_blocks): moe_gemm by ranges of the
// experts' row tiles (the grid's y, numbered across experts: the host cannot know which expert a
// tile falls to, only that the ranges cover every tile once) and by output columns;
// moe_gemm_weight_grad by rows and columns of every out[e]. A block's estimate counts its work as
// if each of its tiles were full, bounded by all P rows: offsets stay on the GPU.
// moe_quantized_matmul, quantized_matmul's tiled form on moe_gemm's tile map, is in quantized.cpp.

void MetalOps::moe_gemm(const Tensor& x, const Tensor& w, const Tensor& offsets, const Tensor& out, bool transpose,
                        float alpha, float beta) {
  Emit e{this, "moe_gemm"};
  const std::string s = e.sfx(x.dtype());
  const int64_t P = x.size(0), E = w.size(0), O = w.size(1), I = w.size(2);
  const int64_t K = x.size(1), N = out.size(1);  // x (P, K), out (P, N)
  if (P == 0 || N == 0) return;
  u32(e.op, O * I, "O x I"), u32(e.op, P, "P"), u32(e.op, K, "x's columns"), u32(e.op, N, "out's columns");
  const size_t es = dtype_size(x.dtype());
  // sum over experts of ceil(n_e / 32) <= (P + 31 E) / 32: the row tiles the grid's y runs over
  const int64_t tiles = (P + (kGemmTile - 1) * E) / kGemmTile;
  const int64_t ld_w = I;  // W_e (O, I): nt reads its rows as out's columns, nn its columns
  encode_blocks(tiles * kGemmTile, N, kGemmTile, kGemmTile, [&](int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
    Dispatch d = e.make("gemm", std::string("moe_gemm_") + (transpose ? "nt_" : "nn_") + s);
    d.constant_bool(0, false);  // the gemm library as its unaligned GEMMs build it (these kernels never read it)
    const int64_t w_off = transpose ? c0 * ld_w : c0;
    const int64_t wr = transpose ? cols : O, wc = transpose ? I : cols;
    bind(d, 0, x);
    d.bind(1, w.storage()->ptr(), w.offset() + size_t(w_off) * es, size_t(extent_elems(wr, wc, ld_w, O * I, E)) * es);
    d.bind(2, out.storage()->ptr(), out.offset() + size_t(c0) * es, size_t(extent_elems(P, cols, N, 0, 1)) * es);
    bind(d, 3, offsets);
    MoeGemmArgs g{};
    g.E = uint32_t(E), g.P = uint32_t(P), g.N = uint32_t(cols), g.K = uint32_t(K);
    g.lda = uint32_t(K), g.ldb = uint32_t(ld_w), g.ldc = uint32_t(N), g.stride_b = uint32_t(O * I);
    g.tile0 = u32(e.op, r0 / kGemmTile, "row tiles");
    g.alpha = alpha, g.beta = beta;
    d.set_args(4, g);
    const double n = double(std::min(rows, P));                                  // rows at most
    const double experts = double(std::min<int64_t>(E, ceil_div(rows, kGemmTile)));  // W_e read at most
    d.flops = 2.0 * n * double(cols) * double(K);
    d.rate = RateClass::gemm;
    d.bytes = double(es) * (n * double(K) + experts * double(cols) * double(K) + n * double(cols) * (beta != 0.f ? 2 : 1));
    d.grid = {ceil_div(cols, kGemmTile), ceil_div(rows, kGemmTile), 1};
    d.threads = {32, 1, 1};
    return d;
  });
}

void MetalOps::moe_gemm_weight_grad(const Tensor& a, const Tensor& b, const Tensor& offsets, const Tensor& out,
                                    float alpha, float beta) {
  Emit e{this, "moe_gemm_weight_grad"};
  const std::string s = e.sfx(a.dtype());
  const int64_t P = a.size(0), M = a.size(1), N = b.size(1), E = out.size(0);  // a (P, M), b (P, N)
  if (M == 0 || N == 0) return;
  u32(e.op, M * N, "M x N"), u32(e.op, E, "E"), u32(e.op, P, "P");
  const bool widen = out.dtype() != a.dtype();  // 16-bit operands, f32 out
  const size_t es = dtype_size(a.dtype()), cs = dtype_size(out.dtype());
  encode_blocks(M, N, kGemmTile, kGemmTile, [&](int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
    Dispatch d = e.make("gemm", "moe_gemm_weight_grad_" + s + (widen ? "_f32" : ""));
    d.constant_bool(0, false);  // as moe_gemm's
    // a_e^T's rows are a's columns: the block binds a at column r0, b at column c0, out[0] at (r0, c0)
    d.bind(0, a.storage()->ptr(), a.offset() + size_t(r0) * es, size_t(extent_elems(P, rows, M, 0, 1)) * es);
    d.bind(1, b.storage()->ptr(), b.offset() + size_t(c0) * es, size_t(extent_elems(P, cols, N, 0, 1)) * es);
    d.bind(2, out.storage()->ptr(), out.offset() + size_t(r0 * N + c0) * cs,
           size_t(extent_elems(rows, cols, N, M * N, E)) * cs);
    bind(d, 3, offsets);
    MoeGemmArgs g{};
    g.E = uint32_t(E), g.P = uint32_t(P), g.M = uint32_t(rows), g.N = uint32_t(cols);
    g.lda = uint32_t(M), g.ldb = uint32_t(N), g.ldc = uint32_t(N), g.stride_c = uint32_t(M * N);
    g.alpha = alpha, g.beta = beta;
    d.set_args(4, g);
    d.flops = 2.0 * double(P) * double(rows) * double(cols);
    d.rate = RateClass::gemm;
    d.bytes = double(es) * double(P) * double(rows + cols) +
              double(cs) * double(E) * double(rows) * double(cols) * (beta != 0.f ? 2 : 1);
    d.grid = {ceil_div(cols, kGemmTile), ceil_div(rows, kGemmTile), uint32_t(E)};
    d.threads = {32, 1, 1};
    return d;
  });
}

}  // namespace krnl::metal
