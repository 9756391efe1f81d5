"""Qwen3 (model_type "qwen3") end to end: per-head RMSNorm of q and k before rotary, head_dim
independent of hidden_size / heads, tied and untied heads. Tiny random folders written by
transformers' Qwen3ForCausalLM: krnl's loss equals transformers' (fused and materialised attention,
gradient checkpointing); LoRA gradients on all seven projections equal PyTorch autograd through
PEFT; krnl adapters load in PEFT and `fuse` output loads in transformers; KV-cached greedy decoding
gives transformers' tokens; the CLI trains; one step on metal-sim equals the CPU backend; an MLX
quantized Qwen3 folder gives mlx-lm's loss.

Tolerances: losses in f32 within 1e-5 relative (different summation orders over 2-3 layers);
gradients within 1e-4 of the largest gradient of their tensor (f32 backward through softmax and
the norms, ~1e-6 observed)."""

import json

import numpy as np
import pytest

import krnl
from krnl import hf
from krnl.model import ALL_MODULES, LoraConfig, ModelConfig, lora_key

from conftest import METAL_SIM, lora_step, tiny_lora_model
from hf_families import (check_lora_gradients, hf_model, random_b, save_random, token_batch, torch_loss,
                         torch_modules)
from mlx_folders import make_base, write_data

V = 61
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
# GQA (4 query heads on 2 KV heads), head_dim 10 with hidden 48 (not 48 / 4); untied and tied.
CONFIGS = {
    "gqa": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=10, tie_word_embeddings=False),
    "tied": dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=24, tie_word_embeddings=True),
}


def test_config_reads_qwen3():
    c = ModelConfig.from_dict({"model_type": "qwen3", "vocab_size": V, "hidden_size": 48, "intermediate_size": 80,
                               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "head_dim": 10, "sliding_window": 4, "use_sliding_window": False})
    assert c.qk_norm and c.head_dim == 10 and not c.attention_bias and c.sliding_window is None
    s = c.weight_shapes()
    assert s["model.layers.0.self_attn.q_norm.weight"] == (10,) and s["model.layers.0.self_attn.k_norm.weight"] == (10,)
    assert s["model.layers.0.self_attn.q_proj.weight"] == (40, 48)
    assert not ModelConfig.from_dict({**c.__dict__, "model_type": "qwen2", "source": None}).qk_norm
    w = {k: np.zeros(v, np.float32) for k, v in s.items() if "k_norm" not in k}
    with pytest.raises(ValueError, match=r"missing weights \['model.layers.0.self_attn.k_norm.weight'\]"):
        c.check_weights(w)


# ---------------------------------------------------------------------------------------------
# Against transformers and PEFT (torch)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch, transformers = torch_modules()
    root = tmp_path_factory.mktemp("qwen3")
    out = {}
    for i, (name, kw) in enumerate(CONFIGS.items()):
        cfg = transformers.Qwen3Config(vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
                                       rope_theta=10000.0, **kw)
        torch.manual_seed(i)
        m = transformers.Qwen3ForCausalLM(cfg)
        out[name] = save_random(m, root / name, 10 + i, norm_center=1.0)
    return out


def _batch(seed=0, B=2, T=13):
    return token_batch(V, seed, B, T)


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_matches_transformers(folders, name):
    folder = folders[name]
    assert ("lm_head.weight" in hf.read_tensors(folder)) != CONFIGS[name]["tie_word_embeddings"]
    ids, labels, targets = _batch()
    ref = torch_loss(hf_model(folder), ids, labels)
    for fused in (False, True):
        m = hf.load_model(folder, krnl.device("cpu"))
        m.fused_attention = fused
        assert m.loss(ids, targets) == pytest.approx(ref, rel=LOSS_RTOL), fused
    # Without the q/k norms the loss differs: the check above sees them.
    w = hf.load_hf_weights(folder)
    plain = {k: (np.ones(np.shape(v), np.float32) if "_norm." in k and "self_attn" in k else v) for k, v in w.items()}
    m = krnl.model.LlamaModel(krnl.device("cpu"), hf.read_config(folder), plain)
    assert abs(m.loss(ids, targets) - ref) > 1e-3


@pytest.mark.torch
@pytest.mark.parametrize("name, fused, ckpt", [("gqa", False, False), ("gqa", True, True), ("tied", True, False)])
def test_lora_gradients_match_peft(folders, name, fused, ckpt):
    """All seven targets; PyTorch autograd through PEFT's LoRA on transformers' model."""
    check_lora_gradients(folders[name], ALL_MODULES, CONFIGS[name]["num_hidden_layers"], _batch(2), LOSS_RTOL, GRAD_RTOL,
                         grad_checkpoint=ckpt, fused_attention=fused)


