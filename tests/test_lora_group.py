"""lora_group: the LoRA products of linears sharing an input (q/k/v, gate/up), issued together,
against a float64 numpy oracle at awkward sizes, and against the same linears run one by one."""

import numpy as np
import pytest

import krnl
from krnl.models import lora_group
from krnl.models.lora import LoraFactors, LoraLinear
from krnl.models.params import FlatParams

from conftest import read, upload


def _group(dev, rng, inp, outs, r, dt, scale=2.0, beta=1.0, stacked=False):
    """Linears of widths outs on a shared input of width inp: (lins, float64 A, B per member,
    the f32 gA/gB starting values as float64). stacked: A, B and their gradients are views of one
    FlatParams laid out as a model's (the A side by side), and the members share their Stack."""
    lins, ref = [], []
    G = len(outs)
    flat = FlatParams(dev, {**{f"A{i}": (r, inp) for i in range(G)}, **{f"B{i}": (o, r) for i, o in enumerate(outs)}},
                      dt) if stacked else None
    for i, out in enumerate(outs):
        W, _ = upload(dev, rng.standard_normal((out, inp)) / np.sqrt(inp), dt)
        A, a = upload(dev, rng.standard_normal((r, inp)) / np.sqrt(inp), dt)
        B, b = upload(dev, rng.standard_normal((out, r)) / np.sqrt(r), dt)
        gA, ga = upload(dev, rng.standard_normal((r, inp)), "f32")
        gB, gb = upload(dev, rng.standard_normal((out, r)), "f32")
        if flat is not None:  # the same values, now in the flat buffers
            for src, name in ((A, f"A{i}"), (B, f"B{i}")):
                krnl.ops.cast(src, flat.master(name))
                krnl.ops.cast(src, flat.compute(name))
            krnl.ops.cast(gA, flat.grad(f"A{i}"))
            krnl.ops.cast(gB, flat.grad(f"B{i}"))
            A, B, gA, gB = flat.compute(f"A{i}"), flat.compute(f"B{i}"), flat.grad(f"A{i}"), flat.grad(f"B{i}")
        lins.append(LoraLinear(W, LoraFactors(A, B, gA, gB), scale, accumulate_grads=beta != 0, tag=i))
        ref.append((a, b, ga, gb))
    if flat is not None and G > 1:
        st = lora_group.stack_of(flat, [f"A{i}" for i in range(G)], range(G))
        assert st is not None and lora_group.stack_of(flat, ["A1", "A0"], (1, 0)) is None
        for lin in lins:
            lin.stack = st
    return lins, ref


def _tol(dt):
    return {"f32": 2e-5, "f16": 2e-2, "bf16": 6e-2}[dt]


@pytest.mark.parametrize("stacked", [False, True], ids=["copied", "stacked"])
@pytest.mark.parametrize("out_beta", [1.0, 0.0], ids=["add", "write"])
@pytest.mark.parametrize("accumulate", [True, False], ids=["accumulate", "overwrite"])
@pytest.mark.parametrize("rows,inp,outs,r", [(33, 31, (31, 17, 17), 3), (1, 127, (64, 48), 16), (31, 64, (33,), 2)])
def test_lora_group_forward_backward(dev, rows, inp, outs, r, accumulate, out_beta, stacked):
    """ys = b ys + s x A_i^T B_i^T, gB_i (+)= s dy_i^T t_i, gA_i (+)= dt_i^T x,
    dx = b dx + sum_i dt_i A_i (b: out_beta, the LoRA-first order's 0); with the members' A
    copied together at the call, or read (and their gA written) as one Stack."""
    dt = "f32"
    rng = np.random.default_rng(rows * 7 + len(outs))
    s, beta = 2.0, 1.0 if accumulate else 0.0
    lins, ref = _group(dev, rng, inp, outs, r, dt, s, beta, stacked)
    x, xf = upload(dev, rng.standard_normal((rows, inp)), dt)
    # the outputs as column blocks of one buffer, like q|k|v
    total = sum(outs)
    Y, yf = upload(dev, rng.standard_normal((rows, total)), dt)
    cols = np.cumsum((0,) + outs)
    ys = [Y[:, c0:c1] for c0, c1 in zip(cols[:-1], cols[1:])]
    saved, group = lora_group.group_forward(lins, x, ys, beta=out_beta)
    assert (group is not None) == (len(outs) > 1)
    assert group is None or (group.gA is not None) == stacked
    DY, dyf = upload(dev, rng.standard_normal((rows, total)), dt)
    dys = [DY[:, c0:c1] for c0, c1 in zip(cols[:-1], cols[1:])]
    DX, dxf = upload(dev, rng.standard_normal((rows, inp)), dt)
    # one member runs as its own LoraLinear, whose lora_backward adds into dx
    dx_beta = out_beta if group is not None else 1.0
    lora_group.group_backward(lins, dys, saved, group, DX, beta=dx_beta)

    y_ref, dx_ref = out_beta * yf, dx_beta * dxf
    for i, ((a, b, ga, gb), lin) in enumerate(zip(ref, lins)):
        c0, c1 = cols[i], cols[i + 1]
        t = xf @ a.T
        y_ref[:, c0:c1] += s * t @ b.T
        dy = dyf[:, c0:c1]
        dtt = s * dy @ b
        dx_ref += dtt @ a
        gB_ref = beta * gb + s * dy.T @ t
        gA_ref = beta * ga + dtt.T @ xf
        for got, want, what in ((lin.factors.gB, gB_ref, "gB"), (lin.factors.gA, gA_ref, "gA")):
            err = np.max(np.abs(read(got) - want)) / max(np.max(np.abs(want)), 1.0)
            assert err < _tol(dt), f"member {i} {what}: relative error {err:.2e}"
    for got, want, what in ((Y, y_ref, "y"), (DX, dx_ref, "dx")):
        err = np.max(np.abs(read(got) - want)) / max(np.max(np.abs(want)), 1.0)
        assert err < _tol(dt), f"{what}: relative error {err:.2e}"


