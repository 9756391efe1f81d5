"""`krnl doctor`'s op cases: each op of the backend contract (csrc/core/op_list.h) called on small
awkward operands, the same way on the device under test and on the CPU (doctor_ops.py runs and
compares them). They ship in the package: the doctor runs from an installed wheel, without tests/,
whose float64 oracles and finer tolerances stay the real op tests."""

import math

import numpy as np

import krnl

from ...formats.mlx_folder import round_to  # values rounded to a dtype and back, as float32
from ...quant.affine import pack
from ...quant.mxfp4 import e8m0_to_float

ops = krnl.ops

FLOAT_DTYPES = ("f32", "f16", "bf16")
# Unit roundoff (half an ulp of 1.0) of each dtype: f32 has 24 significant bits, f16 11, bf16 8.
UNIT = {"f32": 2.0**-24, "f16": 2.0**-11, "bf16": 2.0**-8}
# Error floor of any f32 result judged against the largest reference value: a different summation
# order over these sizes (K <= 127) moves a result by far less; a wrong kernel moves it by O(1).
F32_FLOOR = 2e-5


class Operands:
    """Makes one case's tensors on one device: floats in the dtype under test unless told, outputs
    prefilled with NaN (an element left unwritten then shows), accumulators with zeros."""

    def __init__(self, dev, dtype):
        self.dev, self.dt = dev, dtype

    def t(self, a, dtype=None):
        a = np.asarray(a)
        return self.dev.tensor(a, "i32" if a.dtype.kind in "iu" else (dtype or self.dt))

    def out(self, shape, dtype=None, value=math.nan):
        x = self.dev.empty(tuple(shape), dtype or self.dt)
        ops.fill(x, value)
        return x


class Case:
    """One check: gen(rng, n) -> {name: array} of inputs, run(O, a) -> {name: output tensor};
    ulps: the tolerance in units of the dtype's roundoff (relative to the largest reference value,
    F32_FLOOR at least); same_dtype: the CPU computes in the dtype under test too (for ops that
    only move or round values, which must then agree exactly); dtypes: where only some apply."""

    def __init__(self, op, name, gen, run, ulps=4.0, same_dtype=False, dtypes=FLOAT_DTYPES, exact=False):
        self.op, self.name, self.gen, self.run = op, name, gen, run
        self.ulps, self.same_dtype, self.dtypes, self.exact = ulps, same_dtype, dtypes, exact

    def tolerance(self, dtype):
        return 0.0 if self.exact else max(self.ulps * UNIT[dtype], F32_FLOOR)


# Host references only where an op's inputs are another op's outputs (a backward reads the forward's
# saved values): computed on the host, so that both devices read the same ones.
def _rstd(x, eps):
    return (1.0 / np.sqrt(np.mean(np.float64(x) ** 2, axis=-1) + eps)).astype(np.float32)


def _attention(q, k, v, scale, sinks=None):
    """(o, lse) of causal GQA attention in float64; sinks (Hq,) join each head's rows unscaled, no value."""
    Hq, T, _ = q.shape
    rep = Hq // k.shape[0]
    kk, vv = np.repeat(np.float64(k), rep, axis=0), np.repeat(np.float64(v), rep, axis=0)
    s = scale * np.einsum("htd,hsd->hts", np.float64(q), kk)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    sk = np.full((Hq, 1, 1), -np.inf) if sinks is None else np.float64(sinks).reshape(Hq, 1, 1)
    m = np.maximum(s.max(-1, keepdims=True), sk)
    e, l = np.exp(s - m), np.exp(sk - m) + np.exp(s - m).sum(-1, keepdims=True)
    return np.einsum("hts,hsd->htd", e / l, vv), (m + np.log(l))[..., 0]


