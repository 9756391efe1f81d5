#!/bin/bash
# The CUDA check on a lent H200 (the workplace's device tool): build krnl with the CUDA backend
# there, run the test suite (the Metal simulator and Objective-C files are left to CI) and the W3
# bench. The remote machine has Python, PyTorch, nvcc, cmake and ninja but no network, so the one
# wheel the build needs travels in the ignored folder .whl:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl scipy-openblas32
# then: device run `bash tools/device/h200_check.sh` with carry [".whl"].
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/krnl-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
CUB=$(find /usr/local /opt /usr/lib -name 'libcublas.so.1[23]*' 2>/dev/null | head -1)
[ -n "$CUB" ] && export KRNL_CUBLAS=$CUB  # cuBLAS is opened at run time (csrc/cuda/cublas_api.h)
export PYTHONPATH=/tmp/site
cmake -S . -B build/h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(which python3)" > "$OUT/cmake.log" 2>&1 &&
  cmake --build build/h200 -j16 >> "$OUT/cmake.log" 2>&1 || { grep -E "error|FAILED" "$OUT/cmake.log" | head -40; exit 1; }
cp build/h200/_core*.so python/krnl/
export PYTHONPATH=python:/tmp/site KRNL_TEST_METAL_SIM=0
python3 -c "import krnl; print(krnl.devices())"
skip=""
for f in test_mslsim test_metal_kernels test_metal_kernels_backward test_metal_kernels_extra test_metal_kernels_gemm \
         test_metal_kernels_loss_optim test_metal_host; do skip="$skip --ignore=tests/$f.py"; done
timeout 300 python3 -m pytest -q -n 12 -p no:cacheprovider tests $skip 2>&1 | tee "$OUT/tests.log" | tail -15
timeout 120 python3 -m pytest -q -s -p no:cacheprovider bench/test_cuda_w3.py 2>&1 | tee "$OUT/w3.log" | grep -v "^\s*$" | tail -25
