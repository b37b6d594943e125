#!/usr/bin/env bash
# The RULER measurement of issue 6: every spec in specs/ at 10/5/3/1% on the tasks dense SmolLM2 can do, 4K and 8K.
#
#   bash benchmarks/ruler_sweep.sh [RANKS_PER_GPU] [OUT_ROOT]    # default 14 ranks per GPU (1 process on a CPU)
#   OA_MPS=1 bash benchmarks/ruler_sweep.sh                      # also start CUDA MPS first (see below)
#   OA_BATCH_8K=8 bash benchmarks/ruler_sweep.sh                 # samples per batch at 8K (default 4; OA_BATCH_4K: 8)
#
# A 135M model cannot fill an H200: a decode step is bound by its kernel launches and host waits. So the sweep runs
# many torchrun ranks per GPU, each decoding a batch of 8 samples (4 at 8K: a batch's 8K prefill is large). Without
# CUDA MPS those ranks time-slice the GPU and gain little (14 ranks on one H200: about 2 s per sample and cell); under
# MPS their kernels run side by side (28 ranks on two H200s: about 0.2 s). OA_MPS=1 starts the MPS daemon if none
# is running (nvidia-cuda-mps-control -d, as root, no GPU setting changed; `echo quit | nvidia-cuda-mps-control`
# stops it).
#
# Phases, each resumable (a rerun skips the cells already under OUT_ROOT/ruler_c3f5e3b_smollm2_{4k,8k}, named for the
# RULER generator: a folder holds one generator's records; a phase whose cells ran out of memory says so and the
# script goes on: run it again to retry them):
#   1-2. dense on all eleven tasks at 4K and 8K (the reference, and which tasks the model can do: dense score >= 20)
#   3. the baselines and OpenAttention on the 4K tasks;  4. the ablations at 4K;  5. the baselines at 8K
# Then `oa report` writes each folder's summary, report.md and plots.
set -uo pipefail
PER_GPU=${1:-14}
ROOT=${2:-benchmarks/results}
B4=${OA_BATCH_4K:-8} B8=${OA_BATCH_8K:-4}
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -gt 0 ]; then
  DEVICE=cuda RANKS=$((PER_GPU * GPUS))
  if [ "${OA_MPS:-0}" = 1 ] && ! pgrep -x nvidia-cuda-mps-control > /dev/null; then nvidia-cuda-mps-control -d; fi
else
  DEVICE=cpu RANKS=1
fi
MAIN="specs/dense.yaml specs/openattention.yaml specs/oracle-topk.yaml specs/quest.yaml specs/magicpig.yaml
      specs/vattention.yaml specs/retroinfer.yaml specs/openattention-paper.yaml"
ABLATIONS="specs/dense.yaml $(ls specs/ablate-*.yaml | tr '\n' ' ')"
TASKS="niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 niah_multivalue
       niah_multiquery vt cwe fwe"

run() {  # length batch specs tasks...
  local length=$1 batch=$2 specs=$3; shift 3
  if [ $# -eq 0 ]; then echo "$(date +%T) ${length} tokens: no task to run"; return; fi
  echo "$(date +%T) ${length} tokens: $(echo $specs | wc -w) specs on $*"
  torchrun --nproc-per-node "$RANKS" --master-port 29561 -m oa_core.cli eval --specs $specs --tasks "$@" \
    --densities 0.1 0.05 0.03 0.01 \
    --length "$length" --samples 20 --batch "$batch" --sink 4 --local-window 16 --device "$DEVICE" \
    --out "$ROOT/ruler_c3f5e3b_smollm2_$((length / 1024))k" \
    || echo "$(date +%T) ${length} tokens: incomplete (see above); run the script again to retry what is missing"
}
doable() {  # the tasks dense scores at least 20 on at this length
  python3 -c "
import json
rows = json.load(open('$ROOT/ruler_c3f5e3b_smollm2_$(($1 / 1024))k/summary.json'))
print(' '.join(r['task'] for r in rows if r['spec'] == 'dense' and r['score'] >= 20))"
}

run 4096 "$B4" specs/dense.yaml $TASKS
run 8192 "$B8" specs/dense.yaml $TASKS
run 4096 "$B4" "$MAIN" $(doable 4096)
run 4096 "$B4" "$ABLATIONS" $(doable 4096)
run 8192 "$B8" "$MAIN" $(doable 8192)
oa report "$ROOT/ruler_c3f5e3b_smollm2_4k"
oa report "$ROOT/ruler_c3f5e3b_smollm2_8k"
