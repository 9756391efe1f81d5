"""A newcomer's first hour: base models without an adapter, output files with the
user's umask, one-line errors (disk full, a path under a file, bad options, non-UTF-8 data),
Ctrl-C during training, --lora-targets forms and --help defaults. No torch needed."""

import collections
import errno
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

import krnl.formats.adapter
import krnl.io.fileio
import krnl.train.trainer
from krnl.io.checkpoint import list_checkpoints, load_checkpoint
from krnl.cli.args import lora_targets, parse_args
from krnl.cli.main import main
from krnl.train.data import DataError, read_jsonl
from krnl.models.config import ModelConfig

from conftest import HF_VOCAB as V
TINY = ["--iters", "2", "--train-samples", "64", "--batch-size", "4", "--quiet", "--steps-per-eval", "0"]


def _one_line_error(err, cmd="train"):
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("no adapter: ")]  # the base-run note
    assert len(lines) == 1, err
    assert lines[0].startswith(f"krnl {cmd}: error: ") and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# Base models


def test_base_eval_and_generate_without_an_adapter(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no adapters/ folder here
    assert main(["eval", "--samples", "16"]) == 0
    out, err = capsys.readouterr()
    assert "no adapter: evaluating the base model" in err and "untrained embedded default" in err
    base_loss = re.search(r"test loss ([0-9.]+)", out).group(1)
    assert main(["generate", "--max-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert "no adapter: generating with the base model" in err and out.startswith("+2c>")
    # mlx-lm's --adapter-path "": the same base run
    assert main(["eval", "--samples", "16", "--adapter-path", ""]) == 0
    out, err = capsys.readouterr()
    assert "base model" in err and re.search(r"test loss ([0-9.]+)", out).group(1) == base_loss
    # an explicit folder that is not there: one line naming it
    assert main(["eval", "--adapter-path", "no/such/adapter"]) == 1
    line = _one_line_error(capsys.readouterr().err, "eval")
    assert "no/such/adapter not found" in line
    assert main(["generate", "--adapter-path", "gone"]) == 1
    assert "gone not found" in _one_line_error(capsys.readouterr().err, "generate")
    # once adapters/ exists, it is used by default (and says nothing about a base model)
    assert main(["train", *TINY]) == 0
    capsys.readouterr()
    assert main(["eval", "--samples", "16"]) == 0
    out, err = capsys.readouterr()
    assert "base model" not in err and re.search(r"test loss ([0-9.]+)", out).group(1) != base_loss


def test_base_hf_model_without_an_adapter(hf_folder, tmp_path, monkeypatch, capsys):
    from krnl import device
    from krnl.formats.hf import load_model

    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--model", str(hf_folder), "--prompt", "w5 w7", "--max-tokens", "3",
                 "--dtype", "f32"]) == 0
    out, err = capsys.readouterr()
    assert f"no adapter: generating with the base model {hf_folder}" in err
    want = load_model(hf_folder, device("cpu")).generate([5, 7], max_new_tokens=3, eos_id=0)
    words = [f"w{i}" for i in (want[:want.index(0)] if 0 in want else want)]
    assert words and out.strip().startswith("w5 w7" + " ".join(words))  # (the eos token may be decoded too)
    data = tmp_path / "data"
    data.mkdir()
    (data / "valid.jsonl").write_text("".join(json.dumps({"text": f"w{i} w{i + 1} w{i + 2}"}) + "\n"
                                              for i in range(1, 9)))
    assert main(["eval", "--model", str(hf_folder), "--data", str(data), "--adapter-path", ""]) == 0
    out, err = capsys.readouterr()
    assert "no adapter: evaluating the base model" in err and "valid loss" in out


# ---------------------------------------------------------------------------------------------
# File modes


def _mode(p):
    return os.stat(p).st_mode & 0o777


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_output_files_get_the_users_umask(hf_folder, tmp_path, monkeypatch, capsys, umask):
    from safetensors.numpy import save_file

    monkeypatch.chdir(tmp_path)
    old = os.umask(umask)
    try:
        assert krnl.io.fileio.current_umask() == umask
        assert main(["train", *TINY, "--save-every", "1", "--adapter-path", "ad"]) == 0
        # fuse: a zero adapter on q_proj of the HF folder
        cfg = json.loads(Path("ad/adapter_config.json").read_text())
        lora = krnl.models.config.LoraConfig(r=2, alpha=4.0, target_modules=("q_proj",))
        mc = ModelConfig.from_file(hf_folder / "config.json")
        tensors = {}
        for i in range(mc.num_hidden_layers):
            tensors[krnl.models.config.lora_key(i, "q_proj", "A")] = np.zeros((2, 32), np.float32)
            tensors[krnl.models.config.lora_key(i, "q_proj", "B")] = np.zeros((mc.module_shape("q_proj")[0], 2), np.float32)
        fa = tmp_path / "fa"
        fa.mkdir()
        save_file(tensors, str(fa / "adapter_model.safetensors"))
        cfg = krnl.formats.adapter.peft_config(lora, base_model=str(hf_folder))
        (fa / "adapter_config.json").write_text(json.dumps(cfg))
        assert main(["fuse", "--adapter-path", str(fa), "--save-path", "fused"]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    want = 0o666 & ~umask
    files = [Path("ad") / n for n in ("adapter_model.safetensors", "adapter_config.json", "loss.png", "metrics.jsonl")]
    files += [Path("ad/checkpoints/latest")] + [p for _, d in list_checkpoints("ad/checkpoints") for p in Path(d).iterdir()]
    files += list(Path("fused").iterdir())
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in Path("fused").iterdir()}
    assert len(files) > 15
    assert {str(p): oct(_mode(p)) for p in files} == {str(p): oct(want) for p in files}


# ---------------------------------------------------------------------------------------------
# Clean failures


def test_disk_full_is_one_line_and_keeps_checkpoints(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    real = krnl.formats.adapter.atomic_write_bytes

    def disk_full(path, data):
        if Path(path).name == "adapter_model.safetensors":
            def chunks():
                yield data[:10]
                raise OSError(errno.ENOSPC, "No space left on device")
            return krnl.io.fileio.atomic_write_chunks(path, chunks())
        return real(path, data)

    monkeypatch.setattr(krnl.formats.adapter, "atomic_write_bytes", disk_full)
    assert main(["train", *TINY, "--save-every", "1", "--adapter-path", "ad"]) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert "ad/adapter_model.safetensors" in line and "disk is full" in line
    assert not [p for p in Path("ad").iterdir() if p.name.endswith(".tmp")]  # no temporary file left
    ck = load_checkpoint("ad/checkpoints")  # verifies every file's hash
    assert ck.trainer_state["step"] == 2


def test_unwritable_adapter_path_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("x")  # tests may run as root: a path under a file fails for anyone
    assert main(["train", *TINY, "--adapter-path", "afile/ad"]) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert "afile/ad" in line and "not a folder" in line


def test_permission_error_names_the_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "ad" / "loss.png"))

    monkeypatch.setattr(krnl.train.trainer, "plot_metrics", denied)
    assert main(["train", *TINY, "--adapter-path", "ad"]) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert "loss.png: permission denied" in line and "writable" in line
    monkeypatch.setattr(krnl.train.trainer, "plot_metrics", lambda *a: (_ for _ in ()).throw(
        OSError(errno.EROFS, "Read-only file system", "ad/loss.png")))
    assert main(["train", *TINY, "--adapter-path", "ad2"]) == 1
    assert "ad/loss.png: read-only file system" in _one_line_error(capsys.readouterr().err)


