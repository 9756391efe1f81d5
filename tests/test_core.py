"""Infrastructure of the core: the buffer pool's policy, steps, tensors and views, op validation,
the split-K and row-split planners, the profiler and the device registry.

Expected values come from the documented contracts (docs/architecture.md: 'The op contract', 'Memory', 'Steps';
the headers in csrc/core), worked out by hand or by independent brute force in the test, never by running krnl.
The `dev` fixture (tests/conftest.py) is parametrised over krnl.devices().
"""

import gc
import math

import numpy as np
import pytest

import krnl
from krnl import _core

ops = _core.ops
HostBufferPool = _core.testing.HostBufferPool
cs = HostBufferPool.class_size


def _stats(dev):
    gc.collect()  # tensors dropped by earlier tests go back before we measure
    return dev.pool_stats()


# ----------------------------------------------------------------------------------------------
# BufferPool policy (HostBufferPool: the same class over malloc, caller plays the clock)


def test_class_size_hand_values():
    # multiples of 256 up to 4 KiB, then 2^k * {1.25, 1.5, 1.75, 2}
    assert cs(0) >= 0 and cs(0) % 256 == 0
    assert cs(1) == 256
    assert cs(256) == 256
    assert cs(257) == 512
    assert cs(4095) == 4096
    assert cs(4096) == 4096
    assert cs(4097) == 5120
    assert cs(6144) == 6144
    assert cs(6145) == 7168
    assert cs(7169) == 8192
    assert cs(8193) == 10240
    assert cs(3_111_108) == 3_145_728  # 2^21 * 1.5


