"""What only the CUDA device shows (csrc/cuda): registration and memory that is not host-visible,
asynchronous steps and the pool's completion gating, errors raised instead of aborts, and the
tiny-model LoRA training step against the CPU backend in f32 and bf16. The op suite
(test_ops.py, test_gemm.py, test_core.py) runs on "cuda" through the `dev` fixture."""
import gc

import numpy as np
import pytest

import krnl
from krnl import ops

from conftest import (U32, UNIT_ROUNDOFF, assert_close, assert_close_elementwise, check_step_against_cpu,
                      check_training_reduces_loss, empty_filled, lora_step, read, tiny_lora_model, upload)

pytestmark = pytest.mark.skipif(
    "cuda" not in krnl.devices(),
    reason="no cuda device: it is registered only where a CUDA GPU, its driver and cuBLAS are present ("
           + krnl.unavailable_devices().get("cuda", "this build has no CUDA backend") + ")")



@pytest.fixture(scope="module")
def cuda():
    return krnl.device("cuda")


def test_registered_first_not_host_visible(cuda):
    assert krnl.devices()[0] == "cuda", krnl.devices()
    assert "cuda" not in krnl.unavailable_devices()
    assert krnl.device().name == "cuda"
    assert not cuda.capabilities()["host_visible"]
    with pytest.raises(ValueError, match=r"\[from_numpy\].*not host-visible"):
        cuda.from_numpy(np.zeros(4, np.float32))


def test_capabilities(cuda):
    """What the model and krnl bench read on cuda: every float dtype, bf16 training, graphs, query
    row blocks of 1024, and the fused attention exactly where the ops run (cuDNN, 16-bit)."""
    c = cuda.capabilities()
    assert (c["kind"], c["compute_dtype"], c["graphs"], c["attention_block"]) == ("cuda", "bf16", True, 1024)
    assert c["dtypes"] == ["f32", "f16", "bf16"]
    assert (c["host_visible"], c["synchronous"], c["queue_ordered"]) == (False, False, True)
    fa = c["fused_attention"]
    assert fa["dtypes"] in ([], ["f16", "bf16"]) and not fa["segments"] and fa["window"] == bool(fa["dtypes"])
    assert not fa["sinks"]  # cuDNN's SDPA takes no sink column: gpt-oss keeps the materialised path
    assert c["details"]["gpu"] and int(c["details"]["sm_count"]) > 0


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


def test_step_is_asynchronous_and_reuse_is_stream_ordered(cuda):
    """A step's kernels run after the ops return. A buffer released inside it is handed out again
    at once (every access to cuda memory is ordered on the backend's one stream): writing the new
    tensor, here by an upload, runs after the kernels that still read the old one, so their
    result is intact."""
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
            ops.gemm(A, A, tmp)                  # tmp = n everywhere
            ops.gemm(tmp, A, C, alpha=1.0 / n)   # C = n everywhere, read from tmp
        del tmp
        assert cuda.pool_stats()["pending"] == base
        junk = cuda.empty((n, n), "f32")
        assert junk.buffer_id == tid, "a buffer released inside the step was not reused within it"
    assert cuda.completed_seq < s.seq, "the step completed before the host could look: not asynchronous?"
    cuda.upload(junk, np.full((n, n), 7.0, np.float32))  # into tmp's memory while the step may still run
    cuda.wait(s.seq)
    np.testing.assert_allclose(C.numpy()[:2, :2], n, rtol=1e-6)  # 7 if the upload had overtaken the gemms
    np.testing.assert_array_equal(junk.numpy()[:2, :2], 7.0)


def test_profile_records_device_time(cuda):
    """While profiling, each op's record holds its GPU time (events around its launches), not the
    microseconds the host spends queueing it. Three steps: the suite's other processes share the
    GPU, and their kernels can fall between one op's events, so the scale is compared at its best."""
    n = 4096
    A = cuda.tensor(np.ones((n, n), np.float32))
    C = cuda.empty((n, n), "f32")
    gemm_ms, scale_ms = [], []
    for _ in range(3):
        krnl._core.clear_profile(cuda)
        with krnl.profile(cuda) as prof:
            with cuda.step():
                ops.gemm(A, A, C)  # 137 GFLOP of fp32: over 1 ms on any current GPU
                ops.scale(C, 0.5, C)
        (g, s) = prof.records
        assert g["op"] == "gemm" and s["op"] == "scale"
        assert g["ms"] > 1.0 and s["ms"] > 0, (g, s)
        gemm_ms.append(g["ms"])
        scale_ms.append(s["ms"])
        np.testing.assert_array_equal(C.numpy()[:2, :2], n / 2)
    assert min(scale_ms) < min(gemm_ms), (scale_ms, gemm_ms)  # a 64 MiB pass against 137 GFLOP


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


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_training_step_matches_cpu(cuda, dtype):
    """One forward/backward of the tiny Llama on cuda against the CPU backend in f32. f32 differs
    only by summation order (cuBLAS runs COMPUTE_32F, no TF32); bf16 rounds every activation to 8
    bits."""
    check_step_against_cpu(cuda, dtype, {"f32": 1e-5, "bf16": 5e-2}[dtype])


