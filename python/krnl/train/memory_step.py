"""The device allocations of a training step, replayed from the shapes alone (krnl.train.memory
runs them through a model of the pool): one micro-batch's step as StepRunner and
LlamaModel.forward_backward_step make it, after memory_resident's buffers.

Each function here mirrors the model function of its name, request for request and in the same
order, and frees a buffer where Python drops its last reference: a local at its function's return,
a rebound name after the new value exists (`oh = d.empty(...)` in a loop holds two for a moment),
a cache once its layer's backward is done. A change to what the model allocates belongs here
too; tests/test_memory.py measures the pool against this replay on several configurations.

A sequence objective's micro-batch (DPO, ORPO, SimPO, GRPO) is memory_sequence's."""

from ..models import mlp_rows
from ..models.config import QKV_MODULES
from . import memory_sequence as sequence
from .memory_moe import MoeReplay
from .memory_resident import ACTS, ATTN, CKPT, LOSS, SMALL, WORK, Resident


class Replay(Resident, MoeReplay):
    """One run's allocations, resident and a micro-batch's step, against a memory.Trace."""

    # -- one micro-batch (StepRunner.micro_batch, eager) ----------------------------------------

    def micro_batch(self):
        if self.run.objective != "sft":                                   # two device steps (sequence_loss.py)
            sequence.micro_batch(self)
            return
        if self.run.sample_order:
            self.reserve()
        inputs = self.inputs()
        self.t.begin_step()
        total = self.forward_backward_step()
        self.t.free(total)                                               # cast into StepRunner.losses
        self.t.end_step()
        self.t.free(*inputs)

    def inputs(self):
        """DeviceInputs.of: positions, segments, ids, targets, ce_scale, dropout seeds, loss_scale."""
        B, T, N = self.B, self.T, self.N
        switch = self.c.rope_switch_position                              # LongRoPE: its long frequencies, once
        if switch is not None and T - 1 >= switch and not self.long_rope:
            self.long_rope = self.new((self.D // 2,), "f32", SMALL)
        inputs = [self.new((B, T) if self.run.packed else (T,), "i32", SMALL)]
        inputs += [self.new((T,), "i32", SMALL) for _ in range(B if self.run.packed else 0)]
        inputs += [self.new((N,), "i32", SMALL), self.new((N,), "i32", SMALL), self.new((1,), "f32", SMALL)]
        inputs += [self.new((2,), "i32", SMALL)] if self.dropout else []
        inputs.append(self.new((1,), "f32", SMALL))
        return inputs

    def optimizer(self):
        if self.run.sample_order and self.numel:                          # SampleSums.finish: the slots' tree
            self.t.begin_step()
            self.t.free(self.tree(self.samples, self.numel))
            self.t.end_step()
        self.t.begin_step()
        self.t.free(self.new((5,), "f32", SMALL))                         # AdamW.queue_step's hyper
        self.t.end_step()

    def forward_backward_step(self):
        x, xn, rstd, saved = self.trunk_forward()
        rows_loss, dxn = self.head_backward()
        self.t.free(xn)
        dx = self.trunk_backward(saved, (x, rstd, dxn))                  # x, rstd, dxn go once read
        if self.embeds:                                                   # full.embed_grad (Gemma's scaled copy)
            self.t.free(self.act((self.N, self.C), WORK) if self.c.gemma else None, dx)
        if self.run.sample_order:                                         # sums.loss_sum: per sample, the tree
            P = self.new((self.samples, 1, 1), "f32", SMALL)
            total = self.tree(self.samples, 1)
            if total is None:                                             # one sample: a view of P
                total = P
            else:
                self.t.free(P)
        else:
            total = self.new((1, 1), "f32", SMALL)                        # _loss_sum's out, its ones
            self.grow_ones("f32", self.N)
        self.t.free(rows_loss)
        return total

    def trunk_forward(self, keep=True):
        """LlamaModel._trunk_forward: keep False (a forward without a backward) drops each layer's
        input and cache once its output exists."""
        ckpt, N, C = self.run.grad_checkpoint, self.N, self.C
        x = self.act((N, C), CKPT if ckpt else ACTS)                      # embeddings
        saved = []
        for i in range(self.L):
            out, cache = self.layer_forward(i, x, need_cache=keep and not ckpt)
            if not keep:
                self.t.free(x, *cache)
            else:
                if ckpt:
                    self.t.free(*cache)                                   # dropped before the next layer
                saved.append((x, None if ckpt else cache))
            x = out
        xn, rstd = self.act((N, C), LOSS), self.new((N,), "f32", LOSS)
        if self.c.moe:                                                    # RouterStats.last replaced
            last, self.router_last = self.router_last, self.new((1, 1), "f32", SMALL)
            self.t.free(last)
        return x, xn, rstd, saved

    def head_backward(self):
        N, C, V = self.N, self.C, self.V
        rows_loss, dxn = self.new((N,), "f32", LOSS), self.act((N, C), LOSS)
        chunk = min(N, self.chunk)
        if self.run.sample_order and chunk >= self.T:                      # sums.row_chunks: whole samples
            chunk -= chunk % self.T
        logits = self.act((chunk, V), LOSS)
        dl = self.act((chunk, V), LOSS) if self.c.gemma and self.c.gemma.get("final_softcap") else None
        self.t.free(logits, dl)
        return rows_loss, dxn

    def cols(self, i):
        """The columns the down projection's fold of layer i writes beside dy (Mlp.grad_cols)."""
        return self.r if self.wide_rows(i, "down_proj") else 0

    def trunk_backward(self, saved, ends=()):
        """ends: the caller's (x, rstd, dxn) where only the model's backward holds them."""
        N, C = self.N, self.C
        dx = self.act((N, C + self.cols(self.L - 1)), WORK)
        self.t.free(*ends)
        held, rest = [], None  # the loop's names xin and cache (and `_`, checkpointing's output)
        for i in reversed(range(self.L)):
            xin, cache = saved[i]
            self.t.free(*held)
            held = [xin] + (cache or [])
            if cache is None:                                             # checkpointed: recompute
                self.recording = False
                y, cache = self.layer_forward(i, xin, need_y=False)
                self.recording = True
                self.t.free(rest)
                rest = y
                held = [xin] + cache
            ndx = self.layer_backward(i, dx, i > 0 or self.embeds, self.cols(i - 1) if i else 0)
            self.t.free(dx)
            dx = ndx
            saved[i] = None
        self.t.free(*held, rest)
        if not self.embeds:
            self.t.free(dx)
        return dx                                                         # d_embed_out, for full.embed_grad

    # -- a decoder layer (layer.py, layer_heads.py, attention.py, lora.py, lora_group.py) ----------

    def lora_forward(self, i, m, inp, copies=None):
        """LoraLinear.lora_forward's saved drop(x) and t; copies: where drop(x) goes instead, where
        norm_remake.drop takes it out (an input norm's)."""
        if not self.has(i, m):
            return []
        xd = [self.act((self.N, inp))] if self.dropout else []
        if copies is not None:
            copies += xd
        return (xd if copies is None else []) + [self.act((self.N, self.r))]

    def dora_scale(self, out):
        """dora.scale's buffers: Q (r, out) f32 (after a product in the compute dtype where W is
        quantized), G (r, r); returns the kept c and 1 / norm (out,) f32."""
        q = self.new((self.r, out), "f32", WORK)
        quantized = self.run.quantize or self.run.file_quantized
        p = self.act((self.r, out), WORK) if quantized and self.dt != "f32" else None
        g = self.act((self.r, self.r), WORK)
        kept = [self.new((out,), "f32", ACTS), self.new((out,), "f32", ACTS)]
        self.t.free(q, p, g)
        return kept

    def linear_forward(self, i, m, inp, out):
        """LoraLinear.forward's saves: with DoRA its unscaled output z first and the scale's last."""
        if not self.dora_on(i, m):
            return self.lora_forward(i, m, inp)
        z = self.act((self.N, out))
        return [z] + self.lora_forward(i, m, inp) + self.dora_scale(out)

    def dora_outputs(self, i, members, rows):
        """dora.scale_outputs of a group whose members share one output (N, sum of rows): a new
        output and each DoRA member's scale (the old output stays: DoraSaved's z); None without DoRA."""
        if not any(self.dora_on(i, m) for m in members):
            return None
        y = [self.act((self.N, sum(rows)))]
        for m, n in zip(members, rows):
            if self.dora_on(i, m):
                y += self.dora_scale(n)
        return y

    def dora_backward(self, i, m, out, cols=0):
        """LoraLinear.backward's dz (rows, out + cols) where DoRA scales the linear, and dora.backward's
        dc (S, out) f32; returns dz, freed once the linear's backward is done (None without DoRA)."""
        if not self.dora_on(i, m):
            return None
        dz = self.act((self.N, out + cols), WORK)
        self.t.free(self.new((self.samples, out), "f32", WORK))
        return dz

    def dora_in_place(self, i, members, rows):
        """dora.backward_in_place's dc (S, out) f32 of each DoRA member."""
        for m, n in zip(members, rows):
            if self.dora_on(i, m):
                self.t.free(self.new((self.samples, n), "f32", WORK))

    def group_forward(self, i, members, inp, folded=False, copies=None):
        if self.groups(i, members):
            held = [self.act((len(members) * self.r, inp))] if self.c.fused_projections else []  # A copied
            return held + ([] if folded else [self.act((self.N, len(members) * self.r))])
        return [k for m in members for k in self.lora_forward(i, m, inp, copies)]

    def lora_backward(self, i, m, inp, folded=False, dx=True):
        if not self.has(i, m) or folded:
            return
        dt = self.act((self.N, self.r), WORK)
        tmp = [self.act((self.N, inp), WORK), self.act((self.N, inp), WORK)] if self.dropout and dx else []
        self.t.free(dt, *tmp)

    def group_backward(self, i, members, inp, dx=True):
        if not self.groups(i, members):
            for m in members:
                self.lora_backward(i, m, inp, dx=dx)
            return
        dt = self.act((self.N, len(members) * self.r), WORK)
        fused = self.c.fused_projections and not self.run.sample_order   # (the sample order: into the slots)
        dA = self.new((len(members) * self.r, inp), "f32", WORK) if fused else None
        self.t.free(dt, dA)

    def layer_forward(self, i, x, need_cache=True, need_y=True):
        """(y, the ids the LayerCache holds) of layer i; x is the caller's. need_cache, need_y: as
        layer.layer_forward's (the MLP in blocks of rows where mlp_rows says)."""
        c, N, C, H, Hk, D, T, r = self.c, self.N, self.C, self.H, self.Hk, self.D, self.T, self.r
        QKV = self.NH * D
        fold = self.folds(i, QKV_MODULES, QKV)
        xn, keep = self.act((N, C + (3 * r if fold else 0))), [self.new((N,), "f32", ACTS)]  # xn, r1
        qkv = self.act((N, QKV))
        keep += self.group_forward(i, QKV_MODULES, C, fold, copies := [])
        scaled = self.dora_outputs(i, QKV_MODULES, (H * D, Hk * D, Hk * D))
        if scaled:                                                        # qkv the scaled copy; the old one kept
            keep += [qkv] + scaled[1:]
            qkv = scaled[0]
        if c.attention_bias:
            self.grow_ones("dt", N)
        keep += self.drop(xn, 3 * r if fold else 0, copies)
        if c.qk_full_norm:                                                # olmoe.qk_full_norm_forward: raw q, k, rstd
            heads = self.act((self.NH, N, D), WORK)
            for h in (H, Hk):
                keep += [self.act((N, h * D)), self.new((N,), "f32", ACTS)]
            self.t.free(heads)
        att = self.act((N, H * D))
        local = []
        if self.token_major:
            keep += [qkv, att, self.new((self.B, H, T), "f32", ATTN)]     # views of qkv and att, lse
        else:
            local.append(qkv)
            (keep if self.keeps_x(i, "o_proj") else local).append(att)  # o's x
            oh = None
            for _ in range(self.B):
                keep.append(self.act((self.NH, T, D)))                    # heads
                if c.qk_norm:
                    keep += [self.act((H + Hk, T, D)), self.new(((H + Hk) * T,), "f32", ACTS)]
                new = self.act((H, T, D))                                 # oh
                if not self.fused:
                    self.t.free(oh)
                oh = new
                if self.fused:
                    keep += [oh, self.new((H, T), "f32", ATTN)]           # out, lse
                else:
                    for n, k in self.blocks():                            # P (and gemma2's capped scores Y first)
                        keep += [self.new((H, n, k), self.dt, ATTN) for _ in range(2 if self.softcap else 1)]
            if not self.fused:
                self.t.free(oh)                                           # heads_forward's local
        keep.append(self.act((N, C)))                                     # h
        keep += self.linear_forward(i, "o_proj", H * D, C)
        if c.gemma:                                                       # gemma2.post_norm_forward: the new h, rstd
            keep += [self.act((N, C)), self.new((N,), "f32", ACTS)]
        rows = 0 if need_cache and need_y else self.mlp_rows(i)
        if rows:                                                          # mlp_rows.forward, or deferred
            y, more = (self.mlp_blocks(i, rows) if need_y else None), []
        else:
            y, more = (self.moe_forward if c.moe else self.mlp_forward)(i)
        self.t.free(*local)
        return y, keep + more

    def attention_workspace(self, rows):
        """The fused attention_backward's workspace over `rows` rows of T (the device's capabilities'
        bytes a (rows, H, T, D) element and a (rows, H, T) row; the op takes it from the pool)."""
        per_element, per_row = self.run.device.attention_workspace
        n = rows * self.H * self.T * (per_element * self.D + per_row)
        if self.fused and n:
            self.t.free(self.new(((n + 3) // 4,), "f32", WORK))

    def mlp_rows(self, i):
        """mlp_rows.rows: the rows of layer i's MLP blocks, or 0 where it runs whole."""
        mlp = ("gate_proj", "up_proj", "down_proj")
        if (self.c.moe or self.c.gemma or self.run.sample_order or self.trains(i, "post_attention_layernorm")
                or any(self.dora_on(i, m) or self.trains(i, m) or (self.dropout and self.has(i, m)) for m in mlp)):
            return 0
        n = mlp_rows.block_rows(self.N, self.F, 4 if self.dt == "f32" else 2)
        return n if n < self.N else 0

    def mlp_blocks(self, i, n, dy=None, dh_cols=0):
        """mlp_rows.forward's y (dy None), or mlp_rows.backward's dh, in blocks of n rows."""
        N, C = self.N, self.C
        out = self.act((N, C), CKPT if self.run.grad_checkpoint else ACTS) if dy is None else \
            self.act((N, C + dh_cols), WORK)
        for r0 in range(0, N, n):
            self.N = min(N, r0 + n) - r0
            y, keep = self.mlp_forward(i, out=dy is None)
            self.t.free(y)
            if dy is not None:
                self.mlp_backward(i, dy, dh_cols, out=True)
            self.t.free(*keep)
        self.N = N
        return out

    def mlp_forward(self, i, out=False):
        N, C, F, r = self.N, self.C, self.F, self.r
        fold = self.folds(i, ("gate_proj", "up_proj"), 2 * F)
        hn, keep = self.act((N, C + (2 * r if fold else 0))), [self.new((N,), "f32", ACTS)]  # hn, rstd
        keep += [self.act((N, F)) for _ in range(2)]                      # g, u
        a = self.act((N, F))
        keep += self.group_forward(i, ("gate_proj", "up_proj"), C, fold, copies := [])
        for m in ("gate_proj", "up_proj"):                                # each scaled into a new output
            keep += self.dora_outputs(i, (m,), (F,)) or []
        keep += self.drop(hn, 2 * r if fold else 0, copies)
        part = CKPT if self.run.grad_checkpoint else ACTS
        if self.c.gemma:                                                  # down's output m, then its post norm's
            keep.append(self.act((N, C)))
            keep += self.linear_forward(i, "down_proj", F, C)
            y = self.act((N, C), part)
            keep.append(self.new((N,), "f32", ACTS))
        else:
            y = None if out else self.act((N, C), part)
            keep += self.linear_forward(i, "down_proj", F, C)
        self.t.free(a)                                                    # recomputed where the backward reads it
        return y, keep

    def layer_backward(self, i, dy, need_dx, dx_cols):
        N, C, H, Hk, D, T = self.N, self.C, self.H, self.Hk, self.D, self.T
        o_cols = self.r if self.wide_rows(i, "o_proj") else 0
        rows = self.mlp_rows(i) if self.run.grad_checkpoint else 0
        if rows:
            dhw = self.mlp_blocks(i, rows, dy, o_cols)
        else:
            dhw = (self.moe_backward if self.c.moe else self.mlp_backward)(i, dy, o_cols)
        datt = self.act((N, H * D), WORK)
        da = self.act((N, C), WORK) if self.c.gemma else None              # gemma2.post_norm_backward
        dz = self.dora_backward(i, "o_proj", C, o_cols)
        self.lora_backward(i, "o_proj", H * D, folded=self.folds_back(i, "o_proj"))
        self.t.free(dz)
        dqkv = self.act((N, self.NH * D), WORK)
        if self.token_major:
            self.attention_workspace(self.B)
        else:
            held = {}
            for _ in range(self.B):
                for name, shape in (("doh", (H, T, D)), ("dheads", (self.NH, T, D)),
                                    ("dqk", (H + Hk, T, D) if self.c.qk_norm else None)):
                    if shape:
                        new = self.act(shape, WORK)
                        self.t.free(held.get(name))
                        held[name] = new
                if not self.fused:                                        # materialised_backward's dS
                    dS = None
                    for n, k in reversed(self.blocks()):
                        new = self.new((H, n, k), self.dt, ATTN)
                        self.t.free(dS)
                        dS = new
                    self.t.free(dS)
                else:
                    self.attention_workspace(1)
            self.t.free(*held.values())
        if self.c.qk_full_norm:                                           # olmoe.qk_full_norm_backward's
            dheads, dq = self.act((self.NH, N, D), WORK), self.act((N, H * D), WORK)
            dk = self.act((N, Hk * D), WORK)
            self.t.free(dq)
            self.t.free(dheads, dk)
        need_dx = need_dx or self.trains(i, "input_layernorm")            # its gradient needs dxn
        dxn = self.act((N, C), WORK) if need_dx else None
        xn = self.remake(i, QKV_MODULES)
        self.dora_in_place(i, QKV_MODULES, (H * D, Hk * D, Hk * D))
        self.group_backward(i, QKV_MODULES, C, dx=need_dx)
        self.t.free(*xn)
        dx = self.act((N, C + dx_cols), WORK) if need_dx else None
        self.t.free(dhw, datt, da, dqkv, dxn)
        return dx

    def mlp_backward(self, i, dy, dh_cols, out=False):
        N, C, F = self.N, self.C, self.F
        da = self.act((N, F), WORK)
        dm = self.act((N, C), WORK) if self.c.gemma else None              # gemma2.post_norm_backward
        a = self.act((N, F), WORK) if self.keeps_x(i, "down_proj") else None  # down's input, made again
        dz = self.dora_backward(i, "down_proj", C, self.cols(i))
        self.lora_backward(i, "down_proj", F, folded=self.folds_back(i, "down_proj"))
        self.t.free(dz, a)  # dg and du take da's and u's places (dense_mlp.mlp_backward)
        hn = self.remake(i, ("gate_proj", "up_proj"))
        self.dora_in_place(i, ("gate_proj", "up_proj"), (F, F))
        dhn = self.act((N, C), WORK)
        self.group_backward(i, ("gate_proj", "up_proj"), C)
        self.t.free(*hn)
        dh = None if out else self.act((N, C + dh_cols), WORK)
        self.t.free(da, dm, dhn)
        return dh
