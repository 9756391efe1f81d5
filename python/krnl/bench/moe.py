"""The mixture-of-experts workload: a Qwen3-30B-A3B-shaped stack (hidden 2048, 128 experts of width
768, 8 per token, 32 query heads on 4 KV heads of 128, its vocabulary), a few layers, LoRA r=16 on
attention and on the experts (PEFT's target_parameters), one optimizer step per sample of B rows of
T tokens. krnl with its experts in bf16 and in 4 bits (groups of 64, MLX's affine layout through
ops.moe_quantized_matmul), next to transformers + PEFT on the bf16 model. Weights are random,
made in memory; the two sides draw their own, so losses are reported side by side, not compared.
Reported per implementation as in qlora.py: steady tokens/s, peak device memory, the last loss."""

import gc

import numpy as np

from .qlora import time_krnl, time_torch, with_peer

SIZES = {
    "full": dict(layers=4, C=2048, E=128, K=8, F=768, H=32, KV=4, D=128, V=151936, T=2048, B=1, steps=10, warmup=3),
    "quick": dict(layers=2, C=128, E=7, K=2, F=64, H=4, KV=2, D=32, V=256, T=32, B=2, steps=3, warmup=1),
}
BITS, GROUP = 4, 64
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
SKIP = "sized for the H200 (a Qwen3-30B-A3B-shaped stack); --quick runs a small one here"


def hf_config(s):
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": s["C"],
            "intermediate_size": 6144, "moe_intermediate_size": s["F"], "num_experts": s["E"],
            "num_experts_per_tok": s["K"], "norm_topk_prob": True, "num_hidden_layers": s["layers"],
            "num_attention_heads": s["H"], "num_key_value_heads": s["KV"], "head_dim": s["D"], "vocab_size": s["V"],
            "max_position_embeddings": max(8192, s["T"]), "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "tie_word_embeddings": False, "hidden_act": "silu", "decoder_sparse_step": 1, "mlp_only_layers": []}


def krnl_weights(s, seed=0):
    from ..models.config import ModelConfig, random_weights
    cfg = ModelConfig.from_dict(hf_config(s))
    return cfg, random_weights(cfg, seed=seed, std=0.02)


def run_krnl(dev, s, batches, dtype, quantize, log=print, profile=False):
    from ..models.config import LoraConfig
    from ..models.model import LlamaModel
    cfg, weights = krnl_weights(s)
    model = LlamaModel(dev, cfg, weights, LoraConfig(r=16, alpha=32.0, target_modules=TARGETS), dtype=dtype,
                       quantize=quantize)
    del weights
    return time_krnl(dev, model, s, batches, log, f"moe krnl {'4-bit' if quantize else dtype}", profile)


def run_peft(s, batches, on_gpu, log=print):
    """transformers' Qwen3-MoE in bf16 with PEFT's LoRA on attention (target_modules) and the
    experts (target_parameters), AdamW on the LoRA factors."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda" if on_gpu else "cpu"):
            model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
                **hf_config(s), use_cache=False, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(prev)
    for p in model.parameters():
        p.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(TARGETS[:4]),
                                             target_parameters=[f"mlp.experts.{m}" for m in TARGETS[4:]]))
    label = f"PEFT bf16 (transformers {transformers.__version__})"
    return dict(impl=label, **time_torch(model, s, batches, on_gpu, log, "moe " + label))


def run(dev, dtype="bf16", quick=False, peers=True, log=print, profile=False):
    """Rows for the session: krnl in dtype and with 4-bit experts, then PEFT where torch and peft import."""
    s = SIZES["quick" if quick else "full"]
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, s["V"], (s["B"], s["T"])) for _ in range(s["warmup"] + s["steps"])]
    desc = (f"MoE {s['E']} experts top-{s['K']} width {s['F']}, LoRA r=16 attn+experts; {s['layers']} layers "
            f"C={s['C']} V={s['V']}, B={s['B']} T={s['T']}")
    rows = [dict(impl=f"krnl {dtype}", title=desc, **run_krnl(dev, s, batches, dtype, None, log, profile))]
    gc.collect()
    dev.trim()
    rows.append(dict(impl=f"krnl 4-bit g{GROUP}", **run_krnl(dev, s, batches, dtype, (BITS, GROUP), log)))
    gc.collect()
    dev.trim()
    def peft_row(on_gpu):
        try:
            return run_peft(s, batches, on_gpu, log)
        except (TypeError, ValueError, AttributeError) as e:  # transformers < 5 or PEFT < 0.17: no fused experts
            return dict(impl="PEFT", status="skipped", reason=f"{type(e).__name__}: {str(e)[:120]}")

    return with_peer(rows, dev, peers, peft_row)