def test_training_reduces_loss_on_cuda(cuda):
    check_training_reduces_loss(cuda, "bf16")


# ---- CUDA graphs (Device.capture / krnl.cuda_graph)

def _mlp_inputs(cuda, seed, T=64, C=128, F=96):
    rng = np.random.default_rng(seed)
    t = lambda *s: cuda.tensor(rng.standard_normal(s).astype(np.float32) * 0.3)
    return t(T, C), t(C), t(F, C), t(F, C), t(C, F)


def _mlp_step(cuda, x, w, Wg, Wu, Wd, temps=None):
    """gemm + rmsnorm + swiglu + add: y = x + swiglu(norm(x) Wg^T, norm(x) Wu^T) Wd^T."""
    T, C = x.shape
    F = Wg.shape[0]
    h, rs = cuda.empty((T, C)), cuda.empty((T,))
    ops.rmsnorm_forward(x, w, h, rs, 1e-5)
    g, u, s = cuda.empty((T, F)), cuda.empty((T, F)), cuda.empty((T, F))
    ops.gemm(h, Wg, g, trans_b=True)
    ops.gemm(h, Wu, u, trans_b=True)
    ops.swiglu_forward(g, u, s)
    y = cuda.empty((T, C))
    ops.gemm(s, Wd, y, trans_b=True)
    ops.add(y, x, y)
    if temps is not None:
        temps[:] = [t.buffer_id for t in (h, rs, g, u, s)]
    return y


def test_graph_replay_matches_eager_and_follows_inputs(cuda):
    x, w, Wg, Wu, Wd = _mlp_inputs(cuda, 0)
    with cuda.step():
        ref = _mlp_step(cuda, x, w, Wg, Wu, Wd)
    ref = ref.numpy().copy()
    g = krnl.cuda_graph(cuda, lambda: _mlp_step(cuda, x, w, Wg, Wu, Wd))
    y = g.outputs
    seq = g.replay()
    assert seq > 0 and not cuda.in_step and not cuda.capturing
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-6, atol=1e-6)
    # New input contents, same tensor: the replay computes with them.
    x2 = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    cuda.upload(x, x2)
    with cuda.step():
        assert g.replay() == 0  # joins the open step
    with cuda.step():
        ref2 = _mlp_step(cuda, x, w, Wg, Wu, Wd)
    np.testing.assert_allclose(y.numpy(), ref2.numpy(), rtol=1e-6, atol=1e-6)
    assert np.max(np.abs(ref2.numpy() - ref)) > 0.1
    for _ in range(3):  # back-to-back replays on the same buffers
        g.replay()
    np.testing.assert_allclose(y.numpy(), ref2.numpy(), rtol=1e-6, atol=1e-6)
    g.release()
    assert g.released
    with pytest.raises(RuntimeError, match=r"\[replay\] the graph was released"):
        g.replay()
    np.testing.assert_allclose(y.numpy(), ref2.numpy(), rtol=1e-6, atol=1e-6)  # outputs outlive the graph


def test_graph_keeps_its_buffers_out_of_the_pool(cuda):
    """Temporaries freed inside the recorded call are baked into the graph: the pool must not
    hand them out while it exists, and gets them back after release()."""
    x, w, Wg, Wu, Wd = _mlp_inputs(cuda, 2)
    temps = []
    g = cuda.capture(lambda: _mlp_step(cuda, x, w, Wg, Wu, Wd, temps))
    held = set(temps) | {g.outputs.buffer_id}
    assert len(held) == 6
    cuda.synchronize()
    T, C, F = 64, 128, 96
    fresh = [cuda.empty(s) for s in [(T, C), (T,), (T, F), (T, F), (T, F), (T, C)] * 3]
    assert not held & {t.buffer_id for t in fresh}, "a buffer baked into a live graph was handed out"
    del fresh
    g.release()
    cuda.synchronize()
    again = [cuda.empty(s) for s in [(T, C), (T,), (T, F), (T, F), (T, F)] * 3]
    assert set(temps) & {t.buffer_id for t in again}, "released graph buffers never came back to the pool"


def test_graph_arena_shares_temporaries_between_graphs(cuda):
    """What a recording allocates comes from one arena that every live graph shares: a second
    graph of a shorter length runs in the first one's released temporaries (the arena does not
    grow), both replay right in turn, and the arena goes back to the pool with the last graph."""
    x1, w, Wg, Wu, Wd = _mlp_inputs(cuda, 4, T=128)
    x2 = cuda.tensor(np.random.default_rng(5).standard_normal((64, 128)).astype(np.float32) * 0.3)
    cuda.synchronize()
    base = cuda.pool_stats()["graph_arena"]
    y1, y2 = (np.array(_mlp_step(cuda, x, w, Wg, Wu, Wd).numpy()) for x in (x1, x2))  # eager references
    g1 = cuda.capture(lambda: _mlp_step(cuda, x1, w, Wg, Wu, Wd))
    a1 = cuda.pool_stats()["graph_arena"]
    assert a1 > base
    g2 = cuda.capture(lambda: _mlp_step(cuda, x2, w, Wg, Wu, Wd))
    assert cuda.pool_stats()["graph_arena"] <= a1 + 64 * 128 * 4 * 2, "the second graph did not reuse the first's"
    for _ in range(2):  # each replay rewrites the temporaries the other one shares
        g1.replay()
        np.testing.assert_allclose(g1.outputs.numpy(), y1, rtol=1e-6, atol=1e-6)
        g2.replay()
        np.testing.assert_allclose(g2.outputs.numpy(), y2, rtol=1e-6, atol=1e-6)
    g1.release()
    g2.release()
    del g1, g2  # their outputs, made while recording, are the arena's until they go
    gc.collect()
    cuda.synchronize()
    assert cuda.pool_stats()["graph_arena"] == base


