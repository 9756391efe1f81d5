"""Quantized weights in MLX's layout: krnl.quant.affine's packing and quantization (against mx.quantize
where mlx installs) and ops.quantized_matmul against float64 products with the dequantized
weights, at awkward shapes, every bits and group size, forward (x W^T) and input gradient (x W)."""

import numpy as np
import pytest

import krnl
from krnl import ops
from krnl.quant import affine

from conftest import (FLOAT_DTYPES, U32, UNIT_ROUNDOFF, assert_close_elementwise, dispatch_budget, read, round_to,
                      to_dev, upload)


def test_pack_layout():
    """Element j of a row sits in word j // (32 / bits) at bit (j % (32 / bits)) * bits."""
    codes = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 15, 0, 0, 0, 0, 0, 0, 9]])
    # 3 bits: one little-endian bit stream; code 10 straddles words 0 and 1 (bits 30-32).
    c3 = np.zeros((1, 32), np.int64)
    c3[0, 10], c3[0, 31] = 7, 5
    assert affine.pack(c3, 3).view(np.uint32).tolist() == [[0xC0000000, 0x1, 0xA0000000]]
    w = affine.pack(codes, 4)
    assert w.dtype == np.int32 and w.shape == (1, 2)
    assert w.view(np.uint32)[0, 0] == 0x87654321 and w.view(np.uint32)[0, 1] == 0x9000000F
    rng = np.random.default_rng(0)
    for bits in affine.BITS:
        c = rng.integers(0, 1 << bits, (3, 64))
        assert np.array_equal(affine.unpack(affine.pack(c, bits), bits), c)


@pytest.mark.parametrize("bits", affine.BITS)
@pytest.mark.parametrize("group_size", affine.GROUP_SIZES)
def test_quantize_round_trip(bits, group_size):
    """Each weight whose code is not clipped comes back within half a step of its group, a clipped
    one (the far end, whose step count the exact near end rounds) within 1.5 steps; the end of
    larger magnitude exactly (it is the bias); a constant group exactly."""
    rng = np.random.default_rng(bits * group_size)
    w = (rng.standard_normal((5, 4 * group_size)) * rng.uniform(0.01, 4, (5, 1))).astype(np.float32)
    w[0, :group_size] = 0.75
    wq, s, b = affine.quantize(w, bits, group_size)
    back = affine.dequantize(wq, s, b, bits, group_size)
    step = np.repeat(np.abs(s), group_size, axis=1)
    codes = affine.unpack(wq, bits)
    inside = (codes > 0) & (codes < (1 << bits) - 1)
    err = np.abs(back - w) - 1e-6 * np.abs(w)
    assert np.all(err[inside] <= 0.5 * step[inside] * (1 + 1e-5)) and np.all(err <= 1.5 * step)
    assert np.array_equal(back[0, :group_size], w[0, :group_size])
    g = w.reshape(5, -1, group_size)
    far = np.where(np.abs(g.min(2)) > np.abs(g.max(2)), g.min(2), g.max(2))
    np.testing.assert_allclose(b, far, rtol=0)


