"""Tiny GGUF files for tests/test_gguf.py, written with gguf-py's GGUFWriter: random but valid
quantized blocks (random bytes, finite f16 d and dmin of a size that keeps values near 0.5), a
llama-SentencePiece or gpt2-BPE tokenizer, and the HF-ordered float32 weights the file holds
(what transformers and llama.cpp dequantize it to; q/k rows un-permuted for the llama arch by
index arithmetic written here, independently of krnl.formats.gguf.file)."""

import numpy as np

# type -> (values per block, bytes per block, [(offset of an f16 d, its size)])
BLOCKS = {
    "Q8_0": (32, 34, [(0, 4e-3)]),
    "Q4_0": (32, 18, [(0, 5e-2)]),
    "Q4_1": (32, 20, [(0, 3e-2), (2, 2e-1)]),
    "Q4_K": (256, 144, [(0, 5e-4), (2, 5e-3)]),
    "Q5_K": (256, 176, [(0, 2.5e-4), (2, 5e-3)]),
    "Q6_K": (256, 210, [(208, 1.2e-4)]),
    "Q5_0": (32, 22, [(0, 3e-2)]),
    "Q2_K": (256, 84, [(80, 2e-2), (82, 2e-2)]),
}

TINY = dict(hidden=256, ffn=512, heads=4, kv=2, head_dim=64, layers=2)

SPM_PIECES = ["▁", "t", "h", "e", "l", "o", "w", "r", "d", "1", "2", "3", "a", "▁t", "he", "▁the", "ll", "llo", "▁h",
              "▁he", "▁hel", "▁hell", "▁hello", "▁w", "▁wo", "or", "ld", "▁wor", "▁world", "12", "▁1", "▁12", "at"]
