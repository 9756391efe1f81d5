// Dispatch records for every op of the contract on the Metal kernels (docs/architecture.md, 'The Metal backend'). Portable
// C++: runs in CI on the metal-sim device, and on macOS under the Objective-C++ encoder. The core
// has validated every call (shapes, dtypes, devices); what is checked here is only what the
// kernels add: bf16 kernels run only where the GPU has native bf16 (emulated bf16 is ~40x slower
// than f16 before M3; docs/architecture.md, 'Device capabilities'), and argument structs hold
// 32-bit sizes.
#include "metal/metal_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/dtype.h"
#include "core/ops.h"
#include "core/split_k.h"
#include "kargs.h"  // metal/kargs.h, shared with the kernels

namespace krnl::metal {

// kargs.h's GemmArgs (the kernel's view) and the core's (the validated call) share a name.
using CoreGemmArgs = krnl::GemmArgs;
using KernelGemmArgs = krnl::metal::GemmArgs;

// library_names() is defined in sources.cpp, from the table cmake/embed_metal.cmake generates.

namespace {

constexpr uint32_t kEwThreads = 256;   // threads per threadgroup of the grid-stride kernels
constexpr uint32_t kEwMaxGroups = 1024;
constexpr uint32_t kGemmTile = 32;     // gemm.metal's output tile (one SIMD-group per tile)
constexpr uint32_t kReduceChunk = 16384;  // elements per threadgroup in sumsq's first pass

uint32_t u32(const char* op, int64_t v, const char* what) {
  if (v < 0 || v > int64_t(std::numeric_limits<uint32_t>::max()))
    throw std::invalid_argument(std::string("[") + op + "] " + what + " = " + std::to_string(v) +
                                " does not fit the Metal kernels' 32-bit sizes");
  return uint32_t(v);
}

uint32_t ceil_div(int64_t a, int64_t b) { return uint32_t((a + b - 1) / b); }

// Threads per threadgroup of the one-row-per-threadgroup kernels: enough lanes for the row, in
// whole SIMD-groups, at most 256 (more buys nothing for rows of a few thousand elements).
uint32_t row_threads(int64_t cols) {
  const int64_t lanes = std::max<int64_t>(32, std::min<int64_t>(256, (cols + 3) / 4));
  return uint32_t((lanes + 31) / 32 * 32);
}

uint32_t ew_groups(int64_t n) { return std::max<uint32_t>(1, std::min<uint32_t>(kEwMaxGroups, ceil_div(n, kEwThreads))); }

}  // namespace

MetalOps::MetalOps(std::string name, GpuDescription gpu)
    : Backend(std::move(name)), gpu_(std::move(gpu)), cb_policy_(metal::command_buffer_policy(gpu_)) {
  apply_working_set();
}

std::map<std::string, double> MetalOps::compile_libraries() {
  throw NotImplementedError("[compile_libraries] " + name() +
                            " compiles no Metal libraries: its executor compiles the kernels in Python "
                            "(tools/mslsim, tools/mslcuda); only the 'metal' device on a Mac does");
}

// Past the recommended working set macOS pages GPU memory or fails command buffers (MLX gives its
// cache back from 0.95 of it and waits or swaps from 1.5x); a clean error at it is the safe
// default, KRNL_MAX_MEMORY or Device.set_memory_limit move it. 0 (metal-sim by default): no limit.
void MetalOps::apply_working_set() {
  set_default_memory_limit(size_t(gpu_.working_set),
                           "the GPU's recommended working set, MTLDevice.recommendedMaxWorkingSetSize");
}
MetalOps::~MetalOps() = default;

// metal/ has bf16 kernels (inside `#if KRNL_BF16`, on from MSL 3.1: metal/kargs.h); the policy
// offers them only where the GPU runs bf16 natively, and device.mm compiles MSL 3.1 there.
constexpr bool kBf16Kernels = true;

Capabilities MetalOps::capabilities() const {
  Capabilities c = Backend::capabilities();
  c.dtypes = compute_dtypes(gpu_, kBf16Kernels);
  c.compute_dtype = default_compute_dtype(gpu_, kBf16Kernels);
  // metal/attention.metal: every dtype the backend has kernels for (its bf16 kernels sit behind
  // KRNL_BF16, like every family's, so they come with the backend's bf16 policy), every
  // mask of the contract, at the head sizes it instantiates.
  c.fused_attention_dtypes = c.dtypes;
  c.fused_attention_segments = c.fused_attention_window = true;
  c.fused_attention_head_dims = attention_head_dims();
  // The LoRA fold (python/krnl/lora_fold.py) pays by a static count of bytes per LoRA'd
  // projection, each operand moved once (Metal GPUs are bandwidth-bound; docs/architecture.md,
  // 'The fold on Metal'): T rows, N outputs, G members of rank r. The forward's one GEMM saves
  // the rank-r product's write of y and the frozen GEMM's read of it (2 T N elements) for
  // N (G + 1) r + G r^2 more (S rewritten and read whole, less B's reads): it pays above
  // (G + 1) r / 2 rows (32 for q|k|v at r 16; lora_fold.py keeps smaller calls unfolded). The
  // o/down backward saves 2 T in for 2 r in: it pays above r rows. Training's B T rows are far
  // above both (q|k|v -41%, gate/up -53% of bytes at T 4096, C 2048, F 8192, r 16). Not in the
  // count: the FLOPs the wider K adds (G r / C of the frozen GEMM's). Unmeasured on Apple hardware.
  c.lora_fold = true;
  c.details = {{"gpu", gpu_.name},
               {"gpu_family", gpu_.apple_family ? "apple" + std::to_string(gpu_.apple_family) : "below apple7"},
               {"bf16", native_bf16(gpu_) ? std::string("native")
                                          : std::string("emulated by Metal (~40x slower than f16): not offered")},
               {"command_buffer", "at most " + std::to_string(cb_policy_.max_dispatches) + " dispatches or ~" +
                                      std::to_string(int(cb_policy_.max_ms)) + " ms of estimated GPU work, ~" +
                                      std::to_string(int(cb_policy_.max_dispatch_ms)) + " ms a dispatch"}};
  return c;
}

SplitKConfig MetalOps::split_k_config() const {
  SplitKConfig c;
  c.tile_m = c.tile_n = kGemmTile;
  // An output of fewer tiles than this leaves most of an M-series GPU idle (a tile is one
  // SIMD-group; even an M1 keeps a few hundred in flight): split K to make up the difference.
  c.min_tiles = 256;
  c.k_unit = kGemmTile;
  c.max_splits = 16;
  c.min_k_per_split = 256;
  return c;
}

// ---- helpers shared by every op

namespace {

struct Emit {
  MetalOps* self;
  const char* op;