def test_class_size_properties():
    rng = np.random.default_rng(0)
    sizes = sorted(set(list(range(0, 9000, 7)) + [int(v) for v in rng.integers(1, 1 << 34, 3000)]
                       + [(1 << k) + d for k in range(12, 36) for d in (-1, 0, 1)]))
    prev = 0
    for n in sizes:
        c = cs(n)
        assert c >= n, n
        assert c >= prev, f"class_size not monotone at {n}: {c} < {prev}"
        prev = c
        if n <= 4096:
            assert c % 256 == 0 and c - max(n, 1) < 256, (n, c)  # 0 bytes still take the smallest class
        else:
            assert (c - n) / n < 0.25, f"waste {(c - n) / n:.3f} at {n} (class {c})"
    # four classes per power of two above 4 KiB
    for k in range(12, 30):
        lo, hi = 1 << k, 1 << (k + 1)
        probes = [lo + 1 + (hi - lo - 1) * i // 64 for i in range(65)]
        assert len({cs(n) for n in probes}) == 4, k


def test_pool_retired_buffer_waits_for_its_submission():
    p = HostBufferPool()
    a, ca = p.acquire(1000, 4)
    assert ca == cs(1000)
    p.release(a, 5, 4)  # submission 5 may still read it
    st = p.stats()
    assert st["pending"] == ca and st["cached"] == 0 and st["in_use"] == 0
    b, _ = p.acquire(1000, 4)  # 5 not complete: must not hand `a` out again
    assert b != a
    assert p.stats()["reuses"] == 0
    c, _ = p.acquire(1000, 4)
    assert c not in (a, b)
    r0 = p.stats()["reuses"]
    d, cd = p.acquire(1000, 5)  # now complete: the retired buffer is reused
    assert d == a and cd == ca
    st = p.stats()
    assert st["reuses"] == r0 + 1
    assert st["pending"] == 0
    assert st["allocations"] == 3


def test_pool_has_cached_says_what_acquire_would_reuse():
    """has_cached (the graph arena's question before it takes a larger released buffer): a
    buffer of the class, cached or retired under a completed submission; not another class's."""
    p = HostBufferPool()
    a, _ = p.acquire(1000, 4)
    assert not p.has_cached(1000, 4)
    p.release(a, 5, 4)                    # retired under submission 5
    assert not p.has_cached(1000, 4) and p.has_cached(900, 5)  # the same class once 5 completes
    assert not p.has_cached(5000, 5)
    assert p.acquire(1000, 5)[0] == a and not p.has_cached(1000, 5)


def test_pool_release_with_completed_submission_is_cached_at_once():
    p = HostBufferPool()
    a, ca = p.acquire(5000, 7)
    p.release(a, 7, 7)
    st = p.stats()
    assert st["pending"] == 0 and st["cached"] == ca
    b, _ = p.acquire(5000, 7)
    assert b == a and p.stats()["reuses"] == 1
    # different class: not served from that buffer
    p.release(b, 0, 7)
    c, cc = p.acquire(9000, 7)
    assert c != a and cc == cs(9000)


def test_pool_reuse_now_serves_at_once_but_is_not_given_back_early():
    """release(reuse_now) (a queue-ordered device: later work runs after the buffer's readers): the
    buffer is cached at once and reused, but trim and the limit give it back to the system only
    once its submission completed, since that work may still read it."""
    p = HostBufferPool()
    a, ca = p.acquire(5000, 3)
    p.release(a, 4, 3, reuse_now=True)   # submission 4 may still read it
    st = p.stats()
    assert st["pending"] == 0 and st["cached"] == ca
    p.trim(3)                            # 4 not complete: kept
    assert p.stats()["reserved"] == ca
    b, _ = p.acquire(5000, 3)
    assert b == a
    p.release(b, 4, 3, reuse_now=True)
    p.set_limit(ca + cs(100) - 1)
    with pytest.raises(RuntimeError, match="past its limit"):
        p.acquire(100, 3)                # the limit gives cached memory back, but not this buffer
    assert p.stats()["reserved"] == ca
    c, _ = p.acquire(100, 4)             # once 4 completed it goes, and the request fits
    assert p.stats()["reserved"] == cs(100)
    p.release(c, 0, 4)
    p.trim(4)
    assert p.stats()["reserved"] == 0 and p.stats()["cached"] == 0


def test_pool_exact_buffers_take_their_size_and_are_never_cached():
    """acquire(exact): the request's size in multiples of 256 instead of its class (2^27 + 1 KiB
    would reserve 1.25 x 2^27), never handed to another request, and given back to the system
    once released: at once when its submission completed, else when it does."""
    p = HostBufferPool()
    n = (1 << 27) + 1000
    a, ca = p.acquire(n, 5, exact=True)
    assert ca == (1 << 27) + 1024 and cs(n) == 5 << 25
    p.release(a, 5, 5)
    assert p.stats()["reserved"] == 0 and p.stats()["cached"] == 0
    b, cb = p.acquire(300, 5, exact=True)
    assert cb == 512
    p.release(b, 6, 5, reuse_now=True)          # submission 6 may still read it: pending, not cached
    st = p.stats()
    assert (st["pending"], st["cached"], st["reserved"]) == (512, 0, 512)
    c, cc = p.acquire(300, 5)                   # a class request never gets it
    assert c != b and cc == cs(300)
    p.release(c, 0, 5)
    p.acquire(300, 6, exact=True)               # collected once 6 completed: back to the system
    assert p.stats()["pending"] == 0 and p.stats()["reserved"] == cs(300) + 512


def test_pool_release_unknown_id_raises():
    p = HostBufferPool()
    a, _ = p.acquire(10, 0)
    p.release(a, 0, 0)
    with pytest.raises(ValueError):
        p.release(a, 0, 0)


def test_pool_stats_are_exact_sums_of_class_sizes():
    p = HostBufferPool()
    c1, c2, c3 = cs(1000), cs(5000), cs(70_000)
    assert (c1, c2, c3) == (1024, 5120, 81920)

    def check(in_use, pending, cached, peak_in_use, peak_reserved):
        st = p.stats()
        assert st["in_use"] == in_use
        assert st["pending"] == pending
        assert st["cached"] == cached
        assert st["reserved"] == in_use + pending + cached
        assert st["peak_in_use"] == peak_in_use
        assert st["peak_reserved"] == peak_reserved

    check(0, 0, 0, 0, 0)
    a, _ = p.acquire(1000, 0)
    b, _ = p.acquire(5000, 0)
    c, _ = p.acquire(70_000, 0)
    check(c1 + c2 + c3, 0, 0, c1 + c2 + c3, c1 + c2 + c3)
    p.release(a, 2, 1)  # pending on submission 2
    check(c2 + c3, c1, 0, c1 + c2 + c3, c1 + c2 + c3)
    p.release(c, 1, 1)  # cached
    check(c2, c1, c3, c1 + c2 + c3, c1 + c2 + c3)
    d, _ = p.acquire(1000, 1)  # a still pending: fresh allocation
    assert d != a
    check(c2 + c1, c1, c3, c1 + c2 + c3, 2 * c1 + c2 + c3)
    e, _ = p.acquire(70_000, 1)  # from the cache
    assert e == c
    check(c1 + c2 + c3, c1, 0, c1 + c2 + c3, 2 * c1 + c2 + c3)
    f, _ = p.acquire(1000, 2)  # a is now reusable
    assert f == a
    check(2 * c1 + c2 + c3, 0, 0, 2 * c1 + c2 + c3, 2 * c1 + c2 + c3)
    st = p.stats()
    assert st["allocations"] == 4 and st["reuses"] == 2

    # trim frees cached memory only; pending and in-use bytes stay
    p.release(b, 3, 2)  # pending
    p.release(e, 0, 2)  # cached
    p.release(f, 0, 2)  # cached
    check(c1, c2, c1 + c3, 2 * c1 + c2 + c3, 2 * c1 + c2 + c3)
    p.trim()
    check(c1, c2, 0, 2 * c1 + c2 + c3, 2 * c1 + c2 + c3)
    # the pending buffer survived the trim and is reused once its submission completes
    g, _ = p.acquire(5000, 3)
    assert g == b
    check(c1 + c2, 0, 0, 2 * c1 + c2 + c3, 2 * c1 + c2 + c3)

    # reset_peak brings both peaks down to the current values, then they grow again
    p.reset_peak()
    check(c1 + c2, 0, 0, c1 + c2, c1 + c2)
    h, _ = p.acquire(70_000, 3)
    p.release(h, 0, 3)
    check(c1 + c2, 0, c3, c1 + c2 + c3, c1 + c2 + c3)


# ----------------------------------------------------------------------------------------------
# The pool on a real device


def _fresh_pool(dev):
    """Collects any pending buffers (an acquire does), then returns cached memory."""
    dev.synchronize()
    tmp = dev.empty((1,), "f32")
    del tmp
    gc.collect()
    dev.trim()


def test_device_pool_reuses_only_after_commit(dev):
    """A buffer released inside a step: on a device whose accesses are not all queue-ordered
    (Metal) it is pending until the step's submission completes (ops of the step may still read
    it); where they are (CPU, CUDA), later ops of the step run after those readers, so the step
    itself reuses it."""
    n = 777_777  # f32: 3_111_108 bytes, a class no other test uses
    cls = cs(4 * n)
    _fresh_pool(dev)
    base = _stats(dev)
    with dev.step():
        t = dev.empty((n,), "f32")
        tid = t.buffer_id
        assert dev.pool_stats()["in_use"] == base["in_use"] + cls
        del t
        st = dev.pool_stats()
        assert st["in_use"] == base["in_use"]
        t2 = dev.empty((n,), "f32")
        if dev.capabilities()["queue_ordered"]:
            assert st["pending"] == base["pending"], "a queue-ordered device has nothing to wait for in a step"
            assert t2.buffer_id == tid, "the released buffer should be reused within the step"
        else:
            assert st["pending"] == base["pending"] + cls, "a buffer released inside a step must be pending"
            assert t2.buffer_id != tid, "a buffer released inside the open step was handed out again"
    dev.synchronize()
    t3 = dev.empty((n,), "f32")
    if not dev.capabilities()["queue_ordered"]:
        assert t3.buffer_id == tid, "after the step completed, the released buffer should be reused"
    st = dev.pool_stats()
    assert st["pending"] == base["pending"]
    assert st["in_use"] == base["in_use"] + 2 * cls
    del t2, t3


def test_device_pool_pending_clears_when_step_completes(dev):
    # pool_stats: "pending (released inside an unfinished submission)": once the submission has
    # completed the bytes are no longer pending, whether or not something was allocated since.
    n = 654_321
    cls = cs(4 * n)
    _fresh_pool(dev)
    base = _stats(dev)
    with dev.step():
        t = dev.empty((n,), "f32")
        del t
        assert dev.pool_stats()["pending"] == base["pending"] + (0 if dev.capabilities()["queue_ordered"] else cls)
    dev.synchronize()
    st = dev.pool_stats()
    assert st["pending"] == base["pending"], f"stale pending bytes after synchronize: {st}"
    assert st["cached"] >= cls


def test_device_pool_in_use_tracks_class_sizes(dev):
    _fresh_pool(dev)
    base = _stats(dev)
    shapes = [((33, 7), "f16"), ((1000,), "f32"), ((5, 5, 5), "bf16"), ((3,), "i32"), ((0,), "f32"),
              ((129, 65), "f32")]
    itemsize = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4}
    live, total = [], 0
    for shape, dt in shapes:
        t = dev.empty(shape, dt)
        assert t.nbytes == int(np.prod(shape)) * itemsize[dt]
        total += cs(t.nbytes)
        live.append(t)
        assert dev.pool_stats()["in_use"] == base["in_use"] + total
    while live:
        t = live.pop()
        total -= cs(t.nbytes)
        del t
        assert dev.pool_stats()["in_use"] == base["in_use"] + total
    assert dev.pool_stats()["in_use"] == base["in_use"]


