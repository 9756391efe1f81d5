"""`krnl fuse --export-gguf` (krnl.formats.gguf.export with mix, meta, vocab and ollama) on the tiny
folders of tests/gguf_export_models.py, one per family krnl exports, each with a trained-looking
adapter:

- round trip through krnl's own GGUF reader: the merged weights (f16: to f16 rounding; q8_0 and
  q4_0: equal to the written blocks as krnl and gguf-py dequantize them), the configuration, the
  tokenizer and chat template; the metadata and tokenizer keys llama.cpp reads; tensor types as
  llama-quantize picks them; the CLI (one command, the Ollama Modelfile, the user's umask) and its
  one-line errors;
- with llama-cpp-python (marker `llama`): every type loads and runs; f16 and bf16 logits within
  their rounding of krnl's fused model, f16's greedy tokens krnl's; each quantized type's logit
  error against the f16 export no worse than 1.1x that of llama.cpp's own llama_model_quantize of
  that f16 file, with the same tensor types;
- with torch (marker `torch`): transformers' GGUF loader gives krnl's loss on the f16 and q8_0
  exports of the families it reads faithfully."""

import ctypes
import os

import numpy as np
import pytest

import krnl

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from gguf_export_models import FAMILIES, PROMPT, make_adapter, make_folder  # noqa: E402

from krnl.formats.gguf.export import _pieces, export_gguf, load_source  # noqa: E402
from krnl.formats.gguf.file import read_gguf, read_metadata, open_reader  # noqa: E402
from krnl.formats.gguf.mix import GGUF_TYPES, tensor_type, use_more_bits  # noqa: E402
from krnl.formats.gguf.names import EXPORT_ARCH, gguf_name, unpermute  # noqa: E402
from krnl.formats.hf import load_model, load_tokenizer, merged_weight  # noqa: E402
from krnl.quant import gguf as gguf_quants  # noqa: E402

TEXTS = [PROMPT, "hello world", "  spaces   and\ttabs\n\nnew lines", "<|im_start|>user\nhi<|im_end|>", "12345678",
         "<start_of_turn>model\nyes<end_of_turn>", "", "naïve café 😀"]
F16_U, BF16_U = 2.0 ** -11, 2.0 ** -8
_built = {}


def built(factory, family, **overrides):
    """(folder, adapter folder) of a family's tiny model, written once per session."""
    key = (id(factory), family, tuple(sorted(overrides.items())))
    if key not in _built:
        root = factory.mktemp(family)
        # not named "mistral" alone: transformers' GGUF loader then takes a path gguf-py 0.19 lacks
        folder = make_folder(root, family, name=f"{family}-base", **overrides)
        _built[key] = folder, make_adapter(folder, root / "adapter")
    return _built[key]


def exported(factory, family, kind, **overrides):
    """The family's GGUF export of --gguf-type `kind`, written once per session."""
    key = ("gguf", id(factory), family, kind, tuple(sorted(overrides.items())))
    if key not in _built:
        folder, ad = built(factory, family, **overrides)
        _built[key] = folder.parent / f"{family}-{kind}.gguf"
        export_gguf(folder, ad, _built[key], kind)
    return _built[key]


def merged(folder, ad):
    """{HF name: float32} of the base with the adapter merged, W + s B A, as fuse computes it."""
    config, weights, _, deltas, scale = load_source(folder, ad)
    return config, {k: merged_weight(w, *deltas[k], scale) if k in deltas else np.asarray(w, np.float32)
                    for k, w in weights.items()}


