"""The Metal device's library compiles (csrc/metal/library_cache.h, device.mm): every library of
metal/ compiles on a background thread from the device's creation, an op waits only for the one
it needs (compiling it itself when nobody has started it), each compiles once however many
threads ask, and a library that does not compile fails every op that needs it, in one line
naming the op and the library. The cache runs here over a fake compiler (LibraryCacheProbe);
device.mm runs the same code with Metal's. Device.compile_libraries is "metal"-only: krnl doctor
calls it on a Mac; here every other device must refuse it clearly."""
import threading
import time

import pytest

import krnl
from krnl import _core

from conftest import METAL_SIM

Probe = _core.testing.LibraryCacheProbe
NAMES = ["attention", "elementwise", "gemm", "rmsnorm"]


def test_background_compiles_every_library_once():
    p = Probe(NAMES, {n: 20.0 for n in NAMES})
    assert p.progress() == (0, 4)
    p.start_background()
    times = p.compile_all()
    assert sorted(times) == NAMES
    assert all(ms >= 19.0 for ms in times.values()), times  # each one's own compile time
    assert p.compiles() == {n: 1 for n in NAMES}
    assert p.progress() == (4, 4)
    assert p.get("gemm") == "lib:gemm"


def test_op_compiles_a_library_the_background_has_not_reached():
    # The background thread is busy with the first library for a long time; an op needing the
    # last one must not wait behind it.
    p = Probe(NAMES, {"attention": 1500.0})
    p.start_background()
    time.sleep(0.1)  # the background thread has taken "attention"
    t0 = time.perf_counter()
    assert p.get("rmsnorm") == "lib:rmsnorm"
    assert time.perf_counter() - t0 < 1.0
    assert not p.compiled_in_background("rmsnorm")
    # ... while an op needing the one being compiled waits for it instead of compiling it again.
    assert p.get("attention") == "lib:attention"
    assert p.compiled_in_background("attention")
    p.compile_all()
    assert p.compiles() == {n: 1 for n in NAMES}


def test_concurrent_requests_compile_once():
    p = Probe(NAMES, {n: 50.0 for n in NAMES})
    got, errors = [], []

    def ask(name):
        try:
            got.append(p.get(name))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(NAMES[i % 4],)) for i in range(16)]
    p.start_background()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(got) == sorted(f"lib:{NAMES[i % 4]}" for i in range(16))
    assert p.compiles() == {n: 1 for n in NAMES}


def test_failure_is_raised_by_each_op_that_needs_the_library():
    p = Probe(NAMES, {}, {"gemm"})
    p.start_background()
    for op in ("gemm", "lora_matmul"):
        with pytest.raises(RuntimeError) as e:
            p.get("gemm", op)
        msg = str(e.value)
        assert "\n" not in msg, msg
        assert msg.startswith(f"[metal] {op}: library gemm (metal/gemm.metal) did not compile: program_source:3:5: "
                              "error: use of undeclared identifier 'x' | "), msg
    assert p.get("rmsnorm") == "lib:rmsnorm"  # the others work
    with pytest.raises(RuntimeError, match=r"^\[metal\] compile_libraries: library gemm "):
        p.compile_all()
    assert p.compiles()["gemm"] == 1  # kept, not retried per op
    assert p.progress() == (4, 4)


def test_without_background_an_op_compiles_on_demand():
    p = Probe(NAMES)
    assert p.get("elementwise") == "lib:elementwise"
    assert p.compiles() == {"attention": 0, "elementwise": 1, "gemm": 0, "rmsnorm": 0}
    with pytest.raises(ValueError, match=r"^\[metal\] an_op: no library 'nope'"):
        p.get("nope")


def test_stop_leaves_the_rest_to_the_ops():
    p = Probe(NAMES, {n: 100.0 for n in NAMES})
    p.start_background()
    time.sleep(0.05)
    p.stop()  # after the library in progress
    done, total = p.progress()
    assert total == 4 and done <= 1
    assert sorted(p.compile_all()) == NAMES
    assert p.compiles() == {n: 1 for n in NAMES}


def test_compile_libraries_refused_off_metal():
    with pytest.raises(NotImplementedError, match=r"^\[compile_libraries\] cpu is not a Metal device"):
        krnl.device("cpu").compile_libraries()


@pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")
def test_compile_libraries_refused_on_metal_sim():
    with pytest.raises(NotImplementedError,
                       match=r"^\[compile_libraries\] metal-sim compiles no Metal libraries: its executor compiles "
                             r"the kernels in Python"):
        krnl.device("metal-sim").compile_libraries()


@pytest.mark.skipif("metal" not in krnl.devices(), reason="no 'metal' device (not a Mac with an Apple7+ GPU)")
def test_compile_libraries_on_metal():
    times = krnl.device("metal").compile_libraries()
    assert sorted(times) == sorted(_core.metal_libraries())
    assert all(ms > 0 for ms in times.values()), times
