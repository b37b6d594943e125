#!/usr/bin/env bash
# Issue 57's accuracy run: RULER at 32K on Gemma-3-270M (head dim 256, 32K positions), niah_single_1 and
# niah_single_2, 20 samples each, dense and four sparse specs at 10/5/3/1%: the default (PQS), exact top-k, the
# vAttention-like and the Quest-like spec. The target: the default's retention at least 0.9 × exact top-k's at 3%
# and at 1%.
#
#   bash benchmarks/ruler_gemma_32k.sh [RANKS_PER_GPU] [OUT]      # default 8 ranks per GPU, 1 process on a CPU
#   OA_MODEL=smollm2-135m OA_LENGTH=2048 OA_SAMPLES=1 OA_EVAL_ARGS="--local-window 16" \
#     bash benchmarks/ruler_gemma_32k.sh 1 /tmp/smoke                 # a smoke run on the CPU (a few minutes)
#
# A 270M model's decode step is bound by launches and host waits, so several torchrun ranks share a GPU, each with a
# batch of OA_BATCH samples (default 2: a 32K prefill's peak). 8 ranks fit an H200's 141 GB; on an 80 GB H100 give 4
# (at 8, whole cells ran out of memory in the prefill even one sample at a time, and were left for a rerun). Resumable: a rerun skips the cells under OUT. Then
# `oa report OUT` writes the summary, report.md and the plots; retention is each spec's score over dense's.
set -uo pipefail
PER_GPU=${1:-8}
OUT=${2:-benchmarks/results/ruler_c3f5e3b_gemma3_270m_32k}
MODEL=${OA_MODEL:-gemma3-270m} LENGTH=${OA_LENGTH:-32768} SAMPLES=${OA_SAMPLES:-20} BATCH=${OA_BATCH:-2}
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -gt 0 ]; then DEVICE=cuda RANKS=$((PER_GPU * GPUS)); else DEVICE=cpu RANKS=1; fi
echo "$(date +%T) RULER ${LENGTH} tokens on ${MODEL}: ${RANKS} rank(s) on ${DEVICE}, out ${OUT}"
torchrun --nproc-per-node "$RANKS" --master-port 29562 -m oa_core.cli eval --model "$MODEL" \
  --specs specs/dense.yaml specs/openattention.yaml specs/oracle-topk.yaml specs/vattention.yaml specs/quest.yaml \
  --tasks niah_single_1 niah_single_2 --densities 0.1 0.05 0.03 0.01 \
  --length "$LENGTH" --samples "$SAMPLES" --batch "$BATCH" --device "$DEVICE" --out "$OUT" ${OA_EVAL_ARGS:-} \
  || echo "$(date +%T) incomplete (see above): run the script again to retry what is missing"
oa report "$OUT"
