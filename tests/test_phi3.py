"""Phi-3 / Phi-3.5 (model_type "phi3"): fused qkv_proj and gate_up_proj weights split at load, LoRA
on the fused modules as PEFT runs it (one A per fused module shared by its members, row blocks of
one B), LongRoPE (short and long factors chosen by the call's largest position, the attention
factor on cos/sin). What Phi-3 adds to the checks every family passes (tests/test_families.py:
loss, PEFT gradients and adapters, fuse, generation across the short/long switch, CLI, metal-sim):
its config and its errors; LoRA targets mapped to the fused modules, their shared A and dropout
mask; the loss matches transformers' only with the LongRoPE scaling; the mlx adapter layout; the
CLI's error for part of a fused module; mlx-lm's loss of a quantized folder with and without a
krnl adapter."""

import json

import numpy as np
import pytest

import krnl
from krnl.formats import hf
from krnl.models.config import LoraConfig, ModelConfig, lora_key

from hf_families import (LONGROPE, PHI3_MODULES, V, family_batch, family_folders, hf_model, random_b, torch_loss,
                         torch_modules)
from mlx_folders import write_data, write_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
_batch = family_batch


def _dict(**kw):
    base = {"model_type": "phi3", "vocab_size": V, "hidden_size": 40, "intermediate_size": 56,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 64}
    return {**base, **kw}


def test_config_reads_phi3():
    c = ModelConfig.from_dict(_dict(original_max_position_embeddings=8, rope_scaling=dict(LONGROPE, type="su")))
    s = c.weight_shapes()
    assert s["model.layers.0.self_attn.qkv_proj.weight"] == (80, 40)
    assert s["model.layers.0.mlp.gate_up_proj.weight"] == (112, 40)
    assert "model.layers.0.self_attn.q_proj.weight" not in s and "model.layers.0.mlp.up_proj.weight" not in s
    assert c.rope_scaling["factor"] == 8.0 and c.rope_attention_factor == pytest.approx(2 ** 0.5)
    # short factors up to position 7 (7 + 1 = original), long beyond, as transformers chooses
    j = np.arange(0, 20, 2) / 20
    assert np.allclose(c.rope_inv_freq(7), 1 / (np.array(LONGROPE["short_factor"]) * 10000.0 ** j), rtol=1e-6)
    assert np.allclose(c.rope_inv_freq(8), 1 / (np.array(LONGROPE["long_factor"]) * 10000.0 ** j), rtol=1e-6)
    given = ModelConfig.from_dict(_dict(rope_scaling=dict(LONGROPE, original_max_position_embeddings=8,
                                                          attention_factor=1.25, factor=2.0)))
    assert given.rope_attention_factor == 1.25 and given.rope_scaling["factor"] == 2.0
    assert ModelConfig.from_dict(_dict()).rope_attention_factor == 1.0


