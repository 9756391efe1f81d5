"""The executor of krnl's `metal-sim` device: runs the dispatch records of the Metal backend
(csrc/metal's op files) with the kernels of metal/ on this simulator.

    import mslsim.metal_sim
    mslsim.metal_sim.register(krnl._core, repo_root)   # then krnl.device("metal-sim")

Each record names an op family (metal/<library>.metal), a kernel, function-constant values,
buffers as device addresses with the byte extent the dispatch may touch, the kargs.h bytes, and
the grid. Libraries are built once per (family, constants) and cached on disk by mslsim."""
from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from . import MslsimError, build


class LibraryCache:
    """The libraries of <root>/metal, each built once per (op family, function constants) by
    `build(path, constants, include_dirs=...)`, in parallel where warmed: shared by the metal-sim
    executor and tools/mslcuda's metal-cuda one."""

    def __init__(self, root: Path, build_fn):
        root = Path(root)
        self.metal_dir = root / "metal"
        self.include_dirs = [self.metal_dir, root / "csrc" / "core"]  # kargs.h, rng.h
        self._build = build_fn
        self._libs: dict = {}
        self._lock = threading.Lock()

    def libraries(self):
        return sorted(p.stem for p in self.metal_dir.glob("*.metal"))

    def library(self, name: str, constants: tuple):
        key = (name, constants)
        with self._lock:  # one build per key; different keys build in parallel
            fut = self._libs.get(key)
            mine = fut is None
            if mine:
                fut = self._libs[key] = Future()
        if mine:
            try:
                fut.set_result(self._build(self.metal_dir / f"{name}.metal", dict(constants),
                                           include_dirs=self.include_dirs))
            except BaseException as e:
                fut.set_exception(e)
                with self._lock:
                    del self._libs[key]  # a later call retries (e.g. after the source is fixed)
        return fut.result()

    def variants(self):
        """Every (library, constants) the Metal backend dispatches: gemm with its alignment
        constant (index 0) set either way, the rest without constants."""
        return [(n, ()) for n in self.libraries() if n != "gemm"] + [("gemm", ((0, True),)), ("gemm", ((0, False),))]

    def warm(self, variants=None):
        """Builds (library, constants) pairs in parallel, one compiler per core: a cold cache
        otherwise compiles them one at a time as the first records need them."""
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(lambda v: self.library(v[0], tuple(v[1])), variants or self.variants()))


class Executor(LibraryCache):
    def __init__(self, root: Path, random_order: bool = False):
        super().__init__(root, build)
        # Shuffle the GPU threads after every barrier and SIMD-group call (a new seed per
        # dispatch): a missing barrier or a lockstep assumption then shows as a wrong result.
        self.random_order = random_order
        self.dispatches = 0  # executed so far (tests read it)

    def __call__(self, records):
        if not self._libs:
            self.warm()
        for r in records:
            self.run(r)

    def run(self, r: dict):
        lib = self.library(r["library"], tuple(r["constants"]))
        buffers = {}
        spans = []
        for index, address, extent, _base, _offset in r["buffers"]:
            n = max(int(extent), 1)
            arr = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address)) if extent else np.zeros(1, np.uint8)
            buffers[index] = arr
            if extent:
                spans.append((address, address + extent))
        buffers[r["args_index"]] = bytes(r["args"])
        # Overlapping bindings (an output aliasing an input, as cross_entropy's dlogits may) must
        # see one memory: the guarded copies would split them, so such a dispatch runs unguarded.
        spans.sort()
        overlap = any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:]))
        lib.dispatch(r["kernel"], grid=r["grid"], threads=r["threads"], buffers=buffers, guard=not overlap,
                     random_order=self.random_order, seed=self.dispatches)
        self.dispatches += 1


def register(core, root, random_order: bool = False) -> Executor:
    """Registers krnl's metal-sim device with an executor over `root`/metal; returns the executor."""
    ex = Executor(root, random_order)
    core.testing.register_metal_sim(ex)
    return ex


def available() -> bool:
    """Whether this machine can run the simulator (a C++20 compiler with _Float16)."""
    from . import _cxx
    import shutil
    return shutil.which(_cxx()) is not None and os.name == "posix"


__all__ = ["Executor", "LibraryCache", "register", "available", "MslsimError"]
