#!/usr/bin/env bash
# The CUDA check, in one prepared run on a GPU host: the draft on CUDA (fp16), the pinned cycle ring,
# then the real-cost bench at llama2-13b shape. Stages run in order of importance, each under its
# own timeout inside one overall deadline, and each writes its log to $OUT as it goes, so a run cut
# short still brings back what it measured:
#   1. same tokens as --mode ar with the draft on CUDA (demo pair; fp32, int8 and q4_0 targets;
#      fp16 and fp32 drafts),
#   2. the draft's cost per cycle on the GPU: where a step's time goes (tools/profile_draft) and at 13B
#      size (tools/bench_draft),
#   3. tools/bench_real: the 13B stand-in at q4_0 on the host's cores, draft on CUDA,
#   4. the tests that take a CUDA branch (pinned rings, draft placement, eagle3 training).
# Sized for the H200 host (16 cores, 128 GB, 64 GB disk, Python 3.12, torch 2.11, transformers
# 5.17, no pyzmq, msgspec or gguf).
#
#   bash tools/device_check.sh --prepare    # here: wheels + inflate.py into .device/ (git-ignored)
#   device run: command "bash tools/device_check.sh", carry [".device"], timeout_s 590
# Knobs for a rehearsal on a CPU machine: DC_DEVICE=cpu DC_SHAPE=tiny-1k DC_DEADLINE=300.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ "${1:-}" = "--prepare" ]; then
    set -e
    mkdir -p .device/whl
    grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
    for package in pyzmq msgspec gguf; do
        python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d .device/whl "$package"
    done
    cp ../shared/testbed/inflate.py .device/inflate.py
    ls -la .device .device/whl
    exit 0
fi

device="${DC_DEVICE:-cuda}"
shape="${DC_SHAPE:-llama2-13b}"
deadline=$((SECONDS + ${DC_DEADLINE:-560}))
out="${OUT:-/tmp/device_check}"
mkdir -p "$out"
if [ -d .device/whl ] && ! python3 -c "import zmq, msgspec, gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .device/whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
[ -f .device/inflate.py ] && export DOVETAIL_INFLATE="$PWD/.device/inflate.py"

# stage NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (never past the deadline), log to $out/NAME.log.
stage() {
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - SECONDS))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        echo "== $name: skipped, ${left} s left" | tee -a "$out/summary.log"
        return
    fi
    echo "== $name (at most $limit s): $*" | tee -a "$out/summary.log"
    local started=$SECONDS
    timeout "$limit" "$@" > >(tee -a "$out/$name.log") 2>&1
    echo "== $name: exit $? after $((SECONDS - started)) s" | tee -a "$out/summary.log"
}

{
    python3 -c "import torch, zmq, msgspec, transformers; print('python', __import__('sys').version.split()[0], \
'torch', torch.__version__, 'transformers', transformers.__version__, 'zmq', zmq.__version__); \
print('cuda:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
    grep -m1 'model name' /proc/cpuinfo
    grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx512_vnni|avx_vnni|amx_int8|amx_bf16|avx512_bf16)$' | tr '\n' ' '
    echo; echo "cores: $(nproc)"; free -g | head -2; df -h /tmp | tail -1
} 2>&1 | tee "$out/summary.log"

run_cli=(python3 -c "from dovetail_runtime.cli import run_main; run_main()")
prompt=$'import os\ndef walk(path):'
for precision in fp32 int8 q4_0; do
    stage "same-tokens-$precision" 60 "${run_cli[@]}" --target demo/target-code-9m --draft demo/draft-dgf \
        --draft-device "$device" --target-dtype "$precision" --compare-ar --prompt "$prompt" --max-new-tokens 96
done
stage same-tokens-fp32-draft 60 "${run_cli[@]}" --target demo/target-code-9m --draft demo/draft-dgf \
    --draft-device "$device" --draft-dtype fp32 --target-dtype int8 --compare-ar --prompt "$prompt" --max-new-tokens 96
stage draft-profile 90 python3 -m tools.profile_draft --device "$device"
stage draft-cost 45 python3 -m tools.bench_draft --size 13b --device "$device" --13b-layers 1 4 \
    --13b-trees 8 16 32 --13b-depths 4 6 --13b-repeats 5
# Inflating 13B (26 GB at fp16) and quantizing it at load take minutes: the bench gets what is left but 35 s.
# The target on all cores but the last, the draft's host thread on that one.
last=$(($(nproc) - 1))
stage bench-real $((deadline - SECONDS - 35)) python3 -m tools.bench_real --runs "$shape:q4_0" \
    --draft-device "$device" --cpu-cores "0-$((last - 1))" --draft-cores "$last" --trees auto,16/6/8 \
    --work-dir /tmp/standins --prompts 3 \
    --prompt-tokens 128 --max-new-tokens 64 --no-verify-sweep
stage cuda-tests 35 python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_ipc_shm_ring.py \
    tests/unit/test_draft_head.py tests/unit/test_preflight.py tests/unit/test_eagle3_train.py \
    tests/unit/test_draft_cuda_choices.py
echo "== done at $SECONDS s" | tee -a "$out/summary.log"
