"""The `krnl` command: the main job learns (its loss falls) and bad flags are refused."""

import re
import subprocess
import sys

import pytest

from krnl.cli import main


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
    assert main(["devices"]) == 0
    assert "cpu" in capsys.readouterr().out.split()
