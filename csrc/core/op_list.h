// The op list (docs/architecture.md, 'The op contract'): every op of the backend contract once, as X(name, (parameters)).
// Generated from it: the Backend virtuals (backend.h), their "[op] not implemented" defaults
// (backend.cpp), the core's entry points (ops.h) and the backends' override declarations
// (KRNL_OVERRIDE_OP in cpu_backend.h, cuda_backend.h, metal_ops.h). Adding an op here declares
// them all; ops_<family>.cpp then defines the entry point (its validation), each of those
// backends defines its override (or leaves the op out of its header, with the reason), and
// bindings/ops.cpp binds it by hand with its argument names, defaults and docstring
// (tests/test_core.py checks that every op of this list is bound).
//
// Expanded where Tensor, GemmArgs and the optimizers' *Args are declared (backend.h) or visible (the backends'
// classes), so nothing is included.
// Notes on single ops (a comment cannot sit inside the macro's lines):
// - attention_forward/backward: fused causal attention (docs/architecture.md, 'Attention'; flash form). q (Hq, T,
//   D), k and v (Hk, T, D), query head h reads KV head h / (Hq / Hk); o (Hq, T, D); lse (Hq, T)
//   f32, the natural-log sum of exp(scale * q.k) over the keys each query sees, which is all
//   backward keeps of the scores. Backward overwrites dq, dk, dv. Query i sees key j iff j <= i,
//   and i - j < window where window > 0 (sliding window), and seg[i] == seg[j] where segments
//   (T,) i32 are given (packed samples). Capabilities say which of these a backend's fused op takes.
//   sinks (Hq,) f32 where given (gpt-oss): one unscaled logit per query head that joins every row's
//   softmax as a column without a value, p_j = exp(s_j) / (exp(sinks[h]) + sum_j exp(s_j)); lse then
//   includes it, so backward (from lse and D = rowsum(dO * O)) takes no sinks.
// - swiglu_forward/backward: s = silu(g) * u where limit <= 0 (alpha must be 1); where limit > 0
//   gpt-oss's clamped form, g' = min(g, limit), u' = clamp(u, -limit, limit), s = g' sigmoid(alpha g')
//   (u' + 1), gradients through the clamps where the input is within the bounds, bounds included
//   (torch.clamp's). Elementwise: outputs may alias inputs.
// - geglu_forward/backward: Gemma's gated MLP, s = gelu_tanh(g) * u with gelu_tanh(x) = 0.5 x (1 +
//   tanh(sqrt(2/pi) (x + 0.044715 x^3))) (transformers' "gelu_pytorch_tanh"); shapes and dtypes as
//   swiglu_forward/backward, and like them elementwise, so outputs may alias inputs.
// - softcap/softcap_backward: Gemma 2's soft-capping, out = cap * tanh(x / cap) (out may be x);
//   the backward takes the forward's OUTPUT y, dx = dy (1 - (y / cap)^2), so x need not be kept.
// - softmax_causal_forward: query row i of S (..., Tq, Tk) sits at position q = i + Tk - Tq and sees
//   key j iff j <= q, q - j < window where window > 0, and seg[q] == seg[j] where segments are given:
//   attention_forward's mask, so a query row block r0:r1 scored against keys :r1 is masked right.
//   sinks (A,) f32 where given, A the product of S's leading dims: one logit per (Tq, Tk) matrix
//   joins each row's softmax as attention_forward's sinks do (unscaled; rows then sum to < 1), and
//   softmax_backward needs nothing more (the sink column's dP is 0).
// - scale_columns/scale_columns_backward: a per-column scale of an (N, M) activation, DoRA's per-output
//   magnitude ratio (python/krnl/models/dora.py). x and out (N, M) of one floating dtype, contiguous or
//   row-strided 2-D views (column blocks of a wider buffer), v (M,) f32: out[n, j] = x[n, j] v[j]; out
//   may be x. The backward: dx = dy * v (dy, x, dx of x's dtype and shape, dx may be dy) and dv (S, M) f32
//   overwritten, row s the sum of dy * x over the s-th block of N / S consecutive rows (S > 1: the
//   sample order's per-sample sums), in an order that depends on the block's rows only.
// - dora_norm: DoRA's per-output norm of W + s B A from small products (models/dora.py): B (M, r) and
//   m (M,) of one floating dtype, w2 (M,) f32 the squared row norms of W, Q (r, M) f32; per output o,
//   n = sqrt(max(w2[o] + alpha sum_k B[o, k] Q[k, o], 0)), scale[o] = m[o] / n, inv_norm[o] = 1 / n
//   (both (M,) f32). With Q = A W^T + (s / 2) A A^T B^T and alpha = 2 s, n = ||W_o + s B_o A||.
// - quantized_matmul: W (O, I) quantized as MLX does (affine, per group of group_size consecutive
//   inputs of a row; bits 2, 3, 4, 5, 6, 8; group_size 16, 32, 64, 128): w (O, I * bits / 32) i32
//   holds each row's codes q as one little-endian bit stream, element j at bit j * bits (codes of
//   3, 5 and 6 bits straddle words); scales and biases (O, I / group_size) in x's dtype or f32;
//   W[o, j] = scales[o, j / gs] * q + biases[o, j / gs]. transpose: out (N, O) = x (N, I) W^T (a
//   linear's forward); else out (N, I) = x (N, O) W (its input gradient). out = that + beta * out,
//   accumulated in f32; x and out may be row-strided 2-D views. Never a full dequantized W per
//   call beyond one transient (O, I) matrix in x's dtype (CUDA's cuBLAS path, which rounds W to a
//   16-bit x's dtype first, as MLX and bitsandbytes do; Metal's tiled kernel rounds each
//   dequantized weight to a 16-bit x's dtype too, tile by tile). mode (ops.h's QuantMode): 0
//   affine (the above; biases required), 1 mxfp4 (OCP microscaling, MLX's mode="mxfp4" and
//   gpt-oss's experts): bits 4, group_size 32, biases null, codes packed as affine 4-bit ones,
//   W[o, j] = scales[o, j / 32] * e2m1(q) with q's bit 3 the sign and bits 0-2 indexing
//   [0, 0.5, 1, 1.5, 2, 3, 4, 6]; scales hold the E8M0 powers of two 2^(e - 127) in f32 or a bf16
//   x's bf16 (both hold every one exactly), never f16 (2^-25 and below, 2^16 and above lost).
// - quantized_embedding: out (n, C) = rows ids (n,) of a table (V, C) held as quantized_matmul's W
//   (w (V, C * bits / 32), scales and biases (V, C / group_size) in out's dtype or f32),
//   dequantized; an embedding that stays quantized (and doubles as a tied head). Ids are checked.
// - Per-step scalars from device tensors, so that a step recorded once as a graph (whose scalar
//   arguments are frozen) still sees each step's values: cross_entropy's scale_by (1,) f32 makes
//   the gradient factor scale * scale_by[0] (formed once in f32); dropout's seed_offset (2,) i32
//   holds a uint64 (low word, high word) and the mask's seed becomes (seed + offset) mod 2^64 &
//   0x7FFFFFFFFFFFFFFF (a (3,) seed_offset adds x's first row r0 in its batch: element i draws
//   the mask bit of index i + r0 * x.shape[-1], the whole batch's bit for it); adamw_update's hyper (5,) f32 [step_size, bc2_sqrt, decay, inv_denom,
//   max_norm] with sq (1,) f32 (sumsq of the accumulated grads) and flag (1,) i32 (nonfinite's)
//   replace lr, weight_decay, step and grad_scale, clip by the global norm on the device, and skip
//   the whole update (nothing written) when flag[0] != 0 or sq[0] is not finite.
// - The other optimizer updates (sgd_update, lion_update, adafactor_update, muon_momentum,
//   muon_update, adamw8bit_update; backend.h's *Args say each one's semantics): their hyper (5,) f32 holds three
//   numbers of their own, then inv_denom and max_norm, clipped and skipped on as adamw_update's.
// - Token-major attention (where Backend::token_major_attention()): attention_forward/backward's
//   q, o, dout, dq (B, T, Hq, D) and k, v, dk, dv (B, T, Hk, D) may be views whose rows of D are
//   contiguous, e.g. the q, k and v columns of one (B T, heads D) projection; lse (B, Hq, T); B
//   sequences in one call, no segments. rope with token_major turns such an x (B, T, H, D) in
//   place, positions (B, T) (or (T,) shared by every sequence).
// - transpose_heads: out (B, A, D) = x (A, B, D) with the first two axes swapped: token-major
//   (T, H, D) projections to head-major (H, T, D) attention operands and back. With positions
//   (T,) i32 and inv_freq (R,) f32 the rows of heads h < rotate also turn as `rope` turns them
//   (sign +1 forward, -1 backward) on the way: one pass instead of a transpose and two ropes.
//   heads_axis names x's head axis (1: x (T, H, D), 0: x (H, T, D)); positions index the other.
// - Mixture of experts (docs/architecture.md, 'Experts'): N tokens, E experts, K experts per token,
//   P = N K (token, expert) pairs. moe_route: p = softmax(logits (N, E)) in f32; ids (N, K) i32 the K
//   largest p of each row in descending order, a tie going to the lower expert (a fixed rule: torch.topk
//   leaves the order of ties unspecified);
//   weights (N, K) f32 their p, divided by their sum where norm. moe_route_backward overwrites
//   dlogits (N, E) (logits' dtype) given dweights (N, K) f32 (recomputing p), dprobs (E,) f32 where
//   given added to every row's gradient of p (the load-balancing loss's). moe_sort groups the pairs
//   by expert, stably: pair (t, k) goes to position s = slot[t, k] (slot (N, K) i32), tokens[s] = t
//   (tokens (P,) i32), expert e holds positions offsets[e]:offsets[e + 1] (offsets (E + 1,) i32, E
//   from its length). moe_gather: out (P, C) = rows tokens of x (N, C) (embedding_forward's work,
//   but with tokens written by an earlier kernel of the step, which no host may read). moe_combine: out
//   (N, C) = beta out + sum over k in order of weights[t, k] (1 without weights) ys[slot[t, k]], ys
//   (P, C), accumulated in f32 (without weights it is the gather's backward). moe_combine_backward
//   overwrites dys[slot[t, k]] = weights[t, k] dout[t] and dweights[t, k] = dout[t] . ys[slot[t, k]]
//   (f32). moe_gemm: rows offsets[e]:offsets[e + 1] of x times expert e of w (E, O, I): transpose,
//   out (P, O) = alpha x (P, I) W_e^T + beta out (a linear), else out (P, I) = alpha x (P, O) W_e +
//   beta out (its input gradient); x, w and out of one dtype, f32 accumulation. moe_gemm_weight_grad:
//   out[e] (M, N) = alpha a_e^T b_e + beta out[e] over the rows of expert e of a (P, M) and b (P, N);
//   out f32 or a's dtype; an expert without rows gets beta out[e]. moe_quantized_matmul: moe_gemm
//   (alpha 1) with every expert's W_e held as quantized_matmul's W: w (E, O, I * bits / 32) i32,
//   scales and biases (E, O, I / group_size) in x's dtype or f32, mode as there; no expert is
//   dequantized whole beyond one transient tile (quantized_matmul's rule per expert). offsets must
//   be moe_sort's: they rise from 0 to P (the CPU checks; GPUs trust them).
#pragma once

