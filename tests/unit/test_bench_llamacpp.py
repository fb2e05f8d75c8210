"""tools/bench_llamacpp.py: each round is judged against the bandwidth measured next to it."""

import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tools import bench_llamacpp
from tools.bench_llamacpp import PairResult, llama_bench_round, print_table


def test_roofline_fractions_divide_each_round_by_its_own_bandwidth(capsys):
    result = PairResult("int8", Path("model.gguf"), ours_tps=[10.0, 12.0, 9.0], llama_tps=[5.0, 6.0, 4.0],
                        ours_bytes=int(1e9), llama_bytes=int(2e9), bandwidth_gbs=[20.0, 12.0, 10.0])
    ours, llama = result.roofline_fractions()
    # Per round: ours 0.5, 1.0, 0.9 and llama.cpp 0.5, 1.0, 0.8. Against one bandwidth (the best,
    # 20 GB/s) the medians would be 0.5 and 0.5 instead.
    assert ours == 0.9
    assert llama == 0.8
    print_table([result], threads=2)
    table = capsys.readouterr().out
    assert "| 90% | 80% |" in table
    assert "read bandwidth 10.0-20.0 GB/s" in table


FAKE_LLAMA_BENCH = """#!{python}
import json, sys, time
hold = bytearray(300 * 1024 * 1024)  # touched: resident
for i in range(0, len(hold), 4096):
    hold[i] = 1
time.sleep(0.6)  # the bench polls VmHWM every 50 ms
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
open(sys.argv[0] + ".peak_kb", "w").write(str(peak))
print(json.dumps([{{"avg_ts": 12.5, "model_size": 1000, "model_n_params": 10, "model_type": "fake"}}]))
"""


def test_llama_cpp_peak_rss_is_in_the_same_gb_as_ours(tmp_path):
    """/proc's VmHWM is in KiB: divided by 1e6 it read 2.4% under the GB (1e9 bytes) of ours beside it."""
    binary = tmp_path / "llama-bench"
    binary.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    binary.chmod(0o755)
    tps, rss_gb, record = llama_bench_round(binary, tmp_path / "model.gguf", tokens=8, threads=1)
    assert (tps, record["model_type"]) == (12.5, "fake")
    true_gb = int((tmp_path / "llama-bench.peak_kb").read_text()) * 1024 / 1e9
    assert true_gb > 0.3
    assert abs(rss_gb - true_gb) / true_gb < 0.01


def not_built(*_args, **_kwargs):
    raise AssertionError("our engine loaded before --llama-bench was checked")


def test_a_llama_bench_that_cannot_run_is_named_before_our_engine_loads(tmp_path, monkeypatch):
    """A non-executable --llama-bench ended in 'OSError: [Errno 8] Exec format error' after our engine loaded."""
    monkeypatch.setattr(bench_llamacpp, "build_engine", not_built)
    text, gguf = tmp_path / "llama-bench", tmp_path / "model.gguf"
    text.write_text("not a program\n")
    gguf.write_bytes(b"GGUF")
    result = CliRunner().invoke(bench_llamacpp.main, ["--target", str(tmp_path), "--llama-bench", str(text),
                                                      "--pair", f"int8={gguf}"])
    assert result.exit_code == 2, result.output
    assert f"{text} is not executable" in result.output


def test_an_executable_that_is_no_program_is_one_line(tmp_path):
    binary = tmp_path / "llama-bench"
    binary.write_bytes(b"\x7fELF not really")
    binary.chmod(0o755)
    with pytest.raises(click.ClickException, match="cannot run .*llama-bench: Exec format error"):
        llama_bench_round(binary, tmp_path / "model.gguf", tokens=8, threads=1)
