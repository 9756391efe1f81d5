"""The Metal backend end to end on the metal-sim device (DESIGN section 7): the dispatch records of
csrc/metal/ops.cpp executed by tools/mslsim. The op suite (test_ops.py, test_gemm.py) also runs
here; this file checks what only a whole device shows: the tiny-model LoRA training step against
the CPU backend, step semantics (nothing runs before commit), the pool's completion gating,
split-K routing and the CPU/GPU row split."""
import numpy as np
import pytest

import krnl
from krnl import ops

from conftest import (METAL_SIM, U32, UNIT_ROUNDOFF, check_step_against_cpu, check_training_reduces_loss, read,
                      upload)

pytestmark = pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")


@pytest.fixture(scope="module")
def sim():
    return krnl.device("metal-sim")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_training_step_matches_cpu(sim, dtype):
    """One forward/backward of the tiny Llama (GQA, RoPE, causal attention, SwiGLU, tied head) on
    metal-sim against the CPU backend in f32. f32 differs only by summation order (a few f32 ulps
    through two layers); f16 compute rounds every activation to 11 bits."""
    check_step_against_cpu(sim, dtype, {"f32": 1e-5, "f16": 2e-2}[dtype])


def test_training_reduces_loss_on_metal_sim(sim):
    check_training_reduces_loss(sim, "f32", grad_checkpoint=True)


def test_nothing_runs_before_commit(sim):
    """Like a command buffer: a step's work runs at commit (reading a tensor inside the step is
    refused), and the step's records are its ops in order."""
    x = sim.tensor(np.arange(8, dtype=np.float32))
    y = sim.zeros((8,), "f32")
    before = METAL_SIM.dispatches
    with sim.step():
        ops.scale(x, 2.0, y)
        ops.add(y, x, y)
        assert METAL_SIM.dispatches == before  # encoded, not run
        with pytest.raises(RuntimeError, match="step is open"):
            y.numpy()
    assert METAL_SIM.dispatches == before + 2
    sim.synchronize()
    np.testing.assert_array_equal(np.array(y.numpy()), 3 * np.arange(8))
    recs = krnl._core.metal_sim_last_step()
    assert [r["kernel"] for r in recs] == ["scale_f32", "add_f32"]


def test_pool_reuses_buffers_only_after_their_step(sim):
    """A buffer freed inside an open step is not handed out again before that step completes:
    its kernel has not run yet when the step is still open."""
    keep = sim.empty((4096,), "f32")
    ops.fill(keep, 3.0)
    with sim.step():
        a = sim.empty((4096,), "f32")
        ops.fill(a, 1.0)
        del a
        assert sim.pool_stats()["pending"] == 4096 * 4
        b = sim.empty((4096,), "f32")  # must not be a's buffer: a's fill has not run yet
        ops.fill(b, 2.0)
        ops.add(b, keep, b)
    sim.synchronize()
    np.testing.assert_array_equal(np.array(b.numpy()), 5.0)
    assert sim.pool_stats()["pending"] == 0


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
    kernels = [r["kernel"] for r in krnl._core.metal_sim_last_step()]
    assert kernels == ["gemm_splitk_nt_f32", "gemm_reduce_f32"], kernels
    P = sim.empty((T, R), "f32")
    ops.gemm(A, B, P, trans_b=True, split_k=1)
    assert [r["kernel"] for r in krnl._core.metal_sim_last_step()] == ["gemm_nt_f32"]
    ref = a @ b.T
    bound = 2 * F * U32 * float(np.max(np.abs(a)) * np.max(np.abs(b))) * 4
    assert float(np.max(np.abs(read(C) - ref))) <= bound
    assert float(np.max(np.abs(read(C) - read(P)))) <= bound


def test_head_batching_by_offset(sim):
    """A batched GEMM over heads is one dispatch with grid.z = heads and the operands bound at
    their view offsets, never copied."""
    rng = np.random.default_rng(12)
    H, T, D = 3, 33, 8
    Q, q = upload(sim, rng.standard_normal((H + 1, T, D)))
    K, k = upload(sim, rng.standard_normal((H, T, D)))
    S = sim.empty((H, T, T), "f32")
    ops.gemm(Q[1:], K, S, trans_b=True, batch=H)
    (rec,) = krnl._core.metal_sim_last_step()
    assert rec["kernel"] == "gemm_nt_f32" and rec["grid"][2] == H
    offsets = {i: off for i, _, _, _, off in rec["buffers"]}
    assert offsets[0] == T * D * 4  # Q[1:] bound at its offset
    np.testing.assert_allclose(read(S), q[1:] @ k.transpose(0, 2, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dt,cdt", [("f32", "f32"), ("f16", "f16"), ("f16", "f32")])
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
    krnl._core.set_row_split(sim, True, cpu_gflops=100.0, gpu_gflops=300.0, overhead_ms=0.0, min_flops=0)
    try:
        C = sim.empty((M, N), cdt)
        ops.cast(C0, C)
        ops.gemm(A, B, C, trans_b=True, alpha=0.5, beta=0.25, split_k=1)
        recs = krnl._core.metal_sim_last_step()
    finally:
        krnl._core.set_row_split(sim, False)
    plan = krnl._core.plan_row_split(M, 1.0 / 100, 1.0 / 300, 0.0, 32)
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
    x = sim.empty((4,), "bf16")
    with pytest.raises(NotImplementedError, match=r"\[fill\] bf16 not implemented on metal-sim"):
        ops.fill(x, 1.0)
