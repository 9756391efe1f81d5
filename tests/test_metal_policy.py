"""The Metal backend's device policy, as the portable functions csrc/metal/device.mm calls
(csrc/metal/policy.cpp), on made-up GPUs: which GPU the "metal" device takes and when it is absent
(with the one-line reason `krnl devices` prints), the dtypes it computes in, and how a step is cut
into command buffers. device.mm only fills a GpuDescription from the Metal API (supportsFamily:,
the MTLDevice properties) and calls these, so the rules are tested here although no Mac runs.
The bf16 policy is also checked on a device: metal-sim standing for an M1, M2 or M3."""
import numpy as np
import pytest

import krnl
from krnl import _core, ops

from conftest import METAL_SIM, metal_sim_as

needs_sim = pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")

# What device.mm reads on each machine: Apple documents MTLGPUFamilyApple7 for A14/M1, Apple8 for
# A15/M2, Apple9 for A17/M3; Intel and AMD Macs report only the Mac2 family; the paravirtual GPU of
# a macOS virtual machine (hosted CI runners) lacks the Apple7 features.
M1 = dict(name="Apple M1", apple_family=7, mac2=True, unified_memory=True)
M2 = dict(name="Apple M2 Pro", apple_family=8, mac2=True, unified_memory=True)
M3 = dict(name="Apple M3 Max", apple_family=9, mac2=True, unified_memory=True)
INTEL = dict(name="Intel(R) UHD Graphics 630", apple_family=0, mac2=True, unified_memory=True, low_power=True)
AMD = dict(name="AMD Radeon Pro 5500M", apple_family=0, mac2=True)
PARAVIRTUAL = dict(name="Apple Paravirtual device", apple_family=0, mac2=True, unified_memory=True)

MSL_31 = 301


@pytest.mark.parametrize("gpu", [M1, M2, M3], ids=["m1", "m2", "m3"])
def test_apple_silicon_runs_the_kernels(gpu):
    p = _core.testing.metal_gpu_policy(gpu)
    assert p["usable"] and p["reason"] == ""
    assert _core.testing.metal_choose_device([gpu], MSL_31, MSL_31) == (0, "")


@pytest.mark.parametrize("gpu", [INTEL, AMD, PARAVIRTUAL], ids=["intel", "amd", "paravirtual"])
def test_gpus_below_apple7_are_refused_with_the_reason(gpu):
    p = _core.testing.metal_gpu_policy(gpu)
    assert not p["usable"]
    assert gpu["name"] in p["reason"] and "Apple7" in p["reason"]
    index, reason = _core.testing.metal_choose_device([gpu], MSL_31, MSL_31)
    assert index == -1
    assert reason.startswith("no usable GPU: ") and gpu["name"] in reason and "\n" not in reason


def test_bf16_only_where_native():
    """bf16 is offered only on Apple9 (M3) and later, where MSL bfloat runs natively (elsewhere
    Metal emulates it, ~40x slower than f16): there it is also the training dtype; older GPUs
    train in f16 with loss scaling. Without bf16 kernels, no GPU would offer it."""
    for gpu, native in ((M1, False), (M2, False), (M3, True)):
        p = _core.testing.metal_gpu_policy(gpu)
        assert p["native_bf16"] is native, gpu["name"]
        assert p["dtypes"] == ["f32", "f16"] and p["compute_dtype"] == "f16"
        assert p["dtypes_with_bf16_kernels"] == (["f32", "f16", "bf16"] if native else ["f32", "f16"])
        assert p["compute_dtype_with_bf16_kernels"] == ("bf16" if native else "f16")


def test_choice_prefers_the_system_default_and_falls_back():
    # The default device comes first when MTLCreateSystemDefaultDevice() returned one.
    assert _core.testing.metal_choose_device([M1, M3], MSL_31, MSL_31)[0] == 0
    # A default that cannot run the kernels is passed over for a device of MTLCopyAllDevices().
    assert _core.testing.metal_choose_device([AMD, M2], MSL_31, MSL_31) == (1, "")
    # MTLCreateSystemDefaultDevice() returned nil (no CoreGraphics): MTLCopyAllDevices() alone.
    assert _core.testing.metal_choose_device([M1], MSL_31, MSL_31) == (0, "")


