"""W2 and W3 (DESIGN section 6): one LoRA training step of a single Llama layer, as krnl runs it
and as each peer runs it. W3, the Llama-3-8B layer, is the same step at other sizes, with GQA.

    W2: 16 heads of 128 (MHA), RoPE (rotate-half), causal, LoRA r=32 on q, k, v, o, gate, up,
        down; T=512 (B=1), C=2048, F=5632, RMSNorm eps 1e-6 (Llama 2); frozen base weights.
    W3: 32 query heads / 8 KV heads of 128, T=4096, C=4096, F=14336, r=16, eps 1e-5 (Llama 3).
    Both: lora_alpha = 2r (scale 2, PEFT's usual choice); the dtype is the device's compute
    dtype (f32 on the CPU, bf16 on CUDA) unless the caller names another.

krnl runs it as a LlamaModel with num_hidden_layers=1 and vocab 256: embedding lookup, the layer,
the final RMSNorm, an LM head of 256 rows and the mean cross entropy. The head is 2*2*T*V*C =
1.07 GFLOP at W2 (forward + dX), under 1% of the layer's 115.5, and is not counted in the GFLOP/s.
One training step = forward + backward to the 14 LoRA gradients and the gradient at the layer
input (the embedding output), no optimizer: the work PyTorch does in loss.backward().

Every implementation is a builder `build(case) -> (step, result)`; `result()` runs one step and
returns {"loss", "dx", <14 PEFT LoRA keys>} as numpy f32."""

import math

import numpy as np

import krnl
from krnl.model import LlamaModel, LoraConfig, ModelConfig, lora_key, random_weights, ALL_MODULES
from .targets import mlx_target, numpy_only_f32_cpu, peer_builders, replayed, torch_target

T, C, F, H, D, R, V = 512, 2048, 5632, 16, 128, 32, 256
EPS = 1e-6
W2 = dict(C=C, F=F, H=H, D=D, T=T, r=R)
SMALL = dict(C=64, F=176, H=4, D=16, T=33, r=32, seed=3)  # the cross-check size
QUICK = dict(C=256, F=704, H=4, D=64, T=64, r=8)
W3 = dict(C=4096, F=14336, H=32, KV=8, D=128, T=4096, r=16, eps=1e-5)  # Llama-3-8B layer, for the H200
W3_QUICK = dict(C=256, F=896, H=8, KV=2, D=32, T=64, r=16, eps=1e-5)
W3_SMALL = dict(C=64, F=176, H=4, KV=2, D=16, T=33, r=16, eps=1e-5, seed=3)


def w2_flops(T=T, C=C, F=F, H=H, D=D, R=R, KV=None):
    """Matmul FLOPs of one step of the layer (2*m*n*k per product), dense attention:
    forward  base  2T(4C^2 + 3CF)                  q,k,v,o (C x C), gate, up (F x C), down (C x F)
             LoRA  2T r (in + out) per projection   x A^T then t B^T
             attn  2 * 2 H T^2 D                    S = Q K^T, O = P V over the full T x T
    backward base  = forward base (dX only; the base weights are frozen)
             LoRA  2 x forward LoRA                 dB, dt, dA, dX
             attn  2 x forward attn                 dV, dP, dQ, dK
    Elementwise work (norms, RoPE, softmax, SwiGLU) and the LM head are not counted.
    With T=512, C=2048, F=5632, H=16, D=128, r=32: 115.54 GFLOP (52.61 + 1.29 + 2.15 forward).
    KV (GQA) shrinks k and v to KV*D outputs; by default KV = H."""
    kvd = (H if KV is None else KV) * D
    shapes = [(H * D, C), (kvd, C), (kvd, C), (C, H * D), (F, C), (F, C), (C, F)]  # (out, in)
    base = sum(2 * T * o * i for o, i in shapes)
    lora = sum(2 * T * R * (o + i) for o, i in shapes)
    attn = 2 * 2 * H * T * T * D
    return 2 * base + 3 * lora + 3 * attn


FLOPS = w2_flops()


def activation_bytes(T=T, C=C, F=F, H=H, R=R, elt=4):
    """What one layer must keep from forward for backward (f32, B=1), as krnl keeps it:
        x (layer input, for RMSNorm backward)          T*C   + rstd1 T
        xn = rmsnorm(x) (input of q, k, v: dA)         T*C
        q, k after RoPE, v (per head)                  3*T*C
        P = softmax(S), dense                          H*T*T
        att (input of o_proj)                          T*C
        h = x + attn (for RMSNorm backward)            T*C   + rstd2 T
        hn = rmsnorm(h) (input of gate, up)            T*C
        g, u (for SwiGLU backward)                     2*T*F
        a = silu(g)*u (input of down)                  T*F
        t = x A^T of the 7 adapters                    7*T*r
    = elt * (T*(7C + 3F + 7r + 2) + H*T^2) = 81.2 MB at W2."""
    return elt * (T * (7 * C + 3 * F + 7 * R + 2) + H * T * T)


