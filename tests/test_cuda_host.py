"""What of the CUDA backend runs without a GPU: the grouped GEMMs' index arithmetic
(csrc/cuda/moe_tiles.cuh), moe_quantized_matmul's dequantizing tile loader included, emulated block
by block on the host against a reference, and the sort's and tile map's algorithms mirrored
(tests/cuda_host/moe_tiles_check.cu); SwiGLU's functors, gpt-oss's clamped form included
(csrc/cuda/swiglu.cuh, tests/cuda_host/swiglu_check.cu); where nvcc exists. The kernels themselves
run in test_cuda.py, test_ops.py and test_moe_ops.py on a CUDA device."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def build_and_run(tmp_path, name):
    """Builds tests/cuda_host/<name>.cu with AddressSanitizer where the host compiler has it, so that
    reading past an operand fails too, not only a wrong result, and runs it: it must end with "<name>: ok"."""
    exe = tmp_path / name
    cmd = ["nvcc", "-std=c++17", "-O1", "-I", str(ROOT / "csrc"), "-x", "cu",
           str(ROOT / "tests" / "cuda_host" / f"{name}.cu"), "-o", str(exe)]
    asan = subprocess.run(cmd + ["-Xcompiler", "-fsanitize=address"], capture_output=True, text=True, timeout=600)
    if asan.returncode != 0:  # no libasan: the plain build
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith(f"{name}: ok"), run.stdout + run.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_moe_tiles_on_the_host(tmp_path):
    """A loader reading past an operand (the quantized codes' last words, x's last row) fails too."""
    build_and_run(tmp_path, "moe_tiles_check")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_swiglu_on_the_host(tmp_path):
    """The gated kernels' SwiGLU arithmetic, plain and clamped, against float64 (bounds included)."""
    build_and_run(tmp_path, "swiglu_check")