@pytest.mark.mlx
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_quantize_matches_mlx(dtype):
    """Codes, scales and biases bit-identical to mx.quantize (scales and biases rounded to the
    weight's dtype, as MLX returns them)."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(3)
    for bits in affine.BITS:
        for gs in affine.MLX_GROUP_SIZES:
            w = (rng.standard_normal((6, 384)) * rng.uniform(0.01, 3, (6, 1))).astype(np.float32)
            w[1, :gs] = -np.abs(w[1, :gs])
            wm = mx.array(w).astype(getattr(mx, dtype))
            wq, s, b = mx.quantize(wm, group_size=gs, bits=bits)
            pq, ps, pb = affine.quantize(np.array(wm.astype(mx.float32)), bits, gs)
            as_dtype = lambda a: np.array(mx.array(a).astype(getattr(mx, dtype)).astype(mx.float32))
            assert np.array_equal(np.array(wq).view(np.int32), pq), (bits, gs)
            assert np.array_equal(np.array(s.astype(mx.float32)), as_dtype(ps)), (bits, gs)
            assert np.array_equal(np.array(b.astype(mx.float32)), as_dtype(pb)), (bits, gs)


def test_quantize_errors():
    with pytest.raises(ValueError, match=r"\[quantize\] bits must be one of \(2, 3, 4, 5, 6, 8\), got 7"):
        affine.quantize(np.zeros((2, 64)), 7, 64)
    with pytest.raises(ValueError, match=r"\[quantize\] W must be 2-D with its last dimension a multiple of "
                                         r"group_size 64 .*, got shape \(2, 96\)"):
        affine.quantize(np.zeros((2, 96)), 4, 64)


# ------------------------------------------------------------------------------- quantized_matmul


def quantized_missing(dev):
    """Why ops.quantized_matmul cannot run on dev (its NotImplementedError), or None."""
    x, w = dev.zeros((1, 32)), dev.zeros((1, 4), "i32")
    s = dev.zeros((1, 1))
    try:
        ops.quantized_matmul(x, w, s, s, dev.empty((1, 1)), True, 32, 4)
        dev.synchronize()
    except NotImplementedError as e:
        return str(e)
    return None


def quantized_inputs(dev, O, I, bits, group_size, sdt, seed):
    """(w, scales, biases) on dev and W (O, I) float64 as the device sees it (scales and biases
    rounded to sdt): random codes, scales of both signs, as quantize makes them."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, (O, I))
    G = I // group_size
    scales = rng.uniform(0.01, 0.2, (O, G)) * rng.choice([-1.0, 1.0], (O, G))
    biases = rng.standard_normal((O, G))
    s, sf = upload(dev, scales, sdt)
    b, bf = upload(dev, biases, sdt)
    W = np.repeat(sf, group_size, axis=1) * codes + np.repeat(bf, group_size, axis=1)
    return to_dev(dev, affine.pack(codes, bits), "i32"), s, b, W


# (N, O, I, group_size): 1, 31 and 33 rows (Metal's 32-row tiles), 8 and 9 (the last of Metal's
# few-row form, the first tiled), I not a multiple of 128 nor, at group size 16, of Metal's 32-deep
# K step, O across the CPU's 256-row tiles and off Metal's 32 and 8 out columns
QMM_CASES = [(1, 1, 32, 32), (33, 31, 96, 32), (2, 300, 192, 64), (33, 65, 320, 64), (5, 17, 384, 128),
             (17, 9, 64, 16), (31, 33, 48, 16), (8, 45, 96, 32), (9, 13, 160, 32)]


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("bits", affine.BITS)
@pytest.mark.parametrize("transpose", [True, False], ids=["xWt", "xW"])
@pytest.mark.parametrize("N,O,I,group_size", QMM_CASES, ids=[f"{n}x{o}x{i}g{g}" for n, o, i, g in QMM_CASES])
def test_quantized_matmul(dev, N, O, I, group_size, transpose, bits, dt):
    """out = x W^T (forward) or x W (input gradient) with W dequantized, against float64 from the
    same rounded inputs; then beta = 0.5 accumulates into out. Bound per element: the f32 sum's
    error over K terms (of |x| |W|), one rounding into dt, and for 16-bit dt one rounding of each
    dequantized weight to dt (the contract allows it: CUDA's cuBLAS path from 16 rows on)."""
    why = quantized_missing(dev)
    if why:
        pytest.skip(why)
    if I * bits % 32:
        pytest.skip(f"a row of {I} {bits}-bit codes does not fill whole 32-bit words")
    w, s, b, W = quantized_inputs(dev, O, I, bits, group_size, dt, seed=N * O + bits)
    K, M = (I, O) if transpose else (O, I)
    x, xf = upload(dev, np.random.default_rng(O).standard_normal((N, K)), dt)
    Wop = W.T if transpose else W                                        # (K, M)
    ref, mag = xf @ Wop, np.abs(xf) @ np.abs(Wop)
    tol = (K + 4) * U32 * mag + (UNIT_ROUNDOFF[dt] * mag if dt != "f32" else 0)
    out = dev.empty((N, M), dt)
    ops.quantized_matmul(x, w, s, b, out, transpose, group_size, bits)
    got = read(out)
    assert_close_elementwise(got, ref, UNIT_ROUNDOFF[dt], tol, what="out")
    ops.quantized_matmul(x, w, s, b, out, transpose, group_size, bits, beta=0.5)
    assert_close_elementwise(read(out), ref + 0.5 * got, 2 * UNIT_ROUNDOFF[dt], 2 * tol, what="out, beta 0.5")


