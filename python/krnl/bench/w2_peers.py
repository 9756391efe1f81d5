"""The peers' versions of the W2/W3 step (w2.py): float32 numpy with the backward written out,
PyTorch (eager or compiled) and MLX (eager or compiled), each a builder
`build(case) -> (step, result)` over a w2.Case, checked against krnl's before it is timed."""

import math

import numpy as np

from krnl.models.config import ALL_MODULES, lora_key
from .targets import mlx_target, numpy_only_f32_cpu, peer_builders, torch_target
from .w2 import _as_dict, _rope_tables, _weights_by_module


def build_torch(case, attn="sdpa", mode=None):
    """The same step in PyTorch on the peer device of the case's (CUDA, MPS or the CPU), in the
    case's dtype: frozen weights and LoRA leaves in that dtype, as PEFT on a model loaded in it;
    logits and the loss in f32. mode: None (eager) or a torch.compile mode for the layer. attn:
    "sdpa" is F.scaled_dot_product_attention(is_causal=True), "manual" dense matmul + masked
    softmax. Returns (step, result_tuple) with result_tuple() -> (loss, grads, dx)."""
    torch, tdev, tdt, sync = torch_target(case.device, case.dtype, mode)
    import torch.nn.functional as Fn

    cfg, T, s, eps = case.cfg, case.T, case.scale, case.eps
    Hh, Dh, Hk = cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(tdev, tdt)
    w = {k: t(v) for k, v in case.weights.items()}
    lora = {k: t(v).clone().requires_grad_(True) for k, v in case.lora.items()}
    p = "model.layers.0."
    W = {m: t(a) for m, a in _weights_by_module(case).items()}
    AB = {m: (lora[lora_key(0, m, "A")], lora[lora_key(0, m, "B")]) for m in ALL_MODULES}
    n1, n2 = w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"]
    embed, head, norm = w["model.embed_tokens.weight"], w["lm_head.weight"], w["model.norm.weight"]
    cos, sin = (t(a) for a in _rope_tables(cfg, T))
    mask = torch.ones(T, T, dtype=torch.bool, device=tdev).tril()
    ids = torch.from_numpy(case.ids.reshape(-1).astype(np.int64)).to(tdev)
    tgt = torch.from_numpy(case.targets.reshape(-1).astype(np.int64)).to(tdev)

    def lin(h, m):
        A, B = AB[m]
        return Fn.linear(h, W[m]) + Fn.linear(Fn.linear(h, A), B) * s

    def rope(q):  # (H, T, Dh), rotate-half
        q1, q2 = q[..., : Dh // 2], q[..., Dh // 2:]
        return q * cos + torch.cat([-q2, q1], -1) * sin

    def heads(z, n):
        return z.view(T, n, Dh).transpose(0, 1)

    def layer_loss(x):
        xn = Fn.rms_norm(x, (x.shape[-1],), n1, eps)
        q, k, v = rope(heads(lin(xn, "q_proj"), Hh)), rope(heads(lin(xn, "k_proj"), Hk)), heads(lin(xn, "v_proj"), Hk)
        if Hk != Hh:  # GQA (W3): each KV head serves Hh/Hk query heads
            k, v = k.repeat_interleave(Hh // Hk, 0), v.repeat_interleave(Hh // Hk, 0)
        if attn == "sdpa":
            o = Fn.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        else:
            sc = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(Dh))
            o = torch.softmax(sc.masked_fill(~mask, float("-inf")).float(), -1).to(tdt) @ v
        h = x + lin(o.transpose(0, 1).reshape(T, Hh * Dh), "o_proj")
        hn = Fn.rms_norm(h, (h.shape[-1],), n2, eps)
        y = h + lin(Fn.silu(lin(hn, "gate_proj")) * lin(hn, "up_proj"), "down_proj")
        logits = Fn.linear(Fn.rms_norm(y, (y.shape[-1],), norm, eps), head).float()
        return Fn.cross_entropy(logits, tgt)

    # The embedding output is the leaf whose gradient is dX, so it stays outside the compiled region.
    layer = layer_loss if mode is None else torch.compile(layer_loss, mode=mode, dynamic=False)
    state = {}

    def step():
        if mode == "reduce-overhead":  # a new iteration: the graph may overwrite earlier outputs
            torch.compiler.cudagraph_mark_step_begin()
        for a in lora.values():
            a.grad = None
        x = Fn.embedding(ids, embed).requires_grad_(True)  # frozen table; dX at its output, as krnl
        state["x"] = x
        loss = layer(x)
        loss.backward()
        sync()
        return loss

    def result():
        loss = step()
        f = lambda v: v.detach().float().cpu().numpy().copy()
        return float(loss.detach()), {k: f(a.grad) for k, a in lora.items()}, f(state["x"].grad)

    return step, result


def _build_torch_peer(case, mode):
    step, result = build_torch(case, "sdpa", mode)
    return step, lambda: _as_dict(*result())


def numpy_w2_step(case):
    """The same step in float32 numpy, backward written out: (loss, grads, dx). Dense attention."""
    cfg, T, s = case.cfg, case.T, np.float32(case.scale)
    Hh, Dh, Hk = cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
    rep = Hh // Hk
    w, W = case.weights, _weights_by_module(case)
    AB = {m: (case.lora[lora_key(0, m, "A")], case.lora[lora_key(0, m, "B")]) for m in ALL_MODULES}
    p = "model.layers.0."
    n1, n2 = w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"]
    head, normw = w["lm_head.weight"], w["model.norm.weight"]
    cos, sin = _rope_tables(cfg, T)
    ids, tgt = case.ids.reshape(-1), case.targets.reshape(-1)
    half = Dh // 2

    def rms(x, g):
        r = 1.0 / np.sqrt(np.mean(x * x, -1, keepdims=True) + np.float32(case.eps))
        return x * r * g, r

    def rms_back(d, x, r, g):
        gw, xh = d * g, x * r
        return r * (gw - xh * np.mean(gw * xh, -1, keepdims=True))

    def lin(h, m):
        A, B = AB[m]
        t = h @ A.T
        return h @ W[m].T + (t @ B.T) * s, t

    grads = {}

    def lin_back(dz, h, t, m):
        A, B = AB[m]
        grads[lora_key(0, m, "B")] = s * (dz.T @ t)
        dt = s * (dz @ B)
        grads[lora_key(0, m, "A")] = dt.T @ h
        return dz @ W[m] + dt @ A

    rot = lambda z: np.concatenate([-z[..., half:], z[..., :half]], -1)
    rot_t = lambda z: np.concatenate([z[..., half:], -z[..., :half]], -1)  # the transpose of rot
    heads = lambda z, n: z.reshape(T, n, Dh).transpose(1, 0, 2)
    flat = lambda z: z.transpose(1, 0, 2).reshape(T, -1)

    # forward
    x = w["model.embed_tokens.weight"][ids]
    xn, r1 = rms(x, n1)
    (q, tq), (k, tk), (v, tv) = lin(xn, "q_proj"), lin(xn, "k_proj"), lin(xn, "v_proj")
    qh, kh, vh = heads(q, Hh), heads(k, Hk), heads(v, Hk)
    qr, kr = qh * cos + rot(qh) * sin, kh * cos + rot(kh) * sin
    kx, vx = np.repeat(kr, rep, 0), np.repeat(vh, rep, 0)
    c = np.float32(1.0 / math.sqrt(Dh))
    S = np.where(np.tri(T, dtype=bool), (qr @ kx.transpose(0, 2, 1)) * c, np.float32(-np.inf))
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    att = flat(P @ vx)
    o, to = lin(att, "o_proj")
    h = x + o
    hn, r2 = rms(h, n2)
    (g, tg), (u, tu) = lin(hn, "gate_proj"), lin(hn, "up_proj")
    sg = 1.0 / (1.0 + np.exp(-g))
    a = g * sg * u
    dn, td = lin(a, "down_proj")
    y = h + dn
    yn, r3 = rms(y, normw)
    logits = yn @ head.T
    mx_ = logits.max(-1, keepdims=True)
    e = np.exp(logits - mx_)
    z = e.sum(-1, keepdims=True)
    loss = float(np.mean(np.log(z[:, 0]) + mx_[:, 0] - logits[np.arange(T), tgt]))

    # backward
    dlog = e / z
    dlog[np.arange(T), tgt] -= 1.0
    dlog /= np.float32(T)
    dy = rms_back(dlog @ head, y, r3, normw)
    da = lin_back(dy, a, td, "down_proj")
    dg = da * u * sg * (1.0 + g * (1.0 - sg))
    du = da * g * sg
    dhn = lin_back(dg, hn, tg, "gate_proj") + lin_back(du, hn, tu, "up_proj")
    dh = dy + rms_back(dhn, h, r2, n2)
    dO = heads(lin_back(dh, att, to, "o_proj"), Hh)
    dP = dO @ vx.transpose(0, 2, 1)
    dvx = P.transpose(0, 2, 1) @ dO
    dS = P * (dP - np.sum(dP * P, -1, keepdims=True)) * c
    dq, dkx = dS @ kx, dS.transpose(0, 2, 1) @ qr
    dk = dkx.reshape(Hk, rep, T, Dh).sum(1)
    dv = dvx.reshape(Hk, rep, T, Dh).sum(1)
    dq, dk = dq * cos + rot_t(dq * sin), dk * cos + rot_t(dk * sin)
    dxn = (lin_back(flat(dq), xn, tq, "q_proj") + lin_back(flat(dk), xn, tk, "k_proj")
           + lin_back(flat(dv), xn, tv, "v_proj"))
    dx = dh + rms_back(dxn, x, r1, n1)
    return loss, grads, dx


def build_numpy(case):
    numpy_only_f32_cpu(case.device, case.dtype)
    return (lambda: numpy_w2_step(case)), lambda: _as_dict(*numpy_w2_step(case))


def _build_mlx(case, compiled):
    mx, mdev, mdt = mlx_target(case.device, case.dtype)
    cfg, T, s, eps = case.cfg, case.T, case.scale, case.eps
    Hh, Dh, Hk = cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
    arr = lambda a: mx.array(a).astype(mdt)
    w = {k: arr(v) for k, v in case.weights.items()}
    W = {m: arr(a) for m, a in _weights_by_module(case).items()}
    p = "model.layers.0."
    n1, n2 = w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"]
    head, normw = w["lm_head.weight"], w["model.norm.weight"]
    cos, sin = (arr(a) for a in _rope_tables(cfg, T))
    ids, tgt = mx.array(case.ids.reshape(-1)), mx.array(case.targets.reshape(-1))
    lora0 = {k: arr(v) for k, v in case.lora.items()}
    half = Dh // 2

    def rope(z):
        return z * cos + mx.concatenate([-z[..., half:], z[..., :half]], -1) * sin

    def loss_fn(x, lora):
        def lin(h, m):
            A, B = lora[lora_key(0, m, "A")], lora[lora_key(0, m, "B")]
            return h @ W[m].T + ((h @ A.T) @ B.T) * s

        heads = lambda z, n: z.reshape(T, n, Dh).transpose(1, 0, 2)
        xn = mx.fast.rms_norm(x, n1, eps)
        q, k = rope(heads(lin(xn, "q_proj"), Hh)), rope(heads(lin(xn, "k_proj"), Hk))
        v = heads(lin(xn, "v_proj"), Hk)
        o = mx.fast.scaled_dot_product_attention(q[None], k[None], v[None], scale=1.0 / math.sqrt(Dh),
                                                 mask="causal")[0]
        h = x + lin(o.transpose(1, 0, 2).reshape(T, Hh * Dh), "o_proj")
        hn = mx.fast.rms_norm(h, n2, eps)
        g = lin(hn, "gate_proj")
        y = h + lin(g * mx.sigmoid(g) * lin(hn, "up_proj"), "down_proj")
        logits = (mx.fast.rms_norm(y, normw, eps) @ head.T).astype(mx.float32)
        picked = mx.take_along_axis(logits, tgt[:, None], -1)[:, 0]
        return mx.mean(mx.logsumexp(logits, -1) - picked)

    grad_fn = mx.value_and_grad(loss_fn, argnums=(0, 1))
    fn = mx.compile(grad_fn) if compiled else grad_fn
    x0 = w["model.embed_tokens.weight"][ids]  # the embedding output: dX is taken there, as krnl

    def step():
        with mx.stream(mdev):
            loss, (dx, dl) = fn(x0, lora0)
            mx.eval(loss, dx, dl)
        return loss, dl, dx

    def result():
        loss, dl, dx = step()
        f = lambda v: np.array(v.astype(mx.float32))
        return _as_dict(loss.item(), {k: f(v) for k, v in dl.items()}, f(dx))

    return step, result


PEERS = peer_builders(build_numpy, _build_torch_peer, _build_mlx)
