"""Device.capabilities(), the one answer to "what can this device do": every
device gives every field with its type, each field agrees with what the device then does, the
CPU's values, the model's attention policy taken from it, and no policy derived from a device's
name anywhere in the package, the bench or the test fixtures."""

import re

import numpy as np
import pytest

import krnl
from krnl import ops
from krnl.models.attention import row_blocks

from conftest import FLOAT_DTYPES, ROOT, lora_step, tiny_lora_model

FIELDS = {"kind": str, "dtypes": list, "compute_dtype": str, "fused_attention": dict, "graphs": bool,
          "host_visible": bool, "synchronous": bool, "queue_ordered": bool, "attention_block": int,
          "gemm_tuning": bool, "collectives": list, "lora_fold": bool, "details": dict}


@pytest.mark.parametrize("name", krnl.devices())  # cpu:1 and, where registered, metal-sim included
def test_every_device_answers_every_field(name):
    c = krnl.device(name).capabilities()
    assert set(c) == set(FIELDS), sorted(c)
    for field, typ in FIELDS.items():
        assert type(c[field]) is typ, (field, c[field])
    assert c["kind"] and ":" not in c["kind"]
    assert c["dtypes"] and set(c["dtypes"]) <= set(FLOAT_DTYPES) and len(set(c["dtypes"])) == len(c["dtypes"])
    assert c["compute_dtype"] in c["dtypes"]
    fa = c["fused_attention"]
    assert set(fa) == {"dtypes", "segments", "window", "sinks", "head_dims", "token_major", "workspace"}
    assert all(type(fa[k]) is bool for k in ("segments", "window", "sinks", "token_major"))
    assert type(fa["workspace"]) is list and len(fa["workspace"]) == 2
    assert all(type(n) is int and n >= 0 for n in fa["workspace"])
    assert all(type(D) is int and D > 0 for D in fa["head_dims"])
    assert set(fa["dtypes"]) <= set(c["dtypes"])
    assert c["attention_block"] >= 0
    assert all(type(k) is str and type(v) is str for k, v in c["details"].items())
    # A device that runs each op as it is called runs every access in call order.
    assert c["queue_ordered"] or not c["synchronous"]


def test_cpu_values():
    for name in ("cpu", "cpu:1"):
        c = krnl.device(name).capabilities()
        assert {k: v for k, v in c.items() if k != "details"} == {
            "kind": "cpu", "dtypes": ["f32", "f16", "bf16"], "compute_dtype": "f32",
            "fused_attention": {"dtypes": [], "segments": True, "window": True, "sinks": True, "head_dims": [],
                                "token_major": True, "workspace": [0, 0]},
            "graphs": False, "host_visible": True,
            "synchronous": True, "queue_ordered": True, "attention_block": 128, "gemm_tuning": False,
            "collectives": [], "lora_fold": False}, name
        assert c["details"]["blas"] and int(c["details"]["threads"]) == krnl.num_threads()


def test_unavailable_devices_say_why():
    missing = krnl.unavailable_devices()
    assert all(type(k) is str and type(v) is str for k, v in missing.items())
    assert not set(missing) & set(krnl.devices())
    for name, reason in missing.items():
        assert reason.strip() and "\n" not in reason, (name, reason)


# ---- each field against what the device does (the `dev` fixture: every device, metal-sim too)


def test_host_visible_is_what_from_numpy_does(dev):
    a = np.zeros(4, np.float32)
    if not dev.capabilities()["host_visible"]:
        with pytest.raises(ValueError, match="not host-visible"):
            dev.from_numpy(a)
        return
    t = dev.from_numpy(a)
    ops.fill(t, 3.0)
    dev.synchronize()
    assert a.tolist() == [3.0] * 4, "a host-visible device's from_numpy must be a view"


def test_synchronous_ops_complete_when_they_return(dev):
    c = dev.capabilities()
    if not c["synchronous"]:
        pytest.skip(f"{dev.name} queues its ops (capabilities: synchronous False)")
    if not c["host_visible"]:
        pytest.skip(f"{dev.name}: only a host-visible view shows an op's result without a wait")
    a = np.zeros(5, np.float32)
    t = dev.from_numpy(a)
    with dev.step():
        ops.fill(t, 2.0)
        assert a.tolist() == [2.0] * 5, "an op inside a step had not run when it returned"
    assert dev.completed_seq == dev.last_committed, "a committed step had not completed"
    ops.scale(t, 3.0, t)
    assert a.tolist() == [6.0] * 5, "an op outside a step had not run when it returned"


