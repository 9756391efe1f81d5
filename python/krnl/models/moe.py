"""A mixture of experts' feed-forward block (qwen3_moe, mixtral, olmoe, gpt_oss), forward and backward
over the core's moe_* ops (op_list.h; docs/architecture.md, 'Experts'); formats/experts.py reads and
writes the experts as files hold them:

    hn = rmsnorm(h) norm                     logits = hn Wr^T (+ br) (N, E)
    ids, w = top-K of softmax(logits)        (divided by their sum where norm_topk)
    per pair (t, k), e = ids[t, k]:          y_tk = down_e(act(gate_e(hn_t), up_e(hn_t)))
    y = h + sum_k w[t, k] y_tk

act is silu(g) u, or gpt-oss's clamped form (ops.swiglu_forward's alpha and limit); gpt-oss's
router and experts carry biases (each projection's + b_e, added as a one-column grouped GEMM of ones
against the (E, O, 1) biases), and its softmax over the top-K logits is norm_topk's renormalisation.

The N K pairs are grouped by expert once (moe_sort), so each projection is one grouped GEMM over
every expert (moe_gemm). LoRA on the experts is PEFT's on target_parameters: per expert, one A
(r, C) and B (2F, r) on the fused gate|up weight, and A (r, F), B (C, r) on down; the router is a
LoraLinear, frozen unless it is a target. Dropout has no place there (PEFT refuses it too)."""

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import _core
from . import norm_remake
from .config import lora_key
from .lora import LoraLinear, module_factors
from ..quant.qweight import expert_matmul, frozen_weight

ops = _core.ops
Tensor = _core.Tensor


@dataclass
class ExpertLora:
    """The LoRA of one expert module: compute-dtype views and f32 gradients of the model's FlatParams."""
    A: Tensor                  # (E, r, in)
    B: list                    # [(E, out, r)], gate_up_proj's gate and up halves apart
    gA: Tensor                 # f32, as A
    gB: list                   # f32, as B
    scale: float


class RouterStats:
    """The load-balancing loss of one forward over every mixture layer, as transformers'
    load_balancing_loss_func defines it (no attention mask: every row counts):

        aux = E sum_e f_e P_e,  f_e = top-K picks of expert e / (L N),  P_e = sum of p[., e] / (L N)

    over L layers of N rows; f is a count (no gradient), so d aux / d p[., e] = E f_e / (L N), the
    dprobs moe_route_backward adds to every row. All of it stays on the device."""

    def __init__(self, device, experts, ones, coef=0.0):
        self.dev, self.E, self.coef, self.ones = device, int(experts), float(coef), ones  # ones(n): (n, 1) f32
        self.counts = device.zeros((self.E, 1, 1), "f32")                # (E, 1, 1) picks per expert
        self.probs = device.zeros((1, self.E), "f32")                    # (1, E) summed probabilities
        self.rows, self.recording, self.dprobs, self.last = 0, False, None, None

    def begin(self):
        ops.fill(self.counts, 0.0)
        ops.fill(self.probs, 0.0)
        self.rows, self.recording, self.dprobs = 0, True, None

    def add(self, logits, offsets, top_k):
        """One layer's routing: logits (N, E), offsets moe_sort's of its N top_k pairs."""
        if not self.recording:
            return  # a checkpointed layer's recomputation: counted in the forward already
        d, (N, E) = self.dev, logits.shape
        S, P = d.empty((N, E), "f32"), d.empty((N, E), "f32")
        ops.cast(logits, S)
        ops.softmax_causal_forward(S.reshape(N, 1, E), P.reshape(N, 1, E), 1.0)  # one query row sees every key
        ops.gemm(self.ones(N), P, self.probs, trans_a=True, beta=1.0)        # probs += 1^T p
        pairs = self.ones(N * top_k)
        ops.moe_gemm_weight_grad(pairs, pairs, offsets, self.counts, beta=1.0)  # counts_e += pairs of e
        self.rows += N

    def loss(self):
        """(1,) f32 aux of the forward since begin(); also kept as .last."""
        out = self.dev.empty((1, 1), "f32")
        ops.gemm(self.probs, self.counts.reshape(self.E, 1), out, alpha=self.E / float(max(self.rows, 1)) ** 2)
        self.last, self.recording = out.reshape(1), False
        return self.last

    def backward(self, loss_scale):
        """The dprobs of coef * aux (times loss_scale, a (1,) f32 tensor) for the layers' backward."""
        if self.coef:
            self.dprobs = self.dev.empty((self.E, 1), "f32")
            ops.gemm(self.counts.reshape(self.E, 1), loss_scale.reshape(1, 1), self.dprobs,
                     alpha=self.coef * self.E / float(max(self.rows, 1)) ** 2)
            self.dprobs = self.dprobs.reshape(self.E)


