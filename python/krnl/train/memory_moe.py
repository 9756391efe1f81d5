"""The allocations of a mixture-of-experts layer's MLP (moe.py), as memory_step.Replay replays them:
its methods of the same names, kept apart."""

from .memory_resident import ACTS, CKPT, WORK


class MoeReplay:
    """moe_forward and moe_backward of a Replay (memory_step.py)."""

    def moe_forward(self, i):
        N, C, F, r, m = self.N, self.C, self.F, self.r, self.c.moe
        Ex, K = m["experts"], m["top_k"]
        P = N * K
        hn, keep = self.act((N, C)), [self.new((N,), "f32", ACTS), self.act((N, Ex))]  # hn, rstd, logits
        keep += self.lora_forward(i, "router", C)
        if m["bias"]:
            self.grow_ones("dt", N)
        keep += [self.new((N, K), "i32", ACTS), self.new((N, K), "f32", ACTS)]  # ids, w
        keep += [self.new((P,), "i32", ACTS), self.new((N, K), "i32", ACTS), self.new((Ex + 1,), "i32", ACTS)]
        if self.recording:                                                # RouterStats.add
            S, Pr = self.new((N, Ex), "f32", WORK), self.new((N, Ex), "f32", WORK)
            self.grow_ones("f32", N)
            self.grow_ones("f32", P)
            self.t.free(S, Pr)
        xs = self.act((P, C), WORK)
        self.t.free(hn)                                                   # made again in the backward
        keep += [self.act((P, F)), self.act((P, F))]                      # g, u
        xa = [self.act((P, r))] if self.has(i, "gate_up_proj") else []
        self.t.free(xs)
        if m["bias"]:
            self.grow_ones("dt", P)
        keep += xa + [self.act((P, F)), self.act((P, C))]                 # a, ys
        keep += [self.act((P, r))] if self.has(i, "down_proj") else []    # ad
        y = self.act((N, C), CKPT if self.run.grad_checkpoint else ACTS)
        return y, keep

    def moe_backward(self, i, dy, dh_cols):
        N, C, F, r, m = self.N, self.C, self.F, self.r, self.c.moe
        P = N * m["top_k"]
        dys, dw = self.act((P, C), WORK), self.new((N, m["top_k"]), "f32", WORK)
        da = self.act((P, F), WORK)
        if self.has(i, "down_proj"):
            self.t.free(self.act((P, r), WORK))
        self.t.free(dys)  # dg and du take da's and u's places
        dxs = self.act((P, C), WORK)
        hn = self.remake(i, ("router",), also=self.has(i, "gate_up_proj"))  # the experts' gather reads it
        if self.has(i, "gate_up_proj"):
            xs = self.act((P, C), WORK)
            self.t.free(self.act((P, r), WORK), xs)
        dhn, dlogits = self.act((N, C), WORK), self.act((N, m["experts"]), WORK)
        self.lora_backward(i, "router", C)
        self.t.free(*hn)
        dh = self.act((N, C + dh_cols), WORK)
        self.t.free(dw, da, dxs, dhn, dlogits)
        return dh
