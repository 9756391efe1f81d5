"""Sampling with a KV cache: the prompt runs once through every layer, then each new token runs the
same decoder layer (layer.layer_forward) with an attention that appends its keys and values to the
cache and attends to every cached position (batch_decode.py decodes many sequences at once)."""

import numpy as np

from .. import _core
from .attention import Batch
from .layer import layer_forward
from .step_inputs import check_ids
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
        sinks = L.sinks
        Kc, Vc, g, D = self.k[i], self.v[i], hd.g, hd.D
        scale, cap, window = scoring(L, hd, self.window)

        def attend(b, q, k, v, out):  # q, out (H, n, D); k, v (Hk, n, D)
            d, dt, n = q.device, q.dtype, q.shape[1]
            end = start + n
            for j in range(hd.Hk):
                ops.cast(k[j], Kc[j][start:end])                          # append to the cache
                ops.cast(v[j], Vc[j][start:end])
                # The g query heads of KV head j are contiguous: one (g n, D) operand.
                S = d.empty((g, n, end), dt)
                ops.gemm(q[j * g:(j + 1) * g].reshape(g * n, D), Kc[j][:end], S.reshape(g * n, end), trans_b=True)
                softmax_scores(S, scale, cap, window, None if sinks is None else sinks[j * g:(j + 1) * g])
                ops.gemm(S.reshape(g * n, end), Vc[j][:end], out[j * g:(j + 1) * g].reshape(g * n, D))
            return None  # nothing to save: no backward

        return attend


def scoring(L, hd, window):
    """(scale, soft-cap (0: none), sliding window) of layer L's attention; window the config's."""
    if L.gemma is not None:  # gemma2: its scale, soft-capped scores, the layer's sliding window
        return L.gemma.scale, L.gemma.softcap, L.gemma.window
    return hd.scale, 0.0, window if L.window is None else L.window


def softmax_scores(S, scale, cap, window, sinks, mask=None):
    """S (..., n, end) scores of queries at positions end - n.. in place to probabilities; mask:
    (ones (R, 1), row (1, end)) added to S's R rows after any capping (batch_decode.FixedDecoder's)."""
    if cap:
        ops.scale(S, scale, S)
        ops.softcap(S, cap, S)
    if mask is not None:
        ops.gemm(mask[0], mask[1], S.reshape(mask[0].shape[0], S.shape[-1]), beta=1.0)
    ops.softmax_causal_forward(S, S, 1.0 if cap else scale, window=window, sinks=sinks)


def sample(logits, temperature, top_p, rng, top_k=0):
    """A token id from logits (V,): argmax at temperature 0, else from softmax(logits / temperature)
    restricted to the top_k largest logits (0: all; ties at the k-th kept, as transformers' top-k),
    then to the smallest set of tokens whose probability reaches top_p."""
    return int(sample_rows(np.asarray(logits)[None], temperature, top_p, [rng], top_k)[0])


def sample_rows(logits, temperature, top_p, rngs, top_k=0):
    """sample() of each row of logits (n, V), row r drawing from rngs[r] (one uniform number per
    row and call, so that a row's draws do not depend on the other rows)."""
    z = np.array(logits, np.float64)                                      # a copy: changed in place
    if temperature == 0:
        return np.argmax(z, axis=1)
    z -= z.max(axis=1, keepdims=True)
    if temperature != 1:  # x / 1 is x: the pass is skipped, the bits are the same
        z /= temperature
    if 0 < top_k < z.shape[1]:
        z = np.where(z >= np.partition(z, -top_k, axis=1)[:, -top_k, None], z, -np.inf)
    p = np.exp(z, out=z)
    out = np.empty(len(p), np.int64)
    for r, (pr, rng) in enumerate(zip(p, rngs)):
        keep = nucleus(pr / pr.sum(), top_p) if top_p < 1 else None
        cdf = np.cumsum(pr if keep is None else pr[keep])
        i = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)
        out[r] = i if keep is None else keep[i]
    return out