# ---- round trips through krnl's reader -------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_f16_round_trip_every_family(tmp_path_factory, family):
    folder, ad = built(tmp_path_factory, family)
    config, want = merged(folder, ad)
    g = read_gguf(exported(tmp_path_factory, family, "f16"))
    got = {k: np.asarray(v, np.float32) for k, v in g.weights.items()}
    assert set(got) == set(want)
    for k, w in want.items():
        if w.ndim >= 2 and not k.endswith((".mlp.gate.weight", "bias")):  # F16 in the file: rounded once
            np.testing.assert_array_equal(got[k], w.astype(np.float16).astype(np.float32), err_msg=k)
        else:  # F32 (norms, biases, routers); Gemma's norms went out as 1 + w, read back as (1 + w) - 1
            np.testing.assert_allclose(got[k], w, rtol=0, atol=2.0 ** -23 if config.gemma else 0.0, err_msg=k)
    c = g.config
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "tie_word_embeddings", "attention_bias", "layer_windows", "sliding_window"):
        assert getattr(c, field) == getattr(config, field), field
    assert c.model_type == {"mistral": "llama"}.get(config.model_type, config.model_type)
    assert c.intermediate_size == config.intermediate_size
    assert c.rope_theta == pytest.approx(config.rope_theta) and c.rms_norm_eps == pytest.approx(config.rms_norm_eps)
    np.testing.assert_allclose(c.inv_freq(), config.inv_freq(), rtol=1e-6)
    if config.gemma:
        assert c.gemma == pytest.approx(config.gemma)
    if config.moe:
        assert {k: v for k, v in c.moe.items() if k != "aux_coef"} == {k: v for k, v in config.moe.items()
                                                                        if k != "aux_coef"}
    tok, back = load_tokenizer(folder), load_tokenizer(g.path)
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text), text
    assert back.chat_template == tok.chat_template


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_round_trip_is_the_written_blocks(tmp_path_factory, family, kind):
    folder, ad = built(tmp_path_factory, family)
    config, want = merged(folder, ad)
    path = exported(tmp_path_factory, family, kind)
    g = read_gguf(path, quiet=True)
    raw = {t.name: t for t in open_reader(path).tensors}
    checked = 0
    arch = EXPORT_ARCH[config.model_type]
    for k, w in want.items():
        got = np.asarray(g.weights[k], np.float32)
        # the file's own blocks (a mixture's gate|up: its two halves), dequantized by gguf-py, in HF's
        # row order (the reader's un-permuting)
        pieces = [(raw[gguf_name(p, arch)], shape) for p, shape, _ in _pieces(k, w.shape)]
        kinds = {t.tensor_type.name for t, _ in pieces}
        if not kinds <= set(gguf_quants.LAYOUTS):
            assert kinds == {"F32"}, k  # norms, biases, routers
            continue
        assert kinds <= {"Q8_0", "Q4_0", "Q6_K"}, (k, kinds)
        ref = np.concatenate([gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
                              for t, shape in pieces], axis=-2)
        if arch == "llama" and (".q_proj." in k or ".k_proj." in k):
            ref = unpermute(ref, config.num_attention_heads if ".q_proj." in k else config.num_key_value_heads)
        np.testing.assert_array_equal(got, ref.astype(np.float32), err_msg=k)
        step = {"Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q6_K": 1 / 31}[pieces[0][0].tensor_type.name]
        assert np.sqrt(np.mean((got - w) ** 2)) <= step * np.abs(w).max(), k  # the weight it stands for
        checked += 1
    assert checked >= 4