  // Kernel dtype suffix. bf16 only where the GPU has it natively (see the file comment): the
  // library is then compiled as MSL 3.1 and holds the _bf16 kernels.
  std::string sfx(DType d) const {
    switch (d) {
      case DType::f32: return "f32";
      case DType::f16: return "f16";
      case DType::i32: return "i32";
      case DType::bf16:
        if (kBf16Kernels && native_bf16(self->gpu())) return "bf16";
        break;
    }
    throw NotImplementedError(std::string("[") + op + "] bf16 not implemented on " + self->name() +
                              ": this GPU emulates bf16 (~40x slower than f16; native from Apple9, M3); use f16");
  }
  Dispatch make(const char* library, std::string kernel) const {
    Dispatch d;
    d.op = op;
    d.library = library;
    d.kernel = std::move(kernel);
    return d;
  }
};

void bind(Dispatch& d, uint32_t index, const Tensor& t, size_t extent_bytes) {
  d.bind(index, t.storage()->ptr(), t.offset(), extent_bytes);
}
void bind(Dispatch& d, uint32_t index, const Tensor& t) { bind(d, index, t, t.nbytes()); }

// A grid-stride dispatch over n elements.
void ew_geometry(Dispatch& d, int64_t n) {
  d.grid = {ew_groups(n), 1, 1};
  d.threads = {kEwThreads, 1, 1};
}

}  // namespace

// Each op below: the kernel, its buffers (indices as in metal/kargs.h), its geometry.

// ---- GEMM

// The plain kernels of gemm.metal: the variant's name, its kernel-name infix, its output tile and
// threads per threadgroup (one threadgroup per tile).
struct GemmKernel {
  const char* name;
  const char* infix;
  uint32_t tile_m, tile_n, threads;
};

namespace {

int64_t extent_elems(int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t batch) {
  if (rows == 0 || cols == 0) return 0;
  return (batch - 1) * stride + (rows - 1) * ld + cols;
}

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
    Tensor I = empty({a.K, a.K}, a.B.dtype());  // fresh from the pool: no GPU work uses it yet
    {
      std::vector<float> eye(size_t(a.K * a.K), 0.f);
      for (int64_t i = 0; i < a.K; ++i) eye[size_t(i * a.K + i)] = 1.f;
      if (a.B.dtype() == DType::f32) {
        std::memcpy(I.data(), eye.data(), eye.size() * 4);
      } else {
        const bool bf = a.B.dtype() == DType::bf16;
        std::vector<uint16_t> h(eye.size());
        for (size_t i = 0; i < h.size(); ++i) h[i] = bf ? f32_to_bf16(eye[i]) : f32_to_f16(eye[i]);
        std::memcpy(I.data(), h.data(), h.size() * 2);
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
  Dispatch whole = gemm_block(a, kern, row0, rows, 0, a.N);
  const double budget = cb_policy_.max_dispatch_ms;
  if (estimate_ms(whole, cb_policy_) <= budget) {
    encode(std::move(whole));
    return 1;
  }
  const BlockPlan p = plan_blocks(rows, a.N, kern->tile_m, kern->tile_n, budget, [&](int64_t r, int64_t c) {
    return estimate_ms(gemm_block(a, kern, row0, r, 0, c), cb_policy_);
  });
  for (int64_t i = 0; i < rows; i += p.rows)
    for (int64_t j = 0; j < a.N; j += p.cols)
      encode(gemm_block(a, kern, row0 + i, std::min(p.rows, rows - i), j, std::min(p.cols, a.N - j)));
  return size_t(p.row_blocks * p.col_blocks);
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
  Tensor ws = empty({splits, a.M, a.N}, DType::f32);  // released after encoding: reused only after the step
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

// ---- normalisation, activations, attention

void MetalOps::rmsnorm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd, float eps,
                               const Tensor* residual) {
  // A residual add is its own dispatch here (rmsnorm.metal has no fused kernel): the same values.
  if (residual) add(x, *residual, x);
  Emit e{this, "rmsnorm_forward"};
  const std::string s = e.sfx(x.dtype());
  // y in x's dtype, or f32 from bf16 x scaled by f32 w (the kernels rmsnorm.metal has)
  const bool wide = y.dtype() != x.dtype();
  if (wide && !(x.dtype() == DType::bf16 && w.dtype() == DType::f32 && y.dtype() == DType::f32))
    throw NotImplementedError("[rmsnorm_forward] y must have x's dtype (or be f32, from bf16 x and f32 w) on " + name());
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  if (rows == 0) return;
  const int64_t ldy = y.row_stride();  // C, or a LoRA fold's wider buffer (core ops.cpp checked the view)
  const std::string wsfx = w.dtype() != x.dtype() ? "_wf32" : "";  // f32 weights scaling f16/bf16 activations
  Dispatch d = e.make("rmsnorm", "rmsnorm_forward_" + s + wsfx + (wide ? "_yf32" : ""));
  const size_t ys = dtype_size(y.dtype());
  bind(d, 0, x), bind(d, 1, w), bind(d, 3, rstd);
  bind(d, 2, y, size_t(extent_elems(rows, C, ldy, 0, 1)) * ys);
  const bool vec4 = C % 4 == 0 && ldy % 4 == 0 && (x.offset() / dtype_size(x.dtype())) % 4 == 0 && (y.offset() / ys) % 4 == 0;
  d.set_args(4, RmsnormArgs{u32(e.op, rows, "rows"), u32(e.op, C, "cols"), eps, u32(e.op, ldy, "ldy"), vec4 ? 1u : 0u});
  d.grid = {uint32_t(rows), 1, 1};
  d.threads = {row_threads(C), 1, 1};
  encode(std::move(d));
}

void MetalOps::rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                const Tensor& dx, const Tensor* dw, const Tensor* residual) {
  Emit e{this, "rmsnorm_backward"};
  const std::string s = e.sfx(x.dtype());
  // dy and dx in x's dtype, or both f32 with bf16 x and f32 w (the kernels rmsnorm.metal has)
  const bool wide = dy.dtype() != x.dtype();
  if (dx.dtype() != dy.dtype() ||
      (wide && !(x.dtype() == DType::bf16 && w.dtype() == DType::f32 && dy.dtype() == DType::f32)))
    throw NotImplementedError("[rmsnorm_backward] dy and dx must have x's dtype (or both be f32, with bf16 x and f32 w) on " +
                              name());
  const std::string gsfx = wide ? "_dyf32" : "";
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  if (rows == 0) return;
  // dx and residual: C, or a LoRA fold's wider buffers (core ops.cpp checked the views)
  const int64_t ldx = dx.row_stride(), ldr = residual ? residual->row_stride() : C;
  const RmsnormBackwardArgs args{u32(e.op, rows, "rows"), u32(e.op, C, "cols"), u32(e.op, ldx, "ldx"),
                                 u32(e.op, ldr, "ldr"), residual ? 1u : 0u};
  if (dw) {  // first: dx may overwrite dy
    Dispatch d = e.make("rmsnorm", "rmsnorm_backward_dw_" + s + gsfx);
    bind(d, 0, dy), bind(d, 1, x), bind(d, 2, rstd), bind(d, 3, *dw);
    d.set_args(4, args);
    d.grid = {ceil_div(C, 32), 1, 1};  // 32 columns per threadgroup, rows in 8 strands
    d.threads = {32, 8, 1};
    encode(std::move(d));
  }
  Dispatch d = e.make("rmsnorm", "rmsnorm_backward_" + s + (w.dtype() != x.dtype() ? "_wf32" : "") + gsfx);
  const size_t gs = dtype_size(dx.dtype());
  bind(d, 0, dy), bind(d, 1, x), bind(d, 2, w), bind(d, 3, rstd);
  bind(d, 4, dx, size_t(extent_elems(rows, C, ldx, 0, 1)) * gs);
  // The residual add is fused (one pass over dx fewer); without one, buffer(6) is dy, never read.
  if (residual) bind(d, 6, *residual, size_t(extent_elems(rows, C, ldr, 0, 1)) * gs);
  else bind(d, 6, dy);
  d.set_args(5, args);
  d.grid = {uint32_t(rows), 1, 1};
  d.threads = {row_threads(C), 1, 1};
  encode(std::move(d));
}

void MetalOps::swiglu_forward(const Tensor& g, const Tensor& u, const Tensor& s) {
  Emit e{this, "swiglu_forward"};
  Dispatch d = e.make("swiglu", "swiglu_forward_" + e.sfx(g.dtype()));
  if (g.numel() == 0) return;
  bind(d, 0, g), bind(d, 1, u), bind(d, 2, s);
  d.set_args(3, SwigluArgs{u32(e.op, g.numel(), "n")});
  ew_geometry(d, g.numel());
  encode(std::move(d));
}

void MetalOps::swiglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du) {
  Emit e{this, "swiglu_backward"};
  Dispatch d = e.make("swiglu", "swiglu_backward_" + e.sfx(g.dtype()));
  if (g.numel() == 0) return;
  bind(d, 0, ds), bind(d, 1, g), bind(d, 2, u), bind(d, 3, dg), bind(d, 4, du);
  d.set_args(5, SwigluArgs{u32(e.op, g.numel(), "n")});
  ew_geometry(d, g.numel());
  encode(std::move(d));
}

void MetalOps::geglu_forward(const Tensor& g, const Tensor& u, const Tensor& s) {
  Emit e{this, "geglu_forward"};
  Dispatch d = e.make("geglu", "geglu_forward_" + e.sfx(g.dtype()));
  if (g.numel() == 0) return;
  bind(d, 0, g), bind(d, 1, u), bind(d, 2, s);
  d.set_args(3, GegluArgs{u32(e.op, g.numel(), "n")});
  ew_geometry(d, g.numel());
  encode(std::move(d));
}

void MetalOps::geglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du) {
  Emit e{this, "geglu_backward"};
  Dispatch d = e.make("geglu", "geglu_backward_" + e.sfx(g.dtype()));
  if (g.numel() == 0) return;
  bind(d, 0, ds), bind(d, 1, g), bind(d, 2, u), bind(d, 3, dg), bind(d, 4, du);
  d.set_args(5, GegluArgs{u32(e.op, g.numel(), "n")});
  ew_geometry(d, g.numel());
  encode(std::move(d));
}

