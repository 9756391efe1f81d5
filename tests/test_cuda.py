"""What only the CUDA device shows (csrc/cuda): registration and memory that is not host-visible,
asynchronous steps and the pool's completion gating, errors raised instead of aborts, and the
tiny-model LoRA training step against the CPU backend in f32 and bf16. The op suite
(test_ops.py, test_gemm.py, test_core.py) runs on "cuda" through the `dev` fixture."""
import gc

import numpy as np
import pytest

import krnl
from krnl import ops
from krnl.model import LlamaModel, LoraConfig, ModelConfig, random_weights

from conftest import read

pytestmark = pytest.mark.skipif(
    "cuda" not in krnl.devices(),
    reason="no cuda device: it is registered only where a CUDA GPU, its driver and cuBLAS are present ("
           + (getattr(krnl._core, "cuda_unavailable_reason", lambda: "this build has no CUDA backend")() or "?") + ")")

TINY = dict(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0)


@pytest.fixture(scope="module")
def cuda():
    return krnl.device("cuda")


def test_registered_first_not_host_visible(cuda):
    assert krnl.devices()[0] == "cuda", krnl.devices()
    assert krnl.device().name == "cuda"
    assert not cuda.host_visible
    with pytest.raises(ValueError, match=r"\[from_numpy\].*not host-visible"):
        cuda.from_numpy(np.zeros(4, np.float32))


def test_numpy_is_a_copy_of_any_view(cuda):
    a = np.arange(60, dtype=np.float32).reshape(6, 10)
    t = cuda.tensor(a)
    v = t.numpy()
    assert not v.flags.writeable, "a copy must refuse writes that could never reach the device"
    with pytest.raises(ValueError):
        v[0, 0] = -1.0
    w = np.array(v)  # the caller's own writable copy
    w[0, 0] = -1.0
    assert t.numpy()[0, 0] == 0.0
    np.testing.assert_array_equal(t[2:5].numpy(), a[2:5])
    np.testing.assert_array_equal(t[:, 3:7].numpy(), a[:, 3:7])  # row-strided view
    np.testing.assert_array_equal(t.T.numpy(), a.T)
    np.testing.assert_array_equal(t[4].numpy(), a[4])
    h = cuda.tensor(a, "bf16")
    np.testing.assert_array_equal(h.T.numpy(), a.T)  # small integers are exact in bf16
    np.testing.assert_array_equal(cuda.tensor(a.astype(np.float16)).numpy(), a.astype(np.float16))
    np.testing.assert_array_equal(cuda.tensor(np.arange(5, dtype=np.int32)).numpy(), np.arange(5))
    assert cuda.empty((0, 3)).numpy().shape == (0, 3)


def test_step_is_asynchronous_and_pool_waits_for_it(cuda):
    """A step's kernels run after the ops return: a buffer released inside it stays pending until
    its event completes, and is handed out again only then."""
    n = 4096
    A = cuda.tensor(np.ones((n, n), np.float32))
    C = cuda.empty((n, n), "f32")
    gc.collect()
    cuda.synchronize()
    base = cuda.pool_stats()["pending"]
    with cuda.step() as s:
        tmp = cuda.empty((n, n), "f32")
        tid = tmp.buffer_id
        for _ in range(12):  # ~1.6 TFLOP of fp32: far longer than the host needs to get below
            ops.gemm(A, A, tmp)
            ops.gemm(tmp, A, C, alpha=1.0 / n)
        del tmp
        assert cuda.pool_stats()["pending"] == base + krnl._core.HostBufferPool.class_size(4 * n * n)
    assert cuda.completed_seq < s.seq, "the step completed before the host could look: not asynchronous?"
    other = cuda.empty((n, n), "f32")
    assert other.buffer_id != tid, "a buffer of a running step was handed out again"
    cuda.wait(s.seq)
    assert cuda.completed_seq >= s.seq
    assert cuda.pool_stats()["pending"] == base
    again = cuda.empty((n, n), "f32")
    assert again.buffer_id == tid
    np.testing.assert_allclose(C.numpy()[:2, :2], n, rtol=1e-6)


