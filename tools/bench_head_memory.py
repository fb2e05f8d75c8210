"""Peak memory of loading a draft head, as the gpu_worker loads it (``Drafter.from_pretrained``).

    python -m tools.bench_head_memory --draft DIR --target DIR [--dtypes int8,fp32] [--repo PATH ...]

Each load runs in a fresh child process and reports its ``ru_maxrss`` (peak resident set)
next to the head's resident weight bytes, so the table shows what loading costs beyond the
weights. ``--repo`` runs the same child against another checkout (e.g. main, to compare the
loader before and after); the default is this one. The target folder only lends the frozen
embedding and lm_head: the target itself is never loaded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tools.tables import markdown_header, markdown_row

_CHILD = """
import json, resource, sys, time
import torch
torch.set_num_threads(1)
from pathlib import Path
from gpu_worker.drafter import Drafter
from gpu_worker.checkpoint import _hf_config
from cpu_worker.target_loading import weight_bytes
draft, target, dtype = sys.argv[1:4]
_hf_config(Path(draft))  # imports what reading a config needs: the baseline, not the load
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
drafter = Drafter.from_pretrained(draft, target, max_len=16, device="cpu", dtype=dtype)
seconds = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"baseline_kb": before, "peak_kb": peak, "weights": weight_bytes(drafter.head),
                  "seconds": seconds}))
"""


def measure(repo: Path, draft: Path, target: Path, dtype: str) -> dict[str, float]:
    """One load in a fresh interpreter whose imports come from ``repo``."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(draft), str(target), dtype], cwd=repo,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"loading {draft} as {dtype} from {repo} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", type=Path, action="append", required=True, help="draft folder (repeatable)")
    parser.add_argument("--target", type=Path, required=True, help="target folder lending embedding/lm_head")
    parser.add_argument("--dtypes", default="int8,fp32", help="draft dtypes, comma-separated")
    parser.add_argument("--repo", type=Path, action="append", help="checkout(s) to run (default: this one)")
    args = parser.parse_args()
    repos = args.repo or [Path(__file__).resolve().parent.parent]
    # The children run in each --repo: a relative path would be looked for there.
    for folder in (*args.draft, args.target):
        if not folder.is_dir():
            raise SystemExit(f"no model folder at {folder}")
    drafts, target = [draft.resolve() for draft in args.draft], args.target.resolve()
    print(f"command: {' '.join(sys.argv)}")
    print(markdown_header(["checkout", "draft", "dtype", "weights GB", "peak RSS GB", "before load GB",
                           "peak - weights - before load GB", "load s"]))
    for draft in drafts:
        for dtype in args.dtypes.split(","):
            for repo in repos:
                got = measure(repo, draft, target, dtype)
                weights, peak, base = got["weights"] / 1e9, got["peak_kb"] * 1024 / 1e9, got["baseline_kb"] * 1024 / 1e9
                print(markdown_row([repo, draft.name, dtype, f"{weights:.2f}", f"{peak:.2f}", f"{base:.2f}",
                                    f"{peak - weights - base:.2f}", f"{got['seconds']:.1f}"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