def test_trainer_replay_matches_eager_bit_for_bit(cuda, tmp_path):
    """krnl train's step recorded once per padded length and replayed (two lengths, dropout, two
    micro-batches) gives the eager step's losses and adapter bit for bit at the same padded
    length, in no more memory than the eager run plus a tenth."""
    from krnl.train.trainer import TrainConfig, Trainer
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 61, (16, 40)).astype(np.int32)
    tg = rng.integers(0, 61, (16, 40)).astype(np.int32)
    tg[8:, 20:] = -100  # half the rows are shorter: two padded lengths, 24 and 40
    ids_short, tg_short = ids[8:, :20], tg[8:, :20]

    class Two:  # alternating long and short batches
        def __init__(self):
            self.i = 0

        def next(self):
            self.i += 1
            r = rng_rows[self.i % 4]
            return (ids[:8][r], tg[:8][r]) if self.i % 2 else (ids_short[r], tg_short[r])

        def state(self):
            return {"i": self.i}

        def load_state(self, s):
            self.i = s["i"]

    rng_rows = [np.random.default_rng(k).permutation(8)[:4] for k in range(4)]
    out = {}
    for graphs in (False, True):
        m = tiny_lora_model(cuda, "bf16")
        m.lora_config.dropout = 0.1
        for L in m.layers:
            for lin in L.linears().values():
                lin.dropout = 0.1
        cfg = TrainConfig(iters=6, batch_size=4, grad_accum=2, learning_rate=1e-2, warmup=0, val_every=0,
                          save_every=0, length_bucket=8, graphs=graphs)
        tr = Trainer(m, cfg, Two(), None, out_dir=tmp_path / str(graphs), progress=False)
        cuda.synchronize()
        cuda.trim()
        tr.run()
        out[graphs] = ([l for _, l in tr.history], m.lora_state(), cuda.pool_stats()["peak_reserved"])
    (le, se, pe), (lg, sg, pg) = out[False], out[True]
    assert le == lg, (le, lg)
    for k in se:
        assert np.array_equal(se[k].view(np.uint32), sg[k].view(np.uint32)), k
    assert pg <= 1.1 * pe + (8 << 20), (pg, pe)


def test_graph_of_training_step_matches_eager(cuda):
    """The tiny Llama's forward_backward (embedding, RoPE, GQA attention, SwiGLU, LoRA, cross
    entropy) captured once and replayed: loss and every LoRA gradient equal the eager step's, also
    after new token ids are uploaded into the captured ids tensor."""
    rng = np.random.default_rng(7)
    ids1, ids2, targets = (rng.integers(0, 61, (2, 9)) for _ in range(3))
    m = tiny_lora_model(cuda, "f32")
    ids_t = cuda.tensor(ids1.astype(np.int32), "i32")

    def fb():
        m.lora_params.zero_grads()
        return m.forward_backward(ids_t, targets)  # numpy targets: a constant of the graph

    g = cuda.capture(fb)
    ref = tiny_lora_model(cuda, "f32")
    for ids in (ids1, ids2):
        cuda.upload(ids_t, ids.astype(np.int32))
        g.replay()
        cuda.synchronize()
        loss_g = float(g.outputs.numpy()[0])
        grads_g = {k: np.array(t.numpy(), np.float64) for k, t in m._lora_grads().items()}
        loss_e, grads_e = lora_step(ref, ids, targets)
        assert abs(loss_g - loss_e) <= 1e-6 * abs(loss_e), (loss_g, loss_e)
        for k in grads_e:
            np.testing.assert_allclose(grads_g[k], grads_e[k], rtol=1e-5, atol=1e-7 * np.max(np.abs(grads_e[k])),
                                       err_msg=k)
    _, g1 = lora_step(ref, ids1, targets)
    assert any(np.max(np.abs(g1[k] - grads_e[k])) > 0 for k in g1), "the two id sets gave the same gradients"
    g.release()


