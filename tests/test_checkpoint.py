"""krnl.io.checkpoint: round trip (with a real AdamW state, resumed bit-identically), atomicity
under a crash mid-write, fingerprint mismatch, corrupt and missing files named, keep-last-K."""

import json
import os

import numpy as np
import pytest

import krnl
import krnl.io.checkpoint as ckpt_mod
from krnl.io.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from krnl.train.optim import AdamW, Schedule
from krnl.models.params import FlatParams

SHAPES = {"layers.0.q.A": (4, 32), "layers.0.q.B": (32, 4)}
FINGERPRINT = {"model": {"hidden_size": 32, "num_layers": 1, "vocab_size": 100},
               "lora": {"rank": 4, "alpha": 8.0, "targets": ["q"]},
               "params": {k: list(v) for k, v in SHAPES.items()}}


def parts(step, seed=0):
    rng = np.random.default_rng(seed)
    adapter = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    opt = {"m": rng.standard_normal(256).astype(np.float32), "v": rng.random(256).astype(np.float32),
           "step": step, "schedule": {"lr": 1e-3, "kind": "cosine"}, "hyper": {"betas": [0.9, 0.999]}}
    gen = np.random.default_rng(seed + 1)
    trainer = {"step": step, "data": {"epoch": 1, "index": 37 * step}, "rng": gen.bit_generator.state}
    return adapter, opt, trainer


def save(root, step, seed=0, **kw):
    adapter, opt, trainer = parts(step, seed)
    return save_checkpoint(root, adapter=adapter, optimizer_state=opt, trainer_state=trainer,
                           model_fingerprint=FINGERPRINT, **kw)


def test_round_trip(tmp_path):
    root = str(tmp_path / "ckpt")
    path = save(root, 10)
    assert os.path.basename(path) == "step-00000010"
    adapter, opt, trainer = parts(10)
    for where in (root, path):  # the root resolves `latest`
        c = load_checkpoint(where, expected_fingerprint=FINGERPRINT)
        assert c.path == path and c.step == 10
        assert set(c.adapter) == set(adapter)
        for k in adapter:
            assert c.adapter[k].dtype == np.float32 and np.array_equal(c.adapter[k], adapter[k])
        assert np.array_equal(c.optimizer_state["m"], opt["m"]) and np.array_equal(c.optimizer_state["v"], opt["v"])
        assert c.optimizer_state["step"] == 10 and c.optimizer_state["hyper"] == {"betas": [0.9, 0.999]}
        assert c.trainer_state == json.loads(json.dumps(trainer))
    # The RNG state restores the exact stream.
    g = np.random.default_rng()
    g.bit_generator.state = load_checkpoint(root).trainer_state["rng"]
    ref = np.random.default_rng(1)
    assert np.array_equal(g.random(5), ref.random(5))
    assert not [e for e in os.listdir(root) if e.startswith(".")], "temporary files left behind"


def test_resume_continues_exactly(tmp_path, dev):
    rng = np.random.default_rng(5)

    def run(flat, opt, grads):
        for g in grads:
            krnl.ops.cast(flat.device.tensor(np.asarray(g, np.float32), "f32"), flat.grads[:flat.numel])
            opt.step()

    sched = dict(lr=1e-2, warmup_steps=2, total_steps=10)
    fa = FlatParams(dev, SHAPES)
    fa.load({k: rng.standard_normal(s) for k, s in SHAPES.items()})
    a = AdamW(fa, Schedule(**sched), weight_decay=0.01, max_grad_norm=0.5)
    grads = [rng.standard_normal(fa.numel).astype(np.float32) for _ in range(8)]
    run(fa, a, grads[:3])
    save_checkpoint(str(tmp_path), adapter=fa.state(), optimizer_state=a.state_dict(),
                    trainer_state={"step": a.iteration}, model_fingerprint=FINGERPRINT)
    run(fa, a, grads[3:])

    c = load_checkpoint(str(tmp_path), expected_fingerprint=FINGERPRINT)
    fb = FlatParams(dev, SHAPES)
    fb.load(c.adapter)
    b = AdamW(fb, Schedule(**sched))
    b.load_state_dict(c.optimizer_state)
    assert b.iteration == c.trainer_state["step"] == 3
    run(fb, b, grads[3:])
    assert np.array_equal(fa.params.numpy(), fb.params.numpy())
    assert np.array_equal(a.m.numpy(), b.m.numpy()) and np.array_equal(a.v.numpy(), b.v.numpy())