void MetalOps::softcap(const Tensor& x, float cap, const Tensor& out) {
  Emit e{this, "softcap"};
  Dispatch d = e.make("softcap", "softcap_" + e.sfx(x.dtype()));
  if (x.numel() == 0) return;
  bind(d, 0, x), bind(d, 1, out);
  d.set_args(2, SoftcapArgs{u32(e.op, x.numel(), "n"), cap});
  ew_geometry(d, x.numel());
  encode(std::move(d));
}

void MetalOps::softcap_backward(const Tensor& dy, const Tensor& y, float cap, const Tensor& dx) {
  Emit e{this, "softcap_backward"};
  Dispatch d = e.make("softcap", "softcap_backward_" + e.sfx(y.dtype()));
  if (y.numel() == 0) return;
  bind(d, 0, dy), bind(d, 1, y), bind(d, 2, dx);
  d.set_args(3, SoftcapArgs{u32(e.op, y.numel(), "n"), cap});
  ew_geometry(d, y.numel());
  encode(std::move(d));
}

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
                                      int64_t window) {
  Emit e{this, "softmax_causal_forward"};
  Dispatch d = e.make("softmax", "softmax_causal_forward_" + e.sfx(S.dtype()));
  const int64_t tq = S.size(-2), tk = S.size(-1), rows = tk ? S.numel() / tk : 0;
  if (rows == 0) return;
  bind(d, 0, S), bind(d, 1, P);
  if (segments)
    bind(d, 2, *segments);
  else
    bind(d, 2, S, 0);  // must be bound; not read
  // A window of tk keys or more masks nothing: as 0 it fits the kernel's u32.
  const uint32_t win = window > 0 && window < tk ? uint32_t(window) : 0u;
  d.set_args(3, SoftmaxArgs{u32(e.op, rows, "rows"), uint32_t(tq), uint32_t(tk), scale, segments ? 1u : 0u, win});
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

// q, k, v, the masks' segments (or a dummy binding) and the argument struct, shared by the kernels.
AttentionArgs attention_args(const char* op, const Tensor& q, const Tensor& k, float scale, const Tensor* segments,
                             int64_t window) {
  return AttentionArgs{u32(op, q.size(0), "Hq"), u32(op, k.size(0), "Hk"), u32(op, q.size(1), "T"),
                       u32(op, q.size(2), "D"),  u32(op, window, "window"), segments ? 1u : 0u, scale, 0u, 0u};
}
void bind_segments(Dispatch& d, uint32_t index, const Tensor& q, const Tensor* segments) {
  if (segments)
    bind(d, index, *segments);
  else
    bind(d, index, q, 0);  // must be bound; not read
}

}  // namespace

