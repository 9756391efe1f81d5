"""What a training run holds in the device's pool before its first step, replayed from the shapes
alone (krnl.train.memory): the buffers LlamaModel (frozen weights, as qweight.frozen_weight and
layer.build_layer upload them), FlatParams (the LoRA masters, gradients and compute copy), the
optimizer (its state) and StepRunner make, in their order. memory_step.Replay goes on from here
with a step; its docstring says how the replay follows the code."""

import math

from ..models.config import QKV_MODULES
from ..models.full import full_param_shapes
from ..models.lora import lora_param_shapes
from ..models.phi3 import MEMBER_OF

E = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "u8": 1}

# The state each optimizer allocates (train/optimizers/), in its order: only what its update reads.
# Muon's Newton-Schulz buffers live only during its update.
OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "adafactor", "muon", "adamw8bit")
BLOCK_8BIT = 256


def optimizer_state(name, shapes, min_8bit_size=4096, momentum=0.0):
    """[(shape, dtype)] of optimizer `name`'s state tensors for LoRA tensors `shapes` {key: shape}
    (momentum: SGD's, which alone gives it a buffer)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"[memory] no state layout for optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
    sizes = {k: math.prod(s) for k, s in shapes.items()}
    vec = lambda n: ((max(n, 1),), "f32")                                # a moment over n elements
    n = sum(sizes.values())
    if name in ("adamw", "adam"):
        return [vec(n), vec(n)]                                           # m, v
    if name == "lion" or (name == "sgd" and momentum):
        return [vec(n)]                                                   # m (SGD's momentum buffer)
    if name == "sgd":
        return []
    if name == "muon":                                                    # m, v of the AdamW ones (not 2-D)
        return [vec(n), vec(sum(sizes[k] for k, s in shapes.items() if len(s) != 2))]
    if name == "adafactor":                                               # a row and a column moment per matrix
        lead = lambda s: math.prod(s[:-2]) if len(s) > 2 else 1
        return [vec(sum(lead(s) * (s[-2] + s[-1]) for s in shapes.values()))]
    blocks = sum(-(-n // BLOCK_8BIT) for n in sizes.values() if n >= min_8bit_size)
    small = sum(n for n in sizes.values() if n < min_8bit_size)
    return ([((BLOCK_8BIT,), "f32")] * 2                                  # the two dynamic maps
            + [((max(blocks * BLOCK_8BIT // 4, 1),), "i32")] * 2          # codes 4 to a word
            + [vec(blocks)] * 2 + [vec(small)] * 2)                       # absmax per block; m, v of the small ones


# the parts a buffer is counted in (krnl.train.memory.PARTS names them for people)
WEIGHTS, LORA, GRADS, OPTIM, ACTS, CKPT, ATTN, LOSS, WORK, SMALL = (
    "weights", "lora", "grads", "optimizer", "activations", "checkpoints", "attention", "loss", "working", "small")


class Resident:
    """One run's resident allocations against `t` (a memory.Trace), from a memory.Run `run`; the
    helpers memory_step.Replay's step shares."""

    def __init__(self, t, run):
        self.t, self.run = t, run
        c, lc = run.config, run.lora
        self.c, self.dt, self.r = c, run.dtype, lc.r
        # rows: a rank's share of the items (the first ranks' where they differ), 2 a pair, G a GRPO prompt
        self.B, self.T = -(-run.batch // run.ranks) * run.rows_per_item, run.seq
        self.N = self.B * self.T
        self.C, self.V, self.L = c.hidden_size, c.vocab_size, c.num_hidden_layers
        self.H, self.Hk, self.D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.F = c.moe["expert_size"] if c.moe else c.intermediate_size
        self.NH = self.H + 2 * self.Hk
        if lc.full:  # the trained weights in FlatParams; no factors, so none of LoRA's paths
            self.shapes, self.adapted = full_param_shapes(c, lc)[0], set()
        else:
            self.shapes, self.adapted = lora_param_shapes(c, lc)
        self.numel = sum(math.prod(s) for s in self.shapes.values())
        self.dropout = lc.dropout > 0
        self.embeds = "model.embed_tokens.weight" in self.shapes          # full.embed_grad: layer 0's dx too
        self.samples = self.B if run.sample_order else 1  # a call's samples (sample_sums.py): DoRA's dc rows
        self.reserved = False                                             # SampleSums.reserve's buffers made
        self.long_rope = None                                             # LongRoPE's long frequencies, once made
        dev = run.device
        self.fused = run.dtype in dev.fused_dtypes and (not dev.fused_head_dims or self.D in dev.fused_head_dims)
        self.fused = self.fused and (not run.packed or dev.fused_segments) and not c.attention_sinks
        self.softcap = bool(c.gemma and c.gemma["attn_softcap"])        # gemma2.attend: always materialised
        self.fused = self.fused and not self.softcap
        self.token_major = self.fused and dev.token_major and not run.packed and not c.qk_norm and not c.gemma
        self.block = dev.attn_block
        self.fold = dev.lora_fold and run.quantize is None and not run.file_quantized and not c.gemma
        self.ones = {"f32": None, "dt": None}  # the model's two Ones columns (f32, compute dtype): (id, rows)
        self.chunk = run.ce_chunk or 1024 * max(1, 32768 // self.V)
        self.recording = True  # RouterStats counts the forward, not a checkpointed recomputation
        self.router_last = None

    # -- helpers ---------------------------------------------------------------------------

    def new(self, shape, dtype, part):
        return self.t.alloc(shape, E[dtype], part)

    def act(self, shape, part=ACTS):
        return self.new(shape, self.dt, part)

    def has(self, i, m):
        """Whether layer i's projection m has LoRA factors (phi3's members: their fused module's)."""
        return (i, MEMBER_OF.get(m, m) if self.c.fused_projections else m) in self.adapted

    def trains(self, i, what):
        """Whether full fine-tuning trains layer i's `what` (a projection's weight or bias, a norm):
        then FlatParams holds it and the layer uploads nothing."""
        if what.endswith("norm"):
            return f"model.layers.{i}.{'self_attn.' if what[:2] in ('q_', 'k_') else ''}{what}.weight" in self.shapes
        name, _, kind = what.partition(":")
        part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        return f"model.layers.{i}.{part}.{name}.{kind or 'weight'}" in self.shapes

    def dora_on(self, i, m):
        """Whether layer i's projection m scales its output by DoRA's magnitude (dora.py)."""
        return self.run.lora.use_dora and self.has(i, m)

    def dora_w2(self, i, mods):
        """dora.Dora's ||W_o||^2 (out,) f32 of each DoRA linear among mods, as build_layer makes them."""
        for m in mods:
            if self.dora_on(i, m):
                self.new((self.c.module_shape(m)[0],), "f32", WEIGHTS)

    def keeps_x(self, i, m):
        """Whether linear m's backward reads its input: LoRA's factors or full fine-tuning's weight."""
        return (self.has(i, m) and not self.dropout) or self.trains(i, m)

    def remake(self, i, members, also=False):
        """norm_remake.remake where the backward reads the members' input (or also): the norm's
        output (N, C), its rstd for a moment, each dropout member's drop of it; the ids to free."""
        drops = [m for m in members if self.has(i, m) and self.dropout]
        if not also and not drops and not any(self.keeps_x(i, m) for m in members):
            return []
        xn = self.act((self.N, self.C), WORK)
        self.t.free(self.new((self.N,), "f32", WORK))
        return [xn] + [self.act((self.N, self.C), WORK) for _ in drops]

    def blocks(self):
        """attention.row_blocks: (rows, keys) of each materialised query block."""
        T, b = self.T, self.block
        if self.run.packed or not b or T <= b:
            return [(T, T)]
        return [(min(T, r0 + b) - r0, min(T, r0 + b)) for r0 in range(0, T, b)]

    def drop(self, xn, t_cols, copies=()):
        """norm_remake.drop: a folded group's t copied out of the norm's wider buffer (t_cols > 0),
        then the norm's output and the members' dropped copies of it freed; what the cache keeps."""
        t = [self.act((self.N, t_cols))] if t_cols else []
        self.t.free(*copies, xn)
        return t

    def all_have(self, i, members):
        return len(members) > 1 and all(self.has(i, m) for m in members)

    def groups(self, i, members):
        """Whether members' LoRA runs grouped (lora_group.groupable, in a training call)."""
        return self.all_have(i, members) and not self.dropout

    def folds(self, i, members, rows_out):
        """Whether a group's forward folds (lora_fold.wanted at build and Fold.pays per call)."""
        G, r = len(members), self.r
        return (self.fold and self.groups(i, members) and not self.c.fused_projections
                and 2 * self.N * rows_out > (G + 1) * r * rows_out + G * r * r)

    def wide_rows(self, i, m):
        """Whether linear m keeps A's rows below W (lora_fold.rows_for_A): then its dy is r wider."""
        return self.fold and self.has(i, m) and not (self.c.moe and m == "down_proj")

    def folds_back(self, i, m):
        """Whether its backward folds (LoraLinear._fold_backward: no dropout drawn)."""
        return self.wide_rows(i, m) and not self.dropout

    def reserve(self):
        """SampleSums.reserve before a call in the sample order: the tree's pair matrices, the row
        sums' ones, the slots (S, numel) f32 of the LoRA gradients (made once: one size a run)."""
        if self.reserved:
            return
        self.reserved = True
        for g in (1, 2, 4, 8):
            self.new((g, 2 * g), "f32", SMALL)
        for n in dict.fromkeys((self.T, self.samples)):
            self.new((n, 1), "f32", SMALL)
        self.new((self.samples, max(self.numel, 1)), "f32", GRADS)

    def tree(self, S, E):
        """SampleSums.tree_sum of (S, E) f32 rows: the buffer that holds the sum, or None where it is
        a view of the rows (S = 1)."""
        def levels(n):  # _levels: each level's out made before the one it reads goes
            held = None
            while n > 1:
                out = self.new((n // 2, E), "f32", WORK)
                self.t.free(held)
                held, n = out, n // 2
            return held

        def node(n):  # _node: a power of two level by level, else both halves and their sum
            if n & (n - 1) == 0:
                return levels(n)
            left, right = node(n // 2), node(n - n // 2)
            out = self.new((E,), "f32", WORK)
            self.t.free(left, right)
            return out

        return node(S)

    def grow_ones(self, which, rows):
        """layer.Ones(rows) of the model's f32 column or the layers' ("dt"): a longer one replaces it."""
        held = self.ones[which]
        if held is None or held[1] < rows:
            self.ones[which] = (self.new((rows, 1), self.dt if which == "dt" else which, SMALL), rows)
            if held is not None:
                self.t.free(held[0])

    # -- resident: the model, its LoRA, the optimizer, the step runner ---------------------------

    def frozen(self, out, inp, q=None):
        """qweight.frozen_weight: dense in the compute dtype, or codes, scales and biases; q: a
        (bits, group_size[, mode]) or None (the projections': the run's quantization)."""
        q = q or self.run.quantize or self.run.file_quantized
        lead = (out,) if isinstance(out, int) else tuple(out)
        if not q:
            return [self.new(lead + (inp,), self.dt, WEIGHTS)]
        bits, gs, mode = (tuple(q) + ("affine",))[:3]
        sdt = "f32" if mode == "mxfp4" and self.dt == "f16" else self.dt
        ids = [self.new(lead + (inp * bits // 32,), "i32", WEIGHTS), self.new(lead + (inp // gs,), sdt, WEIGHTS)]
        return ids + ([] if mode == "mxfp4" else [self.new(lead + (inp // gs,), sdt, WEIGHTS)])

    def resident(self):
        c, C, V, dt = self.c, self.C, self.V, self.dt
        self.t.exact = True                                               # LlamaModel's build (exact_sizes.py)
        for name in ("model.embed_tokens.weight", "lm_head.weight")[:1 if c.tie_word_embeddings else 2]:
            if name in self.shapes:                                       # trained (full.end_tensors)
                continue
            if self.run.file_quantized:  # an MLX folder quantizes them too; --q-bits leaves them
                self.frozen(V, C, self.run.file_quantized)
            else:
                self.new((V, C), dt, WEIGHTS)
        if "model.norm.weight" not in self.shapes:                        # final norm (trained: FlatParams')
            norm = self.new((C,), dt, WEIGHTS)
            if c.gemma:                                                   # up()'s, replaced by 1 + w in f32
                self.t.free(norm)
                self.new((C,), "f32", WEIGHTS)
        n = max(self.numel, 1)                                            # FlatParams
        self.new((n,), "f32", LORA)                                       # params
        self.new((n,), "f32", GRADS)
        if dt != "f32":
            self.new((n,), dt, LORA)                                      # the working copy
        if self.numel:
            self.t.free(self.new((n,), "f32", SMALL))                     # FlatParams.load's upload
        self.new((self.D // 2,), "f32", SMALL)                            # inv_freq
        if self.run.lora.use_dora:                                        # dora.Switch's unit scale
            self.new((max(c.module_shape(m)[0] for m in c.lora_modules()),), "f32", SMALL)
        for i in range(self.L):
            self.layer_weights(i)
        if self.run.lora.use_dora and self.numel:                         # magnitudes(): FlatParams.load again
            self.t.free(self.new((n,), "f32", SMALL))
        if c.moe:                                                          # RouterStats
            self.new((c.moe["experts"], 1, 1), "f32", SMALL)
            self.new((1, c.moe["experts"]), "f32", SMALL)
        self.t.exact = False
        self.new((1,), "f32", SMALL)                                      # the optimizer's _sq, _flag
        self.new((1,), "i32", SMALL)
        run = self.run
        for shape, dtype in optimizer_state(run.optimizer, self.shapes, run.min_8bit_size, run.momentum):
            self.new(shape, dtype, OPTIM)
        k = self.run.micro_batches
        for shape in ((1,), (k,)):
            self.new(shape, "f32", SMALL)                                 # StepRunner's slot, losses
        if c.moe:
            self.new((k,), "f32", SMALL)                                  # StepRunner aux, aux_slot
            self.new((1,), "f32", SMALL)

    def layer_weights(self, i):
        """layer.build_layer's uploads (and moe.build_moe's)."""
        c, C, F, dt, r, D = self.c, self.C, self.F, self.dt, self.r, self.D
        QKV, HD = self.NH * D, self.H * D
        for m, (o, n) in (("o_proj", (C, HD)), ("down_proj", (C, F))):   # rows_for_A
            if self.wide_rows(i, m):
                self.new((o + r, n), dt, WEIGHTS)
        wide = self.fold and self.all_have(i, QKV_MODULES) and not c.fused_projections
        if wide:                                                          # Fold.upload: Wk, eye
            self.new((QKV, C + 3 * r), dt, WEIGHTS)
            self.new((r, r), dt, SMALL)
        elif any(self.trains(i, m) for m in QKV_MODULES):                 # full.tensor: the frozen parts
            for m, rows in zip(QKV_MODULES, (self.H * D, self.Hk * D, self.Hk * D)):
                if not self.trains(i, m):
                    self.frozen(rows, C)
        else:
            self.frozen(QKV, C)
        trained = [self.trains(i, m + ":bias") for m in QKV_MODULES] if c.attention_bias else [True] * 3
        for rows, t in zip((QKV,) if not any(trained) else (self.H * D, self.Hk * D, self.Hk * D), trained):
            if not t:                                                     # one (1, QKV), or the frozen parts
                self.new((1, rows), dt, WEIGHTS)
        gu = self.fold and not c.moe and self.all_have(i, ("gate_proj", "up_proj"))
        if gu:
            self.new((F, C + 2 * r), dt, WEIGHTS)
            self.new((F, C + 2 * r), dt, WEIGHTS)
            self.new((r, r), dt, SMALL)
        self.dora_w2(i, QKV_MODULES)
        if not self.wide_rows(i, "o_proj") and not self.trains(i, "o_proj"):
            self.frozen(C, HD)
        self.dora_w2(i, ("o_proj",))
        if not c.moe:
            for m, (o, n) in (("gate_proj", (F, C)), ("up_proj", (F, C)), ("down_proj", (C, F))):
                if not (gu and m != "down_proj") and not (m == "down_proj" and self.wide_rows(i, m)) \
                        and not self.trains(i, m):
                    self.frozen(o, n)
                self.dora_w2(i, (m,))
        if c.o_proj_bias and not self.trains(i, "o_proj:bias"):
            self.new((1, C), dt, WEIGHTS)
        if c.moe:
            Ex = c.moe["experts"]
            self.frozen((Ex, F), C)                                       # gate, up, down experts
            self.frozen((Ex, F), C)
            self.frozen((Ex, C), F)
            n2 = self.new((C,), dt, WEIGHTS)                              # post_attention_layernorm (build_moe's)
            if self.trains(i, "post_attention_layernorm"):                # full fine-tuning's in its place
                self.t.free(n2)
            self.new((Ex, C), dt, WEIGHTS)                                # router
            if c.moe["bias"]:
                for shape in ((1, Ex), (Ex, F, 1), (Ex, F, 1), (Ex, C, 1)):
                    self.new(shape, dt, WEIGHTS)
        elif c.gemma:                                                     # gemma2.layer_parts: f32, 1 + w folded
            if c.gemma.get("local_theta") is not None and c.layer_windows[i]:
                self.new((D // 2,), "f32", SMALL)                         # the sliding layers' rotary frequencies
            for shape in [(C,)] * 3 + [(D,)] * (2 if c.qk_norm else 0) + [(C,)]:
                self.new(shape, "f32", WEIGHTS)                           # input, pre_ff, post_ff, q/k, post_attn
            return
        elif not self.trains(i, "post_attention_layernorm"):
            self.new((C,), dt, WEIGHTS)                                   # post_attention_layernorm
        if c.qk_norm or c.qk_full_norm:
            hq, hk = (self.H, self.Hk) if c.qk_full_norm else (1, 1)
            for n, heads in (("q_norm", hq), ("k_norm", hk)):
                if not self.trains(i, n):
                    self.new((heads * D,), dt, WEIGHTS)
        if c.attention_sinks:
            self.new((self.H,), "f32", WEIGHTS)
        if not self.trains(i, "input_layernorm"):
            self.new((C,), dt, WEIGHTS)                                   # input_layernorm
