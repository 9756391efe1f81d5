"""The QLoRA workload: LoRA r=16 on all seven projections of a Llama-shaped model whose base is held
in 4 bits (groups of 64), one optimizer step per sample of `B` rows of `T` tokens, gradient
checkpointing off on both sides (and a krnl row with it on, for the memory a smaller machine
needs). krnl (MLX's affine 4-bit layout, ops.quantized_matmul) next to
transformers + PEFT on a bitsandbytes 4-bit base (NF4, double quantization, bf16 compute: the
QLoRA recipe), or, where bitsandbytes does not run, PEFT on a bf16 base, labelled as such; with
--peers liger or unsloth also PEFT with Liger's kernels and Unsloth on their 4-bit bases
(fast_peers.py, each in a process of its own).

Weights are random and generated in memory (nothing written to disk); the two sides cannot share
them (NF4 codes are not affine ones), so the losses are reported side by side, not compared.
Reported per implementation: steady tokens/s (warm-up steps excluded), the peak device memory of
the training steps (the model and optimizer state included: peaks are reset after the build,
when only the model lives), and the loss after the timed steps."""

import gc
import time
from typing import Callable, NamedTuple

import numpy as np

import krnl
from . import fast_peers
from .hostmem import HostGrowth

# Llama-3-8B's shape; "quick" is for tests and the CPU.
SIZES = {
    "full": dict(layers=32, C=4096, F=14336, H=32, KV=8, V=128256, T=2048, B=1, steps=10, warmup=3),
    "quick": dict(layers=2, C=128, F=256, H=4, KV=2, V=512, T=64, B=2, steps=3, warmup=1),
}
BITS, GROUP = 4, 64
SKIP = "sized for the H200 (an 8B-shaped model); --quick runs a small one here"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def hf_config(s):
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": s["C"],
            "intermediate_size": s["F"], "num_hidden_layers": s["layers"], "num_attention_heads": s["H"],
            "num_key_value_heads": s["KV"], "vocab_size": s["V"], "max_position_embeddings": max(8192, s["T"]),
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu"}


def tokens(s, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, s["V"], (s["B"], s["T"])) for _ in range(s["warmup"] + s["steps"])]


