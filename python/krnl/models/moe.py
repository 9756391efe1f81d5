"""A mixture of experts' feed-forward block (qwen3_moe, mixtral), forward and backward over the
core's moe_* ops (op_list.h), and the experts' weights as checkpoints store them:

    hn = rmsnorm(h) norm                     logits = hn Wr^T (N, E)
    ids, w = top-K of softmax(logits)        (divided by their sum where norm_topk)
    per pair (t, k), e = ids[t, k]:          y_tk = down_e(silu(gate_e(hn_t)) * up_e(hn_t))
    y = h + sum_k w[t, k] y_tk

The N K pairs are grouped by expert once (moe_sort), so each projection is one grouped GEMM over
every expert (moe_gemm). LoRA on the experts is PEFT's on target_parameters: per expert, one A
(r, C) and B (2F, r) on the fused gate|up weight, and A (r, F), B (C, r) on down; the router is
frozen. Dropout has no place there (PEFT refuses it too)."""

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import _core
from .config import lora_key
from .moe_config import EXPERT_MODULES  # noqa: F401 (the names, here too)
from ..quant.qweight import QuantizedArray, expert_matmul, frozen_weight, linear, linear_grad

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

    def __init__(self, device, experts, coef=0.0):
        self.dev, self.E, self.coef = device, int(experts), float(coef)
        self.counts = device.zeros((self.E, 1, 1), "f32")                # (E, 1, 1) picks per expert
        self.probs = device.zeros((1, self.E), "f32")                    # (1, E) summed probabilities
        self.rows, self.recording, self.dprobs, self.last, self._ones = 0, False, None, None, {}

    def begin(self):
        ops.fill(self.counts, 0.0)
        ops.fill(self.probs, 0.0)
        self.rows, self.recording, self.dprobs = 0, True, None

    def ones(self, n):
        if n not in self._ones:
            self._ones[n] = self.dev.tensor(np.ones((n, 1), np.float32), "f32")
        return self._ones[n]

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
    router: Tensor             # (E, C), or a QuantizedWeight (qweight.py)
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

    def grad_cols(self):
        return 0  # no fold writes beside dy


@dataclass
class MoeCache:
    hn: Tensor                 # (N, C)
    rstd: Tensor               # (N,) f32
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


def build_moe(i, config, weights, device, dtype, lora_config, lora_params, adapted, sums, quantize=None):
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
    return MoeMlp(norm, frozen_weight(device, [weights[p + "mlp.gate.weight"]], dtype), *experts, config.moe["top_k"],
                  config.moe["norm_topk"], config.rms_norm_eps, los.get("gate_up_proj"), los.get("down_proj"), sums)


def moe_forward(mlp, h, call_seed=None, residual=None):
    """Returns y (N, C) = h + the experts' mixture, and what moe_backward needs. With residual, h +=
    residual first (in place, inside the norm), as layer.mlp_forward."""
    if mlp.sums is not None and mlp.sums.on:
        raise ValueError("[moe] the sample reduce order (--reduce-order sample) groups rows by sample, which "
                         "the experts' grouping by expert cannot keep; use the default order")
    d, dt = h.device, h.dtype
    N, C = h.shape
    E, F, K = mlp.router.shape[0], mlp.gate.shape[1], mlp.top_k
    P = N * K
    hn, rstd = d.empty((N, C), dt), d.empty((N,), "f32")
    ops.rmsnorm_forward(h, mlp.norm, hn, rstd, mlp.eps, residual=residual)
    logits = d.empty((N, E), dt)
    linear(hn, mlp.router, logits)
    ids, w = d.empty((N, K), "i32"), d.empty((N, K), "f32")
    ops.moe_route(logits, ids, w, mlp.norm_topk)
    tokens, slot, offsets = d.empty((P,), "i32"), d.empty((N, K), "i32"), d.empty((E + 1,), "i32")
    ops.moe_sort(ids, tokens, slot, offsets)
    if mlp.stats is not None:
        mlp.stats.add(logits, offsets, K)
    xs = d.empty((P, C), dt)                                              # (P, C) each pair's input
    ops.moe_gather(hn, tokens, xs)
    g, u = d.empty((P, F), dt), d.empty((P, F), dt)
    expert_matmul(xs, mlp.gate, offsets, g)
    expert_matmul(xs, mlp.up, offsets, u)
    xa = _lora_forward(mlp.gate_up_lora, xs, [g, u], offsets)
    del xs                                                                # gathered again in backward
    a = d.empty((P, F), dt)
    ops.swiglu_forward(g, u, a)
    ys = d.empty((P, C), dt)
    expert_matmul(a, mlp.down, offsets, ys)
    ad = _lora_forward(mlp.down_lora, a, [ys], offsets)
    y = d.empty((N, C), dt)
    ops.moe_combine(ys, slot, w, y)
    ops.add(y, h, y)
    return y, MoeCache(hn, rstd, logits, ids, w, tokens, slot, offsets, g, u, a, ys, xa, ad)


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
    dg, du = d.empty((P, F), dt), d.empty((P, F), dt)
    ops.swiglu_backward(da, c.g, c.u, dg, du)
    del da
    dxs = d.empty((P, C), dt)
    expert_matmul(dg, mlp.gate, c.offsets, dxs, transpose=False)
    expert_matmul(du, mlp.up, c.offsets, dxs, transpose=False, beta=1.0)
    if mlp.gate_up_lora is not None:
        xs = d.empty((P, C), dt)
        ops.moe_gather(c.hn, c.tokens, xs)
        _lora_backward(mlp.gate_up_lora, [dg, du], c.xa, xs, dxs, c.offsets)
        del xs
    dhn = d.empty((N, C), dt)
    ops.moe_combine(dxs, c.slot, None, dhn)                               # the gather's backward
    dlogits = d.empty(c.logits.shape, dt)
    ops.moe_route_backward(c.logits, c.ids, dw, dlogits, mlp.norm_topk, mlp.stats and mlp.stats.dprobs)
    linear_grad(dlogits, mlp.router, dhn, 1.0)                            # dhn += dlogits Wr
    dh = d.empty((N, C + dh_cols), dt)
    ops.rmsnorm_backward(dhn, h, mlp.norm, c.rstd, dh[:, :C], residual=dyv)  # dh = norm's gradient + dy
    return dh


