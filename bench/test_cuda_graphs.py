"""CUDA graphs and the DESIGN section 6 workloads on the CUDA backend, in bf16, krnl next to
PyTorch eager and torch.compile on the same GPU in the same run:

    W1: the KRNL MLP block (T=512, C=2048, F=5632, r=32): forward, dX and the 4 LoRA gradients.
    W2: one Llama layer (T=512, C=2048, F=5632, 16 heads of 128, r=32) + 256-row head, mean CE.
    W3: the Llama-3-8B layer (T=4096, C=4096, F=14336, GQA 32/8 heads, r=16), as bench/test_cuda_w3.py.

krnl runs each step eagerly (Python issues every op) and as a replayed CUDA graph (Device.capture:
one launch per step). Times are per step with steps queued back to back (n steps, then one sync),
so they measure throughput, not the latency of a lone step. The last test times W3's skinny LoRA
GEMMs against their memory-bandwidth bound (bytes moved / 4.8 TB/s, and / a device-to-device copy
rate measured in the same run).

Run (needs a CUDA device and torch with CUDA; skipped otherwise):
    PYTHONPATH=python python -m pytest bench/test_cuda_graphs.py -s -q
"""

import math
import time

import numpy as np
import pytest

import krnl
from krnl import ops
from krnl.mlp_block import MLPBlock, make_w1_params, w1_flops
from krnl.model import ALL_MODULES, LlamaModel, LoraConfig, ModelConfig, lora_key, random_weights

pytestmark = pytest.mark.skipif("cuda" not in krnl.devices(), reason="no cuda device")

HBM_TBS = 4.8  # H200 nominal HBM3e bandwidth (datasheet)
W2 = dict(T=512, C=2048, F=5632, H=16, KV=16, D=128, R=32, ALPHA=64.0, V=256, EPS=1e-6)
W3 = dict(T=4096, C=4096, F=14336, H=32, KV=8, D=128, R=16, ALPHA=32.0, V=256, EPS=1e-5)
LINES = []
# PyTorch peers: eager, torch.compile (default mode) and torch.compile with CUDA graphs
# ("reduce-overhead"), the like-for-like peer of krnl's graph replay.
TORCH_MODES = (("torch eager", None), ("torch.compile", "default"), ("compile+cudagraph", "reduce-overhead"))


def _torch():
    torch = pytest.importorskip("torch", reason="PyTorch is needed for the side-by-side baseline")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    return torch


def _per_step_ms(step, sync, n, rounds=5, warmup=2):
    """Median over rounds of (time of n back-to-back steps + one sync) / n."""
    for _ in range(warmup):
        step()
    sync()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        ts.append((time.perf_counter() - t0) / n)
    return 1e3 * float(np.median(ts))


def _report(title, rows, flops, tokens):
    """rows: [(name, ms)]; each row's time over krnl graph's and krnl eager's (> 1: krnl faster)."""
    base = dict(rows)
    out = [title]
    for name, ms in rows:
        out.append(f"  {name:18s} {ms:9.3f} ms {tokens / ms * 1e3:10.0f} tok/s {flops / ms / 1e9:7.1f} TFLOP/s   "
                   f"time/krnl-graph {ms / base['krnl graph']:5.2f}x   time/krnl-eager {ms / base['krnl eager']:5.2f}x")
    LINES.extend(out)
    print("\n" + "\n".join(out), flush=True)


def _layer_config(p):
    return ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": p["V"], "hidden_size": p["C"], "intermediate_size": p["F"],
        "num_hidden_layers": 1, "num_attention_heads": p["H"], "num_key_value_heads": p["KV"], "head_dim": p["D"],
        "rms_norm_eps": p["EPS"], "max_position_embeddings": max(p["T"], 64), "tie_word_embeddings": False})


def _layer_lora(cfg, r, seed):
    rng = np.random.default_rng(seed)
    vals = {}
    for m in ALL_MODULES:
        out, inp = cfg.module_shape(m)
        b = 1.0 / math.sqrt(inp)
        vals[lora_key(0, m, "A")] = rng.uniform(-b, b, (r, inp)).astype(np.float32)
        vals[lora_key(0, m, "B")] = (0.1 * rng.standard_normal((out, r)) / math.sqrt(r)).astype(np.float32)
    return vals


def _layer_flops(p):
    T, C, F, H, KV, D, R = (p[k] for k in ("T", "C", "F", "H", "KV", "D", "R"))
    shapes = [(H * D, C), (KV * D, C), (KV * D, C), (C, H * D), (F, C), (F, C), (C, F)]
    dense = sum(2 * T * o * i for o, i in shapes) * 2
    attn = 6 * 2 * H * T * T * D
    lora = sum(2 * T * R * (o + i) * 3 for o, i in shapes)
    return dense + attn + lora