def test_graph_bad_uses_raise_and_leave_the_device_usable(cuda):
    x, w, Wg, Wu, Wd = _mlp_inputs(cuda, 3)

    def host_read():
        y = _mlp_step(cuda, x, w, Wg, Wu, Wd)
        return y.numpy()  # fn runs inside a step (warm-up and recording): host reads are refused

    with pytest.raises(RuntimeError, match=r"\[numpy\] cannot read a tensor while a step is open"):
        cuda.capture(host_read)
    with pytest.raises(RuntimeError, match=r"\[capture\] nested capture"):
        cuda.capture(lambda: cuda.capture(lambda: None))
    with pytest.raises(RuntimeError, match=r"\[wait\].*graph capture"):
        cuda.capture(lambda: cuda.synchronize() if cuda.capturing else None)
    with pytest.raises(RuntimeError, match=r"\[step\].*graph capture"):
        cuda.capture(lambda: cuda.begin_step() if cuda.capturing else None)
    ids = cuda.tensor(np.array([0, 3, 3], np.int32))
    dtab, dout = cuda.zeros((5, 4)), cuda.tensor(np.ones((3, 4), np.float32))
    with pytest.raises(RuntimeError, match=r"\[embedding_backward\].*graph capture"):
        cuda.capture(lambda: ops.embedding_backward(ids, dout, dtab))
    with cuda.step():
        with pytest.raises(RuntimeError, match=r"\[capture\] cannot capture inside an open step"):
            cuda.capture(lambda: None)
    with pytest.raises(ZeroDivisionError):  # fn's own error comes through unchanged
        cuda.capture(lambda: 1 / 0 if cuda.capturing else None)
    assert not cuda.capturing and not cuda.in_step
    with pytest.raises(NotImplementedError, match=r"\[capture\] not implemented on cpu"):
        krnl.device("cpu").capture(lambda: None)
    g = cuda.capture(lambda: _mlp_step(cuda, x, w, Wg, Wu, Wd))  # still works after every failure
    g.replay()
    with cuda.step():
        ref = _mlp_step(cuda, x, w, Wg, Wu, Wd)
    np.testing.assert_allclose(g.outputs.numpy(), ref.numpy(), rtol=1e-6, atol=1e-6)
    g.release()


def test_graph_replay_with_a_bad_id_gives_nan_not_a_fault(cuda):
    """The eager host check cannot run in a replay: the kernel's own guard writes NaN instead of
    reading outside the table."""
    ids = cuda.tensor(np.array([0, 2, 1], np.int32))
    table = cuda.tensor(np.arange(12, dtype=np.float32).reshape(4, 3))
    out = cuda.empty((3, 3))
    g = cuda.capture(lambda: ops.embedding_forward(ids, table, out))
    cuda.upload(ids, np.array([1, 1000, 3], np.int32))
    g.replay()
    o = out.numpy()
    np.testing.assert_array_equal(o[0], [3, 4, 5])
    assert np.isnan(o[1]).all()
    np.testing.assert_array_equal(o[2], [9, 10, 11])
    g.release()


# ---- fused attention (cuDNN)
def test_fused_attention_step_matches_materialised(cuda):
    """The tiny Llama with 64-wide heads in bf16, one step with the fused attention ops (the
    default where cuDNN loads) against the same model on the materialised path; the profile shows
    which path ran. Then the fused step captured as a graph and replayed matches eager."""
    if "bf16" not in cuda.capabilities()["fused_attention"]["dtypes"]:
        pytest.skip("no fused attention on this cuda device (built without cuDNN headers, or libcudnn absent)")
    rng = np.random.default_rng(9)
    ids, targets = rng.integers(0, 61, (2, 33)), rng.integers(0, 61, (2, 33))
    fused, mat = (tiny_lora_model(cuda, "bf16", head_dim=64) for _ in range(2))
    assert fused.fused_attention
    mat.fused_attention = False
    runs = {}
    for name, m in (("fused", fused), ("materialised", mat)):
        krnl._core.clear_profile(cuda)
        with krnl.profile(cuda) as prof:
            runs[name] = lora_step(m, ids, targets)
        runs[name + " ops"] = {r["op"] for r in prof.records}
    assert {"attention_forward", "attention_backward"} <= runs["fused ops"]
    assert "softmax_causal_forward" not in runs["fused ops"]
    assert "attention_forward" not in runs["materialised ops"]
    (lf, gf), (lm, gm) = runs["fused"], runs["materialised"]
    assert abs(lf - lm) <= 1e-2 * abs(lm), (lf, lm)
    for k in gm:
        scale = float(np.max(np.abs(gm[k])))
        assert scale > 0, k
        assert float(np.max(np.abs(gf[k] - gm[k]))) <= 5e-2 * scale, k

    ids_t = cuda.tensor(ids.astype(np.int32), "i32")

    def fb():
        fused.lora_params.zero_grads()
        return fused.forward_backward(ids_t, targets)

    with cuda.capture(fb) as g:
        g.replay()
        cuda.synchronize()
        assert abs(float(g.outputs.numpy()[0]) - lf) <= 1e-3 * abs(lf)
        for k, t in fused._lora_grads().items():  # cuDNN's dq accumulates atomically: not bitwise
            np.testing.assert_allclose(np.array(t.numpy(), np.float64), gf[k], rtol=0,
                                       atol=1e-2 * np.max(np.abs(gf[k])), err_msg=k)


@pytest.mark.parametrize("dt,C", [("bf16", 64), ("f32", 4), ("bf16", 3)],
                         ids=["bf16-rows-of-16B", "f32-one-16B", "bf16-odd"])