def test_device_exact_sizes_while_set(dev):
    """Device.set_exact_sizes(True) (a model's build): new tensors take their size in multiples of
    256 rather than their class, and go back to the system when released; it returns the setting
    it replaced."""
    _fresh_pool(dev)
    base = _stats(dev)
    assert dev.set_exact_sizes(True) is False
    try:
        t = dev.empty((1000, 1025), "f32")  # 4,100,000 bytes: class 4,194,304
        assert dev.pool_stats()["in_use"] == base["in_use"] + 4_100_096
    finally:
        assert dev.set_exact_sizes(False) is True
    del t
    dev.synchronize()
    u = dev.empty((3,), "f32")  # collects what completed
    assert dev.pool_stats()["reserved"] == base["reserved"] + cs(12)
    del u


def test_device_pool_peaks(dev):
    _fresh_pool(dev)
    dev.reset_peak()
    base = _stats(dev)
    assert base["peak_in_use"] == base["in_use"]
    assert base["peak_reserved"] == base["reserved"]
    ca, cb = cs(4 * 300_001), cs(2 * 123_457)
    a = dev.empty((300_001,), "f32")
    b = dev.empty((123_457,), "f16")
    st = dev.pool_stats()
    assert st["peak_in_use"] == base["in_use"] + ca + cb
    assert st["peak_reserved"] == base["reserved"] + ca + cb
    del a, b
    st = dev.pool_stats()
    assert st["in_use"] == base["in_use"]
    assert st["peak_in_use"] == base["in_use"] + ca + cb  # peaks do not come down on release
    assert st["cached"] >= ca + cb
    dev.trim()
    st = dev.pool_stats()
    assert st["reserved"] == st["in_use"] + st["pending"] + st["cached"]
    assert st["peak_reserved"] == base["reserved"] + ca + cb
    dev.reset_peak()
    st = dev.pool_stats()
    assert st["peak_in_use"] == st["in_use"] and st["peak_reserved"] == st["reserved"]


# ----------------------------------------------------------------------------------------------
# Steps


def test_steps_do_not_nest(dev):
    with dev.step():
        with pytest.raises(RuntimeError):
            with dev.step():
                pass
        assert dev.in_step  # the outer step is still open
    assert not dev.in_step
    dev.begin_step()
    with pytest.raises(RuntimeError):
        dev.begin_step()
    dev.commit()
    assert not dev.in_step


def test_commit_without_step_raises(dev):
    assert not dev.in_step
    with pytest.raises(RuntimeError):
        dev.commit()
    with pytest.raises(ValueError):
        dev.wait(dev.last_committed + 1)


def test_step_seq_increments(dev):
    t = dev.empty((4,), "f32")
    s1 = dev.step()
    assert s1.seq == 0
    with s1:
        ops.fill(t, 1.0)
        ops.fill(t, 2.0)
    assert s1.seq == dev.last_committed
    with dev.step() as s2:
        ops.fill(t, 3.0)
    assert s2.seq == s1.seq + 1
    with dev.step() as s3:
        pass
    assert s3.seq == s2.seq + 1 == dev.last_committed
    dev.synchronize()
    assert dev.completed_seq >= s3.seq
    assert t.numpy().tolist() == [3.0] * 4


def test_reading_inside_step_raises(dev):
    t = dev.zeros((3, 2), "f32")
    with dev.step():
        ops.fill(t, 4.0)
        with pytest.raises(RuntimeError):
            t.numpy()
        with pytest.raises(RuntimeError):
            np.asarray(t)
    assert np.array_equal(t.numpy(), np.full((3, 2), 4.0, np.float32))


def test_ops_outside_step_run_as_own_step(dev):
    t = dev.empty((8,), "f32")
    n0 = dev.last_committed
    ops.fill(t, 1.0)
    assert dev.last_committed == n0 + 1 and not dev.in_step
    ops.scale(t, 3.0, t)
    assert dev.last_committed == n0 + 2 and not dev.in_step
    with dev.step():
        ops.fill(t, 1.0)
        ops.scale(t, 3.0, t)
        ops.scale(t, 3.0, t)
        assert dev.last_committed == n0 + 2
    assert dev.last_committed == n0 + 3
    assert t.numpy().tolist() == [9.0] * 8


def test_failing_op_leaves_explicit_step_open(dev):
    a = dev.zeros((4, 5), "f32")
    b = dev.zeros((6, 3), "f32")
    c = dev.zeros((4, 3), "f32")
    n0 = dev.last_committed
    with dev.step():
        with pytest.raises(ValueError):
            ops.gemm(a, b, c)
        assert dev.in_step
        assert dev.last_committed == n0
        ops.fill(c, 2.0)  # the step is still usable
    assert not dev.in_step
    assert dev.last_committed == n0 + 1
    assert np.all(c.numpy() == 2.0)
    # an exception escaping the block still closes the step and propagates
    with pytest.raises(ValueError):
        with dev.step():
            ops.gemm(a, b, c)
    assert not dev.in_step
    assert dev.last_committed == n0 + 2


def test_data_dependent_error_inside_and_outside_step(dev):
    table = dev.tensor(np.arange(15, dtype=np.float32).reshape(5, 3))
    ids = dev.tensor(np.array([0, 1, 7, 2], np.int32))
    out = dev.empty((4, 3), "f32")
    with pytest.raises(ValueError) as ei:
        ops.embedding_forward(ids, table, out)
    assert str(ei.value).startswith("[embedding_forward]")
    assert "position 2" in str(ei.value)
    assert not dev.in_step  # the implicit step was closed
    with dev.step():
        with pytest.raises(ValueError):
            ops.embedding_forward(ids, table, out)
        assert dev.in_step
    assert not dev.in_step
    good = dev.tensor(np.array([4, 0, 4, 2], np.int32))
    ops.embedding_forward(good, table, out)
    assert np.array_equal(out.numpy(), np.arange(15, dtype=np.float32).reshape(5, 3)[[4, 0, 4, 2]])