// Every op. The list comes in three parts, so that each use takes those it needs:
// - gemm, apart because the backend gets the router's GemmArgs while the core's entry point takes
//   tensors and flags (ops.h declares it by hand). krnl::GemmArgs in full: metal/kargs.h has a
//   GemmArgs of its own in krnl::metal, where MetalOps expands this list.
// - the fused attention pair, apart because a backend may have it in some builds only (CUDA: with
//   cuDNN), so that its header can still take every other override from here.
// - the rest.
#define KRNL_OPS(X)                  \
  KRNL_OPS_BUT_FUSED_ATTENTION(X)    \
  KRNL_FUSED_ATTENTION_OPS(X)

// The ops whose core entry point takes the backend's parameters unchanged: all but gemm.
#define KRNL_DIRECT_OPS(X)                  \
  KRNL_DIRECT_OPS_BUT_FUSED_ATTENTION(X)    \
  KRNL_FUSED_ATTENTION_OPS(X)

#define KRNL_OPS_BUT_FUSED_ATTENTION(X)   \
  X(gemm, (const krnl::GemmArgs& a))      \
  KRNL_DIRECT_OPS_BUT_FUSED_ATTENTION(X)

#define KRNL_FUSED_ATTENTION_OPS(X)                                                                                 \
  X(attention_forward, (const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,      \
                        float scale, const Tensor* segments, int64_t window, const Tensor* sinks))                  \
  X(attention_backward, (const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& dout,    \
                         const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv, float scale,      \
                         const Tensor* segments, int64_t window))

