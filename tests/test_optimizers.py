"""krnl's optimizers (krnl.train.optimizers) over a FlatParams, each N steps with clipping,
gradient accumulation and weight decay: against float64 numpy of its reference's update (no torch
needed), against the reference itself (torch.optim.AdamW, Adam, SGD; lion-pytorch) where it
installs, its state resumed bit for bit, and the choice from a TrainConfig."""

import dataclasses

import numpy as np
import pytest

from krnl.train.optim import (OPTIMIZERS, SGD, Adafactor, Adam, AdamW, AdamW8bit, Lion, LossScaler, Muon, Schedule,
                              from_config)
from krnl.train.trainer import TrainConfig

from test_optim import flat_of, set_grads
from test_optim import make_flat as make_any_flat

# LoRA-like factors (Adafactor factors >= 2 dims), a 3-D one as an expert's
SHAPES = {"l0.q.lora_A.weight": (3, 17), "l0.q.lora_B.weight": (33, 3), "l0.experts.lora_A.weight": (2, 3, 5)}


def make_flat(dev, dtype="f32", seed=0):
    return make_any_flat(dev, dtype, seed, SHAPES)

SCHED = dict(lr=2e-2, warmup_steps=2, total_steps=7, kind="cosine", min_lr_ratio=0.1)

