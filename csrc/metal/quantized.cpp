// quantized_matmul, moe_quantized_matmul and quantized_embedding on the Metal kernels
// (metal/quantized.metal): the tiled and few-row forms, and blocks under the per-dispatch budget.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/dtype.h"
#include "core/ops.h"
#include "metal/metal_ops.h"
#include "metal/ops_common.h"

namespace krnl::metal {

// ---- quantized weights

namespace {

constexpr int64_t kQmmTile = 32;     // quantized.metal's tiled form: 32x32 out tiles, 128 threads
constexpr int64_t kQmvRows = 8;      // its few-row form: x rows per row block,
constexpr int64_t kQmvCols = 8;      // and out columns per threadgroup (2 SIMD-groups of 4, 64 threads)
constexpr int64_t kQmvMaxN = 8;      // the host takes the few-row form up to this many rows (`t` only)

// A kernel name's layout: _b<bits>, or _mxfp4 (quantized.metal's file comment).
std::string layout_suffix(int64_t bits, int64_t mode) {
  return mode == ops::kQuantMxfp4 ? "_mxfp4" : "_b" + std::to_string(bits);
}

// One quantized_matmul dispatch computing the block out[n0 : n0 + rows, m0 : m0 + cols] of the
// whole product out = x op(W) (+ beta out), the interface of QuantizedMatmulArgs (kargs.h): x and
// out bound at row n0, out at column m0; m0 a row of W (transpose) or a column of W, then a
// multiple of 8. `few`: the few-row form (transpose products of at most kQmvMaxN rows), else the
// tiled one. The caller encodes it; quantized_matmul calls it once per block.
Dispatch quantized_matmul_block(const Emit& e, const Tensor& x, const Tensor& w, const Tensor& scales,
                                const Tensor* biases, const Tensor& out, bool transpose, int64_t group_size,
                                int64_t bits, float beta, int64_t mode, int64_t n0, int64_t rows, int64_t m0,
                                int64_t cols, bool few) {
  const int64_t N = x.size(0), K = x.size(1), M = out.size(1);
  if (n0 < 0 || rows < 1 || n0 + rows > N || m0 < 0 || cols < 1 || m0 + cols > M || (!transpose && m0 % 8 != 0))
    throw std::invalid_argument(std::string("[") + e.op + "] block rows [" + std::to_string(n0) + ", " +
                                std::to_string(n0 + rows) + "), columns [" + std::to_string(m0) + ", " +
                                std::to_string(m0 + cols) + ") is not inside (" + std::to_string(N) + ", " +
                                std::to_string(M) + ")" + (transpose ? "" : " with its first column a multiple of 8"));
  const bool sf32 = scales.dtype() != x.dtype();  // f32 scales and biases with 16-bit x
  Dispatch d = e.make("quantized", std::string("quantized_matmul_") + (few ? "tv_" : transpose ? "t_" : "n_") +
                                       e.sfx(x.dtype()) + (sf32 ? "_sf32" : "") + layout_suffix(bits, mode));
  const int64_t ldx = x.strides()[0], ldo = out.strides()[0];  // column-block views allowed
  const size_t xsz = dtype_size(x.dtype()), osz = dtype_size(out.dtype());
  d.bind(0, x.storage()->ptr(), x.offset() + size_t(n0 * ldx) * xsz, size_t(extent_elems(rows, K, ldx, 0, 1)) * xsz);
  bind(d, 1, w), bind(d, 2, scales), bind(d, 3, biases ? *biases : scales);  // mxfp4: bound, never read
  d.bind(4, out.storage()->ptr(), out.offset() + size_t(n0 * ldo + m0) * osz,
         size_t(extent_elems(rows, cols, ldo, 0, 1)) * osz);
  d.set_args(5, QuantizedMatmulArgs{u32(e.op, rows, "N"), u32(e.op, cols, "M"), u32(e.op, K, "K"),
                                    u32(e.op, w.size(1), "words"), uint32_t(group_size), beta, u32(e.op, ldx, "ldx"),
                                    u32(e.op, ldo, "ldo"), u32(e.op, m0, "m0"), u32(e.op, scales.size(1), "groups")});
  // the kernels index scales, codes and x, out rows in 32 bits (their pointers in 64)
  u32(e.op, (N - 1) * std::max(ldx, ldo) + std::max(K, M), "x and out extents");
  u32(e.op, scales.numel(), "scales' size");
  d.flops = 2.0 * double(rows) * double(cols) * double(K);
  d.rate = few ? RateClass::quantized_rows : RateClass::quantized_tiled;
  // Each operand once: x's rows, the codes, scales and biases of the block's W rows (t) or
  // columns (n), out's block (read too when beta != 0).
  const double w_elems = double(cols) * double(K);  // of W, for this block's outputs
  const double params = biases ? 2.0 : 1.0;         // scales and biases, or scales alone
  d.bytes = double(xsz) * double(rows) * double(K) +
            w_elems * (double(bits) / 8 + params * double(dtype_size(scales.dtype())) / double(group_size)) +
            double(osz) * double(rows) * double(cols) * (beta != 0.f ? 2.0 : 1.0);
  if (few) {
    d.grid = {ceil_div(cols, kQmvCols), ceil_div(rows, kQmvRows), 1};
    d.threads = {64, 1, 1};
  } else {
    d.grid = {ceil_div(cols, kQmmTile), ceil_div(rows, kQmmTile), 1};
    d.threads = {128, 1, 1};
  }
  return d;
}

}  // namespace

void MetalOps::quantized_matmul(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor* biases,
                                const Tensor& out, bool transpose, int64_t group_size, int64_t bits, float beta,
                                int64_t mode) {
  Emit e{this, "quantized_matmul"};
  const int64_t N = x.size(0), M = out.size(1);
  if (N == 0 || M == 0) return;
  // The form is the whole product's (a block of a tiled product computes what it would have).
  const bool few = transpose && N <= kQmvMaxN;
  const int64_t tile_rows = few ? N : kQmmTile, tile_cols = few ? kQmvCols : kQmmTile;
  encode_blocks(N, M, tile_rows, tile_cols, [&](int64_t n0, int64_t rows, int64_t m0, int64_t cols) {
    return quantized_matmul_block(e, x, w, scales, biases, out, transpose, group_size, bits, beta, mode, n0, rows, m0,
                                  cols, few);
  });
}

// moe_quantized_matmul: quantized_matmul's tiled form per expert (quantized.metal's
// moe_quantized_matmul_{t,n}_*) on moe_gemm's tile map: the grid's y runs over the experts' row
// tiles, numbered across experts (the host cannot know which expert a tile falls to: offsets are
// moe_sort's, on the GPU), at most (P + 31 E) / 32 of them. Cut into blocks under the per-dispatch
// budget as moe_gemm is, by ranges of those row tiles and by out columns; a block's estimate counts
// its tiles as full, bounded by all P rows, and reads at most one W_e per row tile.
void MetalOps::moe_quantized_matmul(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor* biases,
                                    const Tensor& offsets, const Tensor& out, bool transpose, int64_t group_size,
                                    int64_t bits, float beta, int64_t mode) {
  Emit e{this, "moe_quantized_matmul"};
  const int64_t P = x.size(0), K = x.size(1), M = out.size(1);
  const int64_t E = w.size(0), O = w.size(1), words = w.size(2), G = scales.size(2);
  if (P == 0 || M == 0) return;
  const bool sf32 = scales.dtype() != x.dtype();  // f32 scales and biases with 16-bit x
  const std::string kernel = std::string("moe_quantized_matmul_") + (transpose ? "t_" : "n_") + e.sfx(x.dtype()) +
                             (sf32 ? "_sf32" : "") + layout_suffix(bits, mode);
  const int64_t ldx = x.strides()[0], ldo = out.strides()[0];
  const size_t xsz = dtype_size(x.dtype()), osz = dtype_size(out.dtype()), ssz = dtype_size(scales.dtype());
  // sum over experts of ceil(n_e / 32) <= (P + 31 E) / 32: the row tiles the grid's y runs over
  const int64_t tiles = (P + (kQmmTile - 1) * E) / kQmmTile;
  // the kernel indexes within an expert's codes and scales, x's and out's rows, tiles in 32 bits
  u32(e.op, P, "P"), u32(e.op, K, "x's columns"), u32(e.op, M, "out's columns"), u32(e.op, E, "E");
  u32(e.op, tiles * kQmmTile, "the row tiles' rows");
  u32(e.op, O * words, "one expert's code words"), u32(e.op, O * G, "one expert's scales");
  u32(e.op, (P - 1) * std::max(ldx, ldo) + std::max(K, M), "x and out extents");
  encode_blocks(tiles * kQmmTile, M, kQmmTile, kQmmTile, [&](int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
    Dispatch d = e.make("quantized", kernel);
    bind(d, 0, x), bind(d, 1, w), bind(d, 2, scales), bind(d, 3, biases ? *biases : scales);  // mxfp4: never read
    d.bind(4, out.storage()->ptr(), out.offset() + size_t(c0) * osz, size_t(extent_elems(P, cols, ldo, 0, 1)) * osz);
    bind(d, 5, offsets);
    MoeQuantizedMatmulArgs a{};
    a.E = uint32_t(E), a.P = uint32_t(P), a.M = uint32_t(cols), a.K = uint32_t(K);
    a.words = uint32_t(words), a.group_size = uint32_t(group_size), a.groups = uint32_t(G), a.beta = beta;
    a.ldx = uint32_t(ldx), a.ldo = uint32_t(ldo), a.m0 = uint32_t(c0), a.tile0 = uint32_t(r0 / kQmmTile);
    a.stride_w = uint32_t(O * words), a.stride_s = uint32_t(O * G);
    d.set_args(6, a);
    const double n = double(std::min(rows, P));                                           // rows at most
    const double experts = double(std::min<int64_t>(E, ceil_div(rows, kQmmTile)));       // W_e read at most
    d.flops = 2.0 * n * double(cols) * double(K);
    d.rate = RateClass::quantized_tiled;
    d.bytes = double(xsz) * n * double(K) +
              experts * double(cols) * double(K) *
                  (double(bits) / 8 + (biases ? 2.0 : 1.0) * double(ssz) / double(group_size)) +
              double(osz) * n * double(cols) * (beta != 0.f ? 2.0 : 1.0);
    d.grid = {ceil_div(cols, kQmmTile), ceil_div(rows, kQmmTile), 1};
    d.threads = {128, 1, 1};
    return d;
  });
}

void MetalOps::quantized_embedding(const Tensor& ids, const Tensor& w, const Tensor& scales, const Tensor& biases,
                                   const Tensor& out, int64_t group_size, int64_t bits) {
  Emit e{this, "quantized_embedding"};
  const int64_t V = w.size(0), C = out.size(-1), n = ids.numel();
  // ids come from uploads, never from an earlier kernel of the step: host-visible and final
  ops::check_ids(e.op, "id", "position", ids.ptr<int32_t>(), n, V);
  if (n == 0 || C == 0) return;
  const bool sf32 = scales.dtype() != out.dtype();
  Dispatch d = e.make("quantized", "quantized_embedding_" + e.sfx(out.dtype()) + (sf32 ? "_sf32" : "") + "_b" +
                                       std::to_string(bits));
  bind(d, 0, ids), bind(d, 1, w), bind(d, 2, scales), bind(d, 3, biases), bind(d, 4, out);
  d.set_args(5, QuantizedEmbeddingArgs{u32(e.op, n, "n"), u32(e.op, C, "C"), u32(e.op, V, "V"),
                                       u32(e.op, w.size(1), "words"), uint32_t(group_size)});
  u32(e.op, n * C, "n * C");
  ew_geometry(d, n * C);
  encode(std::move(d));
}

}  // namespace krnl::metal