def nucleus(p, top_p):
    """The ids of the smallest set of tokens whose probabilities p (V,) (summing to 1) reach top_p,
    most probable first; None where top_p >= 1 (every token). Sorts the few largest first and all
    of p only when they fall short."""
    if top_p >= 1:
        return None
    m = min(len(p), 64)
    while True:
        top = np.argpartition(-p, m - 1)[:m] if m < len(p) else np.arange(len(p))
        order = top[np.argsort(-p[top], kind="stable")]
        c = np.cumsum(p[order])
        if c[-1] >= top_p or m == len(p):
            return order[:min(int(np.searchsorted(c, top_p)) + 1, len(order))]
        m = min(len(p), 8 * m)


def run_tokens(model, ids, positions, attend, last_only=True):
    """Logits (1 or n, V) f32 of tokens ids (n,) at positions (n,) through every layer (no dropout),
    attend(i) layer i's attention (layer_forward's attend): the last token's, or every token's."""
    d = model.dev
    positions = np.asarray(positions, np.int32)
    with d.step():
        ids_t = d.tensor(np.asarray(ids, np.int32), "i32")
        batch = Batch(1, len(ids), [d.tensor(positions, "i32")], inv_freq=model.call_inv_freq(int(positions.max())))
        logits = tokens_forward(model, ids_t, batch, attend, last_only)
    return np.asarray(logits.numpy(), np.float32)


def tokens_forward(model, ids_t, batch, attend, last_only=True, logits=None):
    """run_tokens' work on the device: ids_t (n,) i32 through every layer, then the head's logits
    (1 or n, V) of the last token or every one, into `logits` where given; returns them."""
    d, dt, c = model.dev, model.dtype, model.config
    n, C = ids_t.shape[0], c.hidden_size
    x = d.empty((n, C), dt)                                               # (n, C)
    embed(ids_t, model.embed, x)
    if model.embed_scale is not None:
        ops.scale(x, model.embed_scale, x)
    for i, L in enumerate(model.layers):
        x, _ = layer_forward(L, x, batch, attend(i))
    h = x[n - 1:n] if last_only else x                                    # (m, C)
    m = h.shape[0]
    xn, r = d.empty((m, C), dt), d.empty((m,), "f32")
    ops.rmsnorm_forward(h, model.norm_w, xn, r, c.rms_norm_eps)
    if logits is None:
        logits = d.empty((m, c.vocab_size), "f32" if dt == "f32" else dt)  # (m, V)
    linear(xn, model.head, logits)
    if model.final_softcap:
        ops.softcap(logits, model.final_softcap, logits)
    return logits


def decode(model, ids, start, cache):
    """Runs tokens `ids` at positions start.. through the model (no dropout), appending their keys
    and values to cache; returns the logits (V,) f32 of the last one."""
    return run_tokens(model, ids, np.arange(start, start + len(ids)), lambda i: cache.attention(i, start))[0]


def generate(model, prompt, max_new_tokens=32, temperature=0.0, top_p=1.0, seed=0, eos_id=None, top_k=0):
    """Up to max_new_tokens ids sampled after `prompt` (a non-empty list of valid ids), stopping
    after eos_id or at max_position_embeddings."""
    prompt = check_prompt(model, prompt)
    total = cache_length(model, prompt, max_new_tokens, temperature, top_p)
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


def check_prompt(model, prompt):
    """prompt as a list of ints, refused where empty or holding an id outside the vocabulary."""
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("[generate] the prompt is empty")
    check_ids(np.asarray(prompt), "prompt", False, model.config.vocab_size)
    return prompt


def cache_length(model, prompt, max_new_tokens, temperature, top_p):
    """The positions a generation after `prompt` caches (the sampling settings checked)."""
    if not (temperature >= 0) or not (0 < top_p <= 1):
        raise ValueError(f"[generate] temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}")
    mp = model.config.max_position_embeddings
    total = min(len(prompt) + max_new_tokens, mp)
    if len(prompt) >= total:
        raise ValueError(f"[generate] the prompt fills max_position_embeddings {mp}")
    return total