def _torch_layer(torch, p, weights, lora_np, ids_np, tgt_np, mode):
    """The layer step in PyTorch bf16 (frozen bf16 weights, bf16 LoRA leaves as PEFT on a bf16
    model), SDPA attention; the embedding output is the dX leaf, outside the compiled region."""
    import torch.nn.functional as Fn

    T, C, H, KV, D, s, eps = p["T"], p["C"], p["H"], p["KV"], p["D"], p["ALPHA"] / p["R"], p["EPS"]
    g = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to("cuda", torch.bfloat16)
    pre = "model.layers.0."
    W = {m: g(weights[pre + ("self_attn." if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.") + m + ".weight"])
         for m in ALL_MODULES}
    lora = {k: g(v).requires_grad_(True) for k, v in lora_np.items()}
    AB = {m: (lora[lora_key(0, m, "A")], lora[lora_key(0, m, "B")]) for m in ALL_MODULES}
    n1, n2 = g(weights[pre + "input_layernorm.weight"]), g(weights[pre + "post_attention_layernorm.weight"])
    embed, head, norm = g(weights["model.embed_tokens.weight"]), g(weights["lm_head.weight"]), g(weights["model.norm.weight"])
    fr = np.outer(np.arange(T, dtype=np.float64), _layer_config(p).inv_freq().astype(np.float64))
    cos, sin = g(np.concatenate([np.cos(fr)] * 2, -1)), g(np.concatenate([np.sin(fr)] * 2, -1))
    ids = torch.from_numpy(ids_np.reshape(-1).astype(np.int64)).cuda()
    tgt = torch.from_numpy(tgt_np.reshape(-1).astype(np.int64)).cuda()

    def lin(h, m):
        A, B = AB[m]
        return Fn.linear(h, W[m]) + Fn.linear(Fn.linear(h, A), B) * s

    def rope(q):
        q1, q2 = q[..., : D // 2], q[..., D // 2:]
        return q * cos + torch.cat([-q2, q1], -1) * sin

    def heads(z, n):
        return z.view(T, n, D).transpose(0, 1)

    def layer_loss(x):
        xn = Fn.rms_norm(x, (C,), n1, eps)
        q, k, v = rope(heads(lin(xn, "q_proj"), H)), rope(heads(lin(xn, "k_proj"), KV)), heads(lin(xn, "v_proj"), KV)
        if KV != H:
            k, v = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)
        o = Fn.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        h = x + lin(o.transpose(0, 1).reshape(T, H * D), "o_proj")
        hn = Fn.rms_norm(h, (C,), n2, eps)
        y = h + lin(Fn.silu(lin(hn, "gate_proj")) * lin(hn, "up_proj"), "down_proj")
        return Fn.cross_entropy(Fn.linear(Fn.rms_norm(y, (C,), norm, eps), head).float(), tgt)

    layer = layer_loss if mode is None else torch.compile(layer_loss, mode=mode)
    out = {}

    def step():
        if mode == "reduce-overhead":  # a new iteration: earlier graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        for a in lora.values():
            a.grad = None
        x = Fn.embedding(ids, embed).requires_grad_(True)
        loss = layer(x)
        loss.backward()
        out["loss"] = loss

    return step, out


def _krnl_layer(p, weights, lora, ids, tgt):
    """(model, eager step, graph of the step): the layer as a 1-layer LlamaModel in bf16."""
    dev = krnl.device("cuda")
    m = LlamaModel(dev, _layer_config(p), weights, lora=LoraConfig(r=p["R"], alpha=p["ALPHA"]), dtype="bf16")
    m.lora_params.load(lora)

    def eager():
        with dev.step():
            m.zero_grads()
            m.forward_backward(ids, tgt)

    ids_t = dev.tensor(ids.astype(np.int32), "i32")

    def body():
        m.zero_grads()
        return m.forward_backward(ids_t, tgt)

    return m, eager, dev.capture(body)


def _bench_layer(name, p, n, with_compile=True):
    torch = _torch()
    dev = krnl.device("cuda")
    cfg = _layer_config(p)
    weights = random_weights(cfg, seed=0, std=0.02)
    lora = _layer_lora(cfg, p["R"], 1)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, p["V"], (1, p["T"])).astype(np.int32)
    tgt = rng.integers(0, p["V"], (1, p["T"])).astype(np.int32)
    m, eager, graph = _krnl_layer(p, weights, lora, ids, tgt)
    rows = [("krnl eager", _per_step_ms(eager, dev.synchronize, n))]
    loss_e = m.read_loss()
    rows.append(("krnl graph", _per_step_ms(graph.replay, dev.synchronize, n)))
    loss_g = float(graph.outputs.numpy()[0])
    graph.release()
    del m, graph
    dev.synchronize()
    dev.trim()
    losses = {"krnl eager": loss_e, "krnl graph": loss_g}
    for label, mode in TORCH_MODES if with_compile else TORCH_MODES[:1]:
        try:
            step, out = _torch_layer(torch, p, weights, lora, ids, tgt, mode)
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            rows.append((label, _per_step_ms(step, torch.cuda.synchronize, n)))
            losses[label] = float(out["loss"].detach().float())
            if mode:
                LINES.append(f"  ({name} {label} first call, compile included: {first:.1f} s)")
            del step, out
        except Exception as e:  # a peer that fails is reported, not fatal to the table
            LINES.append(f"  ({name} {label} failed: {type(e).__name__}: {str(e)[:200]})")
        torch.cuda.empty_cache()
    _report(f"{name} step, bf16, {torch.cuda.get_device_name()}, per step over {n} queued steps (median of 5):",
            rows, _layer_flops(p), p["T"])
    line = "  loss: " + ", ".join(f"{k} {v:.5f}" for k, v in losses.items())
    LINES.append(line)
    print(line, flush=True)
    assert abs(loss_g - loss_e) <= 1e-3 * abs(loss_e), (loss_g, loss_e)
    assert abs(loss_e - losses["torch eager"]) <= 2e-2 * abs(losses["torch eager"]), losses


def test_w3_lora_gemms_vs_bandwidth():
    """W3's skinny LoRA GEMMs (T=4096, r=16; in/out 4096, 1024 (k/v), 14336), bf16 operands, as
    the model issues them: each timed as 100 calls in one replayed graph (no launch gaps) and as
    100 eager calls, against bytes moved / 4.8 TB/s and / the copy rate measured here."""
    torch = _torch()
    dev = krnl.device("cuda")
    T, R = W3["T"], W3["R"]
    # Device-to-device copy rate, 2 GiB each way (read + write counted), torch's copy_ and krnl's cast.
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = _per_step_ms(lambda: b.copy_(a), torch.cuda.synchronize, 10)
    copy_tbs = 2 * a.numel() * 2 / ms / 1e9
    del a, b
    torch.cuda.empty_cache()
    ka, kb = dev.empty((1 << 30,), "bf16"), dev.empty((1 << 30,), "bf16")
    kms = _per_step_ms(lambda: ops.cast(ka, kb), dev.synchronize, 10)
    krnl_copy_tbs = 2 * (1 << 30) * 2 / kms / 1e9
    del ka, kb
    dev.synchronize()
    dev.trim()

    rng = np.random.default_rng(4)
    up = lambda *s: dev.tensor(rng.standard_normal(s).astype(np.float32) * 0.1, "bf16")
    cases = []  # (name, A, B, C, trans_a, trans_b, beta, bytes)
    for d in (4096, 1024, 14336):
        X, A, t, Bm = up(T, d), up(R, d), up(T, R), up(d, R)
        Y = up(T, d)
        cases += [
            (f"t = x A^T    ({T},{R})=({T},{d})({d},{R})", X, A, dev.empty((T, R), "bf16"), False, True, 0.0,
             2 * (T * d + R * d + T * R)),
            (f"dt = dy B    ({T},{R})=({T},{d})({d},{R})", Y, Bm, dev.empty((T, R), "bf16"), False, False, 0.0,
             2 * (T * d + d * R + T * R)),
            (f"dA = dt^T x  ({R},{d})=({R},{T})({T},{d}) f32", t, X, dev.empty((R, d), "f32"), True, False, 0.0,
             2 * (T * R + T * d) + 4 * R * d),
            (f"y += t B^T   ({T},{d})=({T},{R})({R},{d})", t, Bm, Y, False, True, 1.0,
             2 * (T * R + d * R) + 2 * 2 * T * d),
        ]
    out = [f"W3 LoRA GEMMs, bf16, {torch.cuda.get_device_name()}: us per call (100 calls per graph replay / per "
           f"eager step), bound = bytes / bandwidth; copy rate measured: torch copy_ {copy_tbs:.2f} TB/s, "
           f"krnl cast {krnl_copy_tbs:.2f} TB/s (nominal {HBM_TBS})"]
    out.append(f"  {'GEMM':48s} {'MB':>7s} {'graph us':>9s} {'eager us':>9s} {'TB/s':>6s} "
               f"{'%4.8':>6s} {'%copy':>6s}")
    for name, A, B, Cm, ta, tb, beta, nbytes in cases:
        def calls():
            for _ in range(100):
                ops.gemm(A, B, Cm, trans_a=ta, trans_b=tb, beta=beta)

        def eager():
            with dev.step():
                calls()

        e_us = _per_step_ms(eager, dev.synchronize, 1, rounds=5, warmup=1) * 1e3 / 100
        g = dev.capture(calls)
        g_us = _per_step_ms(g.replay, dev.synchronize, 1, rounds=5, warmup=1) * 1e3 / 100
        g.release()
        tbs = nbytes / g_us / 1e6
        out.append(f"  {name:48s} {nbytes / 1e6:7.1f} {g_us:9.1f} {e_us:9.1f} {tbs:6.2f} "
                   f"{100 * tbs / HBM_TBS:5.0f}% {100 * tbs / copy_tbs:5.0f}%")
    LINES.extend(out)
    print("\n" + "\n".join(out), flush=True)


def test_w3_layer():
    _bench_layer("W3 (T=4096, C=4096, F=14336, GQA 32/8x128, r=16)", W3, n=5, with_compile=False)


def test_w1_mlp_block():
    torch = _torch()
    import torch.nn.functional as Fn

    dev = krnl.device("cuda")
    T, C, F, R, S, EPS = 512, 2048, 5632, 32, 2.0, 1e-5
    P = make_w1_params(T, C, F, R, seed=0)
    block = MLPBlock(dev, P, T, scale=S, eps=EPS, dtype="bf16")
    x, dy = dev.tensor(P["x"], "bf16"), dev.tensor(P["dy"], "bf16")

    def body():
        block.forward(x)
        return block.backward(x, dy)

    def eager():
        with dev.step():
            body()

    n = 50
    rows = [("krnl eager", _per_step_ms(eager, dev.synchronize, n))]
    y_e = np.array(block.y.numpy(), np.float32)
    graph = dev.capture(body)
    rows.append(("krnl graph", _per_step_ms(graph.replay, dev.synchronize, n)))
    y_g = np.array(block.y.numpy(), np.float32)
    graph.release()
    np.testing.assert_allclose(y_g, y_e, rtol=1e-2, atol=1e-2)

    g = lambda k: torch.from_numpy(np.ascontiguousarray(P[k])).to("cuda", torch.bfloat16)
    w, Wg, Wu, Wd, tdy = g("w_norm"), g("Wg"), g("Wu"), g("Wd"), g("dy")
    for label, mode in TORCH_MODES:
        lora = [g(k).requires_grad_(True) for k in ("Ag", "Bg", "Au", "Bu")]
        tx = g("x").requires_grad_(True)

        def blk(x, Ag, Bg, Au, Bu):
            h = Fn.rms_norm(x, (C,), w, EPS)
            gg = Fn.linear(h, Wg) + Fn.linear(Fn.linear(h, Ag) * S, Bg)
            u = Fn.linear(h, Wu) + Fn.linear(Fn.linear(h, Au) * S, Bu)
            return x + Fn.linear(Fn.silu(gg) * u, Wd)

        fwd = blk if mode is None else torch.compile(blk, mode=mode)

        def step():
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            for a in [tx] + lora:
                a.grad = None
            fwd(tx, *lora).backward(tdy)

        try:
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            if mode:
                LINES.append(f"  (W1 {label} first call, compile included: {time.perf_counter() - t0:.1f} s)")
            rows.append((label, _per_step_ms(step, torch.cuda.synchronize, n)))
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            y_t = fwd(tx, *lora).detach().float().cpu().numpy()
        except Exception as e:
            LINES.append(f"  (W1 {label} failed: {type(e).__name__}: {str(e)[:200]})")
            continue
        assert np.max(np.abs(y_t - y_e)) <= 0.05 * np.max(np.abs(y_t)), label
    _report(f"W1 MLP block step (T={T}, C={C}, F={F}, r={R}), bf16, {torch.cuda.get_device_name()}, "
            f"per step over {n} queued steps (median of 5):", rows, w1_flops(T, C, F, R), T)


def test_w2_layer():
    _bench_layer("W2 (T=512, C=2048, F=5632, 16x128 MHA, r=32)", W2, n=30)


def test_zz_summary():
    print("\n==== summary ====\n" + "\n".join(LINES), flush=True)