def test_embedding_forward_replayed_bad_id_is_nan(cuda, dt, C):
    """A recorded embedding_forward cannot check its ids on the host: replayed with an id out of
    range, that token's row is NaN (the 16-byte and the per-element kernels alike), the others
    the table's rows."""
    rng = np.random.default_rng(3)
    table = cuda.tensor(rng.standard_normal((9, C)).astype(np.float32), dt)
    ids, out = cuda.tensor(np.array([0, 8, 4], np.int32), "i32"), cuda.empty((3, C), dt)
    g = cuda.capture(lambda: ops.embedding_forward(ids, table, out))
    cuda.upload(ids, np.array([2, 9, -1], np.int32))
    g.replay()
    got, want = read(out), read(table)
    assert np.array_equal(got[0], want[2]) and np.isnan(got[1:]).all()
    g.release()


def test_gpu_power_meter_reads_this_gpu(cuda):
    """krnl bench's train rows read the GPU's clock and power through NVML (bench/gpu_power.py):
    on cuda the meter exists, and over half a second of 4096^3 bf16 GEMMs it sees a running SM
    clock and a power between idle and twice any GPU's limit."""
    import time
    from krnl.bench import gpu_power
    meter, why = gpu_power.meter_for(cuda)
    assert meter is not None, why
    a = cuda.tensor(np.ones((4096, 4096), np.float32), "bf16")
    c = cuda.empty((4096, 4096), "bf16")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.6:
        for _ in range(20):
            ops.gemm(a, a, c)
        cuda.synchronize()
    t1 = time.perf_counter()
    meter.stop()
    w = gpu_power.window(meter.readings, [(t0 + 0.05, t1)])
    assert w is not None and w["samples"] >= 10 and 200 <= w["sm_mhz"] <= 3000, w
    assert w["watts"] is not None and 50 < w["watts"] < 2000, w


# ---- mixture of experts (csrc/cuda/moe.cu): the paths that test_moe_ops.py's small, odd shapes
# leave out (16-byte tiles, the tensor cores, row tiles of 128, many sort runs), graphs and guards

def _moe_offsets(rng, P, E):
    """Rising offsets (E + 1,) of P rows: ragged experts, one hot, expert 1 empty (E > 2)."""
    e = np.where(rng.random(P) < 0.3, 0, rng.integers(0, E, P))
    if E > 2:
        e[e == 1] = 2
    return np.concatenate([[0], np.cumsum(np.bincount(e, minlength=E))]).astype(np.int32)


MOE_GEMM_TILES = [(600, 6, 136, 72), (1000, 4, 264, 40), (260, 70, 24, 16), (150, 3, 37, 33)]


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("transpose", [True, False], ids=["linear", "input-grad"])
@pytest.mark.parametrize("P,E,O,I", MOE_GEMM_TILES, ids=[f"{p}x{e}x{o}x{i}" for p, e, o, i in MOE_GEMM_TILES])
def test_moe_gemm_tiles(cuda, P, E, O, I, transpose, dt):
    """Dims that are multiples of 8 (16-byte tiles; bf16/f16 on tensor cores), row tiles of 128
    (1000 rows on 4 experts) and of 64, more experts than a warp has lanes, an expert without rows,
    an odd shape with several tiles; with beta = 0 an output prefilled with NaN is never read."""
    from test_ops import reduction_rtol
    rng = np.random.default_rng(P + E)
    off = _moe_offsets(rng, P, E)
    offsets = cuda.tensor(off, "i32")
    w, w64 = upload(cuda, rng.standard_normal((E, O, I)) / np.sqrt(I), dt)
    x, x64 = upload(cuda, rng.standard_normal((P, I if transpose else O)), dt)
    out, o64 = upload(cuda, rng.standard_normal((P, O if transpose else I)), dt)
    fresh = empty_filled(cuda, (P, O if transpose else I), dt)
    ops.moe_gemm(x, w, offsets, out, transpose, alpha=1.5, beta=0.25)
    ops.moe_gemm(x, w, offsets, fresh, transpose, alpha=1.5, beta=0.0)
    prod, mag = np.zeros_like(o64), np.zeros_like(o64)
    for e in range(E):
        r = slice(off[e], off[e + 1])
        We = w64[e].T if transpose else w64[e]
        prod[r], mag[r] = 1.5 * x64[r] @ We, 1.5 * np.abs(x64[r]) @ np.abs(We)
    tol = UNIT_ROUNDOFF[dt] + reduction_rtol(max(O, I))
    assert_close_elementwise(read(out), 0.25 * o64 + prod, rtol=0.0, atol=tol * (mag + 0.25 * np.abs(o64)), what="out")
    assert_close_elementwise(read(fresh), prod, rtol=0.0, atol=tol * mag, what="beta 0")


MOE_WGRAD = [(700, 5, 136, 264), (90, 4, 17, 33), (2000, 3, 128, 64)]


