#!/usr/bin/env bash
# Set up the virtual environment and run the demo on the bundled testbed model.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/venv.sh"
cd "$repo"
exec .venv/bin/python -m tools.complete_target "$@"