@dataclass
class MoeMlp:
    """y = h + the experts' mixture of hn = rmsnorm(h) norm."""
    norm: Tensor               # (C,)
    router: LoraLinear         # (E, C), frozen unless a LoRA target
    gate: Tensor               # (E, F, C): gate_up_proj's first F rows of each expert; or a QuantizedWeight
    up: Tensor                 # (E, F, C)
    down: Tensor               # (E, C, F)
    top_k: int
    norm_topk: bool
    eps: float
    gate_up_lora: Optional[ExpertLora] = None
    down_lora: Optional[ExpertLora] = None
    sums: object = None        # the model's SampleSums: the sample order cannot hold here
    stats: Optional[RouterStats] = None  # the model's load-balancing loss
    swiglu: tuple = (1.0, 0.0)  # (alpha, limit) of ops.swiglu_forward
    ones: object = None        # the layer's Ones (compute dtype), where there are biases
    router_bias: Optional[Tensor] = None  # (1, E) gpt_oss
    biases: Optional[list] = None  # gpt_oss: gate's, up's (E, F, 1) and down's (E, C, 1)
    norm_grad: Optional[Tensor] = None  # (C,) f32 the norm's gradient where it trains (full.py)

    def grad_cols(self):
        return 0  # no fold writes beside dy

    def frozen(self):
        """{name: tensor} of its frozen weights (Layer.frozen)."""
        out = dict(router=self.router.W, experts_gate=self.gate, experts_up=self.up, experts_down=self.down)
        if self.biases is not None:
            out.update(router_bias=self.router_bias, **{f"experts_{n}_bias": b for n, b in
                                                      zip(("gate", "up", "down"), self.biases)})
        return out


@dataclass
class MoeCache:
    rstd: Tensor               # (N,) f32 rmsnorm(h) norm's (hn itself is made again: norm_remake.py)
    logits: Tensor             # (N, E)
    ids: Tensor                # (N, K) i32
    w: Tensor                  # (N, K) f32
    tokens: Tensor             # (P,) i32, P = N K
    slot: Tensor               # (N, K) i32
    offsets: Tensor            # (E + 1,) i32
    g: Tensor                  # (P, F)
    u: Tensor                  # (P, F)
    a: Tensor                  # (P, F) silu(g) u
    ys: Tensor                 # (P, C) each pair's expert output
    xa: Optional[Tensor]       # (P, r) xs A^T of gate_up's LoRA
    ad: Optional[Tensor]       # (P, r) a A^T of down's LoRA
    router: object = None      # the router's LoraSaved (None when frozen)


def build_moe(i, config, weights, device, dtype, lora_config, lora_params, adapted, sums, quantize=None, ones=None):
    """Layer i's MoeMlp from weights named as ModelConfig.weight_shapes has them (stacked_experts,
    switch_experts): experts dense in the compute dtype, quantized as the file holds them, or
    quantized on load where quantize = (bits, group_size); the router dense unless the file
    quantizes it (it is small, and quantize-on-load leaves it)."""
    p, F = f"model.layers.{i}.", config.moe["expert_size"]
    gu = weights[p + "mlp.experts.gate_up_proj"]                          # (E, 2F, C)
    if not isinstance(gu, ExpertHalves):
        gu = np.asarray(gu, np.float32)
        gu = ExpertHalves(gu[:, :F], gu[:, F:])
    experts = [frozen_weight(device, [a], dtype, quantize, what=f"{p}mlp.experts.{n}")
               for a, n in zip(gu.parts + (weights[p + "mlp.experts.down_proj"],), ("gate", "up", "down_proj"))]
    los = {}
    for m in ("gate_up_proj", "down_proj"):
        if (i, m) in adapted:
            kA, kB = lora_key(i, m, "A"), lora_key(i, m, "B")
            B, gB = lora_params.compute(kB), lora_params.grad(kB)
            halves = [0, 1] if m == "gate_up_proj" else [None]
            los[m] = ExpertLora(lora_params.compute(kA), [B if h is None else B[h] for h in halves],
                                lora_params.grad(kA), [gB if h is None else gB[h] for h in halves], lora_config.scale)
    norm = device.tensor(np.asarray(weights[p + "post_attention_layernorm.weight"], np.float32), dtype)
    router = LoraLinear(frozen_weight(device, [weights[p + "mlp.gate.weight"]], dtype),
                        module_factors(config, lora_params, adapted, i, "router"), lora_config.scale, sums=sums)
    mlp = MoeMlp(norm, router, *experts, config.moe["top_k"], config.moe["norm_topk"], config.rms_norm_eps,
                 los.get("gate_up_proj"), los.get("down_proj"), sums, swiglu=config.moe["swiglu"])
    if config.moe["bias"]:
        E, t = config.moe["experts"], lambda a: device.tensor(np.asarray(a, np.float32), dtype)
        gub = np.asarray(weights[p + "mlp.experts.gate_up_proj_bias"], np.float32)     # (E, 2F): gate's, then up's
        mlp.ones, mlp.router_bias = ones, t(weights[p + "mlp.gate.bias"]).reshape(1, E)
        mlp.biases = [t(b).reshape(E, -1, 1) for b in (gub[:, :F], gub[:, F:], weights[p + "mlp.experts.down_proj_bias"])]
    return mlp


