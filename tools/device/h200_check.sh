#!/bin/bash
# The CUDA check on a lent H200 (the workplace's device tool), in two phases, one device call each:
#   bash tools/device/h200_check.sh tests   build krnl with the CUDA backend there and run the test
#                                           suite (the Metal simulator and Objective-C files are left
#                                           to CI)
#   bash tools/device/h200_check.sh bench   pytest bench/test_gpu.py: krnl bench's session on cuda
#                                           (W1, W2, W3, GEMMs; peers), its JSON in $OUT/cuda_bench.json
#   bash tools/device/h200_check.sh build   the build alone (python/krnl then imports it)
#   bash tools/device/h200_check.sh qlora   tests/test_quantized.py on cuda, then `krnl bench --workloads qlora`:
#                                           the 8B-shaped QLoRA step, krnl next to PEFT on a
#                                           bitsandbytes NF4 base (JSON in $OUT/qlora_bench.json)
#   bash tools/device/h200_check.sh train   tests/test_step.py, the graph tests and the power meter's on cuda, then `krnl bench
#                                           --workloads train`: `krnl train` end to end on the 1b shape
#                                           (TRAIN_SHAPES="1b 8b" for both), krnl's Trainer (replayed and
#                                           eager) next to transformers + PEFT eager and compiled, and
#                                           mlx-lm where installed (JSON in $OUT/train_bench_SHAPE.json)
#   bash tools/device/h200_check.sh attention
#                                           every cuDNN attention engine at the train shapes
#                                           (tools/device/attention_probe.cpp, table in
#                                           $OUT/attention_probe.txt), then krnl's own calls alone
#                                           (tools/device/attention_alone.py)
#   bash tools/device/h200_check.sh kernels every kernel of krnl's replayed train step on the 8b shape
#                                           (TRAIN_SHAPES to change; w3: W3's step), timed by the GPU
#                                           (tools/device/step_kernels.py; the list in
#                                           $OUT/kernels_SHAPE.tsv), with the SM clock and power
#                                           sampled alongside ($OUT/smi.csv)
#   bash tools/device/h200_check.sh gemms [lora|frozen|layout|fused|capped]
#                                           tools/device/lora_gemm_probe.cu: the train shapes' GEMMs
#                                           (the LoRA products, the frozen ones, or the frozen ones
#                                           with each weight stored either way) through cuBLAS's
#                                           default and every cuBLASLt candidate (layout: the default
#                                           alone, round-robin over the shapes); fused: one-pass
#                                           kernels for a LoRA's dB and dt against cuBLAS's two
#                                           GEMMs; capped: the frozen ones' candidates back to back
#                                           at the power cap, with NVML's energy ($OUT/gemms_KIND.txt)
#   bash tools/device/h200_check.sh probes  the LM head and the loss alone at the train shapes, chunk
#                                           sizes round-robin (tools/device/head_loss_probe.py); designs of
#                                           the cross-entropy kernel alone (tools/device/ce_probe.cu); what
#                                           the memsets in a recorded step are, and whether a recording can
#                                           carry them as kernel nodes (tools/device/memset_probe.cu, with
#                                           cuBLAS's own workspace and with one set by the caller); SwiGLU
#                                           with its LoRA products in one pass, launch shapes against the
#                                           plain pass (tools/device/swiglu_lora_variants.cu); $OUT/*.txt
#   bash tools/device/h200_check.sh w3timing
#                                           krnl bench's W3 graph replayed under several timing patterns
#                                           (tools/device/w3_timing.py: samples after a pause, alone and
#                                           after the eager step's, back to back, queued, sustained),
#                                           then krnl bench's W3; the SM clock and the power sampled
#                                           every 50 ms alongside ($OUT/smi.csv)
#   bash tools/device/h200_check.sh energy  a step's energy by part at the power cap: the 8b shape's and W3's frozen
#                                           products and attention, each recorded alone, and W3's whole step,
#                                           replayed back to back with NVML's energy counter read alongside
#                                           (tools/device/energy_budget.py; $OUT/energy_budget.txt); the 8b
#                                           step's own joules: the train phase's row
#   OLD=DIR bash tools/device/h200_check.sh compare
#                                           a change's before and after in one call: DIR is an earlier
#                                           tree carried along (git archive REV | tar -x -C .hP/old),
#                                           built beside this one; krnl's Trainer on the 8b shape
#                                           (TRAIN_SHAPES) and W3, the two trees alternating
#                                           (tools/device/train_before_after.py; W3=0 leaves W3 out);
#                                           W3_KERNELS=1: then
#                                           each tree's W3 step kernel by kernel (step_kernels.py);
#                                           KNOB=VAR instead of OLD: this tree with VAR=0 as before
#                                           and VAR=1 as after (e.g. KRNL_LORA_FOLD)
#   bash tools/device/h200_check.sh nccl    on a machine with 2 or more GPUs (nvidia-h200-x2): tests/test_dist_nccl.py
#                                           and tests/test_dist.py (two CUDA ranks through NCCL against one GPU,
#                                           the loader, the fallback), then `krnl bench --workloads train --gpus 2`
#                                           on the 8b shape (TRAIN_SHAPES, GPUS to change): krnl and PyTorch DDP +
#                                           PEFT at 1 and 2 GPUs, JSON in $OUT/train_bench_gpus_SHAPE.json. The
#                                           machine's mpi4py and Open MPI launch the ranks (as root: allowed below)
#   bash tools/device/h200_check.sh metal-cuda
#                                           the unmodified metal/*.metal kernels on the H200
#                                           (tools/mslcuda): every test module's `dev` tests on the
#                                           "metal-cuda" device, then W1, W2, W3 at full size against
#                                           the CUDA backend (tools/mslcuda/workloads.py); with
#                                           SANITIZE="racecheck ..." the sanitize phase of those
#                                           tools runs alongside (one call where device time is short),
#                                           with CUDA_TESTS="tests/test_x.py ..." those modules' cuda
#                                           tests too
#   bash tools/device/h200_check.sh sanitize TOOL...
#                                           compute-sanitizer --tool TOOL (racecheck, synccheck,
#                                           initcheck, memcheck) over every kernel at 2-3 threadgroups
#                                           per dimension with ragged edges (tools/mslcuda/sanitize.py);
#                                           racecheck also runs gemm.metal copies with one barrier
#                                           deleted and fails unless it reports each; logs in $OUT
#   bash tools/device/h200_check.sh qmm     metal/quantized.metal alone on metal-cuda: tests/test_quantized.py's
#                                           metal-cuda tests and its kernels under compute-sanitizer
#                                           (SANITIZE tools, default "racecheck memcheck"; sanitize.py kernels
#                                           metal-cuda quantized), after, first and alone on the GPU,
#                                           tools/mslcuda/qmm_timing.py: the tiled, few-row and naive
#                                           quantized_matmul next to the dense GEMM at an 8B's shapes
#                                           ($OUT/qmm_timing.json)
#   MSLCUDA_CACHE (optional): a folder of mslcuda libraries built here with the same nvcc (13.0),
#          carried to skip the kernels' compile there (a stale one is simply rebuilt).
# The remote machine has Python, PyTorch, nvcc, cmake and ninja but no network, so wheels travel
# in ignored folders named in the call's carry:
#   .whl   what the build needs: the scipy-openblas32 wheel (the CPU backend's BLAS) and the
#          header-only cuDNN frontend's include/ folder as a tarball (the fused attention; cudnn.h
#          comes from the machine's nvidia-cudnn-cu13; the frontend's wheel is 11 MB, its headers
#          0.4 MB packed, which leaves room for .mlx1 in the same call):
#          python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#            --platform manylinux_2_28_x86_64 -d .whl scipy-openblas32 nvidia-cudnn-frontend
#          unzip -q .whl/nvidia_cudnn_frontend-*.whl 'include/*' -d /tmp/fe && rm .whl/nvidia_cudnn_frontend-*.whl
#          tar czf .whl/cudnn_frontend-include.tar.gz -C /tmp/fe include
#   .bnb   (qlora phase) bitsandbytes, unpacked from its wheel without the libraries of other CUDA
#          and ROCm versions (the wheel is 43 MB, its CUDA 13 part 4 MB):
#          unzip -q bitsandbytes-*.whl -d .bnb -x '*cuda1[12]*' '*rocm*' '*xpu*'
#   .mlx1, .mlx2  (optional, for the MLX CUDA peer) mlx's wheel and the two halves of mlx-cuda-13's
#          (90 MB, over one call's 64 MiB carry): `split -b 45m mlx_cuda_13-*.whl part_`, part_aa with
#          the mlx wheel in .mlx1 (carried by the tests call, which keeps it in /tmp/mlx), part_ab in
#          .mlx2 (carried by the bench call, made right after while the machine is warm).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/krnl-out}
mkdir -p "$OUT"
phase=${1:-tests}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
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
if [ "$phase" = compare ] && [ -z "$KNOB" ]; then
  [ -d "$OLD/python/krnl" ] || { echo "compare: OLD must name an earlier tree carried along, got '$OLD'"; exit 1; }
  build_tree "$OLD" > "$OUT/cmake_old.log" 2>&1 &
  old_build=$!
