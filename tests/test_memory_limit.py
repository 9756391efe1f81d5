"""The pool's memory ceiling (csrc/core/buffer_pool.*, docs/architecture.md 'Memory'): an
allocation that would take a device's pool past its limit fails with one line naming the request,
the limit and where the limit came from, and leaves the pool as it was. The limit is the Metal
GPU's recommended working set by default (metal-sim stands for a GPU with a small one here),
KRNL_MAX_MEMORY or Device.set_memory_limit otherwise."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import krnl
from krnl import _core, ops

from conftest import METAL_SIM, METAL_SIM_FAMILY

HostBufferPool = _core.testing.HostBufferPool
cs = HostBufferPool.class_size
MiB = 1 << 20


@pytest.mark.parametrize("text, expect", [
    ("1048576", 1 << 20), ("0", 0), ("off", 0), ("None", 0), ("24G", 24 << 30), ("24GiB", 24 << 30),
    ("24 gb", 24 << 30), ("1.5G", 3 << 29), ("800M", 800 << 20), ("64k", 64 << 10), ("2T", 2 << 40), ("512B", 512),
])
def test_parse_size(text, expect):
    assert _core.testing.parse_size(text) == expect


@pytest.mark.parametrize("text", ["", "G", "12X", "1.2.3G", "-5G", "lots", "1e99T"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match=r"^\[parse_size\] cannot read '.*' as a size"):
        _core.testing.parse_size(text)


def test_pool_limit_refuses_and_stays_usable():
    p = HostBufferPool()
    p.set_limit(3 * MiB, "a test's limit")
    a, ca = p.acquire(2 * MiB, 0)
    before = p.stats()
    with pytest.raises(RuntimeError) as e:
        p.acquire(2 * MiB, 0)
    msg = str(e.value)
    assert "\n" not in msg
    assert "a request of 2.0 MiB" in msg and "limit of 3.0 MiB" in msg and "a test's limit" in msg, msg
    assert "KRNL_MAX_MEMORY" in msg
    assert p.stats() == before  # nothing allocated, nothing lost
    p.release(a, 0, 0)
    b, cb = p.acquire(2 * MiB, 0)  # the released buffer serves it
    assert b == a and p.stats()["reserved"] == ca


def test_pool_limit_gives_cached_memory_back_first():
    p = HostBufferPool()
    p.set_limit(4 * MiB, "a test's limit")
    a, ca = p.acquire(3 * MiB, 0)
    p.release(a, 0, 0)  # cached, still reserved
    assert p.stats()["cached"] == ca
    b, cb = p.acquire(2 * MiB + 1, 0)  # another class: fits once the cached buffer is freed
    assert b != a
    st = p.stats()
    assert st["cached"] == 0 and st["reserved"] == cb == st["in_use"]


def test_pool_limit_gives_back_only_what_the_request_needs():
    # the largest cached class first, and no more: the small buffer stays for its class's next request
    p = HostBufferPool()
    p.set_limit(8 * MiB, "a test's limit")
    small, cs_ = p.acquire(1 * MiB, 0)
    big, cb = p.acquire(4 * MiB, 0)
    held, ch = p.acquire(2 * MiB, 0)
    p.release(small, 0, 0)
    p.release(big, 0, 0)
    c, cc = p.acquire(3 * MiB, 0)  # 7 MiB reserved + 3 > 8: the 4 MiB buffer goes, the 1 MiB one stays
    st = p.stats()
    assert st["cached"] == cs_ and st["reserved"] == cs_ + ch + cc, st
    again, _ = p.acquire(1 * MiB, 0)
    assert again == small


def test_pool_limit_counts_pending_buffers():
    # A buffer released inside an unfinished submission may still be read by the device: it
    # counts until that submission completes, then it is cached and can be given back.
    p = HostBufferPool()
    p.set_limit(3 * MiB, "a test's limit")
    a, _ = p.acquire(2 * MiB, 0)
    p.release(a, 5, 4)
    with pytest.raises(RuntimeError, match=r"2\.0 MiB waiting for the device"):
        p.acquire(3 * MiB // 2 + 1, 4)
    b, _ = p.acquire(3 * MiB // 2 + 1, 5)
    assert b != a and p.stats()["reserved"] == cs(3 * MiB // 2 + 1)


def test_pool_without_limit_allocates_past_any_size():
    p = HostBufferPool()
    p.set_limit(1 * MiB, "x")
    p.set_limit(0, "ignored")
    a, _ = p.acquire(4 * MiB, 0)
    assert p.stats()["reserved"] == cs(4 * MiB)


def test_device_set_memory_limit_on_cpu():
    dev = _core.testing.register_second_cpu() or krnl.device("cpu:1")
    try:
        dev.synchronize()
        dev.trim()
        held = dev.pool_stats()["reserved"]
        dev.set_memory_limit(held + 3 * MiB)
        assert dev.memory_limit == {"bytes": held + 3 * MiB, "origin": "set by Device.set_memory_limit"}
        x = dev.empty((MiB // 2,), "f32")  # 2 MiB
        with pytest.raises(RuntimeError, match=r"^\[alloc\] cpu:1: a request of 2\.0 MiB .*set by Device\.set_memory_limit"):
            dev.empty((MiB // 2,), "f32")
        del x
        dev.empty((MiB // 2,), "f32")  # the freed buffer is there again
        dev.set_memory_limit("1G")
        assert dev.memory_limit["bytes"] == 1 << 30
        for bad in (-1, 2.5, [1]):
            with pytest.raises(ValueError, match=r"^\[set_memory_limit\] takes bytes"):
                dev.set_memory_limit(bad)
        assert dev.memory_limit["bytes"] == 1 << 30
    finally:
        dev.set_memory_limit(None)
    assert dev.memory_limit == {"bytes": 0, "origin": ""}


@pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")
def test_metal_working_set_is_the_default_limit():
    sim = krnl.device("metal-sim")
    sim.synchronize()
    sim.trim()
    assert sim.memory_limit["bytes"] == 0  # the suite's made-up GPU gives no working set
    held = sim.pool_stats()["reserved"]
    ws = held + 8 * MiB
    _core.testing.metal_sim_set_gpu(9, ws)
    try:
        lim = sim.memory_limit
        assert lim["bytes"] == ws and "recommendedMaxWorkingSetSize" in lim["origin"], lim
        keep = sim.empty((5 * MiB // 4,), "f32")  # 5 MiB
        before = sim.pool_stats()
        with pytest.raises(RuntimeError) as e:
            sim.zeros((1 << 20,), "f32")  # 4 MiB more: past 8 MiB
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("[alloc] metal-sim: a request of 4.0 MiB"), msg
        assert "recommended working set" in msg and f"limit of {ws / MiB:.1f} MiB" in msg, msg
        after = sim.pool_stats()
        # nothing in use was lost; cached buffers may have been given back before the refusal
        assert after["in_use"] == before["in_use"] and after["reserved"] <= before["reserved"]
        # The device still works: a smaller tensor runs an op, and the freed memory is usable.
        y = sim.zeros((1 << 18,), "f32")
        sim.synchronize()
        assert float(y.numpy().sum()) == 0.0
        del keep, y
        sim.synchronize()
        z = sim.zeros((1 << 20,), "f32")
        sim.synchronize()
        assert z.numpy().shape == (1 << 20,)
        del z
    finally:
        _core.testing.metal_sim_set_gpu(METAL_SIM_FAMILY)  # the suite's GPU: no working set
    assert sim.memory_limit["bytes"] == 0


@pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")
def test_metal_limit_waits_for_committed_work_before_refusing():
    # A buffer released after its step was committed serves later requests of its class at once,
    # but goes back to the system only once the step completes (on metal-sim, by default, only
    # once someone waits for it). An allocation past the limit waits for that work, gives the
    # buffer back, and succeeds.
    sim = krnl.device("metal-sim")
    sim.synchronize()
    sim.trim()
    held = sim.pool_stats()["reserved"]
    _core.testing.metal_sim_set_gpu(METAL_SIM_FAMILY, held + 10 * MiB)
    try:
        a = sim.empty((5 * MiB // 4,), "f32")  # 5 MiB
        with sim.step() as s:
            ops.fill(a, 1.0)
        del a
        assert sim.completed_seq < s.seq and sim.pool_stats()["cached"] >= 5 * MiB
        b = sim.zeros((6 * MiB // 4,), "f32")  # 6 MiB: fits once the step's buffer is back
        assert sim.completed_seq >= s.seq
        st = sim.pool_stats()
        assert st["pending"] == 0 and st["reserved"] <= held + 10 * MiB, st
        sim.synchronize()
        assert float(b.numpy().max()) == 0.0
        # The open step's own released buffers cannot come back yet: there, the refusal stands.
        with pytest.raises(RuntimeError, match=r"a request of 2\.0 MiB .* 3\.0 MiB waiting for the device"):
            with sim.step():
                c = sim.empty((3 * MiB // 4,), "f32")
                ops.fill(c, 2.0)
                del c
                sim.empty((MiB // 2,), "f32")
        del b
    finally:
        sim.synchronize()
        _core.testing.metal_sim_set_gpu(METAL_SIM_FAMILY)


def test_krnl_max_memory_env_sets_every_device_limit():
    # the krnl this suite imports (installed, or python/ of a developer build), not the source tree's
    path = [str(Path(krnl.__file__).resolve().parents[1])] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = dict(os.environ, KRNL_MAX_MEMORY="3M", PYTHONPATH=os.pathsep.join(path))
    code = ("import krnl\n"
            "d = krnl.device('cpu')\n"
            "print(d.memory_limit)\n"
            "x = d.empty((1 << 19,), 'f32')\n"
            "try:\n"
            "    d.empty((1 << 19,), 'f32')\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == str({"bytes": 3 << 20, "origin": "set by KRNL_MAX_MEMORY"})
    assert lines[1].startswith("[alloc] cpu: a request of 2.0 MiB would take the pool to 4.0 MiB, past its limit "
                               "of 3.0 MiB (set by KRNL_MAX_MEMORY"), lines[1]

    env["KRNL_MAX_MEMORY"] = "plenty"
    r = subprocess.run([sys.executable, "-c", "import krnl; krnl.device('cpu')"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "[KRNL_MAX_MEMORY] cannot read 'plenty' as a size" in r.stderr, r.stderr
