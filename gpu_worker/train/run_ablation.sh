#!/usr/bin/env bash
# The fusion x layers ablation on the testbed (docs/training.md): six heads, one fixed token
# budget each, trained two at a time (one thread each: on a 2-core machine two 1-thread jobs
# beat one 2-thread job), then greedy tau at T=16 (depth 6, top_k 8) and T=7 (depth 4, top_k 4).
#
#   bash gpu_worker/train/run_ablation.sh [RUNS_DIR] [TOKENS] [EVAL_FILES]
#
# Expects RUNS_DIR/feat-train and RUNS_DIR/feat-heldout from `dovetail-train features --stdlib`.
set -euo pipefail
runs="${1:-runs}"
tokens="${2:-1200000}"
files="${3:-30}"
target="${TARGET:-../shared/testbed/target-code-9m}"
bin="$(dirname "$(readlink -f "$0")")/../../.venv/bin"

train_one() {  # fusion layers
  local out="$runs/ablation/$1-$2"
  "$bin/dovetail-train" train --target "$target" --features "$runs/feat-train" --heldout "$runs/feat-heldout" \
    --out "$out" --fusion "$1" --layers "$2" --max-tokens "$tokens" --epochs 1 --batch-size 4 --lr 2e-3 \
    --warmup 30 --eval-every 100 --eval-tokens 32768 --bf16 --threads 1 > "$out.log" 2>&1
}

eval_one() {  # fusion layers
  local out="$runs/ablation/$1-$2"
  "$bin/dovetail-train" eval --target "$target" --draft "$out" --files "$files" --tree-tokens 16 --depth 6 \
    --tree-top-k 8 --tree 7,4,4 --json --threads 1 > "$out.tau.json" 2> "$out.tau.log"
}

mkdir -p "$runs/ablation"
for layers in 4 2 1; do
  train_one dgf "$layers" & train_one fc "$layers" & wait
done
for layers in 4 2 1; do
  eval_one dgf "$layers" & eval_one fc "$layers" & wait
done
"$bin/python" -m gpu_worker.train.report "$runs/ablation"
