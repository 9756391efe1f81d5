"""Shared test helpers: the `dev` fixture (every device this build has), per-dtype rounding
constants and tolerances, upload/read-back helpers and host-side (numpy) conversions that the
float64 oracles use. Op-specific oracles live next to their tests."""

import contextlib
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import krnl

# A second CPU device ("cpu:1") exists only for the cross-device error tests.
krnl._core.testing.register_second_cpu()

FLOAT_DTYPES = ("f32", "f16", "bf16")

# Unit roundoff (half an ulp of 1.0): the largest relative error of one round-to-nearest into
# the dtype. f32 has 24 significant bits, f16 11, bf16 8.
UNIT_ROUNDOFF = {"f32": 2.0**-24, "f16": 2.0**-11, "bf16": 2.0**-8}
U32 = UNIT_ROUNDOFF["f32"]

# Spacing of the subnormals: the absolute error of one rounding near zero (f16 underflows at
# 6e-5, far earlier than f32/bf16, which share the f32 exponent range).
SUBNORMAL = {"f32": 2.0**-149, "f16": 2.0**-24, "bf16": 2.0**-133}

# Relative tolerance of an op that computes in f32 and rounds its output once into `dtype`:
# one output rounding plus a handful of f32 operations (16 * 2^-24 ~ 1e-6) of slack.
OUT_RTOL = {dt: UNIT_ROUNDOFF[dt] + 16 * U32 for dt in FLOAT_DTYPES}


ROOT = Path(__file__).resolve().parents[1]

# The metal-sim device: the Metal backend's dispatch records executed by tools/mslsim (docs/architecture.md,
# 'How Metal is tested without a Mac'). Registered here, for the tests only; KRNL_TEST_METAL_SIM=0 turns it off.
METAL_SIM = None
# The GPU metal-sim stands for in the suite: Apple9 (M3), native bf16, so that the bf16 kernels run
# and the bf16 cases of the op suite are not skipped; metal_sim_as() switches for a test.
METAL_SIM_FAMILY = 9
if os.environ.get("KRNL_TEST_METAL_SIM", "1") != "0":
    sys.path.insert(0, str(ROOT / "tools" / "mslsim"))
    import mslsim.metal_sim  # noqa: E402

    if mslsim.metal_sim.available():
        # random thread order everywhere: every op test is also a race test of its kernels
        METAL_SIM = mslsim.metal_sim.register(krnl._core, ROOT, random_order=True)
        krnl._core.testing.metal_sim_set_gpu(METAL_SIM_FAMILY)

# The metal-cuda device: the same records and the unmodified kernels run on an NVIDIA GPU by
# tools/mslcuda (tools/device/h200_check.sh metal-cuda). Only when asked for, never by default and
# never in CI; once registered it is one of DEVICES, so every module's `dev` tests run on it, the
# model's too. Asked for where it cannot run, registration fails loudly instead of skipping.
METAL_CUDA = None
if os.environ.get("KRNL_TEST_METAL_CUDA", "0") == "1":
    sys.path.insert(0, str(ROOT / "tools" / "mslcuda"))
    import mslcuda.metal_cuda  # noqa: E402

    METAL_CUDA = mslcuda.metal_cuda.register(krnl._core, ROOT)

# Which devices the `dev` fixture runs on (the test devices by name: which to test, not what
# they can do, which their capabilities() say).
DEVICES = [d for d in krnl.devices() if d not in ("cpu:1", "metal-sim")]
# Test modules whose `dev` tests also run on metal-sim: the op suite. Model-level tests would
# take minutes per case on the simulator; test_metal_sim.py runs one training step there instead.
SIM_MODULES = {"test_ops", "test_moe_ops", "test_gemm", "test_metal_sim", "test_capabilities", "test_quantized", "test_lora_group",
               "test_mxfp4", "test_optim_ops"}
# KRNL_TEST_METAL_SIM_OPS=0: the op suite skips metal-sim (test_metal_sim's `dev` tests and the
# model-level metal-sim tests still run), for a run whose kernels another run has checked already
# (CI's wheel stage: the same metal/*.metal as its stage 1).
if os.environ.get("KRNL_TEST_METAL_SIM_OPS", "1") == "0":
    SIM_MODULES = {"test_metal_sim"}


def pytest_generate_tests(metafunc):
    if "dev" in metafunc.fixturenames:
        names = list(DEVICES)
        if METAL_SIM is not None and metafunc.module.__name__.rpartition(".")[2] in SIM_MODULES:
            names.append("metal-sim")
        metafunc.parametrize("dev", names, indirect=True)


