"""The Llama family (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3_text) with LoRA adapters,
as explicit forward and backward over core ops (llm.c style, no autograd tape; docs/architecture.md):
the stack of decoder layers (layer.py), the loss and evaluation; generation is in generate.py.

    x0 = embed(ids)
    per layer:  h = x + o_proj(attn(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))   n1 = rmsnorm(x)
                (qwen3: rope(rmsnorm(q_proj(n1)) per head), likewise k)
                y = h + down_proj(silu(gate_proj(n2)) * up_proj(n2))                  n2 = rmsnorm(h)
    logits = rmsnorm(x_L) W_head^T  (W_head = embed_tokens when tied), mean cross entropy over
    the targets that are not ignore_index (-100), chunked over tokens.
    (gemma2, gemma2.py: x0 scaled by sqrt(C), logits soft-capped, its own layer pieces)

Frozen weights: uploaded once in the compute dtype, [out, in] as in HF checkpoints, buffers of their
own size (exact_sizes.py). An adapted linear: y = x W^T (+ bias) + s (drop(x) A^T) B^T, A (r, in) and
B (out, r) views of one FlatParams (f32 masters and gradients, PEFT names; lora.py), whose grads
the backward adds to (the caller zeros them); base weights never change.
"""

import numpy as np

from .. import _core
from .config import IGNORE_INDEX, LoraConfig, ModelConfig
from .batch_decode import generate_batch
from .generate import generate
from .attention import Batch
from .layer import Heads, Ones, build_layer, layer_backward, layer_forward
from .dora import Switch, held, magnitudes
from .exact_sizes import exact_sizes
from . import full, gemma2, phi3
from .full import Trained, init_full
from .lora import init_lora
from .moe import RouterStats
from .sample_sums import SampleSums
from .step_inputs import DeviceInputs, HostInputs, check_ids, id_array, plan_rows, target_array
from ..quant.qweight import embed, frozen_weight, linear, linear_grad, quantize_spec

ops = _core.ops


