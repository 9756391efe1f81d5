"""What compute-sanitizer runs over the MSL kernels (tools/device/h200_check.sh sanitize TOOL).

    python tools/mslcuda/sanitize.py kernels [metal-cuda|metal-sim [quantized]]   every kernel of metal/
        (or of metal/quantized.metal alone) at least once, through
        krnl's ops on metal-cuda (the Metal backend's own grids and arguments), at sizes that give
        2-3 threadgroups per grid dimension with ragged edges, f32 and f16; prints the kernels
        that ran and those that did not
    python tools/mslcuda/sanitize.py barrier N    gemm_nn_f32 of a copy of metal/gemm.metal with
        its N-th `threadgroup_barrier` deleted (N = 0: the file as it is), on a 70x45x37 product
        (grid 2 x 3 threadgroups, ragged); prints the largest error against numpy (--build-only:
        only compiles it, outside the sanitizer)

Numbers are not checked here (the op suite and workloads.py do that at size): this only has to
run every kernel where the sanitizer watches."""
from __future__ import annotations

import ctypes
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "mslcuda"))

BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


def run_kernels(device="metal-cuda", only=None):
    import krnl
    from krnl import ops

    if device == "metal-sim":  # a dry run of this driver where no GPU is (every op must accept its call)
        sys.path.insert(0, str(ROOT / "tools" / "mslsim"))
        import mslsim.metal_sim
        mslsim.metal_sim.register(krnl._core, ROOT)
        ex = None
    else:
        import mslcuda.metal_cuda
        ex = mslcuda.metal_cuda.register(krnl._core, ROOT)
    dev = krnl.device(device)
    rng = np.random.default_rng(0)

    def t(shape, dt="f32", scale=1.0):
        return dev.tensor((scale * rng.standard_normal(shape)).astype(np.float32), dt)

    caps = dev.capabilities()
    fused = caps["fused_attention"]
    variants = dev.gemm_variants() or [None]
    for dt, variant in [(d, v) for d in ("f32", "f16", "bf16") if d in caps["dtypes"] for v in variants]:
        if only == "quantized":  # metal/quantized.metal's kernels alone
            if variant in (None, variants[0]):
                quantized_calls(dev, t, dt, rng)
            continue
        # GEMM: unaligned 70x45x37 (grid 2 x 3, ragged), aligned 64x96x64, batched, split-K, f16 -> f32;
        # each variant of the Metal backend (metal/gemm.metal: tile32, steel32, steel64) in turn
        if variant is not None:
            dev.set_gemm_choice("*", variant)
        M, N, K = 70, 45, 37
        for ta, tb in ((False, False), (False, True), (True, False)):
            A = t((K, M) if ta else (M, K), dt)
            B = t((N, K) if tb else (K, N), dt)
            ops.gemm(A, B, dev.empty((M, N), dt), trans_a=ta, trans_b=tb, split_k=1)
            A3, B3 = t((96, M) if ta else (M, 96), dt), t((N, 96) if tb else (96, N), dt)  # K = 3 x 32
            ops.gemm(A3, B3, t((M, N), dt), trans_a=ta, trans_b=tb, beta=0.5, split_k=3)
            ops.gemm(A, B, t((M, N), "f32"), trans_a=ta, trans_b=tb, beta=1.0, split_k=1) if dt != "f32" else None
            Aa = t((64, 64), dt)
            ops.gemm(Aa, t((64, 96), dt) if not tb else t((96, 64), dt), dev.empty((64, 96), dt), trans_a=ta,
                     trans_b=tb, split_k=1)
            ops.gemm(Aa, t((64, 96), dt) if not tb else t((96, 64), dt), dev.empty((64, 96), dt), trans_a=ta,
                     trans_b=tb, split_k=2)
        ops.gemm(t((2, M, K), dt), t((2, K, N), dt), dev.empty((2, M, N), dt), batch=2, split_k=1)
        if variant is not None:
            dev.clear_gemm_choices()
        if variant not in (None, variants[0]):
            continue  # the rest once per dtype
        # row kernels: 3 rows, 45 and 1000 columns
        for cols in (45, 1000):
            x, dy = t((3, cols), dt), t((3, cols), dt)
            for wdt in ((dt, "f32") if dt != "f32" else (dt,)):
                w = t((cols,), wdt)
                y, rstd = dev.empty((3, cols), dt), dev.empty((3,), "f32")
                ops.rmsnorm_forward(x, w, y, rstd)
                dw = dev.zeros((cols,), "f32")
                ops.rmsnorm_backward(dy, x, w, rstd, dev.empty((3, cols), dt), dw)
                # a LoRA fold's row-strided forms (lora_fold.py): y, dx and the residual in wider rows
                wide = dev.empty((3, cols + 8), dt)
                ops.rmsnorm_forward(x, w, wide[:, :cols], rstd)
                ops.rmsnorm_backward(dy, x, w, rstd, wide[:, :cols], residual=t((3, cols + 3), dt)[:, :cols])
            if dt == "bf16":  # f32 y and dy from bf16 x with f32 w (the model's final norm)
                w, dy32 = t((cols,), "f32"), t((3, cols), "f32")
                ops.rmsnorm_forward(x, w, dev.empty((3, cols), "f32"), rstd)
                ops.rmsnorm_backward(dy32, x, w, rstd, dev.empty((3, cols), "f32"), dev.zeros((cols,), "f32"))
            S = t((3, cols), dt)
            ops.softmax_backward(S, t((3, cols), dt), dev.empty((3, cols), dt), 0.5)
            tgt = dev.tensor(np.array([1, -100, cols - 1], np.int32), "i32")
            ops.cross_entropy(S, tgt, dev.empty((3,), "f32"), dev.empty((3, cols), dt))
            ops.cross_entropy(S, tgt, dev.empty((3,), "f32"), dev.empty((3, cols), dt), scale_by=t((1,), "f32"))
        T = 37
        S = t((2, T, T), dt)
        ops.softmax_causal_forward(S, dev.empty((2, T, T), dt), 0.3)
        seg = dev.tensor(np.repeat(np.arange(3), [10, 20, 7]).astype(np.int32), "i32")
        ops.softmax_causal_forward(S, dev.empty((2, T, T), dt), 0.3, seg)
        ops.softmax_causal_forward(S, dev.empty((2, T, T), dt), 0.3, seg, 5)
        ops.softmax_causal_forward(t((2, 9, T), dt), dev.empty((2, 9, T), dt), 0.3, window=4)
        ops.softmax_causal_forward(S, dev.empty((2, T, T), dt), 0.3, seg, 5, t((2,), "f32"))  # gpt-oss's sinks
        # elementwise and friends over 1000 elements
        n = 1000
        a, b = t((n,), dt), t((n,), dt)
        ops.add(a, b, dev.empty((n,), dt))
        ops.scale(a, 0.5, dev.empty((n,), dt))
        ops.axpy(0.5, a, b)
        for odt in [d for d in ("f32", "f16", "bf16") if d in caps["dtypes"] and d != dt]:
            ops.axpy(0.5, a, t((n,), odt))
        for odt in [d for d in ("f32", "f16", "bf16") if d in caps["dtypes"]]:
            ops.cast(a, dev.empty((n,), odt))
        ops.fill(dev.empty((n,), dt), 1.5)
        ops.dropout(a, dev.empty((n,), dt), 0.3, 7)
        ops.dropout(a, dev.empty((n,), dt), 0.3, 7, seed_offset=dev.tensor(np.array([5, -3], np.int32), "i32"))
        ops.swiglu_forward(a, b, dev.empty((n,), dt))
        ops.swiglu_backward(t((n,), dt), a, b, dev.empty((n,), dt), dev.empty((n,), dt))
        ops.swiglu_forward(a, b, dev.empty((n,), dt), 1.702, 0.5)  # gpt-oss's clamped form
        ops.swiglu_backward(t((n,), dt), a, b, dev.empty((n,), dt), dev.empty((n,), dt), 1.702, 0.5)
        ops.geglu_forward(a, b, dev.empty((n,), dt))
        ops.geglu_backward(t((n,), dt), a, b, dev.empty((n,), dt), dev.empty((n,), dt))
        ops.softcap(a, 30.0, dev.empty((n,), dt))
        ops.softcap_backward(t((n,), dt), b, 30.0, dev.empty((n,), dt))
        # DoRA's: a column block of a wider buffer, 2-3 threadgroups of columns, sums per 10 rows
        zw, v = t((70, 80), dt), t((75,), "f32")
        ops.scale_columns(zw[:, 2:77], v, dev.empty((70, 75), dt))
        ops.scale_columns_backward(t((70, 75), dt), zw[:, 2:77], v, dev.empty((70, 75), dt), dev.empty((7, 75), "f32"))
        ops.dora_norm(t((300,), "f32"), t((300, 4), dt), t((4, 300), "f32"), t((300,), dt), 0.5,
                      dev.empty((300,), "f32"), dev.empty((300,), "f32"))
        ops.transpose_heads(t((3, 5, 8), dt), dev.empty((5, 3, 8), dt))
        ops.transpose_heads(t((3, 5, 7), dt), dev.empty((5, 3, 7), dt))
        x = t((2, T, 16), dt)
        ops.rope(x, dev.tensor(np.arange(T, dtype=np.int32), "i32"), dev.tensor(np.ones(6, np.float32), "f32"))
        ids = dev.tensor(rng.integers(0, 50, 70).astype(np.int32), "i32")
        ops.embedding_forward(ids, t((50, 45), dt), dev.empty((70, 45), dt))
        ops.embedding_backward(ids, t((70, 45), dt), dev.zeros((50, 45), "f32"))
        ops.sumsq(t((3000,), dt), dev.empty((1,), "f32"))
        ops.nonfinite(a, dev.zeros((1,), "i32"))
        ops.adamw_update(t((n,)), t((n,)), t((n,)), dev.zeros((n,), "f32"), 1e-3, working=dev.empty((n,), dt))
        hyper = dev.tensor(np.array([1e-3, 0.1, 1e-5, 0.5, 1.0], np.float32), "f32")
        ops.adamw_update(t((n,)), t((n,)), t((n,)), dev.zeros((n,), "f32"), 1e-3, working=dev.empty((n,), dt),
                         hyper=hyper, sq=dev.tensor(np.array([4.0], np.float32), "f32"), flag=dev.zeros((1,), "i32"))
        optimizer_calls(dev, dt, rng)
        quantized_calls(dev, t, dt, rng)
        moe_calls(dev, t, dt)
        if dt in fused["dtypes"]:  # the fused attention, where the backend has it: GQA, ragged T
            attention(dev, t, dt, fused["segments"], fused["head_dims"] or (16, 64))
    if only is None:
        ops.fill(dev.empty((100,), "i32"), 3)
        ops.adamw_update(t((1000,)), t((1000,)), t((1000,)), dev.zeros((1000,), "f32"), 1e-3)
    dev.synchronize()
    if ex is None:
        print("dry run on metal-sim: every call accepted")
        return 0
    names = set()
    for lib, consts in ex.variants():
        if only is None or lib == only:
            names |= set(ex.library(lib, tuple(consts)).kernel_names)
    ran = set(ex.launched)
    print(f"mslcuda sanitize: {sum(ex.launched.values())} dispatches of {len(ran)} of {len(names)} kernels")
    missing = sorted(names - ran)
    print("kernels not run: " + (", ".join(missing) if missing else "none"))
    return 0