def test_lora_group_matches_one_by_one(dev, monkeypatch):
    """The grouped products give what each linear's own lora_forward/lora_backward gives (same
    dtype, rounding aside), in the device's compute dtypes."""
    for dt in ("f32", "bf16") if "bf16" in dev.capabilities()["dtypes"] else ("f32",):
        results = []
        for groups in ("1", "0"):
            monkeypatch.setenv("KRNL_LORA_GROUPS", groups)
            rng = np.random.default_rng(5)
            lins, _ = _group(dev, rng, 48, (32, 16), 16, dt)
            x, _ = upload(dev, rng.standard_normal((33, 48)), dt)
            ys = [upload(dev, rng.standard_normal((33, o)), dt)[0] for o in (32, 16)]
            saved, group = lora_group.group_forward(lins, x, ys)
            assert (group is not None) == (groups == "1")
            dys = [upload(dev, rng.standard_normal((33, o)), dt)[0] for o in (32, 16)]
            dx, _ = upload(dev, rng.standard_normal((33, 48)), dt)
            lora_group.group_backward(lins, dys, saved, group, dx)
            results.append([read(t) for t in ys + [dx]] + [read(t) for l in lins for t in (l.factors.gA, l.factors.gB)])
        for got, want in zip(*results):
            err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0)
            assert err < _tol(dt), f"{dt}: grouped and one-by-one differ by {err:.2e}"


def test_lora_group_falls_back_with_dropout(dev):
    """Members with dropout in training mask their inputs each with its own mask: no group."""
    rng = np.random.default_rng(2)
    lins, _ = _group(dev, rng, 32, (16, 16), 4, "f32")
    for lin in lins:
        lin.dropout = 0.25
    x, _ = upload(dev, rng.standard_normal((8, 32)), "f32")
    ys = [upload(dev, rng.standard_normal((8, 16)), "f32")[0] for _ in lins]
    saved, group = lora_group.group_forward(lins, x, ys, call_seed=7)
    assert group is None and all(s.seed is not None for s in saved)


