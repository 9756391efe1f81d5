"""Gemma 3's text configuration (model_type "gemma3_text"), read into the Gemma 2 fields config.py
keeps: no device code. Gemma 3 is Gemma 2's layer with q/k RMSNorm per head ((1 + w) as every
Gemma norm), no soft-capping by default, and rotary frequencies per layer type: sliding layers
rotate with `rope_local_base_freq` unscaled, full-attention layers with `rope_theta` and
`rope_scaling`. transformers 5 writes both as `rope_parameters` = {"sliding_attention": {...},
"full_attention": {...}}; older configs give the flat keys and `sliding_window_pattern` (every
N-th layer full) in place of `layer_types`."""

import numpy as np

LAYER_TYPES = ("sliding_attention", "full_attention")


def normalize(d, where):
    """A copy of config dict d with flat `rope_theta`, `rope_scaling` (full-attention layers),
    `rope_local_base_freq` (sliding layers) and `layer_types`, as gemma2_fields and ModelConfig read them."""
    d = dict(d)
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"{where}: use_bidirectional_attention is not supported (krnl trains causal models)")
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and any(t in rp for t in LAYER_TYPES):
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise ValueError(f"{where}: key 'rope_parameters' must map layer types to objects, got {rp!r}")
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{where}: rope_parameters.sliding_attention must be the default rope, got "
                             f"{local.get('rope_type')!r}")
        d["rope_theta"] = full.get("rope_theta", d.get("rope_theta"))
        d["rope_local_base_freq"] = local.get("rope_theta", d.get("rope_local_base_freq"))
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
        d["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
        d.pop("rope_parameters")
    if d.get("rope_theta") is None:
        d["rope_theta"] = 1_000_000.0  # transformers' defaults
    if d.get("rope_local_base_freq") is None:
        d["rope_local_base_freq"] = 10_000.0
    if d.get("layer_types") is None:
        n, p = d.get("num_hidden_layers"), d.get("sliding_window_pattern", 6)
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"{where}: key 'sliding_window_pattern' must be an integer >= 1, got {p!r}")
        if isinstance(n, int) and not isinstance(n, bool):
            d["layer_types"] = [LAYER_TYPES[(i + 1) % p == 0] for i in range(n)]
    return d


def local_inv_freq(theta, head_dim):
    """The sliding layers' rotary inverse frequencies (D/2,) f32: base theta, no scaling."""
    inv = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float64) / head_dim))
    return inv.astype(np.float32)
