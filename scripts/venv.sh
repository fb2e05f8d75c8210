#!/usr/bin/env bash
# Create (or reuse) .venv in the repo and install Dovetail with everything it needs.
# torch==2.13.0 goes in first on its own: on these machines that pin resolves to the CPU
# build that lies on disk; letting pip pick torch through a range could pull a CUDA build.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
py=.venv/bin/python
if ! "$py" -c "import torch" >/dev/null 2>&1; then
    "$py" -m pip install --quiet torch==2.13.0
fi
"$py" -m pip install --quiet -e ".[test]"
