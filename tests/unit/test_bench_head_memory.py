"""tools.bench_head_memory: folders named relative to where it runs, though its children run in a checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import DEMO_DRAFT, DEMO_TARGET

REPO = Path(__file__).resolve().parents[2]


def run(cwd: Path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.bench_head_memory", *arguments], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, check=False)


def test_relative_folders_are_read_where_it_runs(tmp_path):
    """--draft head --target target (folders here) were looked for inside the checkout: a child's traceback."""
    (tmp_path / "head").symlink_to(DEMO_DRAFT)
    (tmp_path / "target").symlink_to(DEMO_TARGET)
    done = run(tmp_path, "--draft", "head", "--target", "target", "--dtypes", "fp32")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith(f"| {REPO} |")]
    assert [(row[1].strip(), row[2].strip()) for row in rows] == [("draft-dgf", "fp32")]


def test_a_missing_folder_is_one_line(tmp_path):
    done = run(tmp_path, "--draft", "nope", "--target", str(DEMO_TARGET))
    assert done.returncode == 1
    assert done.stderr.strip() == "no model folder at nope"
