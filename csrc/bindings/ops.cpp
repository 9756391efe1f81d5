// Every op of the backend contract, as krnl._core.ops.<name>. Validation happens in the core;
// its std::invalid_argument becomes ValueError naming the op.
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "bindings.h"
#include "core/ops.h"

namespace krnl::bindings {

namespace {

// quantized_matmul's and moe_quantized_matmul's mode by name (ops.h's QuantMode)
int64_t quant_mode(const char* op, const std::string& mode) {
  if (mode == "affine") return ops::kQuantAffine;
  if (mode == "mxfp4") return ops::kQuantMxfp4;
  throw std::invalid_argument(std::string("[") + op + "] mode must be \"affine\" or \"mxfp4\", got \"" + mode + "\"");
}

// An optimizer op's optional tensors: the working copy and the device-resident scalars.
template <typename A>
void device_scalars(A& a, const Tensor* working, const Tensor* hyper, const Tensor* sq, const Tensor* flag) {
  if (working) a.working = *working;
  if (hyper) a.hyper = *hyper;
  if (sq) a.sq = *sq;
  if (flag) a.flag = *flag;
}

}  // namespace

void bind_ops(nb::module_& parent) {
  using namespace nb::literals;
  nb::module_ m = parent.def_submodule("ops", "Device ops (docs/architecture.md, 'The op contract'). Outputs are passed in.");
  // Without the GIL: an op may wait for device work (a host record waits for the GPU work before
  // it), and metal-sim's executor, which runs that work, is Python on another thread.
  const auto release = nb::call_guard<nb::gil_scoped_release>();

  m.def("gemm", &ops::gemm, release, "A"_a, "B"_a, "C"_a, "trans_a"_a = false, "trans_b"_a = false, "alpha"_a = 1.0f,
        "beta"_a = 0.0f, "batch"_a = 1, "stride_a"_a = -1, "stride_b"_a = -1, "stride_c"_a = -1, "split_k"_a = -1,
        "C = alpha*op(A)*op(B) + beta*C with fp32 accumulation. Operands are 2-D, or 3-D with a leading batch\n"
        "dimension; stride_* (elements) override the per-batch step (0 broadcasts). split_k: -1 routes\n"
        "automatically, 1 forces the plain path, s > 1 forces s K-slices reduced in fp32.");
  m.def("gemm_plan", [](const Tensor& A, const Tensor& B, const Tensor& C, bool ta, bool tb, int64_t batch,
                        int64_t sa, int64_t sb, int64_t sc, int64_t split_k) {
          SplitKPlan p = ops::gemm_plan(A, B, C, ta, tb, batch, sa, sb, sc, split_k);
          return nb::make_tuple(p.splits, p.k_per_split);
        }, "A"_a, "B"_a, "C"_a, "trans_a"_a = false, "trans_b"_a = false, "batch"_a = 1, "stride_a"_a = -1,
        "stride_b"_a = -1, "stride_c"_a = -1, "split_k"_a = -1,
        "The (splits, k_per_split) that gemm would use for these operands.");
  m.def("rmsnorm_forward", &ops::rmsnorm_forward, release, "x"_a, "w"_a, "y"_a, "rstd"_a, "eps"_a = 1e-5f,
        "residual"_a = nb::none(),
        "y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps) per row (rstd is f32, saved for backward).\n"
        "With residual, x += residual first (in place, rounded to x's dtype): a residual add fused in.");
  m.def("rmsnorm_backward", &ops::rmsnorm_backward, release, "dy"_a, "x"_a, "w"_a, "rstd"_a, "dx"_a, "dw"_a = nb::none(),
        "residual"_a = nb::none(),
        "dx (overwritten) and optionally dw (f32, accumulated) of rmsnorm_forward. With residual, dx is the\n"
        "norm's gradient (rounded to dx's dtype) + residual: a residual stream's gradient fused in.");
  m.def("swiglu_forward", &ops::swiglu_forward, release, "g"_a, "u"_a, "s"_a, "alpha"_a = 1.0f, "limit"_a = 0.0f,
        "s = silu(g) * u (limit <= 0, alpha 1). limit > 0: gpt-oss's clamped form, g' = min(g, limit),\n"
        "u' = clamp(u, -limit, limit), s = g' * sigmoid(alpha * g') * (u' + 1). s may alias g or u.");
  m.def("swiglu_backward", &ops::swiglu_backward, release, "ds"_a, "g"_a, "u"_a, "dg"_a, "du"_a, "alpha"_a = 1.0f,
        "limit"_a = 0.0f,
        "dg, du (overwritten) of swiglu_forward (same alpha and limit; through a clamp only where its input\n"
        "lies within the bounds, bounds included, as torch.clamp); they may alias ds.");
  m.def("geglu_forward", &ops::geglu_forward, release, "g"_a, "u"_a, "s"_a,
        "s = gelu_tanh(g) * u, gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Gemma's MLP).");
  m.def("geglu_backward", &ops::geglu_backward, release, "ds"_a, "g"_a, "u"_a, "dg"_a, "du"_a,
        "dg, du (overwritten) of geglu_forward; they may alias ds.");
  m.def("softcap", &ops::softcap, release, "x"_a, "cap"_a, "out"_a,
        "out = cap * tanh(x / cap) (Gemma 2's soft-capping of scores and logits); out may be x.");
  m.def("softcap_backward", &ops::softcap_backward, release, "dy"_a, "y"_a, "cap"_a, "dx"_a,
        "dx = dy * (1 - (y / cap)^2) from softcap's OUTPUT y; dx may be dy or y.");
  m.def("scale_columns", &ops::scale_columns, release, "x"_a, "v"_a, "out"_a,
        "out[n, j] = x[n, j] * v[j], v (M,) f32 (DoRA's per-output scale); x and out (N, M) may be row-strided\n"
        "views (column blocks); out may be x.");
  m.def("scale_columns_backward", &ops::scale_columns_backward, release, "dy"_a, "x"_a, "v"_a, "dx"_a, "dv"_a,
        "dx = dy * v (dx may be dy) and dv (S, M) f32 overwritten: row s the column sums of dy * x over the\n"
        "s-th block of N / S consecutive rows (S > 1: one per sample, the sample order's).");
  m.def("dora_norm", &ops::dora_norm, release, "w2"_a, "B"_a, "Q"_a, "m"_a, "alpha"_a, "scale"_a, "inv_norm"_a,
        "Per output o of B (M, r): n = sqrt(max(w2[o] + alpha * sum_k B[o, k] Q[k, o], 0)), scale = m / n and\n"
        "inv_norm = 1 / n (f32; w2 and Q f32, m B's dtype). Q = A W^T + (s/2) A A^T B^T, alpha = 2 s: DoRA's\n"
        "n = ||W_o + s B_o A|| without W + s B A formed.");
  m.def("rope", &ops::rope, release, "x"_a, "positions"_a, "inv_freq"_a, "sign"_a = 1.0f, "token_major"_a = false,
        "In-place rotary embedding of x (..., T, D), rotate_half convention on the first 2*len(inv_freq)\n"
        "dims; sign=-1 applies the inverse rotation (the backward). token_major: x is a (B, T, H, D) view\n"
        "(rows of D contiguous) and positions (B, T) or (T,), where the device takes token-major operands.");
  m.def("softmax_causal_forward", &ops::softmax_causal_forward, release, "S"_a, "P"_a, "scale"_a, "segments"_a = nb::none(),
        "window"_a = 0, "sinks"_a = nb::none(),
        "P = causal softmax of scale*S over the last dim (S is (..., Tq, Tk); query i sits at position\n"
        "q = i + Tk - Tq). Masked entries are exact zeros; segments (Tk,) i32 also masks across samples;\n"
        "window > 0 keeps only keys j with q - j < window (attention_forward's sliding window); sinks (A,)\n"
        "f32, A the product of the leading dims, adds one unscaled logit per score matrix to each row's\n"
        "softmax as a column without output (gpt-oss): P's rows then sum to < 1.");
  m.def("softmax_backward", &ops::softmax_backward, release, "P"_a, "dP"_a, "dS"_a, "scale"_a,
        "dS = P * (dP - rowsum(dP * P)) * scale.");
  m.def("attention_forward", &ops::attention_forward, release, "q"_a, "k"_a, "v"_a, "o"_a, "lse"_a, "scale"_a,
        "segments"_a = nb::none(), "window"_a = 0, "sinks"_a = nb::none(),
        "Fused causal attention: o = softmax(scale * q k^T, causal) v per head, never materialising the\n"
        "scores. q, o (Hq, T, D); k, v (Hk, T, D), query head h reads KV head h // (Hq // Hk); lse (Hq, T) f32\n"
        "receives the natural-log row sums of exp(scale * q.k), which attention_backward needs. Query i sees\n"
        "key j <= i, within i - j < window if window > 0, and of its own sample if segments (T,) i32 are given.\n"
        "sinks (Hq,) f32 (gpt-oss): one unscaled logit per head joins each row's softmax as a column without a\n"
        "value; lse includes it, so attention_backward takes no sinks (capabilities: fused_attention.sinks).");
  m.def("attention_backward", &ops::attention_backward, release, "q"_a, "k"_a, "v"_a, "o"_a, "dout"_a, "lse"_a, "dq"_a,
        "dk"_a, "dv"_a, "scale"_a, "segments"_a = nb::none(), "window"_a = 0,
        "dq, dk, dv (overwritten) of attention_forward (same segments and window), from its o and lse.");
  m.def("embedding_forward", &ops::embedding_forward, release, "ids"_a, "table"_a, "out"_a);
  m.def("embedding_backward", &ops::embedding_backward, release, "ids"_a, "dout"_a, "dtable"_a,
        "dtable (f32) += scatter of dout rows by id.");
  m.def("cross_entropy", &ops::cross_entropy, release, "logits"_a, "targets"_a, "loss"_a, "dlogits"_a = nb::none(),
        "ignore_index"_a = -100, "scale"_a = 1.0f, "scale_by"_a = nb::none(),
        "Per-row loss (f32, 0 where ignored) and optionally dlogits = scale*(softmax - onehot), which may\n"
        "be the logits tensor itself. scale_by, a (1,) f32 device tensor, multiplies scale (formed once in\n"
        "f32) for a per-step factor that a replayed graph reads afresh.");
  m.def("add", &ops::add, release, "a"_a, "b"_a, "out"_a);
  m.def("axpy", &ops::axpy, release, "alpha"_a, "x"_a, "y"_a, "y += alpha * x.");
  m.def("scale", &ops::scale, release, "x"_a, "alpha"_a, "out"_a, "out = alpha * x.");
  m.def("cast", &ops::cast, release, "x"_a, "out"_a, "out = x converted to out's dtype (round to nearest even).");
  m.def("quantized_matmul",
        [](const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor* biases, const Tensor& out,
           bool transpose, int64_t group_size, int64_t bits, float beta, const std::string& mode) {
          ops::quantized_matmul(x, w, scales, biases, out, transpose, group_size, bits, beta,
                                quant_mode("quantized_matmul", mode));
        }, release, "x"_a, "w"_a, "scales"_a, "biases"_a.none(), "out"_a, "transpose"_a = true, "group_size"_a = 64,
        "bits"_a = 4, "beta"_a = 0.0f, "mode"_a = "affine",
        "out = x W^T (transpose, a linear's forward) or x W (its input gradient), + beta * out, with W (O, I)\n"
        "quantized as MLX does: w (O, I * bits / 32) i32 packed codes, scales and biases (O, I / group_size);\n"
        "mode \"affine\": W = scales * q + biases per group of group_size inputs (bits 2-8, a bit stream per\n"
        "row); \"mxfp4\": W = scales * e2m1(q) (bits 4, group_size 32, biases None, scales the E8M0 powers of\n"
        "two in f32 or bf16). f32 accumulation; x and out may be column blocks; at most one transient\n"
        "dequantized W (CUDA, 16+ rows).");
  m.def("quantized_embedding", &ops::quantized_embedding, release, "ids"_a, "w"_a, "scales"_a, "biases"_a, "out"_a,
        "group_size"_a = 64, "bits"_a = 4,
        "out (n, C) = rows ids (n,) of a table (V, C) quantized as quantized_matmul's W, dequantized.");
  m.def("transpose_heads", &ops::transpose_heads, release, "x"_a, "out"_a, "positions"_a = nb::none(),
        "inv_freq"_a = nb::none(), "rotate"_a = 0, "sign"_a = 1.0f, "heads_axis"_a = 1,
        "out (B, A, D) = x (A, B, D) with the first two axes swapped, e.g. (T, H, D) <-> (H, T, D). With\n"
        "positions (T,) and inv_freq (R,), the rows of heads h < rotate also get rope's rotation (sign) on\n"
        "the way; heads_axis is x's head axis (1: x (T, H, D), 0: x (H, T, D)).");
  m.def("fill", &ops::fill, release, "x"_a, "value"_a);
  m.def("dropout", &ops::dropout, release, "x"_a, "out"_a, "p"_a, "seed"_a, "seed_offset"_a = nb::none(),
        "out = x * keep / (1 - p); keep is a hash of (seed, index), so the same call on dy is the backward.\n"
        "seed_offset, a (2,) i32 device tensor holding a uint64 (low word, high word), makes the seed\n"
        "(seed + offset) mod 2^64 & 0x7FFFFFFFFFFFFFFF, a per-step seed that a replayed graph reads afresh;\n"
        "a (3,) seed_offset's third word r0 is x's first row in a larger batch: element i draws the bit of\n"
        "index i + r0 * x.shape[-1], so a data-parallel rank's slice gets the whole batch's mask.");
  m.def("adamw_update", [](const Tensor& params, const Tensor& grads, const Tensor& m_, const Tensor& v, float lr,
                           float beta1, float beta2, float eps, float weight_decay, int64_t step, float grad_scale,
                           const Tensor* working, const Tensor* hyper, const Tensor* sq, const Tensor* flag,
                           bool decoupled) {
          AdamWArgs a;
          a.params = params, a.grads = grads, a.m = m_, a.v = v;
          device_scalars(a, working, hyper, sq, flag);
          a.lr = lr, a.beta1 = beta1, a.beta2 = beta2, a.eps = eps, a.weight_decay = weight_decay;
          a.step = step, a.grad_scale = grad_scale, a.decoupled = decoupled;
          ops::adamw_update(a);
        }, release, "params"_a, "grads"_a, "m"_a, "v"_a, "lr"_a, "beta1"_a = 0.9f, "beta2"_a = 0.999f, "eps"_a = 1e-8f,
        "weight_decay"_a = 0.0f, "step"_a = 1, "grad_scale"_a = 1.0f, "working"_a = nb::none(),
        "hyper"_a = nb::none(), "sq"_a = nb::none(), "flag"_a = nb::none(), "decoupled"_a = true,
        "PyTorch AdamW over flat f32 buffers (decoupled decay, eps outside sqrt, 1-based bias correction).\n"
        "grads are multiplied by grad_scale as read; `working` receives the updated params in its dtype.\n"
        "hyper (5,) f32 [step_size, bc2_sqrt, decay, inv_denom, max_norm] with sq (1,) f32 (sumsq of the\n"
        "grads) and optionally flag (1,) i32 (nonfinite's) take the step's scalars from the device instead\n"
        "of lr, weight_decay, step and grad_scale: grad_scale = clip * inv_denom with norm = sqrt(sq) *\n"
        "inv_denom, clip = min(1, max_norm / (norm + 1e-6)) if max_norm > 0; nothing is written when\n"
        "flag[0] != 0 or sq[0] is not finite. decoupled=False: PyTorch's Adam, weight_decay added to the\n"
        "gradient (L2; hyper's decay is then weight_decay itself).");
  m.def("sgd_update", [](const Tensor& params, const Tensor& grads, const Tensor* buf, float lr, float momentum,
                         float dampening, float weight_decay, bool nesterov, int64_t step, float grad_scale,
                         const Tensor* working, const Tensor* hyper, const Tensor* sq, const Tensor* flag) {
          SgdUpdateArgs a;
          a.params = params, a.grads = grads;
          if (buf) a.buf = *buf;
          device_scalars(a, working, hyper, sq, flag);
          a.lr = lr, a.momentum = momentum, a.dampening = dampening, a.weight_decay = weight_decay;
          a.nesterov = nesterov, a.step = step, a.grad_scale = grad_scale;
          ops::sgd_update(a);
        }, release, "params"_a, "grads"_a, "buf"_a.none(), "lr"_a, "momentum"_a = 0.0f, "dampening"_a = 0.0f,
        "weight_decay"_a = 0.0f, "nesterov"_a = false, "step"_a = 1, "grad_scale"_a = 1.0f, "working"_a = nb::none(),
        "hyper"_a = nb::none(), "sq"_a = nb::none(), "flag"_a = nb::none(),
        "PyTorch SGD over flat f32 buffers: g = grads * grad_scale + weight_decay * params; with momentum,\n"
        "buf = momentum * buf + (1 - dampening) * g (buf = g at step 1), g = g + momentum * buf (nesterov)\n"
        "or buf; params -= lr * g. hyper (5,) f32 [lr, keep, in, inv_denom, max_norm] (buf = keep * buf +\n"
        "in * g) with sq and flag replace lr, step and grad_scale as adamw_update's do.");
  m.def("lion_update", [](const Tensor& params, const Tensor& grads, const Tensor& m_, float lr, float beta1,
                          float beta2, float weight_decay, float grad_scale, const Tensor* working, const Tensor* hyper,
                          const Tensor* sq, const Tensor* flag) {
          LionUpdateArgs a;
          a.params = params, a.grads = grads, a.m = m_;
          device_scalars(a, working, hyper, sq, flag);
          a.lr = lr, a.beta1 = beta1, a.beta2 = beta2, a.weight_decay = weight_decay, a.grad_scale = grad_scale;
          ops::lion_update(a);
        }, release, "params"_a, "grads"_a, "m"_a, "lr"_a, "beta1"_a = 0.9f, "beta2"_a = 0.99f,
        "weight_decay"_a = 0.0f, "grad_scale"_a = 1.0f, "working"_a = nb::none(), "hyper"_a = nb::none(),
        "sq"_a = nb::none(), "flag"_a = nb::none(),
        "Lion (lion-pytorch) over flat f32 buffers: params *= 1 - lr * weight_decay; params -= lr *\n"
        "sign(beta1 * m + (1 - beta1) * g); m = beta2 * m + (1 - beta2) * g, g = grads * grad_scale.\n"
        "hyper (5,) f32 [lr, lr * weight_decay, unused, inv_denom, max_norm] with sq and flag replace lr,\n"
        "weight_decay and grad_scale as adamw_update's do.");
  m.def("adafactor_update", [](const Tensor& params, const Tensor& grads, const Tensor& row, const Tensor& col,
                               float rho, float beta2t, float decay, float eps1, float eps2, float d, float grad_scale,
                               const Tensor* working, const Tensor* hyper, const Tensor* sq, const Tensor* flag) {
          AdafactorUpdateArgs a;
          a.params = params, a.grads = grads, a.row = row, a.col = col;
          device_scalars(a, working, hyper, sq, flag);
          a.rho = rho, a.beta2t = beta2t, a.decay = decay, a.eps1 = eps1, a.eps2 = eps2, a.d = d;
          a.grad_scale = grad_scale;
          ops::adafactor_update(a);
        }, release, "params"_a, "grads"_a, "row"_a, "col"_a, "rho"_a, "beta2t"_a = 1.0f, "decay"_a = 0.0f,
        "eps1"_a = 1.1920929e-07f, "eps2"_a = 1e-3f, "d"_a = 1.0f, "grad_scale"_a = 1.0f, "working"_a = nb::none(),
        "hyper"_a = nb::none(), "sq"_a = nb::none(), "flag"_a = nb::none(),
        "torch.optim.Adafactor's step over one parameter (B..., R, C) f32 with factored second moments\n"
        "row (B, R) and col (B, C): alpha = max(eps2, rms(params)) * rho; params *= 1 - decay; row and col\n"
        "lerp towards the means of g^2 (g = grads * grad_scale) over each row and column by beta2t;\n"
        "u = g / sqrt(max(row col / max(mean(row), eps1), eps1^2)); params -= alpha / max(1, rms(u) / d) u.\n"
        "hyper (5,) f32 [rho, beta2t, decay, inv_denom, max_norm] with sq and flag replace rho, beta2t,\n"
        "decay and grad_scale as adamw_update's do.");
  m.def("muon_momentum", [](const Tensor& grads, const Tensor& buf, const Tensor& out, float momentum, bool nesterov,
                            float eps, float grad_scale, const Tensor* hyper, const Tensor* sq, const Tensor* flag) {
          MuonMomentumArgs a;
          a.grads = grads, a.buf = buf, a.out = out;
          if (hyper) a.hyper = *hyper;
          if (sq) a.sq = *sq;
          if (flag) a.flag = *flag;
          a.momentum = momentum, a.nesterov = nesterov, a.eps = eps, a.grad_scale = grad_scale;
          ops::muon_momentum(a);
        }, release, "grads"_a, "buf"_a, "out"_a, "momentum"_a = 0.95f, "nesterov"_a = true, "eps"_a = 1e-7f,
        "grad_scale"_a = 1.0f, "hyper"_a = nb::none(), "sq"_a = nb::none(), "flag"_a = nb::none(),
        "Muon's momentum (torch.optim.Muon), all f32 of one length: buf = lerp(buf, g, 1 - momentum) with\n"
        "g = grads * grad_scale; out = (nesterov ? lerp(g, buf, momentum) : buf) / max(||.||_F, eps), the\n"
        "Newton-Schulz iteration's start. hyper (5,) f32 [-, -, -, inv_denom, max_norm] with sq and flag\n"
        "replace grad_scale as adamw_update's do (nothing written on a non-finite step).");
  m.def("muon_update", [](const Tensor& params, const Tensor& update, float lr, float decay, float scale,
                          const Tensor* working, const Tensor* hyper, const Tensor* sq, const Tensor* flag) {
          MuonUpdateArgs a;
          a.params = params, a.update = update;
          device_scalars(a, working, hyper, sq, flag);
          a.lr = lr, a.decay = decay, a.scale = scale;
          ops::muon_update(a);
        }, release, "params"_a, "update"_a, "lr"_a, "decay"_a = 0.0f, "scale"_a = 1.0f, "working"_a = nb::none(),
        "hyper"_a = nb::none(), "sq"_a = nb::none(), "flag"_a = nb::none(),
        "Muon's step: params = params * (1 - decay) - lr * scale * update (f32, one length; scale: the\n"
        "shape's learning-rate ratio). hyper (5,) f32 [lr, -, decay, inv_denom, max_norm] with sq and flag\n"
        "replace lr and decay; nothing is written on a non-finite step.");
  m.def("adamw8bit_update", [](const Tensor& params, const Tensor& grads, const Tensor& m_codes, const Tensor& v_codes,
                               const Tensor& m_absmax, const Tensor& v_absmax, const Tensor& m_map, const Tensor& v_map,
                               float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step,
                               float grad_scale, const Tensor* working, const Tensor* hyper, const Tensor* sq,
                               const Tensor* flag, float beta1_complement, float beta2_complement) {
          AdamW8bitArgs a;
          a.params = params, a.grads = grads, a.m_codes = m_codes, a.v_codes = v_codes;
          a.m_absmax = m_absmax, a.v_absmax = v_absmax, a.m_map = m_map, a.v_map = v_map;
          device_scalars(a, working, hyper, sq, flag);
          a.lr = lr, a.beta1 = beta1, a.beta2 = beta2, a.eps = eps, a.weight_decay = weight_decay;
          a.step = step, a.grad_scale = grad_scale;
          a.beta1_complement = beta1_complement, a.beta2_complement = beta2_complement;
          ops::adamw8bit_update(a);
        }, release, "params"_a, "grads"_a, "m_codes"_a, "v_codes"_a, "m_absmax"_a, "v_absmax"_a, "m_map"_a, "v_map"_a,
        "lr"_a, "beta1"_a = 0.9f, "beta2"_a = 0.999f, "eps"_a = 1e-8f, "weight_decay"_a = 0.0f, "step"_a = 1,
        "grad_scale"_a = 1.0f, "working"_a = nb::none(), "hyper"_a = nb::none(), "sq"_a = nb::none(),
        "flag"_a = nb::none(), "beta1_complement"_a = 0.0f, "beta2_complement"_a = 0.0f,
        "bitsandbytes' 8-bit blockwise AdamW over one parameter (n,) f32: m and v as 8-bit codes, four to\n"
        "an i32 word ((ceil(n / 4),) each), into the sorted 256-entry maps m_map and v_map (f32), times an\n"
        "f32 absmax per block of 256 ((ceil(n / 256),) each). Per block: dequantize, AdamW's step (params\n"
        "*= 1 - lr * weight_decay first), requantize (absmax = max |x|, code = the nearest map entry to\n"
        "x / absmax). beta*_complement: 1 - beta as the caller rounds it (bitsandbytes: from its double\n"
        "betas); 0: 1.f - beta. hyper, sq and flag as adamw_update's.");
  m.def("moe_route", &ops::moe_route, release, "logits"_a, "ids"_a, "weights"_a, "norm"_a = false,
        "ids (N, K) i32 = the K experts of largest softmax(logits (N, E)) per row (f32, descending, a tie\n"
        "to the lower expert); weights (N, K) f32 their probabilities, divided by their sum if norm.");
  m.def("moe_route_backward", &ops::moe_route_backward, release, "logits"_a, "ids"_a, "dweights"_a, "dlogits"_a,
        "norm"_a = false, "dprobs"_a = nb::none(),
        "dlogits (N, E) (overwritten) of moe_route given dweights (N, K) f32; dprobs (E,) f32, if given,\n"
        "is added to every row's gradient of the probabilities (the load-balancing loss's).");
  m.def("moe_sort", &ops::moe_sort, release, "ids"_a, "tokens"_a, "slot"_a, "offsets"_a,
        "Groups the (token, k) pairs of ids (N, K) by expert, stably: slot (N, K) i32 each pair's position,\n"
        "tokens (N K,) i32 each position's token, offsets (E + 1,) i32 each expert's first position.");
  m.def("moe_gather", &ops::moe_gather, release, "x"_a, "tokens"_a, "out"_a,
        "out (P, C) = rows tokens (P,) i32 of x (N, C): the grouped rows of moe_sort's tokens.");
  m.def("moe_combine", &ops::moe_combine, release, "ys"_a, "slot"_a, "weights"_a.none(), "out"_a, "beta"_a = 0.0f,
        "out (N, C) = beta * out + sum_k weights[t, k] * ys[slot[t, k]] (weights None: 1), in f32.");
  m.def("moe_combine_backward", &ops::moe_combine_backward, release, "dout"_a, "ys"_a, "slot"_a, "weights"_a, "dys"_a,
        "dweights"_a, "dys[slot[t, k]] = weights[t, k] * dout[t]; dweights[t, k] = dout[t] . ys[slot[t, k]] (f32).");
  m.def("moe_gemm", &ops::moe_gemm, release, "x"_a, "w"_a, "offsets"_a, "out"_a, "transpose"_a = true,
        "alpha"_a = 1.0f, "beta"_a = 0.0f,
        "Rows offsets[e]:offsets[e+1] of x times expert e of w (E, O, I): out = alpha * x W_e^T + beta * out\n"
        "(transpose: x (P, I), out (P, O)) or alpha * x W_e + beta * out (x (P, O), out (P, I)).");
  m.def("moe_gemm_weight_grad", &ops::moe_gemm_weight_grad, release, "a"_a, "b"_a, "offsets"_a, "out"_a,
        "alpha"_a = 1.0f, "beta"_a = 0.0f,
        "out[e] (M, N) = alpha * a_e^T b_e + beta * out[e] over expert e's rows of a (P, M) and b (P, N).");
  m.def("moe_quantized_matmul",
        [](const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor* biases, const Tensor& offsets,
           const Tensor& out, bool transpose, int64_t group_size, int64_t bits, float beta, const std::string& mode) {
          ops::moe_quantized_matmul(x, w, scales, biases, offsets, out, transpose, group_size, bits, beta,
                                    quant_mode("moe_quantized_matmul", mode));
        }, release, "x"_a, "w"_a, "scales"_a, "biases"_a.none(), "offsets"_a, "out"_a, "transpose"_a = true,
        "group_size"_a = 64, "bits"_a = 4, "beta"_a = 0.0f, "mode"_a = "affine",
        "moe_gemm with every expert's W_e quantized as quantized_matmul's (mode as there): w (E, O, I * bits /\n"
        "32) i32, scales and biases (E, O, I / group_size).");
  m.def("sumsq", &ops::sumsq, release, "x"_a, "out"_a, "out[0] = sum(x^2) (f32).");
  m.def("nonfinite", &ops::nonfinite, release, "x"_a, "flag"_a, "flag[0] = 1 if x holds inf or NaN (never cleared).");
}

}  // namespace krnl::bindings
