"""The training step (krnl/train/step.py, krnl/models/step_inputs.py): lengths padded to a bucket, a step that
reads nothing on the host before its end, the windowed tokens/s, and, on devices with graphs,
the replayed step against the eager one."""
import json

import numpy as np
import pytest

import krnl
from krnl.train.step import StepRunner, pad_batch_to, padded_length
from krnl.models.step_inputs import SEED_MASK, seed_offset_words
from krnl.train.optim import AdamW, Schedule
from krnl.train.trainer import Rate, TrainConfig, Trainer

from conftest import tiny_lora_model


def test_padded_length():
    assert [padded_length(T, 1, 100) for T in (1, 31, 33)] == [1, 31, 33]
    assert [padded_length(T, 16, 100) for T in (1, 16, 17, 31, 33)] == [16, 16, 32, 32, 48]
    assert padded_length(90, 16, 100) == 96
    assert padded_length(97, 16, 100) == 100      # never past max_position_embeddings
    assert padded_length(120, 16, 100) == 120     # a batch longer already stays as it is
    assert padded_length(40, 16, 100, switch=44) == 44  # never across LongRoPE's switch
    assert padded_length(50, 16, 100, switch=44) == 64


def test_seed_offset_words():
    for c in (0, 1, 41, 2**40 + 3, 2**62):
        lo, hi = seed_offset_words(c).view(np.uint32)
        assert (int(hi) << 32 | int(lo)) == (c * 1000003) & SEED_MASK
    np.testing.assert_array_equal(seed_offset_words(41, first_row=6).view(np.uint32),
                                  list(seed_offset_words(41).view(np.uint32)) + [6])