def test_q4_k_m_round_trip_and_mix(tmp_path_factory):
    """The K-quant mix on a 4-layer Llama: Q6_K on the head and on attn_v / ffn_down of the layers
    llama.cpp picks (2 and 3 of 4), Q4_K elsewhere; the reader holds each exactly as written."""
    path = exported(tmp_path_factory, "llama", "q4_k_m")
    types = {t.name: t.tensor_type.name for t in open_reader(path).tensors}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    for i in range(4):
        more = "Q6_K" if i in (2, 3) else "Q4_K"
        assert (types[f"blk.{i}.attn_v.weight"], types[f"blk.{i}.ffn_down.weight"]) == (more, more)
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == "Q4_K"
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"
    g = read_gguf(path, quiet=True)
    assert {type(w).__name__ for k, w in g.weights.items() if "norm" not in k} == {"QuantizedArray"}


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
@pytest.mark.parametrize("base", ["gguf", "mlx"])
def test_export_from_quantized_bases(tmp_path_factory, tmp_path, family, base):
    """From a GGUF file (krnl's q8_0 export) or an MLX 4-bit folder (krnl quantize): the merged
    weights are those of the dequantized base, and the file's model computes krnl's."""
    from krnl.formats.hf import quantize_folder

    folder, ad = built(tmp_path_factory, family)
    if base == "gguf":
        src = exported(tmp_path_factory, family, "q8_0")
    else:
        src = tmp_path / "mlx"
        quantize_folder(folder, src, 4, 64)
    export_gguf(src, ad, tmp_path / "out.gguf", "f16")
    _, want = merged(src, ad)
    g = read_gguf(tmp_path / "out.gguf")
    for k, w in want.items():
        got = np.asarray(g.weights[k], np.float32)
        np.testing.assert_array_equal(got, w if k.endswith(".mlp.gate.weight") or w.ndim < 2 else
                                      w.astype(np.float16).astype(np.float32), err_msg=k)
    ids = load_tokenizer(folder).encode(PROMPT)
    a = np.asarray(load_model(src, krnl.device("cpu"), adapter=ad).logits([ids]))
    b = np.asarray(load_model(tmp_path / "out.gguf", krnl.device("cpu")).logits([ids]))
    assert np.abs(a - b).max() <= 16 * F16_U * np.abs(a).max()


# ---- metadata, tokenizer keys and types -------------------------------------------------------------


PRE = {"llama3": "llama3", "qwen2": "qwen2", "gpt-2": "gpt-2", "gpt-4o": "gpt-4o"}


@pytest.mark.parametrize("family", FAMILIES)
def test_metadata_and_tokenizer_keys(tmp_path_factory, family):
    folder, _ = built(tmp_path_factory, family)
    md = read_metadata(open_reader(exported(tmp_path_factory, family, "f16")))
    tok = load_tokenizer(folder)
    keys, (kind, arg), template, extra = FAMILIES[family]
    arch = md["general.architecture"]
    assert arch == {"mistral": "llama", "mixtral": "llama", "gemma3": "gemma3", "qwen3_moe": "qwen3moe",
                    "gpt_oss": "gpt-oss"}.get(family, family)
    assert md["general.file_type"] == 1 and md[f"{arch}.block_count"] == keys.get("num_hidden_layers", 2)
    assert md["general.name"] == f"{family}-base"  # the base folder's name, as llama.cpp's converter names a file
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    V = tok.vocab_size
    assert len(tokens) == len(types) == V + extra
    assert tokens[V:] == [f"[PAD{i}]" for i in range(V, V + extra)] and set(types[V:]) <= {5}
    vocab = tok.tk.get_vocab(with_added_tokens=True)
    assert all(tokens[i] == t for t, i in vocab.items() if types[i] != 4)
    assert types[vocab["<think>"]] == 4  # user-defined
    assert md["tokenizer.ggml.eos_token_id"] == tok.eos_id
    assert md["tokenizer.ggml.add_bos_token"] == tok.add_bos
    assert md["tokenizer.chat_template"] == template
    if kind == "bpe":
        assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == PRE[arg]
        assert md["tokenizer.ggml.merges"][0].count(" ") == 1 and "tokenizer.ggml.scores" not in md
        assert types[vocab["<|im_end|>"]] == 3
        assert tok.add_bos == (arg == "llama3")
    else:
        assert md["tokenizer.ggml.model"] == "llama" and md["tokenizer.ggml.pre"] == "default"
        assert md["tokenizer.ggml.add_space_prefix"] == arg
        assert types[:3] == [2, 3, 3] and set(types[3:259]) == {6} and tokens[3 + 10] == "<0x0A>"
        assert md["tokenizer.ggml.bos_token_id"] == 1 and md["tokenizer.ggml.unknown_token_id"] == 0
        scores = md["tokenizer.ggml.scores"]
        assert len(scores) == len(tokens) and scores[vocab["\u2581t"]] > scores[vocab["\u2581the"]]


