"""Rotary scaling (config.json's rope_scaling), checked and turned into inverse frequencies as
transformers computes them: linear, llama3, Phi-3's longrope (phi3.py) and YaRN (gpt-oss; Qwen or
DeepSeek configs that ask for it). YaRN, as _compute_yarn_parameters defines it: each frequency
blends its interpolated (divided by factor) and extrapolated (unchanged) value along a linear ramp
between the dimensions that turn beta_fast and beta_slow times over the original context, and cos
and sin scale by attention_factor. No device code."""

import math

import numpy as np

from . import phi3


def check_rope_scaling(rs, d, D, model_type, where):
    """The rope_scaling of config dict d, checked (None: no scaling); yarn's with every key filled in."""
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ValueError(f"{where}: key 'rope_scaling' must be an object or null, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        if not isinstance(rs.get("factor"), (int, float)) or not rs["factor"] > 0:
            raise ValueError(f"{where}: key 'rope_scaling.factor' must be a number > 0, got {rs.get('factor')!r}")
    elif kind == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if not isinstance(rs.get(k), (int, float)) or not rs[k] > 0:
                raise ValueError(f"{where}: key 'rope_scaling.{k}' must be a number > 0, got {rs.get(k)!r}")
        if rs["high_freq_factor"] <= rs["low_freq_factor"]:
            raise ValueError(f"{where}: rope_scaling.high_freq_factor must exceed low_freq_factor")
    elif kind in ("longrope", "su") and model_type == "phi3":
        return phi3.check_longrope(rs, d, D, where)
    elif kind == "yarn":
        return yarn_scaling(rs, d, where)
    else:
        raise ValueError(f"{where}: unsupported key 'rope_scaling' type {kind!r}; supported: linear, llama3, yarn"
                         + (", longrope" if model_type == "phi3" else ""))
    return dict(rs)


def scaled_inv_freq(rs, theta, D):
    """The rotary inverse frequencies (D/2,) f32 of base theta under rope_scaling rs (None: none)."""
    inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.int64).astype(np.float64) / D))
    kind = rs and rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "longrope":
        return phi3.longrope_inv_freq(rs, theta, D, False)
    elif kind == "yarn":
        inv = yarn_inv_freq(rs, inv, theta, D)
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


def yarn_scaling(rs, d, where):
    """The checked rope_scaling dict of config dict d with every key filled in: factor (max_position_embeddings
    / original_max_position_embeddings when absent), beta_fast 32, beta_slow 1, truncate True and
    attention_factor (0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio) where absent."""
    out = {"rope_type": "yarn"}
    orig = rs.get("original_max_position_embeddings")
    if isinstance(orig, bool) or not isinstance(orig, (int, float)) or not orig > 0:
        raise ValueError(f"{where}: key 'rope_scaling.original_max_position_embeddings' must be a number > 0, "
                         f"got {orig!r}")
    factor = rs.get("factor")
    if factor is None:
        factor = d.get("max_position_embeddings", 0) / orig
    for k, v in (("factor", factor), ("beta_fast", rs.get("beta_fast") or 32.0), ("beta_slow", rs.get("beta_slow") or 1.0)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{where}: key 'rope_scaling.{k}' must be a number > 0, got {v!r}")
        out[k] = float(v)
    if rs.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: rope_scaling.partial_rotary_factor {rs['partial_rotary_factor']} is not supported")
    af, ms, msa = rs.get("attention_factor"), rs.get("mscale"), rs.get("mscale_all_dim")
    if af is None:
        mscale = lambda m=1.0: 1.0 if out["factor"] <= 1 else 0.1 * m * math.log(out["factor"]) + 1.0
        af = mscale(ms) / mscale(msa) if ms and msa else mscale()
    if isinstance(af, bool) or not isinstance(af, (int, float)) or not af > 0:
        raise ValueError(f"{where}: key 'rope_scaling.attention_factor' must be a number > 0, got {af!r}")
    out.update(original_max_position_embeddings=float(orig), truncate=bool(rs.get("truncate", True)),
               attention_factor=float(af))
    return out


def yarn_inv_freq(rs, inv, theta, D):
    """YaRN's inverse frequencies (D/2,) float64 from the unscaled ones `inv` of base theta."""
    orig = rs["original_max_position_embeddings"]
    dim_of = lambda turns: D * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))
    lo, hi = dim_of(rs["beta_fast"]), dim_of(rs["beta_slow"])
    if rs["truncate"]:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, D - 1)
    if lo == hi:
        hi += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(D // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
    keep = 1.0 - ramp                                                     # the extrapolated share
    return inv / rs["factor"] * (1.0 - keep) + inv * keep
