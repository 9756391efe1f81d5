#!/bin/bash
# The research probes that measured krnl's CUDA backend on the lent H200, one phase a device call,
# on the same set-up as tools/device/h200_check.sh (tools/device/h200_setup.sh: carry .whl as its
# header says). Not product checks: each phase's figures and what they decided are in
# dev/cuda/README.md and dev/performance-history.md (the logs: dev/results/).
#   bash dev/cuda/h200_probes.sh attention
#                                           every cuDNN attention engine at the train shapes
#                                           (dev/cuda/attention_probe.cpp, table in
#                                           $OUT/attention_probe.txt), then krnl's own calls alone
#                                           (dev/cuda/attention_alone.py)
#   bash dev/cuda/h200_probes.sh kernels every kernel of krnl's replayed train step on the 8b shape
#                                           (TRAIN_SHAPES to change; w3: W3's step), timed by the GPU
#                                           (dev/cuda/step_kernels.py; the list in
#                                           $OUT/kernels_SHAPE.tsv), with the SM clock and power
#                                           sampled alongside ($OUT/smi.csv)
#   bash dev/cuda/h200_probes.sh gemms [lora|frozen|layout|fused|capped]
#                                           dev/cuda/lora_gemm_probe.cu: the train shapes' GEMMs
#                                           (the LoRA products, the frozen ones, or the frozen ones
#                                           with each weight stored either way) through cuBLAS's
#                                           default and every cuBLASLt candidate (layout: the default
#                                           alone, round-robin over the shapes); fused: one-pass
#                                           kernels for a LoRA's dB and dt against cuBLAS's two
#                                           GEMMs; capped: the frozen ones' candidates back to back
#                                           at the power cap, with NVML's energy ($OUT/gemms_KIND.txt)
#   bash dev/cuda/h200_probes.sh probes  the LM head and the loss alone at the train shapes, chunk
#                                           sizes round-robin (dev/cuda/head_loss_probe.py); designs of
#                                           the cross-entropy kernel alone (dev/cuda/ce_probe.cu); what
#                                           the memsets in a recorded step are, and whether a recording can
#                                           carry them as kernel nodes (dev/cuda/memset_probe.cu, with
#                                           cuBLAS's own workspace and with one set by the caller); SwiGLU
#                                           with its LoRA products in one pass, launch shapes against the
#                                           plain pass (dev/cuda/swiglu_lora_variants.cu); $OUT/*.txt
#   bash dev/cuda/h200_probes.sh w3timing
#                                           krnl bench's W3 graph replayed under several timing patterns
#                                           (dev/cuda/w3_timing.py: samples after a pause, alone and
#                                           after the eager step's, back to back, queued, sustained),
#                                           then krnl bench's W3; the SM clock and the power sampled
#                                           every 50 ms alongside ($OUT/smi.csv)
#   bash dev/cuda/h200_probes.sh energy  a step's energy by part at the power cap: the 8b shape's and W3's frozen
#                                           products and attention, each recorded alone, and W3's whole step,
#                                           replayed back to back with NVML's energy counter read alongside
#                                           (dev/cuda/energy_budget.py; $OUT/energy_budget.txt); the 8b
#                                           step's own joules: the train phase's row
#   OLD=DIR bash dev/cuda/h200_probes.sh compare
#                                           a change's before and after in one call: DIR is an earlier
#                                           tree carried along (git archive REV | tar -x -C .hP/old),
#                                           built beside this one; krnl's Trainer on the 8b shape
#                                           (TRAIN_SHAPES) and W3, the two trees alternating
#                                           (dev/cuda/train_before_after.py; W3=0 leaves W3 out);
#                                           W3_KERNELS=1: then
#                                           each tree's W3 step kernel by kernel (step_kernels.py);
#                                           KNOB=VAR instead of OLD: this tree with VAR=0 as before
#                                           and VAR=1 as after (e.g. KRNL_LORA_FOLD)
#   bash dev/cuda/h200_probes.sh grouped    the MoE bench's grouped products: krnl's moe_gemm next to
#                                           torch._grouped_mm and a dense cuBLAS GEMM of the same FLOPs
#                                           (dev/cuda/grouped_mm_probe.py; $OUT/grouped_mm.txt)
phase=${1:-probes}
source tools/device/h200_setup.sh || exit 1
if [ "$phase" = compare ] && [ -z "$KNOB" ]; then
  [ -d "$OLD/python/krnl" ] || { echo "compare: OLD must name an earlier tree carried along, got '$OLD'"; exit 1; }
  build_tree "$OLD" > "$OUT/cmake_old.log" 2>&1 &
  old_build=$!