def random_quantized(rng, out_f, in_f):
    """A random 4-bit weight as a quantized file holds one: uniform codes, bf16-representable
    scales (std of the weights about 0.02) and biases centring each group."""
    from ..quant.qweight import QuantizedArray
    from ..io.safetensors_io import bf16_to_f32, f32_to_bf16
    words = rng.integers(0, 2**32, (out_f, in_f * BITS // 32), dtype=np.uint32).view(np.int32)
    scales = bf16_to_f32(f32_to_bf16(rng.uniform(0.004, 0.006, (out_f, in_f // GROUP)).astype(np.float32)))
    biases = bf16_to_f32(f32_to_bf16(-7.5 * scales))
    return QuantizedArray(words, scales, biases, BITS, GROUP, "bf16")


def krnl_weights(s, seed=0):
    from ..models.config import ModelConfig
    cfg = ModelConfig.from_dict(hf_config(s))
    rng = np.random.default_rng(seed)
    w = {}
    for name, shape in cfg.weight_shapes().items():
        if name.endswith("norm.weight"):
            w[name] = np.ones(shape, np.float32)
        elif name.split(".")[-2] in MODULES:
            w[name] = random_quantized(rng, *shape)
        else:  # embeddings and the untied head stay bf16, as bitsandbytes QLoRA keeps them
            w[name] = (0.02 * rng.standard_normal(shape, dtype=np.float32))
    return cfg, w


def run_krnl(dev, s, batches, dtype, log=print, profile=False, grad_checkpoint=False):
    from ..models.config import LoraConfig
    from ..models.model import LlamaModel
    cfg, weights = krnl_weights(s)
    model = LlamaModel(dev, cfg, weights, LoraConfig(r=16, alpha=32.0), dtype=dtype, grad_checkpoint=grad_checkpoint)
    del weights
    return time_krnl(dev, model, s, batches, log, "qlora krnl" + (" (grad checkpoint)" if grad_checkpoint else ""),
                     profile)


def time_krnl(dev, model, s, batches, log, who, profile=False, objective=None):
    """time_steps's figures of AdamW steps of `model` (lr 1e-4, clipping at 1) on `batches`, the peak
    counted from here (the model built); with profile one more step, op by op. objective(model,
    batch) -> loss: the step's forward and backward (default: next-token cross entropy on ids)."""
    from ..train.optim import AdamW, Schedule
    opt = AdamW(model.lora_params, Schedule(1e-4, kind="constant"), max_grad_norm=1.0)
    clock = krnl_clock(dev)

    def step(b):
        model.lora_params.zero_grads()
        if objective is not None:
            loss = objective(model, b)
            opt.step()
            return loss
        model.forward_backward(b, np.concatenate([b[:, 1:], np.full((b.shape[0], 1), -100)], axis=1))
        opt.step()
        return model.read_loss()

    res = time_steps(step, batches, s, clock, log, who)
    if profile:  # where the step's time goes
        with krnl.profile(dev) as p:
            step(batches[-1])
        log(f"krnl bench: {who} profile: {p.op_ms:.1f} ms in ops, {p.wall_ms:.1f} ms wall")
        for g in sorted(p.rows(), key=lambda g: -g["ms"])[:28]:
            log(f"  {g['op'][:22]:22s} {g['shape'][:40]:40s} {g['calls']:5d} {g['ms']:9.2f} ms {100 * g['share']:5.1f}%")
        ops_ms = {}
        for g in p.rows():
            calls, ms = ops_ms.get(g["op"], (0, 0.0))
            ops_ms[g["op"]] = (calls + g["calls"], ms + g["ms"])
        log("  by op: " + ", ".join(f"{op} {ms:.2f} ms/{calls}" for op, (calls, ms) in
                                    sorted(ops_ms.items(), key=lambda kv: -kv[1][1])))
    return res


class Clock(NamedTuple):
    """A device's side of time_steps: sync() waits for it; peak() and in_use() are its allocator's
    bytes, the largest since the clock was made and those held now."""
    sync: Callable[[], None]
    peak: Callable[[], int]
    in_use: Callable[[], int]


def krnl_clock(dev):
    """The Clock of a krnl device, its peak counted from here."""
    gc.collect()
    dev.synchronize()
    dev.reset_peak()
    return Clock(dev.synchronize, lambda: dev.pool_stats()["peak_in_use"], lambda: dev.pool_stats()["in_use"])


def torch_clock(torch, on_gpu):
    """The Clock of torch's device (the GPU's, or the CPU with no allocator figures), its peak
    counted from here."""
    gc.collect()
    if not on_gpu:
        return Clock(lambda: None, lambda: 0, lambda: 0)
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return Clock(torch.cuda.synchronize, torch.cuda.max_memory_allocated, torch.cuda.memory_allocated)


def time_steps(step, batches, s, clock, log, who):
    """Figures of step(batch) over batches after s["warmup"] untimed ones, s["B"] rows of s["T"]
    tokens each; the loss is the last step's return (None: a step with no loss, a generation).
    With the peak: the device bytes held before the first step (the model, built: resident_bytes)
    and the host memory the steps took on top of the process's (host_bytes; None off Linux)."""
    resident = clock.in_use()
    with HostGrowth() as host:
        for b in batches[:s["warmup"]]:
            step(b)
        clock.sync()
        t0 = time.perf_counter()
        loss = None
        for b in batches[s["warmup"]:]:
            loss = step(b)
        clock.sync()
        dt = time.perf_counter() - t0
    toks = s["steps"] * s["B"] * s["T"]
    log(f"krnl bench: {who}: {toks / dt:,.0f} tokens/s, peak {clock.peak() / 2**30:.2f} GiB"
        + ("" if loss is None else f", loss {loss:.4f}"))
    return {"tokens_per_s": toks / dt, "ms": 1e3 * dt / s["steps"], "peak_bytes": int(clock.peak()),
            "resident_bytes": int(resident), "host_bytes": host.bytes,
            "loss": None if loss is None else float(loss), "samples": s["steps"]}


def peft_model(s, torch, on_gpu, config=None, nf4=True):
    """transformers' Llama with random weights (config: its HF config, default hf_config(s)), its
    seven projections on a bitsandbytes NF4 base where nf4 and bitsandbytes runs (else bf16, and
    the label says so), LoRA r=16 through PEFT."""
    import transformers
    from peft import LoraConfig, get_peft_model
    device = "cuda" if on_gpu else "cpu"
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(config or hf_config(s)), use_cache=False,
                                                                           attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(prev)
    label = "PEFT bf16 base"
    if nf4:
        try:
            to_nf4(model, torch, device)
            label = "PEFT bnb-nf4"
        except Exception as e:  # noqa: BLE001 (bitsandbytes absent or without this device's backend)
            label += f" (bitsandbytes: {type(e).__name__}: {str(e)[:80]})"
    for p in model.parameters():
        p.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(MODULES)))
    return model, label


def to_nf4(model, torch, device):
    """The seven projections of every layer replaced by bitsandbytes NF4 ones (the QLoRA recipe)."""
    import bitsandbytes as bnb
    for layer in model.model.layers:
        for part in (layer.self_attn, layer.mlp):
            for name in MODULES:
                lin = getattr(part, name, None)
                if lin is None:
                    continue
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.bfloat16,
                                      quant_type="nf4", device=device)
                q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4",
                                             blocksize=GROUP, compress_statistics=True).to(device)
                setattr(part, name, q)
                del lin


def run_peft(s, batches, on_gpu, log=print):
    import torch
    model, label = peft_model(s, torch, on_gpu)
    res = time_torch(model, s, batches, on_gpu, log, "qlora " + label)
    res["label"] = label
    return res


def time_torch(model, s, batches, on_gpu, log, who, fwd_bwd=None):
    """time_steps's figures of torch AdamW steps (lr 1e-4, clipping at 1) of a PEFT model; the model is
    released after. fwd_bwd(batch) -> loss: the step's forward and backward (default: the model's
    causal-LM loss on ids)."""
    import torch
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    device = "cuda" if on_gpu else "cpu"

    def lm_loss(ids):
        t = torch.as_tensor(ids, device=device)
        loss = model(input_ids=t, labels=t).loss
        loss.backward()
        return loss

    def step(b):
        loss = (fwd_bwd or lm_loss)(b)
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    res = time_steps(step, batches, s, torch_clock(torch, on_gpu), log, who)
    del model, opt, trainable
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return res


def run(dev, dtype="bf16", quick=False, peers=("torch",), log=print, profile=False):
    """Rows for the session: krnl (in dtype), then of the --peers names `peers` the PEFT peer
    ("torch") and Liger and Unsloth (bf16) where torch and peft import."""
    s = SIZES["quick" if quick else "full"]
    batches = tokens(s)
    desc = (f"QLoRA 4-bit g{GROUP}, LoRA r=16 x7; {s['layers']} layers C={s['C']} F={s['F']} "
            f"V={s['V']}, B={s['B']} T={s['T']}")
    rows = [dict(impl="krnl", title=desc, **run_krnl(dev, s, batches, dtype, log, profile))]
    gc.collect()
    dev.trim()
    # what a smaller machine would run: layer inputs kept, the rest recomputed in the backward
    rows.append(dict(impl="krnl grad-ckpt", **run_krnl(dev, s, batches, dtype, log, grad_checkpoint=True)))
    gc.collect()
    dev.trim()
    def peer_rows(on_gpu):
        out = []
        if "torch" in peers:
            r = run_peft(s, batches, on_gpu, log)
            out.append(dict(impl=r.pop("label"), **r))
        return out + fast_peers.qlora_rows(dev.name, s, batches, peers, log)

    return with_peer(rows, dev, bool({"torch", "liger", "unsloth"} & set(peers)), peer_rows, first=2)


def with_peer(rows, dev, peers, peft_row, first=1, name="PEFT"):
    """rows and the PEFT row (peft_row(on_gpu): a row or a list of them) where torch and peft
    import, each of rows[first:] with its tokens/s and peak memory relative to krnl's row rows[0]
    (rows[r["base"]] where a row names its own)."""
    if peers:
        try:
            import peft  # noqa: F401
            import torch
        except ImportError as e:
            rows.append(dict(impl=name, status="skipped", reason=f"{e.name} is not installed"))
        else:
            from .targets import is_gpu
            got = peft_row(is_gpu(dev) and torch.cuda.is_available())
            rows += got if isinstance(got, list) else [got]
    for r in rows[first:]:
        k = rows[r.pop("base", 0)]
        if r.get("tokens_per_s"):
            r["vs_krnl"] = r["tokens_per_s"] / k["tokens_per_s"]
            r["peak_vs_krnl"] = r["peak_bytes"] / k["peak_bytes"] if k["peak_bytes"] and r["peak_bytes"] else None
    return rows
