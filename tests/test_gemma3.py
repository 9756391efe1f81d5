"""Gemma 3 text (model_type "gemma3_text", Gemma3ForCausalLM): Gemma 2's layer with q/k RMSNorm per
head ((1 + w)), no soft-capping, and rotary frequencies per layer type (sliding layers
`rope_local_base_freq` unscaled, full layers `rope_theta` with linear `rope_scaling`). What Gemma 3
adds to the checks every family passes (tests/test_families.py: loss and logits, PEFT gradients and
adapters, fuse, generation and cached decoding, CLI, metal-sim, mlx-lm): its config; each piece
(local base, global scaling, windows, q/k norms) moves the loss; sliding layers rotate with the
local base; the q/k norms fold 1 + w in f32. The multimodal checkpoints:
tests/test_gemma3_multimodal.py."""

import json

import numpy as np
import pytest

import krnl
from krnl.formats import hf
from krnl.models.config import ModelConfig

from hf_families import FOLDERS, V, family_batch, family_folders, hf_model, torch_loss

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
CONFIGS = FOLDERS["gemma3"]["configs"]
_batch = family_batch
BASE = {"model_type": "gemma3_text", "vocab_size": V, "hidden_size": 48, "intermediate_size": 80,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 10,
        "sliding_window": 5, "query_pre_attn_scalar": 16, "tie_word_embeddings": True}


def test_config_reads_gemma3_text():
    old = ModelConfig.from_dict({**BASE, "sliding_window_pattern": 2, "rope_theta": 1e6,
                                 "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert old.gemma == {"attn_scale": 0.25, "attn_softcap": 0.0, "final_softcap": 0.0, "local_theta": 1e4}
    assert old.layer_windows == [5, 0, 5, 0]
    assert old.rope_theta == 1e6 and old.rope_scaling["factor"] == 8.0 and old.qk_norm
    assert old.weight_shapes()["model.layers.3.self_attn.k_norm.weight"] == (10,)
    # transformers 5 writes rope_parameters per layer type; the default pattern is 6
    new = ModelConfig.from_dict({**BASE, "num_hidden_layers": 7, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert new.layer_windows == [5] * 5 + [0, 5] and new.gemma["local_theta"] == 1e4
    assert new.rope_theta == 1e6 and new.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    plain = ModelConfig.from_dict({**BASE, "rope_parameters": {"full_attention": {"rope_type": "default",
                                                                                  "rope_theta": 5e5}}})
    assert plain.rope_scaling is None and plain.rope_theta == 5e5 and plain.gemma["local_theta"] == 1e4
    with pytest.raises(ValueError, match=r"use_bidirectional_attention is not supported"):
        ModelConfig.from_dict({**BASE, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match=r"sliding_window_pattern' must be an integer >= 1"):
        ModelConfig.from_dict({**BASE, "sliding_window_pattern": 0})


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return family_folders(tmp_path_factory, "gemma3")


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_gemma3_piece_moves_the_loss(folders, name):
    """Without the local base, the global scaling, the windows or the q/k norms the loss moves
    (test_families' loss check sees them)."""
    folder = folders[name]
    ids, labels, targets = _batch()
    ref = torch_loss(hf_model(folder), ids, labels)
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
        other = krnl.models.model.LlamaModel(krnl.device("cpu"), ModelConfig.from_dict(hf.normalize_config(cfg)), ww)
        assert abs(other.loss(ids, targets) - ref) > 1e-4, change


@pytest.mark.torch
def test_sliding_layers_rotate_with_the_local_base(folders):
    """Sliding layers hold their own unscaled frequencies; full layers the model's (scaled)."""
    c = hf.read_config(folders["pattern"])
    m = hf.load_model(folders["pattern"], krnl.device("cpu"))
    D = c.head_dim
    local = 1.0 / 1e4 ** (np.arange(0, D, 2) / D)
    for L, wnd in zip(m.layers, c.layer_windows):
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