def test_graphs_is_what_capture_does(dev):
    x = dev.zeros((8,), "f32")
    if not dev.capabilities()["graphs"]:
        with pytest.raises(NotImplementedError):
            dev.capture(lambda: ops.scale(x, 2.0, x))
        return
    ops.fill(x, 1.0)
    g = dev.capture(lambda: ops.scale(x, 2.0, x))  # the warm-up doubles x once
    g.replay()
    dev.synchronize()
    assert x.numpy().tolist() == [4.0] * 8
    g.release()


def test_dtypes_are_the_dtypes_with_kernels(dev):
    """Every listed dtype runs (a fill, a GEMM, a cast to f32); an unlisted float dtype is refused
    by the first op that needs its kernels, so the list cannot claim too little either."""
    have = dev.capabilities()["dtypes"]
    rng = np.random.default_rng(3)
    a, b = rng.integers(-3, 4, (5, 7)).astype(np.float32), rng.integers(-3, 4, (7, 6)).astype(np.float32)
    for dt in FLOAT_DTYPES:
        t = dev.empty((4,), dt)
        if dt not in have:
            with pytest.raises(NotImplementedError, match=dt):
                ops.fill(t, 1.0)
                dev.synchronize()
            continue
        ops.fill(t, 1.5)
        c, out = dev.empty((5, 6), dt), dev.empty((5, 6), "f32")
        ops.gemm(dev.tensor(a, dt), dev.tensor(b, dt), c)  # small integers: exact in every dtype
        ops.cast(c, out)
        np.testing.assert_array_equal(np.asarray(t.numpy(), np.float32), [1.5] * 4, err_msg=dt)
        np.testing.assert_array_equal(out.numpy(), a @ b, err_msg=dt)


def test_fused_attention_dtypes_run_the_fused_ops(dev):
    fused = dev.capabilities()["fused_attention"]["dtypes"]
    if not fused:
        pytest.skip(f"{dev.name} lists no fused attention dtype")
    for dt in fused:
        q = dev.tensor(np.random.default_rng(0).standard_normal((2, 9, 64)).astype(np.float32), dt)
        o, lse = dev.empty((2, 9, 64), dt), dev.empty((2, 9), "f32")
        ops.attention_forward(q, q, q, o, lse, 0.125)
        dev.synchronize()
        assert np.all(np.isfinite(np.asarray(o.numpy(), np.float32))), dt


# ---- the model's attention policy is the device's answer


REAL_CAPABILITIES = krnl.Device.capabilities


def _with_capabilities(monkeypatch, **fields):
    """Makes every Device answer its real capabilities with `fields` replaced (for this test)."""
    real = REAL_CAPABILITIES

    def fake(d):
        c = real(d)
        c.update(fields)
        return c

    monkeypatch.setattr(krnl.Device, "capabilities", fake)


FUSED_F32 = {"dtypes": ["f32"], "segments": False, "window": False, "sinks": False, "head_dims": [],
             "token_major": True, "workspace": [0, 0]}