def test_quantized_matmul_f32_scales_with_16_bit_activations(dev):
    """Scales and biases may stay f32 (the GGUF and quantize-on-load paths keep them unrounded)."""
    why = quantized_missing(dev)
    if why:
        pytest.skip(why)
    w, s, b, W = quantized_inputs(dev, 9, 64, 4, 32, "f32", seed=1)
    x, xf = upload(dev, np.random.default_rng(2).standard_normal((3, 64)), "bf16")
    out = dev.empty((3, 9), "bf16")
    ops.quantized_matmul(x, w, s, b, out, True, 32, 4)
    assert_close_elementwise(read(out), round_to(xf @ W.T, "f32"), UNIT_ROUNDOFF["bf16"],
                             (64 + 4) * U32 * (np.abs(xf) @ np.abs(W.T)), what="out")


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
@pytest.mark.parametrize("bits", affine.BITS)
@pytest.mark.parametrize("V,C,group_size", [(1, 32, 32), (33, 96, 32), (7, 64, 16), (5, 384, 128)])
def test_quantized_embedding(dev, V, C, group_size, bits, dt):
    """Rows of a quantized table, repeated and in any order, equal the float64 dequantized rows
    rounded once to dt; scales in dt or f32."""
    why = quantized_missing(dev)
    if why:
        pytest.skip(why)
    for sdt in ((dt, "f32") if dt != "f32" else ("f32",)):
        w, s, b, W = quantized_inputs(dev, V, C, bits, group_size, sdt, seed=V + C + bits)
        ids = np.random.default_rng(C).integers(0, V, 37).astype(np.int32)
        out = dev.empty((37, C), dt)
        ops.quantized_embedding(dev.tensor(ids, "i32"), w, s, b, out, group_size, bits)
        np.testing.assert_array_equal(read(out), round_to(W[ids], dt), err_msg=f"scales {sdt}")


def test_quantized_embedding_errors(dev):
    w, s = dev.zeros((5, 8), "i32"), dev.zeros((5, 2))
    ids = dev.tensor(np.array([0, 4, 5], np.int32), "i32")
    with pytest.raises(ValueError, match=r"\[quantized_embedding\] id 5 at position 2 is out of range"):
        ops.quantized_embedding(ids, w, s, s, dev.empty((3, 64)), 32, 4)
        dev.synchronize()
    with pytest.raises(ValueError, match=r"\[quantized_embedding\] out must have shape \(3, 64\)"):
        ops.quantized_embedding(ids, w, s, s, dev.empty((3, 32)), 32, 4)
    with pytest.raises(ValueError, match=r"\[quantized_embedding\] scales must be \(5, 2\) for w"):
        ops.quantized_embedding(ids, w, dev.zeros((5, 4)), dev.zeros((5, 4)), dev.empty((3, 64)), 32, 4)


@pytest.mark.parametrize("N", [20, 3])
@pytest.mark.parametrize("bits", [3, 4])
def test_quantized_matmul_column_blocks(dev, bits, N):
    """x and out may be row-strided column blocks of wider matrices (a fused q|k|v projection
    whose parts are quantized differently): only the block is read and written (3 rows: Metal's
    few-row form)."""
    why = quantized_missing(dev)
    if why:
        pytest.skip(why)
    O, I = 24, 64
    w, s, b, W = quantized_inputs(dev, O, I, bits, 32, "f32", seed=bits)
    rng = np.random.default_rng(5)
    wide_x = rng.standard_normal((N, 100)).astype(np.float32)
    wide_out = rng.standard_normal((N, 90)).astype(np.float32)
    xd, od = dev.tensor(wide_x, "f32"), dev.tensor(wide_out, "f32")
    ops.quantized_matmul(xd[:, 7:7 + I], w, s, b, od[:, 30:30 + O], True, 32, bits)           # x W^T
    want = wide_out.copy()
    want[:, 30:30 + O] = wide_x[:, 7:7 + I].astype(np.float64) @ W.T
    np.testing.assert_allclose(od.numpy(), want, rtol=1e-5, atol=1e-5)
    ops.quantized_matmul(od[:, 30:30 + O], w, s, b, xd[:, 7:7 + I], False, 32, bits, beta=1.0)  # + out W
    want_x = wide_x.copy()
    want_x[:, 7:7 + I] += want[:, 30:30 + O].astype(np.float64) @ W
    np.testing.assert_allclose(xd.numpy(), want_x, rtol=1e-5, atol=1e-4)