def optimizer_calls(dev, dt, rng):
    """Two clipped steps of every optimizer of krnl.train.optimizers (SGD also with Nesterov
    momentum) as a run makes them, over LoRA factors of ragged sizes (a 3-D expert's among them;
    8-bit AdamW's blocks of 256 end part-filled) with a working copy in dt."""
    from krnl import ops
    from krnl.models.params import FlatParams
    from krnl.train.optim import OPTIMIZERS, Schedule
    shapes = {"q.lora_A.weight": (3, 17), "q.lora_B.weight": (333, 3), "e.lora_A.weight": (2, 3, 5)}
    options = {"sgd": ({}, {"momentum": 0.9, "nesterov": True}), "adamw8bit": ({"min_8bit_size": 64},)}
    for name, cls in OPTIMIZERS.items():
        for kw in options.get(name, ({},)):
            fp = FlatParams(dev, shapes, compute_dtype=dt)
            fp.load({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()})
            opt = cls(fp, Schedule(1e-2, kind="constant"), weight_decay=0.01, max_grad_norm=1.0, **kw)
            for _ in range(2):
                ops.cast(dev.tensor(rng.standard_normal(fp.numel).astype(np.float32), "f32"), fp.grads[:fp.numel])
                opt.step()


def quantized_calls(dev, t, dt, rng):
    """quantized_matmul (both forms), quantized_embedding and moe_quantized_matmul in dtype dt, affine and MXFP4."""
    from krnl import ops
    # moe_quantized_matmul: 74 rows on 5 experts (20, 0, 33, 7, 14: ragged row tiles, 1 + 2 + 1 + 1
    # of a grid of (74 + 31 * 5) / 32 = 7, the last 2 exit) times W_e (45, 96) at every bits,
    # both directions, scales in dt and in f32; offsets uploaded (moe_calls chains moe_sort's)
    offsets = dev.tensor(np.array([0, 20, 20, 53, 60, 74], np.int32), "i32")
    for bits in (2, 3, 4, 5, 6, 8):
        w = dev.tensor(rng.integers(0, 2**31, (5, 45, 96 * bits // 32)).astype(np.int32), "i32")
        for sdt in ((dt, "f32") if dt != "f32" else (dt,)):
            sc, bi = t((5, 45, 3), sdt, 0.1), t((5, 45, 3), sdt)
            ops.moe_quantized_matmul(t((74, 96), dt), w, sc, bi, offsets, dev.empty((74, 45), dt), True, 32, bits)
            ops.moe_quantized_matmul(t((74, 45), dt), w, sc, bi, offsets, t((74, 96), dt), False, 32, bits, 0.5)
    # quantized_matmul: W (45, 96) at every bits, both directions, scales in dt and in f32;
    # the few-row form (7 rows, x W^T) and the tiled form (40 rows: 2 x 2 or 2 x 3 ragged
    # 32x32 tiles, K = 45 ragged in x W); x and out as column blocks of wider matrices once per bits
    for bits in (2, 3, 4, 5, 6, 8):
        w = dev.tensor(rng.integers(0, 2**31, (45, 96 * bits // 32)).astype(np.int32), "i32")
        for sdt in ((dt, "f32") if dt != "f32" else (dt,)):
            sc, bi = t((45, 3), sdt, 0.1), t((45, 3), sdt)
            for n in (7, 40):
                ops.quantized_matmul(t((n, 96), dt), w, sc, bi, dev.empty((n, 45), dt), True, 32, bits)
                ops.quantized_matmul(t((n, 45), dt), w, sc, bi, t((n, 96), dt), False, 32, bits, 0.5)
        sc, bi = t((45, 3), dt, 0.1), t((45, 3), dt)
        ops.quantized_matmul(t((7, 100), dt)[:, 3:99], w, sc, bi, t((7, 50), dt)[:, 2:47], True, 32, bits)
        qids = dev.tensor(rng.integers(0, 45, 33).astype(np.int32), "i32")
        for sdt in ((dt, "f32") if dt != "f32" else (dt,)):  # rows of the same W as an embedding table
            ops.quantized_embedding(qids, w, t((45, 3), sdt, 0.1), t((45, 3), sdt), dev.empty((33, 96), dt), 32, bits)
    # MXFP4 (mode mxfp4: E2M1 codes times a power of two a group of 32, no biases), the same calls;
    # its scales in bf16 or f32 (f16's range does not hold every power of two)
    w = dev.tensor(rng.integers(0, 2**31, (45, 12)).astype(np.int32), "i32")
    we = dev.tensor(rng.integers(0, 2**31, (5, 45, 12)).astype(np.int32), "i32")
    for sdt in (dt, "f32") if dt == "bf16" else ("f32",):
        sc = dev.tensor(np.ldexp(1.0, rng.integers(-4, 2, (45, 3))).astype(np.float32), sdt)
        sce = dev.tensor(np.ldexp(1.0, rng.integers(-4, 2, (5, 45, 3))).astype(np.float32), sdt)
        for n in (7, 40):
            ops.quantized_matmul(t((n, 96), dt), w, sc, None, dev.empty((n, 45), dt), True, 32, 4, mode="mxfp4")
            ops.quantized_matmul(t((n, 45), dt), w, sc, None, t((n, 96), dt), False, 32, 4, 0.5, "mxfp4")
        ops.moe_quantized_matmul(t((74, 96), dt), we, sce, None, offsets, dev.empty((74, 45), dt), True, 32, 4,
                                 mode="mxfp4")
        ops.moe_quantized_matmul(t((74, 45), dt), we, sce, None, offsets, t((74, 96), dt), False, 32, 4, 0.5,
                                 mode="mxfp4")


def moe_calls(dev, t, dt):
    """The mixture-of-experts ops chained as a model runs them (the routing stays on the device):
    37 tokens on 5 experts, top 2 (74 pairs: moe_sort's one threadgroup, ragged row tiles per
    expert), 45 channels and 70 outputs (2-3 tiles a dimension), in dtype dt."""
    from krnl import ops
    N, E, K, C, O = 37, 5, 2, 45, 70
    P = N * K
    logits = t((N, E), dt)
    ids, w = dev.empty((N, K), "i32"), dev.empty((N, K), "f32")
    for norm in (False, True):
        ops.moe_route(logits, ids, w, norm)
        ops.moe_route_backward(logits, ids, t((N, K)), dev.empty((N, E), dt), norm, t((E,)) if norm else None)
    tokens, slot, offsets = dev.empty((P,), "i32"), dev.empty((N, K), "i32"), dev.empty((E + 1,), "i32")
    ops.moe_sort(ids, tokens, slot, offsets)
    xs, h = dev.empty((P, C), dt), dev.empty((P, O), dt)
    ops.moe_gather(t((N, C), dt), tokens, xs)
    ops.moe_gemm(xs, t((E, O, C), dt), offsets, h)
    ops.moe_gemm(h, t((E, O, C), dt), offsets, t((P, C), dt), transpose=False, beta=0.5)
    for odt in ((dt, "f32") if dt != "f32" else (dt,)):
        ops.moe_gemm_weight_grad(h, xs, offsets, t((E, O, C), odt), beta=1.0)
    ops.moe_combine(xs, slot, w, dev.empty((N, C), dt))
    ops.moe_combine(xs, slot, None, t((N, C), dt), 0.5)
    ops.moe_combine_backward(t((N, C), dt), xs, slot, w, dev.empty((P, C), dt), dev.empty((N, K), "f32"))


def attention(dev, t, dt, segments, head_dims):
    """attention_forward and _backward at T = 37 (ragged blocks), 4 query heads on 2 KV heads, at
    every head size the device lists, plain, with a window and (where supported) packed segments
    and sinks (the forward's only: its lse holds them)."""
    from krnl import ops
    T = 37
    seg = dev.tensor(np.repeat(np.arange(3), [10, 20, 7]).astype(np.int32), "i32") if segments else None
    for D in head_dims:
        q, k, v = t((4, T, D), dt), t((2, T, D), dt), t((2, T, D), dt)
        for extra in ({}, {"window": 5}, {"segments": seg} if seg is not None else None):
            if extra is None:
                continue
            try:
                o, lse = dev.empty((4, T, D), dt), dev.empty((4, T), "f32")
                ops.attention_forward(q, k, v, o, lse, 0.25, **extra)
            except TypeError:  # a core without the keyword (segments, window): the plain call only
                continue
            ops.attention_backward(q, k, v, o, t((4, T, D), dt), lse, dev.empty((4, T, D), dt),
                                   dev.empty((2, T, D), dt), dev.empty((2, T, D), dt), 0.25, **extra)
        if dev.capabilities()["fused_attention"].get("sinks"):
            ops.attention_forward(q, k, v, dev.empty((4, T, D), dt), dev.empty((4, T), "f32"), 0.25, window=5,
                                  sinks=t((4,), "f32"))


def run_barrier(n: int, build_only: bool = False):
    import mslcuda
    src = (ROOT / "metal" / "gemm.metal").read_text()
    sites = [m.start() for m in re.finditer(re.escape(BARRIER), src)]
    if n:
        if not 1 <= n <= len(sites):
            raise SystemExit(f"gemm.metal has {len(sites)} barriers; got {n}")
        s = sites[n - 1]
        src = src[:s] + " " * len(BARRIER) + src[s + len(BARRIER):]  # same lines and columns
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "metal" / "gemm.metal"  # named as the original in the generated code's line markers
        path.parent.mkdir()
        path.write_text(src)
        lib = mslcuda.build(path, {0: False}, include_dirs=[ROOT / "metal", ROOT / "csrc" / "core"],
                            name=f"gemm_nobarrier{n}")
    if build_only:
        return 0
    rt = mslcuda.runtime()
    M, N, K = 70, 45, 37
    rng = np.random.default_rng(1)
    A, B = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    bufs = {}
    for i, arr in ((0, A), (1, B), (2, np.zeros((M, N), np.float32))):
        p = rt.alloc(arr.nbytes)
        ctypes.memmove(p, arr.ctypes.data, arr.nbytes)
        bufs[i] = p
    args = np.array([M, N, K, K, N, N, 0, 0, 0, K], np.uint32).tobytes() + np.array([1.0, 0.0], np.float32).tobytes()
    lib.launch("gemm_nn_f32", (-(-N // 32), -(-M // 32), 1), (32, 1, 1), bufs, args, 3)
    rt.synchronize()
    C = np.ctypeslib.as_array((ctypes.c_float * (M * N)).from_address(bufs[2])).reshape(M, N).copy()
    ref = A.astype(np.float64) @ B.astype(np.float64)
    print(f"gemm.metal with barrier {n} of {len(sites)} deleted: max error {np.max(np.abs(C - ref)):.3e}"
          if n else f"gemm.metal as it is: max error {np.max(np.abs(C - ref)):.3e}")
    for p in bufs.values():
        rt.free(p)
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "kernels":
        sys.exit(run_kernels(*sys.argv[2:4]))
    if len(sys.argv) in (3, 4) and sys.argv[1] == "barrier":
        sys.exit(run_barrier(int(sys.argv[2]), sys.argv[3:] == ["--build-only"]))
    raise SystemExit(__doc__)
