#!/usr/bin/env bash
# Issue 57's runs on one GPU, each resumable on its own (a part writes its own file; run the script again, or one
# part, to finish what a short lease left):
#
#   bash benchmarks/gpu_report.sh [speed|layer|ruler|all] [OUT]      # default: all, into benchmarks/results
#
#   speed  generate_speed.py: dense-static, dense-engine, the default per head and shared, the paper's pipeline
#          shared, at 1% and 3%, one process per batch × context × method (16x16K, 8x32K, 4x64K, 2x128K, and
#          1x128K for prepare's share of a batch-1 prefill), each kept in OUT/generate_speed_parts/<config>/ (one
#          already there is not run again; delete it to redo it) and merged into OUT/generate_speed.json
#   layer  kernel_h200.py per head at 16x16K and 32x32K, 1% and 3%, in CUDA graphs and eagerly:
#          OUT/kernel_h200_<config>.json
#   ruler  ruler_gemma_32k.sh: RULER 32K on Gemma-3-270M (needs `pip install 'openattention[gemma]'`)
#
# Afterwards `python benchmarks/results_tables.py --write` re-renders the docs' tables from the JSON.
#
# The package and its needs must be importable there: on a machine without them, install this checkout's wheel with
# pydantic's and a transformers >= 5.20 (`oa.patch` refuses an older one before any model loads; 5.20.0 works with
# huggingface_hub 1.x, later ones want 2.x) with `pip install --no-deps`.
set -uo pipefail
PART=${1:-all}
OUT=${2:-benchmarks/results}
mkdir -p "$OUT"
if [ "$PART" = speed ] || [ "$PART" = all ]; then
  python3 benchmarks/generate_speed.py --configs 16x16384 8x32768 4x65536 2x131072 1x131072 \
    --keep "$OUT/generate_speed_parts" --out "$OUT/generate_speed.json"
fi
if [ "$PART" = layer ] || [ "$PART" = all ]; then
  for config in "16 16384" "32 32768"; do
    set -- $config
    file="$OUT/kernel_h200_$1x$2.json"
    if [ -f "$file" ]; then echo "$(date +%T) kernel $1x$2: $file is there"; continue; fi
    python3 benchmarks/kernel_h200.py --batch "$1" --context "$2" --density 0.01 0.03 --gqa per_head \
      --spec specs/openattention.yaml --out "$file"
  done
fi
if [ "$PART" = ruler ] || [ "$PART" = all ]; then
  bash benchmarks/ruler_gemma_32k.sh 8 "$OUT/ruler_c3f5e3b_gemma3_270m_32k"
fi