fi
krnl_build || exit 1
if [ "$phase" = attention ]; then
  # cudnn.h and libcudnn from the machine's nvidia-cudnn wheel, the frontend from .whl, nvrtc.h from the toolkit
  sp=$(python3 -c "import nvidia.cudnn as m, os; print(os.path.dirname(m.__path__[0]))") || exit 1
  nvrtc_h=$(find /usr/local/cuda* "$sp" -name nvrtc.h 2>/dev/null | head -1)
  g++ -O2 -std=c++17 -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING -I/tmp/site/include -I"$sp/cudnn/include" \
    -I"$(dirname "$nvrtc_h")" -I/usr/local/cuda/include -o /tmp/attention_probe dev/cuda/attention_probe.cpp \
    -L/usr/local/cuda/lib64 -lcudart -ldl || exit 1
  timeout ${PROBE_S:-240} /tmp/attention_probe "$(ls "$sp"/cudnn/lib/libcudnn.so.9* | head -1)" > "$OUT/attention_probe.txt" 2>&1
  echo "attention_probe: exit $?, $(grep -c ' plan ' "$OUT/attention_probe.txt") plans timed"
  timeout ${ALONE_S:-120} python3 dev/cuda/attention_alone.py 2>&1 | tee "$OUT/attention_alone.log"
elif [ "$phase" = kernels ]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit,clocks_event_reasons.active --format=csv -lms 250 \
    > "$OUT/smi.csv" &
  smi=$!
  for shape in ${TRAIN_SHAPES:-8b}; do  # w3: krnl bench's W3 step, replayed
    src=w3
    if [ "$shape" != w3 ]; then
      src=/tmp/train_$shape
      python3 dev/cuda/train_before_after.py write "$src" --shape "$shape" || exit 1
    fi
    timeout ${KERNELS_S:-300} python3 dev/cuda/step_kernels.py "$src" "$OUT/kernels_$shape.tsv" 2>&1 |
      grep -v Warning | tee "$OUT/kernels_$shape.log"
  done
  kill $smi
elif [ "$phase" = gemms ]; then
  nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/lora_gemm_probe dev/cuda/lora_gemm_probe.cu -ldl || exit 1
  lt=$(find /usr/local /opt /usr/lib -name 'libcublasLt.so.1[23]*' 2>/dev/null | head -1)
  timeout ${GEMMS_S:-300} /tmp/lora_gemm_probe "$CUB" "$lt" ${2:-lora} 2>&1 | tee "$OUT/gemms_${2:-lora}.txt"
elif [ "$phase" = probes ]; then
  nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc -o /tmp/ce_probe dev/cuda/ce_probe.cu || exit 1
  nvcc -O2 -arch=sm_90 -o /tmp/memset_probe dev/cuda/memset_probe.cu -ldl || exit 1
  nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc -o /tmp/swiglu_lora dev/cuda/swiglu_lora_variants.cu || exit 1
  timeout 120 /tmp/swiglu_lora 2>&1 | tee "$OUT/swiglu_lora.txt"
  timeout 120 python3 dev/cuda/head_loss_probe.py 2>&1 | tee "$OUT/head_loss.txt"
  timeout 120 /tmp/ce_probe 2>&1 | tee "$OUT/ce_probe.txt" | grep "TB/s"
  for ws in default workspace; do
    timeout 60 /tmp/memset_probe "$CUB" $ws > "$OUT/memset_$ws.txt" 2>&1
    grep -E "^recording|Destroy|^memsets|^instantiate|replay|^outputs" "$OUT/memset_$ws.txt" | sort | uniq -c | sed "s/^/$ws: /"
  done
elif [ "$phase" = w3timing ]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.draw.instant,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 50 > "$OUT/smi.csv" &
  smi=$!
  timeout ${W3T_S:-120} python3 dev/cuda/w3_timing.py 2>&1 | tee "$OUT/w3_timing.txt"
  timeout 150 python3 -m krnl.bench --workloads w3 --peers numpy --device cuda --rounds 5 2>&1 |
    grep -E "^w3|^ +krnl" | tee -a "$OUT/w3_timing.txt"
  kill $smi
elif [ "$phase" = grouped ]; then
  timeout 120 python3 dev/cuda/grouped_mm_probe.py 2>&1 | tee "$OUT/grouped_mm.txt"
elif [ "$phase" = energy ]; then
  timeout ${ENERGY_S:-240} python3 dev/cuda/energy_budget.py 2>&1 | tee "$OUT/energy_budget.txt"
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
    python3 dev/cuda/train_before_after.py write "/tmp/train_$shape" --shape "$shape" || exit 1
    for t in before after after before; do
      as $t timeout 150 python3 dev/cuda/train_before_after.py time "/tmp/train_$shape" --label "$shape $t" |
        tail -1 | tee -a "$OUT/compare_train.jsonl"
    done
  done
  for t in $([ "${W3:-1}" = 0 ] || echo before after after before); do  # W3=0: the train shapes alone
    as $t timeout 150 python3 -m krnl.bench --workloads w3 --peers numpy --device cuda --rounds 3 2>&1 |
      grep -E "^w3|^ +krnl" | sed "s/^/$t  /" | tee -a "$OUT/compare_w3.txt"
  done
  if [ -n "$W3_KERNELS" ]; then  # each tree's replayed W3 step kernel by kernel
    for t in before after; do
      as $t timeout 120 python3 dev/cuda/step_kernels.py w3 "$OUT/kernels_w3_$t.tsv" 2>&1 |
        grep -v Warning | head -${W3_KERNELS_TOP:-30} | sed "s/^/$t  /" | tee "$OUT/kernels_w3_$t.log"
    done
  fi
fi
