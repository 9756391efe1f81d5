// moe_quantized_matmul on CUDA (op_list.h's notes): moe_gemm (alpha 1) with every expert's W_e held
// as quantized_matmul's W. moe_gemm's own kernels and tile map (moe_gemm.cuh), instantiated for
// each code width: the A tiles (rows of x), the fragments and the epilogue are moe_gemm's, and each
// B tile is dequantized as it is loaded (moe_tiles.cuh's QuantTileLoader: s q + b in f32, rounded
// to a 16-bit x's dtype for the tensor cores as Metal's quantized kernel rounds each weight; s e2m1(q)
// in mode mxfp4, moe::kMxfp4 in place of the width), so
// no W_e is ever dequantized beyond the block's shared tile, and the offsets (moe_sort's) are read
// on the device only: no host reads, no syncs, graph-capturable.
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "core/ops.h"
#include "moe_gemm.cuh"

namespace krnl::cuda {
namespace {

template <Mode MODE>
void launch_quantized(int64_t bits, int64_t mode, const GemmParams& p, const QuantParams& q, DType dt, int bm,
                      bool vec, unsigned blocks, cudaStream_t s) {
  if (mode == ops::kQuantMxfp4) return launch_gemm<MODE, moe::kMxfp4>(p, dt, bm, 128, vec, blocks, s, q);
  switch (bits) {  // the core allows exactly these
    case 2: return launch_gemm<MODE, 2>(p, dt, bm, 128, vec, blocks, s, q);
    case 3: return launch_gemm<MODE, 3>(p, dt, bm, 128, vec, blocks, s, q);
    case 4: return launch_gemm<MODE, 4>(p, dt, bm, 128, vec, blocks, s, q);
    case 5: return launch_gemm<MODE, 5>(p, dt, bm, 128, vec, blocks, s, q);
    case 6: return launch_gemm<MODE, 6>(p, dt, bm, 128, vec, blocks, s, q);
    default: return launch_gemm<MODE, 8>(p, dt, bm, 128, vec, blocks, s, q);
  }
}

int log2_exact(int64_t v) {  // group_size: 16, 32, 64 or 128 (the core checks)
  int l = 0;
  while ((int64_t(1) << l) < v) ++l;
  return l;
}

}  // namespace

void CudaBackend::moe_quantized_matmul(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor* biases,
                                       const Tensor& offsets, const Tensor& out, bool transpose, int64_t group_size,
                                       int64_t bits, float beta, int64_t mode) {
  OpTimer timer(this);
  const int64_t P = x.size(0), E = w.size(0), O = w.size(1), words = w.size(2), I = words * 32 / bits;
  const int64_t K = transpose ? I : O, N = transpose ? O : I;
  const DType dt = x.dtype();
  if (P == 0 || N == 0) return;
  if (K == 0) {  // an empty sum: beta out over every row (moe_sort's offsets cover them all)
    moe_scale_kernel<<<grid_for(P * N), kThreads, 0, stream_>>>(dt, out.data(), P * N, beta);
    check_launch("moe_quantized_matmul");
    return;
  }
  const bool tc = dt != DType::f32;
  if (tc) require_tensor_cores("moe_quantized_matmul");
  // 16-byte units for x's tiles and the epilogue (the codes' loads are the B loader's own).
  const int64_t unit = 16 / int64_t(dtype_size(dt));
  const bool vec = K % unit == 0 && N % unit == 0 && aligned16({x.data(), out.data()});
  // moe_gemm's tiles (each dequantized B tile serves a whole row tile)
  const RowTiles t = row_tiles(*this, offsets, P, E, N, tc, vec, false, "moe_quantized_matmul");
  GemmParams p{x.data(), nullptr, out.data(), reinterpret_cast<const int4*>(t.map.data()), offsets.ptr<int32_t>(),
               P, 0, N, K, 0, 0, t.tiles_n, dt, 1.f, beta};
  // Scales and biases (none in mode mxfp4): expert 0's (O, groups) is contiguous (the core
  // checks); experts by stride.
  const QuantParams q{static_cast<const uint32_t*>(w.data()), scales.data(), biases ? biases->data() : nullptr,
                      words, scales.size(2), scales.strides()[0], biases ? biases->strides()[0] : 0,
                      log2_exact(group_size), scales.dtype()};
  if (transpose)
    launch_quantized<Mode::linear>(bits, mode, p, q, dt, t.bm, vec, unsigned(t.blocks), stream_);
  else
    launch_quantized<Mode::input_grad>(bits, mode, p, q, dt, t.bm, vec, unsigned(t.blocks), stream_);
  check_launch("moe_quantized_matmul");
}

}  // namespace krnl::cuda
