"""The device allocations of a micro-batch of a sequence objective (--train-mode dpo, orpo, simpo and
grpo), replayed from the shapes alone for krnl.train.memory: what Pairwise.step and GRPO.run make
(train/preference.py, train/grpo.py, models/sequence_loss.py, models/batch_decode.py), in their order,
with memory_step.Replay's forward and backward.

A micro-batch of P pairs is 2P rows; one of GRPO holds its prompts' G completions each. Before the
training call: GRPO's generation (its KV caches, released before the step and then held by the
pool for the next one) and, for DPO and GRPO with --beta > 0, the reference's forward with the
adapter off. The training call is two device steps with the rows' losses read between; the
second scales the head's gradient into a new buffer before the layers' backward.
A decoding step's layers are replayed as a training forward's of its tokens, with the scores its
attention makes."""

from .memory_resident import LOSS, SMALL, WORK

GENERATION = "generation"  # memory.PARTS' name of GRPO's KV caches


def micro_batch(rp):
    """One micro-batch of rp.run.objective against rp (a memory_step.Replay)."""
    if rp.run.completion:
        generation(rp)
    if rp.run.reference:
        reference(rp)
    inputs = rp.inputs()
    rp.t.begin_step()                                                     # forward, rows' losses, head's gradient
    x, xn, rstd, saved = rp.trunk_forward()
    rows_loss, dxn = rp.head_backward()
    rp.t.end_step()
    rp.t.begin_step()
    N = rp.N
    scaled = rp.act((N, rp.C), WORK)                                      # dxn row by row times dL/d(row loss)
    rp.t.free(rp.new((N, 1), "i32", SMALL), rp.new((N, 1), "f32", SMALL))
    rp.trunk_backward(saved)
    rp.t.end_step()
    rp.t.free(scaled, x, xn, rstd, rows_loss, dxn, *inputs)


def reference(rp):
    """adapter_off's copy of the LoRA compute copy, then row_losses: a forward without saved
    activations and the loss's logits chunk by chunk."""
    N, V, T = rp.N, rp.V, rp.T
    keep = rp.act((max(rp.numel, 1),), WORK)
    inputs = [rp.new((N,), "i32", SMALL), rp.new((N,), "i32", SMALL), rp.new((T,), "i32", SMALL)]  # ids, targets, every
    rows = rp.new((N,), "f32", LOSS)
    rp.t.begin_step()
    x, xn, rstd, _ = rp.trunk_forward(keep=False)
    rp.t.free(x, rstd)
    logits = None
    for r0 in range(0, N, rp.chunk):
        new = rp.act((min(N, r0 + rp.chunk) - r0, V), LOSS)
        rp.t.free(logits)
        logits = new
    rp.t.free(logits, xn)
    rp.t.end_step()
    rp.t.free(rows, *inputs, keep)


def generation(rp):
    """generate_batch of the micro-batch's prompts, G completions each: per prompt its KV cache,
    the prompt's forward, then a GroupCache of its G sequences; then the decoding steps."""
    L, H, Hk, D, T, G, dt = rp.L, rp.H, rp.Hk, rp.D, rp.T, rp.run.rows_per_item, rp.dt
    P, n = max(T - rp.run.completion, 1), rp.N // T                      # a prompt's tokens, the rows
    groups, pc = [], []
    for _ in range(rp.B // G):                                            # this rank's prompts
        new = [rp.new((P, D), dt, GENERATION) for _ in range(2 * L * Hk)]  # KVCache
        rp.t.free(*pc)
        pc = new
        # decode(prompt): KVCache.attention's scores, one KV head's query heads at a time
        tokens(rp, P, 1, lambda: rp.t.free(rp.new((H // Hk, P, P), dt, GENERATION)))
        groups += [rp.new((G * Hk, T, D), dt, GENERATION) for _ in range(2 * L)]  # GroupCache k, v
        groups.append(rp.new((1, 1), dt, SMALL))                          # its one; its ones (G, 1) a moment
        rp.t.free(rp.new((G, 1), dt, SMALL))
    fixed = []
    if rp.run.device.graphs:  # batch_decode.FixedDecoder: its inputs and logits, then every step at T
        windows = len(set(rp.c.layer_windows or [0]))
        fixed = [rp.new((2 * n,), "i32", SMALL), rp.new(((1 + windows) * T * (rp.B // G),), dt, SMALL),
                 rp.new((G * H, 1), dt, SMALL), rp.new((n, rp.V), "f32" if dt == "f32" else dt, GENERATION)]
    for end in range(P + 1, T):                                           # a token of every row
        def attend():  # the rows token-major, then each group's scores (G Hk, g, end)
            heads = [rp.new((n, h, D), dt, GENERATION) for h in (H, Hk, Hk, H)]
            for _ in range(rp.B // G):
                rp.t.free(rp.new((G * Hk, H // Hk, T if fixed else end), dt, GENERATION))
            rp.t.free(*heads)
        tokens(rp, n, n, attend, fixed=bool(fixed))
        if fixed:  # the first step runs as the recording's warm-up, the rest replay it: no new buffers
            break
    rp.t.free(*groups, *pc, *fixed)


def tokens(rp, n, m, attend, fixed=False):
    """run_tokens of n tokens, m rows of logits: each layer's buffers as a training forward's of n
    tokens in one row with its attention fused (attend() the scores the decoding makes instead);
    fixed: FixedDecoder's step, whose inputs and logits are made before."""
    keep = rp.B, rp.T, rp.N, rp.fused, rp.token_major
    rp.B, rp.T, rp.N, rp.fused, rp.token_major, rp.recording = 1, n, n, True, False, False
    rp.t.begin_step()
    inputs = [] if fixed else [rp.new((n,), "i32", SMALL), rp.new((n,), "i32", SMALL)]  # ids, positions
    x, cache = rp.act((n, rp.C), GENERATION), []
    for i in range(rp.L):  # `x, _ = layer_forward(...)`: a layer's cache goes once the next one's is made
        y, new = rp.layer_forward(i, x)
        attend()
        rp.t.free(x, *cache)
        x, cache = y, new
    out = [rp.act((m, rp.C), GENERATION), rp.new((m,), "f32", GENERATION)]  # xn, rstd
    if not fixed:
        out.append(rp.new((m, rp.V), "f32" if rp.dt == "f32" else rp.dt, GENERATION))
    rp.t.free(x, *cache, *out, *inputs)
    rp.t.end_step()
    rp.B, rp.T, rp.N, rp.fused, rp.token_major = keep
    rp.recording = True