def _names_dtype(text, dtype):
    """Whether `text` (a parameter or a test name) names `dtype` as a word: 'bf16' names bf16,
    not f16."""
    return re.search(rf"(?<![a-z0-9]){dtype}(?![a-z0-9])", text) is not None


def pytest_collection_modifyitems(config, items):
    # A test of a float dtype the device has no kernels for (its capabilities' dtypes: Metal on a
    # GPU without native bf16 offers none) is skipped, saying so; every other test runs.
    dtypes = {}
    for item in items:
        cs = getattr(item, "callspec", None)
        name = cs.params.get("dev") if cs else None
        if name is None:
            continue
        if name not in dtypes:
            dtypes[name] = krnl.device(name).capabilities()["dtypes"]
        values = [v for k, v in cs.params.items() if k != "dev" and isinstance(v, str)] + [item.originalname]
        absent = [dt for dt in FLOAT_DTYPES if dt not in dtypes[name] and any(_names_dtype(v, dt) for v in values)]
        if absent:
            item.add_marker(pytest.mark.skip(reason=f"{name} has no {'/'.join(absent)} kernels (its capabilities' "
                                                    f"dtypes: {', '.join(dtypes[name])})"))


@contextlib.contextmanager
def dispatch_budget(dev, ms):
    """A Metal device's per-dispatch budget (estimated ms, csrc/metal/policy.h) set to `ms` for the
    block, then restored."""
    old = krnl._core.testing.metal_command_buffer_policy(dev)
    krnl._core.testing.metal_set_command_buffer_policy(dev, old["max_dispatches"], old["max_ms"], ms)
    try:
        yield
    finally:
        krnl._core.testing.metal_set_command_buffer_policy(dev, old["max_dispatches"], old["max_ms"],
                                                          old["max_dispatch_ms"])


@contextlib.contextmanager
def metal_sim_as(apple_family):
    """metal-sim standing for an Apple GPU of that family for the block (its capabilities and bf16
    policy follow), then for the suite's Apple9 again (native bf16: every kernel runs)."""
    krnl._core.testing.metal_sim_set_gpu(apple_family)
    try:
        yield krnl.device("metal-sim")
    finally:
        krnl._core.testing.metal_sim_set_gpu(METAL_SIM_FAMILY)


def device_dtypes(dev):
    """The float dtypes `dev` has kernels for (its capabilities' dtypes), in FLOAT_DTYPES order."""
    have = dev.capabilities()["dtypes"]
    return tuple(d for d in FLOAT_DTYPES if d in have)


def attention_ops_missing(dev, dtype, head_dim=None):
    """Why ops.attention_forward cannot run on `dev` in `dtype` at head size `head_dim` (the
    backend's NotImplementedError), or None where it runs. The fused ops exist where the
    capabilities list the dtype and the head size (the model takes them there: no probe may hide
    their absence) and may exist elsewhere as a reference (the CPU's loops, every dtype), which
    only trying one tells."""
    fa = dev.capabilities()["fused_attention"]
    if head_dim is not None and fa["head_dims"] and head_dim not in fa["head_dims"]:
        return f"head size {head_dim} is not among the fused kernels' {fa['head_dims']}"
    if dtype in fa["dtypes"]:
        return None
    q = dev.zeros((1, 1, 8), dtype)
    try:
        krnl.ops.attention_forward(q, q, q, dev.empty((1, 1, 8), dtype), dev.empty((1, 1), "f32"), 1.0)
        dev.synchronize()
    except NotImplementedError as e:
        return str(e)
    return None


@pytest.fixture
def dev(request):
    """Each device this build can use ('cpu' everywhere), plus 'metal-sim' in SIM_MODULES."""
    return krnl.device(request.param)


def to_dev(dev, array, dtype="f32"):
    """A new tensor of `dtype` ('f32', 'f16', 'bf16', 'i32') on `dev` holding `array`."""
    return dev.tensor(np.asarray(array), dtype)


def read(t, dtype=np.float64):
    """A host copy of tensor `t` (bf16 and f16 widen exactly), float64 unless told otherwise."""
    return np.array(t.numpy(), dtype=dtype, copy=True)


