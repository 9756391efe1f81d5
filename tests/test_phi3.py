"""Phi-3 / Phi-3.5 (model_type "phi3") end to end: fused qkv_proj and gate_up_proj weights split at
load, LoRA on the fused modules as PEFT runs it (one A per fused module shared by its members,
row blocks of one B), LongRoPE (short and long factors chosen by the call's largest position,
the attention factor on cos/sin). Tiny random folders written by transformers' Phi3ForCausalLM:
krnl's loss equals transformers'; LoRA gradients equal PyTorch autograd through PEFT; krnl
adapters load in PEFT and `fuse` output loads in transformers; KV-cached greedy decoding gives
transformers' tokens (across the short/long switch); the CLI trains; one step on metal-sim
equals the CPU backend.

Tolerances: losses in f32 within 1e-5 relative (different summation orders over 2-3 layers);
gradients within 1e-4 of the largest gradient of their tensor."""

import json

import numpy as np
import pytest

import krnl
from krnl import hf
from krnl.model import LoraConfig, ModelConfig, lora_key

from conftest import METAL_SIM, lora_step, tiny_lora_model
from hf_families import (check_lora_gradients, hf_model, random_b, save_random, token_batch, torch_loss,
                         torch_modules)
from mlx_folders import write_data, write_tokenizer

V = 61
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
PHI3_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_rng = np.random.default_rng(5)
LONGROPE = {"rope_type": "longrope", "short_factor": [float(x) for x in 1 + _rng.random(10)],
            "long_factor": [float(x) for x in 1 + 3 * _rng.random(10)]}
# GQA (4 query heads on 2 KV heads, D 12), untied; and LongRoPE (D 20, original 8 positions of 64:
# a 13-token batch takes the long factors, a 7-token one the short; attention factor sqrt(2)).
CONFIGS = {
    "gqa": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False),
    "longrope": dict(hidden_size=40, intermediate_size=56, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, tie_word_embeddings=False, original_max_position_embeddings=8,
                     rope_parameters=dict(LONGROPE, rope_theta=10000.0)),
}


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
    m = krnl.model.LlamaModel(krnl.device("cpu"), c, krnl.model.random_weights(c), LoraConfig(r=2, dropout=0.1))
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
    from krnl.layer import layer_forward

    c = ModelConfig.from_dict(_dict(num_hidden_layers=1))
    m = krnl.model.LlamaModel(krnl.device("cpu"), c, krnl.model.random_weights(c), LoraConfig(r=2, dropout=0.4))
    x = m.dev.tensor(np.random.default_rng(0).standard_normal((2 * 7, 40)).astype(np.float32), "f32")  # (N, C)
    batch = m._batch((2, 7), call_seed=11)
    with m.dev.step():
        _, cache = layer_forward(m.layers[0], x, batch)
    xq, xk, xv = (np.array(s.xd.numpy()) for s in cache.qkv)
    xn = np.array(cache.xn.numpy())
    dropped = xq == 0
    assert 0.2 < dropped.mean() < 0.6 and not (xn == 0).any()
    assert np.array_equal(xq, xk) and np.array_equal(xq, xv)
    assert np.allclose(xq[~dropped], xn[~dropped] / 0.6, rtol=1e-6)
    mc = cache.mlp
    assert np.array_equal(mc.gate.xd.numpy(), mc.up.xd.numpy())
    assert not np.array_equal(np.array(cache.o.xd.numpy()) == 0, dropped)  # o's input (N, H D), its own mask


# ---------------------------------------------------------------------------------------------
# Against transformers and PEFT (torch)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch, transformers = torch_modules()
    root = tmp_path_factory.mktemp("phi3")
    out = {}
    for i, (name, kw) in enumerate(CONFIGS.items()):
        cfg = transformers.Phi3Config(vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-5, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2, **kw)
        torch.manual_seed(i)
        m = transformers.Phi3ForCausalLM(cfg)
        out[name] = save_random(m, root / name, 10 + i, norm_center=1.0)
    return out


def _batch(seed=0, B=2, T=13):
    return token_batch(V, seed, B, T)


