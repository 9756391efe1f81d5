// GEMM on the Metal kernels (metal/gemm.metal): its plain variants and the per-shape-class choice
// among them, split-K, blocks under the per-dispatch budget and the CPU/GPU row split.
#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/ops.h"
#include "core/split_k.h"
#include "metal/metal_ops.h"
#include "metal/ops_common.h"

namespace krnl::metal {

// kargs.h's GemmArgs (the kernel's view) and the core's (the validated call) share a name.
using CoreGemmArgs = krnl::GemmArgs;
using KernelGemmArgs = krnl::metal::GemmArgs;

// ---- GEMM

// The plain kernels of gemm.metal: the variant's name, its kernel-name infix, its output tile and
// threads per threadgroup (one threadgroup per tile).
struct GemmKernel {
  const char* name;
  const char* infix;
  uint32_t tile_m, tile_n, threads;
};

namespace {

std::string gemm_variant(bool ta, bool tb) { return std::string(ta ? "t" : "n") + (tb ? "t" : "n"); }

constexpr GemmKernel kGemmKernels[] = {
    {"tile32", "", 32, 32, 32},            // today's kernel: the default
    {"steel64", "steel64_", 64, 64, 128},  // 2x2 SIMD-groups of 32x32
    {"steel32", "steel32_", 32, 32, 128},  // 2x2 SIMD-groups of 16x16
};

const GemmKernel* find_gemm_kernel(const std::string& name) {
  for (const auto& k : kGemmKernels)
    if (name == k.name) return &k;
  return nullptr;
}

const char* const kGemmClassDtypes[] = {"f32", "f16", "f16_f32", "bf16", "bf16_f32"};
const char* const kGemmClassForms[] = {"nn", "nt", "tn"};
const char* const kGemmClassSizes[] = {"skinny", "shallow", "medium", "large"};

}  // namespace

const std::vector<std::string>& MetalOps::gemm_variants() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& k : kGemmKernels) v.push_back(k.name);
    return v;
  }();
  return names;
}

std::string MetalOps::gemm_shape_class(int64_t M, int64_t N, int64_t K, int64_t batch, bool trans_a, bool trans_b,
                                       DType a, DType c) {
  const std::string dt = std::string(dtype_name(a)) + (c != a ? std::string("_") + dtype_name(c) : std::string());
  // tt runs as nt (the transpose of B) and then tn: class it by the product, tn
  const std::string form = trans_a && trans_b ? "tn" : gemm_variant(trans_a, trans_b);
  const char* size = std::min(M, N) <= 64              ? "skinny"
                     : K <= 64                         ? "shallow"
                     : double(M) * double(N) * double(std::max<int64_t>(batch, 1)) >= double(1 << 20) ? "large"
                                                       : "medium";
  return dt + "." + form + "." + size;
}

std::vector<std::string> MetalOps::gemm_shape_classes() {
  std::vector<std::string> v;
  for (const char* d : kGemmClassDtypes)
    for (const char* f : kGemmClassForms)
      for (const char* s : kGemmClassSizes) v.push_back(std::string(d) + "." + f + "." + s);
  return v;
}

void MetalOps::set_gemm_choice(const std::string& shape_class, const std::string& variant) {
  if (shape_class != "*") {
    const auto all = gemm_shape_classes();
    if (std::find(all.begin(), all.end(), shape_class) == all.end())
      throw std::invalid_argument("[set_gemm_choice] unknown shape class '" + shape_class +
                                  "' (dtype.form.size, e.g. f16.nt.large, or * for every class)");
  }
  if (variant.empty()) {
    gemm_choice_.erase(shape_class);
    return;
  }
  if (!find_gemm_kernel(variant)) {
    std::string names;
    for (const auto& k : kGemmKernels) names += std::string(names.empty() ? "" : ", ") + k.name;
    throw std::invalid_argument("[set_gemm_choice] unknown GEMM variant '" + variant + "'; " + name() + " has " + names);
  }
  gemm_choice_[shape_class] = variant;
}

