#!/usr/bin/env bash
# The RULER measurement of issue 6: every spec at 10/5/3/1% on the tasks dense SmolLM2 can do, at 4K and 8K.
#
#   bash benchmarks/ruler_sweep.sh [RANKS] [OUT_ROOT]     # RANKS torchrun processes (default 1), on the GPU if any
#
# Phases, each resumable (a rerun skips the cells already under OUT_ROOT/ruler_smollm2_{4k,8k}):
#   1. dense on all eleven tasks (the reference, and which tasks the model can do: dense score >= 20)
#   2. the baselines and OpenAttention on the tasks dense can do
#   3. the same at 8K
#   4. the ablations at 4K
# Then `oa report OUT_ROOT/ruler_smollm2_4k` (and 8k) writes report.md and the plots.
set -euo pipefail
RANKS=${1:-1}
ROOT=${2:-benchmarks/results}
DEVICE=$(python3 -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
MAIN="specs/dense.yaml specs/openattention.yaml specs/oracle-topk.yaml specs/quest.yaml specs/magicpig.yaml
      specs/vattention.yaml specs/retroinfer.yaml"
ABLATIONS="specs/dense.yaml $(ls specs/ablate-*.yaml | tr '\n' ' ')"
TASKS="niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 niah_multivalue
       niah_multiquery vt cwe fwe"

run() {  # length specs tasks...
  local length=$1 specs=$2; shift 2
  echo "$(date +%T) ${length} tokens: $(echo $specs | wc -w) specs on $*"
  torchrun --nproc-per-node "$RANKS" --master-port 29561 -m oa_core.cli eval --specs $specs --tasks "$@" \
    --length "$length" --samples 20 --batch 4 --device "$DEVICE" --out "$ROOT/ruler_smollm2_$((length / 1024))k"
}
doable() {  # the tasks dense scores at least 20 on at this length
  python3 -c "
import json
rows = json.load(open('$ROOT/ruler_smollm2_$(($1 / 1024))k/summary.json'))
print(' '.join(r['task'] for r in rows if r['spec'] == 'dense' and r['score'] >= 20))"
}

run 4096 specs/dense.yaml $TASKS
run 4096 "$MAIN" $(doable 4096)
run 8192 specs/dense.yaml $TASKS
run 8192 "$MAIN" $(doable 8192)
run 4096 "$ABLATIONS" $(doable 4096)
