"""GGUF files (llama.cpp, Ollama, LM Studio) as base models: one `.gguf` file turned into what an
HF folder gives krnl (docs/architecture.md, 'GGUF files'): an HF config dict, the weights under
HF names and the tokenizer (tokenizer.py).

- config: from the `{arch}.*` metadata of the llama (also Mistral's and Mixtral's files), qwen2,
  qwen3, qwen3moe, olmoe, gpt-oss, gemma2, gemma3 and phi3 architectures; no `output.weight`
  tensor means tied embeddings. Gemma's query scale is llama.cpp's (1/sqrt(head_dim), or
  1/sqrt(C/H) for the 27B sizes), its sliding layers the file's pattern (names.swa_layers).
- weights: GGUF names to HF names (names.py); shapes come reversed (ne0, the input size, first),
  which the reader's row-major arrays already undo, so a row is an output. llama.cpp's converter
  permutes the rows of q and k of the llama architecture for GGML's interleaved rotary embedding;
  that is undone here. Gemma files hold 1 + w for each norm, read back as w.
- Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K load as QuantizedArrays converted exactly
  (krnl.quant.gguf), MXFP4 as mode-mxfp4 ones (its codes reordered); every other quantized type
  is dequantized by gguf-py and rounded to bf16, with one note per load; F32, F16 and BF16 load
  as they are. A mixture's experts come as 3-D `ffn_*_exps` (gpt-oss: `ffn_gate_up_exps` too) or,
  in Mixtral files older than those, one tensor per expert (`ffn_gate.E`), stacked here.
"""

import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ...quant import gguf as gguf_quants
from ...models.config import ModelConfig
from ..experts import switch_experts
from .names import ARCHITECTURES, NORM_SHIFT, ROPE_TENSORS, gguf_name, hf_name, swa_layers, unpermute
from ...models.moe import ExpertHalves
from ...quant.qweight import QuantizedArray
from ...io.safetensors_io import bf16_to_f32, f32_to_bf16

MAGIC = b"GGUF"


def is_gguf(path):
    """True for a file that starts with GGUF's magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


@dataclass
class GGUFModel:
    path: str
    metadata: dict            # key -> value of every metadata key (the tokenizer's arrays as lists)
    hf_config: dict           # what config.json would say (model_type, sizes, architectures, ...)
    config: ModelConfig
    weights: dict             # HF name -> QuantizedArray or float array
    types: dict = field(default_factory=dict)   # HF name -> ggml type name as stored


def open_reader(path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path), "r")
    except (ValueError, IndexError, KeyError, OSError) as e:
        size = Path(path).stat().st_size if Path(path).exists() else 0
        raise ValueError(f"[gguf] {path}: not a readable GGUF file ({size} bytes; truncated or corrupt: {e})") \
            from None


def read_metadata(reader):
    """{key: value} of the file's metadata (strings, numbers, lists)."""
    out = {}
    for k, f in reader.fields.items():
        if not k.startswith("GGUF."):
            out[k] = f.contents()
    return out


