"""ops.gemm through each GEMM variant of a device that has several (Metal: metal/gemm.metal's
tile32, steel64, steel32; metal-sim here, the real GPU too on a Mac), forced with
set_gemm_choice, against float64 numpy at awkward sizes; the per-class choice table and its
errors; the shape classes. The kernels themselves are tested in test_metal_kernels_gemm.py."""

import numpy as np
import pytest

import krnl
from krnl import ops

from conftest import empty_filled, read, upload
from test_gemm import TRANS, check, gemm_bound, operands

VARIANT_DEVICES = [d for d in krnl.devices() if krnl.device(d).gemm_variants()]
PAIRS = [("f32", "f32"), ("f16", "f16"), ("f16", "f32")]
# 65 and 127 leave ragged 64-tiles, 64 is whole; every form includes M or N below one tile.
SHAPES = [(1, 65, 33), (65, 127, 31), (127, 1, 64), (64, 64, 64)]


@pytest.fixture(params=VARIANT_DEVICES or [pytest.param(None, marks=pytest.mark.skip(reason="no device with GEMM "
                                                                                             "variants registered"))])
def vdev(request):
    dev = krnl.device(request.param)
    dev.clear_gemm_choices()
    yield dev
    dev.clear_gemm_choices()


def last_kernels(dev):
    """Kernel names of the last step, where the device keeps its log (metal-sim); else None."""
    if dev.name != "metal-sim":
        return None
    return [r["kernel"] for r in krnl._core.testing.metal_sim_last_step()]


@pytest.mark.parametrize("trans", list(TRANS))
@pytest.mark.parametrize("dt,cdt", PAIRS, ids=[f"{a}->{c}" for a, c in PAIRS])
@pytest.mark.parametrize("variant", ["tile32", "steel64", "steel32"])
def test_gemm_variant_forced(vdev, variant, trans, dt, cdt):
    """Every variant through the op: beta = 0 over NaN (C never read), then alpha, beta != 0.
    tt runs as an nt transpose and a tn product, both through the forced variant."""
    ta, tb = TRANS[trans]
    vdev.set_gemm_choice("*", variant)
    rng = np.random.default_rng(21)
    infix = "" if variant == "tile32" else variant + "_"
    for M, N, K in SHAPES:
        A, B, opa, opb = operands(vdev, rng, M, N, K, ta, tb, dt)
        C = empty_filled(vdev, (M, N), cdt, np.nan)
        ops.gemm(A, B, C, trans_a=ta, trans_b=tb, alpha=1.5, split_k=1)
        check(C, 1.5 * (opa @ opb), K, cdt, 1.5, opa, opb, what=f"{variant} {trans} {M}x{N}x{K} beta=0")
        kernels = last_kernels(vdev)
        if kernels is not None:
            form = "tn" if trans == "tt" else trans
            assert kernels[-1] == f"gemm_{infix}{form}_{dt}" + ("_f32" if cdt != dt else "")
        C, c0 = upload(vdev, rng.standard_normal((M, N)), cdt)
        ops.gemm(A, B, C, trans_a=ta, trans_b=tb, alpha=-0.75, beta=0.5, split_k=1)
        check(C, -0.75 * (opa @ opb) + 0.5 * c0, K, cdt, -0.75, opa, opb, 0.5, c0, what=f"{variant} {trans} beta")


@pytest.mark.parametrize("trans", ["nn", "nt", "tn"])
@pytest.mark.parametrize("variant", ["steel64", "steel32"])
def test_gemm_variant_strided_views(vdev, variant, trans):
    """3-D views of row and column windows of a stack (batch strides and row strides of the
    kernels), alpha and beta; nothing outside C's windows moves."""
    ta, tb = TRANS[trans]
    vdev.set_gemm_choice("*", variant)
    rng = np.random.default_rng(22)
    batch, M, N, K = 3, 65, 33, 31
    a_shape, b_shape = ((K, M) if ta else (M, K)), ((N, K) if tb else (K, N))
    bigA, a = upload(vdev, rng.standard_normal((batch, a_shape[0] + 5, a_shape[1] + 3)), "f16")
    bigB, b = upload(vdev, rng.standard_normal((batch, b_shape[0] + 2, b_shape[1])), "f16")
    bigC, c = upload(vdev, rng.standard_normal((batch, M + 4, N + 5)), "f32")
    A, B, C = bigA[:, 5:, 1:1 + a_shape[1]], bigB[:, :b_shape[0]], bigC[:, 4:, 5:]
    ops.gemm(A, B, C, trans_a=ta, trans_b=tb, alpha=0.5, beta=-0.75, batch=batch, split_k=1)
    sa, sb = a[:, 5:, 1:1 + a_shape[1]], b[:, :b_shape[0]]
    opa, opb = (np.swapaxes(sa, -1, -2) if ta else sa), (np.swapaxes(sb, -1, -2) if tb else sb)
    c0 = c[:, 4:, 5:]
    ref = 0.5 * (opa @ opb) - 0.75 * c0
    got = read(bigC)
    assert float(np.max(np.abs(got[:, 4:, 5:] - ref))) <= gemm_bound(K, "f32", ref, 0.5, opa, opb, -0.75, c0)
    outside = np.ones(c.shape, bool)
    outside[:, 4:, 5:] = False
    np.testing.assert_array_equal(got[outside], c[outside], err_msg="write outside the C windows")