void MetalOps::gemm(const CoreGemmArgs& a) {
  Emit e{this, "gemm"};
  e.sfx(a.A.dtype());
  if (a.M == 0 || a.N == 0) return;
  for (int64_t v : {a.M, a.N, a.K, a.lda, a.ldb, a.ldc, a.stride_a, a.stride_b, a.stride_c, a.batch})
    u32("gemm", v, "a size or stride");
  if (a.trans_a && a.trans_b) {
    // No tt kernel (the model never needs one): op(B) = B^T is materialised as Bt = I * B^T by
    // the nt kernel (exact: one product by 1 per element, the rest adds zeros), any ldb and
    // batch stride included; the product then runs as tn.
    const int64_t nb = a.stride_b == 0 ? 1 : a.batch;
    // A buffer from the pool may be one that encoded work of this step still reads (it reuses
    // released buffers in call order): the identity goes in through upload, which waits for that.
    Tensor I = empty({a.K, a.K}, a.B.dtype());
    {
      std::vector<float> eye(size_t(a.K * a.K), 0.f);
      for (int64_t i = 0; i < a.K; ++i) eye[size_t(i * a.K + i)] = 1.f;
      if (a.B.dtype() == DType::f32) {
        upload(I, eye.data());
      } else {
        const bool bf = a.B.dtype() == DType::bf16;
        std::vector<uint16_t> h(eye.size());
        for (size_t i = 0; i < h.size(); ++i) h[i] = bf ? f32_to_bf16(eye[i]) : f32_to_f16(eye[i]);
        upload(I, h.data());
      }
    }
    Tensor Bt = empty({nb, a.K, a.N}, a.B.dtype());
    CoreGemmArgs tr;
    tr.A = I, tr.B = a.B, tr.C = Bt, tr.trans_b = true;
    tr.M = a.K, tr.N = a.N, tr.K = a.K, tr.batch = nb;
    tr.stride_b = a.stride_b, tr.stride_c = a.K * a.N;
    tr.lda = a.K, tr.ldb = a.ldb, tr.ldc = a.N;
    gemm_plain(tr, 0, tr.M);
    CoreGemmArgs t = a;
    t.B = Bt;
    t.trans_b = false;
    t.ldb = a.N;
    t.stride_b = nb == 1 ? 0 : a.K * a.N;
    gemm(t);
    return;
  }
  if (a.split_k > 1) {
    gemm_split_k(a);
    return;
  }
  if (row_split_.enabled && a.batch == 1 && !a.trans_a &&
      2.0 * double(a.M) * double(a.N) * double(a.K) >= double(row_split_.min_flops) && row_split_.cpu_gflops > 0 &&
      row_split_.gpu_gflops > 0) {
    const double gflop = 2e-9 * double(a.M) * double(a.N) * double(a.K);
    RowSplitPlan p = plan_row_split(a.M, 1e3 * gflop / row_split_.cpu_gflops, 1e3 * gflop / row_split_.gpu_gflops,
                                    row_split_.overhead_ms, kGemmTile);
    if (p.cpu_rows > 0) {
      gemm_row_split(a, p.cpu_rows);
      return;
    }
  }
  gemm_plain(a, 0, a.M);
}

// Rows [row0, row0 + rows) of C: op(A)'s rows start row0 rows (n) or row0 columns (t) in. One
// dispatch, or blocks of rows and then columns where one would be estimated over the policy's
// per-dispatch budget (the GPU watchdog cannot be met by cutting command buffers alone).
// Returns the number of dispatches encoded.
size_t MetalOps::gemm_plain(const CoreGemmArgs& a, int64_t row0, int64_t rows) {
  // The variant chosen for this call's shape class (set_gemm_choice), else tile32.
  const GemmKernel* kern = &kGemmKernels[0];
  if (!gemm_choice_.empty()) {
    auto it = gemm_choice_.find(
        gemm_shape_class(rows, a.N, a.K, a.batch, a.trans_a, a.trans_b, a.A.dtype(), a.C.dtype()));
    if (it == gemm_choice_.end()) it = gemm_choice_.find("*");
    if (it != gemm_choice_.end()) kern = find_gemm_kernel(it->second);
  }
  return encode_blocks(rows, a.N, kern->tile_m, kern->tile_n, [&](int64_t r0, int64_t r, int64_t c0, int64_t c) {
    return gemm_block(a, kern, row0 + r0, r, c0, c);
  });
}

