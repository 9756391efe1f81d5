"""The sample reduce order (krnl.models.sample_sums): a weight gradient summed per sample in the fixed
pairwise tree equals float64 at awkward sizes, a batch's tree is the sum of its two halves' trees
bit for bit (what 2 ranks and MPI's a + b compute), for one GEMM and for whole LoRA steps of the
tiny model (micro-batches, phi3's fused projections, the loss's chunks) under each of OpenBLAS's
x86 kernel sets, slots into the flat gradient, and the bits of per-sample products and of a step
do not depend on the thread count."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import krnl
from krnl.models.sample_sums import SampleSums

HERE = Path(__file__).parent


def _operands(rows, m, n, seed, wide=0):
    """a (rows, m), b (rows, n) f32 whose terms nearly cancel; with wide > 0, a is a column block
    of a (rows, m + wide) array (a row-strided view, as q|k|v's gradients are)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rows, m + wide)).astype(np.float32)
    b = rng.standard_normal((rows, n)).astype(np.float32)
    b[:, 0] -= b[:, 0].mean()  # a column of b summing to ~0 against a's
    return a, b


def _tree_f32(P):
    """The documented tree in numpy f32 (node [lo, hi) = [lo, mid) + [mid, hi))."""
    def node(lo, hi):
        if hi - lo == 1:
            return P[lo]
        mid = lo + (hi - lo) // 2
        return (node(lo, mid) + node(mid, hi)).astype(np.float32)

    return node(0, len(P))


@pytest.mark.parametrize("T", [1, 31, 33])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_sample_sum_matches_float64(dev, B, T):
    m, n, wide = 5, 7, 3
    a, b = _operands(B * T, m, n, seed=B * 100 + T, wide=wide)
    A = dev.tensor(a, "f32")[:, wide:]  # (rows, m) view at row stride m + wide
    got = SampleSums().sample_sum(A, dev.tensor(b, "f32"), 0.5, B).numpy()
    want = 0.5 * a[:, wide:].astype(np.float64).T @ b.astype(np.float64)
    scale = 0.5 * np.abs(a[:, wide:]).astype(np.float64).T @ np.abs(b).astype(np.float64)
    assert got.shape == (m, n)
    assert np.all(np.abs(got - want) <= 4e-7 * scale * np.log2(2 * B * T) + 1e-30)
    # the order is the documented one: each sample's f32 product, then the tree
    per = np.stack([(0.5 * a[s * T:(s + 1) * T, wide:].astype(np.float64).T @ b[s * T:(s + 1) * T]) for s in range(B)])
    assert np.allclose(got, _tree_f32(per.astype(np.float32)), rtol=1e-5, atol=1e-6 * scale.max())


@pytest.mark.parametrize("B,T", [(8, 31), (6, 33), (2, 1)])
def test_sample_sum_of_a_batch_is_its_halves_summed(dev, B, T):
    """One process's tree over B samples == (tree over the first B/2) + (tree over the rest),
    bit for bit: the two ranks' gradients and their allreduce."""
    a, b = _operands(B * T, 4, 9, seed=T)
    sums = SampleSums()
    whole = sums.sample_sum(dev.tensor(a, "f32"), dev.tensor(b, "f32"), 1.0, B).numpy()
    h = B // 2 * T
    first = sums.sample_sum(dev.tensor(a[:h], "f32"), dev.tensor(b[:h], "f32"), 1.0, B // 2).numpy()
    second = sums.sample_sum(dev.tensor(a[h:], "f32"), dev.tensor(b[h:], "f32"), 1.0, B // 2).numpy()
    np.testing.assert_array_equal(whole, first + second)


@pytest.mark.parametrize("S", [1, 2, 3, 5, 6, 7, 8, 12, 16])
def test_tree_sum_adds_in_the_documented_order(dev, S):
    """Bit for bit the recursive halves, whether a node runs as adds or as level GEMMs; magnitudes
    spread over 8 decades so that every other order rounds differently."""
    rng = np.random.default_rng(S)
    P = (rng.standard_normal((S, 2, 3)) * 10.0 ** rng.integers(-4, 5, (S, 2, 3))).astype(np.float32)
    np.testing.assert_array_equal(SampleSums().tree_sum(dev.tensor(P, "f32")).numpy(), _tree_f32(P))
    if S >= 4:  # the order matters at these magnitudes: a plain left-to-right sum differs
        assert not np.array_equal(_tree_f32(P), np.add.reduce(P, axis=0, dtype=np.float32))


def test_weight_grad_into_the_slots(dev):
    """Off, weight_grad is one GEMM over all rows (beta 0 or 1). On, each gradient adds per
    sample into its place in the slots (two gradients of one flat buffer, one of them twice, as a
    fused projection's shared A is), and finish() adds the slots' tree into the flat gradient and
    zeroes them; bad splits and gradients that are no view of the flat buffer are refused."""
    from krnl.models.params import FlatParams

    a, b = _operands(12, 3, 4, seed=9)
    a2, b2 = _operands(12, 2, 5, seed=10)
    g0 = (0.25 * np.ones((3, 4))).astype(np.float32)
    for beta in (0.0, 1.0):
        g = dev.tensor(g0, "f32")
        SampleSums().weight_grad(dev.tensor(a, "f32"), dev.tensor(b, "f32"), g, 2.0, beta)
        np.testing.assert_allclose(g.numpy(), beta * g0 + 2.0 * a.astype(np.float64).T @ b, rtol=1e-5, atol=1e-5)
    flat = FlatParams(dev, {"x": (3, 4), "y": (2, 5)})  # zero gradients
    sums = SampleSums(flat, on=True)
    assert sums.reserve(4, 3, dev) == 4 and sums.begin(4) == 4
    A, B, A2, B2 = (dev.tensor(v, "f32") for v in (a, b, a2, b2))
    sums.weight_grad(A, B, flat.grad("x"), 2.0)
    sums.weight_grad(A2, B2, flat.grad("y"))
    sums.weight_grad(A2, B2, flat.grad("y"), -0.5)
    sums.finish()
    got = flat.grads.numpy()
    want_x = 2.0 * a.astype(np.float64).T @ b
    want_y = 0.5 * a2.astype(np.float64).T @ b2
    np.testing.assert_allclose(got[:12].reshape(3, 4), want_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[12:].reshape(2, 5), want_y, rtol=1e-5, atol=1e-5)
    assert not np.any(sums.slots.numpy())
    with pytest.raises(ValueError, match=r"\[sample_sum\] 12 and 12 rows do not split into 5 samples"):
        sums.sample_sum(A, B, 1.0, 5)
    with pytest.raises(ValueError, match=r"\[weight_grad\] the sample order needs accumulated gradients"):
        sums.weight_grad(A, B, flat.grad("x"), 1.0, 0.0)
    with pytest.raises(ValueError, match=r"\[weight_grad\] g \(3, 2\) is not a view of the flat gradient"):
        sums.weight_grad(A, B[:, :2], flat.grad("x")[:, :2], 1.0)  # a column block: no contiguous place
    with pytest.raises(ValueError, match=r"\[weight_grad\] g \(3, 4\) is not a view of the flat gradient"):
        sums.weight_grad(A, B, dev.tensor(g0, "f32"), 1.0)  # another buffer
    with pytest.raises(ValueError, match=r"\[SampleSums\] a call of 6 samples without reserve\(6\)"):
        sums.begin(6)
    sums.reserve(4, 3, dev)  # a step under way: its micro-batches must keep the sample count
    with pytest.raises(ValueError, match=r"\[SampleSums\] a micro-batch of 6 samples in a step whose micro-batches "
                                         r"have 4: the sample order needs one batch size a step"):
        sums.reserve(6, 3, dev)
    sums.finish()
    assert sums.reserve(6, 3, dev) == 6 and sums.slots.shape[0] == 6


def test_sample_sums_off():
    s = SampleSums()
    assert s.reserve(8, 5, None) == 0 and s.begin(8) == 0 and s.samples == 0
    s.finish()  # nothing to do


# ---- a whole LoRA step of the tiny model


def _batch(vocab, B, T, seed=4):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (B, T)).astype(np.int32)
    tg = np.roll(ids, -1, axis=1)
    for r in range(B):  # unequal target counts per row
        tg[r, :max(0, T - 2 - 2 * r)] = -100
    tg[:, -1] = -100
    return ids, tg


def step_grads(m, batches, n_totals=None, first_row=None):
    """(flat f32 gradient, loss sums) of one step's micro-batches from zeroed gradients (the
    optimizer's update left out), a rank's slices where n_totals gives each global micro-batch's
    target count."""
    from krnl.train.optim import AdamW, Schedule
    from krnl.train.step import StepRunner

    runner = StepRunner(m, AdamW(m.lora_params, Schedule(1e-3, total_steps=1)), micro_batches=len(batches))
    m.lora_params.zero_grads()
    for i, batch in enumerate(batches):
        runner.micro_batch(batch, 1.0, i, None if n_totals is None else n_totals[i], first_row)
    with m.dev.step():
        m.sums.finish()  # what StepRunner.optimizer does first
    m.dev.synchronize()
    flat = m.lora_params
    return np.array(flat.grads.numpy()[:flat.numel], np.float32), np.array(runner.losses.numpy(), np.float32)


def whole_and_halves(m, B, T, accum=1):
    """(whole, halves): the (gradient, loss sums) of one step of `accum` micro-batches of B
    samples of T rows, and the sums of what the two halves of each micro-batch give (each
    weighted by the whole micro-batch's target count and given its first row, as a rank's slice
    is), the sample order on."""
    m.sums.on = True
    batches = [_batch(m.config.vocab_size, B, T, seed=4 + i) for i in range(accum)]
    n = [int(np.count_nonzero(b[1] != -100)) for b in batches]
    whole = step_grads(m, batches)
    h = B // 2
    g0, l0 = step_grads(m, [tuple(a[:h] for a in b) for b in batches], n, 0)
    g1, l1 = step_grads(m, [tuple(a[h:] for a in b) for b in batches], n, h)
    return whole, (g0 + g1, l0 + l1)


@pytest.mark.parametrize("fold", ["0", "1"], ids=["plain", "lora-fold"])
@pytest.mark.parametrize("B,T,accum,kw,dtype", [(8, 40, 1, {}, "f32"), (6, 11, 1, {}, "f32"), (4, 25, 3, {}, "f32"),
                                                (8, 5, 2, {"model_type": "phi3"}, "f32"), (8, 40, 1, {}, "bf16"),
                                                (6, 11, 1, {"quantize": (4, 32), "intermediate_size": 64}, "f32")],
                         ids=["8x40", "6x11", "accum3", "phi3", "bf16", "4-bit"])
def test_lora_step_sample_order_is_its_halves_summed(B, T, accum, kw, dtype, fold, monkeypatch):
    """With the sample order on, one process's gradient and loss sums of a step (accum
    micro-batches) equal the sums of what the two halves of each micro-batch give, bit for bit;
    every LoRA path (grouped q|k|v and gate|up, o, down) carries gradient. OpenBLAS picks its
    kernels by a call's shape (SkylakeX: a small-matrix kernel below about 1,200 outputs, which
    q|k|v's 6-column LoRA product crosses between 320 rows and 160; Haswell: edge tiles), so one
    GEMM over all rows gives a row other bits in the whole batch than in its half: each f32 case
    here failed under both kernel sets before the CPU's GEMMs went by blocks of a sample's rows in
    the sample order (Device.gemm_row_block, docs/distributed.md); bf16's rounding of the
    activations hid it. phi3's fused projections: q, k and v's dA add into one shared gradient,
    per sample too. With the LoRA folded into the frozen GEMMs' K (lora_fold.py, forced on;
    phi3's fused projections and 4-bit weights keep the plain path) the saved inputs are column
    blocks of the widened norm outputs. 4-bit: the quantized matmul's tiles go by the same blocks."""
    from conftest import tiny_lora_model

    monkeypatch.setenv("KRNL_LORA_FOLD", fold)
    m = tiny_lora_model(krnl.device("cpu"), dtype, **kw)
    assert m.config.fused_projections == (kw.get("model_type") == "phi3")
    assert (m.layers[0].qkv_fold is not None) == (fold == "1" and not kw)
    (whole, loss), (halves, halves_loss) = whole_and_halves(m, B, T, accum)
    assert np.count_nonzero(whole) > 0.9 * whole.size
    np.testing.assert_array_equal(whole, halves)
    np.testing.assert_array_equal(loss, halves_loss)
    assert m.dev.gemm_row_block == 0  # finish() unblocks the device's GEMMs
    m.sums.on = False  # the rows order: the same gradient up to f32 rounding
    batches = [_batch(m.config.vocab_size, B, T, seed=4 + i) for i in range(accum)]
    rows, _ = step_grads(m, batches)
    assert np.linalg.norm(rows - whole) <= 1e-5 * np.linalg.norm(whole)


@pytest.mark.parametrize("ce_chunk", [50, 20])
def test_sample_order_loss_chunks_keep_samples(ce_chunk):
    """The loss's logits run in chunks of at most ce_chunk rows; in the sample order a chunk holds
    whole samples (50 rows: one sample of 30) or pieces of one from its start (20: rows 0-19 and
    20-29 of each), so a half's chunks are the whole batch's and the bits match. Chunks of 50
    rows across samples (rows 50-99 hold parts of samples 1-3) differed in both kernel sets."""
    from conftest import tiny_lora_model

    m = tiny_lora_model(krnl.device("cpu"), "f32")
    m.ce_chunk = ce_chunk
    (whole, loss), (halves, halves_loss) = whole_and_halves(m, 4, 30)
    np.testing.assert_array_equal(whole, halves)
    np.testing.assert_array_equal(loss, halves_loss)
    m.sums.samples = 4
    assert m.sums.row_chunks(4, 30, ce_chunk) == ((30, [(r, r + 30) for r in range(0, 120, 30)]) if ce_chunk == 50 else
                                                  (20, [(s + c, s + min(30, c + 20)) for s in range(0, 120, 30)
                                                        for c in (0, 20)]))
    m.sums.samples = 0  # rows order: chunks straight across
    assert m.sums.row_chunks(4, 30, 50) == (50, [(0, 50), (50, 100), (100, 120)])


_KERNELS_CODE = """
import json, sys, numpy as np, krnl
sys.path.insert(0, {here!r})
from conftest import tiny_lora_model
from test_sample_sums import whole_and_halves
out = {{"blas": krnl.device("cpu").capabilities()["details"]["blas"]}}
for B, T in ((8, 40), (8, 5)):
    for cfg in ({{}}, {{"model_type": "phi3"}}):
        m = tiny_lora_model(krnl.device("cpu"), "f32", **cfg)
        (g, loss), (h, hloss) = whole_and_halves(m, B, T)
        same = np.array_equal(g, h) and np.array_equal(loss, hloss)
        out[f"{{B}}x{{T}} {{cfg.get('model_type', 'llama')}}"] = bool(same)
print(json.dumps(out))
"""


def _under_core(core, args, **env):
    """Runs python args in a subprocess under OpenBLAS's `core` kernels (OPENBLAS_CORETYPE; None:
    this CPU's own); skips where the build cannot choose (not a DYNAMIC_ARCH OpenBLAS) or this CPU
    does not run them. Returns its stdout."""
    if core is not None:
        blas = krnl.device("cpu").capabilities()["details"]["blas"]
        if "DYNAMIC_ARCH" not in blas:
            pytest.skip(f"not a DYNAMIC_ARCH OpenBLAS: {blas}")
        env["OPENBLAS_CORETYPE"] = core
    r = subprocess.run([sys.executable] + args, env=dict(os.environ, **env), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    blas = json.loads(r.stdout.strip().splitlines()[-1])["blas"]
    if core is not None and f" {core} " not in blas:
        pytest.skip(f"this CPU does not run OpenBLAS's {core} kernels ({blas})")
    return r.stdout


@pytest.mark.parametrize("core", ["Haswell", "SkylakeX", "Sandybridge"])
def test_sample_order_halves_under_each_openblas_kernel_set(core):
    """The halves' bits equal the whole batch's under each of OpenBLAS's x86 kernel sets that
    this machine runs (OPENBLAS_CORETYPE; the wheel is a DYNAMIC_ARCH build), on 2 threads: the
    claim does not hang on one BLAS's kernel choices. Without the row blocks, 8x40 and 8x5 differed
    under Haswell and SkylakeX (measured)."""
    out = json.loads(_under_core(core, ["-c", _KERNELS_CODE.format(here=str(HERE))], KRNL_NUM_THREADS="2",
                                 OPENBLAS_NUM_THREADS="2").strip().splitlines()[-1])
    del out["blas"]
    assert all(out.values()), out


_THREADS_CODE = """
import json, sys, numpy as np, krnl
sys.path.insert(0, {here!r})
from conftest import tiny_lora_model
from test_sample_sums import _batch, _operands, step_grads
from krnl.models.sample_sums import SampleSums
d = krnl.device("cpu")
a, b = _operands(8 * 33, 64, 300, seed=8)
out = {{"gemm": SampleSums().sample_sum(d.tensor(a, "f32"), d.tensor(b, "f32"), 1.0, 8).numpy()}}
a, b = _operands(1024, 64, 64, seed=9)
d.gemm_row_block = 1024  # what a training call of 1 sample of 1024 rows sets (SampleSums.reserve)
out["gemm1"] = SampleSums().sample_sum(d.tensor(a, "f32"), d.tensor(b, "f32"), 1.0, 1).numpy()
d.gemm_row_block = 0
for key, dtype, B, T in (("step", "f32", 8, 11), ("step1", "f32", 1, 1024), ("bf16", "bf16", 1, 1024)):
    m = tiny_lora_model(d, dtype)
    m.sums.on = True
    out[key] = step_grads(m, [_batch(m.config.vocab_size, B, T)])[0]
np.savez(sys.argv[1], threads=krnl.num_threads(), **out)
print(json.dumps({{"blas": d.capabilities()["details"]["blas"]}}))
"""


@pytest.mark.parametrize("core", [None, "Haswell"], ids=["own", "Haswell"])
def test_sample_order_bits_do_not_depend_on_the_thread_count(tmp_path, core):
    """The per-sample GEMMs (K never split) and the tiny model's whole LoRA step give the same
    bits on 1 thread and on 2, also with fewer samples than threads and with bf16 operands: in
    the sample order every CPU GEMM runs as single-threaded BLAS calls on krnl's pool, blocks of
    one sample's rows in fixed column chunks (Device.gemm_row_block), never split by OpenBLAS's
    threads, whose row tiles per thread change the bits (before the blocks: 1 sample of 1024
    rows, 64 x 64, differed in 29% of the elements under OpenBLAS's Haswell kernels, and so did
    the 1-sample steps; this CPU's SkylakeX kernels kept them, measured)."""
    code = _THREADS_CODE.format(here=str(HERE))
    got = []
    for k in (1, 2):
        _under_core(core, ["-c", code, str(tmp_path / f"t{k}.npz")], KRNL_NUM_THREADS=str(k),
                    OPENBLAS_NUM_THREADS=str(k))
        got.append(np.load(tmp_path / f"t{k}.npz"))
    assert (int(got[0]["threads"]), int(got[1]["threads"])) == (1, 2)
    for key in ("gemm", "gemm1", "step", "step1", "bf16"):
        np.testing.assert_array_equal(got[0][key], got[1][key], err_msg=key)