# name -> (constructor, its keyword arguments): every optimizer and option the references check
CASES = {
    "adamw": (AdamW, dict(betas=(0.8, 0.95), eps=1e-6)),
    "adam": (Adam, dict(betas=(0.9, 0.99), eps=1e-8)),
    "sgd": (SGD, dict()),
    "sgd-momentum": (SGD, dict(momentum=0.9, dampening=0.2)),
    "sgd-nesterov": (SGD, dict(momentum=0.8, nesterov=True)),
    "lion": (Lion, dict(betas=(0.9, 0.99))),
    "adafactor": (Adafactor, dict()),
    "adafactor-lr": (Adafactor, dict(relative_step=False, beta2_decay=-0.5, d=0.5)),
    "muon": (Muon, dict()),
    "muon-plain": (Muon, dict(momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw", betas=(0.9, 0.95))),
    # the B factor (99 elements) quantized, the others with f32 moments
    "adamw8bit": (AdamW8bit, dict(betas=(0.9, 0.99), eps=1e-8, min_8bit_size=64)),
}
# 8-bit AdamW: float64 and f32 values on either side of a code's boundary requantize one code
# apart, and later updates carry that
UPDATE_RTOL = {"adamw8bit": 2e-3}


def newton_schulz(X, steps=5, eps=1e-7, coefficients=(3.4445, -4.7750, 2.0315)):
    """torch.optim.Muon's orthogonalisation in float64 (torch runs it in bf16)."""
    a, b, c = coefficients
    tall = X.shape[0] > X.shape[1]
    Y = X.T if tall else X
    Y = Y / max(np.linalg.norm(Y), eps)
    for _ in range(steps):
        A = Y @ Y.T
        Y = a * Y + (b * A + c * A @ A) @ Y
    return Y.T if tall else Y


class NumpyRef:
    """float64 of each reference's update after torch.nn.utils.clip_grad_norm_."""

    def __init__(self, case, p, lr_fn, wd, max_norm, ratio=None):
        self.kind, self.kw = CASES[case][0].name, CASES[case][1]
        # LoRA+: each element's learning-rate factor, the B factors' ratio
        self.ratio = {k: ratio if ratio and ".lora_B." in k else 1.0 for k in SHAPES}
        self.scale = np.concatenate([np.full(int(np.prod(s)), self.ratio[k]) for k, s in SHAPES.items()])
        self.p = np.array(p, np.float64)
        self.m, self.v = np.zeros_like(self.p), np.zeros_like(self.p)
        self.lr_fn, self.wd, self.max_norm, self.t = lr_fn, wd, max_norm, 0

    def step(self, g_sum, n):
        g = np.asarray(g_sum, np.float64) / n
        norm = float(np.sqrt(np.sum(g * g)))
        if self.max_norm is not None:
            g = g * min(1.0, self.max_norm / (norm + 1e-6))
        self.t += 1
        lr, t, kw, p = self.lr_fn(self.t) * self.scale, self.t, self.kw, self.p
        base_lr = self.lr_fn(self.t)
        if self.kind in ("adamw", "adam", "adamw8bit"):
            (b1, b2), eps = kw["betas"], kw["eps"]
            if self.kind != "adam":
                p *= 1 - lr * self.wd
            else:
                g = g + self.wd * p
            self.m = b1 * self.m + (1 - b1) * g
            self.v = b2 * self.v + (1 - b2) * g * g
            p -= lr / (1 - b1**t) * self.m / (np.sqrt(self.v) / np.sqrt(1 - b2**t) + eps)
            if self.kind == "adamw8bit":  # the step reads the moments before they are requantized
                self.requantize()
        elif self.kind == "muon":
            off = 0
            for name, shape in SHAPES.items():
                size = int(np.prod(shape))
                self.p[off:off + size] = self.muon(name, shape, p[off:off + size], g[off:off + size],
                                                   base_lr * self.ratio[name], t, off)
                off += size
        elif self.kind == "adafactor":
            off = 0
            for name, shape in SHAPES.items():
                size, b = int(np.prod(shape)), (-1,) + shape[-2:]
                got = self.adafactor(name, p[off:off + size].reshape(b), g[off:off + size].reshape(b),
                                     base_lr * self.ratio[name], t)
                self.p[off:off + size] = got.reshape(-1)
                off += size
        elif self.kind == "sgd":
            g = g + self.wd * p
            mu = kw.get("momentum", 0.0)
            if mu:
                self.m = g.copy() if t == 1 else mu * self.m + (1 - kw.get("dampening", 0.0)) * g
                g = g + mu * self.m if kw.get("nesterov") else self.m
            p -= lr * g
        else:
            b1, b2 = kw["betas"]
            p *= 1 - lr * self.wd
            p -= lr * np.sign(b1 * self.m + (1 - b1) * g)
            self.m = b2 * self.m + (1 - b2) * g
        return norm

    def requantize(self):
        """8-bit AdamW: the moments of the parameters of min_8bit_size elements or more as their
        codes hold them after the step (bitsandbytes' blockwise quantization)."""
        from krnl.train.optimizers.adamw8bit import dynamic_map

        off = 0
        for shape in SHAPES.values():
            size = int(np.prod(shape))
            if size >= self.kw["min_8bit_size"]:
                for x, code in ((self.m, dynamic_map(True)), (self.v, dynamic_map(False))):
                    mid = (code[:-1].astype(np.float64) + code[1:]) / 2
                    for b in range(off, off + size, 256):
                        blk = x[b:min(b + 256, off + size)]
                        am = max(np.max(np.abs(blk)), 1e-38)
                        blk[:] = code[np.searchsorted(mid, np.clip(blk / am, -1, 1))] * am
            off += size

    def muon(self, key, shape, p, g, lr, t, off):
        """torch.optim.Muon on a 2-D parameter, PyTorch's AdamW on the others (m, v at its offset)."""
        kw, size = self.kw, p.size
        m, v = self.m[off:off + size], self.v[off:off + size]
        p = p * (1 - lr * self.wd)
        if len(shape) != 2:
            b1, b2 = kw.get("betas", (0.9, 0.999))
            m[:] = b1 * m + (1 - b1) * g
            v[:] = b2 * v + (1 - b2) * g * g
            return p - lr / (1 - b1**t) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + 1e-8)
        mu = kw.get("momentum", 0.95)
        m[:] = m + (1 - mu) * (g - m)
        u = g + mu * (m - g) if kw.get("nesterov", True) else m
        A, B = shape
        ratio = 0.2 * max(A, B) ** 0.5 if kw.get("adjust_lr_fn") == "match_rms_adamw" else max(1, A / B) ** 0.5
        return p - lr * ratio * newton_schulz(u.reshape(shape)).reshape(-1)

    def adafactor(self, key, p, g, lr, t):
        """torch.optim.Adafactor on one parameter as (B, R, C)."""
        kw = self.kw
        if not hasattr(self, "rows"):
            self.rows, self.cols = {}, {}
        row, col = self.rows.get(key, np.zeros(p.shape[:2])), self.cols.get(key, np.zeros((p.shape[0], p.shape[2])))
        rho = min(lr, t**-0.5) if kw.get("relative_step", True) else lr
        w, eps1, d = float(t) ** kw.get("beta2_decay", -0.8), float(np.finfo(np.float32).eps), kw.get("d", 1.0)
        alpha = max(1e-3, np.sqrt(np.mean(p * p))) * rho
        p = p * (1 - lr * self.wd)
        row = row + w * (np.mean(g * g, axis=-1) - row)
        col = col + w * (np.mean(g * g, axis=-2) - col)
        self.rows[key], self.cols[key] = row, col
        v = row[:, :, None] * col[:, None, :] / np.maximum(np.mean(row, axis=-1), eps1)[:, None, None]
        u = g / np.sqrt(np.maximum(v, eps1 * eps1))
        return p - alpha / max(1.0, np.sqrt(np.mean(u * u)) / d) * u


def make_opt(case, fp, wd=0.0, max_norm=None, sched=None, **extra):
    cls, kw = CASES[case]
    return cls(fp, sched or Schedule(**SCHED), weight_decay=wd, max_grad_norm=max_norm, **kw, **extra)


def grads_of(rng, n, n_micro, step):
    """What accumulation of n_micro micro-batches leaves in the grads."""
    micro = [rng.standard_normal(n).astype(np.float32) * 0.1 * step for _ in range(n_micro)]
    return np.sum(np.array(micro, np.float32), axis=0)


@pytest.mark.parametrize("n_micro, max_norm, wd", [(1, None, 0.0), (3, 0.05, 0.1), (2, 1e3, 0.01)])
@pytest.mark.parametrize("case", CASES)
def test_optimizer_matches_numpy(dev, case, n_micro, max_norm, wd):
    fp = make_flat(dev)
    n = fp.numel
    opt = make_opt(case, fp, wd, max_norm)
    ref = NumpyRef(case, flat_of(fp.params, n), Schedule(**SCHED).lr_at, wd, max_norm)
    p0 = ref.p.copy()
    rng = np.random.default_rng(11)
    for step in range(1, 8):
        g_sum = grads_of(rng, n, n_micro, step)
        set_grads(fp, g_sum)
        info = opt.step(accumulated_micro_batches=n_micro)
        norm = ref.step(g_sum, n_micro)
        assert info["grad_norm"] == pytest.approx(norm, rel=1e-5) and not info["skipped"]
        assert np.all(flat_of(fp.grads, n) == 0), "grads must be zeroed after the step"
    got = flat_of(fp.params, n)
    # The total update, so that errors are visible next to the params (~1); slack of a few f32
    # roundings of the params per step. Lion's and SGD's steps are lr-sized.
    scale, rtol = np.max(np.abs(ref.p - p0)), UPDATE_RTOL.get(case, 3e-4)
    np.testing.assert_allclose(got - p0, ref.p - p0, rtol=rtol,
                               atol=rtol * 0.03 * scale + 16 * 2.0**-23 * np.max(np.abs(p0)))
    assert opt.adam_step == 7 and opt.iteration == 7


@pytest.mark.torch
@pytest.mark.parametrize("case", CASES)
def test_optimizer_matches_its_reference(dev, case, request):
    """Seven steps of the reference optimizer itself (torch.optim, lion-pytorch) on the same
    gradients, clipped by torch.nn.utils.clip_grad_norm_, stepped by a LambdaLR of the schedule;
    both in f32."""
    torch = pytest.importorskip("torch")
    cls, kw = CASES[case]
    wd, max_norm, n_micro = 0.05, 0.5, 2
    fp = make_flat(dev)
    n = fp.numel
    opt = make_opt(case, fp, wd, max_norm)
    init = fp.state()
    tps = [torch.nn.Parameter(torch.from_numpy(init[k])) for k in SHAPES]
    sched = Schedule(**SCHED)
    if cls.name == "lion":
        lion_pytorch = pytest.importorskip("lion_pytorch")
        ref = lion_pytorch.Lion(tps, lr=SCHED["lr"], weight_decay=wd, **kw)
    elif cls.name == "muon":
        ref = muon_reference(torch, tps, SCHED["lr"], wd, kw)
    elif cls.name == "adamw8bit":
        bnb = pytest.importorskip("bitsandbytes")
        scope = torch.library._scoped_library("bitsandbytes", "IMPL")  # undone when the test ends
        request.addfinalizer(lambda: scope.__exit__(None, None, None))
        scope.__enter__().impl("quantize_blockwise", bnb_quantize_blockwise(torch), "CPU")
        ref = bnb.optim.AdamW8bit(tps, lr=SCHED["lr"], weight_decay=wd, **kw)
    elif cls.name == "adafactor":
        if not kw.get("relative_step", True):
            pytest.skip("torch's Adafactor always takes the relative step")
        ref = torch.optim.Adafactor(tps, lr=SCHED["lr"], weight_decay=wd, **kw)
    else:
        ref_cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[cls.name]
        ref = ref_cls(tps, lr=SCHED["lr"], weight_decay=wd, **kw)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda i: sched.lr_at(i + 1) / SCHED["lr"])
              for o in getattr(ref, "opts", [ref])]
    rng = np.random.default_rng(12)
    for step in range(1, 8):
        g_sum = grads_of(rng, n, n_micro, step)
        set_grads(fp, g_sum)
        opt.step(n_micro)
        g = g_sum / np.float32(n_micro)
        for tp, (o, size) in zip(tps, fp.offsets.values()):
            tp.grad = torch.from_numpy(g[o:o + size].reshape(tp.shape))
        torch.nn.utils.clip_grad_norm_(tps, max_norm)
        ref.step()
        for ls in scheds:
            ls.step()
    if cls.name == "adamw8bit":
        q = ref.state[tps[1]]  # the quantized one: bitsandbytes' codes and block scales, ours
        w0, words, b0, blocks = opt.blocks["l0.q.lora_B.weight"]
        codes = np.asarray(opt.m_codes.numpy()[w0:w0 + words]).view(np.uint8)[:tps[1].numel()]
        assert np.array_equal(codes, q["state1"].numpy().reshape(-1))
        # v's f32 products may fuse otherwise than torch's: its block scales agree to rounding
        np.testing.assert_allclose(np.asarray(opt.v_absmax.numpy()[b0:b0 + blocks]), q["absmax2"].numpy(), rtol=1e-6)
    want = np.concatenate([tp.detach().numpy().reshape(-1) for tp in tps]).astype(np.float64)
    got, p0 = flat_of(fp.params, n), np.array(make_flat(dev).params.numpy()[:n], np.float64)
    err = np.max(np.abs((got - p0) - (want - p0))) / np.max(np.abs(want - p0))
    assert err < 1e-4, f"{case}: max relative error of the update {err:.2e}"