@pytest.mark.torch
@pytest.mark.parametrize("name, T", [("gqa", 13), ("longrope", 13), ("longrope", 7), ("longrope", 8)])
def test_loss_matches_transformers(folders, name, T):
    folder = folders[name]
    assert "model.layers.0.self_attn.qkv_proj.weight" in hf.read_tensors(folder)
    ids, labels, targets = _batch(T=T)
    ref = torch_loss(hf_model(folder), ids, labels)
    for fused in (False, True):
        m = hf.load_model(folder, krnl.device("cpu"))
        m.fused_attention = fused
        assert m.loss(ids, targets) == pytest.approx(ref, rel=LOSS_RTOL), fused
    if name == "longrope":  # without the scaling (frequencies and attention factor) the loss differs
        c = hf.read_config(folder)
        c.rope_scaling = None
        m = krnl.model.LlamaModel(krnl.device("cpu"), c, hf.load_hf_weights(folder))
        assert abs(m.loss(ids, targets) - ref) > 1e-3


@pytest.mark.torch
@pytest.mark.parametrize("name, fused, ckpt", [("gqa", False, False), ("longrope", True, True)])
def test_lora_gradients_match_peft(folders, name, fused, ckpt):
    """The four fused targets; PyTorch autograd through PEFT's LoRA on transformers' model."""
    check_lora_gradients(folders[name], PHI3_MODULES, CONFIGS[name]["num_hidden_layers"], _batch(2), LOSS_RTOL, GRAD_RTOL,
                         grad_checkpoint=ckpt, fused_attention=fused)


@pytest.mark.torch
def test_krnl_adapter_in_peft_and_fuse_in_transformers(folders, tmp_path):
    torch, _ = torch_modules()
    peft = pytest.importorskip("peft")
    folder = folders["gqa"]
    lora = LoraConfig(r=2, alpha=6.0, target_modules=("q_proj", "k_proj", "v_proj", "gate_up_proj"), layers=[0, 2])
    m = hf.load_model(folder, krnl.device("cpu"), lora=lora)
    st = random_b(m, 3)
    assert lora_key(2, "qkv_proj", "B") in st and lora_key(0, "gate_up_proj", "A") in st and len(st) == 8
    krnl.adapter.save_adapter(tmp_path / "ad", st, krnl.adapter.peft_config(lora, str(folder), lora.layers))
    ids, labels, targets = _batch(4)
    mine = m.loss(ids, targets)
    assert abs(mine - torch_loss(hf_model(folder), ids, labels)) > 1e-2  # the adapter matters
    pm = peft.PeftModel.from_pretrained(hf_model(folder), str(tmp_path / "ad")).eval()
    assert torch_loss(pm, ids, labels) == pytest.approx(mine, rel=LOSS_RTOL)
    again = hf.load_model(folder, krnl.device("cpu"), adapter=tmp_path / "ad")
    assert again.lora_config.target_modules == ("qkv_proj", "gate_up_proj")
    assert again.loss(ids, targets) == pytest.approx(mine, rel=1e-6)

    hf.fuse(folder, tmp_path / "ad", tmp_path / "fused")
    t = hf.read_tensors(tmp_path / "fused")
    assert "model.layers.2.self_attn.qkv_proj.weight" in t and "model.layers.0.self_attn.q_proj.weight" not in t
    assert torch_loss(hf_model(tmp_path / "fused"), ids, labels) == pytest.approx(mine, rel=LOSS_RTOL)


@pytest.mark.torch
def test_mlx_adapter_layout_round_trips(folders, tmp_path):
    folder = folders["gqa"]
    lora = LoraConfig(r=2, alpha=4.0, target_modules=PHI3_MODULES, layers=[1, 2])
    m = hf.load_model(folder, krnl.device("cpu"), lora=lora)
    st = random_b(m, 6)
    krnl.adapter.save_mlx_adapter(tmp_path / "mx", lora, st, m.config)
    cfg = json.loads((tmp_path / "mx" / "adapter_config.json").read_text())
    assert cfg["lora_parameters"]["keys"] == ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                              "mlp.down_proj"]
    back, tensors, info = krnl.adapter.read_adapter(tmp_path / "mx", m.config)
    assert info["format"] == "mlx" and back.target_modules == PHI3_MODULES
    assert set(tensors) == set(st) and all(np.array_equal(tensors[k], st[k]) for k in st)


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(folders, name):
    """longrope: the 5-token prompt takes the short factors, decoding past 8 positions the long
    ones, with the cached keys as they were rotated (transformers' dynamic choice per call)."""
    torch, transformers = torch_modules()
    if name == "longrope" and tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 20):
        # 5.17-5.19 pick the 6th token differently (its uncached forward, 5.20 on and krnl agree)
        pytest.skip(f"transformers {transformers.__version__} decodes longrope past the switch with a cache "
                    f"unlike its own uncached forward and 5.20 on")
    prompt = [5, 17, 3, 40, 9]
    ref = hf_model(folders[name])
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    got = hf.load_model(folders[name], krnl.device("cpu")).generate(prompt, max_new_tokens=9)
    assert got == want and len(set(want)) > 1


