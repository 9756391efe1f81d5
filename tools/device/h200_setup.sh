# Sourced by tools/device/h200_check.sh (the product's phases) and dev/cuda/h200_probes.sh (the
# research probes) on the lent H200: the wheels carried in .whl (h200_check.sh's header says how to
# make them), the environment, and krnl_build, which builds krnl with the CUDA backend into
# python/krnl and checks what an H200 must offer. Expects $phase; sets $OUT and $CUB.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/krnl-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
for t in .whl/cudnn_frontend*include.tar.gz; do [ -f "$t" ] && tar xzf "$t" -C /tmp/site; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
CUB=$(find /usr/local /opt /usr/lib -name 'libcublas.so.1[23]*' 2>/dev/null | head -1)
[ -n "$CUB" ] && export KRNL_CUBLAS=$CUB  # cuBLAS is opened at run time (csrc/cuda/cublas_api.h)
export PYTHONPATH=/tmp/site
# The system compiler, not the image's CC/CXX (/opt/gcc): that one compiles against GCC 13's
# headers but links an older libstdc++ statically, and the mix crashed inside the cuDNN
# frontend (a std::stringstream formatting an integer). With /usr/bin/g++ the module takes the
# system's libstdc++.so.6 like any other.
export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
build_tree() {  # build_tree DIR: krnl's module built in DIR/build/cuda-h200 and copied into DIR/python/krnl
  (cd "$1" && cmake -S . -B build/cuda-h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(which python3)" &&
    cmake --build build/cuda-h200 -j16 && cp build/cuda-h200/_core*.so python/krnl/)
}
krnl_build() {  # 0 once krnl is built and imports with every capability an H200 must offer
  build_tree . > "$OUT/cmake.log" 2>&1 || { grep -E "error|FAILED" "$OUT/cmake.log" | head -40; return 1; }
  readelf -d python/krnl/_core*.so | grep -q "libstdc++" || { echo "the module links no libstdc++.so (a static, mismatched one?)"; return 1; }
  export PYTHONPATH=python:/tmp/site KRNL_TEST_METAL_SIM=0
  # The machine runs everything as root, which Open MPI's mpiexec refuses unless told (the nccl
  # phase, and the tests phase's tests/test_dist.py)
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  # What an H200 must offer: a missing capability fails here instead of turning its tests into skips.
  python3 - <<'PY' || return 1
import sys, krnl
print(krnl.devices(), krnl.unavailable_devices())
c = krnl.device("cuda").capabilities()
print("cuda capabilities:", c)
missing = [w for w, ok in (("bf16", "bf16" in c["dtypes"]), ("graphs", c["graphs"]),
                           ("fused attention bf16/f16", {"bf16", "f16"} <= set(c["fused_attention"]["dtypes"]))) if not ok]
sys.exit(f"missing on the H200: {', '.join(missing)}" if missing else 0)
PY
  grep "krnl: cuDNN" "$OUT/cmake.log"
}
