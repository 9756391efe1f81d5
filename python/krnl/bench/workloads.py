"""The workloads `krnl bench` runs: the training steps W1, W2, W3 (krnl and its peers) and the GEMM
rows (square nn/nt/tn and the skinny LoRA products of W1/W2)."""

import platform
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import numpy as np

import krnl
from . import w1, w2

PEER_NAMES = ("numpy", "torch", "torch.compile", "mlx", "mx.compile")
PEER_MODULES = {"numpy": "numpy", "torch": "torch", "torch.compile": "torch", "mlx": "mlx.core", "mx.compile": "mlx.core"}
INSTALL_HINT = {"torch": 'pip install torch', "mlx.core": 'pip install "mlx[cpu]" (Linux) or mlx (macOS)'}


def is_gpu(device_name):
    """W3 runs only here: metal-sim and the CPU would take hours over a Llama-3-8B layer."""
    return device_name.split(":")[0] in ("cuda", "metal")


def peer_note(name):
    """What a reader must know next to a peer's figure."""
    if name in ("mlx", "mx.compile") and platform.system() == "Linux":
        return "Linux CPU wheel: bundled reference BLAS, slow (DESIGN 6)"
    if name == "torch.compile":
        return "compiled before timing"
    return ""


@dataclass
class Step:
    """A training-step workload: `make(size, device)` builds the problem, `krnl(problem)` and each
    peer builder give (step, result)."""
    name: str
    title: str
    sizes: Dict[str, dict]  # "full", "quick", "small" (the cross-check)
    make: Callable
    krnl: Callable
    peers: Dict[str, Callable]
    tokens: Callable
    flops: Callable
    describe: Callable
    tolerance: float = 1e-4  # of the reference's largest magnitude, per output
    gpu_only: Optional[str] = None  # the skip reason on a device that is not a GPU


class _W1Problem(dict):
    """W1's numpy arrays (what every peer reads) and the device krnl runs on."""
    device = "cpu"


def _w1_make(size, device):
    P = _W1Problem(w1.make_params(**size))
    P.device = device
    return P


def _w2_make(size, device):
    return w2.Case(**{"seed": 0, **size}, device=device)


W1 = Step(
    name="w1", title="W1 MLP block",
    sizes={"full": dict(T=w1.T, C=w1.C, F=w1.F, R=w1.R), "quick": w1.QUICK, "small": w1.SMALL},
    make=_w1_make, krnl=lambda P: w1.build_krnl(P, P.device), peers=w1.PEERS,
    tokens=lambda P: P["x"].shape[0], flops=w1.flops,
    describe=lambda s: f"RMSNorm+SwiGLU, LoRA r={s['R']} gate/up, dX; T={s['T']} C={s['C']} F={s['F']}")

W2 = Step(
    name="w2", title="W2 Llama layer",
    sizes={"full": dict(C=w2.C, F=w2.F, H=w2.H, D=w2.D, T=w2.T, r=w2.R), "quick": w2.QUICK, "small": w2.SMALL},
    make=_w2_make, krnl=w2.build_krnl, peers=w2.PEERS,
    tokens=lambda case: case.T, flops=lambda case: case.flops,
    describe=lambda s: f"{s['H']}x{s['D']} heads, LoRA r={s['r']} x7, dX; T={s['T']} C={s['C']} F={s['F']}")

W3 = Step(
    name="w3", title="W3 Llama-3-8B layer",
    sizes={"full": w2.W3, "quick": dict(C=256, F=896, H=8, KV=2, D=32, T=64, r=16),
           "small": dict(C=64, F=176, H=4, KV=2, D=16, T=33, r=16, seed=3)},
    make=_w2_make, krnl=w2.build_krnl, peers=w2.PEERS,
    tokens=lambda case: case.T, flops=lambda case: case.flops,
    describe=lambda s: f"{s['H']}/{s['KV']} heads of {s['D']}, LoRA r={s['r']} x7; T={s['T']} C={s['C']} F={s['F']}",
    gpu_only="sized for the H200")

STEPS = {s.name: s for s in (W1, W2, W3)}
ALL = ("w1", "w2", "w3", "gemm", "lora")


def square_gemms(n):
    """(name, m, n, k, trans_a, trans_b) of the three square variants."""
    return [(f"gemm {v} {n}^3", n, n, n, v[0] == "t", v[1] == "t") for v in ("nn", "nt", "tn")]


def lora_gemms(T, C, F, R):
    """The skinny products of a LoRA projection with input or output width K in {C, F}, as krnl's
    W1 block and Llama layer call them: (name, m, n, k, trans_a, trans_b)."""
    out = []
    for K in sorted({C, F}):
        out += [
            (f"lora t=hA^T  ({T},{R})=({T},{K})({R},{K})^T", T, R, K, False, True),
            (f"lora z+=tB^T ({T},{K})=({T},{R})({K},{R})^T", T, K, R, False, True),
            (f"lora dB=dz^Tt ({K},{R})=({T},{K})^T({T},{R})", K, R, T, True, False),
            (f"lora dt=dzB  ({T},{R})=({T},{K})({K},{R})", T, R, K, False, False),
            (f"lora dA=dt^Th ({R},{K})=({T},{R})^T({T},{K})", R, K, T, True, False),
        ]
    return out


def gemm_fn(dev, m, n, k, trans_a, trans_b, reps=1):
    """A callable running `reps` sgemms of the shape on `dev` (inputs stored as the op reads them)."""
    rng = np.random.default_rng(0)
    a = dev.tensor(rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32))
    b = dev.tensor(rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32))
    c = dev.empty((m, n))

    def run():
        for _ in range(reps):
            krnl.ops.gemm(a, b, c, trans_a=trans_a, trans_b=trans_b)
        dev.synchronize()

    return run
