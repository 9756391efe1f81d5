"""The workloads `krnl bench` runs: the training steps W1, W2, W3 (krnl and its peers) and the GEMM
rows (square nn/nt/tn and the skinny LoRA products of W1 on the CPU, of W3 on a GPU)."""

import platform
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional

import numpy as np

import krnl
from . import w1, w2, w2_peers
from .targets import kind

# the peers of the W steps; the train, long and qlora workloads also take Liger and Unsloth (fast_peers.py)
STEP_PEERS = ("numpy", "torch", "torch.compile", "compile+cudagraphs", "mlx", "mx.compile")
PEER_NAMES = STEP_PEERS + ("liger", "unsloth")
PEER_MODULES = {"numpy": "numpy", "torch": "torch", "torch.compile": "torch", "compile+cudagraphs": "torch",
                "mlx": "mlx.core", "mx.compile": "mlx.core"}
INSTALL_HINT = {"torch": 'pip install torch',
                "mlx.core": 'pip install "mlx[cpu]" (Linux CPU), "mlx[cuda13]" (Linux CUDA) or mlx (macOS)'}


def peer_note(name, device="cpu"):
    """What a reader must know next to a peer's figure (`device`: krnl's, a Device or a name)."""
    if name in ("mlx", "mx.compile") and platform.system() == "Linux" and kind(device) == "cpu":
        return "Linux CPU wheel: bundled reference BLAS, slow"
    if name in ("torch.compile", "compile+cudagraphs", "mx.compile"):
        return "compiled before timing"
    if name == "krnl graph":
        return "the step replayed as one CUDA graph (Device.capture)"
    return ""


@dataclass
class Step:
    """A training-step workload: `make(size, device, dtype)` builds the problem, `krnl(problem)`
    (and `krnl_graph(problem)` where the device captures graphs) and each peer builder give
    (step, result); `step()` runs one step to completion, `result()` runs one and returns the
    outputs as float32 numpy."""
    name: str
    title: str
    sizes: Dict[str, dict]  # "full", "quick", "small" (the cross-check)
    make: Callable
    krnl: Callable
    krnl_graph: Callable
    peers: Dict[str, Callable]
    tokens: Callable
    flops: Callable
    describe: Callable
    gpu_only: Optional[str] = None  # the skip reason on a device that is not a GPU


W1 = Step(
    name="w1", title="W1 MLP block",
    sizes={"full": dict(T=w1.T, C=w1.C, F=w1.F, R=w1.R), "quick": w1.QUICK, "small": w1.SMALL},
    make=w1.Problem, krnl=w1.build_krnl, krnl_graph=w1.build_krnl_graph, peers=w1.PEERS,
    tokens=lambda P: P["x"].shape[0], flops=w1.flops,
    describe=lambda s: f"RMSNorm+SwiGLU, LoRA r={s['R']} gate/up, dX; T={s['T']} C={s['C']} F={s['F']}")

W2 = Step(
    name="w2", title="W2 Llama layer",
    sizes={"full": w2.W2, "quick": w2.QUICK, "small": w2.SMALL},
    make=w2.Case.of, krnl=w2.build_krnl, krnl_graph=w2.build_krnl_graph, peers=w2_peers.PEERS,
    tokens=lambda case: case.T, flops=lambda case: case.flops,
    describe=lambda s: f"{s['H']}x{s['D']} heads, LoRA r={s['r']} x7, dX; T={s['T']} C={s['C']} F={s['F']}")

# W3 is W2's step at the Llama-3-8B layer's sizes (GQA), for GPUs only.
W3 = replace(
    W2, name="w3", title="W3 Llama-3-8B layer",
    sizes={"full": w2.W3, "quick": w2.W3_QUICK, "small": w2.W3_SMALL},
    describe=lambda s: f"{s['H']}/{s['KV']} heads of {s['D']}, LoRA r={s['r']} x7, dX; T={s['T']} C={s['C']} F={s['F']}",
    gpu_only="sized for the H200")

