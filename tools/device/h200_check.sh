#!/bin/bash
# The CUDA check on a lent H200 (the workplace's device tool), one phase a device call (the research
# probes that measured the CUDA backend have their own script: dev/cuda/h200_probes.sh):
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
#   bash tools/device/h200_check.sh peers   the train, long and qlora workloads with Liger and Unsloth beside PEFT
#                                           (`krnl bench --workloads W --peers torch,liger,unsloth --rounds 1`;
#                                           .peers below carried with .whl), one workload a call to stay inside
#                                           10 minutes: PEERS_WORKLOADS=train (default; TRAIN_SHAPE 8b, or 1b),
#                                           long (the 8b shape at 16k and 32k tokens a row, checkpointed;
#                                           LONG_SEQ=16384 for one of them; LONG_SEQ=4096 LONG_BATCH=2:
#                                           the train workload's 8b shape checkpointed) or
#                                           qlora; several at once where time allows. JSON in
#                                           $OUT/peers_bench_W.json; PEERS to pick other peers
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
#                                           tests too; MC_MODULES="tests/test_x.py ..." runs only those
#                                           modules on metal-cuda, without the workloads unless
#                                           MC_WORKLOADS="moe ..." names some
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
#   bash tools/device/h200_check.sh moebench  `krnl bench --workloads moe`: a Qwen3-30B-A3B-shaped stack, krnl in
#                                           bf16 and with 4-bit experts next to transformers + PEFT (JSON in
#                                           $OUT/moe_bench.json; MOE_PROFILE=1 adds krnl's op profile, MOE_PEERS=mlx
#                                           leaves PEFT out)
#   bash tools/device/h200_check.sh pref    tests/test_generate_batch.py's cuda tests (the recorded decoding steps), then
#                                           `krnl bench --workloads dpo,grpo,serve` on the 1b shape: a DPO step next to
#                                           TRL's DPOTrainer, GRPO's generation next to transformers' generate and its
#                                           step next to TRL's GRPOTrainer loss, timed apart, and `krnl serve` under 1,
#                                           4 and 16 streaming clients next to transformers' generate (JSON in
#                                           $OUT/pref_bench.json; TRL from .trl, uvicorn and Starlette from .whl,
#                                           below; PREF_WORKLOADS to pick; PREF_PROFILE=1 adds krnl's op profiles)
#   bash tools/device/h200_check.sh full    full fine-tuning (--fine-tune-type full): tests/test_full.py's step on cuda
#                                           against the CPU, then `krnl bench --workloads full`: the 1b shape's
#                                           layers trained whole next to transformers' full fine-tuning in f32 +
#                                           bf16 autocast and in bf16 (JSON in $OUT/full_bench.json)
#   bash tools/device/h200_check.sh moe     the mixture-of-experts ops of csrc/cuda/moe.cu and moe_quantized.cu
#                                           and gpt-oss's (MXFP4 products, attention sinks, clamped SwiGLU):
#                                           their cuda tests (tests/test_moe_ops.py, tests/test_mxfp4.py, the
#                                           sinks/swiglu tests of tests/test_ops.py, the moe tests of
#                                           tests/test_cuda.py and tests/test_cuda_host.py), then
#                                           tests/test_moe_ops.py's and tests/test_mxfp4.py's cuda tests under
#                                           compute-sanitizer (SANITIZE tools, default "memcheck racecheck
#                                           synccheck"; logs in $OUT/moe_sanitize_TOOL.log)
#   MSLCUDA_CACHE (optional): a folder of mslcuda libraries built here with the same nvcc (13.0),
#          carried to skip the kernels' compile there (a stale one is simply rebuilt); or carry .mslcache
#          holding them as a tarball (17 MiB packed; every variant's .so is 44 MiB), which the phase unpacks:
#          MSLCUDA_CACHE=/tmp/mc python3 -c "import sys; sys.path[:0] = ['tools/mslcuda', 'tools/mslsim']
#          import mslcuda, mslsim.metal_sim as m; c = m.LibraryCache(__import__('pathlib').Path('.'), mslcuda.build)
#          [mslcuda.build(f'metal/{n}.metal', dict(k), include_dirs=c.include_dirs, load=False) for n, k in c.variants()]
#          mslcuda._compile('mslcuda_rt', (mslcuda.INCLUDE_DIR / 'mslcuda_rt.cu').read_text(), '-O2', 'mslcuda_rt.cu')"
#          mkdir -p .mslcache; tar czf .mslcache/libs.tgz -C /tmp/mc .
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
#          and, for the pref phase's serve workload, `pip download --no-deps -d .whl uvicorn starlette` (pure
#          Python; the image has their anyio, click and h11)
#   .bnb   (qlora phase) bitsandbytes, unpacked from its wheel without the libraries of other CUDA
#          and ROCm versions (the wheel is 43 MB, its CUDA 13 part 4 MB):
#          unzip -q bitsandbytes-*.whl -d .bnb -x '*cuda1[12]*' '*rocm*' '*xpu*'
#   .trl   (pref phase) TRL and what it needs beyond the image's packages (torch 2.11, transformers
#          5.17, PEFT, accelerate, pyarrow, pandas, xxhash, fsspec, requests, tqdm): 1.7 MB of
#          pure-Python wheels. trl 1.16.0 asks for transformers >= 4.56.2 (ran here against 5.17);
#          datasets 4.8.5, the last 4.x, for its loose needs (huggingface-hub >= 0.25, < 2 as transformers
#          5.17's; pyarrow >= 21), where datasets 5.2 wants hub >= 1.31 and pyarrow >= 24; dill and
#          multiprocess in the ranges it takes. Without .trl the TRL rows are skipped, saying so:
#          python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#            -d .trl trl==1.16.0 datasets==4.8.5 dill==0.4.0 multiprocess==0.70.18
#   .peers (peers phase) Liger, Unsloth and what they need beyond the image, one tarball of a
#          site-packages tree unpacked into /tmp/site there (13.3 MiB; with .whl's 8.4 and the tree's
#          4.6 a call carries about 26.5 of its 64). liger-kernel 0.8.5; unsloth and unsloth_zoo
#          2026.10.9, which take transformers <= 5.17.0 (the image's) and torch < 2.15, without
#          unsloth's 82 MB `studio` web app and its CLI; what unsloth imports unguarded on a GPU and
#          the image lacks: trl 1.15.0 (unsloth takes <= 1.15.0) and datasets 4.8.5 with dill and
#          multiprocess (as .trl); bitsandbytes 0.50.2 for the 4-bit rows, CUDA 13 libraries only (as
#          .bnb). Left out, each optional where unsloth imports it: xformers and flash-attn (attention
#          on PyTorch's SDPA then; the row's note names it), torchao, cut_cross_entropy (which unsloth
#          turns off from torch 2.8), diffusers, hf_transfer. `import unsloth` from this tree ran on a
#          CPU (torch 2.13, transformers 5.25: unsloth's CPU path); its GPU path has been read, not run:
#          d=/tmp/peers-dl; python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
#            --platform manylinux_2_17_x86_64 -d $d liger-kernel==0.8.5 unsloth==2026.10.9 unsloth_zoo==2026.10.9 \
#            trl==1.15.0 datasets==4.8.5 dill==0.4.0 multiprocess==0.70.18 bitsandbytes==0.50.2
#          mkdir -p $d/site .peers; for w in $d/*.whl; do unzip -qo $w -d $d/site -x 'studio/*' 'unsloth_cli/*' \
#            '*cuda1[12]*' '*rocm*' '*xpu*' '*.data/*'; done; tar czf .peers/site.tar.gz -C $d/site .
#          (unzip's cautions about a pattern a wheel does not hold are harmless)
#   .mlx1, .mlx2  (optional, for the MLX CUDA peer) mlx's wheel and the two halves of mlx-cuda-13's
#          (90 MB, over one call's 64 MiB carry): `split -b 45m mlx_cuda_13-*.whl part_`, part_aa with
#          the mlx wheel in .mlx1 (carried by the tests call, which keeps it in /tmp/mlx), part_ab in
#          .mlx2 (carried by the bench call, made right after while the machine is warm).
phase=${1:-tests}
source tools/device/h200_setup.sh || exit 1
if [ "$phase" = qmm ]; then  # the timing first: alone on the GPU, and it needs only nvcc (no build)
  export MSLCUDA_CACHE=${MSLCUDA_CACHE:-/tmp/mslcuda-cache}
  timeout ${QMM_S:-240} python3 tools/mslcuda/qmm_timing.py --json "$OUT/qmm_timing.json" 2>&1 |
    tee "$OUT/qmm_timing.log"
  timing_rc=$?
