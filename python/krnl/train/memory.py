"""The memory a training run needs, known before it runs (`krnl train --dry-run`, `krnl plan`,
`--max-memory`, `--fit`; README 'Memory').

What is estimated: the peak of the device pool's `reserved` bytes (Device.pool_stats()
"peak_reserved", the trainer's peak_mem_mib), that is every buffer the model, its LoRA, the
optimizer and a training step allocate through the device, the fused attention backward's
workspace included (its bytes from the device's capabilities). Host memory (numpy copies, the
tokenizer, the data) and memory a backend holds outside its pool (the CUDA context, cuBLAS's
workspace, the CPU's per-thread scratch) are not in it.

How: memory_step.Replay makes the same requests, in the same order, as LlamaModel, FlatParams,
the optimizer and StepRunner make, from the shapes alone; Trace replays them through the pool's rules
(csrc/core/buffer_pool.cpp): each request rounded up to its size class, a released buffer cached
for its class (at once where the device is queue-ordered, at the step's end elsewhere) and
reused only by a request of that class, `reserved` growing only when no cached buffer fits. The
peak is then, per part, the bytes live at the moment the pool holds the most in use, and the
pool's slack: class rounding plus buffers cached in classes the peak moment does not use (the
logits chunk during the backward, say), which a pool limit would give back before refusing.
Where steps replay as graphs (Run.replay), the first micro-batch and the optimizer run once more
as their recordings, through the graph arena's rules (backend.cpp, Backend::empty): a request takes
a released arena buffer of its class; while no graph lives, the pool's cached one of its class
next; else the smallest released arena buffer that holds it; else a new one from the pool. What
the recording releases stays the arena's, in use to the pool, for as long as the graphs live.
One padded length is planned, the longest: each other length a run meets records a graph of its
own, whose buffers the arena adds where the released ones are too small (a longer length after
shorter ones), and first runs eagerly beside the recorded ones."""

import bisect
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Optional

from ..models.config import LoraConfig, ModelConfig
from .memory_step import Replay

# People's names of the parts, in the order the table prints them.
PARTS = {
    "weights": "frozen weights",
    "lora": "trained weights (f32 masters, compute copy)",
    "grads": "their gradients (f32)",
    "optimizer": "optimizer state",
    "checkpoints": "checkpoints (each layer's input)",
    "activations": "saved activations",
    "attention": "attention (scores or log-sum-exp)",
    "loss": "loss (final norm, logits chunk)",
    "working": "backward working set",
    "small": "inputs and small buffers",
    "generation": "GRPO's generation (KV caches)",
    "slack": "pool slack (size classes, cached)",
}