class LlamaModel:
    @exact_sizes
    def __init__(self, device, config, weights, lora=None, dtype="f32", seed=0, grad_checkpoint=False,
                 ce_chunk=None, quantize=None):
        if isinstance(config, dict):
            config = ModelConfig.from_dict(config)
        if dtype not in ("f32", "f16", "bf16"):
            raise ValueError(f"[LlamaModel] dtype must be f32, f16 or bf16, got {dtype!r}")
        self.dev, self.config, self.dtype = device, config, dtype
        self.lora_config = lora if lora is not None else LoraConfig()
        self.lora_config.validate(config)
        self.grad_checkpoint = bool(grad_checkpoint)
        # rows of logits a chunk: 1024 (at most 32768 V elements), more under a small vocabulary
        self.ce_chunk = int(ce_chunk) if ce_chunk else 1024 * max(1, 32768 // config.vocab_size)
        self._call_seed = int(seed)  # counts forward_backward calls: seeds their dropout masks
        config.check_weights(weights)
        if config.fused_projections:  # phi3: q|k|v and gate|up rows of the fused weights
            weights = phi3.split_fused(weights, config)
        c = config
        up = lambda k: device.tensor(np.asarray(weights[k], np.float32), dtype)
        # LoRA factors: one FlatParams, PEFT names, A then B per adapted module; or, in full
        # fine-tuning, the trained weights themselves under their HF names (full.py).
        trained = None
        if self.lora_config.full:
            self.lora_params, self.adapted = init_full(device, c, self.lora_config, dtype, weights, quantize)
            trained = Trained(self.lora_params)
        else:
            self.lora_params, self.adapted = init_lora(device, c, self.lora_config, dtype, seed)
        ends = full.end_tensors(trained, c, self.lora_config)  # {embed, head, norm: view} of those that train
        table = weights["model.embed_tokens.weight"]
        if getattr(table, "mode", "affine") == "mxfp4":  # quantized_embedding reads affine tables: held dense
            table = np.asarray(table, np.float32)
        self.embed = ends["embed"] if ends else frozen_weight(device, [table], dtype)  # (V, C)
        # The embedding table and an untied head stay quantized where the file quantizes them
        # (a tied head is the table); --q-bits leaves both in the compute dtype.
        self.head = self.embed if c.tie_word_embeddings else ends["head"] if ends else \
            frozen_weight(device, [weights["lm_head.weight"]], dtype)
        self.norm_w = ends["norm"] if "norm" in ends else up("model.norm.weight")  # (C,)
        if c.gemma:  # (1 + w), folded into the frozen copy only
            self.norm_w = device.tensor(gemma2.norm_weight(weights["model.norm.weight"]), "f32")
        self.embed_scale = gemma2.embed_scale(c, dtype)                     # None but for gemma2
        self.final_softcap = c.gemma["final_softcap"] if c.gemma else 0.0
        self.end_grads = full.end_grads(trained, c, self.lora_config)  # their gradients, or None
        # d_embed_out: frozen embeddings need none to train (W2, W3 time it); trained ones do
        self.input_grad = self.end_grads is not None
        self._long_inv_freq = None  # (D/2,) f32 LongRoPE's long factors' frequencies, on first use
        self.heads = Heads(c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                           device.tensor(c.inv_freq(), "f32"), c.rope_attention_factor)
        ones = Ones(device, dtype)  # shared by the layers' q/k/v biases
        # quantize = (bits, group_size) or (4, 32, "mxfp4"): the seven projections held quantized as
        # MLX does (QLoRA on a base quantized on load); embeddings, head and norms stay in the
        # compute dtype.
        self.quantize = quantize_spec(quantize)
        self.sums = SampleSums(self.lora_params)  # .on: LoRA gradients and loss summed per sample (sample_sums)
        # DoRA (dora.py): what its linears share, None for LoRA
        self.dora = Switch(device, max(c.module_shape(m)[0] for m in c.lora_modules())) \
            if self.lora_config.use_dora else None
        factors = set() if trained is not None else self.adapted  # the (layer, module) pairs with LoRA factors
        self.layers = [build_layer(i, c, weights, device, dtype, self.heads, ones, self.lora_config, self.lora_params,
                                   factors, self.quantize, self.sums, self.dora, trained)
                       for i in range(c.num_hidden_layers)]
        if self.dora is not None:  # each magnitude starts at ||W_o||, the base's
            self.lora_params.load({**self.lora_params.state(), **magnitudes(c, self.layers, self.adapted)})
        # A mixture's load-balancing loss: computed in every forward (aux_loss()), trained with where
        # aux_loss_coef > 0 (transformers' router_aux_loss_coef with output_router_logits).
        self._ones = Ones(device, "f32")  # f32 ones: the loss sum's gemm row, RouterStats' sums
        self.router_stats = RouterStats(device, c.moe["experts"], self._ones) if c.moe else None
        for L in self.layers if c.moe else ():
            L.mlp.stats = self.router_stats
        caps = device.capabilities()
        # Causal query row blocks skip the score blocks above the diagonal at the cost of more,
        # smaller GEMMs: the device says how many rows a block takes (0: all, one block; its
        # backend holds the measurements).
        self.attn_block = caps["attention_block"]
        # Fused (flash) attention where the device runs it faster than the materialised path, in
        # the dtypes and head sizes it lists (ops.attention_forward); packed rows and a sliding
        # window take it where the device lists those too. Settable, e.g. to compare both paths.
        fa = caps["fused_attention"]
        self.fused_attention = dtype in fa["dtypes"] and (not fa["head_dims"] or c.head_dim in fa["head_dims"])
        self.fused_segments, self.fused_window, self.fused_sinks = fa["segments"], fa["window"], fa["sinks"]
        # q, k and v attended in place as columns of the projection (no head transposes), all
        # rows in one call, where the device takes token-major views; settable like the above.
        self.token_major = fa["token_major"]
        self.d_embed_out = self._loss = None

    @property
    def aux_loss_coef(self):
        return self.router_stats.coef if self.router_stats else 0.0

    @aux_loss_coef.setter
    def aux_loss_coef(self, v):
        v = float(v)
        if not (v >= 0 and np.isfinite(v)):
            raise ValueError(f"[LlamaModel] aux_loss_coef must be a finite number >= 0, got {v!r}")
        if v and not self.router_stats:
            raise ValueError(f"[LlamaModel] aux_loss_coef {v}: {self.config.model_type} has no router")
        if self.router_stats:
            self.router_stats.coef = v

    def aux_loss(self):
        """The load-balancing loss of the last forward (a float, after its step), None without experts."""
        if self.router_stats is None or self.router_stats.last is None:
            return None
        return float(self.router_stats.last.numpy()[0])

    # -- inputs ----------------------------------------------------------------------------

    def _ids(self, ids, what):
        """(flat (N,) i32 device tensor, shape, array or None) of ids or targets."""
        shape, a = id_array(ids, what)
        t = ids.reshape(-1) if a is None else self.dev.tensor(a.reshape(-1).astype(np.int32), "i32")
        return t, shape, a

    def _long_rope(self, T, pos):
        return self.call_inv_freq(T - 1 if pos is None else int(pos.max())) is not None

    def _batch_of(self, B, T, positions, segments, seed, window, long_rope, rope_positions=None):
        """The Batch of a call whose rows' tensors exist (seed: an int or a (2,) i32 seed_offset
        tensor; None is eval; rope_positions: the rows' positions as one (T,) or (B, T) tensor)."""
        return Batch(B, T, positions, segments, seed, self.fused_attention, self.fused_segments, self.attn_block,
                     window, inv_freq=self._long_inv_freq if long_rope else None, fused_window=self.fused_window,
                     token_major=self.token_major, rope_positions=rope_positions, fused_sinks=self.fused_sinks)

    def _batch(self, shape, segments=None, positions=None, call_seed=None):
        """The Batch of one call. positions (B, T) replace arange(T) in the rotary embedding of
        each row; segments (B, T) restrict attention to keys of the query's own segment (packed
        samples); call_seed None is eval (no dropout)."""
        B, T = shape
        seg, pos, window = plan_rows(self.config, shape, segments, positions)
        d = self.dev
        every = d.tensor(np.arange(T, dtype=np.int32) if pos is None else pos, "i32")  # (T,) shared or (B, T)
        rows = [every] * B if pos is None else [every[b] for b in range(B)]
        segs = None if seg is None else [d.tensor(seg[b], "i32") for b in range(B)]
        return self._batch_of(B, T, rows, segs, call_seed, window, self._long_rope(T, pos), every)

    def call_inv_freq(self, max_position):
        """LongRoPE's long rotary frequencies (uploaded once) where max_position reaches them, else None."""
        switch = self.config.rope_switch_position
        if switch is None or max_position < switch:
            return None
        if self._long_inv_freq is None:
            self._long_inv_freq = self.dev.tensor(self.config.rope_inv_freq(max_position), "f32")
        return self._long_inv_freq

    # -- the stack -------------------------------------------------------------------------

    def _trunk_forward(self, ids_t, batch, keep):
        """Embeddings and decoder layers: the last hidden state x (N, C), xn = rmsnorm(x) and its
        rstd (N,), and per layer (input, LayerCache or None when checkpointed) if keep."""
        d, dt, c = self.dev, self.dtype, self.config
        N, C = batch.B * batch.T, c.hidden_size
        if self.router_stats:
            self.router_stats.begin()
        x = d.empty((N, C), dt)
        embed(ids_t, self.embed, x)
        if self.embed_scale is not None:
            ops.scale(x, self.embed_scale, x)
        saved = []
        for L in self.layers:
            out, cache = layer_forward(L, x, batch, need_cache=keep and not self.grad_checkpoint)
            if keep:
                saved.append((x, None if self.grad_checkpoint else cache))
            x, cache = out, None  # checkpointed: this layer's activations go now, not during the next layer
        xn, rstd = d.empty((N, C), dt), d.empty((N,), "f32")
        ops.rmsnorm_forward(x, self.norm_w, xn, rstd, c.rms_norm_eps)
        if self.router_stats:
            self.router_stats.loss()
        return x, xn, rstd, saved

    # -- loss and evaluation ---------------------------------------------------------------

    def _target_array(self, targets, shape):
        """(targets as a checked (B, T) array, the count that is not ignore_index)."""
        return target_array(targets, shape, self.dev, self.config.vocab_size)

    def _targets(self, targets, shape):
        ta, n_valid = self._target_array(targets, shape)
        tt = targets.reshape(-1) if isinstance(targets, _core.Tensor) else self.dev.tensor(
            ta.reshape(-1).astype(np.int32), "i32")
        return tt, n_valid

    def _run(self, fn):
        if self.dev.in_step:
            return fn()
        with self.dev.step():
            return fn()

    def _loss_sum(self, rows_loss, alpha=1.0):
        """(1,) f32 = alpha sum(rows_loss), as one gemm with a ones row (ignored rows hold 0)."""
        N = rows_loss.shape[0]
        out = self.dev.empty((1, 1), "f32")
        ops.gemm(self._ones(N).reshape(1, N), rows_loss.reshape(N, 1), out, alpha=alpha)
        return out.reshape(1)

    def prepare(self, ids, targets, loss_scale=1.0, segments=None, positions=None):
        """The host's half of a training call (checks, the valid-target count, the next dropout
        seed): a HostInputs for DeviceInputs and forward_backward_step. ids may be a (B, T) device
        tensor (then unchecked, HostInputs.ids None)."""
        shape, ia = id_array(ids, "ids")
        check_ids(ia, "ids", False, self.config.vocab_size)
        self.sums.reserve(shape[0], shape[1], self.dev)  # the sample order's slots, before any recording
        ta, n_valid = self._target_array(targets, shape)
        seg, pos, window = plan_rows(self.config, shape, segments, positions)
        self._call_seed += 1
        return HostInputs(shape[0], shape[1], None if ia is None else ia.reshape(-1).astype(np.int32),
                          ta.reshape(-1).astype(np.int32), pos, seg, n_valid, float(loss_scale) / max(n_valid, 1),
                          self._call_seed if self.lora_config.dropout > 0 else None, window,
                          self._long_rope(shape[1], pos), loss_scale=float(loss_scale))

    def forward_backward(self, ids, targets, loss_scale=1.0, segments=None, positions=None):
        """Forward and backward of the mean cross entropy; LoRA gradients accumulate into
        lora_params.grads, multiplied by `loss_scale` (dynamic loss scaling of f16 training).
        Returns a (1,) f32 device tensor holding the unscaled loss (read it after the step,
        e.g. with read_loss()). Packed rows pass segments and positions (B, T) (krnl.train.data.pack):
        attention stays within a segment and rotary positions are per token."""
        host = self.prepare(ids, targets, loss_scale, segments, positions)
        inputs = DeviceInputs.of(self.dev, host, ids.reshape(-1) if isinstance(ids, _core.Tensor) else None)
        return self._run(lambda: self.forward_backward_mean(host, inputs))

    def forward_backward_mean(self, host, inputs):
        """forward_backward for a HostInputs and its DeviceInputs, uploaded before any recording."""
        total = self.forward_backward_step(host.key(), inputs)
        self.sums.finish()  # the sample order's slots into the gradient (StepRunner: once a step)
        self._loss = self.dev.empty((1,), "f32")
        ops.scale(total, 1.0 / max(host.n_valid, 1), self._loss)
        return self._loss

    def forward_backward_step(self, key, inputs):
        """The device's half of forward_backward for the inputs of a HostInputs with this key():
        reads nothing on the host and takes every per-call number from `inputs`, so a recording
        of it replays for any batch of the same key. Returns the (1,) f32 sum of the token losses
        (the mean is that over HostInputs.n_valid)."""
        B, T, _, _, window, long_rope, _ = key
        S = self.sums.begin(B)  # the LoRA backward's sample count (0: sums over all rows at once)
        batch = self._batch_of(B, T, inputs.positions, inputs.segments, inputs.seed_offset, window, long_rope,
                               inputs.rope_positions)
        x, xn, rstd, saved = self._trunk_forward(inputs.ids, batch, keep=True)
        if self.router_stats:
            self.router_stats.backward(inputs.loss_scale)
        rows_loss, dxn = self._head_backward(xn, inputs.targets, inputs.ce_scale, B, T)
        ends, x, xn, rstd, dxn = [x, rstd, dxn], None, None, None, None  # the trunk's backward lets them go
        self._trunk_backward(batch, ends, saved)
        if self.end_grads:
            full.embed_grad(self, inputs.ids, self.d_embed_out)
        return self.sums.loss_sum(rows_loss) if S else self._loss_sum(rows_loss)

    def _head_backward(self, xn, targets, ce_scale, B, T):
        """(rows_loss (N,) f32, dxn (N, C)): each row's cross entropy and its gradient at xn, times
        ce_scale[0] ((1,) f32; None: 1)."""
        d, dt, c = self.dev, self.dtype, self.config
        N, C, V = B * T, c.hidden_size, c.vocab_size
        rows_loss = d.empty((N,), "f32")
        dxn = d.empty((N, C), dt)
        # One (chunk, V) logits buffer serves every chunk (their ops run in queue order): where a
        # released buffer waits for the step's end (Metal), chunks would each hold their own.
        chunk, spans = self.sums.row_chunks(B, T, self.ce_chunk)  # [(r0, r1)] of at most ce_chunk rows
        logits_buf = d.empty((chunk, V), dt)
        dl_buf = d.empty((chunk, V), dt) if self.final_softcap else logits_buf  # soft-capped logits are kept
        for r0, r1 in spans:
            logits, dl = logits_buf[0:r1 - r0], dl_buf[0:r1 - r0]
            linear(xn[r0:r1], self.head, logits)                          # logits = xn W^T
            gemma2.cap_logits(self.final_softcap, logits)
            ops.cross_entropy(logits, targets[r0:r1], rows_loss[r0:r1], dl, IGNORE_INDEX, 1.0, scale_by=ce_scale)
            gemma2.cap_logits_backward(self.final_softcap, logits, dl)
            linear_grad(dl, self.head, dxn[r0:r1])                        # dxn = dlogits W
            if self.end_grads:
                full.head_grad(self.end_grads, dl, xn[r0:r1])
        return rows_loss, dxn

    def _trunk_backward(self, batch, ends, saved):
        """The layers' backward from ends = [x, rstd, dxn] (dxn at the final norm's output; emptied, so
        each goes once read): LoRA gradients accumulate, d_embed_out is the embeddings' output gradient."""
        c, C = self.config, self.config.hidden_size
        cols = [0] + [L.mlp.grad_cols() for L in self.layers]  # [i]: what layer i-1's down fold writes beside dy
        (x, rstd, dxn), ends[:] = ends, []
        dx = self.dev.empty((dxn.shape[0], C + cols[-1]), self.dtype)
        ops.rmsnorm_backward(dxn, x, self.norm_w, rstd, dx[:, :C], dw=self.end_grads and self.end_grads.get("norm"))
        del x, rstd, dxn
        for i in reversed(range(c.num_hidden_layers)):
            L, (xin, cache) = self.layers[i], saved[i]
            if cache is None:                                             # checkpointed: recompute
                _, cache = layer_forward(L, xin, batch, need_y=False)
            dx = layer_backward(L, xin, cache, dx, batch, need_dx=i > 0 or self.input_grad, dx_cols=cols[i])
            saved[i] = None
        self.d_embed_out = dx if self.input_grad else None  # (a trained first norm's dx is not kept)

    def read_loss(self):
        """The loss of the last forward_backward, as a float (after its step is committed)."""
        if self._loss is None:
            raise ValueError("[LlamaModel] no forward_backward has run yet")
        return float(self._loss.numpy()[0])

    def _forward_logits_rows(self, ids_t, batch, fn):
        """fn(r0, r1, logits (r1 - r0, V)) per chunk of rows, forward only."""
        d, dt, c = self.dev, self.dtype, self.config
        N, V = batch.B * batch.T, c.vocab_size
        _, xn, _, _ = self._trunk_forward(ids_t, batch, keep=False)
        for r0 in range(0, N, self.ce_chunk):
            r1 = min(N, r0 + self.ce_chunk)
            logits = d.empty((r1 - r0, V), dt)
            linear(xn[r0:r1], self.head, logits)
            gemma2.cap_logits(self.final_softcap, logits)
            fn(r0, r1, logits)

    def loss(self, ids, targets, segments=None, positions=None):
        """Forward only (eval, no dropout): the mean cross entropy as a float."""
        ids_t, shape, ia = self._ids(ids, "ids")
        check_ids(ia, "ids", False, self.config.vocab_size)
        tt, n_valid = self._targets(targets, shape)
        batch = self._batch(shape, segments, positions)
        N = shape[0] * shape[1]
        rows_loss = self.dev.empty((N,), "f32")

        def body():
            self._forward_logits_rows(
                ids_t, batch, lambda r0, r1, lg: ops.cross_entropy(lg, tt[r0:r1], rows_loss[r0:r1], None, IGNORE_INDEX))
            return self._loss_sum(rows_loss, 1.0 / max(n_valid, 1))  # the mean (0 without valid targets)

        out = self._run(body)
        return out if self.dev.in_step else float(out.numpy()[0])

    def generate(self, prompt, max_new_tokens=32, temperature=0.0, top_p=1.0, seed=0, eos_id=None, top_k=0):
        """Samples up to max_new_tokens after `prompt` (a list of ids) with a KV cache: the prompt
        runs once through every layer, then each new token only attends to the cached keys and
        values. temperature 0 is greedy; otherwise softmax(logits / temperature) restricted to the
        smallest set of tokens whose probability reaches top_p. Returns the new ids."""
        with held(self.dora):
            return generate(self, prompt, max_new_tokens, temperature, top_p, seed, eos_id, top_k)

    def generate_batch(self, prompts, *args, **kwargs):
        """generate() of each prompt, decoded together (krnl.models.batch_decode.generate_batch)."""
        with held(self.dora):
            return generate_batch(self, prompts, *args, **kwargs)

    def logits(self, ids, segments=None, positions=None):
        """(B, T, V) float32 numpy logits (forward only, no dropout)."""
        ids_t, shape, ia = self._ids(ids, "ids")
        check_ids(ia, "ids", False, self.config.vocab_size)
        batch = self._batch(shape, segments, positions)
        N, V = shape[0] * shape[1], self.config.vocab_size
        out = self.dev.empty((N, V), self.dtype)                         # (N, V)
        self._run(lambda: self._forward_logits_rows(ids_t, batch, lambda r0, r1, lg: ops.cast(lg, out[r0:r1])))
        return np.asarray(out.numpy(), np.float32).reshape(shape[0], shape[1], V)

    def zero_grads(self):
        self.lora_params.zero_grads()

    def lora_state(self):
        """{PEFT key: float32 array} of the LoRA masters."""
        return self.lora_params.state()

    def lora_grads(self):
        """{PEFT key: float32 array copy} of the accumulated LoRA gradients (after the step)."""
        return {k: np.array(v.numpy(), np.float32, copy=True) for k, v in self._lora_grads().items()}

    def _lora_grads(self):
        """{PEFT key: f32 device view} of the accumulated LoRA gradients."""
        return {k: self.lora_params.grad(k) for k in self.lora_params.shapes}
