"""A markdown table of trained heads: python -m gpu_worker.train.report RUNS_DIR/ablation

Reads each head folder's train_summary.json and train_log.jsonl and the ``<head>.tau.json``
written next to it by ``dovetail-train eval --json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def head_row(folder: Path) -> dict:
    summary = json.loads((folder / "train_summary.json").read_text())
    evals = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
    evals = [record for record in evals if record.get("kind") == "eval"]
    row = {"head": folder.name, "fusion": summary["config"]["fusion"], "layers": summary["config"]["layers"],
           "steps": summary["steps"], "seconds": summary["seconds"],
           "tokens": summary["steps"] * summary["pairs_per_step"],
           "loss": evals[-1]["loss"] if evals else None, "top1": evals[-1]["top1"] if evals else None}
    tau_file = folder.with_name(folder.name + ".tau.json")
    if tau_file.exists():
        for result in json.loads(tau_file.read_text())["results"]:
            key = f"T{result['tree_tokens']}"
            row[key] = result["tau"]
            row[key + "_accept"] = result["accept_per_depth"]
            row["files"] = result["files"]
    return row


def table(rows: list[dict]) -> str:
    lines = ["| head | trained pairs | train wall | held-out loss | top-1 | tau T=16 (d6, k8) | tau T=7 (d4, k4) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['fusion']} x{r['layers']} | {r['tokens'] / 1e6:.2f}M | {r['seconds'] / 60:.1f} min | "
                     f"{r['loss']:.4f} | {r['top1']:.3f} | {r.get('T16', float('nan')):.3f} | "
                     f"{r.get('T7', float('nan')):.3f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    root = Path(argv[0] if argv else "runs/ablation")
    rows = [head_row(f) for f in sorted(root.iterdir()) if (f / "train_summary.json").exists()]
    rows.sort(key=lambda r: (r["fusion"], r["layers"]))
    print(table(rows))
    for r in rows:
        if "T16_accept" in r:
            print(f"{r['head']}: acceptance per depth T=16 {r['T16_accept']}, T=7 {r.get('T7_accept')} "
                  f"({r.get('files')} files)")


if __name__ == "__main__":
    main(sys.argv[1:])