def test_gemm_choice_per_class(vdev):
    """A class's own entry wins over '*', '*' over the default; removing entries falls back;
    split-K stays on its own kernels; gemm_aligned follows the chosen variant's tile."""
    if vdev.name != "metal-sim":
        pytest.skip("kernel names are read from metal-sim's step log")
    rng = np.random.default_rng(23)

    def run(M, N, K, split_k=1):
        A, B, _, _ = operands(vdev, rng, M, N, K, False, False, "f32")
        ops.gemm(A, B, vdev.empty((M, N), "f32"), split_k=split_k)
        return krnl._core.testing.metal_sim_last_step()

    assert vdev.gemm_shape_class(33, 65, 65) == "f32.nn.skinny"
    assert vdev.gemm_shape_class(128, 128, 64) == "f32.nn.shallow"
    assert vdev.gemm_shape_class(65, 65, 65) == "f32.nn.medium"
    vdev.set_gemm_choice("f32.nn.skinny", "steel32")
    vdev.set_gemm_choice("*", "steel64")
    assert vdev.gemm_choices() == {"f32.nn.skinny": "steel32", "*": "steel64"}
    assert [r["kernel"] for r in run(33, 65, 65)] == ["gemm_steel32_nn_f32"]
    recs = run(65, 65, 65)
    assert [r["kernel"] for r in recs] == ["gemm_steel64_nn_f32"]
    assert recs[0]["grid"] == (2, 2, 1) and recs[0]["threads"] == (128, 1, 1)
    assert recs[0]["constants"] == [(0, False)]
    recs = run(128, 128, 64)  # whole 64-tiles: the aligned build
    assert recs[0]["constants"] == [(0, True)] and recs[0]["grid"] == (2, 2, 1)
    assert [r["kernel"] for r in run(32, 96, 128, split_k=4)] == ["gemm_splitk_nn_f32", "gemm_reduce_f32"]
    vdev.set_gemm_choice("*", None)
    assert [r["kernel"] for r in run(65, 65, 65)] == ["gemm_nn_f32"]
    recs = run(96, 96, 64)  # tile32 is aligned on 32-tiles
    assert recs[0]["constants"] == [(0, True)] and recs[0]["grid"] == (3, 3, 1) and recs[0]["threads"] == (32, 1, 1)
    vdev.set_gemm_choice("*", "steel64")
    recs = run(96, 96, 64)  # ... steel64 is not
    assert recs[0]["constants"] == [(0, False)] and recs[0]["grid"] == (2, 2, 1)
    vdev.clear_gemm_choices()
    assert vdev.gemm_choices() == {}
    assert [r["kernel"] for r in run(33, 65, 65)] == ["gemm_nn_f32"]


def test_gemm_shape_classes(vdev):
    sc = vdev.gemm_shape_class
    assert sc(64, 4096, 4096, dtype="f16") == "f16.nn.skinny"       # LoRA: the rank as M
    assert sc(4096, 16, 4096, trans_b=True, dtype="f16") == "f16.nt.skinny"
    assert sc(4096, 4096, 64, dtype="f16") == "f16.nn.shallow"      # the rank as K
    assert sc(1024, 1024, 65, trans_a=True, dtype="f16", c_dtype="f32") == "f16_f32.tn.large"
    assert sc(1023, 1024, 65) == "f32.nn.medium"
    assert sc(512, 512, 128, batch=4) == "f32.nn.large"             # outputs count every batch entry
    assert sc(128, 128, 128, trans_a=True, trans_b=True) == "f32.tn.medium"  # tt runs as tn
    classes = vdev.gemm_shape_classes()
    assert len(classes) == len(set(classes)) == 5 * 3 * 4 and "bf16_f32.nt.skinny" in classes
    assert vdev.gemm_variants()[0] == "tile32" and set(vdev.gemm_variants()) == {"tile32", "steel64", "steel32"}


def test_gemm_choice_errors(vdev):
    with pytest.raises(ValueError, match=r"^\[set_gemm_choice\] unknown GEMM variant 'steel128'"):
        vdev.set_gemm_choice("*", "steel128")
    with pytest.raises(ValueError, match=r"^\[set_gemm_choice\] unknown shape class 'f16.nn.huge'"):
        vdev.set_gemm_choice("f16.nn.huge", "steel64")
    assert vdev.gemm_choices() == {}


def test_gemm_variants_absent_elsewhere():
    cpu = krnl.device("cpu")
    assert cpu.gemm_variants() == [] and cpu.gemm_choices() == {}
    assert cpu.capabilities()["gemm_tuning"] is False
    with pytest.raises(ValueError, match=r"^\[set_gemm_choice\] cpu has one GEMM kernel"):
        cpu.set_gemm_choice("*", "steel64")
    for name in VARIANT_DEVICES:
        if name == "metal-sim":  # a simulator: timing it says nothing about a GPU
            assert krnl.device(name).capabilities()["gemm_tuning"] is False
