"""Many sequences decoded together: one token of every sequence per layer call (the projections and
MLPs batched), the sequences of one prompt (GRPO's completions, a request's n choices) sharing its
prefill and attending through batched GEMMs.

Two ways to run a decoding step over the same caches:
- decode_groups: eager, each group's scores exactly as long as its sequences so far, the finished
  groups left out. Every op is a host call, so a small model's step is bound by the host.
- FixedDecoder: every step the same shapes over whole caches (zeroed beyond what is written), so
  that it can be recorded once as a graph and replayed (Device.capture, where the device lists
  graphs). What moves from step to step lives in device tensors uploaded before each replay:
  the ids, the rotary positions, a one-hot column that appends the new keys and values as a
  rank-1 update (the row is zero until then, so 0 + x is x), and a mask row of 0 and -inf added to
  the scores before the softmax (the positions not yet written, and the sliding window's)."""

import numpy as np

from .. import _core
from .attention import Batch
from .generate import (KVCache, cache_length, check_prompt, decode, generate, run_tokens, sample_rows, scoring,
                       softmax_scores, tokens_forward)

ops = _core.ops


class GroupCache:
    """The keys and values of the G sequences of one prompt, per layer (G Hk, total, D) with row
    b Hk + j sequence b's KV head j: the prompt's, run once (a KVCache) and copied to every
    sequence, then one position of every sequence per decoding step. pos: the next position.
    zero: the rows after the prompt's zeroed (FixedDecoder's appends add to them)."""

    def __init__(self, model, prompt_cache, P, G, total, zero=False):
        d, dt, hd = model.dev, model.dtype, model.heads
        self.G, self.pos, self.total, self.heads = G, P, total, hd
        self.window = int(model.config.sliding_window or 0)
        self.layers = model.layers
        new = d.zeros if zero else d.empty
        self.k = [new((G * hd.Hk, total, hd.D), dt) for _ in model.layers]
        self.v = [new((G * hd.Hk, total, hd.D), dt) for _ in model.layers]
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


def token_major_attention(model, n, attend_group):
    """layer_forward's attend(i) for n decoded tokens (one per sequence, groups in order): the
    heads made token-major, attend_group(i, qt, kt, vt, ot) over them, the output back."""
    hd = model.heads
    H, Hk, D = hd.H, hd.Hk, hd.D

    def attend(i):
        def layer(b, q, k, v, out):  # q, out (H, n, D); k, v (Hk, n, D)
            d, dt = q.device, q.dtype
            qt, kt, vt, ot = d.empty((n, H, D), dt), d.empty((n, Hk, D), dt), d.empty((n, Hk, D), dt), d.empty((n, H, D), dt)
            for x, xt in ((q, qt), (k, kt), (v, vt)):
                ops.transpose_heads(x, xt)
            attend_group(i, qt, kt, vt, ot)
            ops.transpose_heads(ot, out)

        return layer

    return attend


def decode_groups(model, groups, ids):
    """Logits (n, V) f32 of one token per sequence of the groups (GroupCaches, ids (n,) their
    sequences' in order) at each group's position, appended to the caches; positions advance."""
    starts = np.cumsum([0] + [gc.G for gc in groups])

    def each(i, qt, kt, vt, ot):
        for gc, r0, r1 in zip(groups, starts, starts[1:]):
            gc.attend(i, qt[r0:r1], kt[r0:r1], vt[r0:r1], ot[r0:r1])

    attend = token_major_attention(model, len(ids), each)
    logits = run_tokens(model, ids, np.repeat([gc.pos for gc in groups], [gc.G for gc in groups]), attend, False)
    for gc in groups:
        gc.pos += 1
    return logits


