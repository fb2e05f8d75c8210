#!/usr/bin/env bash
# Set up the virtual environment and run the whole test suite.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/venv.sh"
cd "$repo"
exec .venv/bin/python -m pytest "$@"