fi
if [ "$phase" = qmm ]; then  # the timing first: alone on the GPU, and it needs only nvcc (no build)
  export MSLCUDA_CACHE=${MSLCUDA_CACHE:-/tmp/mslcuda-cache}
  timeout ${QMM_S:-240} python3 tools/mslcuda/qmm_timing.py --json "$OUT/qmm_timing.json" 2>&1 |
    tee "$OUT/qmm_timing.log"
  timing_rc=$?
fi
build_tree . > "$OUT/cmake.log" 2>&1 || { grep -E "error|FAILED" "$OUT/cmake.log" | head -40; exit 1; }
readelf -d python/krnl/_core*.so | grep -q "libstdc++" || { echo "the module links no libstdc++.so (a static, mismatched one?)"; exit 1; }
export PYTHONPATH=python:/tmp/site KRNL_TEST_METAL_SIM=0
# The machine runs everything as root, which Open MPI's mpiexec refuses unless told (the nccl
# phase, and the tests phase's tests/test_dist.py)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# What an H200 must offer: a missing capability fails here instead of turning its tests into skips.
python3 - <<'PY' || exit 1
import sys, krnl
print(krnl.devices(), krnl.unavailable_devices())
c = krnl.device("cuda").capabilities()
print("cuda capabilities:", c)
missing = [w for w, ok in (("bf16", "bf16" in c["dtypes"]), ("graphs", c["graphs"]),
                           ("fused attention bf16/f16", {"bf16", "f16"} <= set(c["fused_attention"]["dtypes"]))) if not ok]