# "3 4" and "o W" first: they merge across llama3's 3-digit and tekken's case splits, so that the
# pre-tokenizers give different ids.
BPE_MERGES = ["3 4", "o W", "Ġ t", "h e", "Ġt he", "l l", "e ll", "h ell", "Ġ h", "Ġh ell", "Ġhell o", "1 2", "w o",
              "l d", "r ld", "wo rld", "Ġ w", "Ġw o", "Ġwo rld", "Ġ Ġ", "ĠĠ Ġ", "Ċ Ċ", "ĠĠ ĠĠ", "2 3", "12 3"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def raw_blocks(rng, kind, rows, cols):
    """Random valid blocks of `kind`: (rows, bytes per row) uint8."""
    qk, nb, ds = BLOCKS[kind]
    raw = rng.integers(0, 256, (rows, cols // qk, nb), dtype=np.uint8)
    for off, size in ds:
        d = rng.uniform(0.5, 1.0, (rows, cols // qk, 1)) * size * rng.choice([-1, 1], (rows, cols // qk, 1))
        raw[..., off:off + 2] = d.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def hf_rows(n_head, D):
    """src: HF row r of q or k is row src[r] of the file (convert_hf_to_gguf's permutation puts
    the pair (i, i + D/2) of a head next to each other, at 2i and 2i + 1)."""
    r = np.arange(n_head * D)
    h, rem = r // D, r % D
    t, i = rem // (D // 2), rem % (D // 2)
    return h * D + 2 * i + t


def spm_vocab():
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["<think>", "<|im_start|>",
                                                                                            "<|im_end|>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [4, 3, 3]
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0] * 3
    return tokens, types, scores


def bpe_vocab():
    from krnl.formats.gguf.tokenizer import _byte_alphabet

    base = sorted(set(_byte_alphabet().values()))
    merged = ["".join(m.split(" ")) for m in BPE_MERGES]
    tokens = base + [t for t in dict.fromkeys(merged) if t not in base] + ["<|endoftext|>", "<|im_start|>",
                                                                          "<|im_end|>", "<think>"]
    types = [1] * (len(tokens) - 4) + [3, 3, 3, 4]
    return tokens, types


def write_gguf(path, arch="llama", types=None, tied=False, tokenizer="spm", seed=0, pre="llama-bpe",
               metadata=None, drop=(), extra=None, experts=None, per_expert=False):
    """Writes a tiny model; returns {HF name: float32 array} as the file holds it. `types` maps a
    GGUF tensor name to a type (default F32); `drop` leaves tensors out; `extra` adds some;
    experts = (E, K, F): a mixture (llama: Mixtral; qwen3moe) of E experts of width F, K per token,
    whose weights come back under transformers' fused names (gate_up_proj (E, 2F, C)); per_expert:
    each expert's weights as a tensor of its own (`blk.N.ffn_gate.E.weight`, llama.cpp's Mixtral files
    before ffn_*_exps)."""
    import gguf

    rng = np.random.default_rng(seed)

    def add(name, data, **kw):
        m = name.endswith("_exps.weight") and per_expert
        for e, d in enumerate(data if m else [data]):
            w.add_tensor(name.replace("_exps.weight", f".{e}.weight") if m else name, d, **kw)

    C, F, H, Hk, D, L = (TINY[k] for k in ("hidden", "ffn", "heads", "kv", "head_dim", "layers"))
    w = gguf.GGUFWriter(str(path), arch)
    if tokenizer == "spm":
        tokens, ttypes, scores = spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        bos, eos = 1, 2
        w.add_unk_token_id(0)
    else:
        tokens, ttypes = bpe_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_merges(BPE_MERGES)
        bos = eos = tokens.index("<|endoftext|>")
        w.add_add_bos_token(False)
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_chat_template(TEMPLATE)
    V = len(tokens)
    w.add_context_length(128)
    w.add_embedding_length(C)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(Hk)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_dimension_count(D)
    metadata = dict(metadata or {})
    w.add_rope_freq_base(metadata.pop(f"{arch}.rope.freq_base", 10000.0))
    w.add_layer_norm_rms_eps(1e-5)
    if experts:
        w.add_expert_count(experts[0])
        w.add_expert_used_count(experts[1])
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(experts[2])
    for k, v in metadata.items():
        (w.add_string if isinstance(v, str) else w.add_uint32 if isinstance(v, int) else w.add_float32)(k, v)
    shapes = {"token_embd.weight": ("model.embed_tokens.weight", (V, C)),
              "output_norm.weight": ("model.norm.weight", (C,))}
    if not tied:
        shapes["output.weight"] = ("lm_head.weight", (V, C))
    mods = {"attn_q": ("self_attn.q_proj", H * D, C), "attn_k": ("self_attn.k_proj", Hk * D, C),
            "attn_v": ("self_attn.v_proj", Hk * D, C), "attn_output": ("self_attn.o_proj", C, H * D),
            "ffn_gate": ("mlp.gate_proj", F, C), "ffn_up": ("mlp.up_proj", F, C), "ffn_down": ("mlp.down_proj", C, F)}
    if experts:
        E, _, Fe = experts
        for g in ("ffn_gate", "ffn_up", "ffn_down"):
            mods.pop(g)
        mods.update({"ffn_gate_inp": ("mlp.gate", E, C), "ffn_gate_exps": ("mlp.experts.gate", E, Fe, C),
                     "ffn_up_exps": ("mlp.experts.up", E, Fe, C), "ffn_down_exps": ("mlp.experts.down_proj", E, C, Fe)})
    for i in range(L):
        shapes[f"blk.{i}.attn_norm.weight"] = (f"model.layers.{i}.input_layernorm.weight", (C,))
        shapes[f"blk.{i}.ffn_norm.weight"] = (f"model.layers.{i}.post_attention_layernorm.weight", (C,))
        for g, (hf, *shape) in mods.items():
            shapes[f"blk.{i}.{g}.weight"] = (f"model.layers.{i}.{hf}" + (".weight" * (len(shape) == 2)), tuple(shape))
            if arch == "qwen2" and g in ("attn_q", "attn_k", "attn_v"):
                shapes[f"blk.{i}.{g}.bias"] = (f"model.layers.{i}.{hf}.bias", (shape[0],))
        if arch in ("qwen3", "qwen3moe", "olmoe"):  # RMSNorm of each q and k head (olmoe: of all q, all k)
            for g, n in (("q", H), ("k", Hk)):
                shapes[f"blk.{i}.attn_{g}_norm.weight"] = (f"model.layers.{i}.self_attn.{g}_norm.weight",
                                                           (D * n if arch == "olmoe" else D,))
    hf_weights = {}
    from gguf.quants import dequantize

    from krnl.io.safetensors_io import bf16_to_f32, f32_to_bf16

    for name, (hf, shape) in shapes.items():
        if name in drop:
            continue
        kind = (types or {}).get(name, "F32")
        perm = None
        if arch == "llama" and (".attn_q.weight" in name or ".attn_k.weight" in name):
            perm = hf_rows(H if ".attn_q." in name else Hk, D)
        if kind in ("F32", "F16"):
            hfv = (1 + 0.1 * rng.normal(size=shape)) if len(shape) == 1 else 0.08 * rng.normal(size=shape)
            hfv = hfv.astype(np.float16 if kind == "F16" else np.float32)
            file_v = np.empty_like(hfv)
            if perm is not None:
                file_v[perm] = hfv
            else:
                file_v = hfv
            add(name, file_v)
            hf_weights[hf] = hfv.astype(np.float32)
        else:
            raw = raw_blocks(rng, kind, int(np.prod(shape[:-1])), shape[-1]).reshape(*shape[:-1], -1)
            file_v = dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32).reshape(shape)
            if kind not in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"):
                file_v = bf16_to_f32(f32_to_bf16(file_v))  # what krnl holds of the other types
            add(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
            hf_weights[hf] = file_v[perm] if perm is not None else file_v
    for i in range(L if experts else 0):  # the halves as one fused weight
        p = f"model.layers.{i}.mlp.experts."
        hf_weights[p + "gate_up_proj"] = np.concatenate([hf_weights.pop(p + "gate"), hf_weights.pop(p + "up")], 1)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf_weights


def mixed_types(layers=2):
    """Quantized types across the layers (the ones krnl keeps quantized, two it dequantizes)."""
    t = {"token_embd.weight": "Q6_K", "output.weight": "Q8_0"}
    per = [{"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q8_0", "attn_output": "Q5_K", "ffn_gate": "Q4_0",
            "ffn_up": "Q4_1", "ffn_down": "Q6_K"},
           {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q4_K", "attn_output": "F16", "ffn_gate": "Q5_0",
            "ffn_up": "Q2_K", "ffn_down": "F32"}]
    for i in range(layers):
        for g, k in per[i % 2].items():
            t[f"blk.{i}.{g}.weight"] = k
    return t


def write_gpt_oss_gguf(path, seed=0, fused_gate_up=False):
    """A tiny gpt-oss as llama.cpp's converter writes it (arch gpt-oss: attn_sinks, post_attention_norm,
    biases, YaRN metadata, the experts in ggml's MXFP4 quantized by gguf-py; gate and up apart, or
    fused as ffn_gate_up_exps); returns {krnl name: float32} of what the file holds, the experts as
    gguf-py dequantizes them, gate_up_proj (E, 2F, C) gate's rows first."""
    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    C, F, H, Hk, D, L, E = 64, 32, 4, 2, 16, 2, 5
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    tokens, ttypes = bpe_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_merges(BPE_MERGES)
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    for add, v in ((w.add_context_length, 128), (w.add_embedding_length, C), (w.add_block_count, L),
                   (w.add_feed_forward_length, F), (w.add_head_count, H), (w.add_head_count_kv, Hk),
                   (w.add_key_length, D), (w.add_value_length, D), (w.add_rope_freq_base, 150000.0),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_expert_count, E), (w.add_expert_used_count, 2),
                   (w.add_expert_feed_forward_length, F), (w.add_sliding_window, 4),
                   (w.add_rope_scaling_type, gguf.RopeScalingType.YARN), (w.add_rope_scaling_factor, 4.0),
                   (w.add_rope_scaling_orig_ctx_len, 16)):
        add(v)
    V, out = len(tokens), {}

    def put(name, krnl_name, shape, mxfp4=False, scale=0.3):
        a = (scale * rng.normal(size=shape)).astype(np.float32)
        if name.endswith("norm.weight"):
            a += 1
        if mxfp4:
            raw = quantize(a, gguf.GGMLQuantizationType.MXFP4)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            a = dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(shape).astype(np.float32)
        else:
            w.add_tensor(name, a)
        if krnl_name:
            out[krnl_name] = a
        return a

    put("token_embd.weight", "model.embed_tokens.weight", (V, C))
    put("output_norm.weight", "model.norm.weight", (C,))
    put("output.weight", "lm_head.weight", (V, C))
    for i in range(L):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        put(b + "attn_norm.weight", p + "input_layernorm.weight", (C,))
        put(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight", (C,))
        for g, m, rows in (("attn_q", "q_proj", H * D), ("attn_k", "k_proj", Hk * D), ("attn_v", "v_proj", Hk * D),
                           ("attn_output", "o_proj", C)):
            put(b + g + ".weight", p + f"self_attn.{m}.weight", (rows, C if g != "attn_output" else H * D))
            put(b + g + ".bias", p + f"self_attn.{m}.bias", (rows,))
        put(b + "attn_sinks.weight", p + "self_attn.sinks", (H,), scale=1.0)
        put(b + "ffn_gate_inp.weight", p + "mlp.gate.weight", (E, C))
        put(b + "ffn_gate_inp.bias", p + "mlp.gate.bias", (E,))
        if fused_gate_up:
            put(b + "ffn_gate_up_exps.weight", p + "mlp.experts.gate_up_proj", (E, 2 * F, C), mxfp4=True)
            put(b + "ffn_gate_up_exps.bias", p + "mlp.experts.gate_up_proj_bias", (E, 2 * F))
        else:
            halves = [put(b + f"ffn_{h}_exps.weight", None, (E, F, C), mxfp4=True) for h in ("gate", "up")]
            out[p + "mlp.experts.gate_up_proj"] = np.concatenate(halves, axis=1)
            bias = [put(b + f"ffn_{h}_exps.bias", None, (E, F)) for h in ("gate", "up")]
            out[p + "mlp.experts.gate_up_proj_bias"] = np.concatenate(bias, axis=1)
        put(b + "ffn_down_exps.weight", p + "mlp.experts.down_proj", (E, C, F), mxfp4=True)
        put(b + "ffn_down_exps.bias", p + "mlp.experts.down_proj_bias", (E, C))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
