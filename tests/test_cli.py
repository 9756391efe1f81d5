"""The `krnl` command: the main job learns (its loss falls) and bad flags are refused."""

import json
import re
import subprocess
import sys

import pytest

import krnl
from krnl.cli.main import main


def test_cli_w1_learns(capsys):
    rc = main(["w1", "--tokens", "33", "--width", "64", "--ffn", "96", "--rank", "4", "--steps", "30",
               "--learning-rate", "3e-2"])
    out = capsys.readouterr().out
    assert rc == 0
    losses = [float(m) for m in re.findall(r"^step +\d+ +loss ([0-9.e+-]+)", out, re.M)]
    assert len(losses) == 30
    assert losses[-1] < 0.25 * losses[0], out


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_cli_w1_low_precision_learns(capsys, dtype):
    rc = main(["w1", "--tokens", "31", "--width", "64", "--ffn", "96", "--rank", "4", "--steps", "30",
               "--learning-rate", "3e-2", "--dtype", dtype])
    out = capsys.readouterr().out
    assert rc == 0
    losses = [float(m) for m in re.findall(r"^step +\d+ +loss ([0-9.e+-]+)", out, re.M)]
    assert losses[-1] < 0.5 * losses[0], out


def test_cli_rejects_bad_flags():
    r = subprocess.run([sys.executable, "-m", "krnl", "w1", "--rank", "0"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "--rank must be >= 1" in r.stderr


def test_cli_devices(capsys):
    """One line per device, its name first and its capabilities as key=value, then one line per
    device this build has but cannot run here, with why."""
    assert main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names, missing = krnl.devices(), krnl.unavailable_devices()
    assert len(lines) == len(names) + len(missing)
    for name, line in zip(names, lines):
        c = krnl.device(name).capabilities()
        fields = dict(f.split("=", 1) for f in line.split("(")[0].split()[1:])
        assert line.split()[0] == name
        assert fields["kind"] == c["kind"] and fields["dtypes"].split(",") == c["dtypes"]
        assert fields["compute"] == c["compute_dtype"] and fields["graphs"] == ("yes" if c["graphs"] else "no")
        assert fields["attention_block"] == str(c["attention_block"] or "all")
    cpu = lines[names.index("cpu")]
    assert "kind=cpu dtypes=f32,f16,bf16 compute=f32 fused_attention=- attention_block=128 graphs=no" in cpu
    assert "blas: " in cpu
    assert lines[len(names):] == [f"{name}: unavailable: {why}" for name, why in missing.items()]


def test_cli_devices_json(capsys):
    assert main(["devices", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["devices"]) == krnl.devices()
    assert out["devices"] == {name: krnl.device(name).capabilities() for name in krnl.devices()}
    assert out["unavailable"] == krnl.unavailable_devices()


def test_cli_dtype_defaults_to_the_devices_compute_dtype(capsys):
    assert main(["w1", "--tokens", "8", "--width", "16", "--ffn", "24", "--rank", "2", "--steps", "1",
                 "--device", "cpu"]) == 0
    assert " f32, " in capsys.readouterr().out.splitlines()[0]  # the CPU's compute_dtype