@pytest.mark.parametrize("dt,odt", [("f32", "f32"), ("f16", "f32"), ("bf16", "f32"), ("bf16", "bf16")])
@pytest.mark.parametrize("P,E,M,N", MOE_WGRAD, ids=[f"{p}x{e}x{m}x{n}" for p, e, m, n in MOE_WGRAD])
def test_moe_gemm_weight_grad_tiles(cuda, P, E, M, N, dt, odt):
    """Many steps of k per expert, 16-byte tiles and odd ones; an expert without rows gets beta out
    exactly, and zeros over NaN where beta = 0."""
    from test_ops import reduction_rtol
    rng = np.random.default_rng(P + M)
    off = _moe_offsets(rng, P, E)
    offsets = cuda.tensor(off, "i32")
    a, a64 = upload(cuda, rng.standard_normal((P, M)), dt)
    b, b64 = upload(cuda, rng.standard_normal((P, N)), dt)
    out, o64 = upload(cuda, rng.standard_normal((E, M, N)), odt)
    fresh = empty_filled(cuda, (E, M, N), odt)
    ops.moe_gemm_weight_grad(a, b, offsets, out, alpha=2.0, beta=0.5)
    ops.moe_gemm_weight_grad(a, b, offsets, fresh, alpha=2.0, beta=0.0)
    prod, mag = np.zeros_like(o64), np.zeros_like(o64)
    for e in range(E):
        r = slice(off[e], off[e + 1])
        prod[e], mag[e] = 2.0 * a64[r].T @ b64[r], 2.0 * np.abs(a64[r]).T @ np.abs(b64[r])
    tol = UNIT_ROUNDOFF[odt] + reduction_rtol(int(np.diff(off).max()) + 1)
    got = read(out)
    assert_close_elementwise(got, 0.5 * o64 + prod, rtol=0.0, atol=tol * (mag + 0.5 * np.abs(o64)), what="out")
    assert_close_elementwise(read(fresh), prod, rtol=0.0, atol=tol * mag, what="beta 0")
    empty = np.diff(off) == 0
    assert empty.any()
    np.testing.assert_array_equal(got[empty], (0.5 * o64)[empty].astype(np.float32))
    np.testing.assert_array_equal(read(fresh)[empty], 0.0)


@pytest.mark.parametrize("N,K,E", [(6000, 8, 128), (3001, 2, 7), (400, 6, 3000)], ids=["6000x128top8", "3001x7top2",
                                                                                        "400x3000top6"])
def test_moe_sort_many_runs(cuda, N, K, E):
    """Many runs of 512 pairs over several blocks (the counts' expert-major scan), experts above a
    warp's lanes, and so many experts that a block holds fewer warps: still a stable sort."""
    from test_moe_ops import sort_ref
    rng = np.random.default_rng(N + E)
    hot = rng.random((N, 1)) < 0.5  # half the tokens on the first experts: long runs of equal ids
    ids = np.where(hot, np.arange(K)[None, :], np.stack([rng.choice(E, K, replace=False) for _ in range(N)]))
    tokens, slot, offsets = cuda.empty((N * K,), "i32"), cuda.empty((N, K), "i32"), cuda.empty((E + 1,), "i32")
    ops.moe_sort(cuda.tensor(ids.astype(np.int32), "i32"), tokens, slot, offsets)
    rt, rs, ro = sort_ref(ids, E)
    np.testing.assert_array_equal(read(tokens, np.int64), rt)
    np.testing.assert_array_equal(read(slot, np.int64), rs)
    np.testing.assert_array_equal(read(offsets, np.int64), ro)


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_moe_combine_vectors(cuda, dt):
    """Rows of whole 16-byte vectors (the vector kernels of the gather, the combine and its
    backward) against the CPU backend: the same sums in the same order."""
    cpu = krnl.device("cpu")
    rng = np.random.default_rng(9)
    N, E, K, C = 129, 9, 3, 256
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)
    arrays = dict(x=rng.standard_normal((N, C)), ys=rng.standard_normal((N * K, C)), dout=rng.standard_normal((N, C)),
                  out=rng.standard_normal((N, C)), w=rng.uniform(0, 1, (N, K)))
    got = {}
    for dev in (cuda, cpu):
        t = {k: dev.tensor(v.astype(np.float32), "f32" if k == "w" else dt) for k, v in arrays.items()}
        tokens, slot, offsets = dev.empty((N * K,), "i32"), dev.empty((N, K), "i32"), dev.empty((E + 1,), "i32")
        ops.moe_sort(dev.tensor(ids, "i32"), tokens, slot, offsets)
        xs, dys, dw = dev.empty((N * K, C), dt), dev.empty((N * K, C), dt), dev.empty((N, K))
        ops.moe_gather(t["x"], tokens, xs)
        ops.moe_combine(t["ys"], slot, t["w"], t["out"], 0.5)
        ops.moe_combine_backward(t["dout"], t["ys"], slot, t["w"], dys, dw)
        got[dev.name] = [read(v) for v in (xs, t["out"], dys, dw)]
    tol = UNIT_ROUNDOFF[dt]
    for name, c, g in zip(["gather", "combine", "dys", "dweights"], got["cpu"], got["cuda"]):
        if name == "gather":
            np.testing.assert_array_equal(g, c)
        else:
            assert_close(g, c, rtol=tol + 64 * U32, what=name)


