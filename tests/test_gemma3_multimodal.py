"""Gemma 3's multimodal checkpoints (model_type "gemma3", Gemma3ForConditionalGeneration): krnl trains
the text tower of a tiny one (the smallest SigLIP vision tower transformers builds): loss and LoRA
gradients equal transformers' and PyTorch autograd through PEFT (the vision tower excluded); krnl
adapters carry PEFT's names for the multimodal model and load in PEFT; `fuse` writes the stored
layout with the vision weights copied and loads in transformers; greedy decoding and the CLI.
Tolerances as tests/test_families.py."""

import json

import numpy as np
import pytest
from safetensors import safe_open

import krnl
from krnl.formats import hf
from krnl.models.config import ALL_MODULES, LoraConfig, ModelConfig, lora_key

from conftest import lora_step
from hf_families import assert_peft_gradients, random_b, save_random, token_batch, torch_loss, torch_modules
from mlx_folders import write_data

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
T = 13  # longer than the window below


def _batch(seed=0, B=2):
    return token_batch(61, seed, B, T)


# Text ids stay below the image, begin- and end-of-image tokens (61-63), which need pixel values.
MM_TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, sliding_window=4, sliding_window_pattern=2,
               query_pre_attn_scalar=16, rope_theta=1e6, rope_local_base_freq=1e4,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=64, rms_norm_eps=1e-6)
# The smallest SigLIP tower transformers builds: one layer, a 28-pixel image of 2 x 2 patches.
MM_VISION = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                 patch_size=14)


