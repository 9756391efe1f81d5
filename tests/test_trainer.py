"""The training loop on a tiny model: it learns, base weights never change, resume is exact,
bad runs stop with a message, and the CLI's train -> eval -> generate works end to end."""

import json

import numpy as np
import pytest

import krnl
from krnl.io.checkpoint import load_checkpoint
from krnl.cli.main import main
from krnl.train.default_task import CharTokenizer, base_weights, make_split, tiny_config
from krnl.models.model import LlamaModel
from krnl.models.config import LoraConfig, ModelConfig
from krnl.train.trainer import Trainer, TrainConfig

FROZEN_PREFIXES = ("embed", "head", "norm_w")


def _model(dev, dtype="f32", r=4, dropout=0.0, hidden=None):
    tok = CharTokenizer()
    cfg = tiny_config(tok.vocab_size)
    if hidden:
        cfg.update(hidden_size=hidden, intermediate_size=2 * hidden)
    config = ModelConfig.from_dict(cfg)
    return tok, LlamaModel(dev, config, base_weights(config, seed=5), lora=LoraConfig(r=r, alpha=2 * r, dropout=dropout),
                           dtype=dtype, seed=3)


def _frozen_bits(model):
    out = {"embed": model.embed.numpy().copy(), "norm": model.norm_w.numpy().copy()}
    for i, L in enumerate(model.layers):
        for name, w in L.frozen().items():
            out[f"{i}.{name}"] = w.numpy().copy()
    return out


def _run(tmp_path, dev, iters, save_every=0, on_step=None, dropout=0.0, resume=False, dtype="f32", accum=1):
    tok, model = _model(dev, dtype=dtype, dropout=dropout)
    train = make_split(tok, 64, seed=1)
    valid = make_split(tok, 32, seed=2)
    cfg = TrainConfig(iters=iters, batch_size=8, grad_accum=accum, learning_rate=1e-2, warmup=2, val_every=3,
                      val_batches=2, save_every=save_every, seed=7)
    tr = Trainer(model, cfg, train, valid, out_dir=tmp_path, fingerprint={"cfg": vars(model.config), "r": 4},
                 progress=False, on_step=on_step)
    if resume:
        tr.resume()
    return tr


def test_training_reduces_loss_and_keeps_base_weights(dev, tmp_path):
    tok, model = _model(dev)
    before = _frozen_bits(model)
    ids, tg = make_split(tok, 16, seed=4)
    cfg = TrainConfig(iters=40, batch_size=16, learning_rate=1e-2, warmup=0, val_every=0, save_every=0)
    tr = Trainer(model, cfg, (ids, tg), None, out_dir=tmp_path, progress=False)
    l0 = model.loss(ids, tg)
    tr.run()
    l1 = model.loss(ids, tg)
    assert l1 < 0.5 * l0, (l0, l1)  # one fixed batch: it must be fitted
    after = _frozen_bits(model)
    for k in before:
        assert np.array_equal(before[k].view(np.uint8), after[k].view(np.uint8)), f"frozen {k} changed"


@pytest.mark.parametrize("dropout,accum", [(0.0, 1), (0.1, 2)])
def test_resume_gives_the_same_losses(dev, tmp_path, dropout, accum):
    full = _run(tmp_path / "full", dev, 9, save_every=3, dropout=dropout, accum=accum)
    full.run()
    ref = [loss for _, loss in full.history]

    class Interrupt(Exception):
        pass

    def stop(step, rec):
        if step == 5:
            raise Interrupt()

    part = _run(tmp_path / "part", dev, 9, save_every=3, on_step=stop, dropout=dropout, accum=accum)
    with pytest.raises(Interrupt):
        part.run()
    assert load_checkpoint(tmp_path / "part" / "checkpoints").step == 3
    resumed = _run(tmp_path / "part", dev, 9, save_every=3, dropout=dropout, accum=accum, resume=True)
    assert resumed.step == 3
    resumed.run()
    got = [loss for _, loss in resumed.history]
    assert got == ref[3:]  # bit-identical continuation on the CPU backend
    # The metrics file holds each step once, in order, with the interrupted run's extra steps dropped.
    steps = [json.loads(x)["step"] for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 10))
    np.testing.assert_array_equal(resumed.model.lora_params.params.numpy(), full.model.lora_params.params.numpy())


