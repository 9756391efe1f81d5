"""Gemma 3 text (model_type "gemma3_text", Gemma3ForCausalLM) end to end: Gemma 2's layer with q/k
RMSNorm per head ((1 + w)), no soft-capping, and rotary frequencies per layer type (sliding layers
`rope_local_base_freq` unscaled, full layers `rope_theta` with linear `rope_scaling`). Tiny random
folders written by transformers (windows shorter than the sequence, a full-attention layer, GQA):
krnl's loss equals transformers'; LoRA gradients equal PyTorch autograd through PEFT; krnl adapters
load in PEFT and `fuse` output loads in transformers; KV-cached greedy decoding gives transformers'
tokens; the CLI trains; one step on metal-sim equals the CPU backend. The multimodal checkpoints:
tests/test_gemma3_multimodal.py.

Tolerances as tests/test_gemma2.py: losses in f32 within 1e-5 relative, gradients within 1e-4 of
the largest gradient of their tensor."""

import json

import numpy as np
import pytest

import krnl
from krnl import hf
from krnl.model import ALL_MODULES, LoraConfig, ModelConfig, lora_key

from conftest import METAL_SIM, lora_step, tiny_lora_model
from hf_families import (check_lora_gradients, hf_model, random_b, save_random, token_batch, torch_loss,
                         torch_modules)
from mlx_folders import write_data

V = 61
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
T = 13  # longer than every window below
# GQA (4 query heads on 2 KV heads), head_dim 10; window 5 < T; layer 2 of 3 full ("pattern", as
# sliding_window_pattern 3 gives) or layer types given; global layers' rope scaled by a linear
# factor 8 with rope_theta 1e6 against a local base of 1e4 (as the 4B-27B checkpoints).
CONFIGS = {
    "pattern": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=10, sliding_window=5, query_pre_attn_scalar=7,
                    sliding_window_pattern=3, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                    rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "types": dict(hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=24, sliding_window=4, query_pre_attn_scalar=24,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                  rope_theta=50_000.0, rope_local_base_freq=300.0),
}
BASE = {"model_type": "gemma3_text", "vocab_size": V, "hidden_size": 48, "intermediate_size": 80,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 10,
        "sliding_window": 5, "query_pre_attn_scalar": 16, "tie_word_embeddings": True}


