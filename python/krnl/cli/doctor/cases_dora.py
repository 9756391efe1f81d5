"""`krnl doctor`'s cases of DoRA's ops (cases.py has the rest and what they share): the per-column
scale of n rows of 33 columns, one of them written into a wider buffer's columns (q|k|v's blocks),
its backward's column sums over all rows and per row, and the norm of n outputs at rank 4."""

import numpy as np

import krnl

from .cases import Case, _normal

ops = krnl.ops


def dora_cases():
    def gen(rng, n):
        return {"x": _normal(rng, n, 33), "dy": _normal(rng, n, 33), "v": _normal(rng, 33),
                "B": _normal(rng, n, 4), "Q": _normal(rng, 4, n), "m": 1 + np.abs(_normal(rng, n)),
                "w2": 8 + np.abs(_normal(rng, n, scale=4))}

    def scale(wide):
        def run(O, a):
            n = a["x"].shape[0]
            out = O.out((n, 40))[:, 5:38] if wide else O.out((n, 33))
            ops.scale_columns(O.t(a["x"]), O.t(a["v"], "f32"), out)
            return {"out": out}
        return run

    def backward(per_row):
        def run(O, a):
            n = a["x"].shape[0]
            dx, dv = O.out((n, 33)), O.out((n if per_row else 1, 33), "f32")
            ops.scale_columns_backward(O.t(a["dy"]), O.t(a["x"]), O.t(a["v"], "f32"), dx, dv)
            return {"dx": dx, "dv": dv}
        return run

    def norm(O, a):
        n = a["B"].shape[0]
        s, inv = O.out((n,), "f32"), O.out((n,), "f32")
        ops.dora_norm(O.t(a["w2"], "f32"), O.t(a["B"]), O.t(a["Q"], "f32"), O.t(a["m"]), 0.75, s, inv)
        return {"scale": s, "inv_norm": inv}

    return [Case("scale_columns", "33 wide", gen, scale(False)),
            Case("scale_columns", "column block", gen, scale(True)),
            Case("scale_columns_backward", "one sum", gen, backward(False), ulps=8),
            Case("scale_columns_backward", "per row", gen, backward(True)),
            Case("dora_norm", "rank 4", gen, norm)]
