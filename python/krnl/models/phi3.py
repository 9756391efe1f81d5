"""Phi-3 / Phi-3.5 (model_type "phi3") specifics, used by config, lora and the model stack
(docs/architecture.md, 'Models, adapters and data'):

- Fused projections: checkpoints store self_attn.qkv_proj (H D + 2 Hk D, C), rows q | k | v, and
  mlp.gate_up_proj (2F, C), rows gate | up. The model splits their rows at load (krnl's layer
  fuses q/k/v into one buffer again) and PEFT's LoRA targets are the fused names: one A (r, C)
  and one B (out, r) per fused module, which krnl runs as LoRA on the members sharing A and
  taking row blocks of B.
- LongRoPE rotary scaling ("longrope", "su" in older configs): per-frequency short and long
  factors, the long set when a call's largest position + 1 exceeds
  original_max_position_embeddings (as transformers chooses), and cos/sin scaled by an attention
  factor, which the attention scale carries squared (q.k is the only use of rotated q and k).

No device code; imports nothing of krnl."""

import math

import numpy as np

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # PEFT's LoRA targets, layer order
MEMBER_OF = {m: f for f, ms in FUSED.items() for m in ms}


def lora_targets(names):
    """The fused LoRA targets of `names` (fused names, or every member of a fused module:
    q_proj, k_proj and v_proj make qkv_proj); part of a fused module is a ValueError."""
    names = tuple(names)
    bad = [m for m in names if m not in MODULES and m not in MEMBER_OF]
    if bad:
        raise ValueError(f"[LoraConfig] unknown target module(s) {bad} for phi3; valid names: {', '.join(MODULES)} "
                         f"(or all of q_proj, k_proj, v_proj / gate_proj, up_proj)")
    for f, members in FUSED.items():
        given = [m for m in members if m in names]
        if given and len(given) < len(members):
            raise ValueError(f"[LoraConfig] phi3 fuses {', '.join(members)} into {f}: LoRA adapts all of {f} "
                             f"or none of it, got only {', '.join(given)}")
    want = {MEMBER_OF.get(m, m) for m in names}
    return tuple(m for m in MODULES if m in want)


def split_fused(weights, config):
    """{name: weight} with each fused projection replaced by its members' row slices (lazy:
    nothing is read until the layer uploads it; a QuantizedArray slices its codes, scales and
    biases by rows, a row's groups never span rows)."""
    from_q = {"q_proj": config.module_shape("q_proj")[0], "k_proj": config.module_shape("k_proj")[0],
              "v_proj": config.module_shape("v_proj")[0]}
    F = config.intermediate_size
    out = dict(weights)
    for i in range(config.num_hidden_layers):
        for part, fused, sizes in (("self_attn", "qkv_proj", from_q), ("mlp", "gate_up_proj",
                                                                        {"gate_proj": F, "up_proj": F})):
            name = f"model.layers.{i}.{part}.{fused}.weight"
            if name not in out:
                continue
            src, r0 = out.pop(name), 0
            for m, n in sizes.items():
                out[f"model.layers.{i}.{part}.{m}.weight"] = row_slice(src, r0, r0 + n)
                r0 += n
    return out


def row_slice(a, r0, r1):
    """Rows r0:r1 of a weight (array-like or QuantizedArray), read when used."""
    if hasattr(a, "bits") and hasattr(a, "scales"):  # a QuantizedArray (by duck type: qweight loads _core)
        return type(a)(Rows(a.w, r0, r1), Rows(a.scales, r0, r1), Rows(a.biases, r0, r1), a.bits, a.group_size,
                       a.scale_dtype)
    return Rows(a, r0, r1)


class Rows:
    """Rows r0:r1 of anything np.asarray reads; its shape is known without reading it."""

    def __init__(self, a, r0, r1):
        self.a, self.r0, self.r1 = a, r0, r1
        self.shape = (r1 - r0,) + tuple(np.shape(a) if not hasattr(a, "shape") else a.shape)[1:]
        self.ndim = len(self.shape)

    def __array__(self, dtype=None, copy=None):
        a = np.asarray(self.a)[self.r0:self.r1]
        return a if dtype is None else a.astype(dtype, copy=False)


def check_config(d, where):
    """Refuses what krnl's Phi-3 does not run: rotary on part of each head (Phi-4-mini's
    partial_rotary_factor, at the top or in rope_parameters)."""
    rp, rs = (d.get(k) if isinstance(d.get(k), dict) else {} for k in ("rope_parameters", "rope_scaling"))
    for prf in (d.get("partial_rotary_factor"), rp.get("partial_rotary_factor"), rs.get("partial_rotary_factor")):
        if prf not in (None, 1, 1.0):
            raise ValueError(f"{where}: partial_rotary_factor {prf!r} is not supported (rotary on whole heads only)")


def check_longrope(rs, d, head_dim, where):
    """The normalised longrope rope_scaling of config dict d: short_factor and long_factor (D/2
    numbers each), original_max_position_embeddings (in rope_scaling or the config, as Phi-3
    stores it), factor (max_position_embeddings / original unless given) and attention_factor
    (sqrt(1 + ln factor / ln original) for factor > 1 unless given, as transformers computes it)."""
    out = {"rope_type": "longrope"}
    for k in ("short_factor", "long_factor"):
        v = rs.get(k)
        if (not isinstance(v, list) or len(v) != head_dim // 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in v)):
            raise ValueError(f"{where}: key 'rope_scaling.{k}' must be a list of {head_dim // 2} numbers > 0")
        out[k] = [float(x) for x in v]
    orig = rs.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    if isinstance(orig, bool) or not isinstance(orig, (int, float)) or not orig > 1:
        raise ValueError(f"{where}: longrope needs original_max_position_embeddings > 1, got {orig!r}")
    out["original_max_position_embeddings"] = int(orig)
    factor = rs.get("factor")
    if factor is None:
        factor = d.get("max_position_embeddings", 2048) / orig
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"{where}: key 'rope_scaling.factor' must be a number > 0, got {factor!r}")
    out["factor"] = float(factor)
    af = rs.get("attention_factor")
    if af is None:
        af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    if isinstance(af, bool) or not isinstance(af, (int, float)) or not af > 0:
        raise ValueError(f"{where}: key 'rope_scaling.attention_factor' must be a number > 0, got {af!r}")
    out["attention_factor"] = float(af)
    return out


def longrope_inv_freq(rs, theta, head_dim, long):
    """(D/2,) f32 inverse frequencies 1 / (factor_i theta^(2i/D)) of the short or long set."""
    f = np.asarray(rs["long_factor" if long else "short_factor"], np.float64)
    return (1.0 / (f * theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float64) / head_dim))
            ).astype(np.float32)