def test_tensor_types_follow_llama_quantize():
    # llama.cpp's use_more_bits on 32 layers: the first and last 4, and every third between
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    t = lambda name, cols=4096, **kw: tensor_type(kw.pop("kind", "q4_k_m"), name, (64, cols), 32, **kw)
    assert t("output.weight") == "Q6_K" and t("token_embd.weight") == "Q4_K"
    assert t("token_embd.weight", tied=True) == "Q6_K" and t("output.weight", cols=4000) == "Q8_0"
    assert t("blk.6.attn_v.weight") == "Q6_K" and t("blk.7.attn_v.weight") == "Q4_K"
    assert t("blk.7.attn_v.weight", llama_70b=True) == "Q5_K" and t("blk.7.attn_qkv.weight") == "Q4_K"
    assert t("blk.9.ffn_down.weight") == "Q6_K" and t("blk.9.ffn_down_exps.weight") == "Q6_K"
    assert t("blk.9.ffn_up.weight") == "Q4_K"
    assert t("blk.7.attn_v.weight", n_experts=8) == t("blk.7.attn_k.weight", n_experts=8) == "Q8_0"
    assert t("blk.7.attn_output.weight", n_experts=8) == "Q5_K"
    assert t("blk.7.attn_output.weight", n_experts=8, kind="q5_k_m") == "Q5_K"
    assert t("blk.7.attn_q.weight", cols=4000) == "Q5_0"  # falls back as llama.cpp does
    assert t("blk.7.attn_q.weight", cols=4000, kind="q5_k_m") == "Q5_1"
    assert t("blk.9.ffn_down.weight", cols=4000) == "Q8_0"
    assert t("blk.0.ffn_down.weight", kind="q4_0") == "Q4_0" and t("output.weight", kind="q4_0") == "Q6_K"
    assert t("output.weight", kind="q8_0") == "Q8_0" and t("output.weight", kind="f16") == "F16"
    for name, shape in (("blk.0.attn_norm.weight", (64,)), ("blk.0.attn_q.bias", (64,)),
                        ("blk.0.ffn_gate_inp.weight", (4, 64)), ("blk.0.ffn_gate_exps.bias", (4, 64))):
        assert tensor_type("q4_k_m", name, shape, 32) == "F32"
    with pytest.raises(ValueError, match=r"--gguf-type q8_0: tensor blk\.0\.attn_q\.weight has 40 columns, not a "
                                         r"multiple of 32"):
        tensor_type("q8_0", "blk.0.attn_q.weight", (64, 40), 2)


# ---- the command line ----------------------------------------------------------------------------


def test_cli_exports_one_file_and_a_modelfile(tmp_path_factory, tmp_path, capsys):
    from krnl.cli.main import main

    folder, ad = built(tmp_path_factory, "qwen2")
    out = tmp_path / "out" / "model.gguf"
    old = os.umask(0o027)
    try:
        assert main(["fuse", "--model", str(folder), "--adapter-path", str(ad), "--export-gguf", str(out),
                     "--gguf-type", "q8_0", "--ollama"]) == 0
    finally:
        os.umask(old)
    said = capsys.readouterr().out
    assert f"into {out} (qwen2, q8_0: " in said and "Q8_0" in said and "Modelfile" in said
    assert os.stat(out).st_mode & 0o777 == 0o640
    assert sorted(p.name for p in out.parent.iterdir()) == ["Modelfile", "model.gguf"]
    text = (out.parent / "Modelfile").read_text()
    assert "FROM ./model.gguf\n" in text and 'TEMPLATE """{{- range .Messages }}<|im_start|>' in text
    assert 'PARAMETER stop "<|im_end|>"' in text and text.count("PARAMETER stop") == 1
    g = read_gguf(out, quiet=True)
    assert g.config.model_type == "qwen2" and set(g.types.values()) == {"Q8_0", "F32"}


def _one_line_error(capsys, argv, *needles):
    from krnl.cli.main import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and err, argv
    assert all(n in err[-1] for n in needles), err
    return err