def test_profile_records_device_time(cuda):
    """While profiling, each op's record holds its GPU time (events around its launches), not the
    microseconds the host spends queueing it."""
    n = 4096
    A = cuda.tensor(np.ones((n, n), np.float32))
    C = cuda.empty((n, n), "f32")
    krnl._core.clear_profile(cuda)
    with krnl.profile(cuda) as prof:
        with cuda.step():
            ops.gemm(A, A, C)  # 137 GFLOP of fp32: over 1 ms on any current GPU
            ops.scale(C, 0.5, C)
    (g, s) = prof.records
    assert g["op"] == "gemm" and s["op"] == "scale"
    assert g["ms"] > 1.0, g
    assert 0 < s["ms"] < g["ms"], s
    np.testing.assert_array_equal(C.numpy()[:2, :2], n / 2)


def test_errors_raise_instead_of_aborting(cuda):
    with pytest.raises(RuntimeError, match=r"\[alloc\] out of memory"):
        cuda.empty((1 << 46,), "f32")  # 256 TiB
    ids = cuda.tensor(np.array([0, 5, 2], np.int32))
    with pytest.raises(ValueError, match=r"\[embedding_forward\] id 5 at position 1"):
        ops.embedding_forward(ids, cuda.zeros((5, 3)), cuda.empty((3, 3)))
    t = cuda.tensor(np.ones(8, np.float32))  # the device still works
    ops.scale(t, 2.0, t)
    assert t.numpy().tolist() == [2.0] * 8


def test_ids_written_by_the_step_are_checked_after_it(cuda):
    """The range check reads ids on the host only after the queued work that writes them."""
    ids = cuda.zeros((4,), "i32")
    table = cuda.tensor(np.arange(12, dtype=np.float32).reshape(4, 3))
    out = cuda.empty((4, 3), "f32")
    with cuda.step():
        ops.fill(ids, 9)  # queued, not yet run when the check copies the ids
        with pytest.raises(ValueError, match="id 9"):
            ops.embedding_forward(ids, table, out)
        ops.fill(ids, 3)
        ops.embedding_forward(ids, table, out)
    np.testing.assert_array_equal(out.numpy(), np.tile(np.arange(9, 12, dtype=np.float32), (4, 1)))