std::vector<int64_t> MetalOps::attention_head_dims() {
  return std::vector<int64_t>(std::begin(kAttentionHeadDims), std::end(kAttentionHeadDims));
}

void MetalOps::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                                 float scale, const Tensor* segments, int64_t window) {
  Emit e{this, "attention_forward"};
  const int64_t Hq = q.size(0), T = q.size(1), D = q.size(2);
  Dispatch d = e.make("attention", "attention_forward" + attention_size(e.op, name(), D) + e.sfx(q.dtype()));
  const AttentionArgs args = attention_args(e.op, q, k, scale, segments, window);
  if (T == 0 || Hq == 0) return;
  const AttentionTiles t = attention_tiles(D);
  bind(d, 0, q), bind(d, 1, k), bind(d, 2, v), bind(d, 3, o), bind(d, 4, lse);
  bind_segments(d, 5, q, segments);
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
  Tensor delta = empty({Hq, T}, DType::f32);  // (Hq, T) released after encoding: reused only after the step

  Dispatch dd = e.make("attention", "attention_backward_delta_" + sfx);
  bind(dd, 0, o), bind(dd, 1, dout), bind(dd, 2, delta);
  dd.set_args(3, args);
  dd.flops = 2.0 * double(Hq * T * D);
  dd.grid = {ceil_div(Hq * T, 256), 1, 1};
  dd.threads = {256, 1, 1};
  encode(std::move(dd));

  Dispatch dqd = e.make("attention", "attention_backward_dq" + size + sfx);
  bind(dqd, 0, q), bind(dqd, 1, k), bind(dqd, 2, v), bind(dqd, 3, dout), bind(dqd, 4, lse), bind(dqd, 5, delta);
  bind_segments(dqd, 6, q, segments);
  bind(dqd, 7, dq);
  dqd.threads = {32 * t.dq_sg, 1, 1};
  encode_parts(std::move(dqd), 8, args, attention_parts(cb_policy_, AttentionKernel::dq, Hq, Hk, T, D, window, es));

  Dispatch dkv = e.make("attention", "attention_backward_dkv" + size + sfx);
  bind(dkv, 0, q), bind(dkv, 1, k), bind(dkv, 2, v), bind(dkv, 3, dout), bind(dkv, 4, lse), bind(dkv, 5, delta);
  bind_segments(dkv, 6, q, segments);
  bind(dkv, 7, dk), bind(dkv, 8, dv);
  dkv.threads = {32 * t.dkv_sg, 1, 1};
  encode_parts(std::move(dkv), 9, args, attention_parts(cb_policy_, AttentionKernel::dkv, Hq, Hk, T, D, window, es));
}

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

