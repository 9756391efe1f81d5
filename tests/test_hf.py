"""Real model folders and adapters against transformers and PEFT: tiny random Llama
(GQA, sharded) and Qwen2 (q/k/v biases) written by save_pretrained load in krnl with the same
logits and loss; PEFT adapters go both ways; mlx-lm adapters load; `krnl fuse` output loads in
transformers; bad inputs give clear errors.

Tolerances: f32 checkpoints are compared at max|diff| <= 1e-4 * max|logit| (f32 roundoff over a
couple of layers with different summation orders, ~1e-6 observed). A bf16 checkpoint widened to
f32 is exact, so krnl in f32 matches transformers in f32 on the same weights to the same f32
tolerance; krnl computing in bf16 rounds activations at every op (unit roundoff 2^-8 = 0.4%), so
its logits are held to 5% of the logit range.
"""

import json
import shutil
import struct

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import krnl  # noqa: E402
from krnl.formats import adapter as adapter_io  # noqa: E402
from krnl.formats import hf  # noqa: E402

# torch: the whole module needs torch (stage 2 of .ci/run selects it with -m torch).
pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::FutureWarning")]

V = 101
F32_RTOL = 1e-4


def _perturb(model, seed):
    """Weights of realistic size (the default init, std 0.02, makes near-zero logits)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5)
    return model


def _llama_config(**kw):
    base = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_theta=5000.0, max_position_embeddings=64, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _word_tokenizer(path):
    """A word-level tokenizer.json of V tokens: "</s>", "w1" .. "w100"."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"</s>": 0, **{f"w{i}": i for i in range(1, V)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="</s>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tk.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tk.save(str(path))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {}
    m = _perturb(transformers.LlamaForCausalLM(_llama_config()), 1).eval()
    m.save_pretrained(root / "llama", max_shard_size="40KB")  # forces shards + index
    (root / "llama" / "special_tokens_map.json").write_text('{"eos_token": "</s>"}\n')
    _word_tokenizer(root / "llama" / "tokenizer.json")
    out["llama"] = root / "llama"
    m.to(torch.bfloat16).save_pretrained(root / "llama_bf16")
    out["llama_bf16"] = root / "llama_bf16"
    q = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False))
    _perturb(q, 2).save_pretrained(root / "qwen2")
    out["qwen2"] = root / "qwen2"
    t = transformers.LlamaForCausalLM(_llama_config(tie_word_embeddings=True, num_key_value_heads=4))
    _perturb(t, 3).save_pretrained(root / "llama_tied")
    out["llama_tied"] = root / "llama_tied"
    return out


def _hf_model(folder, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype,
                                                             attn_implementation="eager").eval()


def _batch(seed=0, B=2, T=11):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (B, T))
    labels = ids.copy()
    labels[0, :3] = -100  # masked prompt tokens
    targets = np.concatenate([labels[:, 1:], np.full((B, 1), -100)], axis=1)  # krnl: target of position t
    return ids, labels, targets


def _torch_logits_loss(model, ids, labels=None):
    with torch.no_grad():
        out = model(torch.tensor(ids), labels=None if labels is None else torch.tensor(labels))
    return out.logits.float().numpy(), (None if labels is None else float(out.loss))


def _maxdiff(a, b):
    return float(np.abs(a - b).max()), float(np.abs(b).max())


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama_tied"])
def test_logits_and_loss_match_transformers(folders, name):
    folder = folders[name]
    if name == "llama":
        assert (folder / hf.INDEX_NAME).exists() and len(hf.safetensors_files(folder)) > 1
    if name == "llama_tied":
        assert "lm_head.weight" not in hf.read_tensors(folder)
    model = hf.load_model(folder, krnl.device("cpu"))
    if name == "qwen2":
        assert model.config.attention_bias
    ids, labels, targets = _batch()
    ref, ref_loss = _torch_logits_loss(_hf_model(folder), ids, labels)
    got = model.logits(ids)
    d, scale = _maxdiff(got, ref)
    assert d <= F32_RTOL * scale, (name, d, scale)
    assert abs(model.loss(ids, targets) - ref_loss) <= 1e-5 * max(1.0, ref_loss)


