"""GGUF files as base models (krnl.formats.gguf.file, gguf_quants, gguf_tokenizer): quantized blocks
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
         "<|im_start|>user\nhello<|im_end|>", "12345 1234", "", "<|endoftext|>the 123",
         "HeLLo World's DON'T 1234567\n\n\tx/y  \n", "helloWorld 1234"]


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

    from krnl.quant import gguf as gguf_quants
    from krnl.quant.qweight import QuantizedArray

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
    # Scales stored as f16 only where they are f16 values (the file's own d: Q8_0, Q4_0, Q4_1).
    assert sdt == ("f16" if kind in ("Q8_0", "Q4_0", "Q4_1") else "f32")
    if sdt == "f16":
        assert np.array_equal(s.astype(np.float16).astype(np.float32), s)


def test_gguf_row_permutation_is_ggml_rope_and_undone():
    """The file's q/k rows (tests/gguf_files.hf_rows) rotated as GGML does (adjacent pairs) give
    the same attention scores as HF's rows rotated as HF does (halves); read_gguf's unpermute
    restores HF's rows (quantized q/k rows: the model loss tests below)."""
    from krnl.formats.gguf.names import permute, unpermute

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


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False),
                                       ("qwen3", False)])
def test_gguf_model_loads_with_the_loss_of_its_dense_weights(tmp_path, arch, tied, capsys):
    from krnl.formats.gguf.file import read_gguf
    from krnl.formats.hf import load_model
    from krnl.models.model import LlamaModel
    from krnl.quant.qweight import QuantizedArray

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
    from krnl.formats.gguf.file import read_gguf

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
    lin = tmp_path / "linear.gguf"
    write_gguf(lin, metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.5})
    assert read_gguf(lin).config.rope_scaling == {"rope_type": "linear", "factor": 2.5}
    bad = tmp_path / "bad.gguf"
    write_gguf(bad, extra={"rope_freqs.weight": np.linspace(1, 3, D // 2).astype(np.float32)})
    with pytest.raises(ValueError, match=r"^\[gguf\] .*bad.gguf: its rope_freqs factors match no llama3"):
        read_gguf(bad)


# ---- tokenizers ------------------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("arch,kind,pre", [("llama", "spm", None), ("qwen2", "bpe", "qwen2"),
                                           ("llama", "bpe", "llama-bpe"), ("llama", "bpe", "tekken")])
def test_gguf_tokenizer_matches_transformers(tmp_path, arch, kind, pre):
    pytest.importorskip("torch")  # transformers' GGUF reader imports torch
    import transformers
    from transformers import AutoTokenizer

    # Older transformers built GGUF tokenizers otherwise (5.17, on the H200: no BOS for
    # SentencePiece, user-defined tokens split, llama3 digits unsplit); 5.24 builds them as
    # llama.cpp reads the file, and CI installs the newest.
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24):
        pytest.skip(f"transformers {transformers.__version__} builds GGUF tokenizers unlike llama.cpp; the "
                    "reference is 5.24 or newer")

    from krnl.formats.hf import load_tokenizer

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
    from krnl.formats.hf import load_tokenizer

    write_gguf(tmp_path / "spm.gguf")
    write_gguf(tmp_path / "bpe.gguf", arch="qwen2", tokenizer="bpe", pre="qwen2")
    spm, bpe = load_tokenizer(tmp_path / "spm.gguf"), load_tokenizer(tmp_path / "bpe.gguf")
    assert (spm.bos_id, spm.eos_id, spm.add_bos, spm.add_eos) == (1, 2, True, False)
    ids = spm.encode("<s>hello<think>")
    assert ids[0] == 1 and ids[1] == 1 and ids[-1] == spm.tk.token_to_id("<think>")  # whole, not in pieces
    assert spm.encode("hello") == [1, spm.tk.token_to_id("▁hello")]
    # "é" has no piece: byte fallback to <0xC3> <0xA9> (ids 3 + byte)
    assert spm.encode("é", add_special_tokens=False) == [spm.tk.token_to_id("▁"), 3 + 0xC3, 3 + 0xA9]
    end = bpe.tk.token_to_id("<|endoftext|>")
    assert (bpe.bos_id, bpe.eos_id, bpe.add_bos) == (end, end, False)
    assert bpe.encode(" the world") == [bpe.tk.token_to_id(t) for t in ("Ġthe", "Ġ", "world")]  # merges in rank order
    assert bpe.decode(bpe.encode("héllo 世界\n")) == "héllo 世界\n"


# ---- the CLI: train, generate, fuse ----------------------------------------------------------