// ---- elementwise

// A grid-stride kernel of elementwise.metal: the tensors at buffers 0, 1, ..., then ElementwiseArgs.
void MetalOps::elementwise(const char* op, const std::string& kernel, std::initializer_list<const Tensor*> tensors,
                           int64_t n, float alpha) {
  if (n == 0) return;
  Dispatch d = Emit{this, op}.make("elementwise", kernel);
  uint32_t i = 0;
  for (const Tensor* t : tensors) bind(d, i++, *t);
  d.set_args(i, ElementwiseArgs{u32(op, n, "n"), alpha, 0.f});
  ew_geometry(d, n);
  encode(std::move(d));
}

void MetalOps::add(const Tensor& a, const Tensor& b, const Tensor& out) {
  elementwise("add", "add_" + Emit{this, "add"}.sfx(a.dtype()), {&a, &b, &out}, a.numel(), 0.f);
}

void MetalOps::axpy(float alpha, const Tensor& x, const Tensor& y) {
  Emit e{this, "axpy"};
  const std::string k = x.dtype() == y.dtype() ? e.sfx(x.dtype()) : e.sfx(x.dtype()) + "_" + e.sfx(y.dtype());
  elementwise("axpy", "axpy_" + k, {&x, &y}, x.numel(), alpha);
}