sys.exit(f"missing on the H200: {', '.join(missing)}" if missing else 0)
PY
grep "krnl: cuDNN" "$OUT/cmake.log"

if [ "$phase" = tests ]; then
  [ -d .mlx1 ] && mkdir -p /tmp/mlx && cp .mlx1/* /tmp/mlx/
  skip=""
  for f in test_mslsim test_metal_kernels test_metal_kernels_backward test_metal_kernels_extra test_metal_kernels_gemm \
           test_metal_kernels_loss_optim test_metal_host test_metal_dialect test_metal_api test_mslcuda; do
    skip="$skip --ignore=tests/$f.py"
  done
  timeout 330 python3 -m pytest -q -n 12 -p no:cacheprovider tests $skip 2>&1 | tee "$OUT/tests.log" | tail -15
elif [ "$phase" = metal-cuda ] || [ "$phase" = sanitize ] || [ "$phase" = qmm ]; then
  export MSLCUDA_CACHE=${MSLCUDA_CACHE:-/tmp/mslcuda-cache}
  # every library once, in parallel, before any test process needs one
  python3 -c "import sys; sys.path.insert(0, 'tools/mslcuda'); import mslcuda.metal_cuda as m; ex = m.Executor('.'); ex.warm(); print('mslcuda:', len(ex.variants()), 'libraries on', ex.rt.device_name())" || exit 1
  sanitize() {  # sanitize TOOL: every kernel under compute-sanitizer; 0 when it reports nothing
    local tool=$1 log="$OUT/sanitize_$1.log" rc=0
    timeout ${SAN_S:-200} compute-sanitizer --tool "$tool" --print-limit 20 python3 tools/mslcuda/sanitize.py kernels \
      metal-cuda $SAN_ONLY > "$log" 2>&1
    grep -E "SUMMARY|kernels not run|mslcuda sanitize|Device not supported|Error|rror:" "$log" | head -8 | sed "s/^/$tool: /"
    if [ "$tool" = racecheck ]; then
      # racecheck files hazards as warnings: count both (the numbers alone did not catch a race)
      grep -qE "RACECHECK SUMMARY: 0 hazards displayed \(0 errors, 0 warnings\)" "$log" || rc=1
      # SAN_ONLY (one library): without the deleted-barrier checks of gemm.metal
      [ -n "$SAN_ONLY" ] && { echo "sanitize $tool: $([ $rc = 0 ] && echo clean || echo FINDINGS)"; return $rc; }
      for n in 0 1 2 3; do python3 tools/mslcuda/sanitize.py barrier $n --build-only & done; wait  # nvcc outside
      for n in 0 1 2 3; do  # 0: gemm.metal as it is; n: its n-th threadgroup_barrier deleted
        timeout 100 compute-sanitizer --tool racecheck --print-limit 5 python3 tools/mslcuda/sanitize.py barrier $n \
          > "$OUT/racecheck_barrier$n.log" 2>&1 &
      done
      wait
      for n in 0 1 2 3; do
        h=$(grep -oE "RACECHECK SUMMARY: [0-9]+ hazards" "$OUT/racecheck_barrier$n.log" | grep -oE "[0-9]+")
        echo "racecheck barrier $n: ${h:-no summary} hazards; $(grep -h 'gemm.metal' "$OUT/racecheck_barrier$n.log" | tail -1)"
        grep -h "RACECHECK SUMMARY" "$OUT/racecheck_barrier$n.log"
        if [ "$n" = 0 ]; then [ "${h:-x}" = 0 ] || rc=1; else [ "${h:-0}" -gt 0 ] || { echo "racecheck missed deleted barrier $n"; rc=1; }; fi
      done
    else
      grep -qE "ERROR SUMMARY: 0 errors" "$log" || rc=1
    fi
    echo "sanitize $tool: $([ $rc = 0 ] && echo clean || echo FINDINGS)"
    return $rc
  }
  sanitize_all() {  # the tools at once (each its own process on the one GPU); 0 when all are clean
    local rc=0 tool
    for tool in "$@"; do sanitize "$tool" > "$OUT/sanitize_$tool.out" 2>&1 & done
    for tool in "$@"; do wait -n || rc=1; done
    cat "$OUT"/sanitize_*.out
    return $rc
  }
  if [ "$phase" = sanitize ]; then
    shift
    sanitize_all "${@:-racecheck}"
    exit $?
  fi
  if [ "$phase" = qmm ]; then
    SAN_ONLY=quantized sanitize_all ${SANITIZE:-racecheck memcheck} > "$OUT/sanitize.out" 2>&1 &
    san=$!
    KRNL_TEST_METAL_CUDA=1 timeout ${MC_TESTS_S:-240} python3 -m pytest -q -rs -n 8 -p no:cacheprovider \
      tests/test_quantized.py -k "metal-cuda" 2>&1 | tee "$OUT/metal_cuda_tests.log" | tail -8
    wait $san; rc=$?
    cat "$OUT/sanitize.out"
    exit $(( rc || timing_rc ))
  fi
  if [ -n "$SANITIZE" ]; then
    sanitize_all $SANITIZE > "$OUT/sanitize.out" 2>&1 &
  fi
  if [ -n "$CUDA_TESTS" ]; then  # test modules whose cuda tests run alongside (a change touching both)
    timeout ${MC_TESTS_S:-300} python3 -m pytest -q -n 4 -p no:cacheprovider $CUDA_TESTS -k "cuda and not metal-cuda" \
      > "$OUT/cuda_tests.log" 2>&1 &
  fi
  # the whole suite's `dev` tests on metal-cuda (cpu and cuda ran in the tests phase)
  KRNL_TEST_METAL_CUDA=1 timeout ${MC_TESTS_S:-300} python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests \
    --ignore=tests/test_metal_host.py --ignore=tests/test_metal_api.py -k "metal-cuda" --maxfail=50 \
    2>&1 | tee "$OUT/metal_cuda_tests.log" | tail -40
  KRNL_TEST_METAL_CUDA=1 timeout ${MC_WORKLOADS_S:-200} python3 tools/mslcuda/workloads.py --json "$OUT/workloads.json" \
    2>&1 | tee "$OUT/workloads.log"
  wait
  [ -f "$OUT/cuda_tests.log" ] && tail -12 "$OUT/cuda_tests.log"
  [ -f "$OUT/sanitize.out" ] && cat "$OUT/sanitize.out"
elif [ "$phase" = bench ]; then
  if [ -f /tmp/mlx/part_aa ] && [ -f .mlx2/part_ab ]; then
    # into the interpreter's own site-packages: libmlx.so finds the CUDA libraries of the nvidia-*
    # wheels PyTorch installed there through its rpath ($ORIGIN/../../nvidia/...)
    cat /tmp/mlx/part_aa .mlx2/part_ab > /tmp/mlx/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl &&
      python3 -m pip install -q --no-index --no-deps --no-compile /tmp/mlx/mlx-*.whl /tmp/mlx/mlx_cuda_13-*.whl &&
      python3 -c "import mlx.core as mx; print('mlx', mx.__version__, 'gpu:', mx.is_available(mx.gpu))"
  fi
  KRNL_BENCH_JSON="$OUT/cuda_bench.json" timeout ${BENCH_S:-540} python3 -m pytest -q -s -p no:cacheprovider \
    bench/test_gpu.py 2>&1 | tee "$OUT/bench.log" | grep -v "^\s*$" | tail -120
elif [ "$phase" = qlora ]; then
  timeout ${QTESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_quantized.py -k "cuda" 2>&1 | tail -5
  [ -d .bnb ] && export PYTHONPATH=$PYTHONPATH:$PWD/.bnb
  timeout ${BENCH_S:-400} python3 -m krnl.bench --workloads qlora --peers torch --rounds 1 ${QLORA_PROFILE:+--profile} --json "$OUT/qlora_bench.json" \
    2>&1 | tee "$OUT/qlora_bench.log" | tail -30
elif [ "$phase" = nccl ]; then
  nvidia-smi -L
  timeout ${NTESTS_S:-300} python3 -m pytest -q -rs -p no:cacheprovider tests/test_dist_nccl.py tests/test_dist.py 2>&1 |
    tee "$OUT/nccl_tests.log" | tail -15
  for shape in ${TRAIN_SHAPES:-8b}; do
    timeout ${BENCH_S:-500} python3 -m krnl.bench --workloads train --train-shape "$shape" --gpus ${GPUS:-2} \
      --peers torch --rounds 1 --json "$OUT/train_bench_gpus_$shape.json" 2>&1 |
      tee "$OUT/train_bench_gpus_$shape.log" | tail -${TRAIN_TAIL:-20}
  done
elif [ "$phase" = attention ]; then
  # cudnn.h and libcudnn from the machine's nvidia-cudnn wheel, the frontend from .whl, nvrtc.h from the toolkit
  sp=$(python3 -c "import nvidia.cudnn as m, os; print(os.path.dirname(m.__path__[0]))") || exit 1
  nvrtc_h=$(find /usr/local/cuda* "$sp" -name nvrtc.h 2>/dev/null | head -1)
  g++ -O2 -std=c++17 -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING -I/tmp/site/include -I"$sp/cudnn/include" \
    -I"$(dirname "$nvrtc_h")" -I/usr/local/cuda/include -o /tmp/attention_probe tools/device/attention_probe.cpp \
    -L/usr/local/cuda/lib64 -lcudart -ldl || exit 1
  timeout ${PROBE_S:-240} /tmp/attention_probe "$(ls "$sp"/cudnn/lib/libcudnn.so.9* | head -1)" > "$OUT/attention_probe.txt" 2>&1
  echo "attention_probe: exit $?, $(grep -c ' plan ' "$OUT/attention_probe.txt") plans timed"
  timeout ${ALONE_S:-120} python3 tools/device/attention_alone.py 2>&1 | tee "$OUT/attention_alone.log"
elif [ "$phase" = train ]; then
  # the step's own tests first (the replayed step against the eager one, the graph arena)
  timeout ${TTESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_step.py tests/test_cuda.py \
    -k "step or graph or arena or trainer or gpu_power" 2>&1 | tail -6
  for shape in ${TRAIN_SHAPES:-1b}; do  # TRAIN_PEERS_<shape>: other peers; TRAIN_PROFILE=1: an eager step's profile
    peers=TRAIN_PEERS_$shape
    timeout ${BENCH_S:-540} python3 -m krnl.bench --workloads train --peers "${!peers:-torch,torch.compile,mlx}" \
      --rounds 1 --train-shape "$shape" ${TRAIN_PROFILE:+--profile} --json "$OUT/train_bench_$shape.json" 2>&1 |
      tee "$OUT/train_bench_$shape.log" | tail -${TRAIN_TAIL:-30}
  done
elif [ "$phase" = kernels ]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit,clocks_event_reasons.active --format=csv -lms 250 \
    > "$OUT/smi.csv" &
  smi=$!
  for shape in ${TRAIN_SHAPES:-8b}; do  # w3: krnl bench's W3 step, replayed
    src=w3
    if [ "$shape" != w3 ]; then
      src=/tmp/train_$shape
      python3 tools/device/train_before_after.py write "$src" --shape "$shape" || exit 1
    fi
    timeout ${KERNELS_S:-300} python3 tools/device/step_kernels.py "$src" "$OUT/kernels_$shape.tsv" 2>&1 |
      grep -v Warning | tee "$OUT/kernels_$shape.log"
  done
  kill $smi
elif [ "$phase" = gemms ]; then
  nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/lora_gemm_probe tools/device/lora_gemm_probe.cu -ldl || exit 1
  lt=$(find /usr/local /opt /usr/lib -name 'libcublasLt.so.1[23]*' 2>/dev/null | head -1)
  timeout ${GEMMS_S:-300} /tmp/lora_gemm_probe "$CUB" "$lt" ${2:-lora} 2>&1 | tee "$OUT/gemms_${2:-lora}.txt"
elif [ "$phase" = probes ]; then
  nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc -o /tmp/ce_probe tools/device/ce_probe.cu || exit 1
  nvcc -O2 -arch=sm_90 -o /tmp/memset_probe tools/device/memset_probe.cu -ldl || exit 1
  nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc -o /tmp/swiglu_lora tools/device/swiglu_lora_variants.cu || exit 1
  timeout 120 /tmp/swiglu_lora 2>&1 | tee "$OUT/swiglu_lora.txt"
  timeout 120 python3 tools/device/head_loss_probe.py 2>&1 | tee "$OUT/head_loss.txt"
  timeout 120 /tmp/ce_probe 2>&1 | tee "$OUT/ce_probe.txt" | grep "TB/s"
  for ws in default workspace; do
    timeout 60 /tmp/memset_probe "$CUB" $ws > "$OUT/memset_$ws.txt" 2>&1
    grep -E "^recording|Destroy|^memsets|^instantiate|replay|^outputs" "$OUT/memset_$ws.txt" | sort | uniq -c | sed "s/^/$ws: /"
  done
elif [ "$phase" = w3timing ]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.draw.instant,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 50 > "$OUT/smi.csv" &
  smi=$!
  timeout ${W3T_S:-120} python3 tools/device/w3_timing.py 2>&1 | tee "$OUT/w3_timing.txt"
  timeout 150 python3 -m krnl.bench --workloads w3 --peers numpy --device cuda --rounds 5 2>&1 |
    grep -E "^w3|^ +krnl" | tee -a "$OUT/w3_timing.txt"
  kill $smi
elif [ "$phase" = energy ]; then
  timeout ${ENERGY_S:-240} python3 tools/device/energy_budget.py 2>&1 | tee "$OUT/energy_budget.txt"
elif [ "$phase" = compare ]; then
  [ -n "$KNOB" ] || wait $old_build || { tail -20 "$OUT/cmake_old.log"; exit 1; }
  as() {  # as before|after CMD...: CMD on the earlier tree, or on this one with $KNOB=0 (before) or 1
    if [ -n "$KNOB" ]; then
      env "$KNOB=$([ "$1" = before ] && echo 0 || echo 1)" PYTHONPATH=python:/tmp/site "${@:2}"
    else
      env PYTHONPATH="$([ "$1" = before ] && echo "$OLD/python" || echo python):/tmp/site" "${@:2}"
    fi
  }
  for shape in ${TRAIN_SHAPES:-8b}; do
    python3 tools/device/train_before_after.py write "/tmp/train_$shape" --shape "$shape" || exit 1
    for t in before after after before; do
      as $t timeout 150 python3 tools/device/train_before_after.py time "/tmp/train_$shape" --label "$shape $t" |
        tail -1 | tee -a "$OUT/compare_train.jsonl"
    done
  done
  for t in $([ "${W3:-1}" = 0 ] || echo before after after before); do  # W3=0: the train shapes alone
    as $t timeout 150 python3 -m krnl.bench --workloads w3 --peers numpy --device cuda --rounds 3 2>&1 |
      grep -E "^w3|^ +krnl" | sed "s/^/$t  /" | tee -a "$OUT/compare_w3.txt"
  done
  if [ -n "$W3_KERNELS" ]; then  # each tree's replayed W3 step kernel by kernel
    for t in before after; do
      as $t timeout 120 python3 tools/device/step_kernels.py w3 "$OUT/kernels_w3_$t.tsv" 2>&1 |
        grep -v Warning | head -${W3_KERNELS_TOP:-30} | sed "s/^/$t  /" | tee "$OUT/kernels_w3_$t.log"
    done
  fi
fi