def test_cli_errors_are_one_line(tmp_path_factory, tmp_path, capsys):
    folder, ad = built(tmp_path_factory, "qwen2")
    base = ["fuse", "--model", str(folder), "--adapter-path", str(ad)]
    out = str(tmp_path / "m.gguf")
    _one_line_error(capsys, base + ["--export-gguf", out, "--gguf-type", "q3_k"], "--gguf-type", "invalid choice")
    assert len(_one_line_error(capsys, base + ["--ollama"], "--ollama goes with --export-gguf")) == 1
    assert len(_one_line_error(capsys, base + ["--export-gguf", out, "--q-bits", "4"], "--gguf-type", "--q-bits")) == 1
    assert len(_one_line_error(capsys, base + ["--export-gguf", str(tmp_path)], "is a folder")) == 1
    narrow = make_folder(tmp_path, "mistral", name="narrow", hidden_size=80, head_dim=20, num_hidden_layers=1)
    assert len(_one_line_error(capsys, ["fuse", "--model", str(narrow), "--adapter-path", str(make_adapter(
        narrow, tmp_path / "ad2")), "--export-gguf", out, "--gguf-type", "q4_0"],
        "--gguf-type q4_0: tensor", "has 80 columns, not a multiple of 32")) == 1
    odd = make_folder(tmp_path, "gemma2", name="odd", query_pre_attn_scalar=50)
    assert len(_one_line_error(capsys, ["fuse", "--model", str(odd), "--adapter-path", str(make_adapter(
        odd, tmp_path / "ad3")), "--export-gguf", out], "query_pre_attn_scalar 50", "1/sqrt(64)")) == 1
    assert not os.path.exists(out) and not list(tmp_path.glob(".m.gguf.*"))  # nothing half-written


# ---- llama.cpp itself (llama-cpp-python) -----------------------------------------------------------


def _llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (.ci/run's stage 3 builds it "
                                                   "from its sdist): the llama.cpp checks skip")


def _run(path, ids, greedy=0, texts=(), add_bos=False):
    """(logits (T, V) of `ids`, their greedy continuation of `greedy` tokens, the ids of `texts`)
    from llama.cpp."""
    llm = _llama_cpp().Llama(str(path), n_ctx=128, n_batch=128, logits_all=True, verbose=False, n_threads=2)
    try:
        llm.eval(ids)
        logits = np.array(llm.scores[:len(ids)], np.float64)
        out = []
        for _ in range(greedy):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(out[-1:])
        return logits, out, [llm.tokenize(t.encode(), add_bos=add_bos, special=True) for t in texts]
    finally:
        llm.close()


_ref = {}


def _f16_reference(factory, family):
    """(prompt ids, krnl's fused logits, llama.cpp's logits of the f16 export)."""
    if family not in _ref:
        folder, ad = built(factory, family)
        ids = load_tokenizer(folder).encode(PROMPT)
        mine = np.asarray(load_model(folder, krnl.device("cpu"), adapter=ad).logits([ids]), np.float64)[0]
        _ref[family] = ids, mine, _run(exported(factory, family, "f16"), ids)[0]
    return _ref[family]


@pytest.mark.llama
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_runs_the_f16_export(tmp_path_factory, family):
    """Logits within f16 rounding of krnl's fused model (weights and llama.cpp's f16 activations and
    cache: 16 units of f16 rounding of the largest logit), greedy tokens equal, and llama.cpp's
    tokenizer gives krnl's ids."""
    folder, ad = built(tmp_path_factory, family)
    ids, mine, _ = _f16_reference(tmp_path_factory, family)
    tok = load_tokenizer(folder)
    texts = [PROMPT, "hello world", "12345678 naïve café 😀", "  spaces   and\ttabs\n\nnew lines"]
    if FAMILIES[family][1] == ("spm", True):
        # With the space prefix llama.cpp, as SentencePiece itself, puts "▁" before text that starts
        # with a space and before the text after an added token (llama-vocab.cpp); transformers'
        # Metaspace, and krnl, do neither: those texts differ by design
        texts = [PROMPT.replace(" <think>", "")] + texts[1:3]
    logits, greedy, theirs = _run(exported(tmp_path_factory, family, "f16"), ids, 8, texts, tok.add_bos)
    err = float(np.abs(logits - mine).max())
    assert err <= 16 * F16_U * float(np.abs(mine).max()), f"{family}: max logit error {err:.4g}"
    assert greedy == load_model(folder, krnl.device("cpu"), adapter=ad).generate(ids, max_new_tokens=8)
    assert theirs == [tok.encode(t) for t in texts]