// The dispatch of C's block [row0, row0 + rows) x [col0, col0 + cols): op(B)'s columns start col0
// columns (n) or col0 rows (t) in.
Dispatch MetalOps::gemm_block(const CoreGemmArgs& a, const GemmKernel* kern, int64_t row0, int64_t rows,
                              int64_t col0, int64_t cols) {
  Emit e{this, "gemm"};
  const std::string in = e.sfx(a.A.dtype());
  const bool widen = a.C.dtype() != a.A.dtype();  // f16/bf16 operands, f32 C (LoRA gradients)
  Dispatch d = e.make("gemm", std::string("gemm_") + kern->infix + gemm_variant(a.trans_a, a.trans_b) + "_" + in +
                                  (widen ? "_f32" : ""));
  const size_t es = dtype_size(a.A.dtype()), cs = dtype_size(a.C.dtype());
  const int64_t a_off = a.trans_a ? row0 : row0 * a.lda, b_off = a.trans_b ? col0 * a.ldb : col0,
                c_off = row0 * a.ldc + col0;
  const int64_t ar = a.trans_a ? a.K : rows, ac = a.trans_a ? rows : a.K;
  const int64_t br = a.trans_b ? cols : a.K, bc = a.trans_b ? a.K : cols;
  d.bind(0, a.A.storage()->ptr(), a.A.offset() + size_t(a_off) * es, size_t(extent_elems(ar, ac, a.lda, a.stride_a, a.batch)) * es);
  d.bind(1, a.B.storage()->ptr(), a.B.offset() + size_t(b_off) * es, size_t(extent_elems(br, bc, a.ldb, a.stride_b, a.batch)) * es);
  d.bind(2, a.C.storage()->ptr(), a.C.offset() + size_t(c_off) * cs,
         size_t(extent_elems(rows, cols, a.ldc, a.stride_c, a.batch)) * cs);
  KernelGemmArgs g{};
  g.M = uint32_t(rows), g.N = uint32_t(cols), g.K = uint32_t(a.K);
  g.lda = uint32_t(a.lda), g.ldb = uint32_t(a.ldb), g.ldc = uint32_t(a.ldc);
  g.stride_a = uint32_t(a.stride_a), g.stride_b = uint32_t(a.stride_b), g.stride_c = uint32_t(a.stride_c);
  g.k_split = uint32_t(a.K);
  g.alpha = a.alpha, g.beta = a.beta;
  d.set_args(3, g);
  // Aligned: whole tiles everywhere and 16-byte rows, so the kernel drops its edge checks.
  const bool aligned = rows % kern->tile_m == 0 && cols % kern->tile_n == 0 && a.K % kGemmTile == 0 && a.lda % 4 == 0 &&
                       a.ldb % 4 == 0 && a.ldc % 4 == 0 && (a.A.offset() / es + size_t(a_off)) % 4 == 0 &&
                       (a.B.offset() / es + size_t(b_off)) % 4 == 0 && (a.C.offset() / cs + size_t(c_off)) % 4 == 0 &&
                       a.stride_a % 4 == 0 && a.stride_b % 4 == 0 && a.stride_c % 4 == 0;
  d.constant_bool(0, aligned);
  d.flops = 2.0 * double(rows) * double(cols) * double(a.K) * double(a.batch);
  d.rate = RateClass::gemm;
  // What the block reads and writes (a column block of a strided operand binds an extent that
  // spans the whole matrix, but reads only its columns).
  d.bytes = double(a.batch) * (double(es) * double(a.K) * double(rows + cols) +
                               double(cs) * double(rows) * double(cols) * (a.beta != 0.f ? 2.0 : 1.0));
  d.grid = {ceil_div(cols, kern->tile_n), ceil_div(rows, kern->tile_m), uint32_t(a.batch)};
  d.threads = {kern->threads, 1, 1};
  return d;
}

