#!/usr/bin/env bash
# Set up the virtual environment, then lint (ruff) and type-check (mypy) the code.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/venv.sh"
cd "$repo"
.venv/bin/python -m ruff check .
.venv/bin/python -m mypy