def test_model_takes_attention_policy_from_capabilities(monkeypatch):
    """A CPU that claims fused f32 attention and query blocks of 4 rows gets a model that takes
    ops.attention_forward/backward (the CPU has them as reference loops) and splits the
    materialised path into blocks of 4; attention_block 0 means one block. Same loss either way."""
    dev = krnl.device("cpu")
    rng = np.random.default_rng(5)
    ids, targets = rng.integers(0, 61, (2, 11)), rng.integers(0, 61, (2, 11))

    def step_ops(m):
        krnl._core.clear_profile(dev)
        with krnl.profile(dev) as prof:
            loss, _ = lora_step(m, ids, targets)
        return loss, [r["op"] for r in prof.records]

    plain = tiny_lora_model(dev, "f32")
    assert (plain.fused_attention, plain.attn_block) == (False, 128)
    loss_plain, plain_ops = step_ops(plain)
    assert "attention_forward" not in plain_ops

    _with_capabilities(monkeypatch, fused_attention=FUSED_F32, attention_block=4)
    fused = tiny_lora_model(dev, "f32")
    assert fused.fused_attention and fused.attn_block == 4
    assert not tiny_lora_model(dev, "bf16").fused_attention  # fused in the listed dtypes only
    loss_fused, fused_ops = step_ops(fused)
    assert {"attention_forward", "attention_backward"} <= set(fused_ops) and "softmax_causal_forward" not in fused_ops
    assert "transpose_heads" not in fused_ops  # token-major: q, k and v stay columns of the projection
    fused.fused_attention = False  # the materialised path, now in blocks of 4 rows: 0:4, 4:8, 8:11
    assert row_blocks(11, fused.attn_block) == [(0, 4), (4, 8), (8, 11)]
    loss_blocks, block_ops = step_ops(fused)
    per_step = 2 * fused.config.num_hidden_layers  # batches of 2 rows, one softmax per block per layer and row
    assert block_ops.count("softmax_causal_forward") == 3 * per_step

    _with_capabilities(monkeypatch, attention_block=0)
    whole = tiny_lora_model(dev, "f32")
    assert whole.attn_block == 0 and row_blocks(4096, whole.attn_block) == [(0, 4096)]
    loss_whole, whole_ops = step_ops(whole)
    assert whole_ops.count("softmax_causal_forward") == per_step
    for other in (loss_fused, loss_blocks, loss_whole):
        assert other == pytest.approx(loss_plain, rel=1e-5)


def _attention_ops(m, ids, targets, **kw):
    """(loss, the ops of one forward/backward with packed rows or positions in kw)."""
    krnl._core.clear_profile(m.dev)
    with krnl.profile(m.dev) as prof:
        m.lora_params.zero_grads()
        m.forward_backward(ids, targets, **kw)
        m.dev.synchronize()
    return m.read_loss(), [r["op"] for r in prof.records]


def test_model_takes_packed_rows_fused_where_listed(monkeypatch):
    """Packed rows take the fused op where the capabilities list segments (the CPU's reference
    loops take them), else the materialised path; same loss; a head size outside the listed ones
    keeps the materialised path."""
    dev = krnl.device("cpu")
    rng = np.random.default_rng(6)
    ids, targets = rng.integers(0, 61, (2, 11)), rng.integers(0, 61, (2, 11))
    seg = np.array([[0] * 4 + [1] * 7, [0] * 2 + [1] * 6 + [2] * 3], np.int32)
    pos = np.concatenate([np.arange(4), np.arange(7)])[None].repeat(2, 0)
    pos[1] = np.concatenate([np.arange(2), np.arange(6), np.arange(3)])
    kw = {"segments": seg, "positions": pos}
    losses = {}
    for segments in (False, True):
        _with_capabilities(monkeypatch, fused_attention={**FUSED_F32, "segments": segments})
        m = tiny_lora_model(dev, "f32")
        losses[segments], names = _attention_ops(m, ids, targets, **kw)
        assert ("attention_forward" in names) == segments and ("softmax_causal_forward" in names) != segments
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    head_dim = tiny_lora_model(dev, "f32").config.head_dim
    _with_capabilities(monkeypatch, fused_attention={**FUSED_F32, "head_dims": [head_dim + 8]})
    assert not tiny_lora_model(dev, "f32").fused_attention