@pytest.mark.torch
def test_krnl_adapter_in_peft_and_fuse_in_transformers(folders, tmp_path):
    torch, _ = torch_modules()
    peft = pytest.importorskip("peft")
    folder = folders["gqa"]
    lora = LoraConfig(r=2, alpha=6.0, target_modules=ALL_MODULES, layers=[0, 2])
    m = hf.load_model(folder, krnl.device("cpu"), lora=lora)
    st = random_b(m, 3)
    krnl.adapter.save_adapter(tmp_path / "ad", st, krnl.adapter.peft_config(lora, str(folder), lora.layers))
    ids, labels, targets = _batch(4)
    mine = m.loss(ids, targets)
    assert abs(mine - torch_loss(hf_model(folder), ids, labels)) > 1e-2  # the adapter matters
    pm = peft.PeftModel.from_pretrained(hf_model(folder), str(tmp_path / "ad")).eval()
    assert torch_loss(pm, ids, labels) == pytest.approx(mine, rel=LOSS_RTOL)

    hf.fuse(folder, tmp_path / "ad", tmp_path / "fused")
    t = hf.read_tensors(tmp_path / "fused")
    assert "model.layers.1.self_attn.k_norm.weight" in t and "model.layers.2.self_attn.q_norm.weight" in t
    assert torch_loss(hf_model(tmp_path / "fused"), ids, labels) == pytest.approx(mine, rel=LOSS_RTOL)


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(folders, name):
    torch, _ = torch_modules()
    prompt = [5, 17, 3, 40, 9]
    ref = hf_model(folders[name])
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    got = hf.load_model(folders[name], krnl.device("cpu")).generate(prompt, max_new_tokens=9)
    assert got == want and len(set(want)) > 1


@pytest.mark.torch
def test_cli_trains_a_qwen3_folder(folders, tmp_path, capsys):
    from krnl.cli import main

    write_data(tmp_path / "data")
    out = tmp_path / "ad"
    assert main(["train", "--model", str(folders["gqa"]), "--data", str(tmp_path / "data"), "--device", "cpu",
                 "--dtype", "f32", "--iters", "3", "--batch-size", "2", "--lora-rank", "2", "--steps-per-eval", "0",
                 "--quiet", "--no-tune", "--adapter-path", str(out)]) == 0
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(np.isfinite(losses))
    ac = json.loads((out / "adapter_config.json").read_text())
    assert ac["r"] == 2 and (out / "adapter_model.safetensors").exists()
    lora, tensors, _ = krnl.adapter.read_adapter(out, hf.read_config(folders["gqa"]))
    assert lora_key(2, "down_proj", "B") in tensors


# ---------------------------------------------------------------------------------------------
# metal-sim and mlx-lm

QWEN3_TINY = dict(model_type="qwen3", num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # hidden 32


@pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")
def test_training_step_on_metal_sim_matches_cpu():
    """One forward/backward of a tiny Qwen3 (q/k norms, GQA, head_dim 8 with hidden 32 over 2
    heads) on metal-sim against the CPU backend, f32: summation order only."""
    rng = np.random.default_rng(7)
    ids, targets = rng.integers(0, 61, (2, 9)), rng.integers(0, 61, (2, 9))
    loss_c, g_c = lora_step(tiny_lora_model(krnl.device("cpu"), "f32", **QWEN3_TINY), ids, targets)
    loss_d, g_d = lora_step(tiny_lora_model(krnl.device("metal-sim"), "f32", **QWEN3_TINY), ids, targets)
    assert abs(loss_d - loss_c) <= 1e-5 * abs(loss_c), (loss_d, loss_c)
    assert g_c.keys() == g_d.keys()
    for k in g_c:
        scale = float(np.max(np.abs(g_c[k])))
        assert scale > 0, k
        assert float(np.max(np.abs(g_d[k] - g_c[k]))) <= 4e-5 * scale, k


@pytest.mark.mlx
def test_mlx_quantized_qwen3_matches_mlx_lm(tmp_path):
    """mlx_lm.convert -q of a Qwen3 folder (the q/k norms stay float): krnl's loss equals mlx-lm's."""
    pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import mlx.nn as nn

    def mlx_loss(path, ids):  # mlx-lm's mean next-token cross entropy, the model in f32
        model, _ = mlx_lm.load(str(path))
        model.set_dtype(mx.float32)
        logits = model(mx.array(ids[:, :-1])).astype(mx.float32)
        return nn.losses.cross_entropy(logits, mx.array(ids[:, 1:])).mean().item()

    base = make_base(tmp_path / "base", model_type="qwen3", head_dim=24, num_hidden_layers=3,  # o_proj in 96
                     rope_theta=10000.0)
    mlx_lm.convert(str(base), str(tmp_path / "q"), quantize=True, q_bits=4, q_group_size=32)
    w = hf.load_hf_weights(tmp_path / "q")
    assert isinstance(w["model.layers.0.self_attn.o_proj.weight"], krnl.qweight.QuantizedArray)
    assert not isinstance(w["model.layers.0.self_attn.q_norm.weight"], krnl.qweight.QuantizedArray)
    m = hf.load_model(tmp_path / "q", krnl.device("cpu"), dtype="f32")
    for seed in range(2):
        ids = np.random.default_rng(seed).integers(0, V, (2, 14)).astype(np.int32)
        assert m.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(mlx_loss(tmp_path / "q", ids), rel=1e-4)