def _normal(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


# ---------------------------------------------------------------------------- the cases

def _gemm_cases():
    def gen(ta, tb, K, N, batch=0):
        def g(rng, n):
            a, b = (K, n) if ta else (n, K), (N, K) if tb else (K, N)
            lead = (batch,) if batch else ()
            return {"A": _normal(rng, *lead, *a), "B": _normal(rng, *lead, *b), "C": _normal(rng, *lead, n, N)}
        return g

    def run(ta, tb, alpha=1.0, beta=0.0, c_dtype=None):
        def r(O, a):
            C = O.t(a["C"], c_dtype) if beta else O.out(a["C"].shape, c_dtype)
            kw = {"batch": a["A"].shape[0]} if a["A"].ndim == 3 else {}
            ops.gemm(O.t(a["A"]), O.t(a["B"]), C, trans_a=ta, trans_b=tb, alpha=alpha, beta=beta, **kw)
            return {"C": C}
        return r

    return [Case("gemm", "nn K=33", gen(False, False, 33, 31), run(False, False)),
            Case("gemm", "tn K=127 C f32", gen(True, False, 127, 33), run(True, False, c_dtype="f32")),
            Case("gemm", "nt alpha/beta", gen(False, True, 64, 64), run(False, True, alpha=0.5, beta=1.0)),
            Case("gemm", "batched 2", gen(False, False, 31, 33, batch=2), run(False, False))]


def _norm_cases():
    C, eps = 127, 1e-5

    def gen(rng, n):
        return {"x": _normal(rng, n, C), "w": 1 + _normal(rng, C, scale=0.5), "res": _normal(rng, n, C),
                "dy": _normal(rng, n, C)}

    def fwd(residual):
        def r(O, a):
            x, y, rstd = O.t(a["x"]), O.out(a["x"].shape), O.out(a["x"].shape[:1], "f32")
            ops.rmsnorm_forward(x, O.t(a["w"]), y, rstd, eps=eps, residual=O.t(a["res"]) if residual else None)
            return {"y": y, "rstd": rstd, **({"x": x} if residual else {})}
        return r

    def bwd(residual):
        def r(O, a):
            dx, dw = O.out(a["x"].shape), O.out((C,), "f32", 0.0)
            ops.rmsnorm_backward(O.t(a["dy"]), O.t(a["x"]), O.t(a["w"]), O.t(_rstd(a["x"], eps), "f32"), dx, dw,
                                 residual=O.t(a["res"]) if residual else None)
            return {"dx": dx, "dw": dw}
        return r

    return [Case("rmsnorm_forward", "C=127", gen, fwd(False)),
            Case("rmsnorm_forward", "C=127 residual", gen, fwd(True)),
            Case("rmsnorm_backward", "C=127", gen, bwd(False), ulps=8),
            Case("rmsnorm_backward", "C=127 residual", gen, bwd(True), ulps=8)]


def _elementwise_cases():
    def gen(rng, n):
        return {"g": _normal(rng, n, 33, scale=2), "u": _normal(rng, n, 33), "ds": _normal(rng, n, 33)}

    def gated(fwd, bwd):
        def f(O, a):
            s = O.out(a["g"].shape)
            fwd(O.t(a["g"]), O.t(a["u"]), s)
            return {"s": s}

        def b(O, a):
            dg, du = O.out(a["g"].shape), O.out(a["g"].shape)
            bwd(O.t(a["ds"]), O.t(a["g"]), O.t(a["u"]), dg, du)
            return {"dg": dg, "du": du}
        return f, b

    sw, swb = gated(ops.swiglu_forward, ops.swiglu_backward)
    ge, geb = gated(ops.geglu_forward, ops.geglu_backward)
    cap = 5.0

    def softcap(O, a):
        out = O.out(a["g"].shape)
        ops.softcap(O.t(3 * a["g"]), cap, out)
        return {"out": out}

    def softcap_back(O, a):
        dx = O.out(a["g"].shape)
        y = round_to(cap * np.tanh(3 * a["g"] / cap), O.dt)  # the forward's output, as saved
        ops.softcap_backward(O.t(a["ds"]), O.t(y), cap, dx)
        return {"dx": dx}

    def add(O, a):
        ops.add(O.t(a["g"]), O.t(a["u"]), out := O.out(a["g"].shape))
        return {"out": out}

    def axpy(O, a):
        y = O.t(a["u"])
        ops.axpy(-0.75, O.t(a["g"]), y)
        return {"y": y}

    def scale(O, a):
        ops.scale(O.t(a["g"]), 0.3, out := O.out(a["g"].shape))
        return {"out": out}

    def cast_up(O, a):
        out = O.out(a["g"].shape, "f32")
        ops.cast(O.t(a["g"]), out)
        return {"out": out}

    def cast_down(O, a):  # unrounded f32 in: the rounding itself is checked (the CPU rounds in O.dt too)
        out = O.out(a["g"].shape)
        ops.cast(O.dev.tensor(a["raw"], "f32"), out)
        return {"out": out}

    def gen_raw(rng, n):
        return {"g": _normal(rng, n, 33), "raw": _normal(rng, n, 33)}

    def fill(O, a):
        x = O.out(a["g"].shape, value=0.0)
        ops.fill(x, 0.75)
        return {"x": x}

    def sumsq(O, a):
        ops.sumsq(O.t(a["g"]), out := O.out((1,), "f32"))
        return {"out": out}

    def nonfinite(O, a):
        clean, dirty = O.out((1,), "i32", 0), O.out((1,), "i32", 0)
        bad = a["g"].copy()
        bad.flat[bad.size // 2] = np.inf
        ops.nonfinite(O.t(a["g"]), clean)
        ops.nonfinite(O.t(bad), dirty)
        return {"clean": clean, "dirty": dirty}

    return [Case("swiglu_forward", "33 wide", gen, sw), Case("swiglu_backward", "33 wide", gen, swb),
            Case("geglu_forward", "33 wide", gen, ge), Case("geglu_backward", "33 wide", gen, geb, ulps=8),
            Case("softcap", "cap 5", gen, softcap), Case("softcap_backward", "cap 5", gen, softcap_back),
            Case("add", "33 wide", gen, add), Case("axpy", "alpha -0.75", gen, axpy), Case("scale", "0.3", gen, scale),
            Case("cast", "to f32", gen, cast_up, exact=True),
            Case("cast", "from f32", gen_raw, cast_down, same_dtype=True, exact=True),
            Case("fill", "0.75", gen, fill, exact=True), Case("sumsq", "33 wide", gen, sumsq),
            Case("nonfinite", "inf", gen, nonfinite, exact=True)]


def _attention_cases():
    D, R = 16, 6  # rope turns the first 2R dims (partial rotary)

    def inv_freq():
        return (10000.0 ** (-np.arange(R) / R)).astype(np.float32)

    def gen(rng, n):
        return {"x": _normal(rng, 3, n, D), "pos": (np.arange(n) + 5).astype(np.int32),
                "S": _normal(rng, 2, n, n + 3, scale=3), "dP": _normal(rng, 2, n, n + 3),
                "Ssq": _normal(rng, 2, n, n, scale=3), "seg": (np.arange(n) // 7).astype(np.int32)}

    def rope(sign):
        def r(O, a):
            x = O.t(a["x"])
            ops.rope(x, O.t(a["pos"]), O.t(inv_freq(), "f32"), sign=sign)
            return {"x": x}
        return r

    def softmax(masked):
        def r(O, a):
            S = a["Ssq"] if masked else a["S"]  # segments take square scores only
            P = O.out(S.shape)
            ops.softmax_causal_forward(O.t(S), P, 0.3, segments=O.t(a["seg"]) if masked else None,
                                       window=5 if masked else 0)
            return {"P": P}
        return r

    def softmax_back(O, a):
        e = np.exp(a["S"] - a["S"].max(-1, keepdims=True))
        dS = O.out(a["S"].shape)
        ops.softmax_backward(O.t(round_to(e / e.sum(-1, keepdims=True), O.dt)), O.t(a["dP"]), dS, 0.3)
        return {"dS": dS}

    def transpose(axis, rotate):
        def r(O, a):
            x = a["x"] if axis == 0 else a["x"].transpose(1, 0, 2).copy()  # heads_axis 0: (H, T, D); 1: (T, H, D)
            out = O.out((x.shape[1], x.shape[0], D))
            rot = {"positions": O.t(a["pos"]), "inv_freq": O.t(inv_freq(), "f32"), "rotate": rotate} if rotate else {}
            ops.transpose_heads(O.t(x), out, heads_axis=axis, **rot)
            return {"out": out}
        return r

    def gen_attn(rng, n):
        H, KV, d = 4, 2, 8
        return {"q": _normal(rng, H, n, d), "k": _normal(rng, KV, n, d), "v": _normal(rng, KV, n, d),
                "dout": _normal(rng, H, n, d)}

    return [Case("rope", "D=16 partial", gen, rope(1.0)), Case("rope", "inverse", gen, rope(-1.0)),
            Case("softmax_causal_forward", "Tq<Tk", gen, softmax(False)),
            Case("softmax_causal_forward", "segments+window", gen, softmax(True)),
            Case("softmax_backward", "Tq<Tk", gen, softmax_back, ulps=8),
            Case("transpose_heads", "(T,H,D)", gen, transpose(1, 0), exact=True),
            Case("transpose_heads", "(H,T,D) rope 2 heads", gen, transpose(0, 2)),
            Case("attention_forward", "GQA 4/2 D=8", gen_attn, attention_fwd, ulps=8),
            Case("attention_backward", "GQA 4/2 D=8", gen_attn, attention_bwd, ulps=16)]


def attention_fwd(O, a, sinks=None):
    """The fused forward of inputs q, k, v (sinks (Hq,) f32 where given, cases_gpt_oss.py)."""
    o, lse = O.out(a["q"].shape), O.out(a["q"].shape[:2], "f32")
    ops.attention_forward(O.t(a["q"]), O.t(a["k"]), O.t(a["v"]), o, lse, 1 / math.sqrt(a["q"].shape[-1]),
                          sinks=None if sinks is None else O.t(sinks, "f32"))
    return {"o": o, "lse": lse}


def attention_bwd(O, a, sinks=None):
    """The backward from the saved values of attention_fwd's forward (computed on the host, for both devices)."""
    scale = 1 / math.sqrt(a["q"].shape[-1])
    o, lse = _attention(a["q"], a["k"], a["v"], scale, sinks)
    dq, dk, dv = O.out(a["q"].shape), O.out(a["k"].shape), O.out(a["k"].shape)
    ops.attention_backward(O.t(a["q"]), O.t(a["k"]), O.t(a["v"]), O.t(round_to(o, O.dt)), O.t(a["dout"]),
                           O.t(lse.astype(np.float32), "f32"), dq, dk, dv, scale)
    return {"dq": dq, "dk": dk, "dv": dv}


def _table_cases():
    V, C = 37, 33

    def gen(rng, n):
        return {"ids": rng.integers(0, V, n).astype(np.int32), "table": _normal(rng, V, C),
                "dout": _normal(rng, n, C), "logits": _normal(rng, n, 101, scale=2),
                "targets": np.where(np.arange(n) % 5 == 3, -100, rng.integers(0, 101, n)).astype(np.int32)}

    def emb(O, a):
        out = O.out((len(a["ids"]), C))
        ops.embedding_forward(O.t(a["ids"]), O.t(a["table"]), out)
        return {"out": out}

    def emb_back(O, a):
        dtable = O.out((V, C), "f32", 0.0)
        ops.embedding_backward(O.t(a["ids"]), O.t(a["dout"]), dtable)
        return {"dtable": dtable}

    def xent(O, a):
        n = len(a["targets"])
        loss, dlogits = O.out((n,), "f32"), O.out(a["logits"].shape)
        ops.cross_entropy(O.t(a["logits"]), O.t(a["targets"]), loss, dlogits, scale=1.0 / n)
        return {"loss": loss, "dlogits": dlogits}

    return [Case("embedding_forward", "V=37", gen, emb, exact=True),
            Case("embedding_backward", "V=37", gen, emb_back),
            Case("cross_entropy", "V=101 ignored rows", gen, xent)]


def _quantized_cases():
    O_, I, V = 33, 128, 37

    def gen(bits, gs, rows, mxfp4=False):
        def g(rng, n):
            words = pack(rng.integers(0, 2**bits, (rows, I)), bits)
            scales = (e8m0_to_float(rng.integers(120, 123, (rows, I // gs))) if mxfp4  # 2^-7 .. 2^-5
                      else rng.uniform(0.01, 0.02, (rows, I // gs)).astype(np.float32))
            return {"w": words, "scales": scales, "biases": (-(2**bits - 1) / 2 * scales).astype(np.float32),
                    "x": _normal(rng, n, I), "dy": _normal(rng, n, O_), "out0": _normal(rng, n, O_),
                    "ids": rng.integers(0, V, n).astype(np.int32)}
        return g

    def qmm(bits, gs, transpose, beta=0.0, mode="affine"):
        def r(O, a):
            x = a["x"] if transpose else a["dy"]
            shape = (x.shape[0], O_ if transpose else I)
            out = O.t(a["out0"]) if beta else O.out(shape)
            mx = mode == "mxfp4"  # E8M0's powers of two: f32 scales whatever x's dtype, no biases
            ops.quantized_matmul(O.t(x), O.t(a["w"]), O.t(a["scales"], "f32" if mx else None),
                                 None if mx else O.t(a["biases"]), out, transpose, gs, bits, beta, mode)
            return {"out": out}
        return r

    def qemb(bits, gs):
        def r(O, a):
            out = O.out((len(a["ids"]), I))
            ops.quantized_embedding(O.t(a["ids"]), O.t(a["w"]), O.t(a["scales"]), O.t(a["biases"]), out,
                                    group_size=gs, bits=bits)
            return {"out": out}
        return r

    cases = []
    for bits, gs in ((4, 64), (3, 32), (8, 128)):
        cases.append(Case("quantized_matmul", f"q{bits} g{gs} x W^T", gen(bits, gs, O_), qmm(bits, gs, True)))
        cases.append(Case("quantized_matmul", f"q{bits} g{gs} dy W", gen(bits, gs, O_), qmm(bits, gs, False)))
    cases.append(Case("quantized_matmul", "q4 g64 beta 0.5", gen(4, 64, O_), qmm(4, 64, True, beta=0.5)))
    for transpose, beta, name in ((True, 0.0, "mxfp4 x W^T"), (False, 0.0, "mxfp4 dy W"), (True, 0.5, "mxfp4 beta 0.5")):
        cases.append(Case("quantized_matmul", name, gen(4, 32, O_, True), qmm(4, 32, transpose, beta, "mxfp4")))
    return cases + [Case("quantized_embedding", f"q{bits} g{gs}", gen(bits, gs, V), qemb(bits, gs))
                    for bits, gs in ((4, 64), (3, 32))]


def _training_cases():
    def gen(rng, n):
        return {"x": (1 + rng.uniform(0, 1, (n, 33))).astype(np.float32),  # |x| >= 1: a dropped element shows
                "p": _normal(rng, n * 33), "g": _normal(rng, n * 33), "m": _normal(rng, n * 33, scale=0.1),
                "v": rng.uniform(0.01, 1.0, n * 33).astype(np.float32)}

    def dropout(offset):
        def r(O, a):
            out = O.out(a["x"].shape)
            off = {"seed_offset": O.t(np.array([7, 1], np.int32))} if offset else {}
            ops.dropout(O.t(a["x"]), out, 0.25, 1234, **off)
            return {"out": out}
        return r

    def adamw(working, device_scalars):
        def r(O, a):
            p, m, v = (O.t(a[k], "f32") for k in ("p", "m", "v"))
            kw = {"working": O.out(a["p"].shape)} if working else {}
            if device_scalars:  # what a replayed step passes: [step_size, bc2_sqrt, decay, inv_denom, max_norm]
                g2 = float(np.sum(np.float64(a["g"]) ** 2))
                kw.update(hyper=O.t(np.array([1e-2, 0.3, 0.999, 0.5, 1.0], np.float32), "f32"),
                          sq=O.t(np.array([g2], np.float32), "f32"), flag=O.out((1,), "i32", 0))
            ops.adamw_update(p, O.t(a["g"], "f32"), m, v, 1e-2, weight_decay=0.1, step=3, **kw)
            return {"params": p, "m": m, "v": v, **({"working": kw["working"]} if working else {})}
        return r

    return [Case("dropout", "p=0.25", gen, dropout(False)), Case("dropout", "seed offset", gen, dropout(True)),
            Case("adamw_update", "f32", gen, adamw(False, False), dtypes=("f32",)),
            Case("adamw_update", "working copy", gen, adamw(True, False)),
            Case("adamw_update", "device scalars", gen, adamw(False, True), dtypes=("f32",))]


def cases():
    """Every check but the experts' and DoRA's ops' (cases_moe.py, cases_dora.py: on Case), by op family."""
    return (_gemm_cases() + _norm_cases() + _elementwise_cases() + _attention_cases() + _table_cases()
            + _quantized_cases() + _training_cases())