STEPS = {s.name: s for s in (W1, W2, W3)}
ALL = ("w1", "w2", "w3", "gemm", "lora")
# Named, not run by default: the QLoRA model (bench/qlora.py) builds a whole 8B-shaped model, the MoE
# one (bench/moe.py) a Qwen3-30B-A3B-shaped stack, DPO and GRPO (bench/dpo.py, bench/grpo.py) a
# 1B-shaped one next to TRL, serve (bench/serve.py) `krnl serve` under concurrent clients, and
# `train` (bench/train.py) writes a model folder and trains it with krnl and each peer in turn
# (torch.compile's first step alone takes minutes on a small CPU), `long` (bench/train_long.py) the
# same at 16k and 32k tokens a row, and `full` (bench/full.py) full fine-tuning of a 1B-shaped one
# next to transformers'.
KNOWN = ALL + ("qlora", "moe", "dpo", "grpo", "serve", "full", "train", "long")


ELT = {"f32": 4, "bf16": 2, "f16": 2}


def square_gemms(n):
    """(name, m, n, k, trans_a, trans_b, beta, out_f32) of the three square variants."""
    return [(f"gemm {v} {n}^3", n, n, n, v[0] == "t", v[1] == "t", 0.0, False) for v in ("nn", "nt", "tn")]


def lora_gemms(T, C, F, R):
    """The skinny products of a LoRA projection with input or output width K in {C, F}, as krnl's
    W1 block and Llama layer call them: (name, m, n, k, trans_a, trans_b, beta, out_f32); the
    gradients dA, dB are written in f32 (LoRA gradients are f32), z += t B^T adds into
    the base projection's output."""
    out = []
    for K in sorted({C, F}):
        out += [
            (f"lora t=hA^T  ({T},{R})=({T},{K})({R},{K})^T", T, R, K, False, True, 0.0, False),
            (f"lora z+=tB^T ({T},{K})=({T},{R})({K},{R})^T", T, K, R, False, True, 1.0, False),
            (f"lora dB=dz^Tt ({K},{R})=({T},{K})^T({T},{R})", K, R, T, True, False, 0.0, True),
            (f"lora dt=dzB  ({T},{R})=({T},{K})({K},{R})", T, R, K, False, False, 0.0, False),
            (f"lora dA=dt^Th ({R},{K})=({T},{R})^T({T},{K})", R, K, T, True, False, 0.0, True),
        ]
    return out


def gemm_bytes(m, n, k, beta, out_f32, dtype):
    """Bytes a GEMM must move at least: both operands read once, the output written (and read
    when beta != 0). What bounds the skinny LoRA products."""
    e = ELT[dtype]
    eo = 4 if out_f32 else e
    return e * (m * k + k * n) + eo * m * n * (2 if beta else 1)


def gemm_fn(dev, m, n, k, trans_a, trans_b, beta=0.0, out_f32=False, dtype="f32"):
    """run(reps=1): `reps` GEMMs of the shape on `dev` in `dtype` queued back to back in one step,
    as a training step queues them, then one synchronize (inputs stored as the op reads them).
    Outside a step each op is its own submission: on the H200 that added ~7 us to each skinny
    LoRA product of W3 (21.6 us a call against 14.2 inside one step, same session)."""
    rng = np.random.default_rng(0)
    a = dev.tensor(rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32), dtype)
    b = dev.tensor(rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32), dtype)
    c = dev.tensor(np.zeros((m, n), np.float32), "f32" if out_f32 else dtype)

    def run(reps=1):
        with dev.step():
            for _ in range(reps):
                krnl.ops.gemm(a, b, c, trans_a=trans_a, trans_b=trans_b, beta=beta)
        dev.synchronize()

    return run


def copy_rate(dev, dtype, nbytes=1 << 30):
    """Bytes per second of a device-to-device copy (read + write counted), the bandwidth the
    LoRA rows are measured against."""
    n = nbytes // ELT[dtype]
    a, b = dev.empty((n,), dtype), dev.empty((n,), dtype)
    krnl.ops.cast(a, b)
    dev.synchronize()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        krnl.ops.cast(a, b)
        dev.synchronize()
        ts.append(time.perf_counter() - t0)
    return 2 * n * ELT[dtype] / min(ts)
