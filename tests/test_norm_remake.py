"""norm_remake: each layer's norm outputs (xn, hn) and LoRA dropout's copies of them, dropped after
the forward and made again in the backward, give the loss and gradients of a run that holds them,
bit for bit, on every path that reads them (grouped, folded, one by one, dropout, DoRA, full
fine-tuning, experts, checkpointing); and a step's live peak drops by about two (N, C) buffers a
layer (five with dropout)."""

from dataclasses import replace

import numpy as np
import pytest

import krnl
from krnl.models import norm_remake
from krnl.models.config import LoraConfig, ModelConfig, random_weights
from krnl.models.model import LlamaModel

LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
MOE = dict(LLAMA, model_type="qwen3_moe", num_experts=5, num_experts_per_tok=2, moe_intermediate_size=48)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CASES = {
    "grouped, f32": dict(cfg=LLAMA, lora=LoraConfig(r=4, alpha=8.0, target_modules=ALL)),
    "folded, bf16": dict(cfg=LLAMA, lora=LoraConfig(r=4, alpha=8.0, target_modules=ALL), dtype="bf16", fold=True),
    "q and v one by one, checkpointed": dict(cfg=LLAMA, lora=LoraConfig(r=3, target_modules=("q_proj", "v_proj",
                                                                                          "up_proj")), ckpt=True),
    "dropout": dict(cfg=LLAMA, lora=LoraConfig(r=4, dropout=0.2, target_modules=ALL)),
    "DoRA, bf16": dict(cfg=LLAMA, lora=LoraConfig(r=4, use_dora=True, target_modules=ALL), dtype="bf16"),
    "full fine-tuning": dict(cfg=LLAMA, lora=LoraConfig(full=True)),
    "experts and router": dict(cfg=MOE, lora=LoraConfig(r=4, target_modules=ALL[:4] + ("gate_up_proj", "down_proj",
                                                                                           "router"))),
}


def step(dev, cfg, lora, dtype, ckpt, keep):
    """(loss, {name: gradient}, the step's live peak) of one forward and backward; keep: xn and hn
    held through the step (norm_remake.drop made a no-op)."""
    config = ModelConfig.from_dict(cfg)
    m = LlamaModel(dev, config, random_weights(config, seed=1), lora=replace(lora), dtype=dtype,
                   grad_checkpoint=ckpt, seed=2)
    rng = np.random.default_rng(3)
    if not lora.full:  # B away from zero, so that every A has a gradient
        m.lora_params.load({k: v + 0.05 * rng.standard_normal(v.shape) for k, v in m.lora_state().items()})
    ids = rng.integers(0, config.vocab_size, (2, 40)).astype(np.int32)
    dev.synchronize()
    dev.reset_peak()
    base = dev.pool_stats()["in_use"]
    with pytest.MonkeyPatch.context() as mp:
        if keep:
            mp.setattr(norm_remake, "drop", lambda saved, xn, fold=None: list(saved))
        m.forward_backward(ids, np.roll(ids, -1, 1))
        loss = m.read_loss()
    peak = dev.pool_stats()["peak_in_use"] - base
    grads = m.lora_grads()
    return loss, grads, peak


@pytest.mark.parametrize("case", list(CASES))
def test_norm_outputs_made_again_give_the_same_gradients(case, monkeypatch):
    kw = dict(CASES[case])
    monkeypatch.setenv("KRNL_LORA_FOLD", "1" if kw.pop("fold", False) else "0")
    dev = krnl.device("cpu")
    cfg, lora, dtype, ckpt = kw["cfg"], kw["lora"], kw.get("dtype", "f32"), kw.get("ckpt", False)
    loss_k, grads_k, peak_k = step(dev, cfg, lora, dtype, ckpt, keep=True)
    loss, grads, peak = step(dev, cfg, lora, dtype, ckpt, keep=False)
    assert loss == loss_k
    assert grads.keys() == grads_k.keys() and grads
    for k in grads:
        np.testing.assert_array_equal(grads[k], grads_k[k], err_msg=k)
        assert np.any(grads[k] != 0) or "lora_B" in k, k
    if not ckpt and not lora.full:
        # each layer's xn and hn (with dropout: q, k, v, gate and up's drops of them), less the one
        # made again at a time, leave the peak; in full fine-tuning no save holds them to begin with
        N, C, L = 80, cfg["hidden_size"], cfg["num_hidden_layers"]
        isz = 2 if dtype == "bf16" else 4
        assert peak_k - peak >= (2 * L - 2) * N * C * isz, (peak_k, peak)