void MetalOps::scale(const Tensor& x, float alpha, const Tensor& out) {
  elementwise("scale", "scale_" + Emit{this, "scale"}.sfx(x.dtype()), {&x, &out}, x.numel(), alpha);
}

void MetalOps::cast(const Tensor& x, const Tensor& out) {
  Emit c{this, "cast"};
  // i32 -> i32 is a copy of 4-byte words: the f32 copy kernel moves the bits unchanged.
  const std::string src = x.dtype() == DType::i32 ? "f32" : c.sfx(x.dtype());
  const std::string dst = out.dtype() == DType::i32 ? "f32" : c.sfx(out.dtype());
  elementwise("cast", "cast_" + src + "_" + dst, {&x, &out}, x.numel(), 0.f);
}

void MetalOps::fill(const Tensor& x, double value) {
  const std::string s = Emit{this, "fill"}.sfx(x.dtype());
  // alpha carries the value as a float (the i32 kernel saturates it as the CPU backend does);
  // i32 values beyond float's 24-bit mantissa would round, so they are written from the host.
  if (x.dtype() == DType::i32 && std::abs(value) > 16777216.0 && !std::isnan(value)) {
    throw NotImplementedError("[fill] i32 values beyond +-2^24 are not implemented on " + name());
  }
  elementwise("fill", "fill_" + s, {&x}, x.numel(), float(value));
}

void MetalOps::dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, const Tensor* seed_offset) {
  Emit e{this, "dropout"};
  const std::string s = e.sfx(x.dtype());
  if (p == 0.f) {
    cast(x, out);  // same dtype: a copy
    return;
  }
  Dispatch d = e.make("elementwise", "dropout_" + s);
  if (x.numel() == 0) return;
  bind(d, 0, x), bind(d, 1, out);
  if (seed_offset)
    bind(d, 3, *seed_offset);
  else
    bind(d, 3, x, 0);  // must be bound; not read
  const int64_t width = seed_offset && seed_offset->numel() == 3 ? (x.shape().empty() ? 1 : x.shape().back()) : 0;
  d.set_args(2, DropoutArgs{u32(e.op, x.numel(), "n"), uint32_t(seed), uint32_t(seed >> 32), p, 1.f / (1.f - p),
                            seed_offset ? 1u : 0u, u32(e.op, width, "row width")});
  ew_geometry(d, x.numel());
  encode(std::move(d));
}

