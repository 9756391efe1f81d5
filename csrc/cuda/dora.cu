// DoRA's ops (op_list.h's notes; python/krnl/models/dora.py): the per-column scale of an activation
// and its backward, and the per-output norm of W + s B A. Apart from elementwise.cu, whose flat
// kernels take no row strides: these take 2-D views whose rows may be strided (column blocks of
// q|k|v). In-place calls are safe: each element is read before the same thread writes it.
#include <cmath>

#include "common.cuh"

namespace krnl::cuda {
namespace {

constexpr int kColumns = 32;  // scale_columns_backward: columns a block sums (one warp wide) ...
constexpr int kLanes = 32;    // ... and the row lanes that share them (partials summed in lane order)

__global__ void scale_columns_kernel(DType dt, const void* x, int64_t ldx, const float* v, void* out, int64_t ldo,
                                     int64_t rows, int64_t cols) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, j = i % cols;
    st(dt, out, r * ldo + j, ld(dt, x, r * ldx + j) * v[j]);
  }
}

// Block (kColumns, kLanes) over columns blockIdx.x * kColumns.. of row block blockIdx.y: lane y takes
// rows y, y + kLanes, ... of the block; dv's entry is the lanes' partials added in lane order, so it
// depends on the block's rows only.
__global__ void scale_columns_bwd_kernel(DType dt, const void* dy, int64_t ldy, const void* x, int64_t ldx,
                                         const float* v, void* dx, int64_t ldd, float* dv, int64_t per,
                                         int64_t cols) {
  __shared__ float part[kLanes][kColumns];
  const int64_t j = int64_t(blockIdx.x) * kColumns + threadIdx.x, r0 = int64_t(blockIdx.y) * per;
  float acc = 0.f;
  if (j < cols) {
    const float vj = v[j];
    for (int64_t r = r0 + threadIdx.y; r < r0 + per; r += kLanes) {
      const float d = ld(dt, dy, r * ldy + j);
      acc += d * ld(dt, x, r * ldx + j);
      st(dt, dx, r * ldd + j, d * vj);
    }
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    float total = 0.f;
    for (int l = 0; l < kLanes; ++l) total += part[l][threadIdx.x];
    dv[int64_t(blockIdx.y) * cols + j] = total;
  }
}

__global__ void dora_norm_kernel(DType dt, const float* w2, const void* B, const float* Q, const void* m, float alpha,
                                 float* scale, float* inv_norm, int64_t M, int64_t r) {
  for (int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; o < M; o += int64_t(gridDim.x) * blockDim.x) {
    float dot = 0.f;
    for (int64_t k = 0; k < r; ++k) dot += ld(dt, B, o * r + k) * Q[k * M + o];
    const float norm = sqrtf(fmaxf(w2[o] + alpha * dot, 0.f));
    scale[o] = ld(dt, m, o) / norm;
    inv_norm[o] = 1.f / norm;
  }
}

}  // namespace

void CudaBackend::scale_columns(const Tensor& x, const Tensor& v, const Tensor& out) {
  OpTimer timer(this);
  const int64_t rows = x.size(0), cols = x.size(1);
  if (!rows || !cols) return;
  scale_columns_kernel<<<grid_for(rows * cols), kThreads, 0, stream_>>>(
      x.dtype(), x.data(), x.strides()[0], v.ptr<float>(), out.data(), out.strides()[0], rows, cols);
  check_launch("scale_columns");
}

void CudaBackend::scale_columns_backward(const Tensor& dy, const Tensor& x, const Tensor& v, const Tensor& dx,
                                         const Tensor& dv) {
  OpTimer timer(this);
  const int64_t cols = x.size(1), S = dv.size(0);
  if (!cols) return;
  const dim3 grid(unsigned((cols + kColumns - 1) / kColumns), unsigned(S)), block(kColumns, kLanes);
  scale_columns_bwd_kernel<<<grid, block, 0, stream_>>>(x.dtype(), dy.data(), dy.strides()[0], x.data(),
                                                        x.strides()[0], v.ptr<float>(), dx.data(), dx.strides()[0],
                                                        dv.ptr<float>(), x.size(0) / S, cols);
  check_launch("scale_columns_backward");
}

void CudaBackend::dora_norm(const Tensor& w2, const Tensor& B, const Tensor& Q, const Tensor& m, float alpha,
                            const Tensor& scale, const Tensor& inv_norm) {
  OpTimer timer(this);
  const int64_t M = B.size(0);
  if (!M) return;
  dora_norm_kernel<<<grid_for(M), kThreads, 0, stream_>>>(B.dtype(), w2.ptr<float>(), B.data(), Q.ptr<float>(),
                                                          m.data(), alpha, scale.ptr<float>(),
                                                          inv_norm.ptr<float>(), M, B.size(1));
  check_launch("dora_norm");
}

}  // namespace krnl::cuda