def test_bf16_checkpoint(folders):
    folder = folders["llama_bf16"]
    assert {t.st_dtype for t in hf.read_tensors(folder).values()} == {"BF16"}
    ids, labels, targets = _batch(1)
    ref, ref_loss = _torch_logits_loss(_hf_model(folder, torch.float32), ids, labels)  # exact widening
    m32 = hf.load_model(folder, krnl.device("cpu"), dtype="f32")
    d, scale = _maxdiff(m32.logits(ids), ref)
    assert d <= F32_RTOL * scale
    assert abs(m32.loss(ids, targets) - ref_loss) <= 1e-5 * max(1.0, ref_loss)
    mb = hf.load_model(folder, krnl.device("cpu"), dtype="bf16")
    d, scale = _maxdiff(mb.logits(ids), ref)
    assert d <= 0.05 * scale, (d, scale)
    assert abs(mb.loss(ids, targets) - ref_loss) <= 0.02 * ref_loss


def test_bf16_conversion_roundtrip():
    x = np.array([0.0, -0.0, 1.0, -2.5, 3.1415927, 1e-30, 65504.0, np.inf, -np.inf], np.float32)
    u = hf.f32_to_bf16(x)
    ref = torch.tensor(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(u, ref)
    assert np.isnan(hf.bf16_to_f32(hf.f32_to_bf16(np.array([np.nan], np.float32)))).all()
    assert np.array_equal(hf.bf16_to_f32(u), torch.tensor(x).to(torch.bfloat16).float().numpy())


# ---------------------------------------------------------------------------------------------
# PEFT interop




def _peft():
    return pytest.importorskip("peft")


def _peft_logits(base_folder, adapter_folder, ids):
    p = _peft()
    m = p.PeftModel.from_pretrained(_hf_model(base_folder), str(adapter_folder)).eval()
    return _torch_logits_loss(m, ids)[0]


def test_krnl_trained_adapter_loads_in_peft(folders, tmp_path):
    from krnl.models.config import LoraConfig
    from krnl.train.trainer import TrainConfig, Trainer

    folder = folders["qwen2"]
    lora = LoraConfig(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"), use_rslora=True)
    model = hf.load_model(folder, krnl.device("cpu"), lora=lora)
    rng = np.random.default_rng(5)
    data = rng.integers(0, V, (16, 12))
    train = (data, np.concatenate([data[:, 1:], np.full((16, 1), -100)], axis=1))
    cfg = TrainConfig(iters=4, batch_size=4, learning_rate=5e-2, warmup=0, val_every=0, save_every=0)
    Trainer(model, cfg, train, None, out_dir=tmp_path / "ad", base_model=str(folder), progress=False).run()
    assert np.abs(model.lora_state()[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]).max() > 0  # trained
    ids = _batch(2)[0]
    ref = _peft_logits(folder, tmp_path / "ad", ids)
    d, scale = _maxdiff(model.logits(ids), ref)
    assert d <= F32_RTOL * scale
    base_ref = _torch_logits_loss(_hf_model(folder), ids)[0]
    assert np.abs(ref - base_ref).max() > 100 * d  # the adapter matters


def _peft_adapter(folder, out, seed, **kw):
    """A PEFT-initialised adapter with random B (PEFT starts B at 0), saved as safetensors."""
    p = _peft()
    torch.manual_seed(seed)
    m = p.get_peft_model(_hf_model(folder), p.LoraConfig(task_type="CAUSAL_LM", **kw))
    with torch.no_grad():
        for n, prm in m.named_parameters():
            if "lora_B" in n:
                prm.copy_(0.3 * torch.randn(prm.shape))
    m.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("name,kw", [
    ("llama", dict(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                         "down_proj"])),
    ("qwen2", dict(r=2, lora_alpha=3, target_modules=["k_proj", "up_proj"], layers_to_transform=[1],
                   use_rslora=True)),
])
def test_peft_adapter_loads_in_krnl(folders, tmp_path, name, kw):
    folder = folders[name]
    ad = _peft_adapter(folder, tmp_path / "peft", 7, **kw)
    lora, tensors, info = adapter_io.read_adapter(ad, hf.read_config(folder))
    assert info["format"] == "peft" and lora.r == kw["r"] and lora.use_rslora == kw.get("use_rslora", False)
    model = hf.load_model(folder, krnl.device("cpu"), adapter=ad)
    ids = _batch(3)[0]
    ref = _peft_logits(folder, ad, ids)
    d, scale = _maxdiff(model.logits(ids), ref)
    assert d <= F32_RTOL * scale


def test_mlx_adapter_and_fuse(folders, tmp_path):
    """The mlx-lm layout (lora_a (in, r), lora_b (r, out), scale stored) gives PEFT's result; krnl
    fuse output (sharded) loads in transformers and matches krnl with the adapter."""
    folder = folders["llama"]
    ad = _peft_adapter(folder, tmp_path / "peft", 8, r=4, lora_alpha=12,
                       target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    ids = _batch(4)[0]
    ref = _peft_logits(folder, ad, ids)

    # Same adapter in mlx-lm's layout.
    from safetensors.numpy import load_file, save_file
    peft_t = load_file(str(ad / adapter_io.WEIGHTS_NAME))
    mlx = {}
    for k, v in peft_t.items():
        stem = k.replace("base_model.model.", "").replace(".weight", "")
        mlx[stem.replace("lora_A", "lora_a").replace("lora_B", "lora_b")] = np.ascontiguousarray(v.T)
    mdir = tmp_path / "mlx"
    mdir.mkdir()
    save_file(mlx, str(mdir / "adapters.safetensors"))
    (mdir / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": 2, "model": str(folder),
        "lora_parameters": {"rank": 4, "scale": 3.0, "dropout": 0.0}}))
    mm = hf.load_model(folder, krnl.device("cpu"), adapter=mdir)
    got = mm.logits(ids)
    d, scale = _maxdiff(got, ref)
    assert d <= F32_RTOL * scale

    # krnl fuse through the CLI, sharded, then transformers loads the folder.
    from krnl.cli.main import main
    out = tmp_path / "fused"
    assert main(["fuse", "--model", str(folder), "--adapter-path", str(mdir), "--save-path", str(out),
                 "--max-shard-size", "60KB"]) == 0
    assert (out / hf.INDEX_NAME).exists() and (out / "special_tokens_map.json").exists()
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    fused_ref = _torch_logits_loss(_hf_model(out), ids)[0]
    d, scale = _maxdiff(fused_ref, got)
    assert d <= F32_RTOL * scale

    # bf16 checkpoint: the fused folder stays bf16 and matches krnl (f32 math) within bf16 rounding
    # of the merged weights.
    bf = hf.fuse(folders["llama_bf16"], ad, tmp_path / "fused_bf16")
    assert bf["files"] == ["model.safetensors"]
    assert {t.st_dtype for t in hf.read_tensors(tmp_path / "fused_bf16").values()} == {"BF16"}
    kb = hf.load_model(folders["llama_bf16"], krnl.device("cpu"), adapter=ad).logits(ids)
    fb = _torch_logits_loss(_hf_model(tmp_path / "fused_bf16", torch.float32), ids)[0]
    d, scale = _maxdiff(fb, kb)
    assert d <= 0.05 * scale, (d, scale)


