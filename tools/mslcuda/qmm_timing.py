"""metal/quantized.metal's quantized_matmul on metal-cuda (the .metal kernels compiled by nvcc): time
per call, effective GB/s and GFLOP/s, and the static bytes read per FLOP, of the tiled form
(quantized_matmul_{t,n}_f16_b4), the few-row form (quantized_matmul_tv_f16_b4), the naive kernel they
replaced (tools/mslcuda/quantized_naive.metal) and the dense GEMM of the same shape (gemm.metal
tile32 and steel64, f16, aligned), at an 8B Llama's projections (q 4096 -> 4096, gate 4096 -> 14336,
down 14336 -> 4096) at N = 512 in both directions, an LM-head chunk (N = 1024, V = 128256, C = 4096,
x W^T), and generation (N = 1 and 8, x W^T). 4-bit codes, group size 64, f16 x, scales and out.

    python tools/mslcuda/qmm_timing.py [--json FILE] [--quick | --crossover]

Run by tools/device/h200_check.sh qmm. Speeds here are an NVIDIA H200's running MSL through a
CUDA shim (the SIMD-group matrix emulated with shuffles, nothing tuned for it): they compare the
kernels' designs with each other, never a Mac's speed. Each timed kernel's output is spot-checked
against float64 numpy (rows 0 and N - 1, three columns) so that a wrong launch cannot pass as fast.
Effective GB/s counts each operand once (x, packed codes with scales and biases or the dense
f16 W, out written): the traffic a perfect cache would leave."""
from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "mslcuda"))
import mslcuda  # noqa: E402

BITS, GS = 4, 64
_CT = {"uint32_t": "I", "float": "f"}


def kargs(name: str, **vals) -> bytes:
    """The bytes of metal/kargs.h's struct `name` with the given fields (every field named)."""
    text = re.sub(r"//[^\n]*", "", (ROOT / "metal" / "kargs.h").read_text())
    body = re.search(rf"struct\s+{name}\s*\{{(.*?)\}};", text, re.S).group(1)
    fields = re.findall(r"(\w+)\s+(\w+)\s*;", body)
    assert {n for _, n in fields} == set(vals), (name, [n for _, n in fields], sorted(vals))
    import struct
    return struct.pack("<" + "".join(_CT[t] for t, _ in fields), *[vals[n] for _, n in fields])


def trimmed_libs(tmp: Path):
    """The kernels timed here, compiled alone (the full libraries hold every dtype and bits)."""
    q = (ROOT / "metal" / "quantized.metal").read_text()
    q = re.sub(r"^QMM_KERNELS\(.*$", "", q, flags=re.M) + '\nQMM_KERNEL(half, half, "f16", 4)\n'
    keep = {"gemm_nt_f16", "gemm_nn_f16", "gemm_steel64_nt_f16", "gemm_steel64_nn_f16"}
    g = [ln for ln in (ROOT / "metal" / "gemm.metal").read_text().splitlines()
         if not ln.startswith("template [[host_name(") or re.search(r'host_name\("(\w+)"\)', ln).group(1) in keep]
    (tmp / "quantized.metal").write_text(q)
    (tmp / "gemm.metal").write_text("\n".join(g) + "\n")
    inc = [ROOT / "metal", ROOT / "csrc" / "core"]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(4) as pool:
        fq = pool.submit(mslcuda.build, tmp / "quantized.metal", {}, include_dirs=inc, name="qmm_timing_quantized")
        # gemm_aligned as the host sets it: true where M, N are tile multiples (vector loads, no checks)
        fa = pool.submit(mslcuda.build, tmp / "gemm.metal", {0: True}, include_dirs=inc, name="qmm_timing_gemm_a")
        fu = pool.submit(mslcuda.build, tmp / "gemm.metal", {0: False}, include_dirs=inc, name="qmm_timing_gemm_u")
        fn = pool.submit(mslcuda.build, ROOT / "tools" / "mslcuda" / "quantized_naive.metal", {}, include_dirs=inc,
                         name="qmm_timing_naive")
        return fq.result(), (fa.result(), fu.result()), fn.result()


