"""W3 (DESIGN section 6) on the CUDA backend: one LoRA training step of a Llama-3-8B layer,
krnl "cuda" next to PyTorch eager on the same GPU in the same run.

    W3: C=4096, F=14336, 32 query heads / 8 KV heads of 128 (GQA), RoPE, causal, T=4096 (B=1),
        LoRA r=16 (alpha 32) on q, k, v, o, gate, up, down; bf16 compute, frozen bf16 weights.

krnl runs it as a LlamaModel with one layer and a 256-row vocabulary (embedding, the layer, final
norm, LM head, mean cross entropy); one step = forward + backward to the 14 LoRA gradients and dX
at the layer input, no optimizer. Attention is materialised (S = QK^T, softmax, PV), as krnl does
it today (DESIGN 5). PyTorch runs the same model in bf16 eager twice: with
F.scaled_dot_product_attention (its fused flash path) and with dense matmul + masked softmax (the
same algorithm as krnl). The LM head (2*2*T*V*C = 17 GFLOP) is not counted in the FLOPs.

Run (needs a CUDA device and torch with CUDA; skipped otherwise):
    PYTHONPATH=python python -m pytest bench/test_cuda_w3.py -s -q
"""

import math
import time

import numpy as np
import pytest

import krnl
from krnl.model import ALL_MODULES, LlamaModel, LoraConfig, ModelConfig, lora_key, random_weights

C, F, H, KV, D, T, R, ALPHA, V = 4096, 14336, 32, 8, 128, 4096, 16, 32.0, 256
EPS = 1e-5

pytestmark = pytest.mark.skipif("cuda" not in krnl.devices(), reason="no cuda device")


def w3_flops(T=T, C=C, F=F, H=H, KV=KV, D=D, R=R):
    """Forward + dX of the seven projections, the six attention GEMMs, and the LoRA GEMMs."""
    shapes = [(H * D, C), (KV * D, C), (KV * D, C), (C, H * D), (F, C), (F, C), (C, F)]  # (out, in)
    dense = sum(2 * T * o * i for o, i in shapes) * 2  # forward + dX
    attn = 6 * 2 * H * T * T * D  # S, PV; dV, dP, dQ, dK (causal half not skipped: dense)
    lora = sum(2 * T * R * (o + i) * 3 for o, i in shapes)  # forward 2, backward 4 GEMMs of T*R*(in|out)
    return dense + attn + lora


def _config(T_):
    return ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": V, "hidden_size": C, "intermediate_size": F, "num_hidden_layers": 1,
        "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": D, "rms_norm_eps": EPS,
        "max_position_embeddings": max(T_, 64), "tie_word_embeddings": False})


def _lora_values(cfg, seed):
    rng = np.random.default_rng(seed)
    vals = {}
    for m in ALL_MODULES:
        out, inp = cfg.module_shape(m)
        b = 1.0 / math.sqrt(inp)
        vals[lora_key(0, m, "A")] = rng.uniform(-b, b, (R, inp)).astype(np.float32)
        vals[lora_key(0, m, "B")] = (0.1 * rng.standard_normal((out, R)) / math.sqrt(R)).astype(np.float32)
    return vals


def _median_ms(fn, sync, warmup=2, rounds=7):
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts)), 1e3 * float(np.min(ts)), 1e3 * float(np.max(ts))