// K in `split_k` slices: fp32 partials (splits, M, N) from one dispatch, then a reduce that
// applies alpha and beta. Batched GEMMs (which the router never splits) loop over entries.
void MetalOps::gemm_split_k(const CoreGemmArgs& a) {
  Emit e{this, "gemm"};
  const std::string in = e.sfx(a.A.dtype()), out = e.sfx(a.C.dtype());
  const int64_t splits = a.split_k, ks = a.K / splits;
  const size_t es = dtype_size(a.A.dtype()), cs = dtype_size(a.C.dtype());
  Tensor ws = empty({splits, a.M, a.N}, DType::f32);  // released after encoding: later records may reuse it
  for (int64_t b = 0; b < a.batch; ++b) {
    Dispatch d = e.make("gemm", "gemm_splitk_" + gemm_variant(a.trans_a, a.trans_b) + "_" + in);
    const int64_t ar = a.trans_a ? a.K : a.M, ac = a.trans_a ? a.M : a.K;
    const int64_t br = a.trans_b ? a.N : a.K, bc = a.trans_b ? a.K : a.N;
    d.bind(0, a.A.storage()->ptr(), a.A.offset() + size_t(b * a.stride_a) * es, size_t(extent_elems(ar, ac, a.lda, 0, 1)) * es);
    d.bind(1, a.B.storage()->ptr(), a.B.offset() + size_t(b * a.stride_b) * es, size_t(extent_elems(br, bc, a.ldb, 0, 1)) * es);
    bind(d, 2, ws);
    KernelGemmArgs g{};
    g.M = uint32_t(a.M), g.N = uint32_t(a.N), g.K = uint32_t(a.K);
    g.lda = uint32_t(a.lda), g.ldb = uint32_t(a.ldb), g.ldc = uint32_t(a.N);
    g.k_split = uint32_t(ks);
    g.alpha = 1.f, g.beta = 0.f;
    d.set_args(3, g);
    d.constant_bool(0, false);
    d.flops = 2.0 * double(a.M) * double(a.N) * double(a.K);
    d.rate = RateClass::gemm;
    d.grid = {ceil_div(a.N, kGemmTile), ceil_div(a.M, kGemmTile), uint32_t(splits)};
    d.threads = {32, 1, 1};
    encode(std::move(d));

    Dispatch r = e.make("gemm", "gemm_reduce_" + out);
    bind(r, 0, ws);
    r.bind(1, a.C.storage()->ptr(), a.C.offset() + size_t(b * a.stride_c) * cs, size_t(extent_elems(a.M, a.N, a.ldc, 0, 1)) * cs);
    GemmReduceArgs ra{uint32_t(a.M), uint32_t(a.N), uint32_t(a.ldc), uint32_t(splits), a.alpha, a.beta};
    r.set_args(2, ra);
    r.grid = {ceil_div(a.N, 32), ceil_div(a.M, 8), 1};
    r.threads = {32, 8, 1};
    encode(std::move(r));
  }
}

// CPU/GPU row split (KRNL report): the GPU takes rows [cpu_rows, M), the CPU's BLAS rows
// [0, cpu_rows) at the same time, reading the shared buffers in place. For f16 operands the CPU
// backend's GEMM makes the fp32 twins (converted per call, not cached: a cached twin of a pool
// buffer could outlive the tensor it copied). Results differ from the pure-GPU GEMM only by the
// two engines' summation orders.
void MetalOps::gemm_row_split(const CoreGemmArgs& a, int64_t cpu_rows) {
  const bool gpu_half = cpu_rows < a.M;  // the planner may give the CPU every row
  const size_t gpu_records = gpu_half ? gemm_plain(a, cpu_rows, a.M - cpu_rows) : 0;
  Dispatch h = Emit{this, "gemm"}.make("gemm", "host_sgemm");
  Backend* cpu = get_device("cpu");
  CoreGemmArgs part = a;
  part.M = cpu_rows;
  part.split_k = 1;
  // The host call sees this device's memory through host views on the CPU device.
  h.host = [cpu, part]() {
    auto host_view = [cpu](const Tensor& t, size_t byte_off, int64_t rows, int64_t cols, int64_t ld) {
      Tensor w = cpu->wrap(static_cast<char*>(t.data()) + byte_off, {rows, ld}, t.dtype(), [] {});
      return ld == cols ? w : w.slice(1, 0, cols);
    };
    const int64_t ar = part.trans_a ? part.K : part.M, ac = part.trans_a ? part.M : part.K;
    const int64_t br = part.trans_b ? part.N : part.K, bc = part.trans_b ? part.K : part.N;
    Tensor A = host_view(part.A, 0, ar, ac, part.lda), B = host_view(part.B, 0, br, bc, part.ldb);
    Tensor C = host_view(part.C, 0, part.M, part.N, part.ldc);
    ops::gemm(A, B, C, part.trans_a, part.trans_b, part.alpha, part.beta, 1, -1, -1, -1, 1);
  };
  h.host_overlap = uint32_t(gpu_records);  // the GPU half just encoded (its blocks) runs alongside
  encode(std::move(h));
}

}  // namespace krnl::metal