# ---- the experts' weights as checkpoints store them

_PER_EXPERT = {  # family: (block name, {our fused name: the stored names of an expert's pieces})
    "qwen3_moe": ("mlp", {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}),
    "mixtral": ("block_sparse_moe", {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
}


class StackedTensor:
    """Experts' per-expert tensors read as one (E, out, in) array (gate_up: gate's rows, then up's),
    lazily like the LazyTensors it holds (`parts[e]`: the pieces of expert e)."""

    def __init__(self, parts):
        self.parts = parts
        first = parts[0][0]
        rows = sum(p.shape[0] for p in parts[0])
        self.shape = (len(parts), rows, first.shape[1])
        self.st_dtype, self.path = first.st_dtype, first.path

    @property
    def ndim(self):
        return 3

    def __array__(self, dtype=None, copy=None):
        a = np.stack([np.concatenate([np.asarray(p, np.float32) for p in ps]) for ps in self.parts])
        return a if dtype is None else a.astype(dtype, copy=False)


class ExpertHalves:
    """A fused gate_up_proj (E, 2F, C) held as its two halves, gate's and up's experts (E, F, C)
    each, float or QuantizedArrays (MLX's switch_mlp)."""

    def __init__(self, gate, up):
        self.parts = (gate, up)
        E, F, C = gate.shape
        self.shape, self.ndim = (E, 2 * F, C), 3

    def __array__(self, dtype=None, copy=None):
        a = np.concatenate([np.asarray(p, np.float32) for p in self.parts], axis=1)
        return a if dtype is None else a.astype(dtype, copy=False)


def switch_experts(tensors, config, where):
    """tensors with mlx-lm's experts (`mlp.switch_mlp.{gate,up,down}_proj`, (E, O, I) each, float or
    quantized with `.scales` and `.biases` (E, O, I / group_size)) under the fused names; a
    quantized triple's bits and group size follow from its shapes, as for MLX's linears."""
    if not config.moe:
        return tensors
    out, bad = dict(tensors), []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        got = {}
        for n in ("gate_proj", "up_proj", "down_proj"):
            w, s, b = (out.pop(f"{p}switch_mlp.{n}.{k}", None) for k in ("weight", "scales", "biases"))
            if w is None:
                continue
            I = config.hidden_size if n != "down_proj" else config.moe["expert_size"]
            if s is None:  # float, or (GGUF) a QuantizedArray already
                got[n] = w
            elif b is None or w.ndim != 3 or s.ndim != 3 or w.shape[2] * 32 % I or I % s.shape[2]:
                bad.append(f"{p}switch_mlp.{n}: codes {w.shape}, scales {s.shape}, biases "
                           f"{None if b is None else b.shape} do not quantize (E, O, {I}) experts")
                continue
            else:
                got[n] = QuantizedArray(w, s, b, w.shape[2] * 32 // I, I // s.shape[2],
                                        {"F32": "f32", "F16": "f16", "BF16": "bf16"}.get(s.st_dtype, "f32"))
        if "gate_proj" in got and "up_proj" in got:
            out[p + "experts.gate_up_proj"] = ExpertHalves(got["gate_proj"], got["up_proj"])
        if "down_proj" in got:
            out[p + "experts.down_proj"] = got["down_proj"]
    if bad:
        raise ValueError(f"[hf] {where}: " + "; ".join(bad))
    return out


def stacked_experts(tensors, config):
    """tensors with a mixture of experts' per-expert weights (transformers' save_pretrained; Mixtral's
    block_sparse_moe w1/w2/w3) replaced by the fused names ModelConfig.weight_shapes lists. Fused
    checkpoints pass through; a layer missing an expert's piece is left for the caller's check to name."""
    if not config.moe or config.model_type not in _PER_EXPERT:
        return tensors
    block, pieces = _PER_EXPERT[config.model_type]
    out = dict(tensors)
    E = config.moe["experts"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.{block}."
        router = out.pop(p + "gate.weight", None)
        if router is not None:
            out[f"model.layers.{i}.mlp.gate.weight"] = router
        for fused, names in pieces.items():
            keys = [[f"{p}experts.{e}.{n}.weight" for n in names] for e in range(E)]
            if all(k in out for ks in keys for k in ks):
                out[f"model.layers.{i}.mlp.experts.{fused}"] = StackedTensor([[out.pop(k) for k in ks] for ks in keys])
    return out


def expert_pieces(config, name, array):
    """[(stored name, (out, in) array)] of a fused expert weight as `config`'s family stores it per
    expert (the inverse of stacked_experts, for writing folders the way transformers does)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(experts\.(gate_up_proj|down_proj)|gate\.weight)", name)
    if m is None or config.model_type not in _PER_EXPERT:
        return [(name, array)]
    block, pieces = _PER_EXPERT[config.model_type]
    p = f"model.layers.{m.group(1)}.{block}."
    if m.group(3) is None:
        return [(p + "gate.weight", array)]
    names, a = pieces[m.group(3)], np.asarray(array, np.float32)
    rows = a.shape[1] // len(names)
    return [(f"{p}experts.{e}.{n}.weight", a[e, j * rows:(j + 1) * rows]) for e in range(a.shape[0])
            for j, n in enumerate(names)]


def merged_experts(W32, A, B, scale):
    """W (E, out, in) + s B_e A_e per expert in float32, the factors as the model holds them."""
    B = np.asarray(B, np.float32)
    if B.ndim == 4:  # gate_up_proj: gate's rows, then up's
        B = np.concatenate([B[0], B[1]], axis=1)
    return (W32 + np.float32(scale) * np.einsum("eor,eri->eoi", B, np.asarray(A, np.float32))).astype(np.float32)


def stored_name(config, weights, name):
    """The name a weight goes back under: a router beside experts read per expert, its family's
    per-expert name (Mixtral's block_sparse_moe.gate); any other weight, its own."""
    if config.moe and name.endswith(".mlp.gate.weight"):
        if isinstance(weights.get(name[:-len("gate.weight")] + "experts.down_proj"), StackedTensor):
            return expert_pieces(config, name, None)[0][0]
    return name


class ExpertPieces:
    """A fused expert weight's per-expert pieces, made once for all of them and dropped after the last."""

    def __init__(self, config, name, get):
        self.config, self.name, self.get, self.arrays, self.left = config, name, get, None, None

    def take(self, j):
        if self.arrays is None:
            self.arrays = [a for _, a in expert_pieces(self.config, self.name, self.get())]
            self.left = len(self.arrays)
        a, self.left = self.arrays[j], self.left - 1
        if self.left == 0:
            self.arrays = None
        return a


# ---- the experts' LoRA in PEFT's layout (target_parameters on the fused expert weights)

def peft_expert_keys(i, modules):
    """{module: (PEFT key of A, of B)} of layer i's expert modules among `modules`. PEFT wraps the
    experts' parameters in their declaration order (gate_up_proj, then down_proj), each wrapper
    around the last: all but the outermost sit under one more `base_layer.` per wrapper above."""
    mods = [m for m in ("gate_up_proj", "down_proj") if m in modules]
    p = f"base_model.model.model.layers.{i}.mlp.experts."
    return {m: tuple(p + "base_layer." * (len(mods) - 1 - j) + f"lora_{f}.weight" for f in "AB")
            for j, m in enumerate(mods)}


def peft_factors(A, B):
    """PEFT's (E r, in) A and (out, r E) B (column j E + e: rank j of expert e) of factors held as
    A (E, r, in) and B (E, out, r) or gate_up_proj's (2, E, F, r)."""
    A, B = np.asarray(A, np.float32), np.asarray(B, np.float32)
    if B.ndim == 4:
        B = np.concatenate([B[0], B[1]], axis=1)                          # (E, 2F, r): gate's rows, then up's
    E, out, r = B.shape
    return A.reshape(E * r, A.shape[2]), np.ascontiguousarray(B.transpose(1, 2, 0).reshape(out, r * E))


def held_factors(A, B, E, fused_gate_up):
    """The inverse of peft_factors for E experts."""
    A, B = np.asarray(A, np.float32), np.asarray(B, np.float32)
    r = A.shape[0] // E
    out = B.shape[0]
    Bh = np.ascontiguousarray(B.reshape(out, r, E).transpose(2, 0, 1))   # (E, out, r)
    if fused_gate_up:
        Bh = np.stack([Bh[:, :out // 2], Bh[:, out // 2:]])
    return np.ascontiguousarray(A.reshape(E, r, A.shape[1])), np.ascontiguousarray(Bh)
