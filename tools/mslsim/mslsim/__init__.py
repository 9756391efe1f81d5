"""mslsim: run Metal Shading Language compute kernels on a Linux CPU.

    lib = mslsim.build("gemm.metal", constants={"use_bias": True})
    lib.dispatch("gemm_nt_f16", grid=(gx, gy, 1), threads=(32, 1, 1),
                 buffers=[A, B, C, np.array([M, N, K], np.uint32)])

Pipeline: (1) the C preprocessor expands the .metal file (macros, user headers; <metal_stdlib>
and co. resolve to empty stubs); (2) transform() rewrites MSL-only syntax into C++ and appends a
kernel registry; (3) the C++ compiler builds it with include/mslsim.h into a shared object,
cached by content hash; (4) Library.dispatch() binds numpy buffers by [[buffer(i)]] index
through ctypes and runs the grid in include/mslsim_runtime.h.

Environment: MSLSIM_CXX (compiler, g++), MSLSIM_CACHE (~/.cache/krnl-mslsim), MSLSIM_WORKERS
(worker threads, all cores), MSLSIM_RANDOM_ORDER=1 (shuffle thread order everywhere),
MSLSIM_STACK_KB (fiber stack per GPU thread, 256).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import threading
from pathlib import Path

import numpy as np

from . import swizzles
from .transform import MslsimError, Transformed, transform

__all__ = ["build", "Library", "MslsimError", "transform"]

PACKAGE_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = PACKAGE_DIR / "include"
STUB_INCLUDE = INCLUDE_DIR / "stub"

# Bits of the runtime's Flags enum (mslsim_runtime.h).
FLAGS = {"random_order": 1, "no_poison": 2, "allow_exit_barrier": 4, "no_tg_limit": 8, "no_site_check": 16}
MAX_TG_MEMORY_INDEX = 32  # Group::tgbuf in mslsim_runtime.h


def cache_dir() -> Path:
    # read at every build, so that a test or CI step can point it elsewhere after import
    return Path(os.environ.get("MSLSIM_CACHE") or Path.home() / ".cache" / "krnl-mslsim")


def _cxx() -> str:
    return os.environ.get("MSLSIM_CXX") or "g++"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0")


@functools.lru_cache(maxsize=None)
def _toolchain_id(cxx: str) -> str:
    """Compiler version and host CPU features: -march=native objects must not be reused by a
    different compiler or on a CPU without the same instruction set (a shared CI cache)."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except OSError as e:
        raise MslsimError(f"C++ compiler '{cxx}' not found (set MSLSIM_CXX): {e}") from None
    cpu = ""
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    return version + cpu


