"""W1 (DESIGN section 6): one LoRA training step of the KRNL MLP block (RMSNorm, SwiGLU, LoRA on
gate and up; forward, dX and the four LoRA gradients), as krnl runs it and as each peer runs it.

Every implementation is a builder `build(P) -> (step, result)`: `step()` runs one step to
completion, `result()` runs one and returns {"y", "dx", "Ag", "Bg", "Au", "Bu"} as numpy f32."""

import numpy as np

import krnl
from krnl.mlp_block import MLPBlock, make_w1_params, w1_flops

T, C, F, R = 512, 2048, 5632, 32
SCALE = 2.0
EPS = 1e-5
FLOPS = w1_flops(T, C, F, R)
SMALL = dict(T=33, C=64, F=176, R=8)  # the cross-check size: odd T, every dimension distinct
QUICK = dict(T=64, C=256, F=704, R=8)


def make_params(T=T, C=C, F=F, R=R, seed=0):
    return make_w1_params(T, C, F, R, seed=seed)


def flops(P):
    t, c = P["x"].shape
    return w1_flops(t, c, P["Wg"].shape[0], P["Ag"].shape[0])


def numpy_w1_step(P, s=SCALE, eps=EPS):
    """The same step in float32 numpy: forward, dX and the four LoRA gradients."""
    x, dy, w = P["x"], P["dy"], P["w_norm"]
    f = np.float32
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + f(eps))
    h = x * rstd * w
    tg, tu = h @ P["Ag"].T, h @ P["Au"].T
    g = h @ P["Wg"].T + (f(s) * tg) @ P["Bg"].T
    u = h @ P["Wu"].T + (f(s) * tu) @ P["Bu"].T
    sg = 1.0 / (1.0 + np.exp(-g))
    a = g * sg * u
    y = x + a @ P["Wd"].T
    da = dy @ P["Wd"]
    du = da * g * sg
    dg = da * u * sg * (1.0 + g * (1.0 - sg))
    grads = {"Bg": f(s) * dg.T @ tg, "Bu": f(s) * du.T @ tu}
    dtg, dtu = f(s) * dg @ P["Bg"], f(s) * du @ P["Bu"]
    grads["Ag"], grads["Au"] = dtg.T @ h, dtu.T @ h
    dh = dg @ P["Wg"] + dtg @ P["Ag"] + du @ P["Wu"] + dtu @ P["Au"]
    gw = dh * w
    xhat = x * rstd
    dx = rstd * (gw - xhat * np.mean(gw * xhat, axis=-1, keepdims=True)) + dy
    return y, dx, grads


def krnl_w1(params, device="cpu"):
    """(block, step): the W1 block on `device` and one training step of it (a submission)."""
    dev = krnl.device(device)
    block = MLPBlock(dev, params, params["x"].shape[0], scale=SCALE)
    x, dy = dev.tensor(params["x"]), dev.tensor(params["dy"])

    def step():
        with dev.step():
            block.forward(x)
            block.backward(x, dy)
        dev.synchronize()

    return block, step


def build_krnl(P, device="cpu"):
    block, step = krnl_w1(P, device)

    def result():
        step()
        out = {"y": block.y.numpy(), "dx": block.dx.numpy()}
        out.update({k: block.grads[k].numpy() for k in ("Ag", "Bg", "Au", "Bu")})
        return {k: np.array(v, np.float32) for k, v in out.items()}

    return step, result


def build_numpy(P):
    def result():
        y, dx, g = numpy_w1_step(P)
        return {"y": y, "dx": dx, **g}

    return (lambda: numpy_w1_step(P)), result


def _build_torch(P, compiled):
    import torch
    import torch.nn.functional as Fn

    torch.set_num_threads(krnl.num_threads())
    t = lambda k: torch.from_numpy(np.ascontiguousarray(P[k]))
    w, Wg, Wu, Wd, dy = t("w_norm"), t("Wg"), t("Wu"), t("Wd"), t("dy")
    lora = {k: t(k).clone().requires_grad_(True) for k in ("Ag", "Bg", "Au", "Bu")}
    x = t("x").clone().requires_grad_(True)

    def block(x, Ag, Bg, Au, Bu):
        h = Fn.rms_norm(x, (x.shape[-1],), w, EPS)
        g = Fn.linear(h, Wg) + Fn.linear(Fn.linear(h, Ag) * SCALE, Bg)
        u = Fn.linear(h, Wu) + Fn.linear(Fn.linear(h, Au) * SCALE, Bu)
        return x + Fn.linear(Fn.silu(g) * u, Wd)

    fwd = torch.compile(block) if compiled else block
    L = [lora[k] for k in ("Ag", "Bg", "Au", "Bu")]

    def step():
        for a in [x] + L:
            a.grad = None
        y = fwd(x, *L)
        y.backward(dy)
        return y

    def result():
        y = step()
        out = {"y": y.detach().numpy().copy(), "dx": x.grad.numpy().copy()}
        out.update({k: a.grad.numpy().copy() for k, a in lora.items()})
        return out

    return step, result


def build_torch(P):
    return _build_torch(P, compiled=False)


def build_torch_compile(P):
    return _build_torch(P, compiled=True)


def _build_mlx(P, compiled):
    import mlx.core as mx

    a = {k: mx.array(v) for k, v in P.items()}
    names = ("Ag", "Bg", "Au", "Bu")

    def block(x, Ag, Bg, Au, Bu):
        h = mx.fast.rms_norm(x, a["w_norm"], EPS)
        g = h @ a["Wg"].T + ((h @ Ag.T) * SCALE) @ Bg.T
        u = h @ a["Wu"].T + ((h @ Au.T) * SCALE) @ Bu.T
        return x + ((g * mx.sigmoid(g)) * u) @ a["Wd"].T

    def vjp(x, dy, *L):
        (y,), grads = mx.vjp(block, [x, *L], [dy])
        return y, grads

    fn = mx.compile(vjp) if compiled else vjp

    def step():
        y, grads = fn(a["x"], a["dy"], *(a[k] for k in names))
        mx.eval(y, grads)
        return y, grads

    def result():
        y, grads = step()
        out = {"y": np.array(y), "dx": np.array(grads[0])}
        out.update({k: np.array(g) for k, g in zip(names, grads[1:])})
        return out

    return step, result


def build_mlx(P):
    return _build_mlx(P, compiled=False)


def build_mx_compile(P):
    return _build_mlx(P, compiled=True)


PEERS = {"numpy": build_numpy, "torch": build_torch, "torch.compile": build_torch_compile,
         "mlx": build_mlx, "mx.compile": build_mx_compile}