void MetalOps::transpose_heads(const Tensor& x, const Tensor& out, const Tensor* positions, const Tensor* inv_freq,
                               int64_t rotate, float sign, int64_t heads_axis) {
  Emit e{this, "transpose_heads"};
  // i32 moves as f32 bits (positions, ids): the kernel only copies.
  Dispatch d = e.make("elementwise", "transpose_heads_" + (x.dtype() == DType::i32 ? "f32" : e.sfx(x.dtype())));
  const int64_t A = x.size(0), B = x.size(1), D = x.size(2);
  if (x.numel() == 0) return;
  bind(d, 0, x), bind(d, 1, out);
  const bool turn = rotate > 0;
  if (turn)
    bind(d, 3, *positions), bind(d, 4, *inv_freq);
  else
    bind(d, 3, x, 0), bind(d, 4, x, 0);  // must be bound; not read
  const uint32_t R = turn ? uint32_t(inv_freq->numel()) : 0u;
  d.set_args(2, TransposeHeadsArgs{u32(e.op, A, "A"), u32(e.op, B, "B"), u32(e.op, D, "D"), uint32_t(rotate), R,
                                   uint32_t(heads_axis), sign});
  // One row of D per (x-lanes, b, a): the lanes stride over D (by 4 when D % 4 == 0).
  const uint32_t lanes = uint32_t(std::min<int64_t>(32, std::max<int64_t>(1, D % 4 == 0 ? D / 4 : D)));
  const uint32_t ty = std::max<uint32_t>(1, 64 / lanes);
  d.grid = {1, ceil_div(B, ty), uint32_t(A)};
  d.threads = {lanes, ty, 1};
  encode(std::move(d));
}

// ---- quantized weights