class Buf:
    """A managed allocation holding a numpy array's bytes (read back with .get())."""

    def __init__(self, rt, arr):
        self.rt, self.shape, self.dtype = rt, arr.shape, arr.dtype
        self.nbytes = arr.nbytes
        self.ptr = rt.alloc(max(arr.nbytes, 16))
        ctypes.memmove(self.ptr, np.ascontiguousarray(arr).ctypes.data, arr.nbytes)

    def get(self):
        out = np.empty(self.shape, self.dtype)
        ctypes.memmove(out.ctypes.data, self.ptr, self.nbytes)
        return out


def big(rng, shape, dtype, scale=1.0):
    """A large random array made from a 1M-element random block (fast; values only need to be
    ordinary numbers)."""
    n = int(np.prod(shape))
    block = (scale * rng.standard_normal(min(n, 1 << 20) + 7)).astype(dtype)
    return np.resize(block, n).reshape(shape)


def timed(rt, launch, budget_s=0.4):
    """Seconds per call: one call to warm up (page migration, module load), then as many as fit
    in budget_s (at least one)."""
    launch()
    rt.synchronize()
    t0 = time.perf_counter()
    launch()
    rt.synchronize()
    first = time.perf_counter() - t0
    reps = int(max(1, min(50, budget_s / max(first, 1e-6))))
    t0 = time.perf_counter()
    for _ in range(reps):
        launch()
    rt.synchronize()
    return min(first, (time.perf_counter() - t0) / reps)


