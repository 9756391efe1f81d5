// Kernel argument structs shared by the host (csrc/metal, C++) and the kernels (metal/*.metal, MSL).
// Bound as `constant XxxArgs& args [[buffer(i)]]` on the kernel side and as the raw struct bytes on
// the host side (setBytes). Only 4-byte fields, so the layout is identical on both sides.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
// bfloat is MSL 3.1's (__METAL_VERSION__ 310, the check MLX makes; Apple's compiler then also
// defines __HAVE_BFLOAT__). Every bf16 block of metal/*.metal is `#if KRNL_BF16`, so that this is
// the one place that says when they compile: the host compiles 3.1 where the GPU has native bf16.
#if __METAL_VERSION__ >= 310
#define KRNL_BF16 1
#else
#define KRNL_BF16 0
#endif
#else
#include <cstdint>
#endif

#ifdef __cplusplus
#ifndef __METAL_VERSION__
namespace krnl::metal {
#endif
#endif

// fill (x = alpha), add (out = a + b), axpy (y += alpha * x), scale (out = alpha * x), cast.
struct ElementwiseArgs {
    uint32_t n;      // number of elements
    float    alpha;
    float    beta;   // reserved (0)
};

// rmsnorm_forward: x (rows, cols); y (rows, cols) at row stride ldy (cols, or the wider buffer a
// LoRA fold widens: python/krnl/models/lora_fold.py); w (cols,); rstd (rows,) f32. vec4 != 0: the host
// promises cols, ldy and x's and y's buffer offsets multiples of 4 elements (vector accesses).
struct RmsnormArgs {
    uint32_t rows;
    uint32_t cols;
    float    eps;
    uint32_t ldy;
    uint32_t vec4;
};

// softmax_causal_forward: S, P (rows, tk) with rows = batch * tq; query row r sits at position
// q = r % tq + tk - tq. has_segments != 0: buffer(2) holds (tk,) i32 segment ids (tq == tk); when 0
// buffer(2) must still be bound (any buffer) and is not read. window > 0: only keys j with
// q - j < window are visible (0: no sliding window). has_sinks as has_segments, for buffer(4).
struct SoftmaxArgs {
    uint32_t rows;
    uint32_t tq;
    uint32_t tk;
    float    scale;
    uint32_t has_segments;
    uint32_t window;
    uint32_t has_sinks;     // buffer(4): sinks (rows / tq,) f32, one per score matrix
};

// attention_forward / attention_backward (metal/attention.metal): q (Hq, T, D), k, v (Hk, T, D),
// query head h reads KV head h / (Hq / Hk). Query i sees key j iff j <= i, and i - j < window where
// window > 0, and seg[i] == seg[j] where has_segments != 0 (segments (T,) i32 bound; when 0 the
// segment buffer must still be bound and is not read).
// A dispatch may cover part of the grid (the per-dispatch budget, csrc/metal/policy.h): its
// threadgroup (x, y) stands for row block x + block0 of head y + head0.
struct AttentionArgs {
    uint32_t Hq;
    uint32_t Hk;
    uint32_t T;
    uint32_t D;
    uint32_t window;
    uint32_t has_segments;
    float    scale;
    uint32_t head0;
    uint32_t block0;
    uint32_t has_sinks;     // the forward's sinks (Hq,) f32 buffer: read where != 0, else bound only
};

// swiglu_forward (s = silu(g) * u) and swiglu_backward (dg, du from ds, g, u): flat buffers of n
// elements. limit > 0: gpt-oss's clamped form (metal/swiglu.metal) with alpha; else plain, alpha unread.
struct SwigluArgs {
    uint32_t n;
    float    alpha;
    float    limit;
};

// geglu_forward (s = gelu_tanh(g) * u) and geglu_backward (dg, du from ds, g, u): flat buffers of n
// elements.
struct GegluArgs {
    uint32_t n;
};

// softcap (out = cap * tanh(x / cap)) and softcap_backward (dx = dy * (1 - (y / cap)^2)): flat
// buffers of n elements.
struct SoftcapArgs {
    uint32_t n;
    float    cap;
};

// scale_columns (out = x * v[column]) and scale_columns_backward (dx = dy * v[column]; dv (blocks,
// cols) f32, row s the column sums of dy * x over the s-th block of `per` rows): (rows, cols) views
// at row strides ldx (x), ldo (out, or dx) and ldy (dy, backward only).
struct ScaleColumnsArgs {
    uint32_t rows;
    uint32_t cols;
    uint32_t ldx;
    uint32_t ldo;
    uint32_t ldy;
    uint32_t per;
};

// dora_norm: B (M, r), Q (r, M) f32, m, w2, scale, inv_norm (M,); n = sqrt(max(w2 + alpha B.Q, 0)).
struct DoraNormArgs {
    uint32_t M;
    uint32_t r;
    float    alpha;
};

// rope: x (rows, D) in place with rows = batch * T, row r at time t = r % T; positions (T,) i32,
// inv_freq (R,) f32 with 2 * R <= D; theta = sign * positions[t] * inv_freq[i].
struct RopeArgs {
    uint32_t rows;
    uint32_t T;
    uint32_t D;
    uint32_t R;
    float    sign;
};

// rmsnorm_backward: dy, x (rows, cols); w (cols,); rstd (rows,) f32 from the forward; dx (rows,
// cols) at row stride ldx. has_residual != 0: dx += residual (buffer(6), dx's dtype, row stride
// ldr), added after dx is rounded (what an axpy after the norm leaves); when 0, buffer(6) must
// still be bound and is not read. rmsnorm_backward_dw reads only rows and cols (dy, x contiguous).
struct RmsnormBackwardArgs {
    uint32_t rows;
    uint32_t cols;
    uint32_t ldx;
    uint32_t ldr;
    uint32_t has_residual;
};

// softmax_backward: P, dP, dS (rows, cols); dS = P * (dP - rowsum(dP * P)) * scale.
struct SoftmaxBackwardArgs {
    uint32_t rows;
    uint32_t cols;
    float    scale;
};

// gemm (metal/gemm.metal): C = alpha * op(A) * op(B) + beta * C per batch entry b = grid.z, with
// the matrices at element offsets b * stride_* (0 broadcasts). C is (M, N); op(A) (M, K); op(B)
// (K, N); lda/ldb/ldc are the row strides of the stored matrices. Plain kernels: grid
// (ceil(N/tile), ceil(M/tile), batch), one threadgroup per output tile (gemm.metal's variants:
// tile32 32 threads, 32x32; steel64 128 threads, 64x64; steel32 128 threads, 32x32).
// Split-K partial kernels (batch must be 1): grid.z = split s covers k in
// [s * k_split, min(K, (s + 1) * k_split)) and writes alpha-free fp32 partials to
// buffer(2) at s * M * N (dense, row stride N); alpha and beta are ignored there.
struct GemmArgs {
    uint32_t M;
    uint32_t N;
    uint32_t K;
    uint32_t lda;
    uint32_t ldb;
    uint32_t ldc;
    uint32_t stride_a;
    uint32_t stride_b;
    uint32_t stride_c;
    uint32_t k_split;   // K-slice length of the split-K partial kernels (K for plain)
    float    alpha;
    float    beta;
};

// gemm_reduce: C[m, n] = alpha * sum_s partials[s, m, n] + beta * C[m, n] (C row stride ldc),
// summed in s order; one thread per output element.
struct GemmReduceArgs {
    uint32_t M;
    uint32_t N;
    uint32_t ldc;
    uint32_t splits;
    float    alpha;
    float    beta;
};

// cross_entropy: logits, dlogits (rows, V) (dlogits may be the same buffer as logits: each row
// is fully read before it is written); targets (rows,) i32; loss (rows,) f32 = logsumexp - x[y].
// Rows whose target is ignore_index get loss 0 and a zero gradient. write_grad != 0: dlogits =
// scale * (softmax - onehot(y)); when 0, buffer(3) must still be bound and is not written.
// scale_by != 0: the factor is scale * scale_by[0] (buffer(5), (1,) f32, formed once in f32), a
// per-step value a replayed step reads from the device; when 0, buffer(5) is bound, never read.
// One threadgroup per row.
struct CrossEntropyArgs {
    uint32_t rows;
    uint32_t V;
    int32_t  ignore_index;
    float    scale;
    uint32_t write_grad;
    uint32_t scale_by;
};

// embedding_forward: out (n, C) = table (V, C)[ids (n,) i32]; embedding_backward: dtable (V, C)
// f32 += dout (n, C) scattered by ids, deterministic (each column summed in token order).
// Ids are checked on the host before the dispatch, except moe_gather's tokens (moe_sort's, written
// on the GPU): embedding_forward gathers its rows too.
struct EmbeddingArgs {
    uint32_t n;
    uint32_t C;
    uint32_t V;
};

// adamw_update over flat f32 params, grads, m, v (n,), PyTorch's AdamW: g = grads * grad_scale;
// p -= decay * p; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= step_size * m / (sqrt(v) / bc2_sqrt + eps), with step_size = lr / (1 - b1^t),
// bc2_sqrt = sqrt(1 - b2^t), decay = lr * weight_decay computed on the host. The working-copy
// variants also store p into buffer(4) (f32 or f16).
// device_scalars != 0: step_size, bc2_sqrt, decay and grad_scale come from the device instead:
// hyper (buffer(6), (5,) f32 [step_size, bc2_sqrt, decay, inv_denom, max_norm]), sq (buffer(7),
// (1,) f32, the grads' sum of squares), flag (buffer(8), (1,) i32, read only when use_flag != 0);
// norm = sqrt(sq) * inv_denom, clip = max_norm > 0 ? min(1, max_norm / (norm + 1e-6)) : 1,
// grad_scale = clip * inv_denom, and nothing is written when flag != 0 or sq is inf/NaN. When
// device_scalars is 0, buffers 6..8 are bound and never read.
struct AdamwArgs {
    uint32_t n;
    float    step_size;
    float    bc2_sqrt;
    float    decay;
    float    beta1;
    float    beta2;
    float    eps;
    float    grad_scale;
    uint32_t device_scalars;
    uint32_t use_flag;
    uint32_t l2;  // Adam: decay is weight_decay and g += decay * p replaces p -= decay * p
};

// sgd_update (torch.optim.SGD) over flat f32 params, grads, buf (n,): g = grads * grad_scale + wd p;
// with momentum, buf = keep buf + in g, g = nesterov ? g + momentum buf : buf; p -= lr g. lr, keep
// and in from the host, or hyper [lr, keep, in, inv_denom, max_norm] (device_scalars, as AdamwArgs).
struct SgdArgs {
    uint32_t n;
    float    lr;
    float    keep;
    float    in;
    float    weight_decay;
    float    momentum;
    float    grad_scale;
    uint32_t use_momentum;
    uint32_t nesterov;
    uint32_t device_scalars;
    uint32_t use_flag;
};

// lion_update over flat f32 params, grads, m (n,): g = grads * grad_scale; p -= decay p;
// p -= lr sign(beta1 m + (1 - beta1) g); m = beta2 m + (1 - beta2) g. lr and decay from the host,
// or hyper [lr, decay, -, inv_denom, max_norm] (device_scalars, as AdamwArgs).
struct LionArgs {
    uint32_t n;
    float    lr;
    float    decay;
    float    beta1;
    float    beta2;
    float    grad_scale;
    uint32_t device_scalars;
    uint32_t use_flag;
};

// adafactor_update over one parameter (B, R, C) f32 with row (B, R) and col (B, C) f32 moments and
// a scratch `work` (2 B R + B + 2,) f32: [per-row sums of params^2 | of u^2 | each entry's
// max(mean(row), eps1) | alpha | the step alpha / max(1, rms(u) / d)], six dispatches
// (optimizer.metal). rho, beta2t, decay and grad_scale from the host, or hyper [rho, beta2t, decay,
// inv_denom, max_norm] (device_scalars, as AdamwArgs).
struct AdafactorArgs {
    uint32_t B;
    uint32_t R;
    uint32_t C;
    float    rho;
    float    beta2t;
    float    decay;
    float    eps1;
    float    eps2;
    float    d;
    float    grad_scale;
    uint32_t device_scalars;
    uint32_t use_flag;
};

// adamw8bit_update: AdamwArgs' step_size, bc2_sqrt, decay (params *= 1 - decay here), betas, eps,
// grad_scale and device scalars, and 1 - beta1, 1 - beta2 as the host formed them (c1, c2).
struct Adamw8bitArgs {
    uint32_t n;
    float    step_size;
    float    bc2_sqrt;
    float    decay;
    float    beta1;
    float    beta2;
    float    c1;
    float    c2;
    float    eps;
    float    grad_scale;
    uint32_t device_scalars;
    uint32_t use_flag;
};

// muon_momentum over grads, buf, out (n,) f32: buf = lerp(buf, g, 1 - momentum), out = nesterov ?
// lerp(g, buf, momentum) : buf with g = grads * grad_scale; then sumsq_partial/sumsq_finish of out
// into a scratch (1,) and muon_momentum_normalize: out /= max(sqrt(sum), eps). grad_scale from
// the host, or (device_scalars, as AdamwArgs) from hyper's inv_denom and max_norm.
struct MuonArgs {
    uint32_t n;
    float    momentum;
    float    eps;
    float    grad_scale;
    uint32_t nesterov;
    uint32_t device_scalars;
    uint32_t use_flag;
};

// muon_update over params, update (n,) f32: params = params * (1 - decay) - lr * scale * update;
// lr and decay from the host, or hyper [lr, -, decay, inv_denom, max_norm] (device_scalars; only
// the skip is read of the rest).
struct MuonUpdateKArgs {
    uint32_t n;
    float    lr;
    float    decay;
    float    scale;
    uint32_t device_scalars;
    uint32_t use_flag;
};

// sumsq (two passes): sumsq_partial: threadgroup g reduces x[g * chunk, min(n, (g + 1) * chunk))
// into partials[g] (f32); sumsq_finish: one threadgroup sums partials[0, groups) in a fixed order
// into out[0] (f32). Deterministic for a given chunk and threadgroup size.
// nonfinite: flag[0] (i32) = 1 if any element of x (n,) is inf or NaN, else untouched.
struct ReduceArgs {
    uint32_t n;
    uint32_t chunk;
    uint32_t groups;
};

// dropout: out = keep ? x / (1 - p) : 0 with keep = krnl::dropout_keep(seed, i, p) of
// csrc/core/rng.h (the same mask as every other backend). use_offset != 0: the seed is
// krnl::dropout_seed(seed, offset[0], offset[1]) with offset (2,) i32 at buffer(3) (a per-step
// value a replayed step reads from the device); when 0, buffer(3) is bound, never read.
struct DropoutArgs {
    uint32_t n;
    uint32_t seed_lo;
    uint32_t seed_hi;
    float    p;
    float    keep_scale;
    uint32_t use_offset;
    uint32_t row_width;   // use_offset and row_width > 0: offset[2] is x's first row in its batch
};

// transpose_heads: out (B, A, D) = x (A, B, D) with the first two axes swapped. Rows of heads
// h < rotate turn as rope turns them (positions (T,) i32 and inv_freq (R,) f32 bound at 3 and
// 4): h is b with heads_axis 1 (x (T, H, D)), else a; t is the other index.
struct TransposeHeadsArgs {
    uint32_t A;
    uint32_t B;
    uint32_t D;
    uint32_t rotate;      // 0: a plain copy (positions and inv_freq not read)
    uint32_t R;
    uint32_t heads_axis;
    float    sign;
};

// quantized_matmul: out (N, M) = x (N, K) op(W) + beta * out, W (O, I) from packed codes
// (O, words) and scales/biases (O, groups); transpose: K = I, M = O; else K = O, M = I.
// A dispatch may compute a block of a larger product: out's columns [m0, m0 + M) of the whole
// (rows of W in transpose, columns of W otherwise, m0 then a multiple of 8), with out bound at
// column m0 and x, out at the block's first row; M and N are the block's.
struct QuantizedMatmulArgs {
    uint32_t N;
    uint32_t M;
    uint32_t K;
    uint32_t words;       // 32-bit words per row of W (I * bits / 32)
    uint32_t group_size;
    float    beta;
    uint32_t ldx;         // row strides of x and out (column blocks of a wider matrix allowed)
    uint32_t ldo;
    uint32_t m0;          // the block's first column of the whole product (0: the whole)
    uint32_t groups;      // groups per W row (I / group_size of the whole W): scales' row stride
};

// quantized_embedding: out (n, C) = rows ids of a table (V, C) quantized like quantized_matmul's W.
struct QuantizedEmbeddingArgs {
    uint32_t n;
    uint32_t C;
    uint32_t V;
    uint32_t words;       // 32-bit words per row of the table (C * bits / 32)
    uint32_t group_size;
};

// Mixture of experts (metal/moe.metal; csrc/core/op_list.h's notes): N tokens, E experts, K
// experts per token, P = N K pairs. moe_route: logits (N, E), ids (N, K) i32, weights (N, K) f32;
// norm != 0 divides the weights by their sum. moe_route_backward: dweights (N, K) f32, dlogits
// (N, E); has_dprobs != 0: dprobs (E,) f32 at buffer(4), else buffer(4) is bound and never read.
struct MoeRouteArgs {
    uint32_t N;
    uint32_t E;
    uint32_t K;
    uint32_t norm;
    uint32_t has_dprobs;
};

// moe_sort: ids (N, K) i32 -> tokens (P,), slot (N, K), offsets (E + 1,), all i32; counts (T, E)
// u32 the scratch of its one threadgroup of T threads.
struct MoeSortArgs {
    uint32_t P;
    uint32_t K;
    uint32_t E;
};

// moe_combine: out (N, C) = beta out + sum_k weights[t, k] ys[slot[t, k]] with ys (P, C);
// has_weights == 0: every weight 1 (buffer(2) bound, never read). moe_combine_backward: dys (P,
// C) and dweights (N, K) f32 from dout (N, C), ys, slot and weights (beta, has_weights unused).
struct MoeCombineArgs {
    uint32_t N;
    uint32_t C;
    uint32_t K;
    uint32_t P;
    float    beta;
    uint32_t has_weights;
};

// moe_gemm and moe_gemm_weight_grad (metal/gemm.metal, on gemm_tile). Expert e's rows are rows
// offsets[e]:offsets[e + 1] (clamped into [0, P]) of the (P, lda) and (P, ldb) operands.
// moe_gemm: out (P, ldc) = alpha x op(W_e) + beta out over N columns, x (P, lda) of K columns,
// W_e at e * stride_b with row stride ldb (M, stride_c unused). Threadgroup (x, y) computes
// column tile x of row tile tile0 + y, the experts' row tiles (ceil(n_e / 32) each) numbered in
// expert order; past the last one it exits.
// moe_gemm_weight_grad: out[e] (M, N) = alpha a_e^T b_e + beta out[e], a (P, lda), b (P, ldb),
// out[e] at e * stride_c with row stride ldc; threadgroup (x, y, e) (K, stride_b, tile0 unused).
// A dispatch may compute a block of the output (columns, and rows of each out[e] or a range of
// row tiles), its buffers bound at the block.
struct MoeGemmArgs {
    uint32_t E;
    uint32_t P;
    uint32_t M;
    uint32_t N;
    uint32_t K;
    uint32_t lda;
    uint32_t ldb;
    uint32_t ldc;
    uint32_t stride_b;
    uint32_t stride_c;
    uint32_t tile0;
    float    alpha;
    float    beta;
};

// moe_quantized_matmul (metal/quantized.metal): out (P, ldo) = x (P, ldx) op(W_e) + beta out over
// the rows offsets[e]:offsets[e + 1] (clamped into [0, P]) of each expert e, W_e quantized as
// quantized_matmul's W: codes at e * stride_w of w (words per row), scales and biases at
// e * stride_s (groups per row); transpose (the _t kernels): K = I, out columns rows of W_e; else
// K = O, out columns columns of W_e. Threadgroup (x, y) computes column tile x of row tile
// tile0 + y, the experts' row tiles (ceil(n_e / 32) each) numbered in expert order; past the last
// one it exits. A dispatch may compute a block: M out columns from m0 of the whole (out bound at
// column m0; a multiple of 8) and a range of row tiles (tile0).
struct MoeQuantizedMatmulArgs {
    uint32_t E;
    uint32_t P;
    uint32_t M;
    uint32_t K;
    uint32_t words;       // 32-bit words per row of W_e (I * bits / 32)
    uint32_t group_size;
    uint32_t groups;      // groups per row of W_e (I / group_size)
    float    beta;
    uint32_t ldx;         // row strides of x and out
    uint32_t ldo;
    uint32_t m0;
    uint32_t tile0;
    uint32_t stride_w;    // O * words: one expert's codes
    uint32_t stride_s;    // O * groups: one expert's scales (and biases)
};

#ifdef __cplusplus
#ifndef __METAL_VERSION__
}  // namespace krnl::metal
#endif
#endif
