#!/usr/bin/env bash
# demo/draft-smollm2 rebuilt on a lent GPU host, with ~8x the data a 2-core CPU affords in hours:
# the same recipe as scripts/train_smollm2_head.sh (self-distilled chat answers, three-layer
# features, dgf-eagle3 training), each stage on CUDA and time-boxed inside one deadline.
#
# The device machine reaches no network and a call carries at most 64 MiB, so the fixture GGUF
# (94 MB) travels in two pieces, one per call, while the machine stays warm between them:
#   bash tools/device_train_head.sh --prepare        # here: wheels, the GGUF's two pieces, its sha256
#   device run 1: "bash tools/device_train_head.sh --stash", carry [".device/gguf-1", ".device/whl"]
#   device run 2: "bash tools/device_train_head.sh", carry [".device/gguf-2", ".device/whl"], timeout_s 590
# (the tracked demo weights, ~45 MB, must stay out of both calls' working tree: move them aside and
# back). Run 1 also runs the test of the CUDA training path: if it fails, run 2 takes
# TH_FEATURES_ON_HOST=1. Answers from an earlier run, put at .device/answers/chat.jsonl.xz and
# carried too, are resumed (extended) instead of generated again. $OUT brings back the head (in
# pieces under 16 MiB), the answers (xz) and every log.
# Rehearsal on a CPU machine: TH_DEVICE=cpu TH_PROMPTS=16 TH_BATCH=8 TH_GEN_SECONDS=60 TH_TRAIN_SECONDS=30.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stash=/tmp/dovetail-gguf-pieces

if [ "${1:-}" = "--prepare" ]; then
    set -e
    bash tools/device_check.sh --prepare >/dev/null
    gguf="$(.venv/bin/python -m tools.fixtures --gguf-only)"
    rm -rf .device/gguf-1 .device/gguf-2
    mkdir -p .device/gguf-1 .device/gguf-2
    half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
    head -c "$half" "$gguf" > .device/gguf-1/piece-1
    tail -c +"$((half + 1))" "$gguf" > .device/gguf-2/piece-2
    sha256sum "$gguf" | cut -d' ' -f1 > .device/gguf-2/sha256
    ls -la .device/gguf-1 .device/gguf-2
    exit 0