namespace {

constexpr int64_t kQmmTile = 32;     // quantized.metal's tiled form: 32x32 out tiles, 128 threads
constexpr int64_t kQmvRows = 8;      // its few-row form: x rows per row block,
constexpr int64_t kQmvCols = 8;      // and out columns per threadgroup (2 SIMD-groups of 4, 64 threads)
constexpr int64_t kQmvMaxN = 8;      // the host takes the few-row form up to this many rows (`t` only)

// One quantized_matmul dispatch computing the block out[n0 : n0 + rows, m0 : m0 + cols] of the
// whole product out = x op(W) (+ beta out), the interface of QuantizedMatmulArgs (kargs.h): x and
// out bound at row n0, out at column m0; m0 a row of W (transpose) or a column of W, then a
// multiple of 8. `few`: the few-row form (transpose products of at most kQmvMaxN rows), else the
// tiled one. The caller encodes it; quantized_matmul calls it once per block.
Dispatch quantized_matmul_block(const Emit& e, const Tensor& x, const Tensor& w, const Tensor& scales,
                                const Tensor& biases, const Tensor& out, bool transpose, int64_t group_size,
                                int64_t bits, float beta, int64_t n0, int64_t rows, int64_t m0, int64_t cols, bool few) {
  const int64_t N = x.size(0), K = x.size(1), M = out.size(1);
  if (n0 < 0 || rows < 1 || n0 + rows > N || m0 < 0 || cols < 1 || m0 + cols > M || (!transpose && m0 % 8 != 0))
    throw std::invalid_argument(std::string("[") + e.op + "] block rows [" + std::to_string(n0) + ", " +
                                std::to_string(n0 + rows) + "), columns [" + std::to_string(m0) + ", " +
                                std::to_string(m0 + cols) + ") is not inside (" + std::to_string(N) + ", " +
                                std::to_string(M) + ")" + (transpose ? "" : " with its first column a multiple of 8"));
  const bool sf32 = scales.dtype() != x.dtype();  // f32 scales and biases with 16-bit x
  Dispatch d = e.make("quantized", std::string("quantized_matmul_") + (few ? "tv_" : transpose ? "t_" : "n_") +
                                       e.sfx(x.dtype()) + (sf32 ? "_sf32" : "") + "_b" + std::to_string(bits));
  const int64_t ldx = x.strides()[0], ldo = out.strides()[0];  // column-block views allowed
  const size_t xsz = dtype_size(x.dtype()), osz = dtype_size(out.dtype());
  d.bind(0, x.storage()->ptr(), x.offset() + size_t(n0 * ldx) * xsz, size_t(extent_elems(rows, K, ldx, 0, 1)) * xsz);
  bind(d, 1, w), bind(d, 2, scales), bind(d, 3, biases);
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
  d.bytes = double(xsz) * double(rows) * double(K) +
            w_elems * (double(bits) / 8 + 2.0 * double(dtype_size(scales.dtype())) / double(group_size)) +
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

void MetalOps::quantized_matmul(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor& biases,
                                const Tensor& out, bool transpose, int64_t group_size, int64_t bits, float beta) {
  Emit e{this, "quantized_matmul"};
  const int64_t N = x.size(0), M = out.size(1);
  if (N == 0 || M == 0) return;
  // The form is the whole product's (a block of a tiled product computes what it would have).
  const bool few = transpose && N <= kQmvMaxN;
  const int64_t tile_rows = few ? N : kQmmTile, tile_cols = few ? kQmvCols : kQmmTile;
  auto block = [&](int64_t n0, int64_t rows, int64_t m0, int64_t cols) {
    return quantized_matmul_block(e, x, w, scales, biases, out, transpose, group_size, bits, beta, n0, rows, m0, cols,
                                  few);
  };
  Dispatch whole = block(0, N, 0, M);
  const double budget = cb_policy_.max_dispatch_ms;
  if (estimate_ms(whole, cb_policy_) <= budget) {
    encode(std::move(whole));
    return;
  }
  // Over the per-dispatch budget (the watchdog; policy.h): blocks of rows, then columns.
  const BlockPlan p = plan_blocks(N, M, tile_rows, tile_cols, budget, [&](int64_t r, int64_t c) {
    return estimate_ms(block(0, r, 0, c), cb_policy_);
  });
  for (int64_t i = 0; i < N; i += p.rows)
    for (int64_t j = 0; j < M; j += p.cols) encode(block(i, std::min(p.rows, N - i), j, std::min(p.cols, M - j)));
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

// ---- optimizer

void MetalOps::adamw_update(const AdamWArgs& a) {
  Emit e{this, "adamw_update"};
  const int64_t n = a.params.numel();
  if (n == 0) return;
  const bool working = a.working.defined();
  Dispatch d = e.make("optimizer", working ? "adamw_update_working_" + e.sfx(a.working.dtype()) : std::string("adamw_update"));
  bind(d, 0, a.params), bind(d, 1, a.grads), bind(d, 2, a.m), bind(d, 3, a.v);
  if (working) bind(d, 4, a.working);
  // The device scalars (or dummy bindings, never read: the kernels read them only as the flags say).
  const bool dev = a.hyper.defined(), flag = a.flag.defined();
  bind(d, 6, dev ? a.hyper : a.params, dev ? a.hyper.nbytes() : 0);
  bind(d, 7, dev ? a.sq : a.params, dev ? a.sq.nbytes() : 0);
  bind(d, 8, flag ? a.flag : a.params, flag ? a.flag.nbytes() : 0);
  // Bias corrections in double on the host, as the CPU backend computes them.
  const double bc1 = 1.0 - std::pow(double(a.beta1), double(a.step));
  const double bc2 = 1.0 - std::pow(double(a.beta2), double(a.step));
  d.set_args(5, AdamwArgs{u32(e.op, n, "n"), float(double(a.lr) / bc1), float(std::sqrt(bc2)), a.lr * a.weight_decay,
                          a.beta1, a.beta2, a.eps, a.grad_scale, dev ? 1u : 0u, flag ? 1u : 0u});
  ew_geometry(d, n);
  encode(std::move(d));
}

void MetalOps::sumsq(const Tensor& x, const Tensor& out) {
  Emit e{this, "sumsq"};
  const int64_t n = x.numel();
  const uint32_t groups = std::max<uint32_t>(1, ceil_div(n, kReduceChunk));
  const ReduceArgs args{u32(e.op, n, "n"), kReduceChunk, groups};
  Tensor partials = empty({int64_t(groups)}, DType::f32);
  Dispatch d = e.make("optimizer", "sumsq_partial_" + e.sfx(x.dtype()));
  bind(d, 0, x), bind(d, 1, partials);
  d.set_args(2, args);
  d.grid = {groups, 1, 1};
  d.threads = {256, 1, 1};
  encode(std::move(d));
  Dispatch f = e.make("optimizer", "sumsq_finish");
  bind(f, 0, partials), bind(f, 1, out);
  f.set_args(2, args);
  f.grid = {1, 1, 1};
  f.threads = {256, 1, 1};
  encode(std::move(f));
}

void MetalOps::nonfinite(const Tensor& x, const Tensor& flag) {
  Emit e{this, "nonfinite"};
  Dispatch d = e.make("optimizer", "nonfinite_" + e.sfx(x.dtype()));
  const int64_t n = x.numel();
  if (n == 0) return;
  bind(d, 0, x), bind(d, 1, flag);
  d.set_args(2, ReduceArgs{u32(e.op, n, "n"), 0, 0});
  ew_geometry(d, n);
  encode(std::move(d));
}

}  // namespace krnl::metal