def moe_forward(mlp, h, call_seed=None, residual=None):
    """Returns y (N, C) = h + the experts' mixture, and what moe_backward needs. With residual, h +=
    residual first (in place, inside the norm), as layer.mlp_forward."""
    if mlp.sums is not None and mlp.sums.on:
        raise ValueError("[moe] the sample reduce order (--reduce-order sample) groups rows by sample, which "
                         "the experts' grouping by expert cannot keep; use the default order")
    d, dt = h.device, h.dtype
    N, C = h.shape
    E, F, K = mlp.router.out, mlp.gate.shape[1], mlp.top_k
    P = N * K
    hn, rstd = d.empty((N, C), dt), d.empty((N,), "f32")
    ops.rmsnorm_forward(h, mlp.norm, hn, rstd, mlp.eps, residual=residual)
    logits = d.empty((N, E), dt)
    router = mlp.router.forward(hn, logits)
    if mlp.router_bias is not None:
        ops.gemm(mlp.ones(N), mlp.router_bias, logits, beta=1.0)
    ids, w = d.empty((N, K), "i32"), d.empty((N, K), "f32")
    ops.moe_route(logits, ids, w, mlp.norm_topk)
    tokens, slot, offsets = d.empty((P,), "i32"), d.empty((N, K), "i32"), d.empty((E + 1,), "i32")
    ops.moe_sort(ids, tokens, slot, offsets)
    if mlp.stats is not None:
        mlp.stats.add(logits, offsets, K)
    xs = d.empty((P, C), dt)                                              # (P, C) each pair's input
    ops.moe_gather(hn, tokens, xs)
    (router,) = norm_remake.drop([router], hn)
    del hn                                                                # made again in the backward
    g, u = d.empty((P, F), dt), d.empty((P, F), dt)
    expert_matmul(xs, mlp.gate, offsets, g)
    expert_matmul(xs, mlp.up, offsets, u)
    xa = _lora_forward(mlp.gate_up_lora, xs, [g, u], offsets)
    del xs                                                                # gathered again in backward
    _add_biases(mlp, (0, 1), [g, u], offsets)
    a = d.empty((P, F), dt)
    ops.swiglu_forward(g, u, a, *mlp.swiglu)
    ys = d.empty((P, C), dt)
    expert_matmul(a, mlp.down, offsets, ys)
    ad = _lora_forward(mlp.down_lora, a, [ys], offsets)
    _add_biases(mlp, (2,), [ys], offsets)
    y = d.empty((N, C), dt)
    ops.moe_combine(ys, slot, w, y)
    ops.add(y, h, y)
    return y, MoeCache(rstd, logits, ids, w, tokens, slot, offsets, g, u, a, ys, xa, ad, router)


def _add_biases(mlp, which, outs, offsets):
    """outs[j] (P, O) += the bias of each row's expert, biases[which[j]] (E, O, 1)."""
    if mlp.biases is not None:
        ones = mlp.ones(outs[0].shape[0])                                 # (P, 1)
        for j, out in zip(which, outs):
            ops.moe_gemm(ones, mlp.biases[j], offsets, out, beta=1.0)


def _lora_forward(lo, x, outs, offsets):
    """outs[j] += s (x A^T) B_j^T per expert; returns x A^T (P, r), or None without LoRA."""
    if lo is None:
        return None
    xa = x.device.empty((x.shape[0], lo.A.shape[1]), x.dtype)
    ops.moe_gemm(x, lo.A, offsets, xa)
    for B, out in zip(lo.B, outs):
        ops.moe_gemm(xa, B, offsets, out, alpha=lo.scale, beta=1.0)
    return xa