#define KRNL_DIRECT_OPS_BUT_FUSED_ATTENTION(X) \
  KRNL_DIRECT_OPS_BUT_ATTENTION_AND_MOE(X)     \
  KRNL_MOE_OPS(X)

// Mixture-of-experts: routing, grouping by expert, grouped GEMMs and the weighted combine (notes above).
#define KRNL_MOE_OPS(X)                                                                                             \
  X(moe_route, (const Tensor& logits, const Tensor& ids, const Tensor& weights, bool norm))                          \
  X(moe_route_backward, (const Tensor& logits, const Tensor& ids, const Tensor& dweights, const Tensor& dlogits,    \
                         bool norm, const Tensor* dprobs))                                                          \
  X(moe_sort, (const Tensor& ids, const Tensor& tokens, const Tensor& slot, const Tensor& offsets))                  \
  X(moe_gather, (const Tensor& x, const Tensor& tokens, const Tensor& out))                                        \
  X(moe_combine, (const Tensor& ys, const Tensor& slot, const Tensor* weights, const Tensor& out, float beta))      \
  X(moe_combine_backward, (const Tensor& dout, const Tensor& ys, const Tensor& slot, const Tensor& weights,         \
                           const Tensor& dys, const Tensor& dweights))                                              \
  X(moe_gemm, (const Tensor& x, const Tensor& w, const Tensor& offsets, const Tensor& out, bool transpose,           \
               float alpha, float beta))                                                                            \
  X(moe_gemm_weight_grad, (const Tensor& a, const Tensor& b, const Tensor& offsets, const Tensor& out, float alpha, \
                           float beta))                                                                             \
  X(moe_quantized_matmul, (const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor* biases,             \
                           const Tensor& offsets, const Tensor& out, bool transpose, int64_t group_size,             \
                           int64_t bits, float beta, int64_t mode))

