"""The Llama family (llama, mistral, qwen2) with LoRA adapters, as explicit forward and backward
over core ops (llm.c style, no autograd tape; DESIGN sections 3, 5 and 8).

    x0 = embed(ids)
    per layer:  h = x + o_proj(attn(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))   n1 = rmsnorm(x)
                y = h + down_proj(silu(gate_proj(n2)) * up_proj(n2))                  n2 = rmsnorm(h)
    logits = rmsnorm(x_L) W_head^T  (W_head = embed_tokens when tied), mean cross entropy over
    the targets that are not ignore_index (-100), chunked over tokens.

Frozen weights are uploaded once in the compute dtype, stored [out, in] as in HF checkpoints.
Every adapted linear is y = x W^T (+ bias) + s (drop(x) A^T) B^T with A (r, in), B (out, r) as
views of one FlatParams (f32 masters and gradients, PEFT key names). LoRA gradients accumulate
into FlatParams.grads (the caller zeros them); base weights never change.
"""

import contextlib
import json
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from . import _core
from .params import FlatParams

ops = _core.ops

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ALL_MODULES = ATTN_MODULES + MLP_MODULES
QKV_MODULES = ("q_proj", "k_proj", "v_proj")
IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------
# Configs


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    sliding_window: Optional[int] = None  # attention window (mistral; qwen2 with use_sliding_window)
    source: str = field(default="<dict>", repr=False, compare=False)

    @classmethod
    def from_file(cls, path):
        path = str(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"[ModelConfig] cannot read {path}: {e}") from e
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"[ModelConfig] {path}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from e
        return cls.from_dict(d, source=path)

    @classmethod
    def from_dict(cls, d, source="<dict>"):
        where = f"[ModelConfig] {source}"
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{where}: unknown model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")

        def get(key, kind, default=None, required=True, positive=True):
            if key not in d or d[key] is None:
                if required and default is None:
                    raise ValueError(f"{where}: missing key {key!r}")
                return default
            v = d[key]
            if kind is int:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
                    raise ValueError(f"{where}: key {key!r} must be an integer, got {v!r}")
                v = int(v)
            elif kind is float:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise ValueError(f"{where}: key {key!r} must be a number, got {v!r}")
                v = float(v)
            elif kind is bool:
                if not isinstance(v, bool):
                    raise ValueError(f"{where}: key {key!r} must be true or false, got {v!r}")
            if positive and kind in (int, float) and not v > 0:
                raise ValueError(f"{where}: key {key!r} must be > 0, got {v!r}")
            return v

        C = get("hidden_size", int)
        H = get("num_attention_heads", int)
        Hk = get("num_key_value_heads", int, default=H)
        if H % Hk:
            raise ValueError(f"{where}: num_attention_heads ({H}) must be a multiple of num_key_value_heads ({Hk})")
        if "head_dim" in d and d["head_dim"] is not None:
            D = get("head_dim", int)
        else:
            if C % H:
                raise ValueError(f"{where}: hidden_size ({C}) is not a multiple of num_attention_heads ({H}) "
                                 "and head_dim is not given")
            D = C // H
        if D % 2:
            raise ValueError(f"{where}: head_dim must be even for rotary embeddings, got {D}")
        rs = d.get("rope_scaling")
        if rs is not None:
            if not isinstance(rs, dict):
                raise ValueError(f"{where}: key 'rope_scaling' must be an object or null, got {rs!r}")
            kind = rs.get("rope_type", rs.get("type"))
            if kind in (None, "default"):
                rs = None
            elif kind == "linear":
                if not isinstance(rs.get("factor"), (int, float)) or not rs["factor"] > 0:
                    raise ValueError(f"{where}: key 'rope_scaling.factor' must be a number > 0, got {rs.get('factor')!r}")
            elif kind == "llama3":
                for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                    if not isinstance(rs.get(k), (int, float)) or not rs[k] > 0:
                        raise ValueError(f"{where}: key 'rope_scaling.{k}' must be a number > 0, got {rs.get(k)!r}")
                if rs["high_freq_factor"] <= rs["low_freq_factor"]:
                    raise ValueError(f"{where}: rope_scaling.high_freq_factor must exceed low_freq_factor")
            else:
                raise ValueError(f"{where}: unsupported key 'rope_scaling' type {kind!r}; supported: linear, llama3")
        if mt == "qwen2":
            bias = True  # Qwen2 always has q/k/v biases (HF hard-codes them)
            if "attention_bias" in d and d["attention_bias"] is not None:
                bias = get("attention_bias", bool)
        else:
            bias = get("attention_bias", bool, default=False, required=False)
        sw = None
        if mt == "mistral" or (mt == "qwen2" and d.get("use_sliding_window")):
            sw = get("sliding_window", int, default=None, required=False)
        return cls(
            model_type=mt,
            vocab_size=get("vocab_size", int),
            hidden_size=C,
            intermediate_size=get("intermediate_size", int),
            num_hidden_layers=get("num_hidden_layers", int),
            num_attention_heads=H,
            num_key_value_heads=Hk,
            head_dim=D,
            rope_theta=get("rope_theta", float, default=10000.0),
            rope_scaling=dict(rs) if rs else None,
            rms_norm_eps=get("rms_norm_eps", float, default=1e-6),
            tie_word_embeddings=get("tie_word_embeddings", bool, default=False, required=False),
            attention_bias=bias,
            max_position_embeddings=get("max_position_embeddings", int, default=2048),
            sliding_window=sw,
            source=source,
        )

    def module_shape(self, name):
        """(out, in) of a projection."""
        C, F, H, Hk, D = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                          self.num_key_value_heads, self.head_dim)
        return {"q_proj": (H * D, C), "k_proj": (Hk * D, C), "v_proj": (Hk * D, C), "o_proj": (C, H * D),
                "gate_proj": (F, C), "up_proj": (F, C), "down_proj": (C, F)}[name]

    def inv_freq(self):
        """The rotary inverse frequencies (D/2,) as HF computes them, rope_scaling included."""
        D = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, D, 2, dtype=np.int64).astype(np.float64) / D))
        rs = self.rope_scaling
        if rs:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "linear":
                inv = inv / float(rs["factor"])
            elif kind == "llama3":
                factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
                old = float(rs["original_max_position_embeddings"])
                low_wl, high_wl = old / lo, old / hi
                wl = 2 * math.pi / inv
                out = np.where(wl > low_wl, inv / factor, inv)
                smooth = (old / wl - lo) / (hi - lo)
                smoothed = (1 - smooth) * out / factor + smooth * out
                medium = ~(wl < high_wl) & ~(wl > low_wl)
                inv = np.where(medium, smoothed, out)
        return inv.astype(np.float32)

    def weight_shapes(self):
        """{HF name: shape} of every weight this config needs."""
        C, V = self.hidden_size, self.vocab_size
        s = {"model.embed_tokens.weight": (V, C)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            for m in ATTN_MODULES:
                s[p + f"self_attn.{m}.weight"] = self.module_shape(m)
            if self.attention_bias:
                for m in ("q_proj", "k_proj", "v_proj"):
                    s[p + f"self_attn.{m}.bias"] = (self.module_shape(m)[0],)
            for m in MLP_MODULES:
                s[p + f"mlp.{m}.weight"] = self.module_shape(m)
            s[p + "input_layernorm.weight"] = (C,)
            s[p + "post_attention_layernorm.weight"] = (C,)
        s["model.norm.weight"] = (C,)
        if not self.tie_word_embeddings:
            s["lm_head.weight"] = (V, C)
        return s


@dataclass
class LoraConfig:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple = ALL_MODULES
    use_rslora: bool = False
    layers: Optional[list] = None

    @property
    def scale(self):
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r

    def validate(self, config):
        if isinstance(self.target_modules, str):
            self.target_modules = (self.target_modules,)
        self.target_modules = tuple(self.target_modules)
        bad = [m for m in self.target_modules if m not in ALL_MODULES]
        if bad:
            raise ValueError(f"[LoraConfig] unknown target module(s) {bad}; valid names: {', '.join(ALL_MODULES)}")
        if isinstance(self.r, bool) or not isinstance(self.r, (int, np.integer)):
            raise ValueError(f"[LoraConfig] r must be an integer, got {self.r!r}")
        for m in self.target_modules:
            out, inp = config.module_shape(m)
            if self.r < 1 or self.r > min(out, inp):
                raise ValueError(f"[LoraConfig] r={self.r} is invalid for {m} (in={inp}, out={out}): "
                                 f"it must be between 1 and min(in, out) = {min(out, inp)}")
        if not (0.0 <= float(self.dropout) < 1.0):
            raise ValueError(f"[LoraConfig] dropout must be in [0, 1), got {self.dropout!r}")
        if not float(self.alpha) > 0:
            raise ValueError(f"[LoraConfig] alpha must be > 0, got {self.alpha!r}")
        n = config.num_hidden_layers
        if self.layers is not None:
            bad = [i for i in self.layers if not isinstance(i, (int, np.integer)) or not 0 <= i < n]
            if bad:
                raise ValueError(f"[LoraConfig] layers {bad} out of range for a model of {n} layers")

    def adapted_layers(self, config):
        n = config.num_hidden_layers
        return list(range(n)) if self.layers is None else sorted(set(int(i) for i in self.layers))


def lora_key(layer, module, factor):
    """PEFT's key of a LoRA factor ('A' or 'B')."""
    part = "self_attn" if module in ATTN_MODULES else "mlp"
    return f"base_model.model.model.layers.{layer}.{part}.{module}.lora_{factor}.weight"


def random_weights(config, seed=0, std=0.02):
    """Random HF-named float32 weights for tiny models (norm weights near 1)."""
    rng = np.random.default_rng(seed)
    w = {}
    for k, shape in config.weight_shapes().items():
        if k.endswith("norm.weight"):
            w[k] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif k.endswith(".bias"):
            w[k] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w[k] = (std * rng.standard_normal(shape)).astype(np.float32)
    return w


# ---------------------------------------------------------------------------------------------
# Modules


class LoraLinear:
    """y = x W^T (+ b) (+ s (drop(x) A^T) B^T), DESIGN section 3."""

    def __init__(self, model, W, bias=None, lora=None, tag=0):
        self.m, self.W, self.bias = model, W, bias
        self.out, self.inp = W.shape
        self.lora = lora  # (A, B, gA, gB) or None
        self.tag = tag
        self.s = model.lora_config.scale
        self.p = float(model.lora_config.dropout)

    def _seed(self):
        return (self.m._call_seed * 1000003 + self.tag) & 0x7FFFFFFFFFFFFFFF

    def forward(self, x, y):
        """Writes y (rows, out); returns what backward needs."""
        ops.gemm(x, self.W, y, trans_b=True)                              # y = x W^T
        if self.bias is not None:
            ops.gemm(self.m._ones(x.shape[0]), self.bias, y, beta=1.0)    # y += 1 b
        return self.lora_forward(x, y)

    def lora_forward(self, x, y):
        """y += s drop(x) A^T B^T (y may be a column block of a fused output)."""
        if self.lora is None:
            return {}
        d, dt, rows = self.m.dev, self.m.dtype, x.shape[0]
        A, B = self.lora[0], self.lora[1]
        xd = x
        if self.p > 0:
            xd = d.empty((rows, self.inp), dt)
            ops.dropout(x, xd, self.p, self._seed())
        t = d.empty((rows, A.shape[0]), dt)
        ops.gemm(xd, A, t, trans_b=True)                                  # t = drop(x) A^T   (rows, r)
        ops.gemm(t, B, y, trans_b=True, alpha=self.s, beta=1.0)           # y += s t B^T
        return {"xd": xd, "t": t}

    def backward(self, dy, ctx, dx, accumulate=False):
        """dx (+)= dy W (+ drop(dt A)); LoRA gradients accumulate (beta = 1)."""
        ops.gemm(dy, self.W, dx, beta=1.0 if accumulate else 0.0)         # dx (+)= dy W
        self.lora_backward(dy, ctx, dx)

    def lora_backward(self, dy, ctx, dx):
        """LoRA gradients from dy (possibly a column block) and dx += drop(dt A)."""
        if self.lora is None:
            return
        d, dt, rows = self.m.dev, self.m.dtype, dy.shape[0]
        A, B, gA, gB = self.lora
        t, xd = ctx["t"], ctx["xd"]
        ops.gemm(dy, t, gB, trans_a=True, alpha=self.s, beta=1.0)         # dB += s dy^T t    (out, r)
        dtt = d.empty((rows, A.shape[0]), dt)
        ops.gemm(dy, B, dtt, alpha=self.s)                                # dt = s dy B       (rows, r)
        ops.gemm(dtt, xd, gA, trans_a=True, beta=1.0)                     # dA += dt^T drop(x) (r, in)
        if self.p > 0:
            tmp, tmp2 = d.empty((rows, self.inp), dt), d.empty((rows, self.inp), dt)
            ops.gemm(dtt, A, tmp)
            ops.dropout(tmp, tmp2, self.p, self._seed())                  # same mask as forward
            ops.axpy(1.0, tmp2, dx)
        else:
            ops.gemm(dtt, A, dx, beta=1.0)                                # dx += dt A


class LlamaModel:
    def __init__(self, device, config, weights, lora=None, dtype="f32", seed=0, grad_checkpoint=False,
                 ce_chunk=1024):
        if isinstance(config, dict):
            config = ModelConfig.from_dict(config)
        if dtype not in ("f32", "f16", "bf16"):
            raise ValueError(f"[LlamaModel] dtype must be f32, f16 or bf16, got {dtype!r}")
        self.dev, self.config, self.dtype = device, config, dtype
        self.lora_config = lora if lora is not None else LoraConfig()
        self.lora_config.validate(config)
        self.grad_checkpoint = bool(grad_checkpoint)
        self.ce_chunk = int(ce_chunk)
        self._call_seed = int(seed)
        self._check_weights(weights)
        c = config
        self.H, self.Hk, self.D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.g = self.H // self.Hk
        self.inv_freq = device.tensor(c.inv_freq(), "f32")
        up = lambda k: device.tensor(np.asarray(weights[k], np.float32), dtype)
        self.embed = up("model.embed_tokens.weight")
        self.head = self.embed if c.tie_word_embeddings else up("lm_head.weight")
        self.norm_w = up("model.norm.weight")

        # LoRA factors: one FlatParams, PEFT names, A then B per adapted module.
        r = self.lora_config.r
        self.adapted = {}
        shapes = {}
        for i in self.lora_config.adapted_layers(c):
            for m in ALL_MODULES:
                if m in self.lora_config.target_modules:
                    out, inp = c.module_shape(m)
                    shapes[lora_key(i, m, "A")] = (r, inp)
                    shapes[lora_key(i, m, "B")] = (out, r)
                    self.adapted[(i, m)] = True
        self.lora_params = FlatParams(device, shapes, dtype)
        rng = np.random.default_rng(seed)
        init = {}
        for k, shp in shapes.items():
            if ".lora_A." in k:   # PEFT: kaiming_uniform_(a=sqrt(5)) => U(-1/sqrt(in), 1/sqrt(in))
                b = 1.0 / math.sqrt(shp[1])
                init[k] = rng.uniform(-b, b, size=shp).astype(np.float32)
            else:
                init[k] = np.zeros(shp, np.float32)
        if shapes:
            self.lora_params.load(init)

        HD, KD = self.H * self.D, self.Hk * self.D
        self._qkv_cols = {"q_proj": (0, HD), "k_proj": (HD, HD + KD), "v_proj": (HD + KD, HD + 2 * KD)}
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            L = {"n1": up(p + "input_layernorm.weight"), "n2": up(p + "post_attention_layernorm.weight")}
            # q, k and v share their input: their weights live in one (QKV, C) buffer so the
            # projection is one GEMM and one head transpose instead of three of each (fewer
            # dispatches for GPU backends; on the 2-core CPU with OpenBLAS the time is the same,
            # measured). Each module's weight is a row range of it, its output a column block.
            qkv = [f"{p}self_attn.{m}.weight" for m in QKV_MODULES]
            L["qkv"] = device.tensor(np.concatenate([np.asarray(weights[k], np.float32) for k in qkv]), dtype)
            L["qkv_bias"] = None
            if c.attention_bias:
                b = [np.asarray(weights[f"{p}self_attn.{m}.bias"], np.float32) for m in QKV_MODULES]
                L["qkv_bias"] = device.tensor(np.concatenate(b).reshape(1, -1), dtype)
            for tag, m in enumerate(ALL_MODULES):
                part = "self_attn" if m in ATTN_MODULES else "mlp"
                bias = None
                if m in QKV_MODULES:
                    r0, r1 = self._qkv_cols[m]
                    W = L["qkv"][r0:r1]
                    if L["qkv_bias"] is not None:
                        bias = L["qkv_bias"][:, r0:r1]
                else:
                    W = up(f"{p}{part}.{m}.weight")
                lo = None
                if (i, m) in self.adapted:
                    kA, kB = lora_key(i, m, "A"), lora_key(i, m, "B")
                    lp = self.lora_params
                    lo = (lp.compute(kA), lp.compute(kB), lp.grad(kA), lp.grad(kB))
                L[m] = LoraLinear(self, W, bias, lo, tag=i * len(ALL_MODULES) + tag)
            self.layers.append(L)
        caps = device.capabilities()
        # Causal query row blocks skip the score blocks above the diagonal at the cost of more,
        # smaller GEMMs: the device says how many rows a block takes (0: all, one block; its
        # backend holds the measurements).
        self.attn_block = caps["attention_block"]
        # Fused (flash) attention where the device runs it faster than the materialised path, in
        # the dtypes it lists (CUDA with cuDNN: bf16/f16; ops.attention_forward). Packed segments
        # keep the materialised path (the fused ops mask causally only). Settable, e.g. to compare
        # both.
        self.fused_attention = dtype in caps["fused_attention"]["dtypes"]
        self._ones_cache = None
        self._pos_rows = self._seg_rows = None
        self.d_embed_out = None
        self._loss = None

    # -- helpers ---------------------------------------------------------------------------

    def _check_weights(self, weights):
        want = self.config.weight_shapes()
        have = set(weights)
        missing = sorted(set(want) - have)
        unexpected = sorted(have - set(want))
        if self.config.tie_word_embeddings and "lm_head.weight" in unexpected:
            unexpected.remove("lm_head.weight")  # some tied checkpoints still store it; ignored
        bad = [f"{k}: {tuple(np.shape(weights[k]))} (expected {want[k]})" for k in sorted(set(want) & have)
               if tuple(np.shape(weights[k])) != tuple(want[k])]
        msgs = []
        if missing:
            msgs.append(f"missing weights {missing}")
        if unexpected:
            msgs.append(f"unexpected weights {unexpected}")
        if bad:
            msgs.append(f"wrong shapes {bad}")
        if msgs:
            raise ValueError(f"[LlamaModel] weights do not match the config ({self.config.source}): " + "; ".join(msgs))

    def _ones(self, rows):
        if self._ones_cache is None or self._ones_cache.shape[0] < rows:
            self._ones_cache = self.dev.tensor(np.ones((rows, 1), np.float32), self.dtype)
        return self._ones_cache[:rows]

    def _ids(self, ids, what):
        if isinstance(ids, _core.Tensor):
            if ids.ndim != 2:
                raise ValueError(f"[LlamaModel] {what} must be (B, T), got {ids.shape}")
            return ids.reshape(-1), tuple(ids.shape), None
        a = np.asarray(ids)
        if a.ndim == 1:
            a = a[None, :]
        if a.ndim != 2 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"[LlamaModel] {what} must be a (B, T) integer array, got shape {a.shape} dtype {a.dtype}")
        return self.dev.tensor(a.reshape(-1).astype(np.int32), "i32"), a.shape, a

    def _lora_grads(self):
        return {k: self.lora_params.grad(k) for k in self.lora_params.shapes}

    # -- layers ----------------------------------------------------------------------------

    def _row_blocks(self, T, seg):
        """Query row blocks of causal attention: (r0, r1) pairs covering [0, T). nb blocks leave
        (nb - 1) / (2 nb) of the score matrix uncomputed; attn_block 0 and packed segments (their
        softmax wants square scores) take one block."""
        if seg is not None or not self.attn_block or T <= self.attn_block:
            return [(0, T)]
        return [(r0, min(T, r0 + self.attn_block)) for r0 in range(0, T, self.attn_block)]

    def _qrows(self, x, s, r0, r1):
        """Rows r0:r1 of query head s of every KV head's group, from x (H, T, cols) with the g
        query heads of a KV head adjacent: a (Hk, r1 - r0, cols) view."""
        if self.g == 1:
            return x[:, r0:r1]
        T = x.shape[1]
        return x.reshape(self.Hk, self.g * T, x.shape[2])[:, s * T + r0:s * T + r1]

    def _qkv_forward(self, L, xn, cache):
        """q|k|v = xn Wqkv^T (+ bias) (+ LoRA into each column block): (rows, (H + 2 Hk) D)."""
        rows = xn.shape[0]
        qkv = self.dev.empty((rows, (self.H + 2 * self.Hk) * self.D), self.dtype)
        ops.gemm(xn, L["qkv"], qkv, trans_b=True)
        if L["qkv_bias"] is not None:
            ops.gemm(self._ones(rows), L["qkv_bias"], qkv, beta=1.0)
        for m in QKV_MODULES:
            c0, c1 = self._qkv_cols[m]
            cache[m] = L[m].lora_forward(xn, qkv[:, c0:c1])
        return qkv

    def _mlp_forward(self, L, h, cache):
        """out = h + down(silu(gate(hn)) * up(hn)) with hn = rmsnorm(h); saves what backward needs."""
        d, dt, c = self.dev, self.dtype, self.config
        N, C, F = h.shape[0], c.hidden_size, c.intermediate_size
        hn, r2 = d.empty((N, C), dt), d.empty((N,), "f32")
        ops.rmsnorm_forward(h, L["n2"], hn, r2, c.rms_norm_eps)
        gt, ut, a = d.empty((N, F), dt), d.empty((N, F), dt), d.empty((N, F), dt)
        cache["gate_ctx"] = L["gate_proj"].forward(hn, gt)
        cache["up_ctx"] = L["up_proj"].forward(hn, ut)
        ops.swiglu_forward(gt, ut, a)
        out = d.empty((N, C), dt)
        cache["down_ctx"] = L["down_proj"].forward(a, out)
        ops.add(out, h, out)                                              # out = h + mlp
        cache.update(hn=hn, r2=r2, g=gt, u=ut, a=a)
        return out

    def _attention_forward(self, L, xn, B, T, cache):
        d, dt, H, Hk, D = self.dev, self.dtype, self.H, self.Hk, self.D
        N, NH = B * T, H + 2 * Hk
        qkv = self._qkv_forward(L, xn, cache)
        att = d.empty((N, H * D), dt)
        per = []
        for b in range(B):
            r = slice(b * T, (b + 1) * T)
            # One transpose makes every head of q, k and v head-major: (NH, T, D).
            heads = d.empty((NH, T, D), dt)
            ops.transpose_heads(qkv[r].reshape(T, NH, D), heads)
            qh, kh, vh = heads[:H], heads[H:H + Hk], heads[H + Hk:]
            pos = self._row_pos(b)
            ops.rope(qh, pos, self.inv_freq)
            ops.rope(kh, pos, self.inv_freq)
            seg = None if self._seg_rows is None else self._seg_rows[b]
            oh = d.empty((H, T, D), dt)
            if self.fused_attention and seg is None:
                saved = (oh, d.empty((H, T), "f32"))                      # its output and log-sum-exp
                ops.attention_forward(qh, kh, vh, oh, saved[1], self._scale)   # scores stay on chip
            else:
                saved = self._score_blocks_forward(qh, kh, vh, oh, T, seg)
            ops.transpose_heads(oh, att[r].reshape(T, H, D))
            per.append((qh, kh, vh, saved))
        cache["attn"] = per
        cache["att"] = att
        return att

    def _score_blocks_forward(self, qh, kh, vh, oh, T, seg):
        """oh = the materialised attention of qh, kh, vh; returns the saved probability blocks
        [(r0, r1, P)] that _score_blocks_backward reads."""
        d, dt, H, Hk, g = self.dev, self.dtype, self.H, self.Hk, self.g
        Ps = []
        for r0, r1 in self._row_blocks(T, seg):
            # Causal: queries r0:r1 see keys :r1 only, so the block's scores are (H, n, r1);
            # the key blocks above the diagonal are never computed.
            P = d.empty((H, r1 - r0, r1), dt)
            for s in range(g):
                ops.gemm(self._qrows(qh, s, r0, r1), kh[:, :r1], self._qrows(P, s, 0, r1 - r0),
                         trans_b=True, batch=Hk)                      # S = Q K^T
            ops.softmax_causal_forward(P, P, self._scale, seg)         # in place: P = softmax(S)
            for s in range(g):
                ops.gemm(self._qrows(P, s, 0, r1 - r0), vh[:, :r1], self._qrows(oh, s, r0, r1), batch=Hk)
            Ps.append((r0, r1, P))
        return Ps

    def _score_blocks_backward(self, qh, kh, vh, Ps, doh, dqh, dkh, dvh):
        """dq, dk, dv of the materialised attention from its saved probability blocks Ps."""
        d, dt, H, Hk, g = self.dev, self.dtype, self.H, self.Hk, self.g
        # Last row block first: it reaches every key, so its dK and dV write all T rows
        # (beta 0) and the earlier blocks accumulate into their shorter key ranges.
        first = True
        for r0, r1, P in reversed(Ps):
            n = r1 - r0
            dS = d.empty((H, n, r1), dt)
            for s in range(g):
                ops.gemm(self._qrows(doh, s, r0, r1), vh[:, :r1], self._qrows(dS, s, 0, n),
                         trans_b=True, batch=Hk)                      # dP = dO V^T
            ops.softmax_backward(P, dS, dS, self._scale)               # in place: dS from dP
            for s in range(g):
                beta = 0.0 if first else 1.0
                Pq, dSq, dOq = self._qrows(P, s, 0, n), self._qrows(dS, s, 0, n), self._qrows(doh, s, r0, r1)
                ops.gemm(Pq, dOq, dvh[:, :r1], trans_a=True, beta=beta, batch=Hk)   # dV (+)= P^T dO
                ops.gemm(dSq, kh[:, :r1], self._qrows(dqh, s, r0, r1), batch=Hk)     # dQ = dS K
                ops.gemm(dSq, self._qrows(qh, s, r0, r1), dkh[:, :r1], trans_a=True, beta=beta,
                         batch=Hk)                                                  # dK (+)= dS^T Q
                first = False

    def _attention_backward(self, L, xn, dattn, cache, dxn):
        """dattn: gradient at the o_proj input (N, H*D). Writes dxn (N, C)."""
        d, dt, H, Hk, D, g = self.dev, self.dtype, self.H, self.Hk, self.D, self.g
        B, T = self._BT
        N = B * T
        NH = H + 2 * Hk
        dqkv = d.empty((N, NH * D), dt)
        for b, (qh, kh, vh, Ps) in enumerate(cache["attn"]):
            r = slice(b * T, (b + 1) * T)
            doh = d.empty((H, T, D), dt)
            ops.transpose_heads(dattn[r].reshape(T, H, D), doh)
            dheads = d.empty((NH, T, D), dt)
            dqh, dkh, dvh = dheads[:H], dheads[H:H + Hk], dheads[H + Hk:]
            if isinstance(Ps, tuple):  # fused forward: its output and log-sum-exp
                ops.attention_backward(qh, kh, vh, Ps[0], doh, Ps[1], dqh, dkh, dvh, self._scale)
            else:
                self._score_blocks_backward(qh, kh, vh, Ps, doh, dqh, dkh, dvh)
            ops.rope(dqh, self._row_pos(b), self.inv_freq, -1.0)
            ops.rope(dkh, self._row_pos(b), self.inv_freq, -1.0)
            ops.transpose_heads(dheads, dqkv[r].reshape(T, NH, D))
        ops.gemm(dqkv, L["qkv"], dxn)                                      # dxn = dq|dk|dv Wqkv (K = NH*D)
        for m in QKV_MODULES:
            c0, c1 = self._qkv_cols[m]
            L[m].lora_backward(dqkv[:, c0:c1], cache[m], dxn)

    def _layer_forward(self, i, x):
        """Returns (out, cache) for layer i on x (N, C)."""
        d, dt, c = self.dev, self.dtype, self.config
        L = self.layers[i]
        B, T = self._BT
        N, C = B * T, c.hidden_size
        cache = {}
        xn, r1 = d.empty((N, C), dt), d.empty((N,), "f32")
        ops.rmsnorm_forward(x, L["n1"], xn, r1, c.rms_norm_eps)
        att = self._attention_forward(L, xn, B, T, cache)
        h = d.empty((N, C), dt)
        cache["o_ctx"] = L["o_proj"].forward(att, h)
        ops.add(h, x, h)                                                  # h = x + attn
        out = self._mlp_forward(L, h, cache)
        cache.update(xn=xn, r1=r1, h=h)
        return out, cache

    def _layer_backward(self, i, x, cache, dout):
        """Returns dx (N, C) given dout, the gradient at the layer output."""
        d, dt, c = self.dev, self.dtype, self.config
        L = self.layers[i]
        B, T = self._BT
        N, C, F, H, D = B * T, c.hidden_size, c.intermediate_size, self.H, self.D
        # MLP
        da = d.empty((N, F), dt)
        L["down_proj"].backward(dout, cache["down_ctx"], da)
        dg, du = d.empty((N, F), dt), d.empty((N, F), dt)
        ops.swiglu_backward(da, cache["g"], cache["u"], dg, du)
        dhn = d.empty((N, C), dt)
        L["gate_proj"].backward(dg, cache["gate_ctx"], dhn)
        L["up_proj"].backward(du, cache["up_ctx"], dhn, accumulate=True)
        dh = d.empty((N, C), dt)
        ops.rmsnorm_backward(dhn, cache["h"], L["n2"], cache["r2"], dh)
        ops.axpy(1.0, dout, dh)                                           # residual
        # attention
        datt = d.empty((N, H * D), dt)
        L["o_proj"].backward(dh, cache["o_ctx"], datt)
        dxn = d.empty((N, C), dt)
        self._attention_backward(L, cache["xn"], datt, cache, dxn)
        dx = d.empty((N, C), dt)
        ops.rmsnorm_backward(dxn, x, L["n1"], cache["r1"], dx)
        ops.axpy(1.0, dh, dx)                                             # residual
        return dx

    # -- whole model -----------------------------------------------------------------------

    def _row_arrays(self, a, what, shape):
        if a is None:
            return None
        a = np.asarray(a)
        if a.ndim == 1:
            a = a[None, :]
        if a.shape != tuple(shape) or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"[LlamaModel] {what} must be a {tuple(shape)} integer array like ids, "
                             f"got shape {a.shape} dtype {a.dtype}")
        return a.astype(np.int32)

    def _setup(self, shape, segments=None, positions=None):
        """Per-call state. positions (B, T) replace arange(T) in the rotary embedding of each
        row; segments (B, T) restrict attention to keys of the query's own segment (packed
        samples)."""
        B, T = shape
        seg = self._row_arrays(segments, "segments", shape)
        pos = self._row_arrays(positions, "positions", shape)
        mp = self.config.max_position_embeddings
        if pos is not None:
            if pos.min() < 0 or pos.max() >= mp:
                raise ValueError(f"[LlamaModel] positions must lie in [0, {mp}) (max_position_embeddings), "
                                 f"got [{pos.min()}, {pos.max()}]")
        elif T > mp:
            raise ValueError(f"[LlamaModel] sequence length {T} exceeds max_position_embeddings {mp}")
        sw = self.config.sliding_window
        if sw is not None:
            span = T
            if seg is not None:  # the longest run of one segment bounds the attention span
                edges = np.concatenate([np.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
                run_starts = np.flatnonzero(np.concatenate([edges.reshape(-1), [True]]))
                span = int(np.diff(run_starts).max())
            if span > sw:
                raise ValueError(f"[LlamaModel] sequence length {span} exceeds the sliding window {sw} of "
                                 f"{self.config.source}: windowed attention is not implemented")
        self._BT = (B, T)
        self._pos = self.dev.tensor(np.arange(T, dtype=np.int32), "i32")
        self._pos_rows = None if pos is None else [self.dev.tensor(pos[b], "i32") for b in range(B)]
        self._seg_rows = None if seg is None else [self.dev.tensor(seg[b], "i32") for b in range(B)]
        self._scale = 1.0 / math.sqrt(self.D)

    def _row_pos(self, b):
        return self._pos if self._pos_rows is None else self._pos_rows[b]

    def _trunk_forward(self, ids_t, keep):
        """Embeddings and decoder layers; returns the final normed hidden state and saved state."""
        d, dt, c = self.dev, self.dtype, self.config
        B, T = self._BT
        N, C = B * T, c.hidden_size
        x = d.empty((N, C), dt)
        ops.embedding_forward(ids_t, self.embed, x)
        saved = []
        for i in range(c.num_hidden_layers):
            out, cache = self._layer_forward(i, x)
            if keep:
                saved.append((x, None if self.grad_checkpoint else cache))
            x = out
        xn, rstd = d.empty((N, C), dt), d.empty((N,), "f32")
        ops.rmsnorm_forward(x, self.norm_w, xn, rstd, c.rms_norm_eps)
        return x, xn, rstd, saved

    def _check_ids(self, a, what, allow_ignore):
        if a is None:
            return
        V = self.config.vocab_size
        bad = (a < 0) | (a >= V)
        if allow_ignore:
            bad &= a != IGNORE_INDEX
        if bad.any():
            raise ValueError(f"[LlamaModel] {what} holds values outside [0, {V})"
                             + (f" other than {IGNORE_INDEX}" if allow_ignore else "") + f": {np.unique(a[bad])[:8]}")

    def _targets(self, targets, shape):
        tt, tshape, ta = self._ids(targets, "targets")
        if tshape != shape:
            raise ValueError(f"[LlamaModel] targets shape {tshape} differs from ids shape {shape}")
        if ta is None:
            if self.dev.in_step:
                raise ValueError("[LlamaModel] targets given as a device tensor cannot be counted inside a step; "
                                 "pass a numpy array")
            ta = np.asarray(tt.numpy())
        self._check_ids(ta, "targets", True)
        n_valid = int((ta != IGNORE_INDEX).sum())
        return tt, n_valid

    def _run(self, fn):
        if self.dev.in_step:
            return fn()
        with self.dev.step():
            return fn()

    def _mean_loss(self, rows_loss, n_valid):
        """(1,) f32 = sum(rows_loss) / n_valid, as one gemm with a ones row."""
        N = rows_loss.shape[0]
        out = self.dev.zeros((1, 1), "f32")
        if n_valid > 0:
            ones = self.dev.tensor(np.ones((1, N), np.float32), "f32")
            ops.gemm(ones, rows_loss.reshape(N, 1), out, alpha=1.0 / n_valid)
        return out.reshape(1)

    def forward_backward(self, ids, targets, loss_scale=1.0, segments=None, positions=None):
        """Forward and backward of the mean cross entropy; LoRA gradients accumulate into
        lora_params.grads, multiplied by `loss_scale` (dynamic loss scaling of f16 training).
        Returns a (1,) f32 device tensor holding the unscaled loss (read it after the step,
        e.g. with read_loss()). Packed rows pass segments and positions (B, T) (krnl.data.pack):
        attention stays within a segment and rotary positions are per token."""
        ids_t, shape, ia = self._ids(ids, "ids")
        self._check_ids(ia, "ids", False)
        tt, n_valid = self._targets(targets, shape)
        self._setup(shape, segments, positions)
        self._call_seed += 1

        def body():
            d, dt, c = self.dev, self.dtype, self.config
            B, T = self._BT
            N, C, V = B * T, c.hidden_size, c.vocab_size
            x, xn, rstd, saved = self._trunk_forward(ids_t, keep=True)
            rows_loss = d.empty((N,), "f32")
            dxn = d.empty((N, C), dt)
            scale = float(loss_scale) / max(n_valid, 1)
            for r0 in range(0, N, self.ce_chunk):
                r1 = min(N, r0 + self.ce_chunk)
                logits = d.empty((r1 - r0, V), dt)
                ops.gemm(xn[r0:r1], self.head, logits, trans_b=True)          # logits = xn W^T
                ops.cross_entropy(logits, tt[r0:r1], rows_loss[r0:r1], logits, IGNORE_INDEX, scale)
                ops.gemm(logits, self.head, dxn[r0:r1])                       # dxn = dlogits W
            dx = d.empty((N, C), dt)
            ops.rmsnorm_backward(dxn, x, self.norm_w, rstd, dx)
            for i in reversed(range(c.num_hidden_layers)):
                xin, cache = saved[i]
                if cache is None:                                             # checkpointed: recompute
                    _, cache = self._layer_forward(i, xin)
                dx = self._layer_backward(i, xin, cache, dx)
                saved[i] = None
            self.d_embed_out = dx
            self._loss = self._mean_loss(rows_loss, n_valid)
            return self._loss

        return self._run(body)

    def read_loss(self):
        """The loss of the last forward_backward, as a float (after its step is committed)."""
        if self._loss is None:
            raise ValueError("[LlamaModel] no forward_backward has run yet")
        return float(self._loss.numpy()[0])

    def _forward_logits_rows(self, ids_t, fn):
        d, dt, c = self.dev, self.dtype, self.config
        B, T = self._BT
        N, V = B * T, c.vocab_size
        _, xn, _, _ = self._trunk_forward(ids_t, keep=False)
        for r0 in range(0, N, self.ce_chunk):
            r1 = min(N, r0 + self.ce_chunk)
            logits = d.empty((r1 - r0, V), dt)
            ops.gemm(xn[r0:r1], self.head, logits, trans_b=True)
            fn(r0, r1, logits)

    def loss(self, ids, targets, segments=None, positions=None):
        """Forward only (eval, no dropout): the mean cross entropy as a float."""
        ids_t, shape, ia = self._ids(ids, "ids")
        self._check_ids(ia, "ids", False)
        tt, n_valid = self._targets(targets, shape)
        self._setup(shape, segments, positions)
        with self._eval_mode():
            N = shape[0] * shape[1]
            rows_loss = self.dev.empty((N,), "f32")

            def body():
                self._forward_logits_rows(
                    ids_t, lambda r0, r1, lg: ops.cross_entropy(lg, tt[r0:r1], rows_loss[r0:r1], None, IGNORE_INDEX))
                return self._mean_loss(rows_loss, n_valid)

            out = self._run(body)
        if self.dev.in_step:
            return out
        return float(out.numpy()[0])

    def generate(self, prompt, max_new_tokens=32, temperature=0.0, top_p=1.0, seed=0, eos_id=None):
        """Samples up to max_new_tokens after `prompt` (a list of ids) with a KV cache: the prompt
        runs once through every layer, then each new token only attends to the cached keys and
        values. temperature 0 is greedy; otherwise softmax(logits / temperature) restricted to the
        smallest set of tokens whose probability reaches top_p. Returns the new ids."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("[generate] the prompt is empty")
        self._check_ids(np.asarray(prompt), "prompt", False)
        if not (temperature >= 0) or not (0 < top_p <= 1):
            raise ValueError(f"[generate] temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}")
        total = min(len(prompt) + max_new_tokens, self.config.max_position_embeddings)
        if len(prompt) >= total:
            raise ValueError(f"[generate] the prompt fills max_position_embeddings {self.config.max_position_embeddings}")
        d, dt, D, Hk = self.dev, self.dtype, self.D, self.Hk
        # Per layer and KV head: keys and values (total, D), rows filled as positions are decoded.
        kv = [([d.empty((total, D), dt) for _ in range(Hk)], [d.empty((total, D), dt) for _ in range(Hk)])
              for _ in self.layers]
        self._scale = 1.0 / math.sqrt(D)
        rng = np.random.default_rng(seed)
        out, pending, pos = [], prompt, 0
        with self._eval_mode():
            while pos + len(pending) <= total:
                logits = self._decode(pending, pos, kv)
                pos += len(pending)
                nxt = self._sample(logits, temperature, top_p, rng)
                out.append(nxt)
                if nxt == eos_id or len(out) == max_new_tokens or pos >= total:
                    break
                pending = [nxt]
        return out

    @staticmethod
    def _sample(logits, temperature, top_p, rng):
        z = np.asarray(logits, np.float64)
        if temperature == 0:
            return int(np.argmax(z))
        z = (z - z.max()) / temperature
        p = np.exp(z)
        p /= p.sum()
        order = np.argsort(-p)
        keep = order[:int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]
        return int(rng.choice(keep, p=p[keep] / p[keep].sum()))

    def _decode(self, ids, start, kv):
        """Runs tokens `ids` at positions start.. through the model, appending their keys and
        values to the cache kv; returns the logits (V,) of the last one."""
        d, dt, c = self.dev, self.dtype, self.config
        H, Hk, D, g, n, C = self.H, self.Hk, self.D, self.g, len(ids), c.hidden_size
        L_tot = start + n
        with d.step():
            ids_t = d.tensor(np.asarray(ids, np.int32), "i32")
            pos = d.tensor(np.arange(start, start + n, dtype=np.int32), "i32")
            x = d.empty((n, C), dt)
            ops.embedding_forward(ids_t, self.embed, x)
            for i, L in enumerate(self.layers):
                Kc, Vc = kv[i]
                xn, r = d.empty((n, C), dt), d.empty((n,), "f32")
                ops.rmsnorm_forward(x, L["n1"], xn, r, c.rms_norm_eps)
                heads = d.empty((H + 2 * Hk, n, D), dt)
                ops.transpose_heads(self._qkv_forward(L, xn, {}).reshape(n, H + 2 * Hk, D), heads)
                qh, kh, vh = heads[:H], heads[H:H + Hk], heads[H + Hk:]
                ops.rope(qh, pos, self.inv_freq)
                ops.rope(kh, pos, self.inv_freq)
                oh = d.empty((H, n, D), dt)
                for j in range(Hk):
                    ops.cast(kh[j], Kc[j][start:L_tot])                  # append to the cache
                    ops.cast(vh[j], Vc[j][start:L_tot])
                    # The g query heads of KV head j are contiguous: one (g*n, D) operand.
                    S = d.empty((g, n, L_tot), dt)
                    ops.gemm(qh[j * g:(j + 1) * g].reshape(g * n, D), Kc[j][:L_tot], S.reshape(g * n, L_tot),
                             trans_b=True)
                    ops.softmax_causal_forward(S, S, self._scale)         # query i sits at start + i
                    ops.gemm(S.reshape(g * n, L_tot), Vc[j][:L_tot], oh[j * g:(j + 1) * g].reshape(g * n, D))
                att = d.empty((n, H * D), dt)
                ops.transpose_heads(oh, att.reshape(n, H, D))
                h = d.empty((n, C), dt)
                L["o_proj"].forward(att, h)
                ops.add(h, x, h)
                x = self._mlp_forward(L, h, {})
            last, xn, r = x[n - 1:n], d.empty((1, C), dt), d.empty((1,), "f32")
            ops.rmsnorm_forward(last, self.norm_w, xn, r, c.rms_norm_eps)
            logits = d.empty((1, c.vocab_size), "f32" if dt == "f32" else dt)
            ops.gemm(xn, self.head, logits, trans_b=True)
        return np.asarray(logits.numpy()[0], np.float32)

    @contextlib.contextmanager
    def _eval_mode(self):
        """Context in which LoRA dropout is off (eval, generation)."""
        saved = [(L[m], L[m].p) for L in self.layers for m in ALL_MODULES]
        for lin, _ in saved:
            lin.p = 0.0
        try:
            yield
        finally:
            for lin, p in saved:
                lin.p = p

    def logits(self, ids, segments=None, positions=None):
        """(B, T, V) float32 numpy logits (forward only, no dropout)."""
        ids_t, shape, ia = self._ids(ids, "ids")
        self._check_ids(ia, "ids", False)
        self._setup(shape, segments, positions)
        N, V = shape[0] * shape[1], self.config.vocab_size
        out = self.dev.empty((N, V), self.dtype)
        with self._eval_mode():
            self._run(lambda: self._forward_logits_rows(ids_t, lambda r0, r1, lg: ops.cast(lg, out[r0:r1])))
        return np.asarray(out.numpy(), np.float32).reshape(shape[0], shape[1], V)

    def zero_grads(self):
        self.lora_params.zero_grads()

    def lora_state(self):
        """{PEFT key: float32 array} of the LoRA masters."""
        return self.lora_params.state()

    def lora_grads(self):
        """{PEFT key: float32 array copy} of the accumulated LoRA gradients (after the step)."""
        return {k: np.array(v.numpy(), np.float32, copy=True) for k, v in self._lora_grads().items()}
