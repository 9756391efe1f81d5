"""MLX quantized folders without MLX (krnl.formats.mlx_folder, hf.load_hf_weights, krnl quantize, fuse
--q-bits, --adapter-format mlx): folders written here with numpy in MLX's layout (packed U32
codes, scales and biases, the quantization entry of config.json), read back exactly; the errors;
the layout `krnl quantize` writes; training, fusing and the mlx-lm adapter layout through the CLI.
tests/test_mlx_models.py checks the same files against mlx-lm itself."""

import json
from pathlib import Path

import numpy as np
import pytest

import krnl
from krnl.quant import affine
from krnl.cli.main import main
from krnl.formats.hf import fuse, load_hf_weights, load_model, read_tensors, write_sharded
from krnl.models.model import LlamaModel
from krnl.models.config import LoraConfig, ModelConfig, lora_key
from krnl.quant.qweight import QuantizedArray
from krnl.io.safetensors_io import LazyTensor, read_safetensors_header

from mlx_folders import (V, base_config, make_base, mixed_layouts, random_adapter, round_bf16, write_data,
                         write_mlx_folder)


def test_lazy_tensor_reads_u32_and_i32_as_integers(tmp_path):
    u, i = np.array([[0, 1, 0xFFFFFFFF], [0x80000000, 7, 9]], np.uint32), np.array([-1, 2, -(2 ** 31), 5], np.int32)
    write_sharded(tmp_path, [("u", "U32", u.shape, u.tobytes), ("i", "I32", i.shape, i.tobytes)])
    header, _ = read_safetensors_header(tmp_path / "model.safetensors")
    t = {k: LazyTensor(str(tmp_path / "model.safetensors"), k, *v) for k, v in header.items()}
    assert t["u"].st_dtype == "U32" and t["i"].st_dtype == "I32"
    got_u, got_i = np.asarray(t["u"]), np.asarray(t["i"])
    assert got_u.dtype == np.uint32 and np.array_equal(got_u, u)
    assert got_i.dtype == np.int32 and np.array_equal(got_i, i)


def test_read_mlx_folder_mixed_layouts(tmp_path):
    lay = mixed_layouts()
    over = {m: {"group_size": gs, "bits": b, "mode": "affine"} for m, (b, gs) in lay.items() if (b, gs) != (4, 64)}
    expect = write_mlx_folder(tmp_path / "m", lay, quantization={"group_size": 64, "bits": 4, "mode": "affine",
                                                                   **over})
    w = load_hf_weights(tmp_path / "m")
    assert set(w) == set(ModelConfig.from_dict(base_config()).weight_shapes())
    for name, want in expect.items():
        m, a = name[:-len(".weight")], w[name]
        assert tuple(a.shape) == want.shape, name
        if m in lay:
            assert isinstance(a, QuantizedArray) and (a.bits, a.group_size) == lay[m], name
            assert a.scale_dtype == "bf16"
        else:
            assert isinstance(a, LazyTensor), name
        np.testing.assert_allclose(np.asarray(a, np.float32), want, rtol=1e-6, atol=1e-7, err_msg=name)