@pytest.mark.torch
def test_cli_trains_a_phi3_folder(folders, tmp_path, capsys):
    from krnl.cli import main

    write_data(tmp_path / "data")
    out = tmp_path / "ad"
    args = ["train", "--model", str(folders["longrope"]), "--data", str(tmp_path / "data"), "--device", "cpu",
            "--dtype", "f32", "--iters", "3", "--batch-size", "2", "--lora-rank", "2", "--steps-per-eval", "0",
            "--quiet", "--no-tune"]
    assert main(args + ["--adapter-path", str(out), "--lora-targets", "q,k,v,down"]) == 0
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(np.isfinite(losses))
    ac = json.loads((out / "adapter_config.json").read_text())
    assert ac["r"] == 2 and sorted(ac["target_modules"]) == ["down_proj", "qkv_proj"]
    lora, tensors, _ = krnl.adapter.read_adapter(out, hf.read_config(folders["longrope"]))
    assert lora_key(1, "qkv_proj", "B") in tensors and lora_key(1, "down_proj", "A") in tensors
    capsys.readouterr()
    assert main(args + ["--adapter-path", str(tmp_path / "bad"), "--lora-targets", "q,o"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("[LoraConfig] phi3 fuses q_proj, k_proj, v_proj into qkv_proj: LoRA adapts all of "
                            "qkv_proj or none of it, got only q_proj")


# ---------------------------------------------------------------------------------------------
# metal-sim

PHI3_TINY = dict(model_type="phi3", num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                 original_max_position_embeddings=4, rope_scaling=dict(LONGROPE, short_factor=LONGROPE["short_factor"][:4],
                                                                       long_factor=LONGROPE["long_factor"][:4]),
                 hidden_size=16)


@pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")
def test_training_step_on_metal_sim_matches_cpu():
    """One forward/backward of a tiny Phi-3 (fused LoRA targets, GQA, LongRoPE's long factors
    and attention factor: 9 positions past an original 4) on metal-sim against the CPU backend,
    f32: summation order only."""
    rng = np.random.default_rng(7)
    ids, targets = rng.integers(0, 61, (2, 9)), rng.integers(0, 61, (2, 9))
    loss_c, g_c = lora_step(tiny_lora_model(krnl.device("cpu"), "f32", **PHI3_TINY), ids, targets)
    loss_d, g_d = lora_step(tiny_lora_model(krnl.device("metal-sim"), "f32", **PHI3_TINY), ids, targets)
    assert abs(loss_d - loss_c) <= 1e-5 * abs(loss_c), (loss_d, loss_c)
    assert g_c.keys() == g_d.keys() and lora_key(1, "gate_up_proj", "A") in g_c
    for k in g_c:
        scale = float(np.max(np.abs(g_c[k])))
        assert scale > 0, k
        assert float(np.max(np.abs(g_d[k] - g_c[k]))) <= 4e-5 * scale, k


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
    assert isinstance(w["model.layers.0.self_attn.qkv_proj.weight"], krnl.qweight.QuantizedArray)
    assert isinstance(w["model.layers.1.mlp.gate_up_proj.weight"], krnl.qweight.QuantizedArray)

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
    krnl.adapter.save_mlx_adapter(tmp_path / "ad", lora, st, m.config)
    mine = m.loss(ids[:, :-1], ids[:, 1:])
    assert abs(mine - mlx_loss(ids)) > 1e-2
    assert mine == pytest.approx(mlx_loss(ids, tmp_path / "ad"), rel=1e-4)
