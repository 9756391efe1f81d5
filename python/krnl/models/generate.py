"""Sampling with a KV cache: the prompt runs once through every layer, then each new token runs the
same decoder layer (layer.layer_forward) with an attention that appends its keys and values to the
cache and attends to every cached position. generate_batch decodes many sequences at once: one
token of every sequence per layer call (the projections and MLPs batched), the sequences of one
prompt (GRPO's completions) sharing its prefill and attending through batched GEMMs."""

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


def softmax_scores(S, scale, cap, window, sinks):
    """S (..., n, end) scores of queries at positions end - n.. in place to probabilities."""
    if cap:
        ops.scale(S, scale, S)
        ops.softcap(S, cap, S)
    ops.softmax_causal_forward(S, S, 1.0 if cap else scale, window=window, sinks=sinks)


def sample(logits, temperature, top_p, rng, top_k=0):
    """A token id from logits (V,): argmax at temperature 0, else from softmax(logits / temperature)
    restricted to the top_k largest logits (0: all; ties at the k-th kept, as transformers' top-k),
    then to the smallest set of tokens whose probability reaches top_p."""
    return int(sample_rows(np.asarray(logits)[None], temperature, top_p, [rng], top_k)[0])


def sample_rows(logits, temperature, top_p, rngs, top_k=0):
    """sample() of each row of logits (n, V), row r drawing from rngs[r] (one uniform number per
    row and call, so that a row's draws do not depend on the other rows)."""
    z = np.asarray(logits, np.float64)
    if temperature == 0:
        return np.argmax(z, axis=1)
    z = (z - z.max(axis=1, keepdims=True)) / temperature
    if 0 < top_k < z.shape[1]:
        z = np.where(z >= np.partition(z, -top_k, axis=1)[:, -top_k, None], z, -np.inf)
    p = np.exp(z)
    out = np.empty(len(p), np.int64)
    for r, (pr, rng) in enumerate(zip(p, rngs)):
        keep = nucleus(pr / pr.sum(), top_p)
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
    d, dt, c = model.dev, model.dtype, model.config
    n, C = len(ids), c.hidden_size
    positions = np.asarray(positions, np.int32)
    with d.step():
        ids_t = d.tensor(np.asarray(ids, np.int32), "i32")
        batch = Batch(1, n, [d.tensor(positions, "i32")], inv_freq=model.call_inv_freq(int(positions.max())))
        x = d.empty((n, C), dt)                                           # (n, C)
        embed(ids_t, model.embed, x)
        if model.embed_scale is not None:
            ops.scale(x, model.embed_scale, x)
        for i, L in enumerate(model.layers):
            x, _ = layer_forward(L, x, batch, attend(i))
        h = x[n - 1:n] if last_only else x                                # (m, C)
        m = h.shape[0]
        xn, r = d.empty((m, C), dt), d.empty((m,), "f32")
        ops.rmsnorm_forward(h, model.norm_w, xn, r, c.rms_norm_eps)
        logits = d.empty((m, c.vocab_size), "f32" if dt == "f32" else dt)  # (m, V)
        linear(xn, model.head, logits)
        if model.final_softcap:
            ops.softcap(logits, model.final_softcap, logits)
    return np.asarray(logits.numpy(), np.float32)


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


class GroupCache:
    """The keys and values of the G sequences of one prompt, per layer (G Hk, total, D) with row
    b Hk + j sequence b's KV head j: the prompt's, run once (a KVCache) and copied to every
    sequence, then one position of every sequence per decoding step. pos: the next position."""

    def __init__(self, model, prompt_cache, P, G, total):
        d, dt, hd = model.dev, model.dtype, model.heads
        self.G, self.pos, self.total, self.heads = G, P, total, hd
        self.window = int(model.config.sliding_window or 0)
        self.layers = model.layers
        self.k = [d.empty((G * hd.Hk, total, hd.D), dt) for _ in model.layers]
        self.v = [d.empty((G * hd.Hk, total, hd.D), dt) for _ in model.layers]
        self.one = d.tensor(np.ones((1, 1), np.float32), dt)
        ones = d.tensor(np.ones((G, 1), np.float32), dt)
        # sinks (H,) of each sequence's heads in a row: the (G Hk g) rows of the scores
        self.sinks = [None if L.sinks is None else d.tensor(np.tile(L.sinks.numpy(), G), "f32") for L in model.layers]
        with d.step():  # C (G, P D) = ones (G, 1) x (1, P D): the prompt's rows of head j, once per sequence
            for dst, src in ((self.k, prompt_cache.k), (self.v, prompt_cache.v)):
                for i, heads in enumerate(src):
                    rows = dst[i].reshape(G, hd.Hk * total * hd.D)
                    for j, h in enumerate(heads):
                        ops.gemm(ones, h[:P].reshape(1, P * hd.D), rows[:, j * total * hd.D:j * total * hd.D + P * hd.D])

    def attend(self, i, q, k, v, out):
        """Layer i's attention of the G sequences' tokens at self.pos: q, out (G, H, D) and k, v
        (G, Hk, D) token-major. Appends k and v (as one (1, 1) x (1, D) product per row: no copy
        op takes a strided destination), then batched products over the G Hk (sequence, KV head)
        pairs, each pair's g query heads one (g, D) block."""
        hd, L, G, p = self.heads, self.layers[i], self.G, self.pos
        n, g, D, end = G * hd.Hk, hd.g, hd.D, p + 1
        K, V = self.k[i], self.v[i]
        for new, cache in ((k, K), (v, V)):
            ops.gemm(self.one, new.reshape(n, 1, D), cache[:, p:p + 1], batch=n, stride_a=0)
        scale, cap, window = scoring(L, hd, self.window)
        S = q.device.empty((n, g, end), q.dtype)                          # (G Hk, g, end)
        ops.gemm(q.reshape(n, g, D), K[:, :end], S, trans_b=True, batch=n)
        softmax_scores(S.reshape(n * g, 1, end), scale, cap, window, self.sinks[i])
        ops.gemm(S, V[:, :end], out.reshape(n, g, D), batch=n)