def test_ctrl_c_during_training(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    real = krnl.train.trainer.Trainer.evaluate

    def evaluate(self):
        if self.step == 5:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(krnl.train.trainer.Trainer, "evaluate", evaluate)
    args = ["train", "--iters", "8", "--train-samples", "64", "--batch-size", "4", "--quiet",
            "--steps-per-eval", "1", "--save-every", "2", "--adapter-path", "ad"]
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip() == "krnl train: interrupted at step 5; newest checkpoint: step 4; continue with --resume"
    assert [s for s, _ in list_checkpoints("ad/checkpoints")] == [2, 4]
    assert load_checkpoint("ad/checkpoints").trainer_state["step"] == 4
    monkeypatch.setattr(krnl.train.trainer.Trainer, "evaluate", real)
    assert main(args + ["--resume"]) == 0
    assert "step 8:" in capsys.readouterr().out


def _yaml_error(tmp_path, text):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(cfg)])
    msg = str(e.value.code)
    assert msg.startswith(f"krnl train: error: {cfg}: ") and "\n" not in msg
    return msg


def test_yaml_options_of_the_wrong_type(tmp_path):
    assert "'learning_rate' must be a number, got 'fast'" in _yaml_error(tmp_path, "learning_rate: fast\n")
    assert "'iters' must be an integer, got 1.5" in _yaml_error(tmp_path, "iters: 1.5\n")
    assert "'batch_size' must be an integer, got True" in _yaml_error(tmp_path, "batch_size: true\n")
    assert "'pack' must be true or false" in _yaml_error(tmp_path, "pack: 3\n")
    assert "'lr_schedule' must be one of cosine" in _yaml_error(tmp_path, "lr_schedule: cubic\n")
    assert "'lora_parameters.rank' must be an integer" in _yaml_error(tmp_path, "lora_parameters: {rank: big}\n")
    assert "'model' must be a single value" in _yaml_error(tmp_path, "model: [a, b]\n")


