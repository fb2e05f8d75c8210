#!/usr/bin/env bash
# Set up the virtual environment and run the demo: the bundled target (demo/target-code-9m)
# with its draft head (demo/draft-dgf) completes a code prompt, then the same prompt runs in
# --mode ar on the same workers and both speeds are printed side by side.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/venv.sh"
cd "$repo"
if [ "$#" -eq 0 ]; then
    set -- --prompt "def fibonacci(n):" --max-new-tokens 128
fi
exec .venv/bin/dovetail-run --compare-ar --log-level warning "$@"
