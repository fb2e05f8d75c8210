#!/usr/bin/env bash
# The CUDA check: the real-cost bench at llama2-13b shape on a GPU host, in one prepared run.
# fp32 and int8 targets on 16 pinned cores, the 4-layer demo head on CUDA in fp16 through the
# pinned cycle ring; prints one table (tools/bench_real.py) and writes it, its log and the plot
# to $OUT. Sized for the H200 host (16 cores, 128 GB, Python 3.12, torch 2.11, transformers
# 5.17, no pyzmq or msgspec) and under 8 minutes.
#
#   bash tools/device_check.sh --prepare    # here: wheels + inflate.py into .device/ (git-ignored)
#   device run: command "bash tools/device_check.sh", carry [".device"], timeout_s 590
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ "${1:-}" = "--prepare" ]; then
    mkdir -p .device/whl
    grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
    for package in pyzmq msgspec; do
        python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d .device/whl "$package"
    done
    cp ../shared/testbed/inflate.py .device/inflate.py
    ls -la .device .device/whl
    exit 0
fi

out="${OUT:-/tmp/device_check}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .device/whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 DOVETAIL_INFLATE="$PWD/.device/inflate.py"
python3 -c "import torch, zmq, msgspec; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, torch.cuda.get_device_name(0), 'zmq', zmq.__version__)" 2>&1 | tee "$out/device_check.log"
nproc | sed 's/^/cores: /' | tee -a "$out/device_check.log"
# int8 first (the main claim), then fp32 with fewer tokens: fp32 13B streams 52 GB per token.
set -o pipefail
# An explicit --plot without matplotlib stops bench_real before its runs: ask for it only where it can be drawn.
plot=()
if python3 -c "import matplotlib" 2>/dev/null; then
    plot=(--plot "$out/bench_real_13b_int8.png")
else
    echo "no matplotlib here: no plot" | tee -a "$out/device_check.log"
fi
timeout 280 python3 -m tools.bench_real --runs llama2-13b:int8 --cpu-cores 0-15 --draft-device cuda \
    --trees auto,16/6/8 --work-dir /tmp/standins --prompts 4 --max-new-tokens 64 --sweep-repeats 2 \
    ${plot[@]+"${plot[@]}"} 2>&1 | tee -a "$out/device_check.log"
timeout 200 python3 -m tools.bench_real --runs llama2-13b:fp32 --cpu-cores 0-15 --draft-device cuda \
    --work-dir /tmp/standins --prompts 4 --max-new-tokens 32 --no-verify-sweep 2>&1 | tee -a "$out/device_check.log"