def upload(dev, array, dtype="f32"):
    """(tensor, float64 copy of what the device holds): the oracle then sees exactly the inputs
    the op sees, rounded to `dtype`."""
    t = to_dev(dev, np.asarray(array, dtype=np.float32), dtype)
    return t, read(t)


def empty_filled(dev, shape, dtype, value=np.nan):
    """An output tensor prefilled with `value` (NaN by default), so that an op that leaves any
    element unwritten, or reads an output it should only write, shows up."""
    t = dev.empty(tuple(shape), dtype)
    krnl.ops.fill(t, float(value))
    return t


def bf16_bits(x):
    """float32 -> bfloat16 bits with round-to-nearest-even on the uint32 pattern (NaN -> quiet
    NaN), the reference for the device's bf16 conversion."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def bf16_value(bits):
    """bfloat16 bits -> float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def round_to(x, dtype):
    """x (float32-representable values) rounded to `dtype` with round-to-nearest-even, as float64."""
    x32 = np.asarray(x, dtype=np.float32)
    if dtype == "f32":
        return x32.astype(np.float64)
    if dtype == "f16":
        return x32.astype(np.float16).astype(np.float64)
    if dtype == "bf16":
        return bf16_value(bf16_bits(x32)).astype(np.float64)
    raise ValueError(dtype)


def assert_close(got, ref, rtol, atol=0.0, what=""):
    """max|got - ref| <= atol + rtol * max|ref|: error judged against the output's magnitude."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite output at {np.argwhere(~np.isfinite(got))[:5].tolist()}"
    err = np.abs(got - ref)
    bound = atol + rtol * (float(np.max(np.abs(ref))) if ref.size else 0.0)
    worst = float(np.max(err)) if err.size else 0.0
    assert worst <= bound, (f"{what}: max error {worst:.3e} > bound {bound:.3e} at "
                            f"{np.unravel_index(np.argmax(err), err.shape)} (rtol {rtol:.2e}, atol {atol:.2e})")


def assert_close_elementwise(got, ref, rtol, atol=0.0, what=""):
    """|got - ref| <= atol + rtol * |ref| for every element (atol may be an array)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite output at {np.argwhere(~np.isfinite(got))[:5].tolist()}"
    err = np.abs(got - ref)
    bound = atol + rtol * np.abs(ref)
    bad = err > bound
    if np.any(bad):
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        pytest.fail(f"{what}: {int(bad.sum())} of {err.size} elements out of tolerance; worst at {i}: "
                    f"got {got[i]!r} ref {ref[i]!r} (err {err[i]:.3e} > {np.broadcast_to(bound, err.shape)[i]:.3e})")


# ---- a tiny HF model folder (test_newcomer.py, test_quantized.py)

HF_VOCAB = 32


@pytest.fixture
def hf_folder(tmp_path):
    return write_hf_folder(tmp_path)


