"""tools.bench_load prints a row per checkout, precision and round, with the load's numbers and, for an
HF folder at a block precision, the CPU work split into reading and quantizing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import save_tiny_model

REPO = Path(__file__).resolve().parents[2]


def test_a_row_per_precision_with_its_seconds_memory_and_work(tmp_path):
    folder = save_tiny_model(tmp_path / "tiny", "llama", seed=5)
    done = subprocess.run([sys.executable, "-m", "tools.bench_load", "--target", str(folder), "--precisions",
                           "q4_0,fp32", "--threads", "1"], cwd=REPO, capture_output=True, text=True, check=True)
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith(f"| {REPO.name} |")]
    assert [row[1].strip() for row in rows] == ["q4_0", "fp32"]
    for row in rows:
        seconds, peak, weights = (float(cell) for cell in row[3:6])
        assert seconds > 0 and peak > 0.05 and weights > 0  # a Python process with torch holds > 50 MB
    q4_0_work, fp32_work = rows[0][6:8], rows[1][6:8]
    assert all(float(cell) >= 0 for cell in q4_0_work)
    assert all(cell.strip() == "nan" for cell in fp32_work)  # not a block precision: no split


def test_a_missing_target_is_named(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tools.bench_load", "--target", str(tmp_path / "nope")],
                          cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "no target at" in done.stderr


def test_a_target_relative_to_where_it_runs(tmp_path):
    """The children run with each checkout as their directory: --target tiny (a folder here) was looked
    for inside the checkout ('model folder tiny does not exist'), or found another folder of that name there."""
    save_tiny_model(tmp_path / "tiny", "llama", seed=5)
    done = subprocess.run([sys.executable, "-m", "tools.bench_load", "--target", "tiny", "--precisions", "fp32",
                           "--threads", "1"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line.split("|")[2].strip() for line in done.stdout.splitlines() if line.startswith(f"| {REPO.name} |")
            ] == ["fp32"]


def test_peak_rss_kib_are_reported_as_gb(tmp_path, monkeypatch, capsys):
    """ru_maxrss is in KiB: divided by 1e6 the 'peak RSS GB' column read 2.4% low (bench_head_memory's
    column, the same figure, multiplies by 1024 first)."""
    from tools import bench_load

    monkeypatch.setattr(bench_load, "child", lambda *_args: {"seconds": 1.0, "peak_kb": 10_000_000, "weights": 5e8})
    monkeypatch.setattr(sys, "argv", ["bench_load", "--target", str(tmp_path), "--precisions", "fp32"])
    assert bench_load.main() == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {REPO.name} |"))
    assert row.split("|")[5].strip() == "10.24"  # 10,000,000 KiB = 10.24e9 bytes


def test_an_unknown_precision_is_a_usage_line(tmp_path, monkeypatch, capsys):
    from tools import bench_load

    def child(*_args):
        raise AssertionError("a child ran before --precisions was checked")

    monkeypatch.setattr(bench_load, "child", child)
    monkeypatch.setattr(sys, "argv", ["bench_load", "--target", str(tmp_path), "--precisions", "q4_0,int9"])
    with pytest.raises(SystemExit) as exit_:
        bench_load.main()
    assert exit_.value.code == 2
    assert "argument --precisions: int9: expected some of fp32, bf16, int8" in capsys.readouterr().err


@pytest.mark.parametrize(("option", "value"), [("--rounds", "0"), ("--threads", "0")])
def test_counts_start_at_one(tmp_path, monkeypatch, capsys, option, value):
    """--rounds 0 printed a header and no rows; --threads 0 printed a child's torch traceback as the error."""
    from tools import bench_load

    def child(*_args):
        raise AssertionError(f"a child ran before {option} was checked")

    monkeypatch.setattr(bench_load, "child", child)
    monkeypatch.setattr(sys, "argv", ["bench_load", "--target", str(tmp_path), option, value])
    with pytest.raises(SystemExit) as exit_:
        bench_load.main()
    assert exit_.value.code == 2
    assert f"argument {option}: 0 is below 1" in capsys.readouterr().err