def test_quantized_matmul_metal_forms():
    """On Metal, x W^T of at most 8 rows takes the few-row form (quantized_matmul_tv_*, 8 out columns
    and 8 rows per threadgroup of 64 threads), anything else the tiled form (32x32 tiles, 128
    threads); one dispatch for the whole product (block at column 0, the groups of W's rows), its
    flops counted for the command-buffer split's estimate."""
    import conftest
    if conftest.METAL_SIM is None:
        pytest.skip("metal-sim is not registered")
    sim = krnl.device("metal-sim")
    w, s, b, _ = quantized_inputs(sim, 70, 96, 4, 32, "f16", seed=3)
    fields = ["N", "M", "K", "words", "group_size", "beta", "ldx", "ldo", "m0", "groups"]
    for N, transpose, kernel, grid, threads in ((8, True, "tv", (9, 1, 1), 64), (9, True, "t", (3, 1, 1), 128),
                                                (1, False, "n", (3, 1, 1), 128), (33, False, "n", (3, 2, 1), 128)):
        K, M = (96, 70) if transpose else (70, 96)
        x = to_dev(sim, np.ones((N, K)), "f16")
        with sim.step():
            ops.quantized_matmul(x, w, s, b, sim.empty((N, M), "f16"), transpose, 32, 4, beta=0.25)
        (rec,) = krnl._core.testing.metal_sim_last_step()
        assert rec["kernel"] == f"quantized_matmul_{kernel}_f16_b4", rec["kernel"]
        assert rec["grid"] == grid and rec["threads"] == (threads, 1, 1)
        assert rec["flops"] == 2 * N * M * K
        vals = np.frombuffer(rec["args"], np.uint32).copy()
        args = dict(zip(fields, vals.tolist()))
        args["beta"] = float(vals[5:6].view(np.float32)[0])
        assert args == dict(N=N, M=M, K=K, words=12, group_size=32, beta=0.25, ldx=K, ldo=M, m0=0, groups=3)