def test_embedding_backward_is_deterministic(cuda):
    rng = np.random.default_rng(5)
    V, C, T = 50, 257, 3000
    ids = rng.integers(0, 7, T).astype(np.int32)  # many repeats
    dout = rng.standard_normal((T, C)).astype(np.float32)
    outs = []
    for _ in range(2):
        dt = cuda.zeros((V, C), "f32")
        ops.embedding_backward(cuda.tensor(ids), cuda.tensor(dout), dt)
        outs.append(dt.numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    cpu = krnl.device("cpu")
    ref = cpu.zeros((V, C), "f32")
    ops.embedding_backward(cpu.tensor(ids), cpu.tensor(dout), ref)
    np.testing.assert_array_equal(outs[0], ref.numpy())  # same order of additions as the CPU


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_vector_and_scalar_paths_agree(cuda, dt):
    """Aligned rows take the 16-byte vector kernels; the same data one element into a buffer
    (2 or 4 bytes off alignment) takes the scalar ones. Elementwise results are bit-identical;
    row reductions differ only in summation order."""
    rng = np.random.default_rng(9)

    def pair(a):
        aligned = cuda.tensor(a.astype(np.float32), dt)
        buf = cuda.empty((a.size + 1,), dt)
        off = buf[1:]
        ops.cast(aligned.reshape(-1), off)  # same dtype: a copy
        return aligned, off.reshape(a.shape)

    def outs(shape):
        return cuda.empty(shape, dt), cuda.empty((int(np.prod(shape)) + 1,), dt)[1:].reshape(shape)

    x, xu = pair(rng.standard_normal((64, 256)))
    y, yu = pair(rng.standard_normal((64, 256)))
    for op in ("add", "swiglu", "axpy"):
        o, ou = outs((64, 256))
        if op == "add":
            ops.add(x, y, o), ops.add(xu, yu, ou)
        elif op == "swiglu":
            ops.swiglu_forward(x, y, o), ops.swiglu_forward(xu, yu, ou)
        else:
            ops.cast(y, o), ops.cast(y, ou)
            ops.axpy(0.75, x, o), ops.axpy(0.75, xu, ou)
        np.testing.assert_array_equal(o.numpy(), ou.numpy(), err_msg=op)
    q, qu = pair(rng.standard_normal((4, 64, 128)))
    pos, invf = cuda.tensor(np.arange(64, dtype=np.int32)), cuda.tensor((1e4 ** -(np.arange(64) / 64)).astype(np.float32))
    ops.rope(q, pos, invf, 1.0), ops.rope(qu, pos, invf, 1.0)
    np.testing.assert_array_equal(q.numpy(), qu.numpy(), err_msg="rope")
    tol = {"f32": 1e-5, "f16": 2e-3, "bf16": 1.6e-2}[dt]  # an output rounding apart at most
    w = cuda.tensor(rng.standard_normal(256).astype(np.float32))
    (o, ou), rs, rsu = outs((64, 256)), cuda.empty((64,)), cuda.empty((64,))
    ops.rmsnorm_forward(x, w, o, rs, 1e-5), ops.rmsnorm_forward(xu, w, ou, rsu, 1e-5)
    np.testing.assert_allclose(read(o), read(ou), rtol=tol, atol=tol)
    s, su = pair(rng.standard_normal((2, 64, 256)))
    (p, pu) = outs((2, 64, 256))
    ops.softmax_causal_forward(s, p, 0.3), ops.softmax_causal_forward(su, pu, 0.3)
    np.testing.assert_allclose(read(p), read(pu), rtol=tol, atol=tol * 1e-2)


def _model(dev, dtype, seed=0):
    cfg = ModelConfig.from_dict(TINY)
    m = LlamaModel(dev, cfg, random_weights(cfg, seed, std=0.2), LoraConfig(r=2, alpha=4.0), dtype=dtype, seed=seed)
    rng = np.random.default_rng(seed + 1)
    lora = m.lora_state()
    for k in lora:  # B non-zero so that every LoRA path carries gradient
        if ".lora_B." in k:
            lora[k] = (0.1 * rng.standard_normal(lora[k].shape)).astype(np.float32)
    m.lora_params.load(lora)
    return m


def _step(m, ids, targets):
    m.lora_params.zero_grads()
    m.forward_backward(ids, targets)
    m.dev.synchronize()
    return m.read_loss(), {k: np.array(g.numpy(), np.float64) for k, g in m._lora_grads().items()}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_training_step_matches_cpu(cuda, dtype):
    """Loss and every LoRA gradient of one forward/backward of the tiny Llama (GQA, RoPE, causal
    attention, SwiGLU, tied head) on cuda against the CPU backend in f32. f32 differs only by
    summation order (cuBLAS runs COMPUTE_32F, no TF32); bf16 rounds every activation to 8 bits."""
    rng = np.random.default_rng(7)
    ids, targets = rng.integers(0, 61, (2, 9)), rng.integers(0, 61, (2, 9))
    loss_c, g_c = _step(_model(krnl.device("cpu"), "f32"), ids, targets)
    loss_g, g_g = _step(_model(cuda, dtype), ids, targets)
    tol = {"f32": 1e-5, "bf16": 5e-2}[dtype]
    assert abs(loss_g - loss_c) <= tol * abs(loss_c), (loss_g, loss_c)
    assert g_c.keys() == g_g.keys()
    for k in g_c:
        scale = float(np.max(np.abs(g_c[k])))
        assert scale > 0, k
        err = float(np.max(np.abs(g_g[k] - g_c[k])))
        assert err <= 4 * tol * scale, f"{k}: {err:.3e} > {4 * tol * scale:.3e}"


def test_training_reduces_loss_on_cuda(cuda):
    """Four AdamW steps on a fixed batch lower the loss; base weights are untouched."""
    from krnl.optim import AdamW, Schedule

    m = _model(cuda, "bf16")
    rng = np.random.default_rng(3)
    ids, targets = rng.integers(0, 61, (2, 9)), rng.integers(0, 61, (2, 9))
    w0 = read(m.head)
    opt = AdamW(m.lora_params, Schedule(3e-2, kind="constant"))
    losses = []
    for _ in range(4):
        loss, _ = _step(m, ids, targets)
        losses.append(loss)
        opt.step()
        cuda.synchronize()
    assert losses[-1] < losses[0] - 0.05, losses
    np.testing.assert_array_equal(read(m.head), w0)