@pytest.mark.llama
@pytest.mark.parametrize("kind", [k for k in GGUF_TYPES if k != "f16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_runs_every_type(tmp_path_factory, family, kind):
    """bf16: within bf16 rounding of krnl's fused model. Quantized types: the logit error against
    the f16 export at most 1.1x that of llama_model_quantize's file made from that f16 export, whose
    tensor types are the ones krnl chose."""
    llama_cpp = _llama_cpp()
    ids, mine, f16 = _f16_reference(tmp_path_factory, family)
    path = exported(tmp_path_factory, family, kind)
    logits = _run(path, ids)[0]
    if kind == "bf16":
        # within bf16 rounding (llama.cpp rounds the activations to bf16 too) of krnl on the same
        # bf16 weights, and of the fused model where no router's choice can flip between the two
        krnl_bf16 = np.asarray(load_model(path, krnl.device("cpu")).logits([ids]), np.float64)[0]
        assert float(np.abs(logits - krnl_bf16).max()) <= 16 * BF16_U * float(np.abs(krnl_bf16).max())
        if not load_model(path, krnl.device("cpu")).config.moe:
            assert float(np.abs(logits - mine).max()) <= 16 * BF16_U * float(np.abs(mine).max())
        return
    theirs = path.with_name(f"{family}-{kind}-llama-quantize.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = GGUF_TYPES[kind][1], 2
    f16_path = exported(tmp_path_factory, family, "f16")
    assert llama_cpp.llama_model_quantize(str(f16_path).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    rms = lambda a: float(np.sqrt(np.mean((a - f16) ** 2)))
    ours_err, their_err = rms(logits), rms(_run(theirs, ids)[0])
    assert ours_err <= 1.1 * their_err, f"{family} {kind}: error {ours_err:.4g} vs llama.cpp's {their_err:.4g}"
    tensors = lambda p: {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in open_reader(p).tensors}
    ours, want = tensors(path), tensors(theirs)
    assert {k: v[0] for k, v in ours.items()} == {k: v[0] for k, v in want.items()}  # llama-quantize's mix
    assert [k for k in ours if ours[k][1] != want[k][1]] == []  # and its bytes: the f16-rounded weights quantized


# ---- transformers' GGUF loader -------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["f16", "q8_0"])
@pytest.mark.parametrize("family, overrides", [("llama", {"rope_scaling": None}), ("mistral", {}), ("qwen2", {}),
                                               ("qwen3", {"head_dim": 128, "num_attention_heads": 2,
                                                                          "num_key_value_heads": 1}), ("phi3", {})])
def test_transformers_reads_the_export(tmp_path_factory, family, overrides, kind):
    """The families whose GGUF metadata transformers maps in full (its loader ignores llama3's
    rope_freqs, qwen3's key_length (its head_dim stays 128), the Gemmas' soft-capping and layer
    pattern, and reads no mixture but qwen3moe, without its expert width): its loss on the file is
    krnl's on the same file, and that is krnl's fused model's to the file's rounding."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")  # transformers loads GGUF files only with it
    from transformers import AutoModelForCausalLM

    folder, ad = built(tmp_path_factory, family, **overrides)
    path = exported(tmp_path_factory, family, kind, **overrides)
    model = load_model(path, krnl.device("cpu"))
    rng = np.random.default_rng(1)
    ids, tg = rng.integers(0, model.config.vocab_size, (2, 13)), rng.integers(0, model.config.vocab_size, (2, 13))
    tg[0, :3] = -100
    got = float(model.loss(ids, tg))
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        logits = ref(torch.tensor(ids)).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(tg).reshape(-1),
                                             ignore_index=-100)
    assert got == pytest.approx(float(want), rel=2e-5)
    fused = float(load_model(folder, krnl.device("cpu"), adapter=ad).loss(ids, tg))
    assert got == pytest.approx(fused, rel=2e-3 if kind == "f16" else 2e-2)