def write_hf_folder(tmp_path):
    """A tiny random Llama HF folder (in-features multiples of 32, so it also quantizes): config.json,
    model.safetensors, a word-level tokenizer of HF_VOCAB tokens ("</s>", "w1" .. "w31")."""
    tokenizers = pytest.importorskip("tokenizers")
    import json

    from safetensors.numpy import save_file

    from krnl.models.config import ModelConfig, random_weights

    folder = tmp_path / "base"
    folder.mkdir()
    cfg = dict(model_type="llama", vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
               tie_word_embeddings=False)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(random_weights(ModelConfig.from_dict(cfg), seed=3), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    vocab = {"</s>": 0, **{f"w{i}": i for i in range(1, HF_VOCAB)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="</s>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tk.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder



# ---- the tiny Llama of the device-level training checks (test_metal_sim.py, test_cuda.py)

TINY_LLAMA = dict(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0)


def tiny_lora_model(dev, dtype, seed=0, grad_checkpoint=False, weights=None, quantize=None, **config):
    """The tiny Llama (GQA, RoPE, SwiGLU, tied head; `config` overrides TINY_LLAMA's fields) with
    LoRA r=2 on every projection, B non-zero so that every LoRA path carries gradient; `weights`
    replace its random ones, `quantize` = (bits, group_size) holds its projections quantized."""
    from krnl.models.model import LlamaModel
    from krnl.models.config import LoraConfig, ModelConfig, random_weights

    cfg = ModelConfig.from_dict({**TINY_LLAMA, **config})
    weights = weights if weights is not None else random_weights(cfg, seed, std=0.2)
    m = LlamaModel(dev, cfg, weights, LoraConfig(r=2, alpha=4.0), dtype=dtype, seed=seed,
                   grad_checkpoint=grad_checkpoint, quantize=quantize)
    rng = np.random.default_rng(seed + 1)
    lora = m.lora_state()
    for k in lora:
        if ".lora_B." in k:
            lora[k] = (0.1 * rng.standard_normal(lora[k].shape)).astype(np.float32)
    m.lora_params.load(lora)
    return m


def lora_step(m, ids, targets):
    """(loss, {name: float64 LoRA gradient}) of one forward/backward from zeroed gradients."""
    m.lora_params.zero_grads()
    m.forward_backward(ids, targets)
    m.dev.synchronize()
    return m.read_loss(), {k: np.array(g.numpy(), np.float64) for k, g in m._lora_grads().items()}


def check_step_against_cpu(dev, dtype, tol):
    """Loss and every LoRA gradient of one step of the tiny model on `dev` in `dtype` against the
    CPU backend in f32: loss within tol (relative), each gradient within 4 tol of its largest value."""
    rng = np.random.default_rng(7)
    ids, targets = rng.integers(0, 61, (2, 9)), rng.integers(0, 61, (2, 9))
    loss_c, g_c = lora_step(tiny_lora_model(krnl.device("cpu"), "f32"), ids, targets)
    assert_step_close((loss_c, g_c), lora_step(tiny_lora_model(dev, dtype), ids, targets), tol, 4 * tol)


def assert_step_close(ref, got, loss_tol, grad_tol):
    """(loss, {name: gradient}) of a step against a reference step: the loss within loss_tol
    (relative), each gradient within grad_tol of its largest reference value."""
    (loss_r, g_r), (loss, g) = ref, got
    assert abs(loss - loss_r) <= loss_tol * abs(loss_r), (loss, loss_r)
    assert g_r.keys() == g.keys()
    for k in g_r:
        scale = float(np.max(np.abs(g_r[k])))
        assert scale > 0, k
        err = float(np.max(np.abs(g[k] - g_r[k])))
        assert err <= grad_tol * scale, f"{k}: {err:.3e} > {grad_tol * scale:.3e}"


def check_training_reduces_loss(dev, dtype, grad_checkpoint=False):
    """Four AdamW steps on a fixed batch lower the loss; the base weights stay bit-identical."""
    from krnl.train.optim import AdamW, Schedule

    m = tiny_lora_model(dev, dtype, grad_checkpoint=grad_checkpoint)
    rng = np.random.default_rng(3)
    ids, targets = rng.integers(0, 61, (2, 9)), rng.integers(0, 61, (2, 9))
    w0 = read(m.head)
    opt = AdamW(m.lora_params, Schedule(3e-2, kind="constant"))
    losses = []
    for _ in range(4):
        loss, _ = lora_step(m, ids, targets)
        losses.append(loss)
        opt.step()
        dev.synchronize()
    assert losses[-1] < losses[0] - 0.05, losses
    np.testing.assert_array_equal(read(m.head), w0)


# ---- metal-sim time per test module, printed at the end of the run (CI's budget is watched there)

# Modules that run MSL kernels on the simulator directly (not through the `dev` fixture).
_SIM_KERNEL_MODULES = re.compile(r"test_(mslsim|metal_kernels\w*)$")
_sim_seconds: dict = {}


def _runs_on_metal_sim(item):
    cs = getattr(item, "callspec", None)
    module = item.module.__name__.rpartition(".")[2]
    return ((cs is not None and cs.params.get("dev") == "metal-sim") or "sim" in item.fixturenames
            or _SIM_KERNEL_MODULES.match(module) is not None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0 = time.perf_counter()
    yield
    if _runs_on_metal_sim(item):
        module = item.module.__name__.rpartition(".")[2]
        n, s = _sim_seconds.get(module, (0, 0.0))
        _sim_seconds[module] = (n + 1, s + time.perf_counter() - t0)


def pytest_terminal_summary(terminalreporter):
    if not _sim_seconds:
        return
    tr = terminalreporter
    tr.section("metal-sim time per test module")
    for module, (n, s) in sorted(_sim_seconds.items(), key=lambda kv: -kv[1][1]):
        tr.write_line(f"{module:40s} {n:5d} tests {s:8.1f} s")
    tr.write_line(f"{'total':40s} {sum(n for n, _ in _sim_seconds.values()):5d} tests "
                  f"{sum(s for _, s in _sim_seconds.values()):8.1f} s")