@pytest.mark.parametrize("N,transpose", [(3, True), (40, True), (40, False)], ids=["xWt-few", "xWt", "xW"])
def test_quantized_matmul_over_the_dispatch_budget_runs_in_blocks(N, transpose):
    """On Metal, a quantized product estimated over the per-dispatch budget (the watchdog:
    csrc/metal/policy.h) runs as blocks of its form's tiles (32x32 tiled; 8 columns of the few-row
    form, whose rows are never split), each its own dispatch within the budget or a single tile,
    together covering out once; the result equals the one-dispatch product bit for bit."""
    import conftest
    if conftest.METAL_SIM is None:
        pytest.skip("metal-sim is not registered")
    sim = krnl.device("metal-sim")
    O, I = 70, 96
    K, M = (I, O) if transpose else (O, I)
    w, s, b, _ = quantized_inputs(sim, O, I, 4, 32, "f16", seed=4)
    x = to_dev(sim, np.random.default_rng(5).standard_normal((N, K)), "f16")
    out0 = np.random.default_rng(6).standard_normal((N, M))
    whole, split = to_dev(sim, out0, "f16"), to_dev(sim, out0, "f16")
    ops.quantized_matmul(x, w, s, b, whole, transpose, 32, 4, beta=0.5)
    (one,) = krnl._core.testing.metal_sim_last_step()
    gpu = dict(apple_family=9)
    budget = 0.3 * krnl._core.testing.metal_estimate_ms(gpu, one["flops"], one["bytes"], one["rate"])
    with dispatch_budget(sim, budget):
        ops.quantized_matmul(x, w, s, b, split, transpose, 32, 4, beta=0.5)
        recs = krnl._core.testing.metal_sim_last_step()
    assert len(recs) > 1 and {r["kernel"] for r in recs} == {one["kernel"]}
    assert one["rate"] == ("quantized_rows" if N <= 8 else "quantized_tiled")
    cover = np.zeros((N, M), np.int32)
    base = {i: off for i, _, _, _, off in one["buffers"]}[4]
    for r in recs:
        rows, cols = (int(v) for v in np.frombuffer(r["args"], np.uint32)[:2])
        r0, c0 = divmod(({i: off for i, _, _, _, off in r["buffers"]}[4] - base) // 2, M)
        assert int(np.frombuffer(r["args"], np.uint32)[8]) == c0  # m0: the block's first column
        ms = krnl._core.testing.metal_estimate_ms(gpu, r["flops"], r["bytes"], r["rate"])
        single_tile = r["grid"][:2] == (1, 1)
        assert ms <= budget or single_tile, (ms, budget, r["grid"])
        cover[r0:r0 + rows, c0:c0 + cols] += 1
    assert (cover == 1).all()
    np.testing.assert_array_equal(read(split), read(whole))


def test_quantized_matmul_errors(dev):
    """Bad layouts are refused in one line naming the op and the tensor."""
    x, w, s = dev.zeros((2, 64)), dev.zeros((3, 8), "i32"), dev.zeros((3, 2))
    out = dev.empty((2, 3))
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] bits must be 2, 3, 4, 5, 6 or 8, got 7"):
        ops.quantized_matmul(x, w, s, s, out, True, 32, 7)
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] w must be 2-D \(O, I \* bits / 32\) of packed 3-bit"):
        ops.quantized_matmul(x, w, s, s, out, True, 32, 3)
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] group_size must be 16, 32, 64 or 128, got 48"):
        ops.quantized_matmul(x, w, s, s, out, True, 48, 4)
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] w must be i32"):
        ops.quantized_matmul(x, dev.zeros((3, 8)), s, s, out, True, 32, 4)
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] scales must be \(3, 2\) for w .* got"):
        ops.quantized_matmul(x, w, dev.zeros((3, 1)), s, out, True, 32, 4)
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] biases must have shape \(3, 2\)"):
        ops.quantized_matmul(x, w, s, dev.zeros((3, 3)), out, True, 32, 4)
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] x must be \(N, 3\) for out = x W"):
        ops.quantized_matmul(x, w, s, s, dev.empty((2, 64)), False, 32, 4)
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] out must have shape \(2, 3\)"):
        ops.quantized_matmul(x, w, s, s, dev.empty((2, 4)), True, 32, 4)
    with pytest.raises(ValueError, match=r"\[quantized_matmul\] scales must be f32, got"):
        ops.quantized_matmul(x, w, dev.zeros((3, 2), "f16"), dev.zeros((3, 2), "f16"), out, True, 32, 4)


# ------------------------------------------------------------------- LoRA on a quantized base


def _tiny(dev, quantize=None, weights=None):
    """The suite's tiny LoRA model with in-features of 32 and 64 (so it quantizes at group size
    32) and the same random weights unless `weights` replace them."""
    from krnl.models.config import ModelConfig, random_weights

    from conftest import TINY_LLAMA, tiny_lora_model
    if weights is None:
        weights = random_weights(ModelConfig.from_dict({**TINY_LLAMA, "intermediate_size": 64}), 0, std=0.2)
    return tiny_lora_model(dev, "f32", weights=weights, quantize=quantize, intermediate_size=64), weights


