"""Qwen3 (model_type "qwen3"): per-head RMSNorm of q and k before rotary, head_dim independent of
hidden_size / heads, tied and untied heads. What Qwen3 adds to the checks every family passes
(tests/test_families.py: loss, PEFT gradients and adapters, fuse, generation, CLI, metal-sim,
mlx-lm): its config, and that the loss matches transformers' only with the q/k norms."""

import numpy as np
import pytest

import krnl
from krnl.formats import hf
from krnl.models.config import ModelConfig

from hf_families import V, family_batch, family_folders, hf_model, torch_loss

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


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


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return family_folders(tmp_path_factory, "qwen3")


@pytest.mark.torch
@pytest.mark.parametrize("name", ["gqa", "tied"])
def test_loss_needs_the_qk_norms(folders, name):
    """Without the q/k norms the loss differs: test_families' loss check sees them."""
    folder = folders[name]
    ids, labels, targets = family_batch()
    ref = torch_loss(hf_model(folder), ids, labels)
    w = hf.load_hf_weights(folder)
    plain = {k: (np.ones(np.shape(v), np.float32) if "_norm." in k and "self_attn" in k else v) for k, v in w.items()}
    m = krnl.models.model.LlamaModel(krnl.device("cpu"), hf.read_config(folder), plain)
    assert abs(m.loss(ids, targets) - ref) > 1e-3
