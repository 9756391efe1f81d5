"""A ModelConfig as the `{arch}.*` metadata llama.cpp's converter writes (convert_hf_to_gguf.py and
its conversion/ classes) and file.py reads back, plus the rotary tables some families store as
tensors (llama3's rope_freqs, Phi-3's LongRoPE factors). Configurations llama.cpp would run
differently from krnl are refused here, naming the setting (check_supported)."""

import math

import numpy as np

from ...models.rope_scaling import scaled_inv_freq

GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales these sizes' queries by 1/sqrt(C/H)


def check_supported(config, arch, source):
    """ValueError for a configuration that llama.cpp's graph for `arch` does not compute as krnl does."""
    where = f"[gguf] {source} ({config.model_type})"
    moe = config.moe or {}
    g = config.gemma or {}
    if arch in GEMMA_27B_LAYERS:
        big = config.num_hidden_layers == GEMMA_27B_LAYERS[arch]
        want = (config.hidden_size // config.num_attention_heads if big else config.head_dim) ** -0.5
        if not math.isclose(g["attn_scale"], want, rel_tol=1e-6):
            raise ValueError(f"{where}: query_pre_attn_scalar {g['attn_scale'] ** -2:g}: llama.cpp scales this "
                             f"model's queries by 1/sqrt({want ** -2:g})")
        if arch == "gemma3" and g.get("attn_softcap"):
            raise ValueError(f"{where}: attn_logit_softcapping {g['attn_softcap']}: llama.cpp's gemma3 has none")
    if config.model_type in ("qwen3_moe", "mixtral") and not moe["norm_topk"]:
        raise ValueError(f"{where}: norm_topk_prob false: llama.cpp always renormalises this family's top-k weights")
    if config.model_type == "olmoe" and moe["norm_topk"]:
        raise ValueError(f"{where}: norm_topk_prob true: llama.cpp never renormalises OLMoE's top-k weights")
    if config.model_type == "olmoe" and (config.num_attention_heads * config.head_dim != config.hidden_size
                                         or config.num_key_value_heads != config.num_attention_heads):
        raise ValueError(f"{where}: llama.cpp's olmoe takes heads x head_dim == hidden_size and as many key/value "
                         f"heads as query heads, not {config.num_attention_heads} x {config.head_dim} and "
                         f"{config.num_key_value_heads}")
    if config.model_type == "gpt_oss" and tuple(moe["swiglu"]) != (1.702, 7.0):
        raise ValueError(f"{where}: swiglu_alpha / swiglu_limit {moe['swiglu']}: llama.cpp's are (1.702, 7.0)")


def notes(config, arch):
    """What llama.cpp computes differently in ways krnl lets pass (printed by the exporter)."""
    if arch in ("llama", "qwen2", "qwen3", "qwen3moe") and config.sliding_window:
        return [f"llama.cpp's {arch} has no sliding window: the file attends over the whole context where "
                f"{config.model_type} attends over {config.sliding_window} tokens"]
    if arch == "phi3" and config.sliding_window:
        return ["llama.cpp runs Phi-3 without its sliding window (phi3.cpp): results differ past "
                f"{config.sliding_window} tokens"]
    return []


def arch_metadata(config, arch):
    """{GGUF key: value} of the model's configuration (ints as uint32, floats as float32)."""
    a = arch
    C, H, D, L = config.hidden_size, config.num_attention_heads, config.head_dim, config.num_hidden_layers
    moe = config.moe or {}
    md = {f"{a}.context_length": config.max_position_embeddings, f"{a}.embedding_length": C,
          f"{a}.block_count": L, f"{a}.feed_forward_length": moe.get("expert_size", config.intermediate_size),
          f"{a}.attention.head_count": H, f"{a}.attention.head_count_kv": config.num_key_value_heads,
          f"{a}.attention.key_length": D, f"{a}.attention.value_length": D,
          f"{a}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
          f"{a}.rope.freq_base": float(config.rope_theta), f"{a}.rope.dimension_count": D,
          f"{a}.vocab_size": config.vocab_size}
    if config.model_type == "qwen3_moe":
        md[f"{a}.feed_forward_length"] = config.intermediate_size
    if moe:
        md.update({f"{a}.expert_count": moe["experts"], f"{a}.expert_used_count": moe["top_k"]})
        if arch in ("qwen3moe", "gpt-oss"):
            md[f"{a}.expert_feed_forward_length"] = moe["expert_size"]
    rs = config.rope_scaling or {}
    kind = rs.get("rope_type")
    if kind == "linear":
        md.update({f"{a}.rope.scaling.type": "linear", f"{a}.rope.scaling.factor": float(rs["factor"])})
    elif kind == "yarn":
        md.update({f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": float(rs["factor"]),
                   f"{a}.rope.scaling.original_context_length": int(rs["original_max_position_embeddings"]),
                   f"{a}.rope.scaling.yarn_beta_fast": float(rs["beta_fast"]),
                   f"{a}.rope.scaling.yarn_beta_slow": float(rs["beta_slow"])})
    elif kind == "llama3":  # the factors go as rope_freqs; the original context lets file.py name them again
        md[f"{a}.rope.scaling.original_context_length"] = int(rs["original_max_position_embeddings"])
    if arch == "phi3":
        md[f"{a}.rope.scaling.original_context_length"] = int(rs.get("original_max_position_embeddings",
                                                                     config.max_position_embeddings))
        md[f"{a}.attention.sliding_window"] = int(config.sliding_window or 0)
        if kind == "longrope":
            md[f"{a}.rope.scaling.attn_factor"] = float(rs["attention_factor"])
    g = config.gemma or {}
    if arch == "gemma2":
        md.update({f"{a}.attn_logit_softcapping": float(g["attn_softcap"]),
                   f"{a}.final_logit_softcapping": float(g["final_softcap"])})
    if arch == "gemma3" and g.get("final_softcap"):
        md[f"{a}.final_logit_softcapping"] = float(g["final_softcap"])
    if arch == "gemma3":
        md[f"{a}.rope.freq_base_swa"] = float(g["local_theta"])
    if config.layer_windows and any(config.layer_windows):  # per layer: sliding (True) or full
        md[f"{a}.attention.sliding_window"] = max(config.layer_windows)
        md[f"{a}.attention.sliding_window_pattern"] = [bool(w) for w in config.layer_windows]
    return md


def rope_tensors(config, arch):
    """{GGUF name: float32 array} of the rotary tables llama.cpp reads as tensors."""
    rs = config.rope_scaling or {}
    if rs.get("rope_type") == "llama3":  # per-frequency divisors, as convert_hf_to_gguf computes them
        base = scaled_inv_freq(None, config.rope_theta, config.head_dim).astype(np.float64)
        return {"rope_freqs.weight": (base / config.inv_freq().astype(np.float64)).astype(np.float32)}
    if rs.get("rope_type") == "longrope" and arch == "phi3":
        return {"rope_factors_long.weight": np.asarray(rs["long_factor"], np.float32),
                "rope_factors_short.weight": np.asarray(rs["short_factor"], np.float32)}
    return {}