def bnb_quantize_blockwise(torch):
    """bitsandbytes' pure-PyTorch quantize_blockwise (its definition, the one its CUDA and default
    backends follow), for its CPU backend, whose native quantizer approximates the nearest code of
    values below ~1e-5 of their block's absmax."""

    def quantize(A, code, blocksize):
        flat = A.reshape(-1).float()
        n = flat.numel()
        full = n - n % blocksize
        absmax = flat[:full].reshape(-1, blocksize).abs().max(dim=-1)[0]
        scaled = torch.clamp(flat[:full].reshape(-1, blocksize) * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1)
        scaled = scaled.reshape(-1)
        if n % blocksize:
            am = flat[full:].abs().max().clamp(min=1e-38)
            absmax = torch.cat([absmax, am.unsqueeze(0)])
            scaled = torch.cat([scaled, torch.clamp(flat[full:] / am, -1, 1)])
        q = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)
        return q.reshape(A.shape), absmax

    return quantize


class muon_reference:
    """torch.optim.Muon over the 2-D tensors, torch.optim.AdamW over the rest, one learning rate;
    the Newton-Schulz iteration run in f32 (torch's is bf16, krnl's f32)."""

    def __init__(self, torch, tps, lr, wd, kw):
        kw = dict(kw)
        betas = kw.pop("betas", (0.9, 0.999))
        mats = [t for t in tps if t.ndim == 2]
        self.opts = [torch.optim.Muon(mats, lr=lr, weight_decay=wd, **kw),
                     torch.optim.AdamW([t for t in tps if t.ndim != 2], lr=lr, weight_decay=wd, betas=betas)]
        self.param_groups = [g for o in self.opts for g in o.param_groups]
        self.torch = torch

    def step(self):
        original = self.torch.Tensor.bfloat16
        self.torch.Tensor.bfloat16 = lambda t: t.float().clone()  # a copy, as the cast is; within this step only
        try:
            for o in self.opts:
                o.step()
        finally:
            self.torch.Tensor.bfloat16 = original


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", CASES)
def test_state_dict_round_trip_continues_bit_identically(dev, case, dtype):
    """Four steps, the state into a fresh optimizer of other settings over other params, then
    four more steps of both: params and state bit for bit (f16: with loss scaling)."""
    scaler = (lambda: LossScaler(True, init=1024.0, growth_interval=2)) if dtype == "f16" else (lambda: None)
    fa = make_flat(dev, dtype)
    a = make_opt(case, fa, 0.05, 0.3, loss_scaler=scaler())
    rng = np.random.default_rng(13)
    grads = [rng.standard_normal(fa.numel).astype(np.float32) for _ in range(8)]
    for g in grads[:4]:
        set_grads(fa, g * np.float32(a.loss_scale))
        a.step(2)
    state, masters = a.state_dict(), fa.state()
    assert state["optimizer"] == type(a).name
    fb = make_flat(dev, dtype, seed=99)
    cls = type(a)
    b = cls(fb, Schedule(1.0, kind="constant"), loss_scaler=scaler())
    fb.load(masters)
    b.load_state_dict(state)
    for g in grads[4:]:
        for opt, fp in ((a, fa), (b, fb)):
            set_grads(fp, g * np.float32(opt.loss_scale))
            opt.step(2)
    assert np.array_equal(fa.params.numpy(), fb.params.numpy())
    sa, sb = a.state_dict(), b.state_dict()
    for key in a.state:
        assert np.array_equal(sa[key], sb[key]), key
    assert sa["hyper"] == sb["hyper"]


