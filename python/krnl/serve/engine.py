"""The serving engine: one thread owns the model and decodes every running request together, one
token of each sequence per step (models.batch_decode: GroupCache, decode_groups). A request joins
between steps after its own prefill and leaves once each of its choices is done or its client
is gone; a request of n choices is one group of n sequences sharing its prefill. A step runs the
requests of one adapter (its LoRA weights copied into the model's: adapters.py); adapters with
running requests take turns. Everything a request learns comes back through its `emit`, called
on the engine's thread."""

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..models.batch_decode import GroupCache, decode_groups
from ..models.generate import KVCache, cache_length, check_prompt, decode, sample_rows
from .text import ChoiceText


class QueueFull(Exception):
    """The engine's queue holds max_queue requests already (HTTP 429)."""


@dataclass
class Sampling:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: Optional[int] = None
    stop: tuple = ()         # stop strings: the text ends before the first one
    logprobs: int = -1       # -1: none; k >= 0: the sampled token's log-probability and the k most likely


@dataclass
class Token:
    """One sampled token of a choice: its id, the text it made sendable, and its log-probability
    with the top alternatives [(id, logprob)] where asked."""
    id: int
    text: str
    logprob: Optional[float] = None
    top: Optional[list] = None


class Request:
    """A prompt's generation. emit(kind, *payload) is called on the engine's thread: ("token",
    choice, Token), ("finish", choice, reason, remaining text) with reason "stop" or "length", then
    ("done",) once every choice has finished, or ("error", message) if the engine failed it."""

    def __init__(self, ids, sampling: Sampling, emit: Callable, adapter=None, tok=None, eos_ids=()):
        self.ids, self.s, self.emit, self.adapter = list(ids), sampling, emit, adapter
        self.eos_ids, self.cancelled = set(eos_ids), False
        n = sampling.n
        self.tokens = [[] for _ in range(n)]
        self.reasons = [None] * n
        self.texts = [ChoiceText(tok, sampling.stop) for _ in range(n)]
        seed = sampling.seed
        # choice i of a seeded request: the generator `krnl generate --seed` uses for n = 1
        self.rngs = [np.random.default_rng(seed if n == 1 or seed is None else [seed, i]) for i in range(n)]
        self.cache = None

    @property
    def done(self):
        return all(r is not None for r in self.reasons)

    def last(self, i):
        return self.tokens[i][-1]

    def take(self, logits):
        """Samples the next token of each unfinished choice from its row of logits (n, V)."""
        s = self.s
        live = [i for i, r in enumerate(self.reasons) if r is None]
        ids = sample_rows(logits[live], s.temperature, s.top_p, [self.rngs[i] for i in live], s.top_k)
        if s.logprobs >= 0:
            z = np.asarray(logits[live], np.float64)
            z = z - z.max(axis=1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        for j, (i, t) in enumerate(zip(live, ids)):
            t = int(t)
            self.tokens[i].append(t)
            if t in self.eos_ids:
                self._finish(i, "stop")
                continue
            text, stopped = self.texts[i].add(t)
            tok = Token(t, text)
            if s.logprobs >= 0:
                top = np.argsort(-logp[j], kind="stable")[:s.logprobs]
                tok.logprob, tok.top = float(logp[j, t]), [(int(k), float(logp[j, k])) for k in top]
            self.emit("token", i, tok)
            if stopped:
                self._finish(i, "stop")
            elif len(self.tokens[i]) >= s.max_tokens or self.cache.pos >= self.cache.total:
                self._finish(i, "length")
        if self.done:
            self.emit("done")

    def _finish(self, i, reason):
        self.reasons[i] = reason
        self.emit("finish", i, reason, self.texts[i].flush())


class Engine:
    """Runs requests on `model` (its tokenizer's ids) until stop(). adapters: an adapters.Adapters
    (None: the model as loaded); max_batch: the sequences decoded together; max_queue: the requests
    waiting to join, beyond which submit() raises QueueFull."""

    def __init__(self, model, adapters=None, max_batch=16, max_queue=64):
        self.model, self.adapters = model, adapters
        self.max_batch, self.max_queue = int(max_batch), int(max_queue)
        self.pending = queue.Queue()
        self.running = []
        self._stop = threading.Event()
        self._thread = None
        self._turn = 0

    def start(self):
        self._thread = threading.Thread(target=self._loop, name="krnl-serve-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self.pending.put(None)
        if self._thread is not None:
            self._thread.join()

    def check(self, ids, sampling):
        """Raises ValueError (the request's fault) for a prompt or settings the model cannot take."""
        ids = check_prompt(self.model, ids)
        if sampling.n > self.max_batch:
            raise ValueError(f"n = {sampling.n} exceeds the server's --max-batch {self.max_batch}")
        cache_length(self.model, ids, sampling.max_tokens, sampling.temperature, sampling.top_p)

    def submit(self, request):
        if self.pending.qsize() >= self.max_queue:
            raise QueueFull(f"{self.max_queue} requests are waiting already; try again later")
        self.pending.put(request)

    def _loop(self):
        while not self._stop.is_set():
            self._admit()
            self.running = [r for r in self.running if not (r.done or r.cancelled)]
            if not self.running:
                r = self.pending.get()  # idle: sleep until a request (or stop's None) arrives
                if r is not None:
                    self._join(r)
                continue
            names = sorted({r.adapter or "" for r in self.running})
            self._turn = (self._turn + 1) % len(names)
            name = names[self._turn]
            group = [r for r in self.running if (r.adapter or "") == name]
            self._guard(group, lambda: self._step(group))

    def _admit(self):
        """Joins waiting requests while the batch has room for their choices."""
        rows = sum(r.s.n for r in self.running)
        while True:
            try:
                r = self.pending.get_nowait()
            except queue.Empty:
                return
            if r is None:
                return
            if rows + r.s.n > self.max_batch and self.running:
                self._requeue_front(r)
                return
            self._join(r)
            rows += r.s.n

    def _requeue_front(self, r):
        with self.pending.mutex:
            self.pending.queue.appendleft(r)

    def _join(self, r):
        if not r.cancelled and self._guard([r], lambda: self._prefill(r)) and not r.done:
            self.running.append(r)

    def _guard(self, requests, fn):
        """fn(), failing the requests (not the server) if it raises."""
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001: any failure ends these requests with its message
            for r in requests:
                r.reasons = ["error"] * r.s.n
                r.emit("error", f"{type(e).__name__}: {e}")
            return False

    def _use(self, name):
        if self.adapters is not None:
            self.adapters.use(name)

    def _prefill(self, r):
        m, s = self.model, r.s
        self._use(r.adapter)
        total = cache_length(m, r.ids, s.max_tokens, s.temperature, s.top_p)
        pc = KVCache(m.dev, m.dtype, m.layers, m.heads, len(r.ids), m.config.sliding_window)
        logits = decode(m, r.ids, 0, pc)
        r.cache = GroupCache(m, pc, len(r.ids), s.n, total)
        r.take(np.repeat(logits[None], s.n, 0))

    def _step(self, group):
        self._use(group[0].adapter)
        fed = [(r, i) for r in group for i in range(r.s.n)]
        logits = decode_groups(self.model, [r.cache for r in group], [r.last(i) for r, i in fed])
        row = 0
        for r in group:
            r.take(logits[row:row + r.s.n])
            row += r.s.n