def test_resume_from_another_model_is_refused(dev, tmp_path):
    _run(tmp_path, dev, 3, save_every=3).run()
    tok, other = _model(dev, hidden=32)
    cfg = TrainConfig(iters=6, batch_size=8, save_every=3)
    tr = Trainer(other, cfg, make_split(tok, 64, seed=1), None, out_dir=tmp_path,
                 fingerprint={"cfg": vars(other.config), "r": 4}, progress=False)
    with pytest.raises(ValueError, match="hidden_size"):
        tr.resume()


def test_nan_loss_stops_with_the_step(dev, tmp_path):
    tr = _run(tmp_path, dev, 6)

    def poison(step, rec):
        if step == 2:  # a NaN in the LoRA masters makes every later loss NaN
            krnl.ops.fill(tr.model.lora_params.params[0:1], float("nan"))  # on the device: numpy() may be a copy
            tr.model.lora_params.refresh_working()

    tr.on_step = poison
    with pytest.raises(FloatingPointError, match=r"step 3"):
        tr.run()


def test_f16_training_uses_loss_scaling(dev, tmp_path):
    tr = _run(tmp_path, dev, 6, dtype="f16")
    assert tr.opt.scaler.enabled
    out = tr.run()
    assert np.isfinite(out["loss"])
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["loss_scale"] >= 1.0


def test_cli_train_eval_generate(tmp_path, capsys):
    out = tmp_path / "ad"
    rc = main(["train", "--iters", "60", "--adapter-path", str(out), "--quiet", "--lora-rank", "4",
               "--train-samples", "256", "--steps-per-eval", "30", "--save-every", "30"])
    assert rc == 0
    for f in ("adapter_model.safetensors", "adapter_config.json", "metrics.jsonl", "loss.png"):
        assert (out / f).exists(), f
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 60 and lines[-1]["loss"] < lines[0]["loss"]
    assert "val_loss" in lines[29]
    capsys.readouterr()
    assert main(["eval", "--adapter-path", str(out), "--samples", "64"]) == 0
    assert "test loss" in capsys.readouterr().out
    assert main(["generate", "--adapter-path", str(out), "--prompt", "+1a>", "--max-tokens", "5"]) == 0
    text = capsys.readouterr().out.strip()
    assert text.startswith("+1a>") and len(text) <= 4 + 5


def test_generate_with_kv_cache_matches_full_recompute(dev):
    tok, model = _model(dev)
    rng = np.random.default_rng(0)
    st = model.lora_state()
    model.lora_params.load({k: v if "lora_A" in k else 0.3 * rng.standard_normal(v.shape).astype(np.float32)
                            for k, v in st.items()})
    prompt = tok.encode("+2c>")
    got = model.generate(prompt, max_new_tokens=7)
    seq, ref = list(prompt), []
    for _ in range(7):
        nxt = int(np.argmax(model.logits(np.array([seq]))[0, -1]))
        ref.append(nxt)
        seq.append(nxt)
    assert got == ref
    sampled = model.generate(prompt, max_new_tokens=7, temperature=0.8, top_p=0.9, seed=3)
    assert sampled == model.generate(prompt, max_new_tokens=7, temperature=0.8, top_p=0.9, seed=3)
    assert len(sampled) == 7 and all(0 <= t < model.config.vocab_size for t in sampled)


def test_cli_errors_are_clear(tmp_path, capsys):
    assert main(["generate", "--adapter-path", str(tmp_path / "none")]) == 1
    assert f"adapter folder {tmp_path / 'none'} not found" in capsys.readouterr().err
    assert main(["train", "--iters", "2", "--lora-rank", "9999", "--adapter-path", str(tmp_path), "--quiet"]) == 1
    assert "9999" in capsys.readouterr().err


def test_cli_epochs_sets_the_step_count(tmp_path):
    out = tmp_path / "ep"
    # 128 samples / (batch 16 x accumulation 2) = 4 steps per epoch; 1.5 epochs = 6 steps
    assert main(["train", "--epochs", "1.5", "--batch-size", "16", "--grad-accumulation", "2", "--train-samples",
                 "128", "--adapter-path", str(out), "--quiet", "--lora-rank", "2"]) == 0
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))