@pytest.mark.parametrize("kw, match", [
    (dict(rope_scaling=dict(LONGROPE, short_factor=[1.0] * 9), original_max_position_embeddings=8),
     r"key 'rope_scaling.short_factor' must be a list of 10 numbers"),
    (dict(rope_scaling=LONGROPE), r"longrope needs original_max_position_embeddings"),
    (dict(partial_rotary_factor=0.75), r"partial_rotary_factor 0.75 is not supported"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=r"^\[ModelConfig\] <dict>: " + match):
        ModelConfig.from_dict(_dict(**kw))


def test_lora_targets_map_to_fused_modules():
    c = ModelConfig.from_dict(_dict())
    lc = LoraConfig(r=2, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    lc.validate(c)
    assert lc.target_modules == ("qkv_proj", "o_proj")
    lc = LoraConfig(r=2)  # every projection: the four fused targets
    lc.validate(c)
    assert lc.target_modules == PHI3_MODULES
    assert lora_key(0, "qkv_proj", "A") == "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight"
    assert lora_key(1, "gate_up_proj", "B") == "base_model.model.model.layers.1.mlp.gate_up_proj.lora_B.weight"
    for targets, fused in ((("q_proj",), "qkv_proj"), (("gate_proj", "down_proj"), "gate_up_proj"),
                           (("qkv_proj", "up_proj"), "gate_up_proj")):
        with pytest.raises(ValueError, match=rf"^\[LoraConfig\] phi3 fuses .* into {fused}: LoRA adapts all of"):
            LoraConfig(r=2, target_modules=targets).validate(c)
    with pytest.raises(ValueError, match=r"^\[LoraConfig\] unknown target module\(s\) \['qkv_proj'\]"):
        LoraConfig(r=2, target_modules=("qkv_proj",)).validate(ModelConfig.from_dict(_dict(model_type="llama")))


def test_fused_members_share_a_and_the_dropout_mask():
    """q/k/v (gate/up) LoraLinears are views of one A and of row blocks of one B, and drop the
    same inputs (one mask, as PEFT's single dropout of the fused module)."""
    c = ModelConfig.from_dict(_dict())
    m = krnl.models.model.LlamaModel(krnl.device("cpu"), c, krnl.models.config.random_weights(c), LoraConfig(r=2, dropout=0.1))
    st = {k: np.arange(np.prod(v.shape), dtype=np.float32).reshape(v.shape) for k, v in m.lora_state().items()}
    m.lora_params.load(st)
    L = m.layers[0]
    B = st[lora_key(0, "qkv_proj", "B")]
    for lin, r0, r1 in ((L.q_proj, 0, 40), (L.k_proj, 40, 60), (L.v_proj, 60, 80)):
        assert np.array_equal(lin.factors.A.numpy(), st[lora_key(0, "qkv_proj", "A")])
        assert np.array_equal(lin.factors.B.numpy(), B[r0:r1])
        assert lin.seed(7) == L.q_proj.seed(7)
    gu = st[lora_key(0, "gate_up_proj", "B")]
    assert np.array_equal(L.mlp.up.factors.B.numpy(), gu[56:]) and L.mlp.up.seed(3) == L.mlp.gate.seed(3)
    assert L.o_proj.seed(3) != L.q_proj.seed(3) and L.mlp.down.seed(3) != L.mlp.gate.seed(3)


def test_fused_members_drop_the_same_inputs():
    """In a training call q, k and v (gate and up) see one dropout mask of their shared input,
    as PEFT's qkv_proj (gate_up_proj) does with its single dropout; o and down draw their own."""
    from krnl.models import norm_remake
    from krnl.models.layer import layer_forward

    c = ModelConfig.from_dict(_dict(num_hidden_layers=1))
    m = krnl.models.model.LlamaModel(krnl.device("cpu"), c, krnl.models.config.random_weights(c), LoraConfig(r=2, dropout=0.4))
    x = m.dev.tensor(np.random.default_rng(0).standard_normal((2 * 7, 40)).astype(np.float32), "f32")  # (N, C)
    batch = m._batch((2, 7), call_seed=11)
    with m.dev.step():
        _, cache = layer_forward(m.layers[0], x, batch)
    L = m.layers[0]
    assert all(s.xd is None for s in cache.qkv)  # made again in the backward (norm_remake.py)
    with m.dev.step():
        xn, saves = norm_remake.remake(x, L.n1, L.eps, cache.qkv, [L.q_proj, L.k_proj, L.v_proj])
    xq, xk, xv = (np.array(s.xd.numpy()) for s in saves)
    xn = np.array(xn.numpy())  # n1's output
    dropped = xq == 0
    assert 0.2 < dropped.mean() < 0.6 and not (xn == 0).any()
    assert np.array_equal(xq, xk) and np.array_equal(xq, xv)
    assert np.allclose(xq[~dropped], xn[~dropped] / 0.6, rtol=1e-6)
    mc = cache.mlp
    with m.dev.step():
        _, (gate, up) = norm_remake.remake(cache.h, L.mlp.norm, L.eps, [mc.gate, mc.up], [L.mlp.gate, L.mlp.up])
    assert np.array_equal(gate.xd.numpy(), up.xd.numpy())
    assert not np.array_equal(np.array(cache.o.xd.numpy()) == 0, dropped)  # o's input (N, H D), its own mask


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return family_folders(tmp_path_factory, "phi3")


@pytest.mark.torch
@pytest.mark.parametrize("T", [13, 7, 8])
def test_loss_needs_the_longrope_scaling(folders, T):
    """Without the scaling (frequencies and attention factor) the loss differs: test_families'
    loss check sees it."""
    folder = folders["longrope"]
    ids, labels, targets = _batch(T=T)
    ref = torch_loss(hf_model(folder), ids, labels)
    c = hf.read_config(folder)
    c.rope_scaling = None
    m = krnl.models.model.LlamaModel(krnl.device("cpu"), c, hf.load_hf_weights(folder))
    assert abs(m.loss(ids, targets) - ref) > 1e-3


@pytest.mark.torch
def test_mlx_adapter_layout_round_trips(folders, tmp_path):
    folder = folders["gqa"]
    lora = LoraConfig(r=2, alpha=4.0, target_modules=PHI3_MODULES, layers=[1, 2])
    m = hf.load_model(folder, krnl.device("cpu"), lora=lora)
    st = random_b(m, 6)
    krnl.formats.adapter.save_mlx_adapter(tmp_path / "mx", lora, st, m.config)
    cfg = json.loads((tmp_path / "mx" / "adapter_config.json").read_text())
    assert cfg["lora_parameters"]["keys"] == ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                              "mlp.down_proj"]
    back, tensors, info = krnl.formats.adapter.read_adapter(tmp_path / "mx", m.config)
    assert info["format"] == "mlx" and back.target_modules == PHI3_MODULES
    assert set(tensors) == set(st) and all(np.array_equal(tensors[k], st[k]) for k in st)


@pytest.mark.torch
def test_cli_refuses_part_of_a_fused_module(folders, tmp_path, capsys):
    """LoRA targets q and o: the CLI stops with the LoraConfig error as its last line (the fused
    targets it trains: tests/test_families.py)."""
    from krnl.cli.main import main

    write_data(tmp_path / "data")
    args = ["train", "--model", str(folders["longrope"]), "--data", str(tmp_path / "data"), "--device", "cpu",
            "--dtype", "f32", "--iters", "3", "--batch-size", "2", "--lora-rank", "2", "--steps-per-eval", "0",
            "--quiet", "--no-tune"]
    capsys.readouterr()
    assert main(args + ["--adapter-path", str(tmp_path / "bad"), "--lora-targets", "q,o"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("[LoraConfig] phi3 fuses q_proj, k_proj, v_proj into qkv_proj: LoRA adapts all of "
                            "qkv_proj or none of it, got only q_proj")


# ---------------------------------------------------------------------------------------------
# mlx-lm: quantized fused weights and the adapter layout

@pytest.mark.torch
@pytest.mark.mlx
def test_mlx_quantized_phi3_and_adapter_match_mlx_lm(tmp_path):
    """mlx_lm.convert -q of a Phi-3 folder (fused qkv_proj and gate_up_proj quantized whole, krnl
    splits their rows): krnl's loss equals mlx-lm's, without and with a krnl adapter in mlx-lm's
    layout loaded by mlx_lm.load(adapter_path=...)."""
    torch, transformers = torch_modules()
    pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import mlx.nn as nn

    cfg = transformers.Phi3Config(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    model = transformers.Phi3ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not n.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    model.save_pretrained(tmp_path / "base")
    write_tokenizer(tmp_path / "base")
    mlx_lm.convert(str(tmp_path / "base"), str(tmp_path / "q"), quantize=True, q_bits=4, q_group_size=32)
    w = hf.load_hf_weights(tmp_path / "q")
    assert isinstance(w["model.layers.0.self_attn.qkv_proj.weight"], krnl.quant.qweight.QuantizedArray)
    assert isinstance(w["model.layers.1.mlp.gate_up_proj.weight"], krnl.quant.qweight.QuantizedArray)

    def mlx_loss(ids, adapter=None):  # mlx-lm's mean next-token cross entropy, the model in f32
        m, _ = mlx_lm.load(str(tmp_path / "q"), adapter_path=None if adapter is None else str(adapter))
        m.set_dtype(mx.float32)
        logits = m(mx.array(ids[:, :-1])).astype(mx.float32)
        return nn.losses.cross_entropy(logits, mx.array(ids[:, 1:])).mean().item()

    ids = np.random.default_rng(1).integers(0, V, (2, 14)).astype(np.int32)
    lora = LoraConfig(r=2, alpha=4.0, target_modules=PHI3_MODULES)
    m = hf.load_model(tmp_path / "q", krnl.device("cpu"), lora=lora)
    st = m.lora_state()
    assert m.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(mlx_loss(ids), rel=1e-4)  # B = 0: the base
    st = random_b(m, 2)
    krnl.formats.adapter.save_mlx_adapter(tmp_path / "ad", lora, st, m.config)
    mine = m.loss(ids[:, :-1], ids[:, 1:])
    assert abs(mine - mlx_loss(ids)) > 1e-2
    assert mine == pytest.approx(mlx_loss(ids, tmp_path / "ad"), rel=1e-4)
