"""The MoE bench's grouped products (P = 16384 pairs over 128 experts, C 2048, F 768, bf16) three
ways on one GPU: krnl's moe_gemm, torch._grouped_mm (CUTLASS's grouped GEMM, offsets on the
device) where this torch has it, and one dense cuBLAS GEMM of the same FLOPs as the bound."""
import sys
import time

import numpy as np
import torch

import krnl

P, E, C, F = 16384, 128, 2048, 768
dev = krnl.device("cuda")
rng = np.random.default_rng(0)
counts = np.bincount(rng.integers(0, E, P), minlength=E)
offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


def timed(fn, n=20):
    fn()
    torch.cuda.synchronize()
    dev.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    dev.synchronize()
    return (time.perf_counter() - t) / n * 1e3


for name, (I, O) in (("gate (P,C)x(E,F,C)^T", (C, F)), ("down (P,F)x(E,C,F)^T", (F, C))):
    flops = 2 * P * I * O
    x = dev.tensor(rng.standard_normal((P, I)).astype(np.float32), "bf16")
    w = dev.tensor((rng.standard_normal((E, O, I)) * 0.02).astype(np.float32), "bf16")
    out = dev.empty((P, O), "bf16")
    off = dev.tensor(offs, "i32")
    ms = timed(lambda: krnl._core.ops.moe_gemm(x, w, off, out))
    print(f"{name}: krnl moe_gemm {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    tx = torch.randn(P, I, device="cuda", dtype=torch.bfloat16)
    tw = torch.randn(E, O, I, device="cuda", dtype=torch.bfloat16) * 0.02
    to = torch.tensor(offs[1:], device="cuda", dtype=torch.int32)
    if hasattr(torch, "_grouped_mm"):
        try:
            twt = tw.transpose(1, 2)  # (E, I, O) view of (E, O, I): x_e W_e^T
            ms = timed(lambda: torch._grouped_mm(tx, twt, offs=to))
            print(f"{name}: torch._grouped_mm {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: torch._grouped_mm failed: {type(e).__name__}: {str(e)[:200]}")
    a = torch.randn(P, I, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(I, O, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: a @ b)
    print(f"{name}: dense cuBLAS (P,I)x(I,O) {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
# krnl's other grouped products of the MoE step: the frozen experts' input gradient and the expert
# LoRA's weight gradients at r = 16 (gA_e = dxa_e^T x_e, gB_e = dy_e^T xa_e)
off = dev.tensor(offs, "i32")
dy = dev.tensor(rng.standard_normal((P, F)).astype(np.float32), "bf16")
w = dev.tensor((rng.standard_normal((E, F, C)) * 0.02).astype(np.float32), "bf16")
dx = dev.empty((P, C), "bf16")
ms = timed(lambda: krnl._core.ops.moe_gemm(dy, w, off, dx, transpose=False))
print(f"gate input grad (P,F)x(E,F,C): krnl moe_gemm {ms:.3f} ms {2 * P * C * F / ms / 1e9:.0f} TFLOP/s", flush=True)
R = 16
xr = dev.tensor(rng.standard_normal((P, C)).astype(np.float32), "bf16")
la = dev.tensor((rng.standard_normal((E, R, C)) * 0.02).astype(np.float32), "bf16")
xa = dev.empty((P, R), "bf16")
ms = timed(lambda: krnl._core.ops.moe_gemm(xr, la, off, xa))
print(f"LoRA xa (P,C)x(E,r,C)^T: krnl moe_gemm {ms:.3f} ms {2 * P * C * R / ms / 1e9:.0f} TFLOP/s", flush=True)
for name, (M, N) in (("LoRA gA (E,r,C)", (R, C)), ("LoRA gB (E,F,r)", (F, R))):
    a = dev.tensor(rng.standard_normal((P, M)).astype(np.float32), "bf16")
    b = dev.tensor(rng.standard_normal((P, N)).astype(np.float32), "bf16")
    g = dev.empty((E, M, N), "f32")
    ms = timed(lambda: krnl._core.ops.moe_gemm_weight_grad(a, b, off, g))
    print(f"{name}: krnl moe_gemm_weight_grad {ms:.3f} ms {2 * P * M * N / ms / 1e9:.0f} TFLOP/s", flush=True)
print("torch", torch.__version__, file=sys.stderr)
