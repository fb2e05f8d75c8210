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
installed() {  # whether module "$1" is installed (under folder "$2" if given), without importing it (torch takes seconds)
    "$py" -P -c 'import importlib.util, sys; spec = importlib.util.find_spec(sys.argv[1])
sys.exit(spec is None or not (spec.origin or "").startswith(sys.argv[2]))' "$1" "${2:-}" 2>/dev/null
}
if ! installed torch; then
    "$py" -m pip install --quiet torch==2.13.0
fi
# The install is editable: only pyproject.toml (dependencies, commands) and the extras change what pip would
# do. A stamp of them skips pip's ~12 s of resolving on every later demo or test run (-P above: this repo's
# copy must be the installed one).
stamp=.venv/.dovetail-installed
spec=".[test,fixture]"  # fixture: scripts/fetch_fixture.sh reads the GGUF with transformers (gguf, accelerate)
wanted="$("$py" -c 'import hashlib, sys; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest(), sys.version)') $spec"
if [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ] && [ -x .venv/bin/dovetail-run ] && installed dovetail_runtime "$repo/"; then
    exit 0
fi
rm -f "$stamp"
"$py" -m pip install --quiet -e "$spec"
echo "$wanted" > "$stamp"
