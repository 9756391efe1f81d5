"""`krnl doctor`'s cases of the ops' gpt-oss forms (cases.py has the rest and what they share):
attention sinks in the materialised softmax and the fused attention (and the backward from such a
forward's lse), and SwiGLU clamped at a limit that the inputs cross."""

import numpy as np

import krnl

from .cases import Case, _normal, attention_bwd, attention_fwd

ops = krnl.ops

CLAMP = {"alpha": 1.702, "limit": 2.0}  # gpt-oss's alpha; a limit g (2 sigma) and u (1 sigma) both cross


def gpt_oss_cases():
    """Sinks large and small against scores of a few units, GQA 4/2 at D = 8; the clamped SwiGLU."""
    def gen(rng, n):
        return {"g": _normal(rng, n, 33, scale=2), "u": _normal(rng, n, 33), "ds": _normal(rng, n, 33),
                "S": _normal(rng, 2, n, n + 3, scale=3), "q": _normal(rng, 4, n, 8), "k": _normal(rng, 2, n, 8),
                "v": _normal(rng, 2, n, 8), "dout": _normal(rng, 4, n, 8),
                "sinks": np.array([4.0, -3.0, 0.5, 1.5], np.float32)}

    def swiglu(O, a):
        s = O.out(a["g"].shape)
        ops.swiglu_forward(O.t(a["g"]), O.t(a["u"]), s, **CLAMP)
        return {"s": s}

    def swiglu_back(O, a):
        dg, du = O.out(a["g"].shape), O.out(a["g"].shape)
        ops.swiglu_backward(O.t(a["ds"]), O.t(a["g"]), O.t(a["u"]), dg, du, **CLAMP)
        return {"dg": dg, "du": du}

    def softmax(O, a):
        P = O.out(a["S"].shape)
        ops.softmax_causal_forward(O.t(a["S"]), P, 0.3, sinks=O.t(a["sinks"][:2], "f32"))
        return {"P": P}

    # The backward takes no sinks: its case reads them into the host's saved lse.
    return [Case("swiglu_forward", "clamped", gen, swiglu), Case("swiglu_backward", "clamped", gen, swiglu_back),
            Case("softmax_causal_forward", "sinks", gen, softmax),
            Case("attention_forward", "sinks GQA 4/2 D=8", gen, lambda O, a: attention_fwd(O, a, a["sinks"]), ulps=8),
            Case("attention_backward", "sinks GQA 4/2 D=8", gen, lambda O, a: attention_bwd(O, a, a["sinks"]),
                 ulps=16)]