def class_size(nbytes):
    """BufferPool::class_size: multiples of 256 below 4 KiB, then 2^k, 1.25, 1.5, 1.75 x 2^k."""
    nbytes = max(int(nbytes), 1)
    if nbytes <= 4096:
        return exact_size(nbytes)
    p = 4096
    while p * 2 < nbytes:
        p *= 2
    return next((p + p // 4 * q for q in range(1, 5) if p + p // 4 * q >= nbytes), 2 * p)


def exact_size(nbytes):
    """BufferPool::exact_size: what an exact request (Device.set_exact_sizes) reserves."""
    return max(1, -(-int(nbytes) // 256)) * 256


class Trace:
    """A device pool's counts over a replayed list of requests (no memory is allocated); while
    `exact` (a model's build: models/exact_sizes.py), buffers of their own size, never cached."""

    def __init__(self, queue_ordered=True):
        self.queue_ordered = queue_ordered
        self.live = {}                 # id -> (class size, bytes, part)
        self.cached = Counter()        # class size -> free buffers
        self.pending = []              # class sizes released inside an open step (not queue-ordered)
        self.by_part = defaultdict(int)
        self.in_use = self.reserved = self.peak_in_use = self.peak_reserved = 0
        self.at_peak, self.in_step, self._next = {}, False, 0
        self.recording, self.graphs = False, 0  # requests go through the graph arena; graphs recorded
        self.arena, self.arena_ids = [], set()  # its released buffers' classes (sorted); ids it owns
        self.exact, self.exact_ids = False, set()

    def alloc(self, shape, itemsize, part):
        n = math.prod(shape) * itemsize
        cls = class_size(n)
        if self.recording:
            self.arena_ids.add(self._next + 1)
            j = bisect.bisect_left(self.arena, cls)
            same = j < len(self.arena) and self.arena[j] == cls
            if same or (j < len(self.arena) and not (self.graphs == 0 and self.cached[cls])):  # in use all along
                self._next += 1
                self.live[self._next] = (self.arena.pop(j), n, part)
                self.by_part[part] += n
                return self._next
        if self.exact:
            cls = exact_size(n)
            self.exact_ids.add(self._next + 1)
        if self.cached[cls] and not self.exact:
            self.cached[cls] -= 1
        else:
            self.reserved += cls
        self.in_use += cls
        self._next += 1
        self.live[self._next] = (cls, n, part)
        self.by_part[part] += n
        if self.in_use > self.peak_in_use:
            self.peak_in_use, self.at_peak = self.in_use, dict(self.by_part)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return self._next

    def free(self, *ids):
        for i in ids:
            if i is None:
                continue
            cls, n, part = self.live.pop(i)
            self.by_part[part] -= n
            if i in self.arena_ids:  # the graphs live to the end of the run
                bisect.insort(self.arena, cls)
                continue
            self.in_use -= cls
            if i in self.exact_ids:  # back to the system (outside the step it is made in)
                self.exact_ids.discard(i)
                self.reserved -= cls
            elif self.in_step and not self.queue_ordered:
                self.pending.append(cls)
            else:
                self.cached[cls] += 1

    def record(self, fn):
        """fn's requests as a recording (Device.capture's, after its warm-up); then one more graph."""
        self.recording = True
        fn()
        self.recording, self.graphs = False, self.graphs + 1

    def begin_step(self):
        self.in_step = True

    def end_step(self):
        self.in_step = False
        self.cached.update(self.pending)
        self.pending = []


@dataclass(frozen=True)
class Traits:
    """What the device's capabilities decide about a step's buffers (LlamaModel reads the same)."""
    name: str = "cpu"
    fused_dtypes: tuple = ()        # fused attention's dtypes (none: materialised scores)
    fused_head_dims: tuple = ()     # ... and head sizes (empty: any)
    fused_segments: bool = False    # packed rows fused too
    token_major: bool = False       # q, k, v attended as columns of the projection
    attn_block: int = 0             # query rows per materialised block (0: one block)
    lora_fold: bool = False         # LoRA folded into the frozen GEMMs (wider weights)
    queue_ordered: bool = True      # a buffer released in a step serves the same step
    graphs: bool = False            # steps replay as graphs: lengths padded to a bucket
    attention_workspace: tuple = (0, 0)  # the fused backward's pool bytes a (B, H, T, D) element, a (B, H, T) row

    @classmethod
    def of(cls, device):
        c = device.capabilities()
        fa = c["fused_attention"]
        return cls(device.name, tuple(fa["dtypes"]), tuple(fa["head_dims"]), bool(fa["segments"]),
                   bool(fa["token_major"]), int(c["attention_block"]), bool(c["lora_fold"]),
                   bool(c["queue_ordered"]), bool(c["graphs"]), tuple(fa["workspace"]))


# A CUDA GPU with cuDNN's fused attention, as the README's table assumes.
CUDA = Traits("cuda", ("bf16", "f16"), (), True, True, 1024, True, True, True, (8, 4))


@dataclass(frozen=True)
class Run:
    """One training run's shape: what the estimate depends on."""
    config: ModelConfig
    lora: LoraConfig
    dtype: str = "bf16"
    quantize: Optional[tuple] = None  # --q-bits: (bits, group_size[, mode]) of the projections
    file_quantized: Optional[tuple] = None  # an MLX quantized folder's (bits, group_size): embeddings too
    batch: int = 1                    # items of a micro-batch: rows (B), pairs or grpo's prompts
    seq: int = 2048                   # tokens of a row (T), padded
    grad_checkpoint: bool = False
    micro_batches: int = 1            # accumulated micro-batches of a step
    ce_chunk: Optional[int] = None    # rows of logits at a time (None: the model's default)
    packed: bool = False              # rows of packed samples (segments)
    optimizer: str = "adamw"
    min_8bit_size: int = 4096         # adamw8bit: smaller parameters keep only f32 moments
    momentum: float = 0.0             # sgd: a momentum buffer where > 0
    objective: str = "sft"            # --train-mode: sft, or a sequence objective (memory_sequence)
    rows_per_item: int = 1            # rows a batch item makes: 2 a pair; grpo's G completions a prompt
    reference: bool = False           # a forward with the adapter off first (DPO; GRPO with --beta > 0)
    completion: int = 0               # grpo: the tokens a completion may take (then seq: prompt + these)
    ranks: int = 1                    # data-parallel ranks: each holds its share of a micro-batch's items
    sample_order: bool = False        # the sample reduce order (--reduce-order; sample_sums.py)
    replay: bool = False              # steps recorded as graphs and replayed (the Trainer's choice)
    device: Traits = Traits()


@dataclass
class Estimate:
    run: Run
    parts: dict          # part -> bytes at the peak (PARTS' keys, slack included)
    total: int           # the pool's peak reserved bytes
    live: int            # the pool's peak in-use bytes (class-rounded)

    def table(self, budget=None, origin=""):
        """The plan as lines: each part, the total, and whether it fits `budget` bytes."""
        rows = [(PARTS[k], self.parts[k]) for k in PARTS if self.parts.get(k)]
        width = max(len(name) for name, _ in rows)
        lines = [f"  {name:<{width}}  {size_text(n):>10}" for name, n in rows]
        lines.append(f"  {'total (peak of the pool)':<{width}}  {size_text(self.total):>10}")
        if budget is None:
            lines.append(f"  budget: unknown ({origin or 'the device reports none'}); fits: unknown")
        else:
            fits = "yes" if self.total <= budget else "no"
            lines.append(f"  budget: {size_text(budget)} ({origin}); fits: {fits}")
        return lines


def size_text(n):
    """Bytes as people read them: KiB below a MiB, MiB below a GiB, else GiB."""
    if n < 2**20:
        return f"{n / 2**10:.1f} KiB"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def estimate(run):
    """The Estimate of a Run: the resident buffers, then a step of its micro-batches."""
    lora = replace(run.lora)
    lora.validate(run.config)  # as LlamaModel does: family-specific target names
    run = replace(run, lora=lora)
    t = Trace(run.device.queue_ordered)
    rp = Replay(t, run)
    rp.resident()
    for _ in range(1 if run.replay else run.micro_batches):  # a replay makes no new buffers
        rp.micro_batch()
    if run.replay:  # Device.capture: the warm-up above, then the recording
        t.record(rp.micro_batch)
    rp.optimizer()
    if run.replay:
        t.record(rp.optimizer)
    parts = {k: v for k, v in t.at_peak.items() if v}
    parts["slack"] = t.peak_reserved - sum(parts.values())
    return Estimate(run, parts, t.peak_reserved, t.peak_in_use)


def batch_size(run):
    """(a micro-batch's size as --batch-size counts it, what it counts): grpo's completions, pairs, rows."""
    if run.objective == "grpo":
        return run.batch * run.rows_per_item, "completions"
    return run.batch, "rows" if run.objective == "sft" else "pairs"


def describe(run, base):
    """What a fitted run changes from `base`, for people."""
    out = []
    if run.grad_checkpoint and not base.grad_checkpoint:
        out.append("--grad-checkpoint")
    if run.batch != base.batch:
        n, noun = batch_size(run)
        out.append(f"micro-batches of {n} {noun}, {run.micro_batches} accumulated (global batch "
                   f"{n * run.micro_batches} kept)")
    if run.ce_chunk != base.ce_chunk:
        out.append(f"loss chunks of {run.ce_chunk} rows")
    return ", ".join(out) or "nothing to change"


def candidates(run):
    """Runs in the order --fit tries them: as given; with gradient checkpointing; then smaller
    micro-batches (accumulated to keep the global batch), largest first; then each of those with
    the loss's logits in smaller chunks."""
    yield run
    run = replace(run, grad_checkpoint=True)
    yield run
    B, k = run.batch, run.micro_batches
    sizes = [b for b in range(B, 0, -1) if B % b == 0]
    for b in sizes[1:]:
        yield replace(run, batch=b, micro_batches=k * (B // b))
    default = run.ce_chunk or 1024 * max(1, 32768 // run.config.vocab_size)
    for chunk in (c for c in (512, 256, 128, 64) if c < default):
        for b in sizes:
            yield replace(run, batch=b, micro_batches=k * (B // b), ce_chunk=chunk)


def fit(run, budget):
    """(the first candidate Estimate within budget bytes, True), or (the smallest one, False)."""
    best = None
    for cand in candidates(run):
        est = estimate(cand)
        if est.total <= budget:
            return est, True
        if best is None or est.total < best.total:
            best = est
    return best, False


class OutOfMemory(RuntimeError):
    """A training step's allocation failed: one line with the step, the estimate and what to change."""


def out_of_memory(err, step, est=None, checkpoint=None):
    """The OutOfMemory of a device allocation error `err` in `step`; est: the run's Estimate."""
    what = str(err).splitlines()[0] if str(err) else type(err).__name__
    plan = f"; krnl's estimate for this run is {size_text(est.total)}" if est is not None else ""
    todo = ("--grad-checkpoint" if est is None or not est.run.grad_checkpoint else None,
            "a smaller --batch-size with more --grad-accumulation", "a lower --max-seq-length",
            "--q-bits 4", "or --fit / --max-memory SIZE to choose for you")
    kept = f"the last checkpoint (step {checkpoint}) is intact" if checkpoint else "no checkpoint was written yet"
    return OutOfMemory(f"out of memory in step {step}: {what}{plan}; try {', '.join(t for t in todo if t)}; "
                       f"{kept}")