def test_read_mlx_folder_infers_layout_and_keeps_float_modules(tmp_path):
    # No overrides in the config (as mlx-lm writes a uniform model): layouts come from the shapes;
    # a module without scales (mlx-lm leaves ones whose input size the group does not divide) and
    # one the config marks false stay float; F16 scales give scale_dtype f16.
    lay = {"model.layers.0.mlp.down_proj": (8, 128), "model.layers.1.self_attn.k_proj": (2, 32)}
    q = {"group_size": 64, "bits": 4, "mode": "affine", "model.layers.0.self_attn.q_proj": False}
    expect = write_mlx_folder(tmp_path / "m", lay, scale_st="F16", quantization=q)
    w = load_hf_weights(tmp_path / "m")
    for name, want in expect.items():
        a = w[name]
        if name[:-len(".weight")] in lay:
            assert (a.bits, a.group_size, a.scale_dtype) == (*lay[name[:-len(".weight")]], "f16")
        else:
            assert not isinstance(a, QuantizedArray)
        np.testing.assert_allclose(np.asarray(a, np.float32), want, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("q, match", [
    ({"group_size": 16, "bits": 4, "mode": "nvfp4"}, r"quantization mode 'nvfp4' is not supported"),
    ({"group_size": 64, "bits": 4, "model.layers.0.mlp.up_proj": {"group_size": 32, "bits": 8, "mode": "mxfp8"}},
     r"\(model\.layers\.0\.mlp\.up_proj\): quantization mode 'mxfp8'"),
    ({"group_size": 64, "bits": 4, "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 4}},
     r"model\.layers\.0\.mlp\.down_proj: stored at 8 bits in groups of 128, the config says 4 bits"),
    ({"group_size": 64, "bits": 4, "model.layers.0.mlp.down_proj": False},
     r"model\.layers\.0\.mlp\.down_proj: the config says not quantized but .*down_proj\.scales is stored"),
    ({"group_size": 64, "bits": 4, "model.layers.1.mlp.up_proj": {"group_size": 64, "bits": 4}},
     r"model\.layers\.1\.mlp\.up_proj: the config quantizes it \(4 bits\) but .* has no .*up_proj\.scales"),
])
def test_read_mlx_folder_config_errors(tmp_path, q, match):
    write_mlx_folder(tmp_path / "m", {"model.layers.0.mlp.down_proj": (8, 128)}, quantization=q)
    with pytest.raises(ValueError, match=match) as e:
        load_hf_weights(tmp_path / "m")
    assert "\n" not in str(e.value) and str(e.value).startswith("[hf]")


def test_read_mlx_folder_tensor_errors(tmp_path):
    write_mlx_folder(tmp_path / "m", {"model.layers.0.mlp.down_proj": (8, 128), "lm_head": (4, 64)})
    # Codes of the wrong width, missing biases: both named, with the file.
    f = tmp_path / "m" / "model.safetensors"
    t = read_tensors(tmp_path / "m")
    items = []
    for name, lt in t.items():
        if name == "lm_head.biases":
            continue
        if name == "model.layers.0.mlp.down_proj.weight":
            items.append((name, "U32", (64, 23), lambda: np.zeros((64, 23), np.uint32).tobytes()))
        else:
            items.append((name, lt.st_dtype, lt.shape, (lambda b: lambda: b)(lt.raw_bytes())))
    write_sharded(tmp_path / "m", items)
    with pytest.raises(ValueError) as e:
        load_hf_weights(tmp_path / "m")
    msg = str(e.value)
    assert "\n" not in msg and str(f) in msg
    assert "model.layers.0.mlp.down_proj.weight" in msg and "(64, 23)" in msg
    assert "lm_head.biases: missing" in msg
    # Another quantizer's config: one line naming it.
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    del cfg["quantization"]
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quant_method 'gptq'\) is not MLX's quantization"):
        load_hf_weights(tmp_path / "m")


def test_model_on_mlx_folder_matches_dense_dequantized(tmp_path):
    # The model holds the projections and the head quantized (quantized_matmul, a RowStack where
    # q, k and v differ); the same weights dequantized and held dense (gemm) give the same loss.
    write_mlx_folder(tmp_path / "m", mixed_layouts())
    dev = krnl.device("cpu")
    m = load_model(tmp_path / "m", dev, dtype="f32")
    assert m.head.__class__.__name__ == "QuantizedWeight"
    dense = {k: np.asarray(v, np.float32) for k, v in load_hf_weights(tmp_path / "m").items()}
    ref = LlamaModel(dev, m.config, dense, dtype="f32")
    ids = np.random.default_rng(1).integers(0, V, (2, 11))
    a, b = m.loss(ids[:, :-1], ids[:, 1:]), ref.loss(ids[:, :-1], ids[:, 1:])
    assert np.isfinite(a) and a == pytest.approx(b, rel=1e-5)
    with pytest.raises(ValueError, match=r"is quantized already \(4 bits, groups of 64\); leave out --q-bits"):
        load_model(tmp_path / "m", dev, quantize=(4, 64))


def header_of(folder):  # {name: (dtype, shape)}, metadata
    h, meta = read_safetensors_header(Path(folder) / "model.safetensors")
    return {k: v[:2] for k, v in h.items()}, meta


def test_quantize_command_writes_mlx_layout(tmp_path, capsys):
    base = make_base(tmp_path / "base")
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(base), "--save-path", str(out), "--q-bits", "5", "--q-group-size", "128",
                 "--dtype", "bf16"]) == 0
    assert "quantized" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    cfg = json.loads((out / "config.json").read_text())
    q = {"group_size": 128, "bits": 5, "mode": "affine"}
    assert cfg["quantization"] == q and cfg["quantization_config"] == q
    h, meta = header_of(out)
    assert meta["format"] == "mlx"
    # Group size 128: only down_proj (input 128) divides; the rest (input 64) stays bf16.
    for i in range(2):
        p = f"model.layers.{i}."
        assert h[p + "mlp.down_proj.weight"] == ("U32", (64, 128 * 5 // 32))
        assert h[p + "mlp.down_proj.scales"] == h[p + "mlp.down_proj.biases"] == ("BF16", (64, 1))
        assert h[p + "self_attn.q_proj.weight"] == ("BF16", (64, 64)) and p + "self_attn.q_proj.scales" not in h
    assert h["model.embed_tokens.weight"] == ("BF16", (V, 64)) and h["model.norm.weight"] == ("BF16", (64,))
    # The codes, scales and biases are krnl.quant.affine's of the weight cast to bf16.
    W = np.asarray(load_hf_weights(base)["model.layers.1.mlp.down_proj.weight"], np.float32)
    w, s, b = affine.quantize(round_bf16(W), 5, 128)
    qa = load_hf_weights(out)["model.layers.1.mlp.down_proj.weight"]
    assert np.array_equal(np.asarray(qa.w).view(np.int32), w)
    assert np.array_equal(np.asarray(qa.scales, np.float32), round_bf16(s))
    assert np.array_equal(np.asarray(qa.biases, np.float32), round_bf16(b))
    # An MLX folder is not quantized twice.
    assert main(["quantize", "--model", str(out), "--save-path", str(tmp_path / "qq")]) == 1
    assert "is quantized already (5 bits, groups of 128)" in capsys.readouterr().err


def test_train_eval_generate_on_mlx_folder_through_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = make_base(tmp_path / "base")
    # The former spellings (--bits, --group-size) still work, with a note naming the new ones.
    assert main(["quantize", "--model", str(base), "--save-path", "q4", "--bits", "4", "--group-size", "64"]) == 0
    err = capsys.readouterr().err
    assert "krnl: --bits is spelled --q-bits now" in err and "krnl: --group-size is spelled --q-group-size now" in err
    q = json.loads(Path("q4/config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"]) == (4, 64)
    write_data(tmp_path / "data")
    common = ["--model", "q4", "--data", "data", "--dtype", "f32", "--device", "cpu"]
    assert main(["train", *common, "--iters", "3", "--batch-size", "2", "--lora-rank", "2", "--steps-per-eval", "0",
                 "--quiet", "--no-tune", "--adapter-path", "ad", "--adapter-format", "mlx", "--lora-layers", "1"]) == 0
    assert "step 3: train loss" in capsys.readouterr().out
    assert {"adapters.safetensors", "adapter_config.json"} == {p.name for p in Path("ad/mlx").iterdir()}
    assert main(["eval", *common, "--adapter-path", "ad"]) == 0
    assert "valid loss" in capsys.readouterr().out
    assert main(["generate", "--model", "q4", "--adapter-path", "ad/mlx", "--prompt", "w1 w2", "--max-tokens", "2",
                 "--dtype", "f32", "--device", "cpu"]) == 0
    assert main(["train", *common, "--iters", "1", "--q-bits", "4", "--adapter-path", "ad2"]) == 1
    assert "is quantized already (4 bits, groups of 64); leave out --q-bits" in capsys.readouterr().err
    # mlx-lm adapts the last layers only: layer 0 of 2 alone has no mlx-lm layout, refused before training.
    assert main(["train", *common, "--iters", "1", "--adapter-path", "ad3", "--adapter-format", "mlx",
                 "--lora-layers", "0", "--quiet", "--no-tune"]) == 1
    assert "no mlx-lm layout" in capsys.readouterr().err
    assert not Path("ad3/adapter_model.safetensors").exists()


def test_mlx_adapter_round_trip(tmp_path):
    config = ModelConfig.from_dict(base_config(num_hidden_layers=3))
    lora = LoraConfig(r=3, alpha=5.0, dropout=0.1, target_modules=("v_proj", "q_proj", "down_proj"), layers=[1, 2])
    t = random_adapter(config, lora)
    krnl.formats.adapter.save_mlx_adapter(tmp_path / "a", lora, t, config, base_model="/some/base")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["num_layers"] == 2 and cfg["fine_tune_type"] == "lora" and cfg["model"] == "/some/base"
    assert cfg["lora_parameters"] == {"rank": 3, "scale": 5.0 / 3, "dropout": 0.1,
                                      "keys": ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]}
    h, _ = read_safetensors_header(tmp_path / "a" / "adapters.safetensors")
    assert h["model.layers.2.self_attn.v_proj.lora_a"][:2] == ("F32", (64, 3))  # (in, r)
    assert h["model.layers.2.mlp.down_proj.lora_b"][:2] == ("F32", (3, 64))     # (r, out)
    lora2, t2, info = krnl.formats.adapter.read_adapter(tmp_path / "a", config)
    assert info["format"] == "mlx" and lora2.layers == [1, 2] and lora2.r == 3
    assert lora2.scale == pytest.approx(lora.scale) and set(lora2.target_modules) == set(lora.target_modules)
    assert set(t2) == set(t) and all(np.array_equal(t2[k], t[k]) for k in t)


def test_fuse_from_and_to_mlx_folder(tmp_path, capsys):
    lay = mixed_layouts()
    write_mlx_folder(tmp_path / "m", lay)
    config = ModelConfig.from_dict(base_config())
    lora = LoraConfig(r=2, alpha=3.0, target_modules=("q_proj", "down_proj"))
    t = random_adapter(config, lora)
    krnl.formats.adapter.save_mlx_adapter(tmp_path / "a", lora, t, config, base_model=str(tmp_path / "m"))
    src = load_hf_weights(tmp_path / "m")
    merged = "model.layers.1.self_attn.q_proj.weight"
    W = np.asarray(src[merged], np.float64) + 1.5 * (t[lora_key(1, "q_proj", "B")].astype(np.float64)
                                                     @ t[lora_key(1, "q_proj", "A")])
    # To an HF folder: dequantized, bf16, no quantization in its config.
    assert main(["fuse", "--adapter-path", str(tmp_path / "a"), "--save-path", str(tmp_path / "hf")]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization" not in cfg and "quantization_config" not in cfg
    assert cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16"
    h, _ = header_of(tmp_path / "hf")
    assert set(h) == set(config.weight_shapes()) and {v[0] for v in h.values()} == {"BF16"}
    hf = load_hf_weights(tmp_path / "hf")
    np.testing.assert_allclose(np.asarray(hf[merged], np.float64), W, rtol=2 ** -8, atol=1e-6)
    un = "model.layers.0.mlp.gate_proj.weight"  # not adapted: the dequantized weight, rounded to bf16
    assert np.array_equal(np.asarray(hf[un], np.float32), round_bf16(np.asarray(src[un], np.float32)))
    # To an MLX folder: merged modules quantized afresh (4 bits, groups of 32); the others keep their
    # stored codes and layouts, written as overrides.
    assert main(["fuse", "--adapter-path", str(tmp_path / "a"), "--save-path", str(tmp_path / "q"),
                 "--q-bits", "4", "--q-group-size", "32"]) == 0
    assert "(MLX, 4 bits, groups of 32)" in capsys.readouterr().out
    q = load_hf_weights(tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert (q[merged].bits, q[merged].group_size) == (4, 32) and "model.layers.1.self_attn.q_proj" not in cfg
    assert cfg["model.layers.0.mlp.gate_proj"] == {"group_size": 32, "bits": 2, "mode": "affine"}
    assert np.array_equal(np.asarray(q[un].w), np.asarray(src[un].w))
    W32 = krnl.formats.hf.merged_weight(np.asarray(src[merged], np.float32), t[lora_key(1, "q_proj", "A")],
                                t[lora_key(1, "q_proj", "B")], None, 1.5)
    w, s, b = affine.quantize(round_bf16(W32), 4, 32)
    assert np.array_equal(np.asarray(q[merged].w).view(np.int32), w)
    assert np.array_equal(np.asarray(q[merged].scales, np.float32), round_bf16(s))
    assert fuse(tmp_path / "m", tmp_path / "a", tmp_path / "q2", quantize=(8, 64))["merged"]


@pytest.mark.torch
def test_fused_mlx_folder_loads_in_transformers(tmp_path):
    """fuse from an MLX folder writes a plain HF folder: transformers loads it and gives krnl's
    loss of the quantized base with the adapter (f32 output, so no rounding in between)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    write_mlx_folder(tmp_path / "m", mixed_layouts())
    config = ModelConfig.from_dict(base_config())
    lora = LoraConfig(r=2, alpha=3.0, target_modules=("q_proj", "down_proj"))
    krnl.formats.adapter.save_mlx_adapter(tmp_path / "a", lora, random_adapter(config, lora), config)
    fuse(tmp_path / "m", tmp_path / "a", tmp_path / "hf", dtype="f32")
    ids = np.random.default_rng(2).integers(0, V, (2, 12))
    want = load_model(tmp_path / "m", krnl.device("cpu"), adapter=tmp_path / "a").loss(ids[:, :-1], ids[:, 1:])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.tensor(ids[:, :-1])).logits.float()
    got = torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.tensor(ids[:, 1:]).reshape(-1)).item()
    assert got == pytest.approx(want, rel=1e-4)


def test_recipe_overrides_follow_mlx_lm_rule():
    # 9 layers: the first eighth is layer 0, the last 7 and 8, every third between 3 and 6.
    low, over = krnl.formats.mlx_folder.recipe_overrides(ModelConfig.from_dict(base_config(num_hidden_layers=9)), "mixed_2_6")
    assert low == 2 and over.pop("lm_head") == (6, 64)
    assert over == {f"model.layers.{i}.{m}": (6, 64) for i in (0, 3, 6, 7, 8) for m in ("self_attn.v_proj",
                                                                                       "mlp.down_proj")}
    with pytest.raises(ValueError, match=r"\[quantize\] unknown recipe 'mixed_9'"):
        krnl.formats.mlx_folder.recipe_overrides(ModelConfig.from_dict(base_config()), "mixed_9")


def test_quantize_folder_overrides(tmp_path):
    base = make_base(tmp_path / "base")
    over = {"model.layers.0.self_attn.v_proj": (8, 32), "lm_head": None, "model.layers.1.mlp.down_proj": (2, 128)}
    assert len(krnl.formats.hf.quantize_folder(base, tmp_path / "q", 4, 64, overrides=over, shard_size="40KB")["files"]) > 1
    q = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert q == {"group_size": 64, "bits": 4, "mode": "affine",
                 "model.layers.0.self_attn.v_proj": {"group_size": 32, "bits": 8, "mode": "affine"},
                 "model.layers.1.mlp.down_proj": {"group_size": 128, "bits": 2, "mode": "affine"}}
    w = load_hf_weights(tmp_path / "q")
    assert not isinstance(w["lm_head.weight"], QuantizedArray)
    assert w["model.layers.0.self_attn.v_proj.weight"].bits == 8 and w["model.layers.0.self_attn.k_proj.weight"].bits == 4
    assert w["model.layers.1.mlp.down_proj.weight"].group_size == 128
    with pytest.raises(ValueError, match=r"\[quantize\] bits must be one of"):
        krnl.formats.hf.quantize_folder(base, tmp_path / "q2", 7, 64)