def test_config_fills_transformers_defaults():
    """The 4B checkpoint's text_config gives little more than its sizes: the rest is transformers'."""
    c = ModelConfig.from_dict({"model_type": "gemma3", "vision_config": {}, "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}})
    assert c.multimodal and (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (8, 4, 256)
    assert c.vocab_size == 262208
    assert c.max_position_embeddings == 131072 and c.tie_word_embeddings and c.gemma["attn_scale"] == 256 ** -0.5
    assert c.layer_windows[:6] == [1024] * 5 + [0] and c.rope_theta == 1e6 and c.gemma["local_theta"] == 1e4


def test_text_tower_names_both_layouts():
    from krnl.models.gemma3 import peft_keys_in, peft_keys_out, text_tower

    stored = ["language_model.model.layers.0.mlp.up_proj.weight", "model.language_model.norm.weight",
              "language_model.lm_head.weight", "vision_tower.encoder.layers.0.self_attn.q_proj.weight",
              "model.multi_modal_projector.mm_input_projection_weight"]
    text, names, rest = text_tower({k: i for i, k in enumerate(stored)})
    assert text == {"model.layers.0.mlp.up_proj.weight": 0, "model.norm.weight": 1, "lm_head.weight": 2}
    assert names["model.norm.weight"] == stored[1] and sorted(rest) == sorted(stored[3:])
    key = lora_key(4, "q_proj", "A")
    peft_key = "base_model.model.model.language_model.layers.4.self_attn.q_proj.lora_A.weight"
    assert peft_keys_out({key: 1}) == {peft_key: 1}
    assert peft_keys_in({"base_model.model.language_model.model.layers.4.self_attn.q_proj.lora_A.weight": 1,
                         **peft_keys_out({lora_key(1, "o_proj", "B"): 2})}) == {key: 1, lora_key(1, "o_proj", "B"): 2}


@pytest.fixture(scope="module")
def mm_folder(tmp_path_factory):
    torch, transformers = torch_modules()
    cfg = transformers.Gemma3Config(text_config=MM_TEXT, vision_config=MM_VISION, mm_tokens_per_image=4,
                                    boi_token_index=61, eoi_token_index=62, image_token_index=63)
    torch.manual_seed(5)
    return save_random(transformers.Gemma3ForConditionalGeneration(cfg), tmp_path_factory.mktemp("gemma3mm") / "m",
                       30, norm_center=0.0)


def mm_model(folder):
    torch, transformers = torch_modules()
    return transformers.Gemma3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32,
                                                                       attn_implementation="eager").eval()


@pytest.mark.torch
def test_multimodal_loss_matches_transformers(mm_folder):
    torch, _ = torch_modules()
    c = hf.read_config(mm_folder)
    assert c.multimodal and c.model_type == "gemma3_text" and c.layer_windows == [4, 0, 4]
    assert any(k.startswith("vision_tower.") for k in hf.read_tensors(mm_folder))
    ids, labels, targets = _batch(1)
    ref_model = mm_model(mm_folder)
    ref = torch_loss(ref_model, ids, labels)
    for fused in (False, True):
        m = hf.load_model(mm_folder, krnl.device("cpu"))
        m.fused_attention = fused
        assert m.loss(ids, targets) == pytest.approx(ref, rel=LOSS_RTOL), fused
    with torch.no_grad():
        want = ref_model(torch.tensor(ids)).logits.numpy()
    assert np.abs(m.logits(ids) - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.torch
def test_multimodal_lora_gradients_match_peft(mm_folder):
    from krnl.models.gemma3 import EXCLUDE, peft_keys_out

    lora = LoraConfig(r=3, alpha=5.0, target_modules=ALL_MODULES)
    m = hf.load_model(mm_folder, krnl.device("cpu"), lora=lora)
    st = random_b(m, 1)
    ids, labels, targets = _batch(2)
    loss, grads = lora_step(m, ids, targets)
    torch, transformers = torch_modules()
    old = transformers.AutoModelForCausalLM.from_pretrained  # hf_model's loader, the multimodal class here
    transformers.AutoModelForCausalLM.from_pretrained = lambda f, **kw: mm_model(f)
    try:
        assert_peft_gradients(mm_folder, lora, peft_keys_out(st), ids, labels, loss, peft_keys_out(grads),
                              2 * 7 * 3, LOSS_RTOL, GRAD_RTOL, exclude_modules=EXCLUDE)
    finally:
        transformers.AutoModelForCausalLM.from_pretrained = old


@pytest.mark.torch
def test_multimodal_adapter_in_peft_and_fuse_in_transformers(mm_folder, tmp_path):
    peft = pytest.importorskip("peft")
    lora = LoraConfig(r=2, alpha=6.0, target_modules=ALL_MODULES, layers=[0, 2])
    m = hf.load_model(mm_folder, krnl.device("cpu"), lora=lora)
    st = random_b(m, 3)
    cfg = krnl.formats.adapter.peft_config(lora, str(mm_folder), lora.layers, m.config)
    krnl.formats.adapter.save_adapter(tmp_path / "ad", st, cfg, m.config)
    with safe_open(str(tmp_path / "ad" / "adapter_model.safetensors"), "np") as f:
        keys = set(f.keys())  # PEFT's names on Gemma3ForConditionalGeneration
    assert "base_model.model.model.language_model.layers.2.mlp.down_proj.lora_B.weight" in keys and len(keys) == 28
    ids, labels, targets = _batch(4)
    mine = m.loss(ids, targets)
    assert abs(mine - torch_loss(mm_model(mm_folder), ids, labels)) > 1e-3  # the adapter matters
    pm = peft.PeftModel.from_pretrained(mm_model(mm_folder), str(tmp_path / "ad")).eval()
    adapted = {n for n, _ in pm.named_modules() if n.endswith(".lora_A")}
    assert len(adapted) == 14 and all("language_model" in n for n in adapted)  # not the vision tower
    assert torch_loss(pm, ids, labels) == pytest.approx(mine, rel=LOSS_RTOL)
    _, tensors, _ = krnl.formats.adapter.read_adapter(tmp_path / "ad", m.config)  # krnl reads it back
    assert set(tensors) == set(st) and all(np.array_equal(tensors[k], st[k]) for k in st)

    hf.fuse(mm_folder, tmp_path / "ad", tmp_path / "fused")
    t, orig = hf.read_tensors(tmp_path / "fused"), hf.read_tensors(mm_folder)
    assert set(t) == set(orig) - {"language_model.lm_head.weight"}  # the stored layout, vision included
    for n in (k for k in orig if k.startswith("vision_tower.") or k.startswith("multi_modal_projector.")):
        assert np.array_equal(np.asarray(t[n], np.float32), np.asarray(orig[n], np.float32)), n
    assert json.loads((tmp_path / "fused" / "config.json").read_text())["model_type"] == "gemma3"
    assert torch_loss(mm_model(tmp_path / "fused"), ids, labels) == pytest.approx(mine, rel=LOSS_RTOL)


@pytest.mark.torch
def test_multimodal_refusals(mm_folder, tmp_path):
    """One-line errors: no text_config; mlx-lm's adapter layout; fuse --q-bits."""
    with pytest.raises(ValueError, match=r"^\[ModelConfig\] <dict>: a gemma3 config needs a 'text_config' object$"):
        ModelConfig.from_dict({"model_type": "gemma3"})
    lora = LoraConfig(r=2, alpha=4.0)
    m = hf.load_model(mm_folder, krnl.device("cpu"), lora=lora)
    with pytest.raises(ValueError, match=r"^\[adapter\] mlx-lm's layout of a multimodal gemma3 adapter"):
        krnl.formats.adapter.mlx_adapter(lora, m.lora_state(), m.config)
    krnl.formats.adapter.save_adapter(tmp_path / "ad", m.lora_state(), krnl.formats.adapter.peft_config(lora, "", None, m.config),
                              m.config)
    with pytest.raises(ValueError, match=r"^\[fuse\] .* is a multimodal gemma3 model; fuse it without --q-bits$"):
        hf.fuse(mm_folder, tmp_path / "ad", tmp_path / "q", quantize=(4, 32))


@pytest.mark.torch
def test_multimodal_greedy_generation_matches_transformers(mm_folder):
    torch, _ = torch_modules()
    prompt = [59, 8, 33, 17, 40]
    ref = mm_model(mm_folder)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    got = hf.load_model(mm_folder, krnl.device("cpu")).generate(prompt, max_new_tokens=9)
    assert got == want and len(set(want)) > 1


@pytest.mark.torch
def test_cli_trains_a_multimodal_gemma3_folder(mm_folder, tmp_path):
    from krnl.cli.main import main

    write_data(tmp_path / "data")
    out = tmp_path / "ad"
    assert main(["train", "--model", str(mm_folder), "--data", str(tmp_path / "data"), "--device", "cpu",
                 "--dtype", "f32", "--iters", "3", "--batch-size", "2", "--lora-rank", "2", "--steps-per-eval", "0",
                 "--quiet", "--no-tune", "--adapter-path", str(out)]) == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["exclude_modules"] == krnl.models.gemma3.EXCLUDE
    lora, tensors, _ = krnl.formats.adapter.read_adapter(out, hf.read_config(mm_folder))
    assert lora_key(2, "down_proj", "B") in tensors
