"""W1 (docs/performance.md, 'Workloads'): one LoRA training step of the KRNL MLP block (RMSNorm, SwiGLU, LoRA on
gate and up; forward, dX and the four LoRA gradients), as krnl runs it and as each peer runs it.

Every implementation is a builder `build(P) -> (step, result)` of a Problem P (arrays, device,
dtype): `step()` runs one step to completion, `result()` runs one and returns {"y", "dx", "Ag",
"Bg", "Au", "Bu"} as numpy f32."""

import numpy as np

import krnl
from krnl.models.mlp_block import MLPBlock, make_w1_params, w1_flops
from .targets import mlx_target, numpy_only_f32_cpu, peer_builders, replayed, torch_target

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


class Problem(dict):
    """W1's numpy arrays (what every implementation reads), the krnl device and the dtype the
    step runs in."""

    def __init__(self, size, device="cpu", dtype="f32"):
        super().__init__(make_params(**size))
        self.device, self.dtype = device, dtype


def krnl_w1(P):
    """(block, body, dev): the W1 block of problem P on its device and dtype, and one training
    step of it (a body to run inside a submission)."""
    dev = krnl.device(P.device)
    block = MLPBlock(dev, P, P["x"].shape[0], scale=SCALE, eps=EPS, dtype=P.dtype)
    x, dy = dev.tensor(P["x"], P.dtype), dev.tensor(P["dy"], P.dtype)

    def body():
        block.forward(x)
        block.backward(x, dy)

    return block, body, dev


def _krnl_outputs(block):
    out = {"y": block.y.numpy(), "dx": block.dx.numpy()}
    out.update({k: block.grads[k].numpy() for k in ("Ag", "Bg", "Au", "Bu")})
    return {k: np.array(v, np.float32) for k, v in out.items()}


def build_krnl(P):
    block, body, dev = krnl_w1(P)

    def step():
        with dev.step():
            body()
        dev.synchronize()

    return step, lambda: (step(), _krnl_outputs(block))[1]


def build_krnl_graph(P):
    """The step recorded once as a CUDA graph and replayed (Device.capture)."""
    block, body, dev = krnl_w1(P)
    step, _ = replayed(dev, body)
    return step, lambda: (step(), _krnl_outputs(block))[1]


def build_numpy(P):
    numpy_only_f32_cpu(P.device, P.dtype)

    def result():
        y, dx, g = numpy_w1_step(P)
        return {"y": y, "dx": dx, **g}

    return (lambda: numpy_w1_step(P)), result


def _build_torch(P, mode):
    """PyTorch on the peer device of P's (CUDA, MPS or the CPU) in P's dtype; LoRA factors are
    leaves in that dtype, as PEFT makes them on a model loaded in it. mode: None (eager), or a
    torch.compile mode."""
    torch, tdev, tdt, sync = torch_target(P.device, P.dtype, mode)
    import torch.nn.functional as Fn

    t = lambda k: torch.from_numpy(np.ascontiguousarray(P[k])).to(tdev, tdt)
    w, Wg, Wu, Wd, dy = t("w_norm"), t("Wg"), t("Wu"), t("Wd"), t("dy")
    lora = {k: t(k).clone().requires_grad_(True) for k in ("Ag", "Bg", "Au", "Bu")}
    x = t("x").clone().requires_grad_(True)

    def block(x, Ag, Bg, Au, Bu):
        h = Fn.rms_norm(x, (x.shape[-1],), w, EPS)
        g = Fn.linear(h, Wg) + Fn.linear(Fn.linear(h, Ag) * SCALE, Bg)
        u = Fn.linear(h, Wu) + Fn.linear(Fn.linear(h, Au) * SCALE, Bu)
        return x + Fn.linear(Fn.silu(g) * u, Wd)

    fwd = block if mode is None else torch.compile(block, mode=mode, dynamic=False)
    L = [lora[k] for k in ("Ag", "Bg", "Au", "Bu")]

    def step():
        if mode == "reduce-overhead":  # a new iteration: the graph may overwrite earlier outputs
            torch.compiler.cudagraph_mark_step_begin()
        for a in [x] + L:
            a.grad = None
        y = fwd(x, *L)
        y.backward(dy)
        sync()
        return y

    def result():
        y = step()
        f = lambda v: v.detach().float().cpu().numpy().copy()
        out = {"y": f(y), "dx": f(x.grad)}
        out.update({k: f(a.grad) for k, a in lora.items()})
        return out

    return step, result


def _build_mlx(P, compiled):
    mx, mdev, mdt = mlx_target(P.device, P.dtype)
    a = {k: mx.array(v).astype(mdt) for k, v in P.items()}
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
        with mx.stream(mdev):
            y, grads = fn(a["x"], a["dy"], *(a[k] for k in names))
            mx.eval(y, grads)
        return y, grads

    def result():
        y, grads = step()
        f = lambda v: np.array(v.astype(mx.float32))
        out = {"y": f(y), "dx": f(grads[0])}
        out.update({k: f(g) for k, g in zip(names, grads[1:])})
        return out

    return step, result


PEERS = peer_builders(build_numpy, _build_torch, _build_mlx)
