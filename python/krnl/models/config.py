"""What a model is: the Llama-family configuration (HF config.json; qwen3 adds per-head q/k norms,
gemma2 the four norms per layer, soft-capping and alternating sliding windows),
the LoRA configuration, PEFT's key names of LoRA factors, and random weights for tiny test
models. No device code."""

import json
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from . import gemma3, phi3
from .rope_scaling import check_rope_scaling, scaled_inv_freq
from .moe_config import EXPERT_MODULES, MOE_MODEL_TYPES, expert_shapes, expert_targets, moe_fields

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gemma3",
                         *MOE_MODEL_TYPES)

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ALL_MODULES = ATTN_MODULES + MLP_MODULES
QKV_MODULES = ("q_proj", "k_proj", "v_proj")
IGNORE_INDEX = -100


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
    sliding_window: Optional[int] = None  # attention window (mistral; qwen2/qwen3 with use_sliding_window)
    gemma: Optional[dict] = None  # gemma2/gemma3_text: gemma3.gemma_fields' dict (None for the other families)
    moe: Optional[dict] = None  # qwen3_moe/mixtral/olmoe/gpt_oss: moe_fields' dict (None for dense families)
    layer_windows: Optional[list] = None  # gemma2/gemma3_text/gpt_oss: per layer, the sliding window (0: full)
    multimodal: bool = False  # gemma3: the text tower of Gemma3ForConditionalGeneration (gemma3.py)
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
        multimodal = mt == "gemma3"  # Gemma3ForConditionalGeneration: its text tower
        if multimodal:
            d, mt = gemma3.text_config(d, where), "gemma3_text"
        if mt == "gemma3_text":
            d = gemma3.normalize(d, where)

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
        if mt == "phi3":
            phi3.check_config(d, where)
        rs = check_rope_scaling(d.get("rope_scaling"), d, D, mt, where)
        if mt == "qwen2":
            bias = True  # Qwen2 always has q/k/v biases (HF hard-codes them)
            if "attention_bias" in d and d["attention_bias"] is not None:
                bias = get("attention_bias", bool)
        else:
            bias = get("attention_bias", bool, default=mt == "gpt_oss", required=False)
        sw = None
        if mt in ("mistral", "phi3", "mixtral") or (mt in ("qwen2", "qwen3", "qwen3_moe") and d.get("use_sliding_window")):
            sw = get("sliding_window", int, default=None, required=False)
        return cls(
            model_type=mt,
            vocab_size=get("vocab_size", int),
            hidden_size=C,
            intermediate_size=get("intermediate_size", int, default=0 if mt == "qwen3_moe" else None),
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
            gemma=gemma3.gemma_fields(d, get, where) if mt == "gemma2" or mt == "gemma3_text" else None,
            moe=moe_fields(d, get, where) if mt in MOE_MODEL_TYPES else None,
            layer_windows=layer_windows(d, get, where) if mt in ("gemma2", "gemma3_text", "gpt_oss") else None,
            multimodal=multimodal,
            source=source,
        )

    @property
    def qk_norm(self):
        """Qwen3 and Gemma 3 normalise each head of q and k (RMSNorm over D, weights (D,)) before rotary."""
        return self.model_type in ("qwen3", "gemma3_text", "qwen3_moe")

    @property
    def qk_full_norm(self):
        """OLMoE normalises the whole q (H D) and k (Hk D) of a token (olmoe.py)."""
        return self.model_type == "olmoe"

    @property
    def o_proj_bias(self):
        """attention_bias puts a bias on o_proj too, in every family but Qwen2 (q/k/v only)."""
        return self.attention_bias and self.model_type != "qwen2"

    @property
    def attention_sinks(self):
        """gpt-oss: one learned logit per query head joins each softmax (self_attn.sinks (H,))."""
        return self.model_type == "gpt_oss"

    @property
    def fused_projections(self):
        """Phi-3 stores q|k|v as qkv_proj and gate|up as gate_up_proj (phi3.py)."""
        return self.model_type == "phi3"

    def lora_modules(self):
        """The module names LoRA targets take in this family (PEFT's), in layer order."""
        if self.moe:
            return ATTN_MODULES + EXPERT_MODULES + ("router",)
        return phi3.MODULES if self.fused_projections else ALL_MODULES

    def module_shape(self, name):
        """(out, in) of a projection (or of a fused one: qkv_proj, gate_up_proj; of one expert's in a
        mixture of experts)."""
        C, F, H, Hk, D = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                          self.num_key_value_heads, self.head_dim)
        if self.moe:
            F = self.moe["expert_size"]
            if name == "router":
                return (self.moe["experts"], C)
        return {"q_proj": (H * D, C), "k_proj": (Hk * D, C), "v_proj": (Hk * D, C), "o_proj": (C, H * D),
                "gate_proj": (F, C), "up_proj": (F, C), "down_proj": (C, F), "qkv_proj": ((H + 2 * Hk) * D, C),
                "gate_up_proj": (2 * F, C)}[name]

    @property
    def rope_attention_factor(self):
        """LongRoPE's and YaRN's scaling of cos and sin (1.0 otherwise)."""
        rs = self.rope_scaling
        return rs["attention_factor"] if rs and rs.get("rope_type") in ("longrope", "yarn") else 1.0

    @property
    def rope_switch_position(self):
        """The first position whose call takes LongRoPE's long factors (None without longrope)."""
        rs = self.rope_scaling
        return rs["original_max_position_embeddings"] if rs and rs.get("rope_type") == "longrope" else None

    def rope_inv_freq(self, max_position):
        """inv_freq() for a call whose largest position is max_position: LongRoPE switches to
        its long factors past original_max_position_embeddings, as transformers does."""
        rs = self.rope_scaling
        if rs and rs.get("rope_type") == "longrope":
            long = max_position >= self.rope_switch_position
            return phi3.longrope_inv_freq(rs, self.rope_theta, self.head_dim, long)
        return self.inv_freq()

    def inv_freq(self):
        """The rotary inverse frequencies (D/2,) as HF computes them, rope_scaling included."""
        return scaled_inv_freq(self.rope_scaling, self.rope_theta, self.head_dim)

    def weight_shapes(self):
        """{HF name: shape} of every weight this config needs."""
        C, V = self.hidden_size, self.vocab_size
        s = {"model.embed_tokens.weight": (V, C)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            mods = self.lora_modules()  # phi3: the fused qkv_proj and gate_up_proj
            for m in (m for m in mods if module_part(m) == "self_attn"):
                s[p + f"self_attn.{m}.weight"] = self.module_shape(m)
            if self.attention_bias:
                for m in ("q_proj", "k_proj", "v_proj", "o_proj")[:4 if self.o_proj_bias else 3]:
                    s[p + f"self_attn.{m}.bias"] = (self.module_shape(m)[0],)
            if self.attention_sinks:
                s[p + "self_attn.sinks"] = (self.num_attention_heads,)
            if self.qk_norm or self.qk_full_norm:  # per head (D,), or olmoe's over all heads
                hq, hk = (self.num_attention_heads, self.num_key_value_heads) if self.qk_full_norm else (1, 1)
                s[p + "self_attn.q_norm.weight"] = (hq * self.head_dim,)
                s[p + "self_attn.k_norm.weight"] = (hk * self.head_dim,)
            if self.moe:  # the experts' weights fused, as transformers holds them (formats.experts)
                s.update(expert_shapes(self.moe, p, C))
            for m in (m for m in mods if module_part(m) == "mlp" and not self.moe):
                s[p + f"mlp.{m}.weight"] = self.module_shape(m)
            s[p + "input_layernorm.weight"] = (C,)
            s[p + "post_attention_layernorm.weight"] = (C,)
            if self.gemma:
                s[p + "pre_feedforward_layernorm.weight"] = (C,)
                s[p + "post_feedforward_layernorm.weight"] = (C,)
        s["model.norm.weight"] = (C,)
        if not self.tie_word_embeddings:
            s["lm_head.weight"] = (V, C)
        return s

    def check_weights(self, weights, who="[LlamaModel]"):
        """Raises ValueError naming every missing, unexpected or misshapen weight of {HF name: array}."""
        want = self.weight_shapes()
        have = set(weights)
        missing = sorted(set(want) - have)
        unexpected = sorted(have - set(want))
        if self.tie_word_embeddings and "lm_head.weight" in unexpected:
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
            raise ValueError(f"{who} weights do not match the config ({self.source}): " + "; ".join(msgs))


def layer_windows(d, get, where):
    """Per layer, the sliding window (0: full attention) `layer_types` gives (gemma2, gemma3_text,
    gpt_oss); without it, sliding on even layers (transformers' default for gemma2 and gpt_oss;
    gemma3.normalize fills it for gemma3_text)."""
    n = get("num_hidden_layers", int)
    types = d.get("layer_types")
    if types is None:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in ("sliding_attention", "full_attention")
                                                            for t in types):
        raise ValueError(f"{where}: key 'layer_types' must list {n} of 'sliding_attention' / 'full_attention', "
                         f"got {types!r}")
    sw = get("sliding_window", int, default=0, required=False) or 0
    if sw == 0 and "sliding_attention" in types:
        raise ValueError(f"{where}: layer_types has sliding_attention layers but no sliding_window")
    return [sw if t == "sliding_attention" else 0 for t in types]