def test_config_reads_gemma3_text():
    old = ModelConfig.from_dict({**BASE, "sliding_window_pattern": 2, "rope_theta": 1e6,
                                 "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert old.gemma == {"attn_scale": 0.25, "attn_softcap": 0.0, "final_softcap": 0.0, "windows": [5, 0, 5, 0],
                         "local_theta": 1e4}
    assert old.rope_theta == 1e6 and old.rope_scaling["factor"] == 8.0 and old.qk_norm
    assert old.weight_shapes()["model.layers.3.self_attn.k_norm.weight"] == (10,)
    # transformers 5 writes rope_parameters per layer type; the default pattern is 6
    new = ModelConfig.from_dict({**BASE, "num_hidden_layers": 7, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert new.gemma["windows"] == [5] * 5 + [0, 5] and new.gemma["local_theta"] == 1e4
    assert new.rope_theta == 1e6 and new.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    plain = ModelConfig.from_dict({**BASE, "rope_parameters": {"full_attention": {"rope_type": "default",
                                                                                  "rope_theta": 5e5}}})
    assert plain.rope_scaling is None and plain.rope_theta == 5e5 and plain.gemma["local_theta"] == 1e4
    with pytest.raises(ValueError, match=r"use_bidirectional_attention is not supported"):
        ModelConfig.from_dict({**BASE, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match=r"sliding_window_pattern' must be an integer >= 1"):
        ModelConfig.from_dict({**BASE, "sliding_window_pattern": 0})


# ---------------------------------------------------------------------------------------------
# Against transformers and PEFT (torch)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch, transformers = torch_modules()
    root = tmp_path_factory.mktemp("gemma3")
    out = {}
    for i, (name, kw) in enumerate(CONFIGS.items()):
        cfg = transformers.Gemma3TextConfig(vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
                                            tie_word_embeddings=True, **kw)
        torch.manual_seed(i)
        m = transformers.Gemma3ForCausalLM(cfg)
        out[name] = save_random(m, root / name, 20 + i, norm_center=0.0)
    return out


def _batch(seed=0, B=2):
    return token_batch(V, seed, B, T)


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_matches_transformers(folders, name):
    torch, _ = torch_modules()
    folder = folders[name]
    c = hf.read_config(folder)
    assert c.model_type == "gemma3_text" and set(c.gemma["windows"]) == {0, CONFIGS[name]["sliding_window"]}
    ids, labels, targets = _batch()
    ref_model = hf_model(folder)
    ref = torch_loss(ref_model, ids, labels)
    # no soft-capping: the fused op (with its window) or the materialised path, in row blocks of 4
    for fused, block in ((False, 0), (True, 0), (False, 4)):
        m = hf.load_model(folder, krnl.device("cpu"))
        m.fused_attention, m.attn_block = fused, block
        assert m.loss(ids, targets) == pytest.approx(ref, rel=LOSS_RTOL), (fused, block)
    with torch.no_grad():
        want = ref_model(torch.tensor(ids)).logits.numpy()
    assert np.abs(m.logits(ids) - want).max() <= 1e-5 * np.abs(want).max()
    # Each Gemma 3 piece matters: the local base, the global scaling, the windows, the q/k norms.
    w = hf.load_hf_weights(folder)
    changes = [{"rope_local_base_freq": 77.0}, {"sliding_window": 64}, "qk"]
    if name == "pattern":
        changes.append({"rope_scaling": None})
    for change in changes:
        cfg = json.loads((folder / "config.json").read_text())
        ww = dict(w)
        if change == "qk":
            ww = {k: (np.zeros_like(np.asarray(v)) if "_norm." in k and "self_attn" in k else v) for k, v in w.items()}
        else:
            cfg.pop("rope_parameters", None)
            cfg.update({"rope_theta": CONFIGS[name]["rope_theta"], "rope_local_base_freq":
                        CONFIGS[name]["rope_local_base_freq"], "rope_scaling": CONFIGS[name].get("rope_scaling")})
            cfg.update(change)
        other = krnl.model.LlamaModel(krnl.device("cpu"), ModelConfig.from_dict(hf.normalize_config(cfg)), ww)
        assert abs(other.loss(ids, targets) - ref) > 1e-4, change


@pytest.mark.torch
def test_sliding_layers_rotate_with_the_local_base(folders):
    """Sliding layers hold their own unscaled frequencies; full layers the model's (scaled)."""
    c = hf.read_config(folders["pattern"])
    m = hf.load_model(folders["pattern"], krnl.device("cpu"))
    D = c.head_dim
    local = 1.0 / 1e4 ** (np.arange(0, D, 2) / D)
    for L, wnd in zip(m.layers, c.gemma["windows"]):
        got = np.asarray(L.heads.inv_freq.numpy(), np.float64)
        want = local if wnd else 1.0 / 1e6 ** (np.arange(0, D, 2) / D) / 8.0
        assert np.allclose(got, want, rtol=1e-6), wnd


@pytest.mark.torch
def test_qk_norms_fold_one_in_f32(folders):
    w = hf.read_tensors(folders["types"])
    m = hf.load_model(folders["types"], krnl.device("cpu"), dtype="bf16")
    for t, name in ((m.layers[2].q_norm, "q_norm"), (m.layers[2].k_norm, "k_norm")):
        assert t.dtype == "f32"
        want = 1.0 + np.asarray(w[f"model.layers.2.self_attn.{name}.weight"], np.float32)
        assert np.array_equal(np.asarray(t.numpy()), want), name


@pytest.mark.torch
@pytest.mark.parametrize("name, ckpt, fused", [("pattern", False, True), ("pattern", False, False),
                                               ("types", True, False)])
def test_lora_gradients_match_peft(folders, name, ckpt, fused):
    check_lora_gradients(folders[name], ALL_MODULES, CONFIGS[name]["num_hidden_layers"], _batch(2), LOSS_RTOL, GRAD_RTOL,
                         grad_checkpoint=ckpt, fused_attention=fused)


@pytest.mark.torch
def test_krnl_adapter_in_peft_and_fuse_in_transformers(folders, tmp_path):
    peft = pytest.importorskip("peft")
    folder = folders["pattern"]
    lora = LoraConfig(r=2, alpha=6.0, target_modules=ALL_MODULES, layers=[0, 2])
    m = hf.load_model(folder, krnl.device("cpu"), lora=lora)
    st = random_b(m, 3)
    krnl.adapter.save_adapter(tmp_path / "ad", st, krnl.adapter.peft_config(lora, str(folder), lora.layers))
    ids, labels, targets = _batch(4)
    mine = m.loss(ids, targets)
    assert abs(mine - torch_loss(hf_model(folder), ids, labels)) > 1e-3  # the adapter matters
    pm = peft.PeftModel.from_pretrained(hf_model(folder), str(tmp_path / "ad")).eval()
    assert torch_loss(pm, ids, labels) == pytest.approx(mine, rel=LOSS_RTOL)

    hf.fuse(folder, tmp_path / "ad", tmp_path / "fused")
    t, orig = hf.read_tensors(tmp_path / "fused"), hf.read_tensors(folder)
    for n in ("model.norm.weight", "model.layers.1.self_attn.q_norm.weight",
              "model.layers.2.self_attn.k_norm.weight"):  # the original w, not 1 + w
        assert np.array_equal(np.asarray(t[n], np.float32), np.asarray(orig[n], np.float32)), n
    assert torch_loss(hf_model(tmp_path / "fused"), ids, labels) == pytest.approx(mine, rel=LOSS_RTOL)


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(folders, name):
    """9 new tokens after 5: the cache grows past every sliding window."""
    torch, _ = torch_modules()
    prompt = {"pattern": [7, 7, 30, 2, 44], "types": [59, 8, 33, 17, 40]}[name]  # tokens whose continuation varies
    ref = hf_model(folders[name])
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    got = hf.load_model(folders[name], krnl.device("cpu")).generate(prompt, max_new_tokens=9)
    assert got == want and len(set(want)) > 1


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decode_logits_match_transformers(folders, name):
    torch, _ = torch_modules()
    from krnl.generate import KVCache, decode

    ids = np.random.default_rng(6).integers(0, V, T)
    with torch.no_grad():
        want = hf_model(folders[name])(torch.tensor(ids[None])).logits[0].numpy()
    m = hf.load_model(folders[name], krnl.device("cpu"))
    cache = KVCache(m.dev, m.dtype, len(m.layers), m.heads, T, [L.gemma for L in m.layers])
    got = [decode(m, list(ids[:4]), 0, cache)] + [decode(m, [int(ids[t])], t, cache) for t in range(4, T)]
    assert np.abs(np.stack(got) - want[3:]).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.torch
def test_cli_trains_a_gemma3_text_folder(folders, tmp_path):
    from krnl.cli import main

    write_data(tmp_path / "data")
    out = tmp_path / "ad"
    assert main(["train", "--model", str(folders["pattern"]), "--data", str(tmp_path / "data"), "--device", "cpu",
                 "--dtype", "f32", "--iters", "3", "--batch-size", "2", "--lora-rank", "2", "--steps-per-eval", "0",
                 "--quiet", "--no-tune", "--adapter-path", str(out)]) == 0
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(np.isfinite(losses))
    lora, tensors, _ = krnl.adapter.read_adapter(out, hf.read_config(folders["pattern"]))
    assert lora_key(2, "down_proj", "B") in tensors


# ---------------------------------------------------------------------------------------------
# metal-sim

GEMMA3_TINY = dict(model_type="gemma3_text", num_attention_heads=2, num_key_value_heads=1, head_dim=8,  # hidden 32
                   sliding_window=4, query_pre_attn_scalar=8, sliding_window_pattern=2, rope_theta=1e6,
                   rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                   tie_word_embeddings=True)


@pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")
@pytest.mark.parametrize("dtype, tol", [("f32", 1e-5), ("bf16", 3e-2)])
def test_training_step_on_metal_sim_matches_cpu(dtype, tol):
    """One forward/backward of a tiny Gemma 3 (window 4 < T = 9 on layer 0, q/k norms, both rotary
    bases, GQA) on metal-sim against the CPU backend in the same dtype: bf16 against f32 moves the
    q-projection gradients by up to 18% here (the per-head q/k norms of D = 8 features round
    coarsely, measured on the CPU alone), so both backends round at the same points instead."""
    rng = np.random.default_rng(7)
    ids, targets = rng.integers(0, 61, (2, 9)), rng.integers(0, 61, (2, 9))
    loss_c, g_c = lora_step(tiny_lora_model(krnl.device("cpu"), dtype, **GEMMA3_TINY), ids, targets)
    loss_d, g_d = lora_step(tiny_lora_model(krnl.device("metal-sim"), dtype, **GEMMA3_TINY), ids, targets)
    assert abs(loss_d - loss_c) <= tol * abs(loss_c), (loss_d, loss_c)
    assert g_c.keys() == g_d.keys()
    for k in g_c:
        scale = float(np.max(np.abs(g_c[k])))
        assert scale > 0, k
        assert float(np.max(np.abs(g_d[k] - g_c[k]))) <= 4 * tol * scale, k


@pytest.mark.mlx
def test_mlx_quantized_gemma3_text_matches_mlx_lm(tmp_path):
    """mlx_lm.convert -q of a gemma3_text folder (window 6, layer 2 of 3 full, scaled global rope):
    krnl's loss equals mlx-lm's, for sequences within and past the window."""
    pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_folders import make_base

    def mlx_loss(path, ids):  # mlx-lm's mean next-token cross entropy, the model in f32
        model, _ = mlx_lm.load(str(path))
        model.set_dtype(mx.float32)
        logits = model(mx.array(ids[:, :-1])).astype(mx.float32)
        return nn.losses.cross_entropy(logits, mx.array(ids[:, 1:])).mean().item()

    base = make_base(tmp_path / "base", model_type="gemma3_text", head_dim=32, num_hidden_layers=3, rope_theta=1e6,
                     rope_local_base_freq=1e4, tie_word_embeddings=True, sliding_window=6, sliding_window_pattern=3,
                     query_pre_attn_scalar=32, rope_scaling={"rope_type": "linear", "factor": 8.0})
    # transformers would pick Gemma's own tokenizer class for a gemma3 folder; ours is a plain one
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>",
                                                             "tokenizer_class": "PreTrainedTokenizerFast"}))
    mlx_lm.convert(str(base), str(tmp_path / "q"), quantize=True, q_bits=4, q_group_size=32)
    m = hf.load_model(tmp_path / "q", krnl.device("cpu"), dtype="f32")
    for seed, n in ((0, 5), (1, 14)):
        ids = np.random.default_rng(seed).integers(0, V, (2, n)).astype(np.int32)
        assert m.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(mlx_loss(tmp_path / "q", ids), rel=1e-4)