def test_no_device_at_all():
    index, reason = _core.testing.metal_choose_device([], MSL_31, MSL_31)
    assert index == -1 and "no Metal device" in reason and "MTLCopyAllDevices" in reason


def test_every_refusal_named():
    index, reason = _core.testing.metal_choose_device([INTEL, AMD], MSL_31, MSL_31)
    assert index == -1 and INTEL["name"] in reason and AMD["name"] in reason and "\n" not in reason


def test_os_too_old_for_the_kernels_language():
    index, reason = _core.testing.metal_choose_device([M3], 300, MSL_31)
    assert index == -1 and "3.1" in reason and "3.0" in reason and "macOS 14" in reason
    assert _core.testing.metal_choose_device([M3], 302, MSL_31) == (0, "")
    index, reason = _core.testing.metal_choose_device([M3], 0, 300)  # macOS 12: below MSL 3.0
    # MSL 3.0 came with macOS 13, but the deployment target is 14: the message names 14
    assert index == -1 and "below 3.0" in reason and "macOS 14 or later" in reason
    index, reason = _core.testing.metal_choose_device([M3], 301, 302)
    assert index == -1 and "macOS 15 or later" in reason
    index, reason = _core.testing.metal_choose_device([M3], 302, 400)
    assert index == -1 and "macOS 26 or later" in reason


def test_kernels_language_version_is_what_the_os_check_uses():
    # The newest MSL any kernel declares: device.mm compares it with what the OS compiles.
    versions = [_core.metal_library_msl_version(n) for n in _core.metal_libraries()]
    assert all(200 <= v <= 400 for v in versions), versions
    need = max(versions)
    assert _core.testing.metal_choose_device([M1], need, need)[0] == 0
    assert _core.testing.metal_choose_device([M1], need - 1, need)[0] == -1


def test_unknown_description_key_is_an_error():
    with pytest.raises(ValueError, match="unknown GPU description key 'family'"):
        _core.testing.metal_gpu_policy(dict(name="x", family=7))


# ---- command buffers (csrc/metal/submission.cpp cuts a step by this policy)

def _gemm(m, n, k, es=2):
    return (2.0 * m * n * k, float(es * (m * k + n * k + m * n)))


