"""Sampling with a KV cache: the prompt runs once through every layer, then each new token runs the
same decoder layer (layer.layer_forward) with an attention that appends its keys and values to the
cache and attends to every cached position."""

import numpy as np

from .. import _core
from .attention import Batch
from .layer import layer_forward
from ..quant.qweight import embed, linear

ops = _core.ops


class KVCache:
    """Per layer and KV head: keys and values (total, D), rows filled as positions are decoded."""

    def __init__(self, device, dtype, layers, heads, total, window=0):
        self.heads, self.window = heads, int(window or 0)  # window: the config's sliding window
        self.layers = layers  # their Gemma settings, own windows and sinks
        e = lambda: [device.empty((total, heads.D), dtype) for _ in range(heads.Hk)]
        self.k = [e() for _ in layers]
        self.v = [e() for _ in layers]

    def attention(self, i, start):
        """layer_forward's attend for layer i on tokens at positions start..: appends their keys
        and values, then out = causal attention over every cached position."""
        hd, L = self.heads, self.layers[i]
        ga, sinks = L.gemma, L.sinks
        Kc, Vc, g, D, scale = self.k[i], self.v[i], hd.g, hd.D, hd.scale
        cap, window = 0.0, self.window if L.window is None else L.window
        if ga is not None:  # gemma2: its scale, soft-capped scores, the layer's sliding window
            scale, cap, window = ga.scale, ga.softcap, ga.window

        def attend(b, q, k, v, out):  # q, out (H, n, D); k, v (Hk, n, D)
            d, dt, n = q.device, q.dtype, q.shape[1]
            end = start + n
            for j in range(hd.Hk):
                ops.cast(k[j], Kc[j][start:end])                          # append to the cache
                ops.cast(v[j], Vc[j][start:end])
                # The g query heads of KV head j are contiguous: one (g n, D) operand.
                S = d.empty((g, n, end), dt)
                ops.gemm(q[j * g:(j + 1) * g].reshape(g * n, D), Kc[j][:end], S.reshape(g * n, end), trans_b=True)
                if cap:
                    ops.scale(S, scale, S)
                    ops.softcap(S, cap, S)
                ops.softmax_causal_forward(S, S, 1.0 if cap else scale, window=window,  # query i at start + i
                                           sinks=None if sinks is None else sinks[j * g:(j + 1) * g])
                ops.gemm(S.reshape(g * n, end), Vc[j][:end], out[j * g:(j + 1) * g].reshape(g * n, D))
            return None  # nothing to save: no backward

        return attend


def sample(logits, temperature, top_p, rng, top_k=0):
    """A token id from logits (V,): argmax at temperature 0, else from softmax(logits / temperature)
    restricted to the top_k largest logits (0: all; ties at the k-th kept, as transformers' top-k),
    then to the smallest set of tokens whose probability reaches top_p."""
    z = np.asarray(logits, np.float64)
    if temperature == 0:
        return int(np.argmax(z))
    z = (z - z.max()) / temperature
    if 0 < top_k < len(z):
        z = np.where(z >= np.partition(z, -top_k)[-top_k], z, -np.inf)
    p = np.exp(z)
    p /= p.sum()
    order = np.argsort(-p)
    keep = order[:int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]
    return int(rng.choice(keep, p=p[keep] / p[keep].sum()))


def decode(model, ids, start, cache):
    """Runs tokens `ids` at positions start.. through the model (no dropout), appending their keys
    and values to cache; returns the logits (V,) f32 of the last one."""
    d, dt, c = model.dev, model.dtype, model.config
    n, C = len(ids), c.hidden_size
    with d.step():
        ids_t = d.tensor(np.asarray(ids, np.int32), "i32")
        batch = Batch(1, n, [d.tensor(np.arange(start, start + n, dtype=np.int32), "i32")],
                      inv_freq=model.call_inv_freq(start + n - 1))
        x = d.empty((n, C), dt)                                           # (n, C)
        embed(ids_t, model.embed, x)
        if model.embed_scale is not None:
            ops.scale(x, model.embed_scale, x)
        for i, L in enumerate(model.layers):
            x, _ = layer_forward(L, x, batch, cache.attention(i, start))
        last, xn, r = x[n - 1:n], d.empty((1, C), dt), d.empty((1,), "f32")
        ops.rmsnorm_forward(last, model.norm_w, xn, r, c.rms_norm_eps)
        logits = d.empty((1, c.vocab_size), "f32" if dt == "f32" else dt)  # (1, V)
        linear(xn, model.head, logits)
        if model.final_softcap:
            ops.softcap(logits, model.final_softcap, logits)
    return np.asarray(logits.numpy()[0], np.float32)


def generate(model, prompt, max_new_tokens=32, temperature=0.0, top_p=1.0, seed=0, eos_id=None, top_k=0):
    """Up to max_new_tokens ids sampled after `prompt` (a non-empty list of valid ids), stopping
    after eos_id or at max_position_embeddings."""
    if not (temperature >= 0) or not (0 < top_p <= 1):
        raise ValueError(f"[generate] temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}")
    mp = model.config.max_position_embeddings
    total = min(len(prompt) + max_new_tokens, mp)
    if len(prompt) >= total:
        raise ValueError(f"[generate] the prompt fills max_position_embeddings {mp}")
    cache = KVCache(model.dev, model.dtype, model.layers, model.heads, total, model.config.sliding_window)
    rng = np.random.default_rng(seed)
    out, pending, pos = [], prompt, 0
    switch = model.config.rope_switch_position  # LongRoPE: None, or where the long factors begin
    while pos + len(pending) <= total:
        if switch is not None and 0 < pos <= switch < pos + len(pending):
            # The cached keys were rotated with the short factors: as transformers' Phi-3 does,
            # run the whole sequence again with the long ones (once, then decode on).
            pending, pos = prompt + out, 0
        logits = decode(model, pending, pos, cache)
        pos += len(pending)
        nxt = sample(logits, temperature, top_p, rng, top_k)
        out.append(nxt)
        if nxt == eos_id or len(out) == max_new_tokens or pos >= total:
            break
        pending = [nxt]
    return out
