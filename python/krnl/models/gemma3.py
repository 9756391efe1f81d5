"""Gemma 3's text configuration (model_type "gemma3_text"), read into the Gemma 2 fields config.py
keeps, and the multimodal checkpoints' names of their text tower (below): no device code.
Gemma 3 is Gemma 2's layer with q/k RMSNorm per head ((1 + w) as every Gemma norm), no
soft-capping by default, and rotary frequencies per layer type: sliding layers rotate with
`rope_local_base_freq` unscaled, full-attention layers with `rope_theta` and `rope_scaling`.
transformers 5 writes both as `rope_parameters` = {"sliding_attention": {...}, "full_attention":
{...}}; older configs give the flat keys and `sliding_window_pattern` (every N-th layer full) in
place of `layer_types`."""

import numpy as np

LAYER_TYPES = ("sliding_attention", "full_attention")
# Gemma3TextConfig's defaults, which the multimodal checkpoints' text_config leaves out (it
# lists little more than the sizes that differ); krnl's own defaults differ for some of these.
DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096}


def normalize(d, where):
    """A copy of config dict d with flat `rope_theta`, `rope_scaling` (full-attention layers),
    `rope_local_base_freq` (sliding layers) and `layer_types`, as gemma_fields and ModelConfig read
    them, and transformers' defaults where d leaves a key out."""
    d = {**DEFAULTS, **d}
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


def gemma_fields(d, get, where):
    """Gemma 2's keys (ModelConfig.gemma): {"attn_scale": query_pre_attn_scalar ** -0.5,
    "attn_softcap" and "final_softcap" (0: none), and for gemma3_text "local_theta": the sliding
    layers' rotary base, unscaled}; `get` is ModelConfig's reader of d's keys."""
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{where}: unsupported hidden_activation {act!r}; supported: gelu_pytorch_tanh")
    g = {"attn_scale": float(get("query_pre_attn_scalar", float, default=256.0)) ** -0.5,
         "attn_softcap": get("attn_logit_softcapping", float, default=0.0, required=False) or 0.0,
         "final_softcap": get("final_logit_softcapping", float, default=0.0, required=False) or 0.0}
    if d.get("model_type") == "gemma3_text":
        g["local_theta"] = get("rope_local_base_freq", float)
    return g


def local_inv_freq(theta, head_dim):
    """The sliding layers' rotary inverse frequencies (D/2,) f32: base theta, no scaling."""
    inv = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float64) / head_dim))
    return inv.astype(np.float32)


# The multimodal checkpoints (model_type "gemma3", Gemma3ForConditionalGeneration): krnl trains the
# text tower. Its config sits under `text_config`; its weights under `language_model.model.*`
# (what transformers writes, also in version 5) or `model.language_model.*` (transformers 5's
# module names), the rest (vision tower, projector) are carried through untouched. krnl names the
# tower's weights as Gemma3ForCausalLM does and translates at the files.
TOWER_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
# PEFT's keys on Gemma3ForConditionalGeneration in transformers 5 (and older transformers')
PEFT_TOWER = "base_model.model.model.language_model.layers."
PEFT_TOWER_OLD = "base_model.model.language_model.model.layers."
PEFT_TEXT = "base_model.model.model.layers."
# PEFT would also adapt the vision tower's q/k/v_proj: the adapter config excludes it.
EXCLUDE = r".*(vision_tower|multi_modal_projector).*"


def text_config(d, where):
    """The text tower's config dict of a multimodal gemma3 config, read as gemma3_text."""
    tc = d.get("text_config")
    if not isinstance(tc, dict):
        raise ValueError(f"{where}: a gemma3 config needs a 'text_config' object")
    tie = d.get("tie_word_embeddings", tc.get("tie_word_embeddings", True))
    return {**tc, "model_type": "gemma3_text", "tie_word_embeddings": tie}


def text_tower(tensors):
    """({Gemma3ForCausalLM name: tensor} of the text tower, {that name: stored name}, {stored name:
    tensor} of everything else) from a multimodal checkpoint's tensors."""
    text, names, rest = {}, {}, {}
    for k, t in tensors.items():
        new = next((to + k[len(p):] for p, to in TOWER_PREFIXES if k.startswith(p)), None)
        if new is None:
            rest[k] = t
        else:
            text[new], names[new] = t, k
    return text, names, rest


def peft_keys_in(raw):
    """A multimodal adapter's PEFT keys renamed to the text model's (lora_key's)."""
    out = {}
    for k, v in raw.items():
        for p in (PEFT_TOWER, PEFT_TOWER_OLD):
            if k.startswith(p):
                k = PEFT_TEXT + k[len(p):]
        out[k] = v
    return out


def peft_keys_out(tensors):
    """lora_key names renamed to PEFT's on Gemma3ForConditionalGeneration (transformers 5)."""
    return {(PEFT_TOWER + k[len(PEFT_TEXT):] if k.startswith(PEFT_TEXT) else k): v for k, v in tensors.items()}
