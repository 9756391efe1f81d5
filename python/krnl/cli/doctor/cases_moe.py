"""`krnl doctor`'s cases of the mixture-of-experts ops (cases.py has the rest and what they share):
routing, grouping, the combine and the grouped GEMMs of n tokens over 7 experts, 3 per token, one
expert reached by one token only and, at n = 1, four experts empty."""

import numpy as np

import krnl

from .cases import Case, _normal
from ...quant.affine import pack
from ...quant.mxfp4 import e8m0_to_float

ops = krnl.ops


def _grouping(ids, E):
    """moe_sort's (tokens, slot, offsets) of expert ids (N, K), on the host."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    slot = np.empty_like(order)
    slot[order] = np.arange(flat.size)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=E))])
    return (order // ids.shape[1]).astype(np.int32), slot.reshape(ids.shape).astype(np.int32), offsets.astype(np.int32)


def moe_cases():
    """The mixture-of-experts ops at E = 7 experts, K = 3 per token (n tokens)."""
    E, K, C, F = 7, 3, 33, 17

    def gen(rng, n):
        # logits a row apart by >= 0.5: no dtype's rounding reorders the experts
        logits = np.stack([rng.permutation(E) * 0.5 + rng.uniform(0, 0.1) for _ in range(n)]).astype(np.float32)
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, :K].astype(np.int32)
        if n > 1:
            ids[0] = [6, 2, 4]  # expert 6 for one row only; with n = 1 the others stay empty
        tokens, slot, offsets = _grouping(ids, E)
        return {"logits": logits, "ids": ids, "tokens": tokens, "slot": slot, "offsets": offsets,
                "w": rng.uniform(0, 1, (n, K)).astype(np.float32), "dw": _normal(rng, n, K), "x": _normal(rng, n, C),
                "ys": _normal(rng, n * K, C), "out": _normal(rng, n, C), "dout": _normal(rng, n, C),
                "xs": _normal(rng, n * K, C), "dys": _normal(rng, n * K, F), "W": _normal(rng, E, F, C, scale=0.2),
                "dprobs": _normal(rng, E), "qw": np.stack([pack(rng.integers(0, 16, (F, C + 31)), 4) for _ in range(E)]),
                "qs": rng.uniform(0.01, 0.02, (E, F, 2)).astype(np.float32), "qx": _normal(rng, n * K, C + 31),
                "qe": e8m0_to_float(rng.integers(120, 123, (E, F, 2)))}  # mxfp4's scales, 2^-7 .. 2^-5

    def route(O, a):
        ids, w = O.t(np.zeros_like(a["ids"])), O.out(a["ids"].shape, "f32")
        ops.moe_route(O.t(a["logits"]), ids, w, True)
        return {"ids": ids, "weights": w}

    def route_back(O, a):
        dl = O.out(a["logits"].shape)
        ops.moe_route_backward(O.t(a["logits"]), O.t(a["ids"]), O.t(a["dw"], "f32"), dl, True, O.t(a["dprobs"], "f32"))
        return {"dlogits": dl}

    def sort(O, a):
        n = a["ids"].shape[0]
        tokens, slot, offsets = (O.t(np.zeros(s, np.int32)) for s in ((n * K,), (n, K), (E + 1,)))
        ops.moe_sort(O.t(a["ids"]), tokens, slot, offsets)
        return {"tokens": tokens, "slot": slot, "offsets": offsets}

    def gather(O, a):
        out = O.out(a["ys"].shape)
        ops.moe_gather(O.t(a["x"]), O.t(a["tokens"]), out)
        return {"out": out}

    def combine(weighted):
        def r(O, a):
            out = O.t(a["out"])
            ops.moe_combine(O.t(a["ys"]), O.t(a["slot"]), O.t(a["w"], "f32") if weighted else None, out, 0.5)
            return {"out": out}
        return r

    def combine_back(O, a):
        dys, dw = O.out(a["ys"].shape), O.out(a["w"].shape, "f32")
        ops.moe_combine_backward(O.t(a["dout"]), O.t(a["ys"]), O.t(a["slot"]), O.t(a["w"], "f32"), dys, dw)
        return {"dys": dys, "dweights": dw}

    def gemm(transpose):
        def r(O, a):
            x = a["xs"] if transpose else a["dys"]
            out = O.out((x.shape[0], F if transpose else C))
            ops.moe_gemm(O.t(x), O.t(a["W"]), O.t(a["offsets"]), out, transpose)
            return {"out": out}
        return r

    def weight_grad(O, a):
        out = O.t(np.ones((E, F, C), np.float32), "f32")
        ops.moe_gemm_weight_grad(O.t(a["dys"]), O.t(a["xs"]), O.t(a["offsets"]), out, alpha=0.5, beta=1.0)
        return {"out": out}

    def qmm(transpose, mode="affine"):
        def r(O, a):
            x = a["qx"] if transpose else a["dys"]
            out = O.out((x.shape[0], F if transpose else C + 31))
            # mxfp4: E8M0's powers of two as f32 scales whatever x's dtype, no biases
            s, b = (O.t(a["qe"], "f32"), None) if mode == "mxfp4" else (O.t(a["qs"]), O.t(-7.5 * a["qs"]))
            ops.moe_quantized_matmul(O.t(x), O.t(a["qw"]), s, b, O.t(a["offsets"]), out, transpose, 32, 4, mode=mode)
            return {"out": out}
        return r

    return [Case("moe_quantized_matmul", "q4 g32 x W^T", gen, qmm(True)),
            Case("moe_quantized_matmul", "q4 g32 dy W", gen, qmm(False)),
            Case("moe_quantized_matmul", "mxfp4 x W^T", gen, qmm(True, "mxfp4")),
            Case("moe_quantized_matmul", "mxfp4 dy W", gen, qmm(False, "mxfp4")),
            Case("moe_route", "E=7 top3 norm", gen, route), Case("moe_route_backward", "norm dprobs", gen, route_back,
                                                                                ulps=16),
            Case("moe_sort", "E=7 top3", gen, sort, exact=True), Case("moe_gather", "C=33", gen, gather, exact=True),
            Case("moe_combine", "weighted beta", gen, combine(True), ulps=8),
            Case("moe_combine", "gather's backward", gen, combine(False), ulps=8),
            Case("moe_combine_backward", "C=33", gen, combine_back, ulps=8),
            Case("moe_gemm", "x W^T", gen, gemm(True)), Case("moe_gemm", "dy W", gen, gemm(False)),
            Case("moe_gemm_weight_grad", "a^T b beta", gen, weight_grad)]
