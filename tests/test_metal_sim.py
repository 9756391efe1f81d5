"""The Metal backend end to end on the metal-sim device: the dispatch
records of csrc/metal's op files, submitted as command buffers by csrc/metal/submission.cpp (the code
device.mm runs) and executed by tools/mslsim on a worker thread. The op suite (test_ops.py,
test_gemm.py) also runs here; this file checks what only a whole device shows: the tiny-model LoRA
training step against the CPU backend, step semantics, the pool's completion gating, split-K
routing, the CPU/GPU row split, and the ordering rules of an asynchronous step. Completion lags
behind commit deterministically (by default a command buffer runs only once waited for), and each
ordering rule is shown to be what its test needs: switched off (a test-only switch), it fails."""
import contextlib
import time

import numpy as np
import pytest

import krnl
from krnl import ops

from conftest import (METAL_SIM, U32, UNIT_ROUNDOFF, assert_step_close, check_step_against_cpu,
                      check_training_reduces_loss, dispatch_budget, lora_step, metal_sim_as, read, tiny_lora_model,
                      upload)

pytestmark = pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")


@pytest.fixture(scope="module")
def sim():
    return krnl.device("metal-sim")


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_training_step_matches_cpu(sim, dtype):
    """One forward/backward of the tiny Llama (GQA, RoPE, causal attention, SwiGLU, tied head) on
    metal-sim against the CPU backend in f32. f32 differs only by summation order (a few f32 ulps
    through two layers); f16 compute rounds every activation to 11 bits, bf16 (metal-sim standing
    for a GPU with native bf16) to 8 bits: its worst gradient was 5.5% of the largest (the CPU
    backend computing in bf16 errs the same), so 4 x 3% leaves a 2x margin."""
    check_step_against_cpu(sim, dtype, {"f32": 1e-5, "f16": 2e-2, "bf16": 3e-2}[dtype])


def test_rmsnorm_strided_records(sim, monkeypatch):
    """The row-strided forms' dispatch records (norm.cpp): y's and dx's bindings span exactly their
    rows at the wider stride; float4 accesses only where cols, the row stride and both offsets are
    multiples of 4; the backward's residual bound at buffer(6) and added in its one dispatch."""
    import struct

    records = []
    run = METAL_SIM.run
    monkeypatch.setattr(METAL_SIM, "run", lambda r: records.append(r) or run(r))
    rows, C = 3, 128
    x, w, dy = (sim.tensor(np.ones(s, np.float32), "f16") for s in ((rows, C), (C,), (rows, C)))
    rstd = sim.empty((rows,), "f32")
    wide = sim.empty((rows, 136), "f16")
    for y, ld, vec4 in ((wide[:, :C], 136, 1), (wide[:, 4:4 + C], 136, 1), (wide[:, 1:1 + C], 136, 0),
                        (sim.empty((rows, C + 2), "f16")[:, :C], C + 2, 0), (sim.empty((rows, C), "f16"), C, 1)):
        records.clear()
        ops.rmsnorm_forward(x, w, y, rstd, eps=1e-5)
        sim.synchronize()
        (r,) = records
        assert struct.unpack("<IIfII", bytes(r["args"]))[3:] == (ld, vec4), (ld, vec4)
        assert {b[0]: b[2] for b in r["buffers"]}[2] == ((rows - 1) * ld + C) * 2
    res_wide = sim.empty((rows, C + 5), "f16")
    records.clear()
    ops.rmsnorm_backward(dy, x, w, rstd, wide[:, :C], residual=res_wide[:, :C])
    sim.synchronize()
    (r,) = records  # no axpy after it
    assert struct.unpack("<IIIII", bytes(r["args"]))[2:] == (136, C + 5, 1)
    extents = {b[0]: b[2] for b in r["buffers"]}
    assert (extents[4], extents[6]) == (((rows - 1) * 136 + C) * 2, ((rows - 1) * (C + 5) + C) * 2)