class FixedDecoder:
    """decode_groups' step at fixed shapes over the groups' whole caches (GroupCaches made with
    zero=True), recorded as a graph on its first step where record (the device must list graphs)
    and replayed after, else run eagerly. Every group's rows run each step; a group that is not
    live neither appends nor advances (its rows' logits are not read)."""

    def __init__(self, model, groups, record):
        d, dt, hd, c = model.dev, model.dtype, model.heads, model.config
        self.model, self.groups, self.record, self.graph = model, groups, record, None
        self.n = n = sum(gc.G for gc in groups)
        self.windows = sorted({scoring(L, hd, gc.window)[2] for gc in groups for L in model.layers})
        # The step's inputs: ids and positions (2 n,) i32; per group a one-hot column (total,) and a
        # mask row (total,) per window, in the compute dtype. One upload each a step.
        self.index = d.zeros((2 * n,), "i32")
        sizes = [gc.total * (1 + len(self.windows)) for gc in groups]
        self.flags = d.zeros((sum(sizes),), dt)
        self.host = np.zeros(sum(sizes), np.float32)
        self.onehot, self.masks, at = [], [], 0
        for gc, size in zip(groups, sizes):
            T = gc.total
            self.onehot.append(self.flags[at:at + T].reshape(T, 1))
            self.masks.append({w: self.flags[at + T * (1 + j):at + T * (2 + j)].reshape(1, T)
                               for j, w in enumerate(self.windows)})
            at += size
        self.ones = d.tensor(np.ones((max(gc.G for gc in groups) * hd.H, 1), np.float32), dt)
        self.batch = Batch(1, n, [self.index[n:]])
        self.logits = d.empty((n, c.vocab_size), "f32" if dt == "f32" else dt)  # (n, V)

    def step(self, ids, live):
        """Logits (n, V) f32 of ids (n,), a token per sequence of every group in order; live[g]:
        whether group g appends its token and advances."""
        at, host = 0, self.host
        positions = np.repeat([gc.pos for gc in self.groups], [gc.G for gc in self.groups])
        host[:] = 0.0
        for gc, on in zip(self.groups, live):
            T, p = gc.total, min(gc.pos, gc.total - 1)
            if on:
                host[at + p] = 1.0
            keys = np.arange(T)
            for j, w in enumerate(self.windows):  # softmax_causal_forward's mask for a query at p
                seen = (keys <= p) & ((p - keys < w) if w > 0 else True)
                host[at + T * (1 + j):at + T * (2 + j)] = np.where(seen, 0.0, -np.inf)
            at += T * (1 + len(self.windows))
        d = self.model.dev
        d.upload(self.index, np.concatenate([np.asarray(ids, np.int32), positions.astype(np.int32)]))
        d.upload(self.flags, host)
        if not self.record:
            with d.step():
                self._run()
        elif self.graph is None:
            self.graph = d.capture(self._run)  # its warm-up is this step's run
        else:
            self.graph.replay()
        for gc, on in zip(self.groups, live):
            gc.pos += bool(on)
        return np.asarray(self.logits.numpy(), np.float32)

    def release(self):
        if self.graph is not None:
            self.graph.release()
            self.graph = None

    def _run(self):
        """One step into self.logits: nothing read on the host, the same work every call."""
        # attend is built per call: kept on self, its bound method would make a reference cycle,
        # which holds the caches until the garbage collector runs
        attend = token_major_attention(self.model, self.n, self._attend_groups)
        tokens_forward(self.model, self.index[:self.n], self.batch, attend, last_only=False, logits=self.logits)

    def _attend_groups(self, i, qt, kt, vt, ot):
        r0 = 0
        for gc, onehot, masks in zip(self.groups, self.onehot, self.masks):
            r1 = r0 + gc.G
            self._attend(gc, i, onehot, masks, qt[r0:r1], kt[r0:r1], vt[r0:r1], ot[r0:r1])
            r0 = r1

    def _attend(self, gc, i, onehot, masks, q, k, v, out):
        """GroupCache.attend over the whole cache: the append as cache += onehot k^T, the unseen
        scores -inf."""
        hd, L, G, T = gc.heads, gc.layers[i], gc.G, gc.total
        n, g, D = G * hd.Hk, hd.g, hd.D
        K, V = gc.k[i], gc.v[i]
        for new, cache in ((k, K), (v, V)):                                # (n, T, D) += (T, 1) x (n, 1, D)
            ops.gemm(onehot, new.reshape(n, 1, D), cache, batch=n, stride_a=0, beta=1.0)
        scale, cap, window = scoring(L, hd, gc.window)
        S = q.device.empty((n, g, T), q.dtype)                            # (G Hk, g, T)
        ops.gemm(q.reshape(n, g, D), K, S, trans_b=True, batch=n)
        # the window is in the mask: the softmax's own would count from the last column
        softmax_scores(S.reshape(n * g, 1, T), scale, cap, 0, gc.sinks[i], (self.ones[:n * g], masks[window]))
        ops.gemm(S, V, out.reshape(n, g, D), batch=n)