#define KRNL_DIRECT_OPS_BUT_ATTENTION_AND_MOE(X)                                                                    \
  X(rmsnorm_forward, (const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd, float eps,           \
                      const Tensor* residual))                                                                      \
  X(rmsnorm_backward, (const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dx,    \
                       const Tensor* dw, const Tensor* residual))                                                   \
  X(swiglu_forward, (const Tensor& g, const Tensor& u, const Tensor& s, float alpha, float limit))                 \
  X(swiglu_backward, (const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du,       \
                      float alpha, float limit))                                                                    \
  X(geglu_forward, (const Tensor& g, const Tensor& u, const Tensor& s))                                             \
  X(geglu_backward, (const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du))       \
  X(softcap, (const Tensor& x, float cap, const Tensor& out))                                                       \
  X(softcap_backward, (const Tensor& dy, const Tensor& y, float cap, const Tensor& dx))                             \
  X(scale_columns, (const Tensor& x, const Tensor& v, const Tensor& out))                                           \
  X(scale_columns_backward, (const Tensor& dy, const Tensor& x, const Tensor& v, const Tensor& dx,                  \
                             const Tensor& dv))                                                                     \
  X(dora_norm, (const Tensor& w2, const Tensor& B, const Tensor& Q, const Tensor& m, float alpha,                   \
                const Tensor& scale, const Tensor& inv_norm))                                                       \
  X(rope, (const Tensor& x, const Tensor& positions, const Tensor& inv_freq, float sign, bool token_major))        \
  X(softmax_causal_forward, (const Tensor& S, const Tensor& P, float scale, const Tensor* segments,                 \
                             int64_t window, const Tensor* sinks))                                                  \
  X(softmax_backward, (const Tensor& P, const Tensor& dP, const Tensor& dS, float scale))                           \
  X(embedding_forward, (const Tensor& ids, const Tensor& table, const Tensor& out))                                 \
  X(embedding_backward, (const Tensor& ids, const Tensor& dout, const Tensor& dtable))                              \
  X(cross_entropy, (const Tensor& logits, const Tensor& targets, const Tensor& loss, const Tensor* dlogits,         \
                    int32_t ignore_index, float scale, const Tensor* scale_by))                                     \
  X(add, (const Tensor& a, const Tensor& b, const Tensor& out))                                                     \
  X(axpy, (float alpha, const Tensor& x, const Tensor& y))                                                          \
  X(scale, (const Tensor& x, float alpha, const Tensor& out))                                                       \
  X(cast, (const Tensor& x, const Tensor& out))                                                                     \
  X(transpose_heads, (const Tensor& x, const Tensor& out, const Tensor* positions, const Tensor* inv_freq,          \
                      int64_t rotate, float sign, int64_t heads_axis))                                              \
  X(quantized_matmul, (const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor* biases,                 \
                       const Tensor& out, bool transpose, int64_t group_size, int64_t bits, float beta,             \
                       int64_t mode))                                                                               \
  X(quantized_embedding, (const Tensor& ids, const Tensor& w, const Tensor& scales, const Tensor& biases,            \
                          const Tensor& out, int64_t group_size, int64_t bits))                                     \
  X(fill, (const Tensor& x, double value))                                                                          \
  X(dropout, (const Tensor& x, const Tensor& out, float p, uint64_t seed, const Tensor* seed_offset))              \
  X(adamw_update, (const AdamWArgs& a))                                                                             \
  X(sgd_update, (const SgdUpdateArgs& a))                                                                           \
  X(lion_update, (const LionUpdateArgs& a))                                                                         \
  X(adafactor_update, (const AdafactorUpdateArgs& a))                                                               \
  X(muon_momentum, (const MuonMomentumArgs& a))                                                                     \
  X(muon_update, (const MuonUpdateArgs& a))                                                                         \
  X(adamw8bit_update, (const AdamW8bitArgs& a))                                                                     \
  X(sumsq, (const Tensor& x, const Tensor& out))                                                                    \
  X(nonfinite, (const Tensor& x, const Tensor& flag))