def test_model_sliding_window_on_both_paths(monkeypatch):
    """Rows longer than the config's sliding window take the fused op where it lists the window
    and the materialised softmax's window elsewhere: the same loss and LoRA gradients on both,
    unlike the unwindowed model's; KV-cached generation keeps the window too (its tokens equal a
    full forward's greedy choice at every step)."""
    from conftest import lora_step
    dev = krnl.device("cpu")
    rng = np.random.default_rng(8)
    ids, targets = rng.integers(0, 61, (2, 11)), rng.integers(0, 61, (2, 11))
    wide = tiny_lora_model(dev, "f32")
    loss_wide, _ = _attention_ops(wide, ids, targets)
    mat = tiny_lora_model(dev, "f32", model_type="mistral", sliding_window=4)
    loss_mat, names = _attention_ops(mat, ids, targets)
    assert "softmax_causal_forward" in names and "attention_forward" not in names
    assert loss_mat != pytest.approx(loss_wide, rel=1e-4)
    _with_capabilities(monkeypatch, fused_attention={**FUSED_F32, "window": True})
    fused = tiny_lora_model(dev, "f32", model_type="mistral", sliding_window=4)
    loss_fused, names = _attention_ops(fused, ids, targets)
    assert "attention_forward" in names and loss_fused == pytest.approx(loss_mat, rel=1e-5)
    (lm, gm), (lf, gf) = lora_step(mat, ids, targets), lora_step(fused, ids, targets)
    assert lm == pytest.approx(lf, rel=1e-5)
    for k in gm:
        np.testing.assert_allclose(gm[k], gf[k], rtol=1e-4, atol=1e-5 * np.abs(gm[k]).max(), err_msg=k)
    prompt = [int(t) for t in ids[0, :6]]
    got = mat.generate(prompt, max_new_tokens=5)
    seq = list(prompt)
    for _ in range(5):  # greedy from the full (windowed) forward of the whole sequence
        seq.append(int(np.argmax(mat.logits(np.array([seq]))[0, -1])))
    assert got == seq[len(prompt):]


# ---- no policy from a device's name

# Name-derived policy as it was written before capabilities(): splitting a name into its kind,
# comparing a name with a backend's, membership in a literal tuple of backend names (of anything:
# a set of kinds read from capabilities()["kind"] gets a name, as bench's GPU_KINDS), tables keyed
# by backend names. A grep, not a proof: a name carried in another variable and compared later
# passes it; the patterns are the forms this code had (test_the_name_check_sees_what_it_forbids).
NAME = r"(\.name\b|\bdevice_name\b|\bdev_name\b)"  # a device's name (not a tensor's or a file's local `name`)
PATTERNS = [
    NAME + r"\.(split|rsplit|partition|rpartition|startswith)\(", r"\.split\(\":\"\)",
    NAME + r"\s*[!=]=\s*[\"'](cpu|cuda|metal)",
    r"[\"'](cpu|cuda|metal)[\w:-]*[\"']\s*[!=]=\s*[\w.]*" + NAME,
    r"[\w)]\s+(not\s+)?in\s+\(\s*[\"'](cpu|cuda|metal)",
    r"\{\s*[\"'](cpu|cuda|metal)[\"']\s*:.*\}\.get\(",
]
# The lines that match a pattern above but choose no device's behaviour: (path, line), and why.
ALLOWED = {
    # the `dev` fixture's device list: which devices to test (the test devices by name), not what
    # any of them can do
    ("tests/conftest.py", 'DEVICES = [d for d in krnl.devices() if d not in ("cpu:1", "metal-sim")]'),
}


def _policy_sources():
    files = sorted((ROOT / "python" / "krnl").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
    return files + [ROOT / "tests" / "conftest.py"]


def test_no_policy_from_device_names():
    hits = []
    for path in _policy_sources():
        rel = path.relative_to(ROOT).as_posix()
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(re.search(p, code) for p in PATTERNS) and (rel, code.strip()) not in ALLOWED:
                hits.append(f"{rel}:{i}: {line.strip()}")
    assert not hits, "device policy derived from a name (read Device.capabilities() instead):\n" + "\n".join(hits)


def test_the_name_check_sees_what_it_forbids():
    """The patterns catch each form the code had before capabilities(), and each allowed line
    exists and matches a pattern (a stale entry would excuse nothing but say something false)."""
    before = ['self.attn_block = {"cpu": 128, "cuda": 1024}.get(device.name.split(":")[0], 1 << 30)',
              "    return device_name.split(\":\")[0]",
              'if dev.name == "metal-sim" and d in SIM_DTYPES_ABSENT',
              'if dev.name.split(":")[0] != "cpu" and not dev.fused_attention(dt):',
              'if name in ("cuda", "metal"):',
              '    return kind(device_name) in ("cuda", "metal")']
    for line in before:
        assert any(re.search(p, line) for p in PATTERNS), line
    sources = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in _policy_sources()}
    for rel, code in ALLOWED:
        assert code in sources[rel], (rel, code)
        assert any(re.search(p, code) for p in PATTERNS), (rel, code)  # else the entry excuses nothing