def test_state_of_another_optimizer_is_refused(dev):
    a = make_opt("adamw", make_flat(dev))
    b = make_opt("lion", make_flat(dev))
    with pytest.raises(ValueError, match=r"\[Lion.load_state_dict\] the state is adamw's, this optimizer is lion"):
        b.load_state_dict(a.state_dict())
    old = a.state_dict()
    del old["optimizer"]  # a checkpoint from before the choice: AdamW's
    make_opt("adamw", make_flat(dev)).load_state_dict(old)


def test_sgd_skipped_first_step_keeps_the_buffer_start(dev):
    """Under loss scaling a skipped step does not count: the next one still starts the momentum
    buffer as its gradient."""
    fp = make_flat(dev, "f16")
    opt = SGD(fp, Schedule(0.1, kind="constant"), momentum=0.9, loss_scaler=LossScaler(True, init=4.0))
    bad = np.full(fp.numel, np.inf, np.float32)
    set_grads(fp, bad)
    assert opt.step()["skipped"]
    g = np.linspace(-1, 1, fp.numel).astype(np.float32)
    set_grads(fp, g * np.float32(opt.loss_scale))
    opt.step()
    np.testing.assert_allclose(flat_of(opt.m, fp.numel), g, rtol=1e-6)


def test_from_config_picks_each_optimizer(dev):
    for name, cls in OPTIMIZERS.items():
        cfg = TrainConfig(optimizer=name, weight_decay=0.01, max_grad_norm=0.5)
        opt = from_config(make_flat(dev), Schedule(1e-3, kind="constant"), cfg)
        assert type(opt) is cls and opt.weight_decay == 0.01 and opt.max_grad_norm == 0.5
    lion = from_config(make_flat(dev), Schedule(1e-3, kind="constant"), TrainConfig(optimizer="lion"))
    assert lion.betas == (0.9, 0.99)
    cfg = dataclasses.replace(TrainConfig(), optimizer="sgd", momentum=0.9, nesterov=True)
    sgd = from_config(make_flat(dev), Schedule(1e-3, kind="constant"), cfg)
    assert sgd.momentum == 0.9 and sgd.nesterov and sgd.state == {"buf": "m"}
    with pytest.raises(ValueError, match="optimizer must be one of"):
        from_config(make_flat(dev), Schedule(1e-3, kind="constant"), TrainConfig(optimizer="adagrad"))
    with pytest.raises(ValueError, match=r"\[SGD\] nesterov"):
        SGD(make_flat(dev), Schedule(1e-3, kind="constant"), nesterov=True)