@pytest.mark.parametrize("quantize", [(4, 32), (8, 32), (4, 32, "mxfp4")], ids=["q4", "q8", "mxfp4"])
def test_lora_on_a_quantized_base_equals_the_dequantized_base(dev, quantize):
    """A model whose projections are quantized (affine, or mxfp4) gives the loss and LoRA gradients
    of a dense model holding the dequantized weights (f32: both compute the same products), and the
    quantized one differs from the original weights' model (the base really is quantized)."""
    from conftest import lora_step
    why = quantized_missing(dev)
    if why:
        pytest.skip(why)
    rng = np.random.default_rng(7)
    ids, targets = rng.integers(0, 61, (2, 9)), rng.integers(0, 61, (2, 9))
    q, weights = _tiny(dev, quantize)
    assert q.quantize == quantize and q.layers[0].mlp.down.W.mode == (quantize[2:] or ("affine",))[0]
    dense_weights = dict(weights)
    for i, L in enumerate(q.layers):
        for name, lin in L.linears().items():
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            dense_weights[f"model.layers.{i}.{block}.{name}.weight"] = lin.W.numpy()
    loss_q, g_q = lora_step(q, ids, targets)
    loss_d, g_d = lora_step(_tiny(dev, None, dense_weights)[0], ids, targets)
    loss_o, _ = lora_step(_tiny(dev, None, weights)[0], ids, targets)
    assert loss_q == pytest.approx(loss_d, rel=1e-5) and loss_q != pytest.approx(loss_o, rel=1e-6)
    for k in g_d:
        np.testing.assert_allclose(g_q[k], g_d[k], rtol=1e-4, atol=1e-5 * np.max(np.abs(g_d[k])), err_msg=k)


def test_quantized_base_refuses_a_group_size_that_does_not_divide(dev):
    from krnl.models.model import LlamaModel
    from krnl.models.config import LoraConfig, ModelConfig, random_weights

    from conftest import TINY_LLAMA
    cfg = ModelConfig.from_dict({**TINY_LLAMA, "intermediate_size": 48})
    with pytest.raises(ValueError, match=r"\[quantize\] model.layers.0.mlp.down_proj.weight \(32, 48\): its input "
                                         r"size must be a multiple of --q-group-size 32"):
        LlamaModel(dev, cfg, random_weights(cfg, 0), LoraConfig(r=2), quantize=(4, 32))
    with pytest.raises(ValueError, match=r"\[quantize\] bits must be one of \(2, 3, 4, 5, 6, 8\), got 7"):
        LlamaModel(dev, cfg, random_weights(cfg, 0), LoraConfig(r=2), quantize=(7, 32))
    with pytest.raises(ValueError, match=r"\[quantize\] mxfp4 takes bits 4, group_size 32 and no biases, got bits 4, "
                                         r"group_size 64"):
        LlamaModel(dev, cfg, random_weights(cfg, 0), LoraConfig(r=2), quantize=(4, 64, "mxfp4"))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_model_takes_quantized_arrays(dev, dtype):
    """Weights handed over quantized, as MLX folders and GGUF files hold them (QuantizedArray):
    q, k and v at different bits (a RowStack), the MLP at 3, 5 and 6 bits and groups of 16, an
    untied quantized head, a quantized embedding; the loss and LoRA gradients equal those of a
    dense model holding the dequantized weights (f32), and stay close in bf16 with f32 scales."""
    from krnl.models.config import ModelConfig, random_weights
    from krnl.quant.qweight import QuantizedArray, RowStack, QuantizedWeight

    from conftest import TINY_LLAMA, lora_step, tiny_lora_model
    why = quantized_missing(dev)
    if why:
        pytest.skip(why)
    if dtype not in dev.capabilities()["dtypes"]:
        pytest.skip(f"{dtype} not listed by {dev.name}")
    cfg = {**TINY_LLAMA, "intermediate_size": 64, "tie_word_embeddings": False}
    weights = random_weights(ModelConfig.from_dict(cfg), 0, std=0.2)
    layout = {"q_proj": (4, 32, "f32"), "k_proj": (8, 16, "f32"), "v_proj": (6, 32, "f16"),
              "o_proj": (2, 32, "f32"), "gate_proj": (3, 32, "f32"), "up_proj": (5, 16, "f32"),
              "down_proj": (6, 16, "bf16")}
    qw, dense = dict(weights), dict(weights)
    for name in weights:
        m = name.split(".")[-2]
        if name.endswith("_proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight"):
            bits, gs, sdt = layout.get(m, (8, 32, "f16"))
            w, s, b = affine.quantize(np.asarray(weights[name], np.float32), bits, gs)
            s, b = round_to(s, sdt).astype(np.float32), round_to(b, sdt).astype(np.float32)
            qw[name] = QuantizedArray(w, s, b, bits, gs, sdt)
            dense[name] = qw[name].dequantize()
    rng = np.random.default_rng(4)
    ids, targets = rng.integers(0, 61, (2, 9)), rng.integers(0, 61, (2, 9))
    mq = tiny_lora_model(dev, dtype, weights=qw, intermediate_size=64, tie_word_embeddings=False)
    L = mq.layers[0]
    assert isinstance(L.qkv, RowStack) and isinstance(mq.head, QuantizedWeight) and isinstance(mq.embed, QuantizedWeight)
    assert [p.bits for p in L.qkv.parts] == [4, 8, 6] and L.mlp.down.W.scales.dtype == dtype
    assert L.mlp.up.W.scales.dtype == "f32"
    loss_q, g_q = lora_step(mq, ids, targets)
    loss_d, g_d = lora_step(tiny_lora_model(dev, "f32", weights=dense, intermediate_size=64,
                                            tie_word_embeddings=False), ids, targets)
    rtol = 1e-5 if dtype == "f32" else 2e-2
    assert loss_q == pytest.approx(loss_d, rel=rtol)
    for k in g_d:
        np.testing.assert_allclose(g_q[k], g_d[k], rtol=10 * rtol, atol=10 * rtol * np.max(np.abs(g_d[k])), err_msg=k)
    # tied: the quantized table is the head too; generation runs through both
    tied = {k: v for k, v in qw.items() if k != "lm_head.weight"}
    dense_tied = {k: v for k, v in dense.items() if k != "lm_head.weight"}
    mt = tiny_lora_model(dev, dtype, weights=tied, intermediate_size=64, tie_word_embeddings=True)
    assert mt.head is mt.embed and isinstance(mt.embed, QuantizedWeight)
    md = tiny_lora_model(dev, "f32", weights=dense_tied, intermediate_size=64, tie_word_embeddings=True)
    assert lora_step(mt, ids, targets)[0] == pytest.approx(lora_step(md, ids, targets)[0], rel=rtol)
    if dtype == "f32":
        assert mt.generate([3, 5, 7], max_new_tokens=4) == md.generate([3, 5, 7], max_new_tokens=4)