@dataclass
class LoraConfig:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple = ALL_MODULES
    use_rslora: bool = False
    layers: Optional[list] = None  # layer indices (None: all); ("last", N) until validate (--num-layers)
    use_dora: bool = False  # DoRA: a trainable magnitude per output (models/dora.py)
    full: bool = False  # full fine-tuning: the layers' weights themselves trained, no factors (models/full.py)
    train_embeddings: bool = False  # full: the embeddings, head and final norm train too

    @property
    def scale(self):
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r

    def validate(self, config):
        if isinstance(self.target_modules, str):
            self.target_modules = (self.target_modules,)
        self.target_modules = tuple(self.target_modules)
        if config.fused_projections:
            self.target_modules = phi3.lora_targets(self.target_modules)
        if config.moe:
            self.target_modules = expert_targets(self.target_modules)
        bad = [m for m in self.target_modules if m not in config.lora_modules()]
        if self.train_embeddings and not self.full:
            raise ValueError("[LoraConfig] train_embeddings goes with full fine-tuning (LoRA adapts no embeddings)")
        if self.full and not bad:
            self.target_modules = self._full_targets(config)
        elif bad:
            raise ValueError(f"[LoraConfig] unknown target module(s) {bad}; valid names: "
                             f"{', '.join(config.lora_modules())}")
        if isinstance(self.r, bool) or not isinstance(self.r, (int, np.integer)):
            raise ValueError(f"[LoraConfig] r must be an integer, got {self.r!r}")
        for m in () if self.full else self.target_modules:  # full fine-tuning has no rank
            out, inp = config.module_shape(m)
            if self.r < 1 or self.r > min(out, inp):
                raise ValueError(f"[LoraConfig] r={self.r} is invalid for {m} (in={inp}, out={out}): "
                                 f"it must be between 1 and min(in, out) = {min(out, inp)}")
        if not (0.0 <= float(self.dropout) < 1.0):
            raise ValueError(f"[LoraConfig] dropout must be in [0, 1), got {self.dropout!r}")
        if config.moe and self.dropout and set(self.target_modules) & {*EXPERT_MODULES, "router"}:
            raise ValueError(f"[LoraConfig] dropout {self.dropout} on the experts' or router's LoRA: PEFT has none "
                             "there either (target_parameters); set dropout 0 or leave them out of the targets")
        if self.use_dora and config.moe and set(self.target_modules) & {*EXPERT_MODULES, "router"}:
            raise ValueError("[LoraConfig] DoRA on the experts' or router's LoRA: PEFT has none there either "
                             "(target_parameters); leave them out of the targets or train LoRA")
        if not float(self.alpha) > 0:
            raise ValueError(f"[LoraConfig] alpha must be > 0, got {self.alpha!r}")
        n = config.num_hidden_layers
        if isinstance(self.layers, tuple) and self.layers[:1] == ("last",):  # mlx-lm's --num-layers N
            self.layers = list(range(max(0, n - int(self.layers[1])), n))
        if self.layers is not None:
            bad = [i for i in self.layers if not isinstance(i, (int, np.integer)) or not 0 <= i < n]
            if bad:
                raise ValueError(f"[LoraConfig] layers {bad} out of range for a model of {n} layers")

    def _full_targets(self, config):
        """Full fine-tuning's trained projections (a fused one's members: phi3), checked: no factors,
        so no dropout or DoRA; a mixture's experts and router stay frozen."""
        if self.use_dora:
            raise ValueError("[LoraConfig] full fine-tuning and DoRA exclude each other: choose one fine-tune type")
        if self.dropout:
            raise ValueError(f"[LoraConfig] dropout {self.dropout} applies to LoRA's input; full fine-tuning has none "
                             "(mlx-lm's neither): set it to 0")
        experts = [m for m in self.target_modules if m in (*EXPERT_MODULES, "router")] if config.moe else []
        if experts:
            raise ValueError(f"[LoraConfig] full fine-tuning of a mixture's {', '.join(experts)} is not supported: "
                             "train its attention (--lora-targets q,k,v,o) or use LoRA on the experts")
        names = {n for m in self.target_modules for n in phi3.FUSED.get(m, (m,))}
        return tuple(m for m in ALL_MODULES if m in names)

    def adapted_layers(self, config):
        n = config.num_hidden_layers
        return list(range(n)) if self.layers is None else sorted(set(int(i) for i in self.layers))


def module_part(module):
    """The block of a projection: self_attn or mlp."""
    return "self_attn" if module in ATTN_MODULES or module == "qkv_proj" else "mlp"


def lora_key(layer, module, factor):
    """PEFT's key of a LoRA factor ('A' or 'B')."""
    return f"base_model.model.model.layers.{layer}.{module_part(module)}.{module}.lora_{factor}.weight"


def magnitude_key(layer, module):
    """PEFT's key of a DoRA magnitude vector (its saved adapters' name, without .weight)."""
    return f"base_model.model.model.layers.{layer}.{module_part(module)}.{module}.lora_magnitude_vector"


def random_weights(config, seed=0, std=0.02):
    """Random HF-named float32 weights for tiny models (norm weights near 1)."""
    rng = np.random.default_rng(seed)
    w = {}
    for k, shape in config.weight_shapes().items():
        if k.endswith("norm.weight"):
            w[k] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif k.endswith((".bias", "_bias", ".sinks")):
            w[k] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w[k] = (std * rng.standard_normal(shape)).astype(np.float32)
    return w

