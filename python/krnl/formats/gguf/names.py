"""GGUF's tensor names and architectures against the HF names and model types krnl holds: one
table, read one way by the reader (file.py) and the other by the exporter (export.py).

- ARCHITECTURES: a GGUF architecture and the model type and HF class it reads as; llama.cpp writes
  Mistral and Mixtral (with experts) as "llama" (EXPORT_ARCH, the table inverted).
- Layer tensors: one map per architecture (layer_names), because the norms differ: `ffn_norm` is
  Llama's post_attention_layernorm but Gemma's pre_feedforward_layernorm; gpt-oss says
  `post_attention_norm`; Phi-3's `attn_qkv` and `ffn_up` hold its fused qkv_proj and gate_up_proj.
  A mixture's experts go by mlx-lm's names here (switch_mlp, each (E, out, in)).
- q and k rows: llama.cpp's converter permutes them for the llama architecture only (GGML's
  interleaved rotary embedding); every other architecture here rotates halves as HF does.
- Gemma's norms compute x (1 + w); llama.cpp's compute x w, so its files hold 1 + w (NORM_SHIFT).
"""

import re

import numpy as np

ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM"), "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
                 "gpt-oss": ("gpt_oss", "GptOssForCausalLM"), "olmoe": ("olmoe", "OlmoeForCausalLM"),
                 "gemma2": ("gemma2", "Gemma2ForCausalLM"), "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
                 "phi3": ("phi3", "Phi3ForCausalLM")}
EXPORT_ARCH = {**{mt: arch for arch, (mt, _) in ARCHITECTURES.items()}, "mistral": "llama", "mixtral": "llama"}
NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}

_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # qwen3, gemma3, olmoe
          # experts (E, out, in) each and the router, under mlx-lm's names (experts.switch_experts)
          "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
          "ffn_up_exps": "mlp.switch_mlp.up_proj", "ffn_down_exps": "mlp.switch_mlp.down_proj",
          # gpt-oss: sinks; gate|up fused in newer files (gate's rows first, as krnl holds it)
          "attn_sinks": "self_attn.sinks", "ffn_gate_up_exps": "mlp.experts.gate_up_proj"}
_GEMMA = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
          "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER = {None: {"ffn_norm": "post_attention_layernorm"},
               "gpt-oss": {"post_attention_norm": "post_attention_layernorm"},
               "gemma2": _GEMMA, "gemma3": _GEMMA,
               "phi3": {"ffn_norm": "post_attention_layernorm", "attn_qkv": "self_attn.qkv_proj",
                        "ffn_up": "mlp.gate_up_proj"}}
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
# Rotary tables krnl reads into the config (llama3's factors, Phi-3's LongRoPE factors)
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def layer_names(arch):
    """{GGUF layer tensor: HF module path} of an architecture, one to one."""
    return {**_LAYER, **_ARCH_LAYER.get(arch, _ARCH_LAYER[None])}


def hf_name(name, arch=None):
    """The HF name of a GGUF tensor name (None for one krnl does not know). A Mixtral expert of its
    own (`blk.N.ffn_gate.E.weight`, files older than ffn_*_exps) comes as `...switch_mlp.gate_proj.E`."""
    if name in GLOBAL:
        return GLOBAL[name]
    m = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight", name)
    if m:
        return f"model.layers.{m.group(1)}.mlp.switch_mlp.{m.group(2)}_proj.{m.group(3)}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    layer = layer_names(arch)
    if not m or m.group(2) not in layer:
        return None
    hf = f"model.layers.{m.group(1)}.{layer[m.group(2)]}"
    if m.group(2) == "attn_sinks":
        return hf
    if m.group(2) == "ffn_gate_up_exps":
        return hf + ("_bias" if m.group(3) == "bias" else "")
    if arch == "gpt-oss":  # mlx-lm's names of gpt-oss's experts (experts.switch_experts)
        hf = hf.replace(".switch_mlp.", ".experts.")
    return f"{hf}.{m.group(3)}"


def gguf_name(hf, arch=None):
    """The GGUF name of an HF name (a mixture's experts under their switch_mlp names); the name
    itself where there is none."""
    back = {v: k for k, v in GLOBAL.items()}
    if hf in back:
        return back[hf]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+?)(?:\.(weight|bias))?", hf)
    g = {v: k for k, v in layer_names(arch).items()}.get(m.group(2)) if m else None
    return f"blk.{m.group(1)}.{g}.{m.group(3) or 'weight'}" if g else hf


def unpermute(w, n_head):
    """Undoes convert_hf_to_gguf's q/k row permutation (heads of [first halves, second halves]
    interleaved pairwise): rows (n_head * D, ...) back to HF's order. Works on any per-row array."""
    w = np.asarray(w)
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute(w, n_head):
    """convert_hf_to_gguf's permutation of q/k rows (the exporter's, for the llama architecture)."""
    w = np.asarray(w)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permuted_heads(arch, hf, config):
    """The head count whose rows llama.cpp permutes in weight `hf` (q or k, llama architecture), or None."""
    if arch != "llama":
        return None
    if ".self_attn.q_proj." in hf:
        return config.num_attention_heads
    return config.num_key_value_heads if ".self_attn.k_proj." in hf else None


def swa_layers(md, arch, n_layers, default_pattern):
    """Per layer, whether llama.cpp runs it with the sliding window: the file's
    `attention.sliding_window_pattern` (one bool per layer, or every n-th layer full), else the
    architecture's default n (llama_hparams::set_swa_pattern: layer i slides when i % n < n - 1)."""
    p = md.get(f"{arch}.attention.sliding_window_pattern", default_pattern)
    if isinstance(p, list):
        if len(p) != n_layers:
            raise ValueError(f"{arch}.attention.sliding_window_pattern lists {len(p)} layers, not {n_layers}")
        return [bool(x) for x in p]
    n = int(p)
    return [n == 0 or i % n < n - 1 for i in range(n_layers)]