# fold against no fold: the same sums in another order, and in f16/bf16 s B rounded once into S
# where the unfolded path rounds the rank-r product's y before the frozen GEMM adds to it. Measured
# worst (loss, gradient / its largest value): f32 0, 1.7e-6; f16 3.7e-5, 3.4e-3; bf16 4.6e-4, 4.3e-2
# (bf16's own noise: the unfolded path is 5.5% off the CPU's f32, as above).
FOLD_TOL = {"f32": (1e-6, 1e-5), "f16": (2e-4, 1e-2), "bf16": (2e-3, 1e-1)}


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_lora_fold_matches_unfolded(sim, dtype, monkeypatch):
    """metal-sim's capabilities fold (the RMSNorm writing at a row stride, its backward taking the
    wider gradients): q|k|v and gate/up folded, o and down folding their backward. One step's loss
    and LoRA gradients with the fold equal those with KRNL_LORA_FOLD=0 (tolerance by dtype); the
    folded step, the default, is checked against the CPU by test_training_step_matches_cpu."""
    assert sim.capabilities()["lora_fold"]
    rng = np.random.default_rng(7)
    ids, targets = rng.integers(0, 61, (2, 9)), rng.integers(0, 61, (2, 9))
    res = {}
    for fold in ("0", None):
        if fold is None:
            monkeypatch.delenv("KRNL_LORA_FOLD", raising=False)
        else:
            monkeypatch.setenv("KRNL_LORA_FOLD", fold)
        m = tiny_lora_model(sim, dtype)
        on = fold is None
        assert all((L.qkv_fold is not None) == on and (L.mlp.fold is not None) == on
                   and (L.o_proj.grad_cols() > 0) == on and (L.mlp.down.grad_cols() > 0) == on for L in m.layers)
        res[fold] = lora_step(m, ids, targets)
    assert_step_close(res["0"], res[None], *FOLD_TOL[dtype])


def test_training_reduces_loss_on_metal_sim(sim):
    check_training_reduces_loss(sim, "f32", grad_checkpoint=True)


def test_training_step_takes_the_fused_attention(sim):
    """The tiny model's head size (8) has Metal attention kernels, so its step (the one checked
    against the CPU above) runs through them instead of the materialised scores."""
    m = tiny_lora_model(sim, "f16")
    assert m.fused_attention
    rng = np.random.default_rng(7)
    lora_step(m, rng.integers(0, 61, (2, 9)), rng.integers(0, 61, (2, 9)))
    kernels = {r["kernel"] for r in krnl._core.testing.metal_sim_last_step()}
    assert {"attention_forward_d8_f16", "attention_backward_delta_f16", "attention_backward_dq_d8_f16",
            "attention_backward_dkv_d8_f16"} <= kernels, sorted(kernels)
    assert not any(k.startswith("softmax") for k in kernels)


def test_attention_head_sizes(sim):
    """The fused op runs in every dtype of the device, with every mask, at the head sizes
    metal/attention.metal instantiates; another size raises NotImplementedError naming the op and
    the sizes there are."""
    caps = sim.capabilities()
    assert caps["fused_attention"] == {"dtypes": caps["dtypes"], "segments": True, "window": True, "sinks": True,
                                       "head_dims": [4, 8, 16, 32, 64, 80, 96, 128, 256], "token_major": False,
                                       "workspace": [0, 0]}
    assert {"f32", "f16"} <= set(caps["dtypes"])
    q, lse = sim.zeros((2, 3, 24), "f32"), sim.empty((2, 3), "f32")
    sizes = r"\(Metal kernels for D in 4, 8, 16, 32, 64, 80, 96, 128, 256\)"
    with pytest.raises(NotImplementedError, match=r"\[attention_forward\] head size D = 24 not implemented on "
                                                  r"metal-sim " + sizes):
        ops.attention_forward(q, q, q, sim.empty((2, 3, 24)), lse, 0.5)
    with pytest.raises(NotImplementedError, match=r"\[attention_backward\] head size D = 24 .* " + sizes):
        ops.attention_backward(q, q, q, q, q, lse, sim.empty((2, 3, 24)), sim.empty((2, 3, 24)),
                               sim.empty((2, 3, 24)), 0.5)


def test_nothing_runs_before_commit(sim):
    """Like a command buffer: nothing of a step runs before commit (reading a tensor inside the step
    is refused), completion lags behind commit (here: until a wait), and the step's records are its
    ops in order."""
    x = sim.tensor(np.arange(8, dtype=np.float32))
    y = sim.zeros((8,), "f32")
    sim.synchronize()
    before = METAL_SIM.dispatches
    with sim.step():
        ops.scale(x, 2.0, y)
        ops.add(y, x, y)
        assert METAL_SIM.dispatches == before  # encoded, not run
        with pytest.raises(RuntimeError, match="step is open"):
            y.numpy()
    assert METAL_SIM.dispatches == before and sim.completed_seq < sim.last_committed  # committed, not run
    sim.synchronize()
    assert METAL_SIM.dispatches == before + 2 and sim.completed_seq == sim.last_committed
    np.testing.assert_array_equal(np.array(y.numpy()), 3 * np.arange(8))
    recs = krnl._core.testing.metal_sim_last_step()
    assert [r["kernel"] for r in recs] == ["scale_f32", "add_f32"]


