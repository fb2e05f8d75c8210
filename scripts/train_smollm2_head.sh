#!/usr/bin/env bash
# Rebuild demo/draft-smollm2, the draft head for SmolLM2-135M-Instruct, on the CPU: self-distilled chat
# data (prompts from tools/chat_prompts.py's training topics, answered by the model), features, an EAGLE-3
# head trained with Dovetail's gated fusion, then tau on the held-out topics. Every step resumes where
# an interrupted run stopped (rerun the script). WORK (default data/smollm2) holds the intermediate files.
#   PROMPTS=2000 EPOCHS=3 bash scripts/train_smollm2_head.sh   (about 25 + 7 + 30 min on 2 cores)
#   DEVICE=cuda PROMPTS=3768 ANSWERS=3 MAX_NEW_TOKENS=192 BATCH=768 TRAIN_BATCH=32 EPOCHS=4 \
#       bash scripts/train_smollm2_head.sh    (on a GPU, minutes: the shipped head's recipe; it was made by
#       tools/device_train_head.sh, time-boxed, from the first 9,216 of those answers)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/fetch_fixture.sh" >/dev/null
cd "$repo"
py=.venv/bin/python
work="${WORK:-data/smollm2}"
target="$($py -c 'from dovetail_runtime.demo_models import SMOLLM2_DIR; print(SMOLLM2_DIR)')"
out="${OUT:-demo/draft-smollm2}"
mkdir -p "$work"
device="${DEVICE:-cpu}"
$py -m tools.chat_data --target "$target" --out "$work/chat.jsonl" --prompts "${PROMPTS:-2000}" \
    --answers "${ANSWERS:-1}" --batch "${BATCH:-32}" --max-new-tokens "${MAX_NEW_TOKENS:-160}" --device "$device"
$py -m tools.chat_data --heldout --out "$work/heldout-prompts.jsonl"
.venv/bin/dovetail-train features --target "$target" --input "$work/chat.jsonl" --out "$work/features" \
    --aux-layers auto --window 512 --device "$device"
.venv/bin/dovetail-train train --target "$target" --features "$work/features" --out "$work/head" \
    --recipe dgf-eagle3 --draft-vocab "${DRAFT_VOCAB:-4096}" --epochs "${EPOCHS:-3}" --batch-size "${TRAIN_BATCH:-8}" \
    --bf16 --save-dtype fp16 --device "$device"
mkdir -p "$out"
cp "$work/head/config.json" "$work/head/model.safetensors" "$out/"
.venv/bin/dovetail-train eval --target "$target" --draft "$out" --chat "$work/heldout-prompts.jsonl" \
    --new-tokens 96 --tree 4,3,2 --tree 8,4,4 --tree 32,8,8