# ----------------------------------------------------------------------------------------------
# Tensors


def _bf16_round(x):
    """float32 -> nearest bfloat16 (ties to even), returned as float32. NaN not handled."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    lo = u & 0xFFFF0000
    rem = u & 0xFFFF
    odd = (lo >> 16) & 1
    up = (rem > 0x8000) | ((rem == 0x8000) & (odd == 1))
    return (lo + up.astype(np.uint64) * 0x10000).astype(np.uint32).view(np.float32)


def test_tensor_roundtrip_exact(dev):
    rng = np.random.default_rng(1)
    f32 = np.concatenate([rng.standard_normal(97).astype(np.float32) * 1e3,
                          np.array([0.0, -0.0, 1e-45, -3e-39, 3.4e38, np.inf, -np.inf], np.float32)]).reshape(8, 13)
    f16 = np.concatenate([rng.standard_normal(50).astype(np.float16),
                          np.array([0.0, -0.0, 6e-8, -6.1e-5, 65504, -65504, np.inf, -np.inf], np.float16)])
    i32 = np.array([0, 1, -1, 2**31 - 1, -2**31, 123456789, -98765], np.int32).reshape(7, 1)
    for a, name, view in ((f32, "f32", np.uint32), (f16, "f16", np.uint16), (i32, "i32", np.int32)):
        t = dev.tensor(a, name)
        assert t.dtype == name and t.shape == a.shape
        back = t.numpy()
        assert back.dtype == a.dtype
        assert np.array_equal(back.view(view), a.view(view)), name
        t2 = dev.tensor(a)  # dtype inferred from the data
        assert t2.dtype == name
    assert dev.tensor(np.ones(3)).dtype == "f32"  # float64 defaults to f32
    assert dev.tensor([1, 2, 3]).dtype == "i32"


def test_tensor_bf16_round_to_nearest_even(dev):
    one = 1.0
    cases = np.array([
        one + 2.0**-8,            # tie between 1 and 1+2^-7: to even (1)
        one + 3 * 2.0**-8,        # tie between 1+2^-7 and 1+2^-6: to even (1+2^-6)
        -(one + 2.0**-8),
        one + 2.0**-8 + 2.0**-20,  # just above the tie: up
        one + 2.0**-8 - 2.0**-20,  # just below: down
        3.0, -0.0, 1e-40, 3.4e38, np.inf, -np.inf,
    ], np.float32)
    rng = np.random.default_rng(2)
    data = np.concatenate([cases, rng.standard_normal(200).astype(np.float32) * 37])
    t = dev.tensor(data, "bf16")
    assert t.dtype == "bf16"
    back = t.numpy()
    assert back.dtype == np.float32
    want = _bf16_round(data)
    assert back[0] == 1.0 and back[1] == 1.0 + 2.0**-6 and back[2] == -1.0
    assert back[3] == 1.0 + 2.0**-7 and back[4] == 1.0
    assert np.isinf(back[8]) and back[8] > 0  # 3.4e38 is above bf16's max + half an ulp
    assert np.array_equal(back.view(np.uint32), want.view(np.uint32))
    # bf16 values survive exactly
    assert np.array_equal(dev.tensor(want, "bf16").numpy().view(np.uint32), want.view(np.uint32))


def test_tensor_bad_dtype_names(dev):
    with pytest.raises(ValueError, match="f64"):
        dev.empty((2,), "f64")
    with pytest.raises(ValueError, match="float64"):
        dev.tensor([1.0, 2.0], np.float64)
    with pytest.raises(ValueError, match="quarter"):
        dev.zeros((2, 2), "quarter")


def test_from_numpy_is_zero_copy(dev):
    if not dev.capabilities()["host_visible"]:
        pytest.skip(f"{dev.name} memory is not host-visible; from_numpy is documented to refuse")
    a = np.zeros((4, 6), np.float32)
    t = dev.from_numpy(a)
    assert t.shape == (4, 6) and t.dtype == "f32" and t.buffer_id == 0
    ops.fill(t, 2.5)
    dev.synchronize()
    assert np.all(a == 2.5), "an op writing a from_numpy tensor must be visible in the array"
    a[1, 2] = 9.0
    out = dev.empty((4, 6), "f32")
    ops.scale(t, 2.0, out)
    assert out.numpy()[1, 2] == 18.0 and out.numpy()[0, 0] == 5.0
    h = np.zeros(5, np.float16)
    th = dev.from_numpy(h)
    assert th.dtype == "f16"
    ops.fill(th, 1.5)
    dev.synchronize()
    assert np.all(h == 1.5)
    i = np.zeros(3, np.int32)
    ops.fill(dev.from_numpy(i), 7)
    dev.synchronize()
    assert i.tolist() == [7, 7, 7]
    with pytest.raises(ValueError):
        dev.from_numpy(np.zeros(3, np.float64))


def test_from_numpy_non_contiguous_is_not_silently_copied(dev):
    # The contract is a zero-copy view of a C-contiguous array. A strided array must be refused
    # (TypeError/ValueError), never silently copied so that writes are lost.
    if not dev.capabilities()["host_visible"]:
        pytest.skip("not host-visible")
    base = np.zeros((4, 8), np.float32)
    strided = base[:, ::2]
    try:
        t = dev.from_numpy(strided)
    except (TypeError, ValueError):
        return
    ops.fill(t, 1.0)
    dev.synchronize()
    assert np.all(strided == 1.0), "from_numpy accepted a strided array but wrote to a hidden copy"


def test_tensor_numpy_is_a_view(dev):
    if not dev.capabilities()["host_visible"]:
        pytest.skip("not host-visible")
    t = dev.tensor(np.ones(6, np.float32))
    v = t.numpy()
    v[2] = 7.0
    out = dev.empty((6,), "f32")
    ops.scale(t, 2.0, out)
    assert out.numpy().tolist() == [2.0, 2.0, 14.0, 2.0, 2.0, 2.0]
    ops.fill(t, 3.0)
    dev.synchronize()
    assert v.tolist() == [3.0] * 6  # the earlier view sees the op's write
    h = dev.tensor(np.zeros(4, np.float16))
    hv = h.numpy()
    hv[:] = 0.5
    outh = dev.empty((4,), "f16")
    ops.scale(h, 4.0, outh)
    assert outh.numpy().tolist() == [2.0] * 4


def test_tensor_views(dev):
    a = np.arange(30, dtype=np.float32).reshape(5, 6)
    t = dev.tensor(a)
    assert t.is_contiguous() and t.offset == 0 and t.strides == [6, 1] and len(t) == 5
    r = t[1:4]
    assert r.shape == (3, 6) and r.is_contiguous()
    assert r.offset == 1 * 6 * 4
    assert r.buffer_id == t.buffer_id
    assert np.array_equal(r.numpy(), a[1:4])
    r2 = t[-2:]
    assert r2.offset == 3 * 6 * 4 and np.array_equal(r2.numpy(), a[3:])
    row = t[2]
    assert row.shape == (6,) and row.offset == 2 * 6 * 4 and np.array_equal(row.numpy(), a[2])
    col = t[:, 2:4]
    assert col.shape == (5, 2) and not col.is_contiguous()
    assert col.offset == 2 * 4
    assert np.array_equal(col.numpy(), a[:, 2:4])
    assert t[:, 0:6].is_contiguous()
    tt = t.T
    assert tt.shape == (6, 5) and not tt.is_contiguous() and tt.strides == [1, 6]
    assert np.array_equal(tt.numpy(), a.T)
    assert np.array_equal(t[1:4].T.numpy(), a[1:4].T)
    # ops read a row slice at its offset
    out = dev.empty((3, 6), "f32")
    ops.scale(r, 1.0, out)
    assert np.array_equal(out.numpy(), a[1:4])
    ops.fill(t[4], -1.0)
    assert np.array_equal(t.numpy()[4], np.full(6, -1.0, np.float32))
    assert np.array_equal(t.numpy()[:4], a[:4])
    with pytest.raises(IndexError):
        t[5]
    with pytest.raises(IndexError):
        t[0, 0, 0]
    with pytest.raises(IndexError):
        t[::2]


def test_tensor_reshape(dev):
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = dev.tensor(a)
    assert t.reshape(-1).shape == (24,)
    assert t.reshape(3, -1).shape == (3, 8)
    assert t.reshape((2, -1, 3)).shape == (2, 4, 3)
    assert t.reshape([-1, 12]).shape == (2, 12)
    assert np.array_equal(t.reshape(3, -1).numpy(), a.reshape(3, 8))
    assert t.reshape(-1).buffer_id == t.buffer_id
    assert np.array_equal(t[1:3].reshape(-1).numpy(), a[1:3].reshape(-1))
    assert t[1:3].reshape(-1).offset == 6 * 4
    for bad in ((5, -1), (-1, -1), (7, 3), (-2, 12)):
        with pytest.raises(ValueError):
            t.reshape(*bad)
    with pytest.raises(ValueError):
        t.T.reshape(-1)
    with pytest.raises(ValueError):
        t[:, 1:3].reshape(-1)
    # a view may split one dimension in two: rows of a column block (B T, n) -> (B, T, n), or a
    # column block's columns (S, m n) -> (S, m, n) (krnl.models.sample_sums' per-sample GEMMs)
    v = t[:, 1:5]                                                       # (4, 4) at row stride 6
    for shape, strides in (((2, 2, 4), (12, 6, 1)), ((4, 2, 2), (6, 2, 1))):
        w = v.reshape(*shape)
        assert tuple(w.shape) == shape and tuple(w.strides) == strides and w.buffer_id == t.buffer_id
        assert np.array_equal(w.numpy(), a[:, 1:5].reshape(shape))
    for bad in ((2, 8), (8, 2, 1), (2, 2, 2, 2)):
        with pytest.raises(ValueError, match=r"\[reshape\] tensor is not contiguous \(a view can only split one "):
            v.reshape(*bad)


def test_storage_lifetimes(dev):
    if not dev.capabilities()["host_visible"]:
        pytest.skip("not host-visible")
    a = np.arange(5000, dtype=np.float32)
    base = _stats(dev)["in_use"]
    t = dev.tensor(a)
    cls = cs(t.nbytes)
    assert _stats(dev)["in_use"] == base + cls
    v = t.numpy()
    del t
    assert _stats(dev)["in_use"] == base + cls, "the numpy view must keep the buffer alive"
    assert np.array_equal(v, a)
    v2 = v[10:20]
    del v
    assert _stats(dev)["in_use"] == base + cls
    assert np.array_equal(v2, a[10:20])
    del v2
    assert _stats(dev)["in_use"] == base
    # and the tensor outlives its views
    t = dev.tensor(a)
    w = t.numpy()
    del w
    gc.collect()
    assert np.array_equal(t.numpy(), a)
    sub = t[100:200]
    del t
    gc.collect()
    assert np.array_equal(sub.numpy(), a[100:200])
    assert _stats(dev)["in_use"] == base + cls
    del sub
    assert _stats(dev)["in_use"] == base
    # a from_numpy tensor keeps its array alive
    arr = np.arange(64, dtype=np.float32)
    tw = dev.from_numpy(arr)
    del arr
    gc.collect()
    junk = [np.full(64, -5.0, np.float32) for _ in range(50)]  # would reuse freed memory
    assert np.array_equal(tw.numpy(), np.arange(64, dtype=np.float32))
    del junk, tw


def test_repr(dev):
    assert repr(dev) == f"krnl.device('{dev.name}')"
    t = dev.empty((31, 64), "f16")
    assert repr(t) == f"krnl.Tensor(f16 (31, 64) on {dev.name})"
    assert repr(dev.empty((5,), "i32")) == f"krnl.Tensor(i32 (5,) on {dev.name})"
    assert repr(t.T) == f"krnl.Tensor(f16 (64, 31) non-contiguous on {dev.name})"
    assert t.device.name == dev.name


def test_devices_registry():
    names = krnl.devices()
    assert "cpu" in names
    assert len(set(names)) == len(names)
    assert krnl.device().name == names[0]
    for n in names:
        assert krnl.device(n).name == n
    with pytest.raises(ValueError) as ei:
        krnl.device("nope")
    msg = str(ei.value)
    assert "nope" in msg
    for n in names:
        assert n in msg
    with pytest.raises(TypeError):
        krnl.device(3)


# ----------------------------------------------------------------------------------------------
# Validation: ValueError "[op] ..." and nothing crashes


def _bad_calls(dev):
    """(op name, thunk, substring expected in the message or None) for invalid calls."""
    z = lambda shape, dt="f32": dev.zeros(shape, dt)
    x48 = z((4, 8))
    ids = dev.tensor(np.array([0, 1, 7, 2], np.int32))
    cases = [
        ("gemm", lambda: ops.gemm(z((4, 5)), z((6, 3)), z((4, 3))), "inner"),
        ("gemm", lambda: ops.gemm(z((4, 5)), z((5, 3)), z((4, 4))), None),
        ("gemm", lambda: ops.gemm(z((4, 5)), z((3, 5)), z((4, 3))), "inner"),  # trans_b forgotten
        ("gemm", lambda: ops.gemm(z((4, 5), "f16"), z((5, 3)), z((4, 3))), "f16"),
        ("gemm", lambda: ops.gemm(z((4, 5)), z((5, 3)), z((4, 3), "f16")), None),
        ("gemm", lambda: ops.gemm(z((4, 5), "i32"), z((5, 3), "i32"), z((4, 3), "i32")), None),
        ("gemm", lambda: ops.gemm(z((5, 4)).T, z((5, 3)), z((4, 3))), "contiguous"),
        # Row-strided 2-D views (column blocks) are valid GEMM operands, but only unbatched.
        ("gemm", lambda: ops.gemm(x48[:, :5], z((5, 3)), z((2, 4, 3)), batch=2, stride_a=5), "row-strided"),
        ("gemm", lambda: ops.gemm(z((2, 4, 5)), z((5, 3)), z((4, 8))[:, 2:5], batch=2), "row-strided"),
        ("gemm", lambda: ops.gemm(z((4, 64)), z((64, 3)), z((4, 3)), split_k=3), "split_k"),
        ("gemm", lambda: ops.gemm(z((2, 4, 5)), z((2, 5, 3)), z((2, 4, 3)), batch=2, stride_c=0), "overlap"),
        ("gemm", lambda: ops.gemm(z((2, 4, 5)), z((2, 5, 3)), z((2, 4, 3)), batch=2, stride_c=6), "overlap"),
        ("gemm", lambda: ops.gemm(z((2, 4, 5)), z((2, 5, 3)), z((2, 4, 3)), batch=3), None),
        ("gemm", lambda: ops.gemm(z((4, 5)), z((5, 3)), z((4, 3)), batch=0), None),
        ("rmsnorm_forward", lambda: ops.rmsnorm_forward(x48[:, :6], z((6,)), z((4, 6)), z((4,))), "contiguous"),
        ("rmsnorm_forward", lambda: ops.rmsnorm_forward(x48, z((7,)), z((4, 8)), z((4,))), None),
        ("rmsnorm_forward", lambda: ops.rmsnorm_forward(x48, z((8,)), z((4, 8)), z((4,), "f16")), None),
        ("rmsnorm_forward", lambda: ops.rmsnorm_forward(z((4, 8), "i32"), z((8,), "i32"), z((4, 8), "i32"), z((4,))), None),
        ("swiglu_forward", lambda: ops.swiglu_forward(z((3, 4)), z((3, 4), "f16"), z((3, 4))), None),
        ("swiglu_forward", lambda: ops.swiglu_forward(z((3, 4)), z((3, 5)), z((3, 4))), None),
        ("add", lambda: ops.add(z((3, 4)), z((4, 3)), z((3, 4))), None),
        ("cross_entropy", lambda: ops.cross_entropy(z((3, 5), "i32"), z((3,), "i32"), z((3,))), None),
        ("cross_entropy", lambda: ops.cross_entropy(z((3, 5)), z((3,), "f32"), z((3,))), None),
        ("rope", lambda: ops.rope(z((2, 4, 8)), z((4,), "i32"), z((4,)), 0.5), "sign"),
        ("rope", lambda: ops.rope(z((2, 4, 8)), z((4,), "i32"), z((5,)), 1.0), None),
        ("dropout", lambda: ops.dropout(z((10,)), z((10,)), 1.0, 0), None),
        ("dropout", lambda: ops.dropout(z((10,)), z((10,)), -0.1, 0), None),
        ("adamw_update", lambda: ops.adamw_update(z((6,)), z((6,)), z((6,)), z((6,)), 1e-3, step=0), "step"),
        ("adamw_update", lambda: ops.adamw_update(z((6,)), z((5,)), z((6,)), z((6,)), 1e-3), None),
        ("adamw_update", lambda: ops.adamw_update(z((6,), "f16"), z((6,), "f16"), z((6,)), z((6,)), 1e-3), None),
        ("softmax_causal_forward", lambda: ops.softmax_causal_forward(z((5, 4)), z((5, 4)), 1.0), None),
        ("sumsq", lambda: ops.sumsq(z((5,)), z((2,))), None),
        ("cast", lambda: ops.cast(z((5,)), z((5,), "i32")), None),
        ("embedding_forward", lambda: ops.embedding_forward(ids, z((5, 3)), z((4, 3))), "position 2"),
    ]
    return cases


def test_bad_calls_raise_value_error_naming_the_op(dev):
    for i, (op, thunk, needle) in enumerate(_bad_calls(dev)):
        with pytest.raises(ValueError) as ei:
            thunk()
        msg = str(ei.value)
        assert msg.startswith(f"[{op}]"), f"case {i}: {msg!r}"
        if needle:
            assert needle in msg, f"case {i}: {msg!r} does not mention {needle!r}"
        assert not dev.in_step, f"case {i} left a step open"


def _run_bad_calls(dev, inside_step):
    """Runs every bad call (in one explicit step or each on its own); returns the ops that did not raise."""
    missed = []

    def go():
        for op, thunk, _needle in _bad_calls(dev):
            try:
                thunk()
            except ValueError:
                pass
            else:
                missed.append(op)

    if inside_step:
        with dev.step():
            go()
            assert dev.in_step
    else:
        go()
    return missed


def test_nothing_crashes_after_bad_calls(dev):
    base = _stats(dev)["in_use"]
    n0 = dev.last_committed
    assert _run_bad_calls(dev, inside_step=False) == []
    assert not dev.in_step
    assert _run_bad_calls(dev, inside_step=True) == []
    assert not dev.in_step
    assert dev.last_committed > n0
    # a normal op still works
    a = dev.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    b = dev.tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    c = dev.empty((2, 4), "f32")
    ops.gemm(a, b, c)
    assert np.array_equal(c.numpy(), np.arange(6.0).reshape(2, 3) @ np.arange(12.0).reshape(3, 4))
    del a, b, c
    assert _stats(dev)["in_use"] == base


# ----------------------------------------------------------------------------------------------
# Split-K planner


def _brute_split(M, N, K, batch, tile_m, tile_n, min_tiles, k_unit, max_splits, min_k):
    if min_tiles <= 0:
        return (1, K)
    tiles = math.ceil(M / tile_m) * math.ceil(N / tile_n) * batch
    if tiles >= min_tiles:
        return (1, K)
    valid = [s for s in range(2, max_splits + 1)
             if K % s == 0 and (K // s) % k_unit == 0 and K // s >= min_k]
    reach = [s for s in valid if tiles * s >= min_tiles]
    if reach:
        s = min(reach)
    elif valid:
        s = max(valid)
    else:
        s = 1
    return (s, K // s)


def test_plan_split_k_hand_cases():
    kw = dict(tile_m=32, tile_n=32, k_unit=32, max_splits=16, min_k_per_split=256)
    # never split when disabled or when the output already has enough tiles
    assert _core.testing.plan_split_k(32, 32, 4096, min_tiles=0, **kw) == (1, 4096)
    assert _core.testing.plan_split_k(256, 256, 4096, min_tiles=64, **kw) == (1, 4096)  # 64 tiles
    assert _core.testing.plan_split_k(256, 256, 4096, min_tiles=65, **kw) == (2, 2048)
    # one tile, target 4: four slices of 1024
    assert _core.testing.plan_split_k(32, 32, 4096, min_tiles=4, **kw) == (4, 1024)
    # target 3 on K=4096: 3 does not divide, smallest reaching split is 4
    assert _core.testing.plan_split_k(32, 32, 4096, min_tiles=3, **kw) == (4, 1024)
    # batch counts towards the tiles
    assert _core.testing.plan_split_k(32, 32, 4096, batch=4, min_tiles=4, **kw) == (1, 4096)
    # K=768, target 8: 8 slices would be 96 < 256; largest equal split below the target is 3
    assert _core.testing.plan_split_k(32, 32, 768, min_tiles=8, **kw) == (3, 256)
    # prime K: no equal split at all
    assert _core.testing.plan_split_k(1, 1, 8191, min_tiles=100, tile_m=32, tile_n=32, k_unit=1, max_splits=16,
                              min_k_per_split=1) == (1, 8191)
    # slices must be multiples of k_unit: K=4160=65*64, k_unit 64 -> 5 slices of 832 (13*64)
    assert _core.testing.plan_split_k(16, 16, 4160, min_tiles=4, tile_m=32, tile_n=32, k_unit=64, max_splits=8,
                              min_k_per_split=512) == (5, 832)


def test_plan_split_k_properties():
    rng = np.random.default_rng(3)
    for _ in range(3000):
        M, N = int(rng.integers(1, 300)), int(rng.integers(1, 300))
        K = int(rng.choice([int(rng.integers(1, 20000)), 64 * int(rng.integers(1, 200)), 8191, 1 << 14]))
        batch = int(rng.integers(1, 4))
        tile_m, tile_n = int(rng.choice([16, 32, 64])), int(rng.choice([16, 32, 64]))
        min_tiles = int(rng.choice([0, 1, 4, 8, 20, 64, 200]))
        k_unit = int(rng.choice([1, 8, 32, 64]))
        max_splits = int(rng.integers(2, 17))
        min_k = int(rng.choice([1, 64, 256, 512]))
        got = _core.testing.plan_split_k(M, N, K, batch=batch, tile_m=tile_m, tile_n=tile_n, min_tiles=min_tiles,
                                 k_unit=k_unit, max_splits=max_splits, min_k_per_split=min_k)
        s, kp = got
        assert s * kp == K
        if s > 1:
            assert kp % k_unit == 0 and kp >= min_k and s <= max_splits
        want = _brute_split(M, N, K, batch, tile_m, tile_n, min_tiles, k_unit, max_splits, min_k)
        assert got == want, (M, N, K, batch, tile_m, tile_n, min_tiles, k_unit, max_splits, min_k)


def test_gemm_plan_uses_device_config(dev):
    cfg = dev.split_k_config
    A, B, C = dev.empty((8, 64)), dev.empty((64, 8)), dev.empty((8, 8))
    assert ops.gemm_plan(A, B, C, split_k=1) == (1, 64)
    assert ops.gemm_plan(A, B, C, split_k=2) == (2, 32)
    with pytest.raises(ValueError, match=r"^\[gemm\]"):
        ops.gemm_plan(A, B, C, split_k=3)
    M, N, K = 8, 8, cfg["k_unit"] * cfg["min_k_per_split"] * 2
    A, B, C = dev.empty((M, K)), dev.empty((K, N)), dev.empty((M, N))
    want = _brute_split(M, N, K, 1, cfg["tile_m"], cfg["tile_n"], cfg["min_tiles"], cfg["k_unit"],
                        cfg["max_splits"], cfg["min_k_per_split"])
    assert ops.gemm_plan(A, B, C) == want


# ----------------------------------------------------------------------------------------------
# CPU/GPU row-split planner


def _check_row_split(M, t_cpu, t_gpu, overhead, tile_m):
    r = _core.testing.plan_row_split(M, t_cpu, t_gpu, overhead, tile_m)
    p = r["cpu_fraction"]
    assert 0.0 <= p <= 1.0
    assert r["cpu_rows"] + r["gpu_rows"] == M
    assert 0 <= r["cpu_rows"] <= M
    assert r["cpu_rows"] % tile_m == 0 or r["cpu_rows"] == M
    assert abs(r["cpu_rows"] - p * M) <= tile_m / 2 + 1e-9
    return r


def test_plan_row_split_balances_both_engines():
    rng = np.random.default_rng(4)
    for _ in range(2000):
        M = int(rng.integers(0, 5000))
        tile_m = int(rng.choice([1, 8, 32, 64]))
        t_cpu = float(rng.uniform(0.1, 50))
        t_gpu = float(rng.uniform(0.1, 50))
        overhead = float(rng.choice([0.0, rng.uniform(0, 2 * t_cpu)]))
        r = _check_row_split(M, t_cpu, t_gpu, overhead, tile_m)
        p = r["cpu_fraction"]
        if overhead < t_cpu:  # not clamped: both finish together at the unrounded fraction
            assert 0 < p < 1
            assert p * t_cpu == pytest.approx(overhead + (1 - p) * t_gpu, rel=1e-12, abs=1e-12)
        else:
            assert p == 1.0 and r["cpu_rows"] == M and r["gpu_rows"] == 0


def test_plan_row_split_hand_cases():
    # equal engines, no overhead: half each
    r = _core.testing.plan_row_split(512, 10.0, 10.0, 0.0, 32)
    assert r["cpu_fraction"] == 0.5 and r["cpu_rows"] == 256 and r["gpu_rows"] == 256
    # CPU 3x slower, no overhead: p = 1/4
    r = _core.testing.plan_row_split(512, 30.0, 10.0, 0.0, 32)
    assert r["cpu_fraction"] == pytest.approx(0.25) and r["cpu_rows"] == 128
    # overhead 2, t_cpu 8, t_gpu 4: p = 6/12
    r = _core.testing.plan_row_split(100, 8.0, 4.0, 2.0, 8)
    assert r["cpu_fraction"] == pytest.approx(0.5)
    assert r["cpu_rows"] in (48, 56) and r["cpu_rows"] + r["gpu_rows"] == 100
    # overhead at least the CPU's whole time: everything on the CPU
    for o in (5.0, 7.5):
        r = _core.testing.plan_row_split(1000, 5.0, 1.0, o, 64)
        assert r["cpu_fraction"] == 1.0 and r["cpu_rows"] == 1000 and r["gpu_rows"] == 0
    # GPU much faster: (almost) nothing on the CPU
    r = _core.testing.plan_row_split(4096, 100.0, 0.01, 0.0, 32)
    assert r["cpu_fraction"] < 1e-3 and r["cpu_rows"] == 0 and r["gpu_rows"] == 4096
    # M not a multiple of the tile: all-CPU still means all M rows (no partial GPU tile)
    r = _core.testing.plan_row_split(90, 5.0, 1.0, 6.0, 64)
    assert r["cpu_fraction"] == 1.0
    assert r["cpu_rows"] == 90 and r["gpu_rows"] == 0, r
    r = _core.testing.plan_row_split(0, 1.0, 1.0, 0.0, 32)
    assert r["cpu_rows"] == 0 and r["gpu_rows"] == 0


@pytest.mark.parametrize("args", [
    (-1, 1.0, 1.0, 0.0, 32),
    (100, 1.0, 1.0, 0.0, 0),
    (100, 1.0, 1.0, 0.0, -8),
    (100, 0.0, 1.0, 0.0, 32),
    (100, 1.0, 0.0, 0.0, 32),
    (100, -1.0, 1.0, 0.0, 32),
    (100, 1.0, 1.0, -0.5, 32),
    (100, float("nan"), 1.0, 0.0, 32),
    (100, 1.0, float("nan"), 0.0, 32),
    (100, 1.0, 1.0, float("nan"), 32),
])
def test_plan_row_split_bad_arguments(args):
    with pytest.raises(ValueError, match=r"^\[plan_row_split\]"):
        _core.testing.plan_row_split(*args)


# ----------------------------------------------------------------------------------------------
# Profiler


def test_profile_records_each_op(dev):
    M, N, K = 5, 7, 3
    A = dev.tensor(np.ones((M, K), np.float32))
    B = dev.tensor(np.ones((K, N), np.float32))
    C = dev.zeros((M, N), "f32")
    D = dev.zeros((M, N), "f32")
    _core.clear_profile(dev)
    with krnl.profile(dev) as prof:
        ops.gemm(A, B, C)
        with dev.step():
            ops.add(C, C, D)
            ops.gemm(A, B, C, alpha=2.0)
        ops.fill(D, 1.0)
    names = [r["op"] for r in prof.records]
    assert names == ["gemm", "add", "gemm", "fill"]
    gemms = [r for r in prof.records if r["op"] == "gemm"]
    assert all(r["flops"] == 2 * M * N * K for r in gemms)
    assert all(r["dtype"] == "f32" for r in prof.records)
    assert all(r["ms"] >= 0 for r in prof.records)
    assert prof.op_ms <= prof.wall_ms
    rows = prof.rows()
    gemm_rows = [g for g in rows if g["op"] == "gemm"]
    assert sum(g["calls"] for g in gemm_rows) == 2
    assert sum(g["calls"] for g in rows) == 4
    table = prof.table()
    for op in ("gemm", "add", "fill"):
        assert op in table
    assert dev.name in table
    assert np.all(C.numpy() == 2 * K)


def test_no_records_outside_profiling(dev):
    t = dev.zeros((4,), "f32")
    _core.clear_profile(dev)
    with krnl.profile(dev) as prof:
        ops.fill(t, 1.0)
    assert len(prof.records) == 1
    ops.fill(t, 2.0)
    ops.scale(t, 2.0, t)
    assert list(_core.profile_records(dev)) == []
    with dev.step():
        with pytest.raises(RuntimeError):
            krnl.profile(dev).__enter__()


def test_ops_reject_operands_on_another_device():
    a = krnl.device("cpu").tensor(np.ones((4, 8), np.float32))
    b = krnl.device("cpu:1").tensor(np.ones((8, 8), np.float32))
    c = krnl.device("cpu").empty((4, 8))
    with pytest.raises(ValueError, match=r"^\[gemm\] B is on cpu:1 but the other operands are on cpu"):
        ops.gemm(a, b, c)
    y = krnl.device("cpu:1").empty((4, 8))
    with pytest.raises(ValueError, match=r"^\[add\] out is on cpu:1"):
        ops.add(a, a, y)


def test_every_op_of_the_list_is_bound():
    # csrc/core/op_list.h is the one op list in C++; the bindings are written by hand (argument
    # names, defaults, docstrings), so this is what keeps them from drifting apart.
    listed = list(_core.testing.op_names())
    assert len(listed) == len(set(listed)) and "gemm" in listed
    bound = {n for n in dir(ops) if not n.startswith("_") and callable(getattr(ops, n))}
    assert sorted(set(listed) - bound) == [], "ops of op_list.h missing from krnl._core.ops"
    # gemm_plan is gemm's routing decision, an entry point of the core but not an op of a backend
    assert sorted(bound - set(listed)) == ["gemm_plan"]
