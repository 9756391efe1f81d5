"""Which ggml type each tensor of an exported GGUF gets (`krnl fuse --gguf-type`), following
llama.cpp: its converter for f16, bf16 and q8_0 (convert_hf_to_gguf --outtype) and its quantizer's
choices for the rest (llama-quant.cpp, llama_tensor_get_type), so that a file krnl writes has the
types `llama-quantize` would give the f16 export:

- 1-D tensors, norms, biases and a mixture's router (`ffn_gate_inp`): F32, never quantized.
- f16, bf16, q8_0: every other weight in that type.
- q4_0, q6_k: every weight in that type but the head (`output`, or the tied embedding), which gets
  Q6_K (Q8_0 where its width is not whole blocks of 256).
- q4_k_m / q5_k_m: Q4_K / Q5_K, except the head (Q6_K); attn_v (Phi-3's attn_qkv) and ffn_down
  in Q6_K on the layers llama.cpp's use_more_bits picks (the first and last eighth, and every third
  between); a 70B Llama's other attn_v in Q5_K; with 8 experts attn_v and attn_k in Q8_0 and (q4_k_m)
  attn_output in Q5_K.
- a K-quant on a tensor whose width is not whole blocks of 256 falls back as llama.cpp's does:
  Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0. Widths that are not whole blocks of 32 are refused
  (llama.cpp would store them in F16: a file of another type than asked for).
"""

import re

# --gguf-type: (ggml type of most weights, general.file_type (llama_ftype))
GGUF_TYPES = {"f16": ("F16", 1), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7), "q4_0": ("Q4_0", 2),
              "q4_k_m": ("Q4_K", 15), "q5_k_m": ("Q5_K", 17), "q6_k": ("Q6_K", 18)}
BLOCK = {"F32": 1, "F16": 1, "BF16": 1, "Q8_0": 32, "Q4_0": 32, "Q5_0": 32, "Q5_1": 32, "Q4_K": 256, "Q5_K": 256,
         "Q6_K": 256}
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_CONVERTER = ("f16", "bf16", "q8_0")  # what convert_hf_to_gguf writes itself; the rest llama-quantize does


def use_more_bits(i, n):
    """llama.cpp's choice of the layers that get more bits."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _category(name):
    """llama-quant.cpp's tensor_get_category, by name."""
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for part, cat in (("attn_qkv.weight", "attn_v"), ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"),
                      ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"),
                      ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if part in name:
            return cat
    return "other"


def kept_float(name, shape):
    """Whether a tensor stays F32 in every export (llama.cpp quantizes none of these)."""
    return (len(shape) < 2 or not name.endswith(".weight") or name.endswith("_norm.weight")
            or "ffn_gate_inp." in name)


def tensor_type(gguf_type, name, shape, n_layers, n_experts=0, tied=False, llama_70b=False):
    """The ggml type name of tensor `name` (shape as krnl holds it: (..., rows, cols)) in a file of
    --gguf-type `gguf_type`; ValueError naming the tensor where its width does not fit the type."""
    if kept_float(name, shape):
        return "F32"
    base = GGUF_TYPES[gguf_type][0]
    kind = base
    if gguf_type not in _CONVERTER:
        kind = _choose(gguf_type, base, name, shape[-1], n_layers, n_experts, tied, llama_70b)
    cols = shape[-1]
    if cols % BLOCK[kind] and kind in _FALLBACK:
        kind = _FALLBACK[kind]
    if cols % BLOCK[kind]:
        raise ValueError(f"[gguf] --gguf-type {gguf_type}: tensor {name} has {cols} columns, not a multiple of "
                         f"{BLOCK[kind]} ({kind} blocks); export it as f16, bf16 or another type")
    return kind


def _choose(gguf_type, base, name, cols, n_layers, n_experts, tied, llama_70b):
    """llama_tensor_get_type_impl's rules for the types krnl writes."""
    cat = _category(name)
    m = re.match(r"blk\.(\d+)\.", name)
    layer = int(m.group(1)) if m else 0
    km = gguf_type in ("q4_k_m", "q5_k_m")
    if cat == "output" or (tied and cat == "token_embd"):
        return "Q8_0" if cols % 256 else ("Q6_K" if base != "Q8_0" else base)
    if cat == "attn_v":
        kind = "Q6_K" if km and use_more_bits(layer, n_layers) else base
        if llama_70b and kind in ("Q3_K", "Q4_K"):
            kind = "Q5_K"
        return "Q8_0" if n_experts == 8 else kind
    if cat == "attn_k" and n_experts == 8:
        return "Q8_0"
    if cat == "ffn_down" and km and use_more_bits(layer, n_layers):
        return "Q6_K"
    if cat == "attn_output" and n_experts == 8 and gguf_type == "q4_k_m":
        return "Q5_K"
    return base