def decode_groups(model, groups, ids):
    """Logits (n, V) f32 of one token per sequence of the groups (GroupCaches, ids (n,) their
    sequences' in order) at each group's position, appended to the caches; positions advance."""
    hd, starts = model.heads, np.cumsum([0] + [gc.G for gc in groups])
    n, H, Hk, D = len(ids), hd.H, hd.Hk, hd.D

    def attend(i):
        def layer(b, q, k, v, out):  # q, out (H, n, D); k, v (Hk, n, D)
            d, dt = q.device, q.dtype
            qt, kt, vt, ot = d.empty((n, H, D), dt), d.empty((n, Hk, D), dt), d.empty((n, Hk, D), dt), d.empty((n, H, D), dt)
            for x, xt in ((q, qt), (k, kt), (v, vt)):
                ops.transpose_heads(x, xt)
            for gc, r0, r1 in zip(groups, starts, starts[1:]):
                gc.attend(i, qt[r0:r1], kt[r0:r1], vt[r0:r1], ot[r0:r1])
            ops.transpose_heads(ot, out)

        return layer

    logits = run_tokens(model, ids, np.repeat([gc.pos for gc in groups], [gc.G for gc in groups]), attend, False)
    for gc in groups:
        gc.pos += 1
    return logits


def generate_batch(model, prompts, max_new_tokens=32, temperature=0.0, top_p=1.0, seeds=None, eos_id=None, top_k=0):
    """generate() of every prompt (lists of valid ids), row r with seed seeds[r] (default r): the
    same tokens as one generate() call per row (up to the float sums' order in the logits), decoded
    together. Rows with equal prompts share its prefill; a prompt's rows stop together once each has
    met eos_id or the length limit (their extra tokens dropped)."""
    prompts = [check_prompt(model, p) for p in prompts]
    seeds = list(range(len(prompts))) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != len(prompts):
        raise ValueError(f"[generate] {len(seeds)} seeds for {len(prompts)} prompts")
    switch = model.config.rope_switch_position
    if switch is not None and any(len(p) + max_new_tokens > switch for p in prompts):
        # LongRoPE re-runs a sequence that crosses its switch (generate()): one at a time
        return [generate(model, p, max_new_tokens, temperature, top_p, s, eos_id, top_k) for p, s in zip(prompts, seeds)]
    rows = {}
    for r, p in enumerate(prompts):
        rows.setdefault(tuple(p), []).append(r)
    rngs = [np.random.default_rng(s) for s in seeds]
    out, live = [[] for _ in prompts], []
    for p, rs in rows.items():
        total = cache_length(model, p, max_new_tokens, temperature, top_p)
        pc = KVCache(model.dev, model.dtype, model.layers, model.heads, len(p), model.config.sliding_window)
        logits = decode(model, list(p), 0, pc)
        live.append((GroupCache(model, pc, len(p), len(rs), total), rs))
        for r, t in zip(rs, sample_rows(np.repeat(logits[None], len(rs), 0), temperature, top_p,
                                        [rngs[r] for r in rs], top_k)):
            out[r].append(int(t))

    def done(r, gc):  # generate()'s stop: after eos_id, max_new_tokens, or once the cache is full
        return out[r][-1] == eos_id or len(out[r]) == max_new_tokens or gc.pos >= gc.total

    while live := [(gc, rs) for gc, rs in live if not all(done(r, gc) for r in rs)]:
        fed = [(r, gc) for gc, rs in live for r in rs]
        todo = [(i, r) for i, (r, gc) in enumerate(fed) if not done(r, gc)]  # the rest feed on, unsampled
        logits = decode_groups(model, [gc for gc, _ in live], [out[r][-1] for r, _ in fed])
        nxt = sample_rows(logits[[i for i, _ in todo]], temperature, top_p, [rngs[r] for _, r in todo], top_k)
        for (_, r), t in zip(todo, nxt):
            out[r].append(int(t))
    return out