fi
install_wheels() {
    if [ -d .device/whl ] && ! python3 -c "import zmq, msgspec, gguf" 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .device/whl/*.whl || return 1
    fi
}
export PYTHONPATH="$PWD:${PYTHONPATH:-}:/tmp/site" PYTHONUNBUFFERED=1

if [ "${1:-}" = "--stash" ]; then
    mkdir -p "$stash" && cp .device/gguf-1/* "$stash/" && ls -la "$stash" && nvidia-smi -L || exit 1
    install_wheels || exit 1
    # The training path's CUDA branch (features resident on the GPU), checked before the long run.
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_eagle3_train.py -k "features" 2>&1 | tail -n 5
    exit "${PIPESTATUS[0]}"
fi

device="${TH_DEVICE:-cuda}"
deadline=$((SECONDS + ${TH_DEADLINE:-540}))
out="${OUT:-/tmp/device_train_head}"
work="${TH_WORK:-/tmp/smollm2-work}"
logs="$work/logs"
mkdir -p "$out" "$work" "$logs"
install_wheels || exit 1

# stage NAME SECONDS COMMAND...: COMMAND for at most SECONDS (never past the deadline less a reserve
# for packing up), its output in $logs/NAME.log, its last lines in $out/summary.log ($OUT brings
# back 8 files at most: the logs travel packed).
stage() {
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - 25 - SECONDS))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        echo "== $name: skipped, ${left} s left" | tee -a "$out/summary.log"
        return 1
    fi
    echo "== $name (at most $limit s): $*" | tee -a "$out/summary.log"
    local started=$SECONDS
    timeout "$limit" "$@" > "$logs/$name.log" 2>&1
    local status=$?
    echo "== $name: exit $status after $((SECONDS - started)) s" | tee -a "$out/summary.log"
    tail -n 3 "$logs/$name.log" | tr '\r' '\n' | tail -n 3 | tee -a "$out/summary.log"
    return $status
}

# Pack up, however the run ends: the head in pieces under 16 MiB (cat them back in order), the logs
# in one archive.
pack() {
    if [ -f "$work/head/model.safetensors" ]; then
        split -b 12M -d "$work/head/model.safetensors" "$out/head.safetensors.part-"
        cp "$work/head/config.json" "$out/head-config.json"
    fi
    tar -C "$work" -cJf "$out/logs.tar.xz" --ignore-failed-read logs head/train_log.jsonl \
        head/train_summary.json features/manifest.json 2>/dev/null
    ls -la "$out" | tee -a "$out/summary.log"
}
trap pack EXIT

{
    python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'transformers', transformers.__version__, 'cuda:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
    echo "cores: $(nproc)"; free -g | head -2; df -h /tmp | tail -1
} 2>&1 | tee "$out/summary.log"

# The fixture: the GGUF joined from its pieces (or already in $DOVETAIL_FIXTURES), then its fp32 HF folder.
export DOVETAIL_FIXTURES="${DOVETAIL_FIXTURES:-$work/fixtures}"
mkdir -p "$DOVETAIL_FIXTURES"
gguf="$DOVETAIL_FIXTURES/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$gguf" ]; then
    [ -d .device/gguf-2 ] && cp .device/gguf-2/* "$stash/" 2>/dev/null
    if [ ! -f "$stash/piece-1" ] || [ ! -f "$stash/piece-2" ]; then
        echo "the GGUF's pieces are not both here (a fresh machine? run the --stash call first)" | tee -a "$out/summary.log"
        exit 2
    fi
    cat "$stash/piece-1" "$stash/piece-2" > "$gguf"
    [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$(cat "$stash/sha256")" ] || { echo "GGUF checksum differs" \
        | tee -a "$out/summary.log"; rm -f "$gguf"; exit 2; }
fi
stage fixture 120 python3 -m tools.fixtures || exit 3
target="$(python3 -c 'from dovetail_runtime.demo_models import SMOLLM2_DIR; print(SMOLLM2_DIR)')"
train=(python3 -c "from dovetail_runtime.train_cli import main; main()")

# Answers: every training prompt once (half greedy, half sampled), then more sampled answers, as
# many as the time allows; packed at once so a later stage's failure still brings them back.
if [ -f .device/answers/chat.jsonl.xz ] && [ ! -f "$work/chat.jsonl" ]; then
    xz -dc .device/answers/chat.jsonl.xz > "$work/chat.jsonl"  # chat_data resumes after these
    echo "resuming $(wc -l < "$work/chat.jsonl") carried answers" | tee -a "$out/summary.log"
fi
stage answers "$(( ${TH_GEN_SECONDS:-170} + 60 ))" python3 -m tools.chat_data --target "$target" \
    --out "$work/chat.jsonl" --prompts "${TH_PROMPTS:-3768}" --answers "${TH_ANSWERS:-6}" \
    --batch "${TH_BATCH:-768}" --max-new-tokens 192 --device "$device" --seconds "${TH_GEN_SECONDS:-170}"
wc -l "$work/chat.jsonl" | tee -a "$out/summary.log"
xz -T0 -6 -c "$work/chat.jsonl" > "$out/chat.jsonl.xz"

stage features "${TH_FEATURE_SECONDS:-150}" "${train[@]}" features --target "$target" --input "$work/chat.jsonl" --out "$work/features" \
    --aux-layers auto --window 512 --device "$device" || exit 4

train_seconds=$(( deadline - 25 - SECONDS - 45 ))  # 45 s for loading the features and writing the head
stage train "$((train_seconds + 45))" "${train[@]}" train --target "$target" --features "$work/features" \
    --out "$work/head" --recipe dgf-eagle3 --draft-vocab 4096 --epochs "${TH_EPOCHS:-8}" \
    --batch-size "${TH_TRAIN_BATCH:-32}" --bf16 --save-dtype fp16 --device "$device" --save-every 100 \
    --time-budget "${TH_TRAIN_SECONDS:-$train_seconds}" ${TH_FEATURES_ON_HOST:+--features-on-host}