# ---- LoRA+

@pytest.mark.parametrize("case", CASES)
def test_loraplus_matches_numpy(dev, case):
    """LoRA+ with every optimizer: the B factors at lr * ratio (their weight decay and the
    schedule's shape alike), the A factors at lr; the layout A, B, A makes three runs."""
    fp = make_flat(dev)
    n, ratio = fp.numel, 4.0
    opt = make_opt(case, fp, 0.05, 0.5, lr_ratio=ratio)
    assert opt.hyper_size == 10 * type(opt).rows
    ref = NumpyRef(case, flat_of(fp.params, n), Schedule(**SCHED).lr_at, 0.05, 0.5, ratio=ratio)
    p0 = ref.p.copy()
    rng = np.random.default_rng(14)
    for step in range(1, 6):
        g_sum = grads_of(rng, n, 2, step)
        set_grads(fp, g_sum)
        opt.step(2)
        ref.step(g_sum, 2)
    got = flat_of(fp.params, n)
    scale, rtol = np.max(np.abs(ref.p - p0)), UPDATE_RTOL.get(case, 3e-4)
    np.testing.assert_allclose(got - p0, ref.p - p0, rtol=rtol,
                               atol=rtol * 0.03 * scale + 16 * 2.0**-23 * np.max(np.abs(p0)))
    assert opt.state_dict()["hyper"]["loraplus_lr_ratio"] == ratio