# moe_quantized_matmul (csrc/cuda/moe_quantized.cu): moe_gemm's tiles with each B tile dequantized as
# it is loaded. test_moe_ops.py's cases stay at one column tile, 16-byte units, row tiles of 64 and
# 3, 4 and 8 bits; these take every other code width, row tiles of 128, per-element tiles (an odd
# O), several column tiles and a last partial step, groups of 16 to 128, f32 scales for 16-bit x.
MOEQ_TILES = [(1000, 4, 136, 160, 3, 32, True), (600, 6, 40, 48, 6, 16, False), (150, 3, 37, 64, 5, 64, True),
              (260, 70, 24, 256, 2, 128, False), (300, 5, 72, 128, 8, 16, True)]


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("transpose", [True, False], ids=["linear", "input-grad"])
@pytest.mark.parametrize("P,E,O,I,bits,gs,f32_scales", MOEQ_TILES,
                         ids=[f"{p}x{e}x{o}x{i}-q{b}g{g}" + ("-f32s" if f else "") for p, e, o, i, b, g, f in MOEQ_TILES])
def test_moe_quantized_matmul_tiles(cuda, P, E, O, I, bits, gs, f32_scales, transpose, dt):
    """Against float64 from the codes (quantized_matmul's bound: W rounded once to a 16-bit dtype);
    with beta = 0 an output prefilled with NaN is never read. Scales of powers of two over 32 and
    biases in eighths make every s q + b exact in f32, so the result must equal moe_gemm's on W
    rounded to x's dtype bit for bit: the same tiles, only the B loads differ."""
    from krnl.quant import affine
    rng = np.random.default_rng(P + bits)
    off = _moe_offsets(rng, P, E)
    offsets = cuda.tensor(off, "i32")
    G, sdt = I // gs, "f32" if f32_scales or dt == "f32" else dt
    codes = rng.integers(0, 1 << bits, (E, O, I))
    s64 = rng.choice([1.0, -1.0, 2.0, -2.0, 4.0], (E, O, G)) / 32
    b64 = rng.integers(-3, 4, (E, O, G)) / 8
    W = np.repeat(s64, gs, axis=2) * codes + np.repeat(b64, gs, axis=2)  # (E, O, I), exact in f32
    w = cuda.tensor(np.stack([affine.pack(codes[e], bits) for e in range(E)]), "i32")
    s, b = cuda.tensor(s64.astype(np.float32), sdt), cuda.tensor(b64.astype(np.float32), sdt)
    shape = (P, O if transpose else I)
    x, x64 = upload(cuda, rng.standard_normal((P, I if transpose else O)), dt)
    out, o64 = upload(cuda, rng.standard_normal(shape), dt)
    fresh = empty_filled(cuda, shape, dt)
    ops.moe_quantized_matmul(x, w, s, b, offsets, out, transpose, gs, bits, beta=0.25)
    ops.moe_quantized_matmul(x, w, s, b, offsets, fresh, transpose, gs, bits, beta=0.0)
    prod, mag = np.zeros(shape), np.zeros(shape)
    for e in range(E):
        r = slice(off[e], off[e + 1])
        We = W[e].T if transpose else W[e]
        prod[r], mag[r] = x64[r] @ We, np.abs(x64[r]) @ np.abs(We)
    tol = ((I if transpose else O) + 4) * U32 + (2 * UNIT_ROUNDOFF[dt] if dt != "f32" else 0.0)
    assert_close_elementwise(read(out), 0.25 * o64 + prod, rtol=0.0, atol=tol * (mag + 0.25 * np.abs(o64)), what="out")
    assert_close_elementwise(read(fresh), prod, rtol=0.0, atol=tol * mag, what="beta 0")
    dense = empty_filled(cuda, shape, dt)
    ops.moe_gemm(x, cuda.tensor(W.astype(np.float32), dt), offsets, dense, transpose, alpha=1.0, beta=0.0)
    np.testing.assert_array_equal(read(fresh), read(dense))