def _f32(v):
    """A float32 from the file as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(v)))


def hf_config(path, md, tensors):
    """The HF config dict of a GGUF from its metadata; `tensors`: {name: (type, shape)}."""
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"[gguf] {path}: architecture {arch!r} is not supported; krnl reads "
                         f"{', '.join(ARCHITECTURES)} (Mistral files are 'llama')")
    model_type, hf_arch = ARCHITECTURES[arch]

    def get(key, default=None):
        v = md.get(f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"[gguf] {path}: metadata {arch}.{key} is missing")
        return v

    if "token_embd.weight" not in tensors:
        raise ValueError(f"[gguf] {path}: tensor token_embd.weight is missing")
    C, H = int(get("embedding_length")), int(get("attention.head_count"))
    if isinstance(md.get(f"{arch}.attention.head_count_kv"), list):
        raise ValueError(f"[gguf] {path}: per-layer kv head counts are not supported")
    D = int(md.get(f"{arch}.attention.key_length") or C // H)
    if int(md.get(f"{arch}.attention.value_length") or D) != D:
        raise ValueError(f"[gguf] {path}: value_length {md[f'{arch}.attention.value_length']} differs from "
                         f"key_length {D}")
    if int(md.get(f"{arch}.rope.dimension_count") or D) != D:
        raise ValueError(f"[gguf] {path}: partial rotary embeddings (rope.dimension_count "
                         f"{md[f'{arch}.rope.dimension_count']} < head_dim {D}) are not supported")
    E = int(md.get(f"{arch}.expert_count") or 0)
    if E and arch == "llama":  # llama.cpp writes Mixtral as llama with experts
        model_type, hf_arch = "mixtral", "MixtralForCausalLM"
    cfg = {
        "architectures": [hf_arch], "model_type": model_type,
        "vocab_size": int(tensors["token_embd.weight"][1][0]),
        "hidden_size": C, "intermediate_size": int(get("feed_forward_length", 0 if E else None)),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": H,
        "num_key_value_heads": int(md.get(f"{arch}.attention.head_count_kv") or H), "head_dim": D,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(md.get(f"{arch}.rope.freq_base") or 10000.0),
        "max_position_embeddings": int(md.get(f"{arch}.context_length") or 2048),
        "tie_word_embeddings": "output.weight" not in tensors, "torch_dtype": "bfloat16",
    }
    if model_type == "qwen2" or "blk.0.attn_q.bias" in tensors:
        cfg["attention_bias"] = True
    if arch == "gpt-oss":  # SwiGLU's alpha and limit are llama.cpp's constants
        cfg.update({"intermediate_size": int(get("expert_feed_forward_length")),
                    "sliding_window": int(get("attention.sliding_window"))})
    if arch in ("gpt-oss", "gemma2", "gemma3"):
        cfg.update(_layer_types(md, arch, cfg))
    if arch in ("gemma2", "gemma3"):  # llama.cpp's query scale (gemma2.cpp, gemma3.cpp)
        big = cfg["num_hidden_layers"] == (46 if arch == "gemma2" else 62)
        cfg.update({"query_pre_attn_scalar": C // H if big else D, "tie_word_embeddings": True,
                    "final_logit_softcapping": _f32(md.get(f"{arch}.final_logit_softcapping") or 0.0) or None,
                    "attn_logit_softcapping": _f32(md.get(f"{arch}.attn_logit_softcapping") or 0.0) or None})
        if arch == "gemma3":
            cfg["rope_local_base_freq"] = _f32(md.get(f"{arch}.rope.freq_base_swa") or 10000.0)
    if arch == "phi3":
        cfg["original_max_position_embeddings"] = int(md.get(f"{arch}.rope.scaling.original_context_length")
                                                      or cfg["max_position_embeddings"])
        if int(md.get(f"{arch}.attention.sliding_window") or 0):
            cfg["sliding_window"] = int(md[f"{arch}.attention.sliding_window"])
    if E:  # llama.cpp renormalises the top-k weights of qwen3moe and Mixtral (its norm_w), not OLMoE's
        cfg.update({"num_experts" if arch in ("qwen3moe", "olmoe") else "num_local_experts": E,
                    "num_experts_per_tok": int(get("expert_used_count")),
                    "norm_topk_prob": bool(md.get(f"{arch}.expert_weights_norm", arch != "olmoe"))})
        if arch == "qwen3moe":
            cfg["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
    for key, tk in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if md.get(f"tokenizer.ggml.{tk}") is not None:
            cfg[key] = int(md[f"tokenizer.ggml.{tk}"])
    kind = md.get(f"{arch}.rope.scaling.type")
    if kind == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _f32(get("rope.scaling.factor"))}
    elif kind == "yarn":  # ggml's ramp bounds are whole dimensions (transformers' truncate)
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": _f32(get("rope.scaling.factor")), "truncate": True,
                               "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
                               "beta_fast": _f32(md.get(f"{arch}.rope.scaling.yarn_beta_fast") or 32.0),
                               "beta_slow": _f32(md.get(f"{arch}.rope.scaling.yarn_beta_slow") or 1.0)}
    elif kind not in (None, "none", ""):
        raise ValueError(f"[gguf] {path}: rope scaling {kind!r} is not supported (krnl takes linear, yarn and llama3)")
    return cfg


def _layer_types(md, arch, cfg):
    """layer_types and sliding_window of the architectures with sliding layers (gemma3 without a
    window: every layer full)."""
    window = int(md.get(f"{arch}.attention.sliding_window") or 0)
    if window == 0:
        return {"layer_types": ["full_attention"] * cfg["num_hidden_layers"]}
    swa = swa_layers(md, arch, cfg["num_hidden_layers"], 6 if arch == "gemma3" else 2)
    return {"sliding_window": window, "layer_types": ["sliding_attention" if s else "full_attention" for s in swa]}


def _longrope(md, arch, long, short):
    """Phi-3's LongRoPE rope_scaling from the file's factor tensors and attention factor."""
    rs = {"rope_type": "longrope", "long_factor": [float(x) for x in np.asarray(long).reshape(-1)],
          "short_factor": [float(x) for x in np.asarray(short).reshape(-1)]}
    if md.get(f"{arch}.rope.scaling.attn_factor") is not None:
        rs["attention_factor"] = _f32(md[f"{arch}.rope.scaling.attn_factor"])
    return rs


def _llama3_scaling(path, cfg, factors, md, arch):
    """The llama3 rope_scaling whose per-frequency factors are the file's rope_freqs tensor (what
    convert_hf_to_gguf writes in its place), among the parameters Llama 3.x uses."""
    factors = np.asarray(factors, np.float64).reshape(-1)
    base = ModelConfig.from_dict(cfg).inv_freq().astype(np.float64)
    if factors.shape != base.shape:
        raise ValueError(f"[gguf] {path}: rope_freqs has {factors.size} values, expected {base.size}")
    origs = {8192, int(md.get(f"{arch}.rope.scaling.original_context_length") or 8192)}
    for orig in sorted(origs):
        rs = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": orig}
        got = base / ModelConfig.from_dict({**cfg, "rope_scaling": rs}).inv_freq().astype(np.float64)
        if np.allclose(got, factors, rtol=1e-4, atol=0):
            return rs
    raise ValueError(f"[gguf] {path}: its rope_freqs factors match no llama3 rope scaling krnl knows")


def _rows(a, n_head):
    if isinstance(a, QuantizedArray):
        return QuantizedArray(unpermute(a.w, n_head), unpermute(a.scales, n_head), unpermute(a.biases, n_head),
                              a.bits, a.group_size, a.scale_dtype)
    return unpermute(a, n_head)


def tensor_array(t, path):
    """(QuantizedArray or float array, dequantized) of one ReaderTensor: dequantized is True for
    the quantized types krnl does not hold quantized (their values rounded to bf16)."""
    kind = t.tensor_type.name
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # (rows..., ne0)
    if kind in gguf_quants.LAYOUTS and len(shape) == 2:
        w, s, b, bits, gs, sdt = gguf_quants.convert(kind, t.data, shape[0], shape[1])
        return QuantizedArray(w, s, b, bits, gs, sdt), False
    if kind in gguf_quants.LAYOUTS and len(shape) == 3:  # experts: each its own table
        data = np.asarray(t.data).reshape(shape[0], shape[1], -1)
        parts = [gguf_quants.convert(kind, data[e], shape[1], shape[2]) for e in range(shape[0])]
        w, s, b = (np.stack([p[j] for p in parts]) for j in range(3))
        return QuantizedArray(w, s, b, *parts[0][3:]), False
    if kind == "MXFP4" and len(shape) in (2, 3):  # kept in 4 bits, codes reordered (krnl.quant.gguf)
        rows = int(np.prod(shape[:-1]))
        w, s = gguf_quants.convert_mxfp4(np.asarray(t.data).reshape(rows, -1), rows, shape[-1])
        return QuantizedArray(w.reshape(*shape[:-1], -1), s.reshape(*shape[:-1], -1), None, 4, 32, "bf16",
                              "mxfp4"), False
    if kind in ("F32", "F16"):
        return np.asarray(t.data).reshape(shape), False
    if kind == "BF16":
        return bf16_to_f32(np.asarray(t.data).view("<u2").reshape(shape)), False
    from gguf.quants import dequantize

    try:
        a = dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError:
        raise ValueError(f"[gguf] {path}: tensor {t.name} has type {kind}, which gguf-py cannot dequantize") from None
    return bf16_to_f32(f32_to_bf16(np.asarray(a, np.float32).reshape(shape))), True


def _stacked(weights, path):
    """weights with each layer's experts stored one by one (`...switch_mlp.gate_proj.E`) stacked into
    one (E, O, I) weight, a QuantizedArray where every expert holds the same quantized layout."""
    groups = {}
    for k in [k for k in weights if re.search(r"\.switch_mlp\.\w+_proj\.\d+$", k)]:
        base, e = k.rsplit(".", 1)
        groups.setdefault(base, {})[int(e)] = weights.pop(k)
    for base, parts in groups.items():
        if sorted(parts) != list(range(len(parts))):
            raise ValueError(f"[gguf] {path}: the experts of {gguf_name(base + '.weight')} are not 0..{len(parts) - 1}: "
                             f"{sorted(parts)}")
        ps = [parts[e] for e in range(len(parts))]
        if all(isinstance(p, QuantizedArray) for p in ps) and len({(p.bits, p.group_size, p.scale_dtype, p.mode)
                                                                    for p in ps}) == 1:
            weights[base + ".weight"] = replace(ps[0], w=np.stack([p.w for p in ps]),
                                                scales=np.stack([p.scales for p in ps]),
                                                biases=None if ps[0].biases is None else np.stack([p.biases for p in ps]))
        else:  # mixed types: every expert dequantized (krnl holds the experts of a projection alike)
            weights[base + ".weight"] = np.stack([np.asarray(p, np.float32) for p in ps])
    return weights


def read_gguf(path, quiet=False):
    """A GGUFModel from the GGUF file at `path`."""
    path = str(path)
    if not Path(path).is_file():
        raise ValueError(f"[gguf] {path}: no such file")
    reader = open_reader(path)
    md = read_metadata(reader)
    tensors = {t.name: (t.tensor_type.name, tuple(int(x) for x in reversed(t.shape.tolist()))) for t in reader.tensors}
    cfg = hf_config(path, md, tensors)
    arch = md["general.architecture"]
    rope = {t.name: t.data for t in reader.tensors if t.name in ROPE_TENSORS}
    if "rope_freqs.weight" in rope:
        cfg["rope_scaling"] = _llama3_scaling(path, cfg, rope["rope_freqs.weight"], md, arch)
    if "rope_factors_long.weight" in rope:
        cfg["rope_scaling"] = _longrope(md, arch, rope["rope_factors_long.weight"],
                                        rope.get("rope_factors_short.weight", rope["rope_factors_long.weight"]))
    config = ModelConfig.from_dict(cfg, source=path)
    names = {t.name: hf_name(t.name, arch) for t in reader.tensors if t.name not in ROPE_TENSORS}
    unknown = sorted(k for k, v in names.items() if v is None)
    if unknown:
        raise ValueError(f"[gguf] {path}: unexpected tensors {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    # from the switch_mlp (gpt-oss: experts) names below
    fused = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.experts.gate_up_proj_bias",
             "mlp.experts.down_proj_bias")
    missing = sorted(k for k in set(config.weight_shapes()) - set(names.values()) if not k.endswith(fused))
    if missing:
        raise ValueError(f"[gguf] {path}: missing tensors {sorted(gguf_name(m, arch) for m in missing)[:8]} "
                         f"({len(missing)} in all)")
    weights, types, dequantized = {}, {}, {}
    for t in reader.tensors:
        hf = names.get(t.name)
        if hf is None:
            continue
        a, deq = tensor_array(t, path)
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            a = _rows(a, config.num_attention_heads if ".q_proj." in hf else config.num_key_value_heads)
        if NORM_SHIFT.get(arch) and hf.endswith("norm.weight"):
            a = (np.asarray(a, np.float32) - np.float32(NORM_SHIFT[arch])).astype(np.float32)
        weights[hf], types[hf] = a, t.tensor_type.name
        if deq:
            dequantized[t.tensor_type.name] = dequantized.get(t.tensor_type.name, 0) + 1
    weights = switch_experts(_stacked(weights, path), config, path)
    for k, a in list(weights.items()):  # a fused gate|up held quantized: its halves, as the model takes them
        if k.endswith("experts.gate_up_proj") and isinstance(a, QuantizedArray):
            F = a.shape[1] // 2
            weights[k] = ExpertHalves(*(replace(a, w=a.w[:, r], scales=a.scales[:, r], biases=None if a.biases is None
                                                else a.biases[:, r]) for r in (slice(0, F), slice(F, None))))
    config.check_weights(weights, who=f"[gguf] {path}:")
    if dequantized and not quiet:
        what = ", ".join(f"{n} x {k}" for k, n in sorted(dequantized.items()))
        print(f"note: {Path(path).name}: krnl holds {what} dequantized to bf16 (it keeps Q8_0, Q4_0, Q4_1, Q4_K, "
              "Q5_K and Q6_K quantized)", file=sys.stderr)
    return GGUFModel(path, md, cfg, config, weights, types)
