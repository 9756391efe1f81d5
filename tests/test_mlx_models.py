"""MLX quantized folders against mlx-lm itself (mlx[cpu] on Linux; CI stage 2): krnl quantize
writes what mlx_lm.convert -q writes, bit for bit; krnl's loss on mlx-lm's quantized folders
(uniform, mixed per-layer bits, quantized embedding, untied quantized head) equals mlx-lm's in
f32; an adapter krnl writes with --adapter-format mlx loads in mlx_lm.load and gives krnl's
loss; fuse --q-bits writes a folder mlx_lm.load reads."""

import json
from pathlib import Path

import numpy as np
import pytest

from mlx_folders import V, make_base, random_adapter, write_data

import krnl
from krnl.cli.main import main
from krnl.formats.hf import load_hf_weights, load_model, quantize_folder, read_config
from krnl.models.config import LoraConfig
from krnl.quant.qweight import QuantizedArray

pytestmark = pytest.mark.mlx


@pytest.fixture(scope="module")
def mlx_lm():
    pytest.importorskip("mlx.core")
    return pytest.importorskip("mlx_lm")


def mlx_tensors(folder):
    import mlx.core as mx

    out = {}
    for f in sorted(Path(folder).glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def same_bits(a, b):
    """Two mlx arrays of one dtype and shape with identical bytes (bf16 compared as bits)."""
    import mlx.core as mx

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == mx.bfloat16:
        a, b = a.view(mx.uint16), b.view(mx.uint16)
    return np.array_equal(np.array(a), np.array(b))


def tokens(seed=0, shape=(2, 14)):
    return np.random.default_rng(seed).integers(0, V, shape).astype(np.int32)


def mlx_loss(path, ids, adapter=None):
    """mlx-lm's mean next-token cross entropy on ids, the model in f32."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    model, _ = load(str(path), adapter_path=None if adapter is None else str(adapter))
    model.set_dtype(mx.float32)  # f32 compute; bf16 scales widen exactly
    logits = model(mx.array(ids[:, :-1])).astype(mx.float32)
    return nn.losses.cross_entropy(logits, mx.array(ids[:, 1:])).mean().item()


def krnl_loss(path, ids, adapter=None):
    m = load_model(path, krnl.device("cpu"), dtype="f32", adapter=adapter)
    return m.loss(ids[:, :-1], ids[:, 1:])


@pytest.mark.parametrize("bits, gs, dtype", [(4, 64, None), (8, 32, None), (4, 32, "bfloat16"), (3, 64, "float16"),
                                             (6, 128, "bfloat16"), (2, 64, None), (5, 32, None)])
def test_quantize_matches_mlx_convert(mlx_lm, tmp_path, bits, gs, dtype):
    base = make_base(tmp_path / "base", **({"torch_dtype": dtype} if dtype else {}))
    mlx_lm.convert(str(base), str(tmp_path / "ref"), quantize=True, q_bits=bits, q_group_size=gs)
    quantize_folder(base, tmp_path / "mine", bits, gs)
    ref, mine = mlx_tensors(tmp_path / "ref"), mlx_tensors(tmp_path / "mine")
    assert set(mine) == set(ref)
    bad = [k for k in ref if not same_bits(ref[k], mine[k])]
    assert not bad, bad
    assert any(k.endswith(".scales") for k in ref)
    rq = json.loads((tmp_path / "ref" / "config.json").read_text())["quantization"]
    mq = json.loads((tmp_path / "mine" / "config.json").read_text())["quantization"]
    assert mq == rq
    ids = tokens()
    assert krnl_loss(tmp_path / "mine", ids) == pytest.approx(mlx_loss(tmp_path / "mine", ids), rel=1e-4)


@pytest.mark.parametrize("convert, extra", [
    ({"q_bits": 4, "q_group_size": 64}, {}),
    ({"q_bits": 8, "q_group_size": 32}, {}),
    ({"quant_predicate": "mixed_3_6", "q_group_size": 64}, {}),
    ({"quant_predicate": "mixed_2_6", "q_group_size": 64}, {"torch_dtype": "bfloat16"}),
    ({"q_bits": 4, "q_group_size": 64}, {"tie_word_embeddings": True}),
], ids=["4bit-g64", "8bit-g32", "mixed_3_6", "mixed_2_6-bf16", "tied-4bit"])
def test_loss_matches_mlx_lm_on_mlx_folders(mlx_lm, tmp_path, convert, extra):
    """mlx-lm's own quantized folders: the embedding and the untied head quantized too; the mixed
    recipes quantize v_proj and down_proj of some layers at 6 bits and the head at 6 (q, k and
    v of a layer at different bits)."""
    base = make_base(tmp_path / "base", num_hidden_layers=3, **extra)
    mlx_lm.convert(str(base), str(tmp_path / "q"), quantize=True, **convert)
    w = load_hf_weights(tmp_path / "q")
    assert isinstance(w["model.embed_tokens.weight"], QuantizedArray)
    if not extra.get("tie_word_embeddings"):
        assert isinstance(w["lm_head.weight"], QuantizedArray)
    layouts = {(a.bits, a.group_size) for a in w.values() if isinstance(a, QuantizedArray)}
    assert len(layouts) == (2 if "quant_predicate" in convert else 1)
    for seed in range(2):
        ids = tokens(seed)
        assert krnl_loss(tmp_path / "q", ids) == pytest.approx(mlx_loss(tmp_path / "q", ids), rel=1e-4)


def test_mlx_adapter_loads_in_mlx_lm(mlx_lm, tmp_path, monkeypatch, capsys):
    """krnl train --adapter-format mlx on an MLX folder: mlx_lm.load(path, adapter_path=...) loads
    the adapter and gives krnl's loss with it; the PEFT copy gives the same loss in krnl."""
    monkeypatch.chdir(tmp_path)
    base = make_base(tmp_path / "base", num_hidden_layers=3)
    mlx_lm.convert(str(base), "q", quantize=True, quant_predicate="mixed_3_6", q_group_size=64)
    write_data(tmp_path / "data")
    assert main(["train", "--model", "q", "--data", "data", "--dtype", "f32", "--device", "cpu", "--iters", "3",
                 "--batch-size", "2", "--lora-rank", "3", "--lora-alpha", "7", "--lora-layers", "1,2",
                 "--lora-targets", "q,v,down", "--learning-rate", "0.05", "--steps-per-eval", "0", "--quiet",
                 "--no-tune", "--adapter-path", "ad", "--adapter-format", "mlx"]) == 0
    capsys.readouterr()
    # Training moved B off zero; make the update large enough to matter in the comparison.
    lora, tensors, _ = krnl.formats.adapter.read_adapter("ad", read_config("q"))
    assert any(np.abs(v).max() > 0 for k, v in tensors.items() if ".lora_B." in k)
    ids = tokens(3)
    mine = krnl_loss("q", ids, adapter="ad/mlx")
    assert mine == pytest.approx(krnl_loss("q", ids, adapter="ad"), rel=1e-6)
    assert mine == pytest.approx(mlx_loss("q", ids, adapter="ad/mlx"), rel=1e-4)
    # A large random adapter on every module of the last layers: the same check with a clear effect.
    config = read_config("q")
    lora = LoraConfig(r=4, alpha=6.0, layers=[1, 2])
    t = random_adapter(config, lora)
    krnl.formats.adapter.save_mlx_adapter(tmp_path / "big", lora, t, config, base_model=str(tmp_path / "q"))
    with_adapter = krnl_loss("q", ids, adapter=tmp_path / "big")
    assert abs(with_adapter - krnl_loss("q", ids)) > 1e-2
    assert with_adapter == pytest.approx(mlx_loss("q", ids, adapter=tmp_path / "big"), rel=1e-4)


def test_fuse_quantize_loads_in_mlx_lm(mlx_lm, tmp_path, capsys):
    """fuse --q-bits from an HF base and from an MLX base: mlx_lm.load reads both, and its loss
    equals krnl's on the written folder."""
    base = make_base(tmp_path / "base", torch_dtype="bfloat16")
    mlx_lm.convert(str(base), str(tmp_path / "q"), quantize=True, q_bits=4, q_group_size=64)
    config = read_config(base)
    lora = LoraConfig(r=2, alpha=4.0, target_modules=("k_proj", "up_proj"))
    t = random_adapter(config, lora)
    ids = tokens(4)
    for src in (base, tmp_path / "q"):
        ad, out = tmp_path / f"a-{src.name}", tmp_path / f"fused-{src.name}"
        krnl.formats.adapter.save_mlx_adapter(ad, lora, t, config, base_model=str(src))
        assert main(["fuse", "--adapter-path", str(ad), "--save-path", str(out), "--q-bits", "8",
                     "--q-group-size", "32"]) == 0
        capsys.readouterr()
        w = load_hf_weights(out)
        up = w["model.layers.0.mlp.up_proj.weight"]
        assert (up.bits, up.group_size) == (8, 32)
        assert krnl_loss(out, ids) == pytest.approx(mlx_loss(out, ids), rel=1e-4)
        # The fused folder is the base with the adapter, up to 8-bit rounding of the merged modules.
        assert krnl_loss(out, ids) == pytest.approx(krnl_loss(src, ids, adapter=ad), rel=2e-2)


@pytest.mark.parametrize("recipe, layers", [("mixed_3_6", 3), ("mixed_2_6", 9), ("mixed_3_4", 2), ("mixed_4_6", 17)])
def test_quantize_recipes_match_mlx_convert(mlx_lm, tmp_path, recipe, layers):
    """krnl quantize --quant-predicate writes the tensors of mlx_lm.convert's mixed recipes bit for
    bit (layer counts where the first and last eighths and every third layer differ), and
    mlx-lm loads krnl's folder, whose config holds only the modules at the high bits."""
    base = make_base(tmp_path / "base", num_hidden_layers=layers)
    mlx_lm.convert(str(base), str(tmp_path / "ref"), quantize=True, quant_predicate=recipe, q_group_size=64)
    assert main(["quantize", "--model", str(base), "--save-path", str(tmp_path / "mine"), "--quant-predicate",
                 recipe]) == 0
    ref, mine = mlx_tensors(tmp_path / "ref"), mlx_tensors(tmp_path / "mine")
    assert set(mine) == set(ref) and not [k for k in ref if not same_bits(ref[k], mine[k])]
    q = json.loads((tmp_path / "mine" / "config.json").read_text())["quantization"]
    high = {k for k, v in q.items() if isinstance(v, dict)}
    assert "lm_head" in high and len({v["bits"] for k, v in q.items() if k in high}) == 1
    ids = tokens(5)
    assert krnl_loss(tmp_path / "mine", ids) == pytest.approx(mlx_loss(tmp_path / "mine", ids), rel=1e-4)