def _lora_backward(lo, dys, xa, x, dx, offsets):
    """The LoRA gradients (accumulated) of outs[j] += s (x A^T) B_j^T given dys[j]; dx += its
    input gradient."""
    if lo is None:
        return
    dxa = dx.device.empty(xa.shape, dx.dtype)                             # (P, r) s dy B
    for j, (B, gB, dy) in enumerate(zip(lo.B, lo.gB, dys)):
        ops.moe_gemm_weight_grad(dy, xa, offsets, gB, alpha=lo.scale, beta=1.0)   # gB_e += s dy_e^T xa_e
        ops.moe_gemm(dy, B, offsets, dxa, transpose=False, alpha=lo.scale, beta=1.0 if j else 0.0)
    ops.moe_gemm_weight_grad(dxa, x, offsets, lo.gA, beta=1.0)           # gA_e += dxa_e^T x_e
    ops.moe_gemm(dxa, lo.A, offsets, dx, transpose=False, beta=1.0)


def moe_backward(mlp, h, cache, dy, dh_cols=0):
    """Returns dh (N, C + dh_cols) given dy (N, C); LoRA gradients accumulate. As in
    layer.mlp_backward, dh's gradient is its first C columns (the rest for the o projection's fold)."""
    d, dt, c = h.device, h.dtype, cache
    N, C = h.shape
    P, F = c.g.shape
    dyv = dy if dy.shape[1] == C else dy[:, :C]
    dys, dw = d.empty((P, C), dt), d.empty(c.w.shape, "f32")
    ops.moe_combine_backward(dyv, c.ys, c.slot, c.w, dys, dw)
    da = d.empty((P, F), dt)
    expert_matmul(dys, mlp.down, c.offsets, da, transpose=False)
    _lora_backward(mlp.down_lora, [dys], c.ad, c.a, da, c.offsets)
    del dys
    dg, du = da, c.u  # in place, as mlp_backward's
    ops.swiglu_backward(da, c.g, c.u, dg, du, *mlp.swiglu)
    del da
    dxs = d.empty((P, C), dt)
    expert_matmul(dg, mlp.gate, c.offsets, dxs, transpose=False)
    expert_matmul(du, mlp.up, c.offsets, dxs, transpose=False, beta=1.0)
    hn, router = None, c.router
    if mlp.gate_up_lora is not None or norm_remake.needed([router], [mlp.router]):
        hn, (router,) = norm_remake.remake(h, mlp.norm, mlp.eps, [router], [mlp.router])  # (N, C)
    if mlp.gate_up_lora is not None:
        xs = d.empty((P, C), dt)
        ops.moe_gather(hn, c.tokens, xs)
        _lora_backward(mlp.gate_up_lora, [dg, du], c.xa, xs, dxs, c.offsets)
        del xs
    dhn = d.empty((N, C), dt)
    ops.moe_combine(dxs, c.slot, None, dhn)                               # the gather's backward
    dlogits = d.empty(c.logits.shape, dt)
    ops.moe_route_backward(c.logits, c.ids, dw, dlogits, mlp.norm_topk, mlp.stats and mlp.stats.dprobs)
    mlp.router.backward(dlogits, router, dhn, accumulate=True)           # dhn += dlogits Wr (+ its LoRA's)
    del hn, router
    dh = d.empty((N, C + dh_cols), dt)
    ops.rmsnorm_backward(dhn, h, mlp.norm, c.rstd, dh[:, :C], dw=mlp.norm_grad,
                         residual=dyv)                                    # dh = norm's gradient + dy
    return dh


class ExpertHalves:
    """A fused gate_up_proj (E, 2F, C) held as its two halves, gate's and up's experts (E, F, C)
    each, float or QuantizedArrays (MLX's switch_mlp)."""

    def __init__(self, gate, up):
        self.parts = (gate, up)
        E, F, C = gate.shape
        self.shape, self.ndim = (E, 2 * F, C), 3
        self.st_dtype = getattr(gate, "st_dtype", None)
        self.path = getattr(gate, "path", None) or getattr(getattr(gate, "w", None), "path", None)

    def __array__(self, dtype=None, copy=None):
        a = np.concatenate([np.asarray(p, np.float32) for p in self.parts], axis=1)
        return a if dtype is None else a.astype(dtype, copy=False)
