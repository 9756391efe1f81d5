"""GGUF files as base models (krnl.gguf_file, gguf_quants, gguf_tokenizer): quantized blocks
converted exactly, the llama q/k row permutation, config, loss against dense weights and
transformers, the tokenizers against transformers' GGUF tokenizers, the CLI (train, generate,
fuse) and one-line errors. The files are tiny ones written by tests/gguf_files.py."""

import json
import math

import numpy as np
import pytest

import krnl

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from gguf_files import BLOCKS, TINY, hf_rows, mixed_types, raw_blocks, write_gguf  # noqa: E402

KEPT = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
TEXTS = ["hello world", " the  hello\n12345", "héllo 世界 <s> x</s>", "<think>the", "  hello   world  ",
         "<|im_start|>user\nhello<|im_end|>", "12345 1234", "", "<|endoftext|>the 123"]


def _loss(model, vocab, seed=1, rows=2, T=13):
    rng = np.random.default_rng(seed)
    ids, tg = rng.integers(0, vocab, (rows, T)), rng.integers(0, vocab, (rows, T))
    tg[0, :3] = -100
    return float(model.loss(ids, tg)), ids, tg


# ---- quantized blocks ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KEPT)
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_gguf_quantized_types_convert_exactly(kind, rows):
    from gguf.quants import dequantize

    from krnl import gguf_quants, quant
    from krnl.qweight import QuantizedArray

    qk = BLOCKS[kind][0]
    cols = qk * 3
    raw = raw_blocks(np.random.default_rng(rows), kind, rows, cols)
    want = dequantize(raw, gguf.GGMLQuantizationType[kind])
    w, s, b, bits, gs, sdt = gguf_quants.convert(kind, raw, rows, cols)
    assert (bits, gs) == {"Q8_0": (8, 32), "Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32), "Q5_K": (5, 32),
                          "Q6_K": (6, 16)}[kind]
    assert w.shape == (rows, cols * bits // 32) and s.shape == b.shape == (rows, cols // gs)
    a = QuantizedArray(w, s, b, bits, gs, sdt)
    got = np.asarray(a, np.float32)
    assert a.shape == (rows, cols) and got.shape == want.shape
    # Bit for bit, except that ggml's d * 0 keeps d's sign where s * q + b gives +0.
    same = (got.view(np.uint32) == want.view(np.uint32)) | ((got == 0) & (want == 0))
    assert same.all(), f"{kind}: {np.count_nonzero(~same)} values differ"
    assert quant.unpack(w, bits).max() < 2 ** bits
    # Scales stored as f16 only where they are f16 values (the file's own d: Q8_0, Q4_0, Q4_1).
    assert sdt == ("f16" if kind in ("Q8_0", "Q4_0", "Q4_1") else "f32")
    if sdt == "f16":
        assert np.array_equal(s.astype(np.float16).astype(np.float32), s)


def test_gguf_row_permutation_is_ggml_rope_and_undone():
    """The file's q/k rows (tests/gguf_files.hf_rows) rotated as GGML does (adjacent pairs) give
    the same attention scores as HF's rows rotated as HF does (halves); read_gguf's unpermute
    restores HF's rows, for float and quantized (row-wise) arrays."""
    from krnl.gguf_file import permute, unpermute

    rng = np.random.default_rng(0)
    H, D, C, T = 3, 8, 5, 4
    Wq, Wk, x = rng.normal(size=(H * D, C)), rng.normal(size=(H * D, C)), rng.normal(size=(T, C))
    src = hf_rows(H, D)
    Fq, Fk = np.empty_like(Wq), np.empty_like(Wk)
    Fq[src], Fk[src] = Wq, Wk
    inv = 1.0 / 10000 ** (np.arange(0, D, 2) / D)
    ang = np.arange(T)[:, None] * inv[None, :]                                  # (T, D/2)
    cos, sin = np.cos(ang), np.sin(ang)

    def rope_hf(v):                                                             # (T, H, D): halves
        a, b = v[..., :D // 2], v[..., D // 2:]
        c, s = cos[:, None], sin[:, None]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    def rope_ggml(v):                                                           # adjacent pairs
        a, b = v[..., 0::2], v[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        return np.stack([a * c - b * s, b * c + a * s], -1).reshape(v.shape)

    def scores(Wq, Wk, rope):
        q, k = rope((x @ Wq.T).reshape(T, H, D)), rope((x @ Wk.T).reshape(T, H, D))
        return np.einsum("thd,shd->hts", q, k)

    assert np.allclose(scores(Fq, Fk, rope_ggml), scores(Wq, Wk, rope_hf), atol=1e-10)
    assert not np.allclose(scores(Wq, Wk, rope_ggml), scores(Wq, Wk, rope_hf), atol=1e-3)
    assert np.array_equal(unpermute(Fq, H), Wq) and np.array_equal(permute(Wq, H), Fq)
    assert np.array_equal(unpermute(np.arange(H * D), H), src)


# ---- files: config, weights, loss ------------------------------------------------------------


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False)])
def test_gguf_model_loads_with_the_loss_of_its_dense_weights(tmp_path, arch, tied, capsys):
    from krnl.gguf_file import read_gguf
    from krnl.hf import load_model
    from krnl.model import LlamaModel
    from krnl.qweight import QuantizedArray

    path = tmp_path / "m.gguf"
    types = mixed_types()
    dense = write_gguf(path, arch=arch, tied=tied, types=types, tokenizer="spm" if arch == "llama" else "bpe",
                       pre="qwen2")
    g = read_gguf(path)
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "1 x Q2_K, 1 x Q5_0 dequantized to bf16" in err
    c = g.config
    assert (c.model_type, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (arch, 256, 512, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 64)
    assert (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings) == (1e-5, 10000.0, 128)
    assert c.tie_word_embeddings == tied and c.attention_bias == (arch == "qwen2")
    assert set(g.weights) == set(dense) == set(c.weight_shapes())
    for name, want in dense.items():
        a = g.weights[name]
        assert isinstance(a, QuantizedArray) == (g.types[name] in KEPT), name
        assert tuple(np.shape(a)) == want.shape and np.array_equal(np.asarray(a, np.float32), want), name
    dev = krnl.device("cpu")
    got, ids, tg = _loss(load_model(path, dev), c.vocab_size)
    ref = LlamaModel(dev, c, dense)
    assert math.isfinite(got) and abs(got - float(ref.loss(ids, tg))) <= 1e-5 * max(1.0, abs(got))


def test_gguf_llama3_rope_factors_become_rope_scaling(tmp_path):
    from krnl.gguf_file import read_gguf

    D, base = TINY["head_dim"], 500000.0
    freqs = 1.0 / base ** (np.arange(0, D, 2) / D)
    factors = []
    for f in freqs:  # as convert_hf_to_gguf writes them (factor 8, low 1, high 4, 8192 positions)
        wl = 2 * math.pi / f
        if wl < 8192 / 4:
            factors.append(1.0)
        elif wl > 8192 / 1:
            factors.append(8.0)
        else:
            sm = (8192 / wl - 1) / (4 - 1)
            factors.append(1 / ((1 - sm) / 8 + sm))
    path = tmp_path / "l3.gguf"
    write_gguf(path, extra={"rope_freqs.weight": np.asarray(factors, np.float32)},
               metadata={"llama.rope.freq_base": base})
    g = read_gguf(path)
    assert g.config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert np.allclose(g.config.inv_freq(), freqs / np.asarray(factors), rtol=1e-6)
    bad = tmp_path / "bad.gguf"
    write_gguf(bad, extra={"rope_freqs.weight": np.linspace(1, 3, D // 2).astype(np.float32)})
    with pytest.raises(ValueError, match=r"^\[gguf\] .*bad.gguf: its rope_freqs factors match no llama3"):
        read_gguf(bad)


# ---- tokenizers ------------------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("arch,kind,pre", [("llama", "spm", None), ("qwen2", "bpe", "qwen2"),
                                           ("llama", "bpe", "llama-bpe")])
def test_gguf_tokenizer_matches_transformers(tmp_path, arch, kind, pre):
    pytest.importorskip("torch")  # transformers' GGUF reader imports torch
    from transformers import AutoTokenizer

    from krnl.hf import load_tokenizer

    write_gguf(tmp_path / "m.gguf", arch=arch, tokenizer=kind, pre=pre)
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    tok = load_tokenizer(tmp_path / "m.gguf")
    for text in TEXTS:
        want = ref(text)["input_ids"]
        assert tok.encode(text) == want, text
        assert tok.decode(want) == ref.decode(want, skip_special_tokens=True), text
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the world"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nthe world<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_tokenizer_special_tokens_and_bos(tmp_path):
    from krnl.hf import load_tokenizer

    write_gguf(tmp_path / "spm.gguf")
    write_gguf(tmp_path / "bpe.gguf", arch="qwen2", tokenizer="bpe", pre="qwen2")
    spm, bpe = load_tokenizer(tmp_path / "spm.gguf"), load_tokenizer(tmp_path / "bpe.gguf")
    assert (spm.bos_id, spm.eos_id, spm.add_bos, spm.add_eos) == (1, 2, True, False)
    ids = spm.encode("<s>hello<think>")
    assert ids[0] == 1 and ids[1] == 1 and ids[-1] == spm.tk.token_to_id("<think>")  # whole, not in pieces
    assert spm.encode("hello") == [1, spm.tk.token_to_id("▁hello")]
    assert spm.encode("é", add_special_tokens=False) == [spm.tk.token_to_id("▁"), 3 + 0xC3, 3 + 0xA9]  # byte fallback
    end = bpe.tk.token_to_id("<|endoftext|>")
    assert (bpe.bos_id, bpe.eos_id, bpe.add_bos) == (end, end, False)
    assert bpe.encode(" the world") == [bpe.tk.token_to_id(t) for t in ("Ġthe", "Ġ", "world")]  # merges in rank order
    assert bpe.decode(bpe.encode("héllo 世界\n")) == "héllo 世界\n"