def test_cli_train_eval_generate_on_a_quantized_base(hf_folder, tmp_path, monkeypatch, capsys):
    """krnl train --q-bits 4 on an HF folder: the loss goes down, the checkpoint records the
    quantization (resume without it is refused), and eval and generate run with the same flags."""
    import json

    from krnl.cli.main import main
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    rows = "".join(json.dumps({"text": f"w{i} w{i + 1} w{i + 2} w{i + 3}"}) + "\n" for i in range(1, 20))
    (data / "train.jsonl").write_text(rows)
    (data / "valid.jsonl").write_text(rows)
    q = ["--q-bits", "4", "--q-group-size", "32"]
    common = ["--model", str(hf_folder), "--data", str(data), "--dtype", "f32", "--batch-size", "4", "--quiet",
              "--learning-rate", "1e-2", "--no-tune"]
    assert main(["train", *common, *q, "--iters", "12", "--save-every", "6", "--steps-per-eval", "0"]) == 0
    out = capsys.readouterr().out
    assert "base quantized to 4 bits (groups of 32)" in out
    losses = [json.loads(x)["loss"] for x in (tmp_path / "adapters" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(x)]
    assert losses[-1] < losses[0]
    assert main(["train", *common, "--iters", "14", "--resume"]) == 1
    assert "quantize" in capsys.readouterr().err
    assert main(["eval", "--data", str(data), *q]) == 0
    assert "valid loss" in capsys.readouterr().out
    assert main(["generate", "--prompt", "w3 w4", "--max-tokens", "2", *q]) == 0
    assert capsys.readouterr().out.strip().startswith("w3 w4")