def test_command_buffers_cut_by_dispatch_count():
    work = [(0.0, 4096.0)] * 150  # small elementwise dispatches
    sizes = _core.testing.metal_plan_command_buffers(M1, work)
    cap = _core.testing.metal_gpu_policy(M1)["command_buffer"]["max_dispatches"]
    assert sum(sizes) == 150 and max(sizes) == cap and len(sizes) == -(-150 // cap)


def test_command_buffers_cut_by_estimated_work():
    """A W3-sized step (Llama-3-8B layer, T=4096): each command buffer's estimated GPU time stays
    within the policy's budget (plus the one dispatch that crossed it), far below the seconds after
    which macOS ends a command buffer on a display-attached Mac."""
    T, C, F = 4096, 4096, 14336
    step = [_gemm(T, C, C), _gemm(T, F, C), _gemm(T, F, C), _gemm(T, C, F)] * 6
    for gpu in (M1, M3):
        pol = _core.testing.metal_gpu_policy(gpu)["command_buffer"]
        est = [flops / (pol["gflops"]["gemm"] * 1e6) + nbytes / (pol["gbps"] * 1e6) for flops, nbytes in step]
        assert est == pytest.approx([_core.testing.metal_estimate_ms(gpu, f, b, "gemm") for f, b in step])
        sizes = _core.testing.metal_plan_command_buffers(gpu, step)
        assert sum(sizes) == len(step) and len(sizes) > 1
        i = 0
        for s in sizes:
            assert sum(est[i:i + s - 1]) < pol["max_ms"] <= sum(est[i:i + s]) or i + s == len(step)
            i += s
    # A faster family gets longer command buffers for the same work (W2-sized GEMMs).
    w2 = [_gemm(512, 2048, 2048)] * 100
    assert len(_core.testing.metal_plan_command_buffers(M3, w2)) < len(_core.testing.metal_plan_command_buffers(M1, w2))


def test_command_buffer_estimate_is_conservative():
    """The rates assumed are at or below the slowest Mac GPU of the family (an M1 with 7 GPU cores:
    7 x 128 ALUs x 2 flops x 1.278 GHz = 2.29 TFLOP/s f32; 68 GB/s), and each kind of kernel is
    assumed to reach only a fraction of that peak, its own: a real dispatch runs shorter than
    estimated, never longer."""
    pol = _core.testing.metal_gpu_policy(M1)["command_buffer"]
    assert pol["peak_gflops"] <= 2290 and pol["gbps"] <= 68
    rates = pol["gflops"]
    assert rates["memory"] == 0  # its time is its bytes
    assert all(0 < r <= 0.25 * pol["peak_gflops"] for k, r in rates.items() if k != "memory"), rates
    # the tiled quantized form at half the dense GEMM's rate (it ran at 0.62-0.82x on metal-cuda)
    assert rates["quantized_rows"] <= rates["quantized_tiled"] <= rates["gemm"] / 2
    # The per-dispatch budget sits well inside the command buffer's, which is far below the watchdog.
    assert 0 < pol["max_dispatch_ms"] <= pol["max_ms"] / 2 and pol["max_ms"] <= 200
    # At the GEMM kernels' rate a 4096^3 GEMM is ~300 ms on an M1: over the budget of one dispatch,
    # so it is split (next tests); three such dispatches fill three command buffers.
    assert _core.testing.metal_estimate_ms(M1, *_gemm(4096, 4096, 4096), "gemm") > pol["max_ms"]
    assert _core.testing.metal_plan_command_buffers(M1, [_gemm(4096, 4096, 4096)] * 3) == [1, 1, 1]


# ---- one dispatch under the budget: products split into blocks of rows, then columns

# The largest model of each family (hidden C, MLP width F, vocabulary V, attention heads and head
# size), trained at 16,384 tokens a step; the LM head and its loss run in chunks of 1,024 rows
# (python/krnl/models/model.py's ce_chunk).
FAMILIES = {
    "llama-3.1-70b": dict(C=8192, F=28672, V=128256, H=64, Hk=8, D=128),
    "qwen2.5-72b": dict(C=8192, F=29568, V=152064, H=64, Hk=8, D=128),
    "mistral-large-123b": dict(C=12288, F=28672, V=32768, H=96, Hk=8, D=128),
    "gemma-3-27b": dict(C=5376, F=21504, V=262208, H=32, Hk=16, D=128),
    "qwen3-32b": dict(C=5120, F=25600, V=151936, H=64, Hk=8, D=128),
    "phi-3-medium": dict(C=5120, F=17920, V=32064, H=40, Hk=10, D=128),
}
TOKENS, HEAD_CHUNK = 16384, 1024
SLOWEST = M1  # the slowest GPU krnl runs on: Apple7, 7 cores


def _products(f):
    """(name, rows, cols, K) of every frozen product of a training step: each projection forward
    (out = x W^T) and its input gradient (dx = dy W), and the LM head's chunk both ways."""
    C, F, V, D = f["C"], f["F"], f["V"], f["D"]
    q, kv = f["H"] * D, f["Hk"] * D
    out = []
    for name, o, i in (("q", q, C), ("k", kv, C), ("v", kv, C), ("o", C, q), ("gate", F, C), ("up", F, C),
                       ("down", C, F)):
        out += [(name, TOKENS, o, i), (name + ".dx", TOKENS, i, o)]
    return out + [("head", HEAD_CHUNK, V, C), ("head.dx", HEAD_CHUNK, C, V)]


def _check_plan(p, rows, cols, tr, tc, budget):
    assert p["block_ms"] <= budget, p
    assert p["rows"] % tr == 0 or p["rows"] == rows
    assert p["cols"] % tc == 0 or p["cols"] == cols
    # the blocks cover the output, none of them empty
    assert p["row_blocks"] * p["rows"] >= rows > (p["row_blocks"] - 1) * p["rows"]
    assert p["col_blocks"] * p["cols"] >= cols > (p["col_blocks"] - 1) * p["cols"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype_size", [2, 4], ids=["16bit", "f32"])
def test_largest_gemms_fit_the_dispatch_budget(family, dtype_size):
    """Every frozen product of the family's largest model, at 16k tokens, on the slowest GPU: one
    dispatch each would run up to seconds (a 1,024-row chunk of Gemma 3's 262k-entry LM head alone
    is ~2.9 TFLOP, over 6 s at the GEMM rate), so gemm.cpp cuts it into blocks of whole 32x32 tiles,
    each estimated within the per-dispatch budget; few blocks where one suffices."""
    budget = _core.testing.metal_gpu_policy(SLOWEST)["command_buffer"]["max_dispatch_ms"]
    worst = 0.0
    for name, rows, cols, K in _products(FAMILIES[family]):
        es = dtype_size
        p = _core.testing.metal_plan_blocks(SLOWEST, rows, cols, 32, 32, "gemm", 2.0 * K, es * K, es * K, es)
        _check_plan(p, rows, cols, 32, 32, budget)
        worst = max(worst, p["whole_ms"])
        if p["whole_ms"] <= budget:
            assert p["row_blocks"] == p["col_blocks"] == 1, name
        else:
            # no more blocks than needed: merging two would go over the budget (up to the
            # evening out of block sizes, which adds at most one block per dimension)
            n = p["row_blocks"] * p["col_blocks"]
            assert n <= 2 * (p["whole_ms"] / budget) + p["row_blocks"] + p["col_blocks"], (name, p)
    assert worst > 20 * budget  # the shapes do exercise the split


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_largest_quantized_products_fit_the_dispatch_budget(family, bits):
    """The same products with a quantized W (QLoRA, groups of 64 with f16 scale and bias) through
    quantized.metal's tiled form (32x32 tiles), and generation's one-row products through its
    few-row form (8 columns a threadgroup, rows never split): every block within the budget."""
    pol = _core.testing.metal_gpu_policy(SLOWEST)["command_buffer"]
    w_col = lambda K: K * (bits / 8 + 2 * 2 / 64)  # noqa: E731  (codes, scale and bias of W per output)
    for name, rows, cols, K in _products(FAMILIES[family]):
        p = _core.testing.metal_plan_blocks(SLOWEST, rows, cols, 32, 32, "quantized_tiled", 2.0 * K, 2 * K, w_col(K), 2)
        _check_plan(p, rows, cols, 32, 32, pol["max_dispatch_ms"])
        if not name.endswith(".dx"):  # a decode step: one row, the few-row form
            p = _core.testing.metal_plan_blocks(SLOWEST, 1, cols, 1, 8, "quantized_rows", 2.0 * K, 2 * K, w_col(K), 2)
            _check_plan(p, 1, cols, 1, 8, pol["max_dispatch_ms"])


def test_one_tile_over_the_budget_stays_one_block():
    # Nothing smaller than a tile can be dispatched: the planner returns one tile, not zero.
    p = _core.testing.metal_plan_blocks(M1, 64, 64, 32, 32, "gemm", 2.0 * 4096, 0, 0, 0, max_dispatch_ms=1e-9)
    assert (p["rows"], p["cols"], p["row_blocks"], p["col_blocks"]) == (32, 32, 2, 2)
    with pytest.raises(ValueError, match="unknown rate class 'fast'"):
        _core.testing.metal_plan_blocks(M1, 1, 1, 1, 1, "fast", 1.0, 0, 0, 0)


def test_plan_overrides():
    assert _core.testing.metal_plan_command_buffers(M1, [(0.0, 64.0)] * 7, max_dispatches=3) == [3, 3, 1]
    assert _core.testing.metal_plan_command_buffers(M1, [(2e9, 0.0)] * 4, max_ms=1e-9) == [1, 1, 1, 1]


# ---- the same policy on a device: metal-sim standing for an M1, an M2 or an M3

def _bf16_calls(dev):
    """One call per kernel family, each with a bf16 operand or output."""
    b = lambda *shape: dev.empty(shape, "bf16")  # noqa: E731  (zeros would call fill)
    f = lambda *shape: dev.zeros(shape, "f32")  # noqa: E731
    ids = dev.tensor(np.zeros(3, np.int32), "i32")
    return {
        "gemm": lambda: ops.gemm(b(3, 5), b(5, 2), b(3, 2)),
        "rmsnorm_forward": lambda: ops.rmsnorm_forward(b(3, 4), f(4), b(3, 4), f(3), 1e-5),
        "swiglu_forward": lambda: ops.swiglu_forward(b(7), b(7), b(7)),
        "geglu_forward": lambda: ops.geglu_forward(b(7), b(7), b(7)),
        "softcap": lambda: ops.softcap(b(7), 30.0, b(7)),
        "rope": lambda: ops.rope(b(2, 3, 4), ids, f(2), 1.0),
        "softmax_backward": lambda: ops.softmax_backward(b(3, 3), b(3, 3), b(3, 3), 1.0),
        "embedding_forward": lambda: ops.embedding_forward(ids, b(4, 2), b(3, 2)),
        "cross_entropy": lambda: ops.cross_entropy(b(3, 4), ids, f(3)),
        "axpy": lambda: ops.axpy(1.0, b(5), f(5)),
        "cast": lambda: ops.cast(f(5), b(5)),
        "fill": lambda: ops.fill(b(5), 1.0),
        "adamw_update": lambda: ops.adamw_update(f(4), f(4), f(4), f(4), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1.0,
                                                 working=b(4)),
        "nonfinite": lambda: ops.nonfinite(b(5), dev.zeros((1,), "i32")),
    }


@needs_sim
@pytest.mark.parametrize("family", [7, 8])
def test_metal_sim_without_native_bf16_refuses_it(family):
    """As an M1 or M2: no bf16 in the dtypes, f16 the training dtype, and every op family refuses
    bf16 with a one-line error naming the op and why; f16 still runs."""
    with metal_sim_as(family) as dev:
        c = dev.capabilities()
        pol = _core.testing.metal_gpu_policy(dict(apple_family=family))
        assert c["dtypes"] == pol["dtypes_with_bf16_kernels"] == ["f32", "f16"] and c["compute_dtype"] == "f16"
        assert c["details"]["gpu_family"] == f"apple{family}" and c["details"]["bf16"].startswith("emulated")
        for op, call in _bf16_calls(dev).items():
            with pytest.raises(NotImplementedError) as e:
                call()
                dev.synchronize()
            msg = str(e.value)
            assert msg.startswith(f"[{op}] bf16 not implemented on metal-sim: this GPU emulates bf16"), msg
            assert "40x slower than f16" in msg and "\n" not in msg, msg
        x = dev.zeros((5,), "f16")
        ops.fill(x, 1.5)
        np.testing.assert_array_equal(np.array(x.numpy(), np.float32), np.full(5, 1.5, np.float32))


@needs_sim
def test_metal_sim_with_native_bf16_offers_it():
    """As an M3 (the suite's default): bf16 listed and the training dtype, and every op family
    runs it."""
    with metal_sim_as(9) as dev:
        c = dev.capabilities()
        pol = _core.testing.metal_gpu_policy(dict(apple_family=9))
        assert c["dtypes"] == pol["dtypes_with_bf16_kernels"] == ["f32", "f16", "bf16"]
        assert c["compute_dtype"] == pol["compute_dtype_with_bf16_kernels"] == "bf16"
        assert c["details"]["gpu_family"] == "apple9" and c["details"]["bf16"] == "native"
        for op, call in _bf16_calls(dev).items():
            call()  # raises if refused or if the kernel is missing from the library
        dev.synchronize()
        x = dev.zeros((5,), "bf16")
        ops.fill(x, 1.5)
        np.testing.assert_array_equal(np.array(x.numpy(), np.float32), np.full(5, 1.5, np.float32))


@needs_sim
@pytest.mark.parametrize("family", [0, 6, 10])
def test_metal_sim_stands_only_for_known_families(family):
    with pytest.raises(ValueError, match="apple_family must be 7, 8 or 9"):
        _core.testing.metal_sim_set_gpu(family)
    assert krnl.device("metal-sim").capabilities()["details"]["gpu_family"] == "apple9"  # unchanged


def _pairs(T, window):
    return window * (2 * T - window + 1) / 2 if 0 < window < T else T * (T + 1) / 2


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("T,window", [(16384, 0), (32768, 4096)], ids=["causal16k", "window4k-32k"])
def test_largest_attention_fits_the_dispatch_budget(family, T, window):
    """Fused attention of the family's largest model over one 16k sequence (and 32k with a 4k
    sliding window) on the slowest GPU: one head alone is over the budget (~0.3 s forward at 16k),
    so each kernel runs as parts of its grid, one head at a time in ranges of row blocks. The parts
    cover every (head, row) once and add up to the whole kernel's flops; causal ranges shorten
    where rows see more keys."""
    f = FAMILIES[family]
    H, Hk, D = f["H"], f["Hk"], f["D"]
    budget = _core.testing.metal_gpu_policy(SLOWEST)["command_buffer"]["max_dispatch_ms"]
    per_pair = {"forward": 4 * H, "dq": 6 * H, "dkv": 8 * H}  # flops per pair per unit D, all heads
    for kernel in ("forward", "dq", "dkv"):
        heads = Hk if kernel == "dkv" else H
        parts = _core.testing.metal_plan_attention(SLOWEST, kernel, H, Hk, T, D, window)
        assert len(parts) > heads, (kernel, len(parts))
        cover = np.zeros((heads, T), np.int32)
        for p in parts:
            assert p["ms"] <= budget, (kernel, p)
            assert p["row0"] % p["tile"] == 0 and p["rows"] > 0
            cover[p["head0"]:p["head0"] + p["heads"], p["row0"]:p["row0"] + p["rows"]] += 1
        assert (cover == 1).all(), kernel
        assert sum(p["flops"] for p in parts) == pytest.approx(per_pair[kernel] * D * _pairs(T, window), rel=1e-9)
        if window == 0:  # later query rows see more keys: shorter ranges (dkv: the other way round)
            head0 = [p for p in parts if p["head0"] == 0]
            first, last = head0[0]["rows"], head0[-1]["rows"]
            assert (first > last) if kernel != "dkv" else (first < last), (kernel, first, last)


def test_small_attention_is_one_dispatch():
    # A short sequence is one dispatch per kernel; at 4k tokens (Llama-3-8B's heads) whole heads
    # are grouped into a few dispatches.
    for kernel in ("forward", "dq", "dkv"):
        (p,) = _core.testing.metal_plan_attention(M1, kernel, 32, 8, 512, 128)
        assert (p["head0"], p["row0"], p["rows"]) == (0, 0, 512) and p["heads"] == (8 if kernel == "dkv" else 32)
    parts = _core.testing.metal_plan_attention(M1, "forward", 32, 8, 4096, 128)
    assert 1 < len(parts) <= 32 and all(p["rows"] == 4096 for p in parts)  # whole heads grouped
    with pytest.raises(ValueError, match="kernel must be forward, dq or dkv"):
        _core.testing.metal_plan_attention(M1, "dk", 32, 8, 512, 128)