def test_moe_quantized_matmul_recorded_in_a_graph(cuda):
    """Offsets written by moe_sort inside the graph, never read on the host: replayed with new
    expert ids it gives the eager results bit for bit."""
    from krnl.quant import affine
    rng = np.random.default_rng(11)
    N, E, K, O, I, bits, gs, dt = 300, 8, 2, 72, 96, 5, 32, "bf16"
    ids = cuda.empty((N, K), "i32")
    tokens, slot, offsets = cuda.empty((N * K,), "i32"), cuda.empty((N, K), "i32"), cuda.empty((E + 1,), "i32")
    w = cuda.tensor(np.stack([affine.pack(c, bits) for c in rng.integers(0, 1 << bits, (E, O, I))]), "i32")
    s = cuda.tensor(rng.uniform(0.01, 0.1, (E, O, I // gs)).astype(np.float32), dt)
    b = cuda.tensor((rng.standard_normal((E, O, I // gs)) / 10).astype(np.float32), dt)
    x = cuda.tensor(rng.standard_normal((N * K, I)).astype(np.float32), dt)

    def step(out):
        ops.moe_sort(ids, tokens, slot, offsets)
        ops.moe_quantized_matmul(x, w, s, b, offsets, out, True, gs, bits)
        return out

    def new_ids():
        return np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)

    cuda.upload(ids, new_ids())
    recorded = cuda.empty((N * K, O), dt)
    g = cuda.capture(lambda: step(recorded))
    for _ in range(2):
        cuda.upload(ids, new_ids())
        g.replay()
        got = read(recorded)
        np.testing.assert_array_equal(got, read(step(cuda.empty((N * K, O), dt))))
    g.release()


def _moe_block(dev, x, lg, W1, W2, dout, K):
    """The MoE ops as a model chains them, forward and backward; returns every result."""
    N, E = lg.shape
    C, F, dt = x.shape[1], W1.shape[1], x.dtype
    ids, w = dev.empty((N, K), "i32"), dev.empty((N, K))
    ops.moe_route(lg, ids, w, True)
    tokens, slot, offsets = dev.empty((N * K,), "i32"), dev.empty((N, K), "i32"), dev.empty((E + 1,), "i32")
    ops.moe_sort(ids, tokens, slot, offsets)
    xs, h, ys = dev.empty((N * K, C), dt), dev.empty((N * K, F), dt), dev.empty((N * K, C), dt)
    out = dev.empty((N, C), dt)
    ops.moe_gather(x, tokens, xs)
    ops.moe_gemm(xs, W1, offsets, h)
    ops.moe_gemm(h, W2, offsets, ys)
    ops.moe_combine(ys, slot, w, out)
    dys, dw = dev.empty((N * K, C), dt), dev.empty((N, K))
    ops.moe_combine_backward(dout, ys, slot, w, dys, dw)
    dh, dxs, dx = dev.empty((N * K, F), dt), dev.empty((N * K, C), dt), dev.empty((N, C), dt)
    dl = dev.empty((N, E), lg.dtype)
    dW2, dW1 = dev.empty((E, C, F)), dev.empty((E, F, C))
    ops.moe_gemm(dys, W2, offsets, dh, transpose=False)
    ops.moe_gemm_weight_grad(dys, h, offsets, dW2)
    ops.moe_gemm(dh, W1, offsets, dxs, transpose=False)
    ops.moe_gemm_weight_grad(dh, xs, offsets, dW1)
    ops.moe_combine(dxs, slot, None, dx)
    ops.moe_route_backward(lg, ids, dw, dl, True)
    return ids, w, out, dx, dl, dW1, dW2


def test_moe_block_recorded_in_a_graph(cuda):
    """Every MoE op records into a graph (no op reads ids, tokens, slots or offsets on the host);
    replayed with new inputs uploaded into the recorded tensors it gives the eager run's results bit
    for bit (deterministic kernels), and the CPU backend's to rounding."""
    from test_moe_ops import separated_logits
    rng = np.random.default_rng(2)
    N, E, K, C, F, dt = 300, 16, 4, 64, 48, "bf16"

    def inputs():  # logits far enough apart that the CPU picks the same experts
        return (rng.standard_normal((N, C)), separated_logits(rng, N, E, spread=0.2),
                rng.standard_normal((E, F, C)) / 8, rng.standard_normal((E, C, F)) / 7, rng.standard_normal((N, C)))

    def on(dev, arrays):
        return [dev.tensor(a.astype(np.float32), "f32" if i == 1 else dt) for i, a in enumerate(arrays)]

    recorded = on(cuda, inputs())
    g = cuda.capture(lambda: _moe_block(cuda, *recorded, K))
    for _ in range(2):
        arrays = inputs()
        for t, a in zip(recorded, arrays):
            cuda.upload(t, a.astype(np.float32))  # rounded to t's dtype as Device.tensor rounds
        g.replay()
        replayed = [read(t) for t in g.outputs]
        with cuda.step():
            eager = _moe_block(cuda, *on(cuda, arrays), K)
        names = ["ids", "weights", "out", "dx", "dlogits", "dW1", "dW2"]
        for name, r, e in zip(names, replayed, [read(t) for t in eager]):
            np.testing.assert_array_equal(r, e, err_msg=name)
        ref = [read(t) for t in _moe_block(krnl.device("cpu"), *on(krnl.device("cpu"), arrays), K)]
        np.testing.assert_array_equal(replayed[0], ref[0])
        for name, r, c in zip(["weights", "out", "dx", "dlogits", "dW1", "dW2"], replayed[1:], ref[1:]):
            assert_close(r, c, rtol=0.05, what=name)
    g.release()


def test_moe_replayed_bad_tokens_and_slots_are_nan(cuda):
    """Recorded gathers and combines cannot check tokens and slots on the host (nor can any GPU op:
    they are written by earlier kernels): replayed with some out of range, those rows are NaN, the
    rest exact."""
    x = cuda.tensor(np.arange(24, dtype=np.float32).reshape(3, 8))
    tokens, slot = cuda.tensor(np.array([2, 0, 1, 1], np.int32)), cuda.tensor(np.array([[0, 1], [2, 3]], np.int32))
    xs, out = cuda.empty((4, 8)), cuda.empty((2, 8))
    g = cuda.capture(lambda: (ops.moe_gather(x, tokens, xs), ops.moe_combine(xs, slot, None, out)))
    cuda.upload(tokens, np.array([2, 7, 1, -1], np.int32))
    cuda.upload(slot, np.array([[0, 2], [9, 3]], np.int32))
    g.replay()
    got = read(xs)
    np.testing.assert_array_equal(got[[0, 2]], read(x)[[2, 1]])
    assert np.isnan(got[[1, 3]]).all()
    o = read(out)
    np.testing.assert_array_equal(o[0], got[0] + got[2])
    assert np.isnan(o[1]).all()
    g.release()