def test_pool_reuses_a_buffer_of_the_committed_step_in_call_order(sim):
    """A buffer released after its step was committed serves the next request at once (the queue
    runs the step first), and a host write into it waits for the step that still reads it, so the
    step computes from the old contents. It is not given back to the system before that step ran."""
    sim.synchronize()
    sim.trim()
    x = sim.tensor(np.arange(4096, dtype=np.float32))
    y = sim.empty((4096,), "f32")
    with sim.step():
        a = sim.empty((4096,), "f32")
        ops.scale(x, 3.0, a)
        ops.scale(a, 2.0, y)
    a_id = a.buffer_id
    del a  # its buffer is still read by the committed, not yet run, step
    assert sim.completed_seq < sim.last_committed and sim.pool_stats()["pending"] == 0
    reserved = sim.pool_stats()["reserved"]
    sim.trim()  # the step may still use it: kept
    assert sim.pool_stats()["reserved"] == reserved
    c = sim.tensor(np.full(4096, -1.0, np.float32))
    assert c.buffer_id == a_id
    sim.synchronize()
    np.testing.assert_array_equal(np.array(y.numpy()), 6 * np.arange(4096))
    np.testing.assert_array_equal(np.array(c.numpy()), -1.0)


def test_pool_reuses_buffers_inside_the_step(sim):
    """A buffer freed inside an open step serves the step's next request: its kernels run in call
    order, so the new tensor's writes come after the old one's reads."""
    keep = sim.empty((4096,), "f32")
    ops.fill(keep, 3.0)
    with sim.step():
        a = sim.empty((4096,), "f32")
        ops.fill(a, 1.0)
        out = sim.empty((4096,), "f32")
        ops.add(a, keep, out)
        a_id = a.buffer_id
        del a
        assert sim.pool_stats()["pending"] == 0
        b = sim.empty((4096,), "f32")  # a's buffer: a's fill and add run before b's fill
        assert b.buffer_id == a_id
        ops.fill(b, 2.0)
        ops.add(b, keep, b)
    sim.synchronize()
    np.testing.assert_array_equal(np.array(b.numpy()), 5.0)
    np.testing.assert_array_equal(np.array(out.numpy()), 4.0)
    assert sim.pool_stats()["pending"] == 0


def test_gemm_tt_identity_waits_for_the_buffer_it_reuses(sim):
    """The tt GEMM writes an identity from the host into a buffer of the pool, which may be one the
    step's encoded records still read: the write waits for them (upload), so they see the old
    contents and the product is right."""
    K, M, N = 40, 8, 6
    rng = np.random.default_rng(5)
    a_np, A_np, B_np = (rng.standard_normal(s).astype(np.float32) for s in ((K, K), (K, M), (N, K)))
    a, A, B = sim.tensor(a_np), sim.tensor(A_np), sim.tensor(B_np)
    sim.synchronize()
    with sim.step():
        out = sim.empty((K, K), "f32")
        ops.scale(a, 2.0, out)  # encoded, not yet run (completion lags behind commit)
        del a                   # cached for reuse at once: the identity's request takes it
        C = sim.empty((M, N), "f32")
        ops.gemm(A, B, C, trans_a=True, trans_b=True)
    sim.synchronize()
    recs = [r["kernel"] for r in krnl._core.testing.metal_sim_last_step()]
    assert any("gemm" in k for k in recs)
    np.testing.assert_array_equal(np.array(out.numpy()), 2 * a_np)
    np.testing.assert_allclose(np.array(C.numpy()), A_np.T @ B_np.T, rtol=1e-5, atol=1e-5)


def test_split_k_records_and_result(sim):
    """The LoRA-shaped GEMM (T, R) = (T, F)(F, R) takes the split-K path on metal-sim: partials
    then a reduce, equal to the plain path within fp32 summation-order error."""
    rng = np.random.default_rng(11)
    T, F, R = 64, 1024, 32
    (A, a), (B, b) = upload(sim, rng.standard_normal((T, F))), upload(sim, rng.standard_normal((R, F)))
    plan = ops.gemm_plan(A, B, sim.empty((T, R), "f32"), trans_b=True)
    assert plan[0] > 1, plan
    C = sim.empty((T, R), "f32")
    ops.gemm(A, B, C, trans_b=True)
    kernels = [r["kernel"] for r in krnl._core.testing.metal_sim_last_step()]
    assert kernels == ["gemm_splitk_nt_f32", "gemm_reduce_f32"], kernels
    P = sim.empty((T, R), "f32")
    ops.gemm(A, B, P, trans_b=True, split_k=1)
    assert [r["kernel"] for r in krnl._core.testing.metal_sim_last_step()] == ["gemm_nt_f32"]
    ref = a @ b.T
    bound = 2 * F * U32 * float(np.max(np.abs(a)) * np.max(np.abs(b))) * 4
    assert float(np.max(np.abs(read(C) - ref))) <= bound
    assert float(np.max(np.abs(read(C) - read(P)))) <= bound