def test_yaml_lists_and_numbers_as_strings(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("c.yaml").write_text("learning_rate: '1e-3'\nlora_layers: [1]\n"
                              "lora_parameters: {rank: 4, keys: [self_attn.q_proj, mlp.down_proj]}\n")
    assert main(["train", "--config", "c.yaml", *TINY]) == 0
    assert "LoRA r=4 on 2 modules" in capsys.readouterr().out
    cfg = json.loads(Path("adapters/adapter_config.json").read_text())
    assert cfg["target_modules"] == ["down_proj", "q_proj"] and cfg["layers_to_transform"] == [1]


def test_quantization_options_have_one_vocabulary(tmp_path, capsys):
    """--q-bits / --q-group-size on every command; the former spellings (train's and fuse's
    --quantize, quantize's --bits and --group-size, a YAML `quantize` key) land on the same
    options with a note."""
    commands = collections.defaultdict(lambda: None)
    for cmd in ("train", "eval", "generate", "fuse", "quantize"):
        a = parse_args([cmd, "--q-bits", "8", "--q-group-size", "32"] + (["--model", "m"] if cmd == "quantize" else []),
                       commands)
        assert (a.q_bits, a.q_group_size) == (8, 32)
        assert capsys.readouterr().err == ""
    assert parse_args(["quantize", "--model", "m"], commands).q_bits == 4  # quantize's default
    assert parse_args(["train"], commands).q_bits is None
    for cmd, old in (("train", "--quantize"), ("fuse", "--quantize"), ("quantize", "--bits")):
        a = parse_args([cmd, old, "6"] + (["--model", "m"] if cmd == "quantize" else []), commands)
        assert a.q_bits == 6 and capsys.readouterr().err == f"krnl: {old} is spelled --q-bits now\n"
    assert parse_args(["quantize", "--model", "m", "--group-size", "128"], commands).q_group_size == 128
    assert "--group-size is spelled --q-group-size now" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("quantize: 4\nq_group_size: 32\n")
    a = parse_args(["train", "--config", str(cfg)], commands)
    assert (a.q_bits, a.q_group_size) == (4, 32)
    assert "option 'quantize' is spelled q_bits now" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["train", "--q-bits", "7"], commands)  # not a width MLX has
    capsys.readouterr()
    for cmd in ("train", "fuse", "quantize"):  # --help names the new spellings only
        with pytest.raises(SystemExit):
            parse_args([cmd, "--help"], commands)
        out = capsys.readouterr().out
        assert "--q-bits" in out and "--quantize" not in out and "--bits" not in out and "SUPPRESS" not in out


def test_bad_lora_layers_and_seed(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--lora-layers", "a,b"]) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert "--lora-layers" in line and "'a', 'b'" in line
    assert not Path("adapters").exists()
    for cmd in ("train", "eval", "generate"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--seed", "-1"])
        assert e.value.code == f"krnl {cmd}: error: --seed must be >= 0, got -1"


def test_non_utf8_jsonl_names_the_line(tmp_path, hf_folder, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "valid.jsonl").write_bytes(b'{"text": "w1 w2"}\n{"text": "w3"}\n{"text": "caf\xe9 w4"}\n')
    with pytest.raises(DataError, match=r"valid\.jsonl:3: not UTF-8 text \(byte 0xe9 at column 14\)"):
        read_jsonl(data / "valid.jsonl")
    assert main(["eval", "--model", str(hf_folder), "--data", str(data), "--adapter-path", ""]) == 1
    line = _one_line_error(capsys.readouterr().err, "eval")
    assert "valid.jsonl:3: not UTF-8" in line
    # a UTF-8 byte order mark on the first line is accepted
    (data / "valid.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "w1 w2"}\n')
    assert [n for n, _ in read_jsonl(data / "valid.jsonl")] == [1]


# ---------------------------------------------------------------------------------------------
# --lora-targets and --help


def test_lora_targets_accepts_short_module_and_mlx_names(tmp_path, monkeypatch, capsys):
    assert lora_targets("q,k,v,o,gate,up,down") == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj")
    assert lora_targets("q_proj, self_attn.v_proj,mlp.gate_proj,q") == ("q_proj", "v_proj", "gate_proj")
    for bad in ("x", "mlp.q_proj", "self_attn.up_proj", "attn"):
        with pytest.raises(ValueError, match=r"unknown module .*accepted: q, k, v, o, gate, up, down, q_proj"):
            lora_targets(bad)
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--lora-targets", "q,self_attn.v_proj,down_proj"]) == 0
    assert "on 6 modules" in capsys.readouterr().out  # 3 modules x 2 layers
    assert main(["train", *TINY, "--lora-targets", "q,attention"]) == 1
    assert "unknown module 'attention'" in _one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("cmd", ["train", "eval", "generate", "fuse", "w1", "tune", "devices"])
def test_help_shows_every_default(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    options = text.split("options:", 1)[1]
    entries = re.split(r"\n  (?=-)", options)[1:]
    assert entries
    for entry in entries:
        if entry.startswith("-h, --help"):
            continue
        assert re.search(r"default[: ]", " ".join(entry.split())), entry
    if cmd == "train":
        flat = " ".join(text.split())
        for want in ("(default: 1500)", "(default: 16)", "default: 3e-3 (LoRA, DoRA); 1e-5 with --fine-tune-type full",
                     "(default: cosine)", "(default: off)", "(default: adapters)", "(default: 0)"):
            assert want in flat, want
