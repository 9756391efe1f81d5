"""Tiny model folders for the MLX folder tests (test_mlx_folder.py, test_mlx_models.py): a float HF
llama folder, an MLX quantized folder written with numpy (codes packed through a Python integer,
independent of krnl.quant.affine.pack), LoRA factors and a dataset."""

import json
from pathlib import Path

import numpy as np
import pytest

from krnl.formats.hf import write_sharded
from krnl.models.config import ModelConfig, lora_key, random_weights
from krnl.io.safetensors_io import bf16_to_f32, encode, f32_to_bf16

V = 61  # awkward vocabulary: rows of the embedding and the head


def base_config(**kw):
    return {**dict(model_type="llama", vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                   tie_word_embeddings=False), **kw}


def write_tokenizer(folder):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"</s>": 0, **{f"w{i}": i for i in range(1, V)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="</s>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def make_base(folder, seed=3, **kw):
    """A tiny random float HF llama folder (input sizes 64 and 128, so it quantizes)."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True)
    cfg = base_config(**kw)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(random_weights(ModelConfig.from_dict(cfg), seed=seed, std=0.2), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(folder)
    return folder


def pack_ref(codes, bits):
    """Each row's codes as one little-endian bit stream (code j at bit j * bits) cut into 32-bit
    words, through a Python integer: independent of krnl.quant.affine.pack."""
    O, I = codes.shape
    out = np.zeros((O, I * bits // 32), np.uint32)
    for o in range(O):
        acc = 0
        for j in range(I):
            acc |= int(codes[o, j]) << (j * bits)
        for w in range(out.shape[1]):
            out[o, w] = (acc >> (32 * w)) & 0xFFFFFFFF
    return out


def round_bf16(x):
    return bf16_to_f32(f32_to_bf16(np.asarray(x, np.float32)))


def write_mlx_folder(folder, layouts, scale_st="BF16", quantization=None, seed=0, **kw):
    """An MLX quantized folder written with numpy: layouts {module path: (bits, group_size)} are
    stored quantized (random codes, scales and biases), everything else as F32. Returns
    {weight name: float64 weight the file means}."""
    folder = Path(folder)
    folder.mkdir(parents=True)
    cfg = base_config(**kw)
    rng = np.random.default_rng(seed)
    items, expect = [], {}
    for name, shape in ModelConfig.from_dict(cfg).weight_shapes().items():
        m = name[:-len(".weight")] if name.endswith(".weight") else None
        if m in layouts:
            bits, gs = layouts[m]
            O, I = shape
            codes = rng.integers(0, 1 << bits, (O, I))
            s = rng.uniform(0.01, 0.1, (O, I // gs)).astype(np.float32)
            b = rng.uniform(-0.5, 0.5, (O, I // gs)).astype(np.float32)
            if scale_st == "BF16":
                s, b = round_bf16(s), round_bf16(b)
            elif scale_st == "F16":
                s, b = (x.astype(np.float16).astype(np.float32) for x in (s, b))
            words = pack_ref(codes, bits)
            items += [(name, "U32", words.shape, words.tobytes),
                      (m + ".scales", scale_st, s.shape, lambda s=s: encode(s, scale_st)),
                      (m + ".biases", scale_st, b.shape, lambda b=b: encode(b, scale_st))]
            expect[name] = (np.repeat(s.astype(np.float64), gs, 1) * codes + np.repeat(b.astype(np.float64), gs, 1))
        else:
            w = (rng.standard_normal(shape) * 0.2 + (1.0 if "norm" in name else 0.0)).astype(np.float32)
            items.append((name, "F32", w.shape, w.tobytes))
            expect[name] = w.astype(np.float64)
    write_sharded(folder, items, metadata={"format": "mlx"})
    q = quantization if quantization is not None else {"group_size": 64, "bits": 4, "mode": "affine"}
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization": q, "quantization_config": q}))
    write_tokenizer(folder)
    return expect


def mixed_layouts(L=2):
    """Every projection and the embedding and head quantized, at mixed bits and group sizes: q, k
    and v of a layer at different bits (a RowStack in the model)."""
    lay = {"model.embed_tokens": (4, 64), "lm_head": (6, 32)}
    for i in range(L):
        p = f"model.layers.{i}."
        lay.update({p + "self_attn.q_proj": (4, 64), p + "self_attn.k_proj": (4, 64),
                    p + "self_attn.v_proj": (6, 64) if i else (3, 32), p + "self_attn.o_proj": (8, 64),
                    p + "mlp.gate_proj": (2, 32), p + "mlp.up_proj": (5, 64), p + "mlp.down_proj": (8, 128)})
    return lay


def write_data(folder):
    folder.mkdir()
    rows = [json.dumps({"text": " ".join(f"w{(i + j) % (V - 1) + 1}" for j in range(6))}) + "\n" for i in range(16)]
    (folder / "train.jsonl").write_text("".join(rows))
    (folder / "valid.jsonl").write_text("".join(rows[:4]))


def random_adapter(config, lora, seed=5):
    rng = np.random.default_rng(seed)
    t = {}
    for i in lora.adapted_layers(config):
        for m in lora.target_modules:
            out, inp = config.module_shape(m)
            t[lora_key(i, m, "A")] = (0.3 * rng.standard_normal((lora.r, inp))).astype(np.float32)
            t[lora_key(i, m, "B")] = (0.3 * rng.standard_normal((out, lora.r))).astype(np.float32)
    return t