@functools.lru_cache(maxsize=None)
def _shim_hash() -> str:
    h = hashlib.sha256(swizzles.render().encode())
    for f in sorted(INCLUDE_DIR.glob("*.h")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def msl_defines(msl_version: int = 310) -> list:
    """What Apple's compiler defines for MSL `msl_version` (3.1 -> 310): __METAL_VERSION__, and
    __HAVE_BFLOAT__ from 3.1. 310 by default: the shim stands for a GPU with native bf16, for which
    device.mm compiles every library as 3.1, so the bf16 kernels (metal/kargs.h's KRNL_BF16) build."""
    return [f"-D__METAL_VERSION__={msl_version}", "-D__METAL_MACOS__"] + (["-D__HAVE_BFLOAT__=1"] if msl_version >= 310 else [])


def preprocess(path: Path, cxx: str, defines: dict | None = None, include_dirs=(), msl_version: int = 310) -> str:
    cmd = [cxx, "-E", "-x", "c++", "-std=c++17", f"-I{STUB_INCLUDE}", *msl_defines(msl_version), "-DMSLSIM=1"]
    cmd += [f"-I{d}" for d in include_dirs]
    cmd += [f"-D{k}={v}" for k, v in (defines or {}).items()]
    cmd.append(str(path))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise MslsimError(f"preprocessing {path} failed:\n{r.stderr}")
    return r.stdout


def _tmp_name(path: Path) -> Path:
    # unique per process and thread: parallel test processes or threads may build the same kernel
    return path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _write_atomic(path: Path, data: str):
    tmp = _tmp_name(path)
    tmp.write_text(data)
    os.replace(tmp, path)


def build(source, constants: dict | None = None, *, defines: dict | None = None, include_dirs=(),
          opt: str = "-O2", extra_flags=(), cxx: str | None = None, name: str | None = None) -> "Library":
    """Compile the .metal file `source` (or load it from the cache) and return its Library.

    constants: function constant values by name or [[function_constant(index)]]; defines:
    preprocessor macros; name: stem of the cached files (default: the source's stem)."""
    cxx = cxx or _cxx()
    path = Path(source)
    if not path.is_file():
        raise MslsimError(f"{path}: no such file")
    pre = preprocess(path, cxx, defines, include_dirs)
    try:
        tr = transform(pre, constants)
    except MslsimError as e:
        raise MslsimError(f"{path}: {e}") from None
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    inc = cache / swizzles.FILE_NAME
    swz = swizzles.render()
    if not inc.exists() or inc.read_text() != swz:
        _write_atomic(inc, swz)
    flags = ["-std=c++20", opt, "-march=native", "-fPIC", "-shared", "-pthread", f"-I{INCLUDE_DIR}", f"-I{cache}",
             "-Wno-attributes", "-Wno-unknown-pragmas", "-Wno-unused-variable", "-Wno-unused-but-set-variable",
             *extra_flags]
    if "clang" not in Path(cxx).name:
        flags.append("-fsingle-precision-constant")  # MSL has no double: 1.0 is a float literal (g++ only)
    key = hashlib.sha256("\0".join([tr.code, " ".join(flags), cxx, _toolchain_id(cxx), _shim_hash()]).encode())
    stem = f"{name or path.stem}-{key.hexdigest()[:20]}"
    cpp, so = cache / f"{stem}.cpp", cache / f"{stem}.so"
    if not so.exists():
        _write_atomic(cpp, tr.code)
        tmp = _tmp_name(so)
        r = subprocess.run([cxx, *flags, str(cpp), "-o", str(tmp)], capture_output=True, text=True)
        if r.returncode:
            tmp.unlink(missing_ok=True)
            raise MslsimError(f"compiling {path} (generated {cpp}) failed:\n{r.stderr[-20000:]}")
        os.replace(tmp, so)
    return Library(so, tr, path)


def _as_buffer(obj, kernel: str, index: int) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise MslsimError(f"kernel {kernel}: buffer({index}) must be a C-contiguous numpy array")
        return obj
    if isinstance(obj, np.generic):
        return np.array(obj)
    if isinstance(obj, (bytes, bytearray)):
        return np.frombuffer(bytearray(obj), dtype=np.uint8)
    if isinstance(obj, ctypes.Structure):
        return np.frombuffer(bytearray(bytes(obj)), dtype=np.uint8)
    raise MslsimError(f"kernel {kernel}: cannot bind {type(obj).__name__} as buffer({index}): "
                      "use a numpy array, numpy scalar, bytes or ctypes.Structure")


def _dim3(v, what: str, kernel: str) -> tuple[int, int, int]:
    v = tuple(int(x) for x in v)
    if not 1 <= len(v) <= 3 or min(v) < 0:
        raise MslsimError(f"kernel {kernel}: {what} must be 1 to 3 non-negative sizes, got {v}")
    return v + (1,) * (3 - len(v))


class Library:
    """A compiled .metal file: its kernels by host name, dispatched on numpy buffers."""

    def __init__(self, so_path: Path, tr: Transformed, source: Path):
        self.path = so_path
        self.source = source
        self.transformed = tr
        self._lib = ctypes.CDLL(str(so_path))
        L = self._lib
        L.mslsim_kernel_count.restype = ctypes.c_int
        L.mslsim_kernel_name.restype = ctypes.c_char_p
        L.mslsim_kernel_name.argtypes = [ctypes.c_int]
        L.mslsim_guarded_alloc.restype = ctypes.c_void_p
        L.mslsim_guarded_alloc.argtypes = [ctypes.c_uint64, ctypes.c_int]
        L.mslsim_guarded_free.argtypes = [ctypes.c_void_p]
        u32p = ctypes.POINTER(ctypes.c_uint32)
        u64p = ctypes.POINTER(ctypes.c_uint64)
        L.mslsim_dispatch.restype = ctypes.c_int
        L.mslsim_dispatch.argtypes = [ctypes.c_char_p, u32p, u32p, u32p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                      u64p, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64,
                                      ctypes.c_int, ctypes.c_char_p, ctypes.c_int]

    @property
    def kernel_names(self) -> list[str]:
        return [self._lib.mslsim_kernel_name(i).decode() for i in range(self._lib.mslsim_kernel_count())]

    def dispatch(self, kernel: str, grid, threads, buffers, *, threadgroup_memory=None, threads_per_grid=None,
                 workers: int | None = None, random_order: bool = False, seed: int = 0, guard: bool = True,
                 flags=(), tg_limit: int = 32768):
        """dispatchThreadgroups: grid = threadgroups per grid, threads = threads per threadgroup.

        buffers: a list (position = [[buffer(i)]], None = unbound) or a dict {index: array}; numpy
        arrays are updated in place. threadgroup_memory: {index: bytes} (or a list), as
        setThreadgroupMemoryLength:atIndex:. random_order shuffles the fibers after every
        synchronisation point (a race detector; seed picks the order). guard puts every buffer
        right before an inaccessible page, so that reading or writing past its end (rounded up to
        16 bytes) raises instead of corrupting memory. flags: names from FLAGS."""
        grid = _dim3(grid, "grid", kernel)
        threads = _dim3(threads, "threads", kernel)
        items = dict(buffers) if isinstance(buffers, dict) else dict(enumerate(buffers))
        if any(not isinstance(i, int) or i < 0 for i in items):
            raise MslsimError(f"kernel {kernel}: buffer indices must be non-negative integers, got {sorted(items)}")
        nb = max(items) + 1 if items else 0
        arrs = {i: _as_buffer(b, kernel, i) for i, b in items.items() if b is not None}
        tgm = threadgroup_memory or {}
        if not isinstance(tgm, dict):
            tgm = dict(enumerate(tgm))
        if any(not 0 <= i < MAX_TG_MEMORY_INDEX for i in tgm):
            raise MslsimError(f"kernel {kernel}: threadgroup memory indices must be in [0, {MAX_TG_MEMORY_INDEX}), "
                              f"got {sorted(tgm)}")
        unknown = set(flags) - set(FLAGS)
        if unknown:
            raise MslsimError(f"kernel {kernel}: unknown flags {sorted(unknown)}; known: {sorted(FLAGS)}")
        f = sum(FLAGS[x] for x in set(flags))
        if random_order or _env_flag("MSLSIM_RANDOM_ORDER"):
            f |= FLAGS["random_order"]
        if workers is None:
            workers = int(os.environ.get("MSLSIM_WORKERS") or 0)  # 0: one per core
        ntg = max(tgm) + 1 if tgm else 0
        tgsizes = (ctypes.c_uint64 * max(ntg, 1))(*[tgm.get(i, 0) for i in range(max(ntg, 1))])
        tpg = (ctypes.c_uint32 * 3)(*_dim3(threads_per_grid, "threads_per_grid", kernel)) if threads_per_grid else None
        ptrs = (ctypes.c_void_p * max(nb, 1))()
        guarded = {}
        try:
            for i, a in arrs.items():
                if guard:
                    p = self._lib.mslsim_guarded_alloc(max(a.nbytes, 1), i)
                    if not p:
                        raise MslsimError(f"kernel {kernel}: guarded allocation of buffer({i}) ({a.nbytes} bytes) failed")
                    ctypes.memmove(p, a.ctypes.data, a.nbytes)
                    guarded[i] = p
                    ptrs[i] = p
                else:
                    ptrs[i] = a.ctypes.data
            err = ctypes.create_string_buffer(8192)
            rc = self._lib.mslsim_dispatch(kernel.encode(), (ctypes.c_uint32 * 3)(*grid),
                                           (ctypes.c_uint32 * 3)(*threads), tpg, ptrs, nb, tgsizes, ntg, f, seed,
                                           tg_limit, workers, err, len(err))
            if rc:
                raise MslsimError(f"{self.source.name}: {err.value.decode(errors='replace')}")
            for i, p in guarded.items():
                a = arrs[i]
                if a.flags.writeable:
                    ctypes.memmove(a.ctypes.data, p, a.nbytes)
        finally:
            for p in guarded.values():
                self._lib.mslsim_guarded_free(p)

    def dispatch_threads(self, kernel: str, threads_per_grid, threads, buffers, **kw):
        """dispatchThreads: a non-uniform grid of exactly threads_per_grid threads; the
        threadgroups at the upper edges are smaller."""
        tpg = _dim3(threads_per_grid, "threads_per_grid", kernel)
        threads = _dim3(threads, "threads", kernel)
        if 0 in threads:
            raise MslsimError(f"kernel {kernel}: empty threadgroup {threads}")
        grid = tuple(-(-a // b) for a, b in zip(tpg, threads))
        return self.dispatch(kernel, grid, threads, buffers, threads_per_grid=tpg, **kw)