@pytest.mark.parametrize("outs", [(17, 9, 9), (33,)], ids=["group", "one"])
def test_lora_group_sample_order(dev, outs):
    """With SampleSums on (krnl.models.sample_sums), each member's gA, gB (views of one FlatParams' f32
    gradient) gather per sample in the slots, over 2 micro-batches, and finish() adds their tree
    in: float64's gradients (2 micro-batches of 4 samples of 3 rows; column-block dy_i, t_i of
    the q|k|v layout), and the whole micro-batches' gradients are their halves' added in f32, bit
    for bit (what 2 ranks and MPI's sum compute). A single member runs LoraLinear's own
    backward. Halves of 6 rows: on the CPU reserve() blocks every GEMM by a sample's rows, which
    any split keeps (without the blocks the single member failed under OpenBLAS's SkylakeX kernels);
    on CUDA cuBLAS picks the same kernels for both halves and the whole at this size
    (docs/distributed.md)."""
    from krnl.models.sample_sums import SampleSums

    S, T, inp, r, s = 4, 3, 19, 2, 2.0
    rows, cols = S * T, np.cumsum((0,) + outs)
    rng = np.random.default_rng(11)
    a = [rng.standard_normal((r, inp)) / np.sqrt(inp) for _ in outs]
    b = [rng.standard_normal((o, r)) / np.sqrt(r) for o in outs]
    xs = [rng.standard_normal((rows, inp)) for _ in range(2)]
    dys = [rng.standard_normal((rows, cols[-1])) for _ in range(2)]
    run = []
    for lo, hi in ((0, rows), (0, rows // 2), (rows // 2, rows)):
        shapes = {f"{k}{i}": sh for i, o in enumerate(outs) for k, sh in (("A", (r, inp)), ("B", (o, r)))}
        flat = FlatParams(dev, shapes)
        sums = SampleSums(flat, on=True)
        lins, ref = [], []
        for i, o in enumerate(outs):
            W, _ = upload(dev, rng.standard_normal((o, inp)))
            (A, af), (B, bf) = upload(dev, a[i]), upload(dev, b[i])
            f = LoraFactors(A, B, flat.grad(f"A{i}"), flat.grad(f"B{i}"))
            lins.append(LoraLinear(W, f, s, sums=sums))
            ref.append((af, bf))
        sums.reserve((hi - lo) // T, T, dev)
        gA_ref, gB_ref = [0.0] * len(outs), [0.0] * len(outs)
        for x0, dy0 in zip(xs, dys):
            sums.begin((hi - lo) // T)
            x, xf = upload(dev, x0[lo:hi])
            Y = dev.empty((hi - lo, cols[-1]), "f32")
            saved, group = lora_group.group_forward(lins, x, [Y[:, c0:c1] for c0, c1 in zip(cols[:-1], cols[1:])],
                                                    beta=0.0)
            DY, dyf = upload(dev, dy0[lo:hi])
            dx = dev.empty((hi - lo, inp), "f32")
            lora_group.group_backward(lins, [DY[:, c0:c1] for c0, c1 in zip(cols[:-1], cols[1:])], saved, group,
                                      dx, beta=0.0 if group is not None else 1.0)
            for i, (af, bf) in enumerate(ref):
                dy = dyf[:, cols[i]:cols[i + 1]]
                gA_ref[i] = gA_ref[i] + (s * dy @ bf).T @ xf
                gB_ref[i] = gB_ref[i] + s * dy.T @ (xf @ af.T)
        sums.finish()
        run.append(read(flat.grads, np.float32))
        if hi - lo == rows:
            for i in range(len(outs)):
                for got, want in ((read(flat.grad(f"A{i}")), gA_ref[i]), (read(flat.grad(f"B{i}")), gB_ref[i])):
                    assert np.max(np.abs(got - want)) <= 2e-5 * max(np.max(np.abs(want)), 1.0)
    np.testing.assert_array_equal(run[0], run[1] + run[2])


def test_lora_group_model_reads_its_stacks(dev):
    """A Llama model lays each layer's A side by side: q, k, v and gate, up read theirs as one
    view of the model's parameters (no copy at the call) and write their gradients there; with
    only some of a group adapted, or the layout split, the group copies (stacked_A's other path)."""
    from krnl.models.model import LlamaModel
    from krnl.models.config import LoraConfig, ModelConfig, random_weights

    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    m = LlamaModel(dev, cfg, random_weights(cfg, 0), LoraConfig(r=2), seed=3)
    flat = m.lora_params.working if m.lora_params.working is not None else m.lora_params.params
    for L in m.layers:
        for lins in ([L.q_proj, L.k_proj, L.v_proj], [L.mlp.gate, L.mlp.up]):
            A, r, gA = lora_group.stacked_A(lins)
            assert gA is not None and A.buffer_id == flat.buffer_id and gA.buffer_id == m.lora_params.grads.buffer_id
            assert A.shape == (len(lins) * 2, 32) and r == 2
            assert np.array_equal(read(A), np.concatenate([read(lin.factors.A) for lin in lins]))
        assert lora_group.stacked_A([L.k_proj, L.v_proj])[2] is None  # not the stack's members
    part = LlamaModel(dev, cfg, random_weights(cfg, 0), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]), seed=3)
    assert part.layers[0].q_proj.stack is None and part.layers[0].mlp.gate.factors is None