def _data(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": "hello", "completion": " the world 123"}, {"prompt": "the world", "completion": " hello 12"}]
    for split in ("train", "valid"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_cli_trains_generates_and_fuses(tmp_path, capsys, arch):
    from krnl.cli.main import main
    from krnl.formats.hf import load_model, load_tokenizer
    from krnl.io.safetensors_io import read_safetensors_header
    from krnl.io.tokenizer import Tokenizer

    path = tmp_path / "m.gguf"
    write_gguf(path, arch=arch, types={k: v for k, v in mixed_types().items() if v in KEPT + ("F16",)},
               tokenizer="spm" if arch == "llama" else "bpe", pre="qwen2", tied=arch == "qwen2")
    ad, data = tmp_path / "ad", _data(tmp_path)
    train = ["train", "--model", str(path), "--data", str(data), "--adapter-path", str(ad), "--batch-size", "2",
             "--max-seq-length", "32", "--learning-rate", "0.01", "--steps-per-eval", "0", "--save-every", "1",
             "--quiet", "--device", "cpu", "--lora-rank", "2"]
    assert main(train + ["--iters", "3"]) == 0
    losses = [json.loads(x)["loss"] for x in (ad / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert json.loads((ad / "adapter_config.json").read_text())["base_model_name_or_path"] == str(path.resolve())
    assert (ad / "adapter_model.safetensors").is_file()
    # Resume: the checkpoint's fingerprint (base path, config) matches a second load of the file.
    assert main(train + ["--iters", "4", "--resume"]) == 0
    assert len((ad / "metrics.jsonl").read_text().splitlines()) == 4
    capsys.readouterr()
    assert main(["eval", "--adapter-path", str(ad), "--data", str(data), "--max-seq-length", "32",
                 "--device", "cpu"]) == 0
    assert "valid loss" in capsys.readouterr().out

    dev = krnl.device("cpu")
    model = load_model(path, dev, adapter=ad)
    tok = load_tokenizer(path)
    capsys.readouterr()
    assert main(["generate", "--adapter-path", str(ad), "--prompt", "hello", "--max-tokens", "3", "--raw-prompt",
                 "--device", "cpu"]) == 0
    want = model.generate(tok.encode("hello"), max_new_tokens=3, eos_id=tok.eos_id)
    assert capsys.readouterr().out.rstrip("\n") == "hello" + tok.decode(want)

    want_loss, ids, tg = _loss(model, model.config.vocab_size)
    assert abs(want_loss - float(load_model(path, dev).loss(ids, tg))) > 1e-6  # the adapter is trained
    for dtype, st in (("f32", "F32"), (None, "BF16")):
        out = tmp_path / f"fused-{dtype}"
        flag = ["--dtype", dtype] if dtype else []
        assert main(["fuse", "--adapter-path", str(ad), "--save-path", str(out)] + flag) == 0
        header, _ = read_safetensors_header(out / "model.safetensors")
        assert {v[0] for v in header.values()} == {st}
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["model_type"] == arch and cfg["torch_dtype"] == {"F32": "float32", "BF16": "bfloat16"}[st]
        fused = load_model(out, dev)
        got = float(fused.loss(ids, tg))
        assert abs(got - want_loss) <= (1e-4 if st == "F32" else 0.05) * max(1.0, want_loss), (st, got, want_loss)
        ftok = Tokenizer.from_folder(out)
        for text in TEXTS:
            assert ftok.encode(text) == tok.encode(text), text
        assert ftok.chat_template == tok.chat_template and ftok.eos_id == tok.eos_id
    # --q-bits: the fused model re-quantized as an MLX folder (8 bits: close to the fused loss)
    out = tmp_path / "fused-q8"
    assert main(["fuse", "--adapter-path", str(ad), "--save-path", str(out), "--q-bits", "8",
                 "--q-group-size", "32", "--dtype", "f32"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 8
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".krnl-fuse-")]  # the HF step is gone
    got = float(load_model(out, dev).loss(ids, tg))
    assert abs(got - want_loss) <= 0.02 * max(1.0, want_loss), (got, want_loss)


# ---- bad input -------------------------------------------------------------------------------


def test_gguf_bad_files_give_one_line_errors(tmp_path):
    from krnl.formats.gguf.file import read_gguf
    from krnl.formats.hf import load_model

    good = tmp_path / "good.gguf"
    write_gguf(good, types={"blk.0.attn_q.weight": "Q4_K"})
    data = good.read_bytes()
    cases = []
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:len(data) // 2])
    cases.append((short, r"short.gguf: not a readable GGUF file"))
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])
    cases.append((header_only, r"header.gguf: not a readable GGUF file"))
    arch = tmp_path / "gemma.gguf"
    write_gguf(arch, arch="gemma")
    cases.append((arch, r"gemma.gguf: architecture 'gemma' is not supported"))
    missing = tmp_path / "missing.gguf"
    write_gguf(missing, drop=("blk.1.ffn_up.weight", "output_norm.weight"))
    cases.append((missing, r"missing.gguf: missing tensors \['blk.1.ffn_up.weight', 'output_norm.weight'\]"))
    extra = tmp_path / "extra.gguf"
    write_gguf(extra, extra={"blk.0.attn_rel_b.weight": np.zeros(4, np.float32)})
    cases.append((extra, r"extra.gguf: unexpected tensors \['blk.0.attn_rel_b.weight'\]"))
    for p, msg in cases:
        with pytest.raises(ValueError, match=r"^\[gguf\] .*" + msg) as e:
            read_gguf(p)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^\[gguf\] .*nope.gguf: no such file"):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match=r"^\[hf\] .*is not a folder"):  # not GGUF: read as a folder
        load_model(tmp_path / "nope.gguf", krnl.device("cpu"))


# ---- against transformers' own GGUF loading --------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_gguf_loss_matches_transformers(tmp_path, arch, tied):
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")  # transformers loads GGUF files only with it
    from transformers import AutoModelForCausalLM

    from krnl.formats.hf import load_model

    # Only the types krnl keeps quantized (and floats): transformers keeps the others in f32.
    types = {k: v for k, v in mixed_types().items() if v in KEPT + ("F16", "F32")}
    write_gguf(tmp_path / "m.gguf", arch=arch, tied=tied, types=types,
               tokenizer="spm" if arch == "llama" else "bpe", pre="qwen2")
    model = load_model(tmp_path / "m.gguf", krnl.device("cpu"))
    got, ids, tg = _loss(model, model.config.vocab_size)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    with torch.no_grad():
        logits = ref(torch.tensor(ids)).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(tg).reshape(-1),
                                             ignore_index=-100)
    assert abs(got - float(want)) <= 2e-5 * max(1.0, abs(got)), (got, float(want))


@pytest.mark.torch
def test_gguf_fused_folder_loads_in_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from krnl.cli.main import main
    from krnl.formats.hf import load_model, load_tokenizer

    path = tmp_path / "m.gguf"
    write_gguf(path, arch="qwen2", tokenizer="bpe", pre="qwen2", types={"blk.0.attn_v.weight": "Q6_K",
                                                                        "output.weight": "Q4_K"})
    ad, out = tmp_path / "ad", tmp_path / "fused"
    assert main(["train", "--model", str(path), "--data", str(_data(tmp_path)), "--adapter-path", str(ad), "--iters",
                 "2", "--batch-size", "2", "--max-seq-length", "32", "--learning-rate", "0.02", "--steps-per-eval",
                 "0", "--quiet", "--device", "cpu", "--lora-rank", "2"]) == 0
    assert main(["fuse", "--adapter-path", str(ad), "--save-path", str(out), "--dtype", "f32"]) == 0
    model = load_model(path, krnl.device("cpu"), adapter=ad)
    want, ids, tg = _loss(model, model.config.vocab_size)
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = ref(torch.tensor(ids)).logits
    got = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(tg).reshape(-1),
                                            ignore_index=-100)
    assert abs(float(got) - want) <= 1e-4 * max(1.0, want)
    tok, htok = load_tokenizer(path), AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert htok(text)["input_ids"] == tok.encode(text), text


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("rows", [1, 33])
def test_gguf_pack_is_quant_pack(bits, rows):
    from krnl.quant import gguf as gguf_quants, affine

    codes = np.random.default_rng(bits).integers(0, 2 ** bits, (rows, 96))
    assert np.array_equal(gguf_quants._pack(codes, bits), affine.pack(codes, bits))


def test_gguf_quantize_on_load_only_for_float_files(tmp_path):
    from krnl.formats.gguf.file import read_gguf
    from krnl.formats.hf import load_model
    from krnl.models.model import LlamaModel

    dev = krnl.device("cpu")
    q, f = tmp_path / "q.gguf", tmp_path / "f.gguf"
    write_gguf(q, types={"blk.1.ffn_down.weight": "Q8_0"})
    dense = write_gguf(f, types={"blk.0.attn_v.weight": "F16"})
    with pytest.raises(ValueError, match=r"^\[hf\] .*q.gguf is quantized already \(8 bits, groups of 32\); leave out"):
        load_model(q, dev, quantize=(4, 64))
    config = read_gguf(f).config
    got, ids, tg = _loss(load_model(f, dev, quantize=(4, 64)), config.vocab_size)
    ref = LlamaModel(dev, config, dense, quantize=(4, 64))
    assert abs(got - float(ref.loss(ids, tg))) <= 1e-6 * max(1.0, got)