def _batch(rng, B, T, V=61, packed=False):
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    tg = rng.integers(0, V, (B, T)).astype(np.int32)
    tg[:, -1] = -100
    if not packed:
        return ids, tg
    seg = np.repeat(np.arange(2)[None, :], B, 0).repeat([T // 2, T - T // 2], axis=1).astype(np.int32)
    pos = np.concatenate([np.arange(T // 2), np.arange(T - T // 2)])[None, :].repeat(B, 0).astype(np.int32)
    return ids, tg, seg, pos


@pytest.mark.parametrize("packed", [False, True])
def test_padding_leaves_loss_and_gradients(packed):
    """Ignored tokens after each row's end change neither the loss nor a LoRA gradient (causal
    attention: no real token sees them; packed rows: they sit in a segment of their own)."""
    dev = krnl.device("cpu")
    rng = np.random.default_rng(3)
    batch = _batch(rng, 2, 13, packed=packed)
    padded = pad_batch_to(batch, 32)
    assert padded[0].shape == (2, 32) and (padded[1][:, 13:] == -100).all()
    out = []
    for b in (batch, padded):
        m = tiny_lora_model(dev, "f32")
        m.zero_grads()
        m.forward_backward(*b[:2], segments=b[2] if packed else None, positions=b[3] if packed else None)
        out.append((m.read_loss(), m.lora_grads()))
    assert abs(out[0][0] - out[1][0]) <= 1e-6 * abs(out[0][0])
    for k, g in out[0][1].items():
        np.testing.assert_allclose(out[1][1][k], g, rtol=1e-4, atol=1e-6 * np.abs(g).max(), err_msg=k)


class _NoReads:
    """Makes every host read of device data (Tensor.numpy) and every wait raise."""

    def __enter__(self):
        self.saved = (krnl._core.Tensor.numpy, krnl._core.Device.synchronize, krnl._core.Device.wait)

        def refuse(*a, **k):
            raise AssertionError("the step read device data on the host or waited before its end")

        krnl._core.Tensor.numpy = refuse
        krnl._core.Device.synchronize = refuse
        krnl._core.Device.wait = refuse
        return self

    def __exit__(self, *exc):
        krnl._core.Tensor.numpy, krnl._core.Device.synchronize, krnl._core.Device.wait = self.saved
        return False


def _family(name):
    """The tiny config overrides of each family's metal-sim check (tests/test_families.py)."""
    if name == "llama":
        return {}
    from test_families import FAMILIES
    return FAMILIES[name]["sim"]["tiny"]


@pytest.mark.parametrize("family,dtype,dropout", [("llama", "f32", 0.0), ("llama", "f32", 0.2), ("llama", "f16", 0.0),
                                                  ("qwen3", "f32", 0.2), ("gemma2", "f32", 0.2),
                                                  ("gemma3", "f32", 0.2), ("phi3", "f32", 0.2)])
def test_step_reads_nothing_on_the_host_before_its_end(family, dtype, dropout):
    """Two micro-batches (dropout, loss scaling in f16) and the optimizer's update are queued with
    every read and wait refused, for every model family (a recorded step could hold none); the
    one read at the end gives the eager AdamW.step's numbers."""
    dev = krnl.device("cpu")
    if dtype not in dev.capabilities()["dtypes"]:
        pytest.skip(f"cpu lacks {dtype}")
    rng = np.random.default_rng(5)
    batches = [_batch(rng, 2, 11) for _ in range(2)]
    runs = []
    for queued in (True, False):
        m = tiny_lora_model(dev, dtype, **_family(family))
        m.lora_config.dropout = dropout
        for L in m.layers:
            for lin in L.linears().values():
                lin.dropout = dropout
        opt = AdamW(m.lora_params, Schedule(1e-2, kind="constant"), max_grad_norm=0.5)
        if queued:
            r = StepRunner(m, opt, bucket=8, micro_batches=2)
            with _NoReads():
                n = [r.micro_batch(b, opt.loss_scale, i) for i, b in enumerate(batches)]
                r.optimizer(2)
            loss, info = r.finish()
        else:  # the public eager calls, padded alike
            hs = [m.forward_backward(*pad_batch_to(b, 16), loss_scale=opt.loss_scale) for b in batches]
            info = opt.step(2)
            loss = float(np.mean([h.numpy()[0] for h in hs]))
            n = None
        runs.append((loss, info, m.lora_state(), n))
    (l1, i1, s1, n), (l2, i2, s2, _) = runs
    assert n == [int((b[1] != -100).sum()) for b in batches]
    assert abs(l1 - l2) <= 1e-6 * abs(l2) and abs(i1["grad_norm"] - i2["grad_norm"]) <= 1e-6 * i2["grad_norm"]
    assert i1["grad_norm"] > 0.5  # clipping was active
    for k in s1:
        np.testing.assert_allclose(s1[k], s2[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_rate_is_windowed(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("krnl.train.rate.time.perf_counter", lambda: now[0])
    r = Rate(window=2)
    for dt, n in [(10.0, 100), (1.0, 100), (1.0, 100), (1.0, 100)]:  # a slow first step (start-up)
        now[0] += dt
        r.add(n)
    assert r.recent() == pytest.approx(100.0)          # the last two steps
    assert r.cumulative() == pytest.approx(400 / 13.0)  # everything since the start


def test_trainer_metrics_carry_both_rates_and_the_bucket(tmp_path):
    dev = krnl.device("cpu")
    rng = np.random.default_rng(9)
    ids, tg = _batch(rng, 8, 13)
    cfg = TrainConfig(iters=3, batch_size=4, learning_rate=1e-2, warmup=0, val_every=0, save_every=0,
                      length_bucket=8)
    tr = Trainer(tiny_lora_model(dev, "f32"), cfg, (ids, tg), None, out_dir=tmp_path, progress=False)
    tr.run()
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_s_cumulative"] > 0 for r in recs)
    # the padded run trains the same as an unpadded one
    cfg2 = TrainConfig(**{**cfg.__dict__, "length_bucket": 1})
    tr2 = Trainer(tiny_lora_model(dev, "f32"), cfg2, (ids, tg), None, out_dir=tmp_path / "b", progress=False)
    tr2.run()
    np.testing.assert_allclose([l for _, l in tr.history], [l for _, l in tr2.history], rtol=1e-5)
