"""The full fine-tuning workload: one AdamW step (lr 1e-4, clipping at 1) training every
weight of the decoder layers (projections and norms; embeddings and head frozen, as krnl's and
mlx-lm's default) of pref.py's model, the 1b shape with random weights made in memory, on B rows of
T tokens. krnl: LoraConfig(full=True), f32 masters, gradients and AdamW moments, the compute dtype
for the products. Next to transformers' Llama trained the same way two ways: f32 weights under
torch.autocast to bf16 (f32 masters and moments as krnl's: the like-for-like row), and bf16 weights
with torch's AdamW holding bf16 moments (half the state, rounded updates), each with the same
weights frozen. tokens/s and peak device memory side by side."""

import gc

import numpy as np

from . import pref
from .qlora import time_krnl, time_torch, with_peer

SIZES = {
    "full": dict(shape="1b", B=4, T=1024, steps=10, warmup=3),
    "quick": dict(shape="quick", B=2, T=16, steps=3, warmup=1),
}
SKIP = "sized for the H200 (the 1b shape); --quick runs a small one here"
ROWS = {"f32": "transformers f32 + bf16 autocast", "bf16": "transformers bf16 (bf16 AdamW state)"}


def batches(s, seed=0):
    rng = np.random.default_rng(seed)
    return [pref.tokens(rng, s, s["B"], s["T"]) for _ in range(s["warmup"] + s["steps"])]


def run_krnl(dev, s, bs, dtype, log=print, profile=False):
    from ..models.config import LoraConfig, ModelConfig, random_weights
    from ..models.model import LlamaModel
    cfg = ModelConfig.from_dict(pref.hf_config(s))
    weights = random_weights(cfg, seed=0, std=0.02)
    model = LlamaModel(dev, cfg, weights, LoraConfig(full=True), dtype=dtype)
    del weights
    res = time_krnl(dev, model, s, bs, log, "full krnl", profile)
    res["note"] = f"{model.lora_params.numel:,} weights trained"
    del model
    gc.collect()
    dev.trim()
    return res


def torch_model(s, on_gpu, kind):
    """transformers' Llama of the shape, its layers trainable, in f32 (kind "f32") or bf16."""
    import torch
    import transformers
    torch.manual_seed(0)
    dt = torch.float32 if kind == "f32" else torch.bfloat16
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device("cuda" if on_gpu else "cpu"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**pref.hf_config(s), use_cache=False,
                                                                           attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(prev)
    for n, p in model.named_parameters():
        p.requires_grad_(".layers." in n)
    return model


def run_torch(s, bs, on_gpu, kind, log=print):
    import torch
    model = torch_model(s, on_gpu, kind)
    device = "cuda" if on_gpu else "cpu"

    def fwd_bwd(ids):
        t = torch.as_tensor(ids, device=device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=kind == "f32"):
            loss = model(input_ids=t, labels=t).loss
        loss.backward()
        return loss

    res = time_torch(model, s, bs, on_gpu, log, f"full {ROWS[kind]}", fwd_bwd=fwd_bwd)
    import transformers
    return dict(impl=ROWS[kind], note=f"torch {torch.__version__}, transformers {transformers.__version__}", **res)


def run(dev, dtype="bf16", quick=False, peers=True, log=print, profile=False):
    """Rows for the session: krnl, then transformers' full fine-tuning in f32 + autocast and in bf16."""
    s = SIZES["quick" if quick else "full"]
    bs = batches(s)
    desc = (f"full fine-tuning of the layers (projections, norms), {s['B']} x {s['T']} tokens, AdamW; "
            f"{pref.describe(s).split(', LoRA')[0]}")
    rows = [dict(impl="krnl", title=desc, **run_krnl(dev, s, bs, dtype, log, profile))]
    peer = lambda on_gpu, k: pref.peer_rows(ROWS[k], lambda: run_torch(s, bs, on_gpu, k, log), trl=False)  # noqa: E731
    return with_peer(rows, dev, peers, lambda on_gpu: [peer(on_gpu, k) for k in ROWS], name="transformers")