@pytest.mark.parametrize("crash_at", ["tensor_writer", "rename_dir", "latest"])
def test_crash_while_writing_keeps_previous(tmp_path, monkeypatch, crash_at):
    root = str(tmp_path)
    first = save(root, 1)
    real_write, real_replace = ckpt_mod._write_bytes, os.replace
    calls = {"n": 0}

    def bad_write(path, data):
        calls["n"] += 1
        if calls["n"] == 2:  # second file: adapter written, optimizer half-written
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            raise OSError("disk full (simulated)")
        real_write(path, data)

    def bad_replace(src, dst):
        is_latest = os.path.basename(dst) == "latest"
        if (crash_at == "latest") == is_latest:
            raise OSError("power cut (simulated)")
        real_replace(src, dst)

    if crash_at == "tensor_writer":
        monkeypatch.setattr(ckpt_mod, "_write_bytes", bad_write)
    else:
        monkeypatch.setattr(ckpt_mod.os, "replace", bad_replace)
    with pytest.raises(OSError, match="simulated"):
        save(root, 2, seed=7)
    monkeypatch.undo()

    c = load_checkpoint(root, expected_fingerprint=FINGERPRINT)
    if crash_at == "latest":
        # The new directory was complete when `latest` failed to move: still the old pointer.
        assert c.path == first
    else:
        assert c.path == first and c.step == 1
        assert [s for s, _ in list_checkpoints(root)] == [1], "a partial directory counts as a checkpoint"
    assert np.array_equal(c.adapter["layers.0.q.A"], parts(1)[0]["layers.0.q.A"])
    assert open(os.path.join(root, "latest")).read().strip() == "step-00000001"
    # The next save cleans up and succeeds.
    save(root, 3)
    assert load_checkpoint(root).step == 3
    assert not [e for e in os.listdir(root) if e.startswith(".")]


def test_simulated_kill_leaves_temp_dir_ignored(tmp_path):
    root = str(tmp_path)
    first = save(root, 4)
    # What a SIGKILL mid-write leaves: a hidden temp dir with some files (even a manifest).
    tmp = os.path.join(root, ".tmp-step-00000005-999")
    os.makedirs(tmp)
    open(os.path.join(tmp, "adapter.safetensors"), "wb").write(b"\x00" * 10)
    open(os.path.join(tmp, "manifest.json"), "w").write("{")
    assert load_checkpoint(root).path == first
    assert list_checkpoints(root) == [(4, first)]


def test_fingerprint_mismatch_is_a_clear_error(tmp_path):
    save(str(tmp_path), 1)
    other = json.loads(json.dumps(FINGERPRINT))
    other["model"]["hidden_size"] = 64
    with pytest.raises(ValueError, match=r"model.hidden_size 32, this model has 64"):
        load_checkpoint(str(tmp_path), expected_fingerprint=other)
    other = json.loads(json.dumps(FINGERPRINT))
    other["lora"]["rank"] = 8
    other["params"]["layers.0.q.A"] = [8, 32]
    with pytest.raises(ValueError, match=r"lora.rank.*params.layers.0.q.A"):
        load_checkpoint(str(tmp_path), expected_fingerprint=other)
    other = json.loads(json.dumps(FINGERPRINT))
    other["lora"]["dropout"] = 0.1
    with pytest.raises(ValueError, match=r"no lora.dropout"):
        load_checkpoint(str(tmp_path), expected_fingerprint=other)
    # Tuples vs lists do not count as a difference.
    same = dict(FINGERPRINT, params={k: tuple(v) for k, v in SHAPES.items()})
    assert load_checkpoint(str(tmp_path), expected_fingerprint=same).step == 1


@pytest.mark.parametrize("fname, damage", [
    ("adapter.safetensors", "flip"), ("optimizer.safetensors", "truncate"), ("trainer.json", "flip"),
    ("optimizer.json", "delete"), ("fingerprint.json", "truncate"),
])
def test_corrupt_or_missing_file_is_named(tmp_path, fname, damage):
    path = save(str(tmp_path), 2)
    fpath = os.path.join(path, fname)
    data = bytearray(open(fpath, "rb").read())
    if damage == "delete":
        os.remove(fpath)
    else:
        if damage == "flip":
            data[len(data) - 3] ^= 0x40  # inside the tensor data / JSON body, not the header
        else:
            data = data[: len(data) // 2]
        open(fpath, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=fname.replace(".", r"\.")):
        load_checkpoint(str(tmp_path))


def test_corrupt_manifest_and_latest_are_named(tmp_path):
    path = save(str(tmp_path), 2)
    open(os.path.join(path, "manifest.json"), "w").write("{not json")
    with pytest.raises(ValueError, match=r"manifest\.json"):
        load_checkpoint(path)
    open(os.path.join(str(tmp_path), "latest"), "w").write("\x00garbage")
    with pytest.raises(ValueError, match="latest"):
        load_checkpoint(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no checkpoint"):
        load_checkpoint(str(empty))


def test_keep_last_k(tmp_path):
    root = str(tmp_path)
    for step in (5, 10, 15, 20, 25):
        save(root, step, keep_last=2)
    assert [s for s, _ in list_checkpoints(root)] == [20, 25]
    assert load_checkpoint(root).step == 25
    save(root, 30)  # no keep_last: nothing pruned
    assert [s for s, _ in list_checkpoints(root)] == [20, 25, 30]
    save(root, 30, seed=3, keep_last=1)  # re-saving a step replaces it
    assert [s for s, _ in list_checkpoints(root)] == [30]
    assert np.array_equal(load_checkpoint(root).adapter["layers.0.q.B"], parts(30, seed=3)[0]["layers.0.q.B"])
    with pytest.raises(ValueError, match="keep_last"):
        save(root, 35, keep_last=0)
