"""`krnl train --optimizer ...` and its options from the command line and a --config file, each
optimizer's run resumed exactly from a checkpoint, and a changed optimizer refused on resume."""

import json

import numpy as np
import pytest

from krnl.cli.args import parse_args
from krnl.cli.main import main
from krnl.cli.optim_args import config_fields
from krnl.io.checkpoint import load_checkpoint, save_checkpoint

BASE = ["train", "--iters", "4", "--warmup", "1", "--steps-per-eval", "4", "--save-every", "2", "--quiet",
        "--train-samples", "64", "--lora-rank", "4", "--batch-size", "4"]
RUNS = {"adamw": [], "adam": ["--weight-decay", "0.01"], "sgd": ["--momentum", "0.9", "--nesterov"],
        "lion": ["--betas", "0.9,0.98", "--learning-rate", "3e-4", "--weight-decay", "0.1"],
        "adafactor": ["--learning-rate", "1e-2", "--no-relative-step", "--clip-threshold", "0.5"],
        "muon": ["--learning-rate", "2e-2", "--weight-decay", "0.1", "--ns-steps", "4"],
        "adamw8bit": ["--min-8bit-size", "256", "--weight-decay", "0.01"]}


def args_of(argv):
    return parse_args(argv, {k: None for k in ("devices", "train", "eval", "generate", "fuse", "serve", "quantize",
                                                "w1", "tune", "doctor", "bench")})


def losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_command_line_and_config_file(tmp_path):
    a = args_of(["train", "--optimizer", "sgd", "--momentum", "0.9", "--dampening", "0.1"])
    assert config_fields(a) == {"optimizer": "sgd", "betas": None, "eps": None, "momentum": 0.9, "dampening": 0.1,
                                "nesterov": None, "beta2_decay": -0.8, "clip_threshold": 1.0, "relative_step": True,
                                "ns_steps": 5, "adjust_lr_fn": "original", "loraplus_lr_ratio": 0.0,
                                "min_8bit_size": 4096}
    assert args_of(["train", "--betas", "0.8,0.9"]).betas == (0.8, 0.9)
    with pytest.raises(SystemExit):
        args_of(["train", "--betas", "0.9"])
    with pytest.raises(SystemExit):
        args_of(["train", "--optimizer", "adagrad"])
    with pytest.raises(ValueError, match="--nesterov"):
        config_fields(args_of(["train", "--nesterov", "--optimizer", "sgd"]))
    with pytest.raises(ValueError, match="--nesterov"):
        config_fields(args_of(["train", "--nesterov"]))
    assert config_fields(args_of(["train", "--optimizer", "muon", "--no-nesterov"]))["nesterov"] is False
    cfg = tmp_path / "c.yaml"
    cfg.write_text("optimizer: lion\nbetas: [0.95, 0.98]\nweight_decay: 0.1\n")
    a = args_of(["train", "--config", str(cfg)])
    assert (a.optimizer, a.betas, a.weight_decay) == ("lion", (0.95, 0.98), 0.1)
    cfg.write_text("optimizer: sgd\nmomentum: 0.5\nnesterov: true\neps: 1e-6\n")
    a = args_of(["train", "--config", str(cfg), "--momentum", "0.7"])  # the command line wins
    assert (a.optimizer, a.momentum, a.nesterov, a.eps) == ("sgd", 0.7, True, 1e-6)
    cfg.write_text("optimizer: adafactor\nrelative_step: false\nbeta2_decay: -0.5\n")
    a = args_of(["train", "--config", str(cfg)])
    assert (a.optimizer, a.relative_step, a.beta2_decay) == ("adafactor", False, -0.5)


@pytest.mark.parametrize("name", RUNS)
def test_each_optimizer_trains_and_resumes_exactly(tmp_path, name, capsys):
    out = tmp_path / "run"
    assert main(BASE + ["--adapter-path", str(out), "--optimizer", name] + RUNS[name]) == 0
    first = losses(out)
    state = json.loads((out / "checkpoints" / "step-00000004" / "optimizer.json").read_text())
    assert state["optimizer"] == name
    assert main(BASE + ["--adapter-path", str(out), "--optimizer", name, "--resume-from", "2"] + RUNS[name]) == 0
    assert losses(out) == first
    capsys.readouterr()
    assert main(BASE + ["--adapter-path", str(out), "--resume", "--iters", "6", "--optimizer",
                        "lion" if name != "lion" else "adamw"]) == 1
    assert f"--optimizer '{name}' -> " in capsys.readouterr().err
    assert main(BASE + ["--adapter-path", str(out), "--resume", "--iters", "6", "--optimizer", name, "--eps", "1e-3",
                        "--resume-override"] + RUNS[name]) == 1
    assert "cannot change the optimizer or its options: --eps" in capsys.readouterr().err


def test_loraplus_trains_and_resumes_exactly(tmp_path):
    out = tmp_path / "run"
    extra = ["--optimizer", "lion", "--learning-rate", "1e-4", "--loraplus-lr-ratio", "16"]
    assert main(BASE + ["--adapter-path", str(out)] + extra) == 0
    first = losses(out)
    state = json.loads((out / "checkpoints" / "step-00000004" / "optimizer.json").read_text())
    assert state["hyper"]["loraplus_lr_ratio"] == 16.0
    assert main(BASE + ["--adapter-path", str(out), "--resume-from", "2"] + extra) == 0
    assert losses(out) == first
    plain = tmp_path / "plain"
    assert main(BASE + ["--adapter-path", str(plain)] + extra[:-2]) == 0
    assert losses(plain)[1:] != first[1:]  # the B factors' larger steps show from the second step


def test_an_earlier_eight_bit_state_resumes_exactly(tmp_path, capsys):
    """A checkpoint of 8-bit AdamW as krnl wrote it before each optimizer held its own state (f32
    m and v as long as the params, zero over the quantized ones) resumes to the same losses; a
    state of no known layout is refused in one line that names the checkpoint."""
    out, extra = tmp_path / "run", ["--optimizer", "adamw8bit"] + RUNS["adamw8bit"]
    assert main(BASE + ["--adapter-path", str(out)] + extra) == 0
    first = losses(out)
    root = out / "checkpoints"
    ck = load_checkpoint(str(root / "step-00000002"))
    state = dict(ck.optimizer_state)
    sizes = [(k, int(np.prod(s))) for k, s in state["layout"]]
    for key in ("m", "v"):
        packed, full, at = state[key], [], 0
        for k, n in sizes:
            small = n < state["hyper"]["min_8bit_size"]
            full.append(packed[at:at + n] if small else np.zeros(n, np.float32))
            at += n if small else 0
        assert at == packed.size and 0 < at < sum(n for _, n in sizes)
        state[key] = np.concatenate(full)

    def rewrite(opt_state):
        save_checkpoint(str(root), adapter=ck.adapter, optimizer_state=opt_state, trainer_state=ck.trainer_state,
                        model_fingerprint=ck.fingerprint)

    rewrite(state)
    assert main(BASE + ["--adapter-path", str(out), "--resume-from", "2"] + extra) == 0
    assert losses(out) == first
    rewrite(dict(state, v=state["v"][:-1]))
    capsys.readouterr()
    assert main(BASE + ["--adapter-path", str(out), "--resume-from", "2"] + extra) == 1
    err = capsys.readouterr().err
    assert "[AdamW8bit.load_state_dict] v has shape" in err and "step-00000002" in err