@pytest.mark.torch
@pytest.mark.parametrize("case", ["adamw", "sgd-momentum", "adafactor", "lion", "muon"])
def test_loraplus_matches_peft(dev, case):
    """PEFT's create_loraplus_optimizer on a tiny LoRA model (two adapted linears) with the
    reference optimizer: the same groups (B at lr * ratio, A at lr, one weight decay) and, over five
    clipped steps on the same gradients, the same parameters."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from peft.optimizers import create_loraplus_optimizer

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.v = torch.nn.Linear(17, 33), torch.nn.Linear(17, 9)

    torch.manual_seed(0)
    model = peft.get_peft_model(Tiny(), peft.LoraConfig(r=3, target_modules=["q", "v"]))
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    rng = np.random.default_rng(15)
    with torch.no_grad():
        for _, p in named:  # B is zero at PEFT's init: random values make the first step show it
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32) * 0.3))
    cls, kw = CASES[case]
    wd, ratio, lr = 0.05, 8.0, SCHED["lr"]
    if cls.name == "lion":
        optimizer_cls = pytest.importorskip("lion_pytorch").Lion
    else:
        optimizer_cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "adafactor": torch.optim.Adafactor,
                         "muon": torch.optim.Muon}[cls.name]
    ref = create_loraplus_optimizer(model, optimizer_cls, lr=lr, loraplus_lr_ratio=ratio, loraplus_weight_decay=wd,
                                    **kw)
    from krnl.models.params import FlatParams

    fp = FlatParams(dev, {k: tuple(p.shape) for k, p in named})
    fp.load({k: p.detach().numpy() for k, p in named})
    opt = make_opt(case, fp, wd, 0.5, lr_ratio=ratio)
    groups = {id(p): g["lr"] for g in ref.param_groups for p in g["params"]}
    assert {k: groups[id(p)] / lr for k, p in named} == {k: [1.0, ratio][opt.group(k)] for k, _ in named}
    sched = Schedule(**SCHED)
    lrs = torch.optim.lr_scheduler.LambdaLR(ref, lambda i: sched.lr_at(i + 1) / lr)
    p0 = flat_of(fp.params, fp.numel)
    for step in range(1, 6):
        g = rng.standard_normal(fp.numel).astype(np.float32) * step
        set_grads(fp, g)
        opt.step()
        for k, p in named:
            o, size = fp.offsets[k]
            p.grad = torch.from_numpy(g[o:o + size].reshape(tuple(p.shape)).copy())
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 0.5)
        original = torch.Tensor.bfloat16
        torch.Tensor.bfloat16 = lambda t: t.float().clone()  # Muon's iteration in f32, as krnl runs it
        try:
            ref.step()
        finally:
            torch.Tensor.bfloat16 = original
        lrs.step()
    want = np.concatenate([p.detach().numpy().reshape(-1) for _, p in named]).astype(np.float64)
    got = flat_of(fp.params, fp.numel)
    err = np.max(np.abs((got - p0) - (want - p0))) / np.max(np.abs(want - p0))
    assert err < 1e-4, f"{case}: max relative error of the update {err:.2e}"