fi
krnl_build || exit 1

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
  # .mslcache/*.tgz (carried): libraries built here, unpacked into the cache
  for t in .mslcache/*.tgz; do [ -f "$t" ] && mkdir -p "$MSLCUDA_CACHE" && tar xzf "$t" -C "$MSLCUDA_CACHE"; done
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
  # (MC_MODULES="tests/test_x.py ...": those modules alone, without the workloads)
  KRNL_TEST_METAL_CUDA=1 timeout ${MC_TESTS_S:-300} python3 -m pytest -q -rs -n 12 -p no:cacheprovider ${MC_MODULES:-tests} \
    --ignore=tests/test_metal_host.py --ignore=tests/test_metal_api.py -k "metal-cuda" --maxfail=50 \
    2>&1 | tee "$OUT/metal_cuda_tests.log" | tail -40
  # MC_WORKLOADS="moe ...": those workloads (also beside MC_MODULES); default all four without MC_MODULES
  { [ -z "$MC_MODULES" ] || [ -n "$MC_WORKLOADS" ]; } && KRNL_TEST_METAL_CUDA=1 timeout ${MC_WORKLOADS_S:-260} \
    python3 tools/mslcuda/workloads.py --workloads ${MC_WORKLOADS:-w1 w2 w3 moe} --json "$OUT/workloads.json" 2>&1 |
    tee "$OUT/workloads.log"
  wait
  [ -f "$OUT/cuda_tests.log" ] && tail -12 "$OUT/cuda_tests.log"
  [ -f "$OUT/sanitize.out" ] && cat "$OUT/sanitize.out"
elif [ "$phase" = moe ]; then
  timeout ${MOE_TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider tests/test_moe_ops.py tests/test_mxfp4.py \
    tests/test_ops.py tests/test_cuda.py tests/test_cuda_host.py \
    -k "(moe or mxfp4 or sinks or swiglu) and not cpu and not metal" 2>&1 | tee "$OUT/moe_tests.log" | tail -15
  rc=0
  for tool in ${SANITIZE:-memcheck racecheck synccheck}; do
    log="$OUT/moe_sanitize_$tool.log"
    timeout ${SAN_S:-300} compute-sanitizer --tool "$tool" --print-limit 20 python3 -m pytest -q -p no:cacheprovider \
      tests/test_moe_ops.py tests/test_mxfp4.py -k "cuda" > "$log" 2>&1
    grep -E "SUMMARY|passed|failed" "$log" | tail -3 | sed "s/^/$tool: /"
    if [ "$tool" = racecheck ]; then  # racecheck files hazards as warnings: both must be 0
      grep -qE "RACECHECK SUMMARY: 0 hazards displayed \(0 errors, 0 warnings\)" "$log" || rc=1
    else
      grep -qE "ERROR SUMMARY: 0 errors" "$log" || rc=1
    fi
  done
  echo "moe sanitize: $([ $rc = 0 ] && echo clean || echo FINDINGS)"
  exit $rc
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
elif [ "$phase" = moebench ]; then
  timeout ${BENCH_S:-500} python3 -m krnl.bench --workloads moe --peers ${MOE_PEERS:-torch} --rounds 1 ${MOE_PROFILE:+--profile} \
    --json "$OUT/moe_bench.json" 2>&1 | tee "$OUT/moe_bench.log" | tail -30
elif [ "$phase" = full ]; then
  timeout ${TTESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_full.py -k "device_step" 2>&1 | tail -4
  timeout ${BENCH_S:-400} python3 -m krnl.bench --workloads full --peers torch --rounds 1 ${FULL_PROFILE:+--profile} \
    --json "$OUT/full_bench.json" 2>&1 | tee "$OUT/full_bench.log" | tail -20
elif [ "$phase" = pref ]; then
  # batched generation on cuda first: FixedDecoder's recorded steps against generate() and decode_groups
  timeout ${PTESTS_S:-120} python3 -m pytest -q -p no:cacheprovider tests/test_generate_batch.py -k cuda 2>&1 | tail -4
  # next to .whl's packages in /tmp/site, which PYTHONPATH puts ahead of the image's own
  if [ -d .trl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .trl/*.whl &&
      python3 -c "import trl, datasets, transformers; print('trl', trl.__version__, 'datasets', datasets.__version__, 'transformers', transformers.__version__)"
  else
    echo "no .trl folder carried: the TRL rows will be skipped"
  fi
  timeout ${BENCH_S:-500} python3 -m krnl.bench --workloads ${PREF_WORKLOADS:-dpo,grpo,serve} --peers torch --rounds 1 ${PREF_PROFILE:+--profile} \
    --json "$OUT/pref_bench.json" 2>&1 | tee "$OUT/pref_bench.log" | tail -30
elif [ "$phase" = qlora ]; then
  timeout ${QTESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_quantized.py -k "cuda" 2>&1 | tail -5
  [ -d .bnb ] && export PYTHONPATH=$PYTHONPATH:$PWD/.bnb
  timeout ${BENCH_S:-400} python3 -m krnl.bench --workloads qlora --peers torch --rounds 1 ${QLORA_PROFILE:+--profile} --json "$OUT/qlora_bench.json" \
    2>&1 | tee "$OUT/qlora_bench.log" | tail -30
elif [ "$phase" = peers ]; then
  if [ -f .peers/site.tar.gz ]; then  # into /tmp/site, which PYTHONPATH holds (h200_setup.sh)
    tar xzf .peers/site.tar.gz -C /tmp/site && python3 - <<'PY'
import importlib.metadata as m
def version(d):
    try:
        return m.version(d)
    except m.PackageNotFoundError:
        return "absent"
names = ("liger-kernel", "unsloth", "unsloth_zoo", "trl", "datasets", "bitsandbytes", "transformers", "peft", "torch",
         "triton", "xformers", "flash-attn")
print("peers:", ", ".join(f"{d} {version(d)}" for d in names))
PY
  else
    echo "no .peers folder carried: the Liger and Unsloth rows will say they are not installed"
  fi
  for wl in ${PEERS_WORKLOADS:-train}; do
    shape=""; [ "$wl" = train ] && shape="--train-shape ${TRAIN_SHAPE:-8b}"
    [ "$wl" = long ] && [ -n "$LONG_SEQ" ] && shape="--train-seq $LONG_SEQ"  # one length a call
    [ "$wl" = long ] && [ -n "$LONG_BATCH" ] && shape="$shape --train-batch $LONG_BATCH"
    timeout ${BENCH_S:-480} python3 -m krnl.bench --workloads "$wl" $shape --peers "${PEERS:-torch,liger,unsloth}" \
      --rounds 1 --json "$OUT/peers_bench_$wl.json" 2>&1 | tee "$OUT/peers_bench_$wl.log" | tail -${PEERS_TAIL:-40}
  done
elif [ "$phase" = nccl ]; then
  nvidia-smi -L
  timeout ${NTESTS_S:-300} python3 -m pytest -q -rs -p no:cacheprovider tests/test_dist_nccl.py tests/test_dist.py 2>&1 |
    tee "$OUT/nccl_tests.log" | tail -15
  for shape in ${TRAIN_SHAPES:-8b}; do
    timeout ${BENCH_S:-500} python3 -m krnl.bench --workloads train --train-shape "$shape" --gpus ${GPUS:-2} \
      --peers torch --rounds 1 --json "$OUT/train_bench_gpus_$shape.json" 2>&1 |
      tee "$OUT/train_bench_gpus_$shape.log" | tail -${TRAIN_TAIL:-20}
  done
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
fi