def _torch_step(torch, cfg, weights, lora_np, ids_np, tgt_np, attn):
    """PyTorch eager bf16 on cuda: frozen bf16 weights, bf16 LoRA leaves (PEFT on a bf16 model)."""
    import torch.nn.functional as Fn

    dev, bf = "cuda", torch.bfloat16
    g = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev, bf)
    p = "model.layers.0."
    W = {m: g(weights[p + ("self_attn." if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.") + m + ".weight"])
         for m in ALL_MODULES}
    lora = {k: g(v).requires_grad_(True) for k, v in lora_np.items()}
    AB = {m: (lora[lora_key(0, m, "A")], lora[lora_key(0, m, "B")]) for m in ALL_MODULES}
    n1, n2 = g(weights[p + "input_layernorm.weight"]), g(weights[p + "post_attention_layernorm.weight"])
    embed, head, norm = g(weights["model.embed_tokens.weight"]), g(weights["lm_head.weight"]), g(weights["model.norm.weight"])
    inv = cfg.inv_freq().astype(np.float64)
    fr = np.outer(np.arange(T, dtype=np.float64), inv)
    cos = g(np.concatenate([np.cos(fr)] * 2, -1))
    sin = g(np.concatenate([np.sin(fr)] * 2, -1))
    mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    ids = torch.from_numpy(ids_np.reshape(-1).astype(np.int64)).to(dev)
    tgt = torch.from_numpy(tgt_np.reshape(-1).astype(np.int64)).to(dev)
    s = ALPHA / R

    def lin(h, m):
        A, B = AB[m]
        return Fn.linear(h, W[m]) + Fn.linear(Fn.linear(h, A), B) * s

    def rope(q):
        q1, q2 = q[..., : D // 2], q[..., D // 2:]
        return q * cos + torch.cat([-q2, q1], -1) * sin

    def heads(z, n):
        return z.view(T, n, D).transpose(0, 1)

    def loss_of(x):
        xn = Fn.rms_norm(x, (C,), n1, EPS)
        q, k, v = rope(heads(lin(xn, "q_proj"), H)), rope(heads(lin(xn, "k_proj"), KV)), heads(lin(xn, "v_proj"), KV)
        k, v = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)
        if attn == "sdpa":
            o = Fn.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        else:
            sc = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D))
            o = torch.softmax(sc.masked_fill(~mask, float("-inf")).float(), -1).to(bf) @ v
        h = x + lin(o.transpose(0, 1).reshape(T, H * D), "o_proj")
        hn = Fn.rms_norm(h, (C,), n2, EPS)
        y = h + lin(Fn.silu(lin(hn, "gate_proj")) * lin(hn, "up_proj"), "down_proj")
        logits = Fn.linear(Fn.rms_norm(y, (C,), norm, EPS), head).float()
        return Fn.cross_entropy(logits, tgt)

    out = {}

    def step():
        for a in lora.values():
            a.grad = None
        x = Fn.embedding(ids, embed).requires_grad_(True)
        loss = loss_of(x)
        loss.backward()
        out["loss"] = loss
        return loss

    return step, out


def test_w3_krnl_cuda_vs_torch_eager():
    torch = pytest.importorskip("torch", reason="PyTorch is needed for the side-by-side baseline")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    cfg = _config(T)
    weights = random_weights(cfg, seed=0, std=0.02)
    lora = _lora_values(cfg, 1)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, V, (1, T)).astype(np.int32)
    tgt = rng.integers(0, V, (1, T)).astype(np.int32)

    dev = krnl.device("cuda")
    m = LlamaModel(dev, cfg, weights, lora=LoraConfig(r=R, alpha=ALPHA), dtype="bf16")
    m.lora_params.load(lora)

    def krnl_step():
        with dev.step():
            m.zero_grads()
            m.forward_backward(ids, tgt)

    k_ms = _median_ms(krnl_step, dev.synchronize)
    k_loss = m.read_loss()
    dev.synchronize()
    peak = dev.pool_stats()["peak_in_use"]
    with krnl.profile(dev) as prof:  # GPU time per op (events), one step
        krnl_step()
        dev.synchronize()
    print("\nkrnl cuda, one W3 step, per-op GPU time:\n" + prof.table())

    rows = {}
    for attn in ("sdpa", "dense"):
        step, out = _torch_step(torch, cfg, weights, lora, ids, tgt, attn)
        rows[attn] = _median_ms(step, torch.cuda.synchronize)
        rows[attn + "_loss"] = float(out["loss"].detach().float())
        del step, out
        torch.cuda.empty_cache()

    fl = w3_flops()
    lines = [f"W3 step on {torch.cuda.get_device_name()} (T={T}, B=1, bf16, median of 7 after 2 warm-ups; "
             f"{fl / 1e12:.2f} TFLOP counted, LM head of V={V} not counted)"]
    for name, (med, lo, hi) in (("krnl cuda", k_ms), ("torch eager sdpa", rows["sdpa"]), ("torch eager dense", rows["dense"])):
        lines.append(f"  {name:18s} {med:8.1f} ms (min {lo:.1f}, max {hi:.1f})  {T / med * 1e3:9.0f} tokens/s  "
                     f"{fl / med / 1e9:6.1f} TFLOP/s")
    lines.append(f"  krnl / torch tokens/s: {rows['sdpa'][0] / k_ms[0]:.2f}x vs SDPA, {rows['dense'][0] / k_ms[0]:.2f}x vs dense")
    lines.append(f"  loss: krnl {k_loss:.5f}, torch sdpa {rows['sdpa_loss']:.5f}, dense {rows['dense_loss']:.5f}; "
                 f"krnl pool peak {peak / 2**30:.2f} GiB")
    print("\n" + "\n".join(lines))
    assert math.isfinite(k_loss)
    assert abs(k_loss - rows["sdpa_loss"]) <= 2e-2 * abs(rows["sdpa_loss"]), (k_loss, rows["sdpa_loss"])


def test_w3_lora_gemm_split_k():
    """The skinny LoRA GEMMs of W3 (T=4096, r=16, in/out 4096 or 14336), bf16 with f32 or bf16
    output, timed with split_k = 1 (cuBLAS alone), 2 and 4 and as routed: the data behind
    CudaBackend::split_k_config."""
    from krnl import ops

    dev = krnl.device("cuda")
    rng = np.random.default_rng(4)
    up = lambda *s: dev.tensor(rng.standard_normal(s).astype(np.float32), "bf16")
    cases = []
    for n_in in (4096, 14336):
        X, A, dt = up(T, n_in), up(R, n_in), up(T, R)
        cases += [(f"t = x A^T   nt M={T} N={R} K={n_in}", X, A, dev.empty((T, R), "bf16"), False, True),
                  (f"dA = dt^T x tn M={R} N={n_in} K={T}", dt, X, dev.empty((R, n_in), "f32"), True, False)]
        dy, B = up(T, n_in), up(n_in, R)
        cases.append((f"dt = dy B    nn M={T} N={R} K={n_in}", dy, B, dev.empty((T, R), "bf16"), False, False))
    lines = ["W3 LoRA GEMMs, us per call (median of 5 batches of 50):"]
    for name, a, b, c, ta, tb in cases:
        row = []
        for s in (1, 2, 4, -1):
            def run():
                with dev.step():
                    for _ in range(50):
                        ops.gemm(a, b, c, trans_a=ta, trans_b=tb, split_k=s)
            med, _, _ = _median_ms(run, dev.synchronize, warmup=1, rounds=5)
            row.append(f"split {s if s > 0 else 'auto=' + str(ops.gemm_plan(a, b, c, trans_a=ta, trans_b=tb)[0])}: "
                       f"{med * 1e3 / 50:6.1f}")
        lines.append(f"  {name:36s} " + "  ".join(row))
    print("\n" + "\n".join(lines))
