"""BLAS calls from the CPU backend's own pool threads (split-K slices, attention heads) run each on
its thread alone, so the two pools never oversubscribe the cores (csrc/cpu/blas.h).

- Here (OpenBLAS): the count reads 1 inside every chunk of a parallel region that holds the
  scopes the split-K GEMM holds, and comes back after.
- macOS (Accelerate): csrc/cpu/accelerate_threads.h sets the per-thread BLASSetThreading (macOS
  15+). No Mac here: the header is type-checked by clang for a macOS 13 target against
  tools/accelerate_stubs, once as a macOS 14 SDK (no <vecLib/thread_api.h>) and once as a macOS 15
  one, with unguarded use of a newer API an error; a copy with the run-time check removed must be
  rejected, so the check is known to bite."""
import shutil
import subprocess
from pathlib import Path

import pytest

import krnl
from krnl import _core

ROOT = Path(__file__).resolve().parents[1]
STUBS = ROOT / "tools" / "accelerate_stubs"
HEADER = ROOT / "csrc" / "cpu" / "accelerate_threads.h"
CLANG = next((p for p in map(shutil.which, ["clang++"] + [f"clang++-{v}" for v in range(30, 13, -1)]) if p), None)
needs_clang = pytest.mark.skipif(CLANG is None, reason="clang++ not on PATH: the macOS check of the Accelerate "
                                                       "threading needs clang")


def test_blas_single_threaded_inside_pool_chunks():
    if krnl.num_threads() < 2:
        pytest.skip("a pool of one thread runs no BLAS call beside another")
    assert _core.testing.blas_fans_out()
    seen = _core.testing.probe_blas_threads()
    before, inside, after = seen[0], seen[1:-1], seen[-1]
    assert inside and all(n == 1 for n in inside), seen
    assert after == before, seen


USE = """#include "cpu/accelerate_threads.h"
int use() {
  krnl::cpu::AccelerateSingleThreadHere here;
  return krnl::cpu::accelerate_thread_api() + krnl::cpu::AccelerateSingleThreadHere::threads();
}
"""


def _check(tmp_path, sdks, header_dir):
    src = tmp_path / "use.cpp"
    src.write_text(USE)
    # No standard headers: the host's are for Linux, and the header needs none.
    cmd = [CLANG, "-target", "arm64-apple-macos13.0", "-std=c++17", "-fsyntax-only", "-nostdinc", "-nostdinc++",
           "-Wall", "-Wextra", "-Werror", "-Werror=unguarded-availability-new",
           *[f"-I{STUBS / s}" for s in sdks], f"-I{header_dir}", str(src)]
    return subprocess.run(cmd, capture_output=True, text=True)


@needs_clang
@pytest.mark.parametrize("sdks", [["sdk14"], ["sdk14", "sdk15"]], ids=["sdk14", "sdk15"])
def test_accelerate_threads_builds_for_macos13(tmp_path, sdks):
    r = _check(tmp_path, sdks, ROOT / "csrc")
    assert r.returncode == 0, r.stderr


@needs_clang
def test_accelerate_threads_check_rejects_unguarded_call(tmp_path):
    src = HEADER.read_text()
    guard = "if (__builtin_available(macOS 15.0, *)) {\n      const auto now"
    assert guard in src, "the plant's anchor is gone from accelerate_threads.h: update the test"
    bad = tmp_path / "inc" / "cpu"
    bad.mkdir(parents=True)
    (bad / "accelerate_threads.h").write_text(src.replace(guard, "if (true) {\n      const auto now", 1))
    r = _check(tmp_path, ["sdk14", "sdk15"], tmp_path / "inc")
    assert r.returncode != 0
    assert "'BLASGetThreading' is only available on macOS 15.0 or newer" in r.stderr, r.stderr
