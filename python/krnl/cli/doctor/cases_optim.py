"""`krnl doctor`'s cases of the optimizer updates beyond AdamW (cases.py has adamw_update and what
the cases share): Adam's form, SGD, Lion, Adafactor, Muon's two and 8-bit AdamW, each over n rows
of 33 f32 values with its scalars from the host and, where a replayed step passes them, from the
device."""

import numpy as np

import krnl

from .cases import Case, _normal
from ...train.optimizers.adamw8bit import dynamic_map

ops = krnl.ops
F32 = ("f32",)  # the updates read f32 state whatever the compute dtype; a working copy takes any


def optim_cases():
    def gen(rng, n):
        g = _normal(rng, n * 33)
        return {"p": _normal(rng, n * 33), "g": g, "m": _normal(rng, n * 33, scale=0.1),
                "v": rng.uniform(0.01, 1.0, n * 33).astype(np.float32), "sq": np.array([np.sum(np.float64(g) ** 2)],
                                                                                       np.float32)}

    def state(O, a, *keys):
        return [O.t(a[k], "f32") for k in keys]

    def device(O, a, first3):
        """The device scalars a replayed step passes: hyper [3 numbers, inv_denom, max_norm], sq, flag."""
        return {"hyper": O.t(np.array(list(first3) + [0.5, 1.0], np.float32), "f32"), "sq": O.t(a["sq"], "f32"),
                "flag": O.out((1,), "i32", 0)}

    def adam(O, a):
        p, m, v = state(O, a, "p", "m", "v")
        ops.adamw_update(p, O.t(a["g"], "f32"), m, v, 1e-2, weight_decay=0.1, step=3, decoupled=False)
        return {"params": p, "m": m, "v": v}

    def sgd(dev_scalars):
        def r(O, a):
            p, buf = state(O, a, "p", "m")
            work = O.out(a["p"].shape)
            kw = device(O, a, (1e-2, 0.9, 1.0)) if dev_scalars else {}
            ops.sgd_update(p, O.t(a["g"], "f32"), buf, 1e-2, 0.9, 0.0, 0.05, True, 2, 1.0, work, **kw)
            return {"params": p, "buf": buf, "working": work}
        return r

    def lion(O, a):
        p, m = state(O, a, "p", "m")
        ops.lion_update(p, O.t(a["g"], "f32"), m, 1e-3, 0.9, 0.99, 0.1, 1.0, **device(O, a, (1e-3, 1e-4, 0.0)))
        return {"params": p, "m": m}

    def adafactor(O, a):
        n = a["p"].size // 33
        p = O.t(a["p"].reshape(n, 33), "f32")
        row, col = O.t(np.abs(a["m"][:n]), "f32"), O.t(np.abs(a["m"][:33]), "f32")
        ops.adafactor_update(p, O.t(a["g"].reshape(n, 33), "f32"), row, col, 1e-2, 0.3, 1e-3)
        return {"params": p, "row": row, "col": col}

    def muon_momentum(O, a):
        buf, out = O.t(a["m"], "f32"), O.out(a["p"].shape, "f32")
        ops.muon_momentum(O.t(a["g"], "f32"), buf, out, 0.95, True, **device(O, a, (0.0, 0.0, 0.0)))
        return {"buf": buf, "out": out}

    def muon_update(O, a):
        p, work = O.t(a["p"], "f32"), O.out(a["p"].shape)
        ops.muon_update(p, O.t(a["v"], "f32"), 2e-2, 2e-3, 1.5, work)
        return {"params": p, "working": work}

    def adamw8bit(O, a):
        n = a["p"].size
        p, words, blocks = O.t(a["p"], "f32"), -(-n // 4), -(-n // 256)
        codes = [O.t(np.zeros(words, np.int32)) for _ in range(2)]
        absmax = [O.t(np.zeros(blocks, np.float32), "f32") for _ in range(2)]
        maps = [O.t(dynamic_map(s), "f32") for s in (True, False)]
        for step in (1, 2):  # the second dequantizes the first's codes
            ops.adamw8bit_update(p, O.t(a["g"] * step, "f32"), *codes, *absmax, *maps, 1e-2, weight_decay=0.1,
                                 step=step)
        return {"params": p, "m_absmax": absmax[0], "v_absmax": absmax[1]}

    return [Case("adamw_update", "adam (L2)", gen, adam, dtypes=F32),
            Case("sgd_update", "nesterov", gen, sgd(False)), Case("sgd_update", "device scalars", gen, sgd(True)),
            Case("lion_update", "device scalars", gen, lion, dtypes=F32),
            Case("adafactor_update", "(n, 33)", gen, adafactor, dtypes=F32, ulps=16),
            Case("muon_momentum", "nesterov, clipped", gen, muon_momentum, dtypes=F32, ulps=16),
            Case("muon_update", "working copy", gen, muon_update),
            Case("adamw8bit_update", "two steps", gen, adamw8bit, dtypes=F32, ulps=16)]