def step_temporaries_bytes(T=T, C=C, F=F, H=H, R=R, elt=4):
    """Every buffer krnl's forward_backward allocates in one step (model.py, one layer, V=256):
    28 T*C (13 forward + final norm, dlogits-to-x, head dX + 12 backward), 6 T*F (g, u, a, da,
    dg, du), 4 H*T^2 (S, P, dP, dS), 14 T*r (t and dt of 7 adapters), T*V logits, 4 T rows.
    On an asynchronous device a buffer released in a step is reused only after the step
    completes (DESIGN section 4), so this (255.2 MB at W2) bounds what the pool reserves for one
    step there; the CPU reuses released buffers within the step and reserves about the live peak."""
    return elt * (28 * T * C + 6 * T * F + 4 * H * T * T + 14 * T * R + T * V + 4 * T)


def frozen_weight_bytes(C=C, F=F, elt=4):
    """The layer's frozen projections: 4 C^2 + 3 C F floats = 205.5 MB at W2 (norms not counted)."""
    return elt * (4 * C * C + 3 * C * F)


def _config(C, F, H, D, T, KV=None, eps=EPS):
    return ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": V, "hidden_size": C, "intermediate_size": F,
        "num_hidden_layers": 1, "num_attention_heads": H, "num_key_value_heads": H if KV is None else KV,
        "head_dim": D, "rms_norm_eps": eps, "max_position_embeddings": max(T, 64), "tie_word_embeddings": False})


def _lora_values(cfg, r, seed):
    """A ~ U(+-1/sqrt(in)) as PEFT; B nonzero (PEFT starts it at 0) so every gradient path counts."""
    rng = np.random.default_rng(seed)
    vals = {}
    for m in ALL_MODULES:
        out, inp = cfg.module_shape(m)
        b = 1.0 / math.sqrt(inp)
        vals[lora_key(0, m, "A")] = rng.uniform(-b, b, (r, inp)).astype(np.float32)
        vals[lora_key(0, m, "B")] = (0.1 * rng.standard_normal((out, r)) / math.sqrt(r)).astype(np.float32)
    return vals


class Case:
    """One problem: weights, LoRA factors, ids and targets as numpy; krnl's model (on `device`, in
    `dtype`) and its step."""

    def __init__(self, C, F, H, D, T, r, seed=0, KV=None, eps=EPS, device="cpu", dtype="f32"):
        self.cfg = _config(C, F, H, D, T, KV, eps)
        self.T, self.r, self.eps, self.scale = T, r, eps, 2.0  # lora_alpha = 2r
        self.device, self.dtype = device, dtype
        self.flops = w2_flops(T, C, F, H, D, r, KV)
        self.weights = random_weights(self.cfg, seed=seed, std=0.02)
        self.lora = _lora_values(self.cfg, r, seed + 1)
        rng = np.random.default_rng(seed + 2)
        self.ids = rng.integers(0, V, (1, T)).astype(np.int32)
        self.targets = rng.integers(0, V, (1, T)).astype(np.int32)
        self.dev = krnl.device(device)
        self.model = LlamaModel(self.dev, self.cfg, self.weights, lora=LoraConfig(r=r, alpha=2.0 * r), dtype=dtype)
        self.model.lora_params.load(self.lora)

    @classmethod
    def of(cls, size, device="cpu", dtype="f32"):
        return cls(**size, device=device, dtype=dtype)

    def krnl_step(self):
        m = self.model
        with self.dev.step():
            m.zero_grads()
            m.forward_backward(self.ids, self.targets)
        self.dev.synchronize()

    def krnl_outputs(self):
        """(loss, grads, dx) of the step that ran last."""
        return (self.model.read_loss(), self.model.lora_grads(),
                np.array(self.model.d_embed_out.numpy(), np.float32).reshape(self.T, -1))

    def krnl_result(self):
        self.krnl_step()
        return self.krnl_outputs()


def _as_dict(loss, grads, dx):
    out = {"loss": np.float32(loss), "dx": np.asarray(dx, np.float32)}
    out.update({k: np.asarray(v, np.float32) for k, v in grads.items()})
    return out


def build_krnl(case):
    return case.krnl_step, lambda: _as_dict(*case.krnl_result())


def build_krnl_graph(case):
    """The step recorded once as a CUDA graph and replayed (Device.capture): ids live on the
    device, the body opens no step of its own."""
    m, dev = case.model, case.dev
    ids = dev.tensor(case.ids, "i32")

    def body():
        m.zero_grads()
        return m.forward_backward(ids, case.targets)

    step, graph = replayed(dev, body)

    def result():
        step()
        loss, grads, dx = case.krnl_outputs()
        return _as_dict(float(np.asarray(graph.outputs.numpy(), np.float32).reshape(-1)[0]), grads, dx)

    return step, result


def _rope_tables(cfg, T):
    inv = cfg.inv_freq().astype(np.float64)
    fr = np.outer(np.arange(T, dtype=np.float64), inv)
    return (np.concatenate([np.cos(fr)] * 2, -1).astype(np.float32),
            np.concatenate([np.sin(fr)] * 2, -1).astype(np.float32))


def _weights_by_module(case):
    p = "model.layers.0."
    return {m: case.weights[p + ("self_attn." if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.") + m + ".weight"]
            for m in ALL_MODULES}


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
