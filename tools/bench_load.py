"""Loading a target: seconds and peak memory, as the cpu_worker loads it (``load_target_model``).

    python -m tools.bench_load --target DIR_OR_GGUF [--precisions q4_0,int8] [--rounds 2] [--repo PATH ...]

Each load runs in a fresh child process, which reports the load's seconds, its peak resident set
(``ru_maxrss``) and the model's weight bytes. Beside it, the load's CPU work alone: every tensor of
the checkpoint read and every matrix quantized as the precision's block type, each result dropped at
once (an HF folder at a block precision only). That second figure is what the
code costs; a whole load also pays for the memory it keeps, which on some hosts (a VM that hands free
memory back to its host) costs seconds per GB the first time it is touched. ``--repo`` runs the same
children against other checkouts (e.g. a worktree of an older commit), alternating round by round.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from cpu_worker.precision import block_type
from ipc.dtypes import TARGET_PRECISIONS
from tools.options import name_list, positive_int
from tools.tables import markdown_header, markdown_row

_LOAD = """
import json, resource, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
from cpu_worker.target_loading import load_target_model, weight_bytes
started = time.perf_counter()
model = load_target_model(sys.argv[1], sys.argv[2])
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "weights": weight_bytes(model)}))
"""

_CPU_WORK = """
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(int(sys.argv[3]))
from cpu_worker.kernels.block_quant import BlockWeights
from cpu_worker.model.loading import iter_tensors
from cpu_worker.precision import block_type, head_block_type
kind, head_kind = block_type(sys.argv[2]), head_block_type(sys.argv[2])
read = quantize = 0.0
mark = time.perf_counter()
for name, tensor in iter_tensors(Path(sys.argv[1])):
    got = time.perf_counter()
    read += got - mark
    if tensor.dim() == 2 and "embed_tokens" not in name:  # dropped at once: the work, not the memory kept
        BlockWeights.quantize(tensor, head_kind if name.endswith("lm_head.weight") else kind)
    mark = time.perf_counter()
    quantize += mark - got
print(json.dumps({"read": read, "quantize": quantize}))
"""


def child(repo: Path, script: str, *args: str) -> dict[str, float]:
    """One run of ``script`` in a fresh interpreter whose imports come from ``repo``."""
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=repo, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} from {repo} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# A typo was each child's ValueError traceback, printed as the error.
precision_list = name_list(TARGET_PRECISIONS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="target folder or GGUF file")
    parser.add_argument("--precisions", type=precision_list, default="q4_0,int8",
                        help=f"--target-dtype values, comma-separated: {', '.join(TARGET_PRECISIONS)}")
    parser.add_argument("--rounds", type=positive_int, default=1, help="loads per checkout and precision (alternating)")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads in each child")
    parser.add_argument("--repo", type=Path, action="append", help="checkout(s) to run (default: this one)")
    args = parser.parse_args()
    if not args.target.exists():
        raise SystemExit(f"no target at {args.target}")
    target = args.target.resolve()  # the children run in each --repo: a relative path would point into it
    repos = args.repo or [Path(__file__).resolve().parent.parent]
    split = args.target.is_dir()
    print(f"command: {' '.join(sys.argv)}")
    print(markdown_header(["checkout", "precision", "round", "load s", "peak RSS GB", "weights MB",
                           "CPU work: read s", "quantize s"]))
    for precision in args.precisions:
        for round_ in range(1, args.rounds + 1):
            for repo in repos:
                load = child(repo, _LOAD, str(target), precision, str(args.threads))
                work = {"read": float("nan"), "quantize": float("nan")}
                if split and block_type(precision) is not None:
                    work = child(repo, _CPU_WORK, str(target), precision, str(args.threads))
                print(markdown_row([repo.name, precision, round_, f"{load['seconds']:.3g}",  # a small model: ms
                                    f"{load['peak_kb'] * 1024 / 1e9:.2f}",  # ru_maxrss is in KiB
                                    f"{load['weights'] / 1e6:.1f}",
                                    f"{work['read']:.1f}", f"{work['quantize']:.1f}"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