def static_bytes_per_flop(kind: str, N: int) -> float:
    """Device loads the kernel issues per FLOP (quantized.metal's header has the formulas)."""
    sx, ss = 2, 2
    w = BITS / 8 + 2 * ss / GS            # bytes of W per weight: codes, scale and bias
    if kind == "tiled":
        return sx / 64 + w / 64
    if kind == "few-row":
        return w / (2 * N) + sx / 8
    if kind == "naive":
        return (sx + w) / 2
    if kind == "tile32":
        return 2 * sx / 64
    if kind == "steel64":
        return 2 * sx / 128
    raise ValueError(kind)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="the q projection alone (a smoke test)")
    ap.add_argument("--crossover", action="store_true",
                    help="instead: the few-row and the tiled form at 1 to 32 rows (where the host's switch at 8 "
                         "stands), and the time of a launch that does almost nothing")
    a = ap.parse_args(argv)
    rt = mslcuda.runtime()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        qlib, (glib_a, glib_u), nlib = trimmed_libs(Path(d))
    print(f"device: {rt.device_name()}; kernels compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    rng = np.random.default_rng(0)
    if a.crossover:
        return crossover(rt, qlib, rng, a.json)
    proj = {"q": (4096, 4096), "gate": (4096, 14336), "down": (14336, 4096)}   # (in, out) features
    cases = []   # (label, N, transpose, O, I)
    for name, (I, O) in proj.items():
        for tr in (True, False):
            cases.append((f"{name} {'x W^T' if tr else 'x W'}", 512, tr, O, I))
    cases.append(("LM head x W^T", 1024, True, 128256, 4096))
    for name, (I, O) in proj.items():
        for n in (1, 8):
            cases.append((f"{name} x W^T", n, True, O, I))
    if a.quick:
        cases = [c for c in cases if c[0].startswith("q ")]
    rows = []
    weights = {}
    for label, N, tr, O, I in cases:
        if (O, I) not in weights:
            weights.clear()  # one W at a time (the LM head's dense copy is 1 GB)
            codes = rng.integers(-2**31, 2**31, (O, I * BITS // 32), dtype=np.int64).astype(np.int32)
            sc = (0.02 * rng.uniform(0.5, 1.0, (O, I // GS)) * rng.choice([-1, 1], (O, I // GS))).astype(np.float16)
            bi = (-8 * sc + 0.01 * rng.standard_normal((O, I // GS))).astype(np.float16)
            dense = big(rng, (O, I), np.float16, 0.05)
            weights[(O, I)] = (codes, sc, bi, dense, Buf(rt, codes), Buf(rt, sc), Buf(rt, bi), Buf(rt, dense))
        codes, sc, bi, dense, wb, sb, bb, db = weights[(O, I)]
        K, M = (I, O) if tr else (O, I)
        x = big(rng, (N, K), np.float16)
        xb = Buf(rt, x)
        ob = Buf(rt, np.zeros((N, M), np.float16))
        flops = 2.0 * N * M * K
        qbytes = x.nbytes + codes.nbytes + sc.nbytes + bi.nbytes + ob.nbytes
        dbytes = x.nbytes + dense.nbytes + ob.nbytes
        qargs = kargs("QuantizedMatmulArgs", N=N, M=M, K=K, words=I * BITS // 32, group_size=GS, beta=0.0, ldx=K,
                      ldo=M, m0=0, groups=I // GS)
        bufs = {0: xb.ptr, 1: wb.ptr, 2: sb.ptr, 3: bb.ptr, 4: ob.ptr}
        form = "few-row" if tr and N <= 8 else "tiled"
        kname = ("quantized_matmul_tv_f16_b4" if form == "few-row" else
                 f"quantized_matmul_{'t' if tr else 'n'}_f16_b4")
        grid = (-(-M // 8), -(-N // 8), 1) if form == "few-row" else (-(-M // 32), -(-N // 32), 1)
        threads = (64, 1, 1) if form == "few-row" else (128, 1, 1)
        ngroups = max(1, min(1024, -(-N * M // 256)))
        # the dense product: x (N, K) times W (O, I) stored as is: nt for x W^T, nn for x W
        op = "nt" if tr else "nn"
        gargs = kargs("GemmArgs", M=N, N=M, K=K, lda=K, ldb=K if tr else M, ldc=M, stride_a=0, stride_b=0, stride_c=0,
                      k_split=K, alpha=1.0, beta=0.0)
        gbufs = {0: xb.ptr, 1: db.ptr, 2: ob.ptr}
        glib = glib_a if N % 32 == 0 and M % 32 == 0 else glib_u
        runs = [
            ("naive", lambda: nlib.launch(f"quantized_matmul_naive_{'t' if tr else 'n'}_f16_b4", (ngroups, 1, 1),
                                          (256, 1, 1), bufs, qargs, 5), qbytes, "q"),
            (form, lambda: qlib.launch(kname, grid, threads, bufs, qargs, 5), qbytes, "q"),
            ("tile32", lambda: glib.launch(f"gemm_{op}_f16", (-(-M // 32), -(-N // 32), 1), (32, 1, 1), gbufs, gargs, 3),
             dbytes, "d"),
        ]
        if N % 64 == 0 and M % 64 == 0:
            runs.append(("steel64", lambda: glib_a.launch(f"gemm_steel64_{op}_f16", (M // 64, N // 64, 1), (128, 1, 1),
                                                        gbufs, gargs, 3), dbytes, "d"))
        Wop_q = None
        for kind, launch, nbytes, wkind in runs:
            s = timed(rt, launch)
            got = ob.get().astype(np.float64)
            # spot check: rows 0 and N - 1, columns 0, M // 2 and M - 1
            rs, cs = sorted({0, N - 1}), [0, M // 2, M - 1]
            if wkind == "q":
                if Wop_q is None:
                    Wop_q = dequant_cols(codes, sc, bi, cs, tr)
                Wc = Wop_q
            else:
                Wc = dense.astype(np.float64)[cs].T if tr else dense.astype(np.float64)[:, cs]
            ref = x[rs].astype(np.float64) @ Wc
            mag = np.abs(x[rs].astype(np.float64)) @ np.abs(Wc)
            err = float(np.max(np.abs(got[np.ix_(rs, cs)] - ref) / (mag + 1e-30)))
            ok = err < 4e-3
            rows.append(dict(shape=label, N=N, M=M, K=K, kernel=kind, ms=s * 1e3, gbps=nbytes / s / 1e9,
                             gflops=flops / s / 1e9, bytes_per_flop_static=static_bytes_per_flop(kind, N),
                             bytes_per_flop_compulsory=nbytes / flops, spot_err=err, ok=ok))
            r = rows[-1]
            print(f"{label:14s} N={N:5d} M={M:6d} K={K:5d} {kind:8s} {r['ms']:9.3f} ms {r['gbps']:8.1f} GB/s "
                  f"{r['gflops']:9.1f} GFLOP/s  B/FLOP static {r['bytes_per_flop_static']:.4f} "
                  f"compulsory {r['bytes_per_flop_compulsory']:.5f}  spot {err:.1e}{'' if ok else '  WRONG'}", flush=True)
        for b in (xb, ob):
            rt.free(b.ptr)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(device=rt.device_name(), bits=BITS, group_size=GS, rows=rows), indent=1))
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows)} timings, {len(bad)} with a wrong spot check")
    return 1 if bad else 0


def crossover(rt, qlib, rng, json_path):
    """x W^T through quantized_matmul_tv (row blocks of 8, W read once per block) and through the
    tiled form, at the q and gate projections' W, N = 1 .. 32; then the floor: a tv launch over
    one 8-column block of a 64-wide W (what every timing here includes of the host's launch path)."""
    rows = []
    for name, (I, O) in {"q": (4096, 4096), "gate": (4096, 14336), "floor": (64, 8)}.items():
        codes = rng.integers(-2**31, 2**31, (O, I * BITS // 32), dtype=np.int64).astype(np.int32)
        sc = (0.02 * rng.uniform(0.5, 1.0, (O, I // GS))).astype(np.float16)
        bi = (-8 * sc).astype(np.float16)
        wb, sb, bb = Buf(rt, codes), Buf(rt, sc), Buf(rt, bi)
        for N in ((1,) if name == "floor" else (1, 2, 4, 8, 9, 16, 32)):
            x = big(rng, (N, I), np.float16)
            xb, ob = Buf(rt, x), Buf(rt, np.zeros((N, O), np.float16))
            qargs = kargs("QuantizedMatmulArgs", N=N, M=O, K=I, words=I * BITS // 32, group_size=GS, beta=0.0, ldx=I,
                          ldo=O, m0=0, groups=I // GS)
            bufs = {0: xb.ptr, 1: wb.ptr, 2: sb.ptr, 3: bb.ptr, 4: ob.ptr}
            forms = (("few-row", "quantized_matmul_tv_f16_b4", (-(-O // 8), -(-N // 8), 1), (64, 1, 1)),
                     ("tiled", "quantized_matmul_t_f16_b4", (-(-O // 32), -(-N // 32), 1), (128, 1, 1)))
            for form, kname, grid, threads in forms[:1] if name == "floor" else forms:
                sec = timed(rt, lambda: qlib.launch(kname, grid, threads, bufs, qargs, 5))
                nbytes = x.nbytes + codes.nbytes + sc.nbytes + bi.nbytes + N * O * 2
                rows.append(dict(shape=name, N=N, M=O, K=I, kernel=form, ms=sec * 1e3, gbps=nbytes / sec / 1e9,
                                 gflops=2.0 * N * O * I / sec / 1e9))
                r = rows[-1]
                print(f"{name:6s} N={N:3d} M={O:6d} K={I:5d} {form:8s} {r['ms']:8.4f} ms {r['gbps']:8.1f} GB/s "
                      f"{r['gflops']:9.1f} GFLOP/s", flush=True)
            rt.free(xb.ptr), rt.free(ob.ptr)
    if json_path:
        Path(json_path).write_text(json.dumps(dict(device=rt.device_name(), bits=BITS, group_size=GS, rows=rows),
                                              indent=1))
    return 0


def dequant_cols(codes, sc, bi, cols, tr):
    """op(W)[:, cols] in float64 from the 4-bit codes: W's rows `cols` transposed (x W^T) or its
    columns `cols` (x W)."""
    if tr:
        words = codes[cols].view(np.uint32)                            # (c, I / 8)
        q = (words[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
        q = q.reshape(len(cols), -1).astype(np.float64)                # (c, I)
        W = np.repeat(sc[cols].astype(np.float64), GS, 1) * q + np.repeat(bi[cols].astype(np.float64), GS, 1)
        return W.T
    cols = np.asarray(cols)
    words = codes.view(np.uint32)[:, cols // 8]                         # (O, c)
    q = ((words >> (4 * (cols % 8)).astype(np.uint32)) & 15).astype(np.float64)
    return sc.astype(np.float64)[:, cols // GS] * q + bi.astype(np.float64)[:, cols // GS]


if __name__ == "__main__":
    sys.exit(main())