def test_cli_generate_and_eval_with_model_folder(folders, tmp_path, capsys):
    from krnl.cli.main import main

    ad = _peft_adapter(folders["llama"], tmp_path / "peft", 9, r=2, lora_alpha=4, target_modules=["q_proj"])
    # base_model_name_or_path is the folder: --model may be left out; eval needs --data.
    # f32: the reference below decodes greedily in f32 (the CLI's default is the device's compute dtype)
    assert main(["generate", "--adapter-path", str(ad), "--prompt", "w5 w7 w9", "--max-tokens", "4", "--dtype", "f32"]) == 0
    text = capsys.readouterr().out.strip()
    want = hf.load_model(folders["llama"], krnl.device("cpu"), adapter=ad).generate([5, 7, 9], max_new_tokens=4,
                                                                                    eos_id=0)
    words = [f"w{i}" for i in (want[:want.index(0)] if 0 in want else want)]
    assert words and text == "w5 w7 w9" + " ".join(words)  # the CLI prints prompt + decoded text
    assert main(["eval", "--adapter-path", str(ad)]) == 1
    assert "--data" in capsys.readouterr().err
    assert main(["fuse", "--adapter-path", str(ad), "--save-path", str(tmp_path / "fused")]) == 0
    assert "fused 2 weights (scale 2)" in capsys.readouterr().out
    cfg = json.loads((ad / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "org/not-here"
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    assert main(["generate", "--adapter-path", str(ad)]) == 1
    assert "--model" in capsys.readouterr().err
    assert main(["train", "--model", str(folders["llama"]), "--iters", "1"]) == 1
    assert "--data is required with --model" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Bad inputs


def _copy_without(src, dst, drop=(), add=None):
    """dst: src's config plus one model.safetensors without `drop` and with `add` tensors."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    from safetensors.numpy import save_file
    w = {k: np.asarray(t, np.float32) for k, t in hf.read_tensors(src).items() if k not in drop}
    w.update(add or {})
    save_file(w, str(dst / "model.safetensors"))
    return dst


def test_missing_and_unexpected_tensors(folders, tmp_path):
    src = folders["qwen2"]
    bad = _copy_without(src, tmp_path / "missing", drop=("model.layers.1.self_attn.k_proj.bias",))
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.self_attn.k_proj.bias'\]") as e:
        hf.load_model(bad, krnl.device("cpu"))
    assert "model.safetensors" in str(e.value)
    bad = _copy_without(src, tmp_path / "extra", add={"model.layers.0.mlp.extra.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.0.mlp.extra.weight'\]"):
        hf.load_model(bad, krnl.device("cpu"))
    bad = _copy_without(src, tmp_path / "shape", add={"model.norm.weight": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match=r"wrong shapes \['model.norm.weight: \(3,\) \(expected \(64,\)\)'\]"):
        hf.load_model(bad, krnl.device("cpu"))
    trunc = tmp_path / "trunc"
    shutil.copytree(src, trunc)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        hf.load_model(trunc, krnl.device("cpu"))
    nofile = tmp_path / "pickle_model"
    nofile.mkdir()
    shutil.copy(src / "config.json", nofile / "config.json")
    (nofile / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="pickle"):
        hf.load_model(nofile, krnl.device("cpu"))


def test_bad_adapters(folders, tmp_path):
    config = hf.read_config(folders["llama"])
    pk = tmp_path / "pickle"
    pk.mkdir()
    (pk / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    (pk / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="pickle file; krnl reads only safetensors"):
        adapter_io.read_adapter(pk, config)
    from safetensors.numpy import save_file
    ws = tmp_path / "shape"
    ws.mkdir()
    (ws / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file({key.format("A"): np.zeros((2, 64), np.float32), key.format("B"): np.zeros((32, 2), np.float32)},
              str(ws / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"q_proj.lora_B.weight: \(32, 2\) \(expected \(64, 2\) for r=2\)"):
        adapter_io.read_adapter(ws, config)
    save_file({key.format("A"): np.zeros((2, 64), np.float32)}, str(ws / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="only lora_A"):
        adapter_io.read_adapter(ws, config)
    save_file({key.format("A").replace("layers.0", "layers.5"): np.zeros((2, 64), np.float32),
               "base_model.model.lm_head.lora_A.weight": np.zeros((2, 64), np.float32)},
              str(ws / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"cannot map .*lm_head.lora_A.weight"):
        adapter_io.read_adapter(ws, config)
    (ws / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                        "use_dora": True}))
    save_file({key.format("A"): np.zeros((2, 64), np.float32), key.format("B"): np.zeros((64, 2), np.float32)},
              str(ws / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="q_proj: only lora_A, lora_B$"):
        adapter_io.read_adapter(ws, config)
    with pytest.raises(ValueError, match="neither adapter_model.safetensors"):
        adapter_io.read_adapter(tmp_path, config)


def test_safetensors_writer_reads_back(tmp_path):
    """write_sharded's files are valid safetensors (read by the safetensors library too)."""
    from safetensors.numpy import load_file
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal((7,)).astype(np.float32)
    items = [("a", "F32", a.shape, lambda: a.tobytes()), ("b", "F16", b.shape, lambda: b.astype(np.float16).tobytes()),
             ("c", "BF16", b.shape, lambda: hf.f32_to_bf16(b).tobytes())]
    names = hf.write_sharded(tmp_path, items, shard_size=64)
    assert len(names) == 2 and (tmp_path / hf.INDEX_NAME).exists()
    t = hf.read_tensors(tmp_path)
    assert np.array_equal(np.asarray(t["a"]), a) and np.array_equal(np.asarray(t["b"]), b.astype(np.float16))
    assert np.abs(np.asarray(t["c"]) - b).max() <= 2**-8 * np.abs(b).max()
    assert set(load_file(str(tmp_path / names[0]))) == {"a"}
    with open(tmp_path / names[0], "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    assert n % 8 == 0
    hf.write_sharded(tmp_path, items[:1], shard_size=64)  # rewriting as one file drops the shards
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_peft_key_variants_and_load_into(folders, tmp_path):
    """Keys with the adapter name (`.lora_A.default.weight`) or without the `base_model.model.`
    prefix read the same; load_adapter_into checks the model's LoRA layout."""
    from safetensors.numpy import save_file

    from krnl.models.config import LoraConfig, lora_key
    config = hf.read_config(folders["llama"])
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((2, 64)).astype(np.float32), rng.standard_normal((64, 2)).astype(np.float32)
    got = []
    for fmt in ("base_model.model.model.layers.1.self_attn.o_proj.lora_{}.default.weight",
                "model.layers.1.self_attn.o_proj.lora_{}.weight"):
        d = tmp_path / str(len(got))
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
        save_file({fmt.format("A"): A, fmt.format("B"): B}, str(d / "adapter_model.safetensors"))
        lora, t, _ = adapter_io.read_adapter(d, config)
        assert lora.layers == [1] and lora.target_modules == ("o_proj",) and lora.scale == 1.0
        assert np.array_equal(t[lora_key(1, "o_proj", "A")], A) and np.array_equal(t[lora_key(1, "o_proj", "B")], B)
        got.append(d)
    m = hf.load_model(folders["llama"], krnl.device("cpu"), lora=LoraConfig(r=2, alpha=2, target_modules=("o_proj",),
                                                                         layers=[1]))
    adapter_io.load_adapter_into(m, got[0])
    assert np.array_equal(m.lora_state()[lora_key(1, "o_proj", "B")], B)
    m2 = hf.load_model(folders["llama"], krnl.device("cpu"), lora=LoraConfig(r=2, alpha=4, target_modules=("o_proj",)))
    with pytest.raises(ValueError, match="differ from the model's LoRA"):
        adapter_io.load_adapter_into(m2, got[0])


def test_cli_trains_an_hf_model_from_a_yaml_config(folders, tmp_path, capsys):
    from krnl.cli.main import main

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": "w1 w2 w3", "completion": "w7 w8 w9 w10"}, {"prompt": "w4 w5", "completion": "w11 w12 w13"}]
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ad"
    cfg = tmp_path / "lora.yaml"
    cfg.write_text(f"model: {folders['llama']}\ndata: {data}\nadapter_path: {out}\niters: 12\nbatch_size: 2\n"
                   f"learning_rate: 0.01\nwarmup: 0\nmax_seq_length: 32\nquiet: true\n"
                   f"lora_parameters:\n  rank: 4\n  scale: 2.0\n  dropout: 0.0\n")
    assert main(["train", "--config", str(cfg), "--steps-per-eval", "0"]) == 0
    ac = json.loads((out / "adapter_config.json").read_text())
    assert ac["r"] == 4 and ac["lora_alpha"] == 8.0  # mlx-lm's scale is alpha / r
    assert ac["base_model_name_or_path"] == str(folders["llama"].resolve())
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 12 and losses[-1] < 0.5 * losses[0]  # one fixed batch is fitted
    capsys.readouterr()
    assert main(["eval", "--adapter-path", str(out), "--data", str(data), "--max-seq-length", "32"]) == 0
    assert "test loss" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("iterz: 3\n")
    with pytest.raises(SystemExit, match="unknown option 'iterz'"):
        main(["train", "--config", str(bad)])


def test_cli_generate_wraps_the_prompt_in_the_chat_template(folders, tmp_path, capsys):
    from krnl.cli.main import main

    base = tmp_path / "chat"
    shutil.copytree(folders["llama"], base)
    # A template whose rendering is plain words of this tokenizer: "w1 <content> w2" (+ "w3" to prompt).
    tpl = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
    (base / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl, "eos_token": "</s>"}))
    ad = _peft_adapter(base, tmp_path / "peft", 4, r=2, lora_alpha=4, target_modules=["v_proj"])
    model = hf.load_model(base, krnl.device("cpu"), adapter=ad)
    for flag, prompt_ids in (([], [1, 5, 7, 2, 3]), (["--raw-prompt"], [5, 7])):
        capsys.readouterr()
        assert main(["generate", "--adapter-path", str(ad), "--prompt", "w5 w7", "--max-tokens", "3"] + flag) == 0
        want = model.generate(prompt_ids, max_new_tokens=3, eos_id=0)
        words = " ".join(f"w{i}" for i in (want[:want.index(0)] if 0 in want else want))
        assert capsys.readouterr().out.strip() == "w5 w7" + words