@pytest.mark.parametrize("form", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_gemm_over_the_dispatch_budget_runs_in_blocks(sim, form, dtype):
    """A GEMM estimated over the per-dispatch budget (the GPU watchdog: policy.h) runs as blocks of
    whole 32x32 tiles, rows first, each its own dispatch within the budget, bound at its offsets.
    The blocks tile C exactly once, and the result is the one-dispatch result bit for bit: every
    block sums k in the same order. Batched, with beta, at sizes off the tile."""
    rng = np.random.default_rng(5)
    M, N, K, batch = 70, 97, 45, 2
    ta, tb = form[0] == "t", form[1] == "t"
    (A, _), (B, _) = (upload(sim, rng.standard_normal(s), dtype)
                      for s in (((batch, K, M) if ta else (batch, M, K)), ((batch, N, K) if tb else (batch, K, N))))
    C0, _ = upload(sim, rng.standard_normal((batch, M, N)), dtype)
    whole, split = sim.empty((batch, M, N), dtype), sim.empty((batch, M, N), dtype)
    for out in (whole, split):
        ops.cast(C0, out)
    sim.synchronize()
    ops.gemm(A, B, whole, trans_a=ta, trans_b=tb, beta=0.5, batch=batch, split_k=1)
    one = [r for r in krnl._core.testing.metal_sim_last_step() if r["kernel"].startswith("gemm_")]
    budget = 0.4 * krnl._core.testing.metal_estimate_ms(dict(apple_family=9), one[-1]["flops"], one[-1]["bytes"], "gemm")
    with dispatch_budget(sim, budget):
        ops.gemm(A, B, split, trans_a=ta, trans_b=tb, beta=0.5, batch=batch, split_k=1)
        recs = [r for r in krnl._core.testing.metal_sim_last_step() if r["kernel"] == one[-1]["kernel"]]
    assert len(recs) > 1 and all(r["rate"] == "gemm" for r in recs)
    covered = np.zeros((M, N), np.int32)
    es = 4 if dtype == "f32" else 2
    c_base = {i: off for i, _, _, _, off in one[-1]["buffers"]}[2]
    for r in recs:
        assert krnl._core.testing.metal_estimate_ms(dict(apple_family=9), r["flops"], r["bytes"], "gemm") <= budget
        g = np.frombuffer(r["args"], np.uint32)  # GemmArgs: M, N, K first
        rows, cols = int(g[0]), int(g[1])
        off = ({i: o for i, _, _, _, o in r["buffers"]}[2] - c_base) // es
        r0, c0 = divmod(off, N)
        assert r0 % 32 == 0 and c0 % 32 == 0 and r["grid"][2] == batch
        covered[r0:r0 + rows, c0:c0 + cols] += 1
    assert (covered == 1).all()
    np.testing.assert_array_equal(read(split), read(whole))


@pytest.mark.parametrize("window,segments", [(0, False), (24, True)], ids=["causal", "window-segments"])
def test_attention_over_the_dispatch_budget_runs_in_parts(sim, window, segments):
    """Fused attention whose kernels are estimated over the per-dispatch budget runs as parts of
    each kernel's grid (one head at a time, consecutive ranges of row blocks; args.head0/block0
    place them), every part within the budget, together covering the grid once; o, lse, dq, dk
    and dv equal the one-dispatch results bit for bit (each threadgroup computes what it did)."""
    rng = np.random.default_rng(9)
    Hq, Hk, T, D = 4, 2, 70, 16
    (q, _), (k, _), (v, _), (do, _) = (upload(sim, rng.standard_normal(s), "f16")
                                       for s in ((Hq, T, D), (Hk, T, D), (Hk, T, D), (Hq, T, D)))
    seg = krnl.device("cpu").tensor(np.repeat(np.arange(3), [20, 31, 19]).astype(np.int32), "i32") if segments else None
    seg = sim.tensor(seg.numpy(), "i32") if segments else None

    def run():
        o, lse = sim.empty((Hq, T, D), "f16"), sim.empty((Hq, T), "f32")
        ops.attention_forward(q, k, v, o, lse, 0.25, seg, window)
        fwd = krnl._core.testing.metal_sim_last_step()
        grads = [sim.empty(s, "f16") for s in ((Hq, T, D), (Hk, T, D), (Hk, T, D))]
        ops.attention_backward(q, k, v, o, do, lse, *grads, 0.25, seg, window)
        bwd = krnl._core.testing.metal_sim_last_step()
        return [read(t) for t in (o, lse, *grads)], fwd + bwd

    whole, recs = run()
    assert len(recs) == 4  # forward; delta, dq, dkv
    one_head = krnl._core.testing.metal_plan_attention(dict(apple_family=9), "forward", 1, 1, T, D, window)[0]["ms"]
    with dispatch_budget(sim, 0.7 * one_head):
        split, recs = run()
    for kernel, heads in (("attention_forward", Hq), ("attention_backward_dq", Hq), ("attention_backward_dkv", Hk)):
        parts = [r for r in recs if r["kernel"].startswith(kernel)]
        assert len(parts) > heads, kernel
        cover = {}
        for r in parts:
            assert r["rate"] == "attention"
            # within the budget, or a single tile (nothing smaller can be dispatched)
            ms = krnl._core.testing.metal_estimate_ms(dict(apple_family=9), r["flops"], r["bytes"], "attention")
            assert ms <= 0.7 * one_head or r["grid"][:2] == (1, 1), (kernel, ms, r["grid"])
            a = np.frombuffer(r["args"], np.uint32)  # AttentionArgs: ..., scale, head0, block0
            head0, block0 = int(a[7]), int(a[8])
            for h in range(head0, head0 + r["grid"][1]):
                for b in range(block0, block0 + r["grid"][0]):
                    cover[(h, b)] = cover.get((h, b), 0) + 1
        assert set(cover.values()) == {1} and {h for h, _ in cover} == set(range(heads)), kernel
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), split, whole):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_head_batching_by_offset(sim):
    """A batched GEMM over heads is one dispatch with grid.z = heads and the operands bound at
    their view offsets, never copied."""
    rng = np.random.default_rng(12)
    H, T, D = 3, 33, 8
    Q, q = upload(sim, rng.standard_normal((H + 1, T, D)))
    K, k = upload(sim, rng.standard_normal((H, T, D)))
    S = sim.empty((H, T, T), "f32")
    ops.gemm(Q[1:], K, S, trans_b=True, batch=H)
    (rec,) = krnl._core.testing.metal_sim_last_step()
    assert rec["kernel"] == "gemm_nt_f32" and rec["grid"][2] == H
    offsets = {i: off for i, _, _, _, off in rec["buffers"]}
    assert offsets[0] == T * D * 4  # Q[1:] bound at its offset
    np.testing.assert_allclose(read(S), q[1:] @ k.transpose(0, 2, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dt,cdt", [("f32", "f32"), ("f16", "f16"), ("f16", "f32"), ("bf16", "bf16"), ("bf16", "f32")])
@pytest.mark.parametrize("M", [33, 256])
def test_row_split_gemm_equals_gpu_gemm(sim, M, dt, cdt):
    """With the row split on, the CPU's BLAS computes the first rows (sized by the core's planner;
    fp32 twins of f16 operands) while the simulated GPU computes the rest; the result equals the
    pure-GPU GEMM."""
    rng = np.random.default_rng(13)
    N, K = 96, 128
    (A, a), (B, b) = (upload(sim, rng.standard_normal(s), dt) for s in ((M, K), (N, K)))
    C0, c0 = upload(sim, rng.standard_normal((M, N)), cdt)
    ref = sim.empty((M, N), cdt)
    ops.cast(C0, ref)
    ops.gemm(A, B, ref, trans_b=True, alpha=0.5, beta=0.25, split_k=1)
    gpu = read(ref)
    krnl._core.testing.set_row_split(sim, True, cpu_gflops=100.0, gpu_gflops=300.0, overhead_ms=0.0, min_flops=0)
    try:
        C = sim.empty((M, N), cdt)
        ops.cast(C0, C)
        ops.gemm(A, B, C, trans_b=True, alpha=0.5, beta=0.25, split_k=1)
        recs = krnl._core.testing.metal_sim_last_step()
    finally:
        krnl._core.testing.set_row_split(sim, False)
    plan = krnl._core.testing.plan_row_split(M, 1.0 / 100, 1.0 / 300, 0.0, 32)
    if plan["cpu_rows"] == 0:
        assert [r["host"] for r in recs] == [False]
    else:
        assert [r["host"] for r in recs] == [False, True]
        assert recs[0]["grid"][1] == -(-(M - plan["cpu_rows"]) // 32)
    got = read(C)
    ref64 = 0.5 * a @ b.T + 0.25 * c0
    # fp32 accumulation over K, plus one rounding of the output when C is f16
    bound = 2 * K * U32 * float(np.max(np.abs(a)) * np.max(np.abs(b))) * 4
    bound += UNIT_ROUNDOFF[cdt] * float(np.max(np.abs(ref64))) * 2
    assert float(np.max(np.abs(got - ref64))) <= bound
    assert float(np.max(np.abs(got - gpu))) <= 2 * bound


def test_bf16_is_refused_by_name(sim):
    with metal_sim_as(7):  # an M1: bf16 only emulated (test_metal_policy.py covers every op family)
        x = sim.empty((4,), "bf16")
        with pytest.raises(NotImplementedError, match=r"\[fill\] bf16 not implemented on metal-sim: this GPU emulates"):
            ops.fill(x, 1.0)


# ---- the ordering rules of an asynchronous step (csrc/metal/submission.cpp)

@contextlib.contextmanager
def rules_off(sim, **off):
    """Switches ordering rules off for the block (tests only), then back on."""
    sim.synchronize()
    krnl._core.testing.metal_set_ordering_rules(sim, **{k: False for k in off})
    try:
        yield
    finally:
        sim.synchronize()
        krnl._core.testing.metal_set_ordering_rules(sim)


@contextlib.contextmanager
def command_buffers(sim, max_dispatches, max_ms=1e9):
    old = krnl._core.testing.metal_command_buffer_policy(sim)
    krnl._core.testing.metal_set_command_buffer_policy(sim, max_dispatches, max_ms)
    try:
        yield
    finally:
        krnl._core.testing.metal_set_command_buffer_policy(sim, old["max_dispatches"], old["max_ms"])


@contextlib.contextmanager
def lag(mode, max_ms=0.0, seed=0):
    krnl._core.testing.metal_sim_set_lag(mode, max_ms, seed)
    try:
        yield
    finally:
        krnl._core.testing.metal_sim_set_lag("wait")


@contextlib.contextmanager
def row_split(sim, cpu_gflops=100.0, gpu_gflops=300.0):
    krnl._core.testing.set_row_split(sim, True, cpu_gflops=cpu_gflops, gpu_gflops=gpu_gflops, overhead_ms=0.0,
                                     min_flops=0)
    try:
        yield
    finally:
        krnl._core.testing.set_row_split(sim, False)


def _row_split_after_producer(sim, factor):
    """A row-split GEMM whose A and C come from kernels earlier in the same step: the host part
    must read what those kernels wrote (`factor` makes them differ from any earlier call's, so
    stale memory cannot pass for them). Returns (C, reference)."""
    rng = np.random.default_rng(21)
    M, N, K = 96, 64, 128
    (A0, a0), (B, b), (C0, c0) = (upload(sim, rng.standard_normal(s)) for s in ((M, K), (N, K), (M, N)))
    A, C = sim.empty((M, K), "f32"), sim.empty((M, N), "f32")
    sim.synchronize()
    with row_split(sim), sim.step():
        ops.scale(A0, factor, A)
        ops.scale(C0, factor, C)
        ops.gemm(A, B, C, trans_b=True, beta=0.5, split_k=1)
    sim.synchronize()
    return read(C), factor * (a0 @ b.T + 0.5 * c0)


def test_host_record_waits_for_earlier_records(sim):
    """Defect 4: the CPU half of a row-split GEMM starts only once the kernels before it (which
    produce A, and C for beta != 0) have completed; its own GPU half is a separate command buffer
    that runs alongside it. Without the rule the host reads A and C before they are written."""
    got, ref = _row_split_after_producer(sim, 2.0)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    step = krnl._core.testing.metal_last_step(sim)
    assert [r["host"] for r in step["records"]] == [False, False, False, True]
    assert step["command_buffers"] == [2, 1]  # the producers, then the GPU half alone
    with rules_off(sim, host_after_earlier=True):
        got_off, ref = _row_split_after_producer(sim, 3.0)
    cpu_rows = krnl._core.testing.plan_row_split(96, 1.0 / 100, 1.0 / 300, 0.0, 32)["cpu_rows"]
    assert cpu_rows > 0
    assert not np.allclose(got_off[:cpu_rows], ref[:cpu_rows], rtol=1e-4, atol=1e-4)


def _upload_inside_step(sim):
    x = sim.tensor(np.ones(64, np.float32))
    y, z = sim.empty((64,), "f32"), sim.empty((64,), "f32")
    with sim.step():
        ops.scale(x, 2.0, y)  # encoded before the upload: reads the old x
        sim.upload(x, np.full(64, 5.0, np.float32))
        ops.add(x, y, z)      # encoded after it: reads the new x
    sim.synchronize()
    return read(y), read(z)


def _upload_after_commit(sim):
    x = sim.tensor(np.ones(64, np.float32))
    y = sim.empty((64,), "f32")
    with sim.step():
        ops.scale(x, 2.0, y)
    sim.upload(x, np.full(64, 5.0, np.float32))  # the step is committed, not yet run
    sim.synchronize()
    return read(y), read(x)


def test_upload_in_call_order(sim):
    """Defect 6: a host write lands in call order relative to the step's records, encoded or
    committed: work recorded before it sees the old contents, work after it the new ones."""
    y, z = _upload_inside_step(sim)
    np.testing.assert_array_equal(y, 2.0)
    np.testing.assert_array_equal(z, 7.0)
    y, x = _upload_after_commit(sim)
    np.testing.assert_array_equal(y, 2.0)
    np.testing.assert_array_equal(x, 5.0)
    with rules_off(sim, upload_in_order=True):
        assert not np.array_equal(_upload_inside_step(sim)[0], np.full(64, 2.0))
        assert not np.array_equal(_upload_after_commit(sim)[0], np.full(64, 2.0))


def test_upload_into_fresh_buffer_does_not_wait(sim):
    """A buffer no unfinished work binds is written at once: Device.tensor inside a step neither
    flushes nor waits (the step still runs as one command buffer, only when waited for)."""
    x = sim.tensor(np.ones(64, np.float32))
    y = sim.empty((64,), "f32")
    sim.synchronize()
    before = METAL_SIM.dispatches
    with sim.step():
        ops.scale(x, 2.0, y)
        w = sim.tensor(np.full(64, 3.0, np.float32))
        ops.add(y, w, y)
        assert METAL_SIM.dispatches == before
    assert krnl._core.testing.metal_last_step(sim)["command_buffers"] == [2]
    sim.synchronize()
    np.testing.assert_array_equal(read(y), 5.0)


def _eight_scales(sim):
    x = sim.tensor(np.ones(256, np.float32))
    ys = [sim.empty((256,), "f32") for _ in range(8)]
    with sim.step():
        for i, y in enumerate(ys):
            ops.scale(x if i == 0 else ys[i - 1], 2.0, y)
    sim.synchronize()
    return read(ys[-1]), krnl._core.testing.metal_last_step(sim)["command_buffers"]


def test_step_split_into_command_buffers(sim):
    """Defect 5: a step is cut into command buffers by dispatch count (and estimated work), each
    depending on the last, with one result; without the cut it is one command buffer."""
    with command_buffers(sim, 3):
        out, cbs = _eight_scales(sim)
        np.testing.assert_array_equal(out, 256.0)
        assert cbs == [3, 3, 2]
        with rules_off(sim, split_steps=True):
            assert _eight_scales(sim)[1] == [8]
    with command_buffers(sim, 64, max_ms=1e-12):  # every dispatch over the work budget
        assert _eight_scales(sim)[1] == [1] * 8


def test_gpu_starts_before_the_step_is_encoded(sim):
    """With command buffers cut early, the GPU (here the worker, completing at once) runs the first
    part of a step while the host is still encoding the rest."""
    x = sim.tensor(np.ones(256, np.float32))
    y = sim.empty((256,), "f32")
    sim.synchronize()
    with command_buffers(sim, 2), lag("none"):
        before = METAL_SIM.dispatches
        with sim.step():
            ops.scale(x, 2.0, y)
            ops.scale(y, 2.0, y)
            t0 = time.monotonic()
            while METAL_SIM.dispatches < before + 2 and time.monotonic() - t0 < 60:
                time.sleep(0.01)
            assert METAL_SIM.dispatches == before + 2, "the first command buffer did not start before commit"
            ops.scale(y, 2.0, y)
        sim.synchronize()
    np.testing.assert_array_equal(read(y), 8.0)


def test_failed_command_buffer_raised_at_step_end(sim, monkeypatch):
    """A command buffer that fails is raised when its step is waited (the step's end), naming the
    step, which of its command buffers, and its first and last ops; the step still completes (its
    buffers return to the pool) and the device keeps working."""
    x = sim.tensor(np.ones(256, np.float32))
    ys = [sim.empty((256,), "f32") for _ in range(5)]
    sim.synchronize()
    run = METAL_SIM.run

    def faulty(r):
        if r["kernel"] == "add_f32":
            raise RuntimeError("injected fault")
        run(r)

    monkeypatch.setattr(METAL_SIM, "run", faulty)
    with command_buffers(sim, 2):
        with sim.step() as st:
            ops.scale(x, 2.0, ys[0])
            ops.scale(x, 2.0, ys[1])
            ops.add(ys[0], ys[1], ys[2])   # command buffer 2: add .. scale
            ops.scale(x, 2.0, ys[3])
            ops.scale(x, 2.0, ys[4])
        with pytest.raises(RuntimeError) as e:
            sim.wait(st.seq)
    msg = str(e.value)
    assert msg.startswith("[metal] command buffer failed:") and "injected fault" in msg, msg
    assert f"step {st.seq}, command buffer 2: add (add_f32) .. scale (scale_f32)" in msg, msg
    assert sim.completed_seq == st.seq
    # The step's last command buffer is submitted by commit itself: its failure too is the step's.
    with sim.step() as st:
        ops.add(ys[0], ys[1], ys[2])
    with pytest.raises(RuntimeError, match=rf"step {st.seq}, command buffer 1: add \(add_f32\)\)"):
        sim.synchronize()
    monkeypatch.setattr(METAL_SIM, "run", run)
    sim.synchronize()  # raised once only
    np.testing.assert_array_equal(read(ys[4]), 2.0)
    ops.add(ys[0], ys[1], ys[2])
    np.testing.assert_array_equal(read(ys[2]), 4.0)


def test_training_step_with_late_completion_and_host_records(sim):
    """The tiny model's step against the CPU backend with completion lagging by seeded random
    delays, the step cut every four dispatches, and the f32 GEMMs row-split with a CPU three times
    the GPU's rate, so that at this size the host takes them whole (host records that must wait for
    the kernels before them): every ordering rule at once on real work."""
    with lag("delay", max_ms=2.0, seed=5), command_buffers(sim, 4), row_split(sim, 300.0, 100.0):
        check_step_against_cpu(sim, "f32", 1e-5)
        assert any(r["host"] for r in krnl._core.testing.metal_last_step(sim)["records"])


def test_set_lag_rejects_unknown_mode():
    with pytest.raises(ValueError, match="lag must be 'none', 'wait' or 'delay'"):
        krnl._core.testing.metal_sim_set_lag("later")



@pytest.mark.parametrize("family", [7, 9])
def test_capabilities_follow_the_gpu_policy(sim, family):
    """metal-sim answers capabilities() as device.mm's "metal" would for the GPU it stands for (an
    M1, or the suite's M3): the dtypes and training dtype of the policy functions (bf16 kernels
    exist), asynchronous completion."""
    with metal_sim_as(family):
        c = sim.capabilities()
    pol = krnl._core.testing.metal_gpu_policy(dict(apple_family=family))
    assert c["kind"] == "metal-sim" and c["dtypes"] == pol["dtypes_with_bf16_kernels"]
    assert c["compute_dtype"] == pol["compute_dtype_with_bf16_kernels"]
    assert (c["synchronous"], c["queue_ordered"], c["host_visible"], c["graphs"]) == (False, True, True, False)
    assert c["details"]["gpu_family"] == f"apple{family}"
    assert c["details"]["bf16"] == "native" if family >= 9 else c["details"]["bf16"].startswith("emulated")


def _packed_split(n, seed):
    """The default task's samples of varied lengths packed into rows of 24 tokens (segments and
    positions restart per sample): (ids, targets, segments, positions)."""
    from krnl.train.batches import pack
    from krnl.train.data import Sample
    from krnl.train.default_task import CharTokenizer, make_split

    tok = CharTokenizer()
    ids, targets = make_split(tok, n, seed=seed)
    samples = []
    for row, tg in zip(ids, targets):
        k = int(np.count_nonzero(row != tok.pad_id))
        learn = np.zeros(k, bool)
        learn[1:] = tg[:k - 1] >= 0  # token t + 1 is learned where position t has a target
        samples.append(Sample(row[:k].copy(), learn))
    p = pack(samples, 24, pad_id=tok.pad_id)
    return tok, (p.ids, p.targets, p.segments, p.positions)


def test_trainer_matches_cpu(sim, tmp_path):
    """krnl's Trainer for 5 optimizer steps on metal-sim and on the CPU backend, both in f16 with
    dynamic loss scaling, packed rows, LoRA dropout and 2 micro-batches per step: the same losses
    (f16 tolerance), a loss that went down, and the same adapter updates. Adam divides each
    gradient by its own running RMS, so where a gradient is at f16's noise level (layer 0's q/k and
    gate/up A factors, whose B starts at zero) two summation orders move it differently: the
    updates are compared as a whole (5%) and per tensor (25%). (In f32 both backends agree to
    3e-6 per tensor: the kernels are not what differs.)"""
    from krnl.train.default_task import base_weights, tiny_config
    from krnl.models.model import LlamaModel
    from krnl.models.config import LoraConfig, ModelConfig
    from krnl.train.trainer import Trainer, TrainConfig

    runs = {}
    for name in ("cpu", "metal-sim"):
        tok, train = _packed_split(24, seed=11)
        config = ModelConfig.from_dict(tiny_config(tok.vocab_size))
        model = LlamaModel(krnl.device(name), config, base_weights(config, seed=5),
                           lora=LoraConfig(r=4, alpha=8, dropout=0.1), dtype="f16", seed=3)
        cfg = TrainConfig(iters=5, batch_size=4, grad_accum=2, learning_rate=1e-2, warmup=1, val_every=0,
                          save_every=0, seed=7)
        init = model.lora_state()
        tr = Trainer(model, cfg, train, None, out_dir=tmp_path / name, progress=False)
        assert tr.opt.scaler.enabled
        tr.run()
        lora = model.lora_state()
        runs[name] = ([loss for _, loss in tr.history], {k: np.float64(lora[k]) - init[k] for k in lora})
    (cpu_losses, cpu_upd), (sim_losses, sim_upd) = runs["cpu"], runs["metal-sim"]
    assert len(sim_losses) == 5 and np.all(np.isfinite(sim_losses))
    np.testing.assert_allclose(sim_losses, cpu_losses, rtol=2e-2)
    assert sim_losses[-1] < sim_losses[0]
    assert cpu_upd.keys() == sim_upd.keys()
    for k in cpu_upd:
        assert np.linalg.norm(sim_upd[k] - cpu_upd[k]) <= 0.25 * np.linalg.norm(cpu_upd[k]), k
    diff = np.sqrt(sum(np.sum((sim_upd[k] - cpu_upd[k]) ** 2) for k in cpu_upd))
    assert diff <= 0.05 * np.sqrt(sum(np.sum(u ** 2) for u in cpu_upd.values()))