def generate_batch(model, prompts, max_new_tokens=32, temperature=0.0, top_p=1.0, seeds=None, eos_id=None, top_k=0,
                   fixed=None):
    """generate() of every prompt (lists of valid ids), row r with seed seeds[r] (default r): the
    same tokens as one generate() call per row (up to the float sums' order in the logits), decoded
    together. Rows with equal prompts share its prefill; a prompt's rows stop together once each has
    met eos_id or the length limit (their extra tokens dropped). fixed: decode with FixedDecoder
    (recorded where the device lists graphs) rather than decode_groups; default: where it records."""
    prompts = [check_prompt(model, p) for p in prompts]
    seeds = list(range(len(prompts))) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != len(prompts):
        raise ValueError(f"[generate] {len(seeds)} seeds for {len(prompts)} prompts")
    switch = model.config.rope_switch_position
    if switch is not None and any(len(p) + max_new_tokens > switch for p in prompts):
        # LongRoPE re-runs a sequence that crosses its switch (generate()): one at a time
        return [generate(model, p, max_new_tokens, temperature, top_p, s, eos_id, top_k) for p, s in zip(prompts, seeds)]
    graphs = bool(model.dev.capabilities()["graphs"])
    fixed = graphs if fixed is None else bool(fixed)
    rows = {}
    for r, p in enumerate(prompts):
        rows.setdefault(tuple(p), []).append(r)
    rngs = [np.random.default_rng(s) for s in seeds]
    out, groups = [[] for _ in prompts], []
    for p, rs in rows.items():
        total = cache_length(model, p, max_new_tokens, temperature, top_p)
        pc = KVCache(model.dev, model.dtype, model.layers, model.heads, len(p), model.config.sliding_window)
        logits = decode(model, list(p), 0, pc)
        groups.append((GroupCache(model, pc, len(p), len(rs), total, zero=fixed), rs))
        for r, t in zip(rs, sample_rows(np.repeat(logits[None], len(rs), 0), temperature, top_p,
                                        [rngs[r] for r in rs], top_k)):
            out[r].append(int(t))

    def done(r, gc):  # generate()'s stop: after eos_id, max_new_tokens, or once the cache is full
        return out[r][-1] == eos_id or len(out[r]) == max_new_tokens or gc.pos >= gc.total

    def live(gc, rs):
        return not all(done(r, gc) for r in rs)

    decoder = FixedDecoder(model, [gc for gc, _ in groups], graphs) if fixed else None
    try:
        while any(live(gc, rs) for gc, rs in groups):
            fed = [(r, gc) for gc, rs in groups for r in rs if decoder or live(gc, rs)]
            todo = [(i, r) for i, (r, gc) in enumerate(fed) if not done(r, gc)]  # the rest feed on, unsampled
            last = [out[r][-1] for r, _ in fed]
            if decoder is None:
                logits = decode_groups(model, [gc for gc, rs in groups if live(gc, rs)], last)
            else:
                logits = decoder.step(last, [live(gc, rs) for gc, rs in groups])
            nxt = sample_rows(logits[[i for i, _ in todo]], temperature, top_p, [rngs[r] for _, r in todo], top_k)
            for (_, r), t in zip(todo, nxt):
                out[r].append(int(t))
    finally:
        if decoder is not None:
            decoder.release()
    return out
