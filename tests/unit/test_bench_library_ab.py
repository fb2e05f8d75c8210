"""tools.bench_library_ab: an older build of the native library and this one, swapped pass by pass."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from cpu_worker.native import library as native
from tools import bench_library_ab

from conftest import DEMO_TARGET


@pytest.fixture(scope="module")
def current_build(tmp_path_factory) -> Path:
    """This checkout's sources built as a separate .so, standing in for an older build."""
    compiler = native.find_compiler()
    assert compiler is not None
    target = tmp_path_factory.mktemp("ab") / "old.so"
    native.compile_library(compiler, native.FLAGS, native.SOURCES, target)
    return target


def test_it_times_both_builds_and_prints_their_ratio_per_tree_size(current_build):
    result = CliRunner().invoke(bench_library_ab.main, [
        "--target", str(DEMO_TARGET), "--precision", "int8", "--old-library", str(current_build),
        "--rows", "1,3", "--passes", "3", "--threads", "1"])
    assert result.exit_code == 0, result.output
    rows = [line.split("|")[1:-1] for line in result.output.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row[0].strip() for row in rows] == ["rows", "1", "3"]
    for row in rows[1:]:
        old, new, ratio = (float(cell) for cell in row[1:])
        assert old > 0 and new > 0 and ratio == pytest.approx(new / old, rel=0.01)  # ms printed to 1 us


def test_a_build_whose_loop_structs_differ_or_no_build_is_refused(current_build, tmp_path):
    assert bench_library_ab.loop_problem(ctypes.CDLL(str(current_build))) is None
    libm = ctypes.CDLL("libm.so.6")
    assert "no dovetail_abi" in (bench_library_ab.loop_problem(libm) or "")
    with pytest.raises(click.ClickException, match="cannot load"):
        bench_library_ab.old_library(None, str(tmp_path / "missing.so"), tmp_path)
    usage = CliRunner().invoke(bench_library_ab.main, ["--target", str(DEMO_TARGET)])
    assert usage.exit_code != 0 and "give one of --old-rev and --old-library" in usage.output
    too_many = CliRunner().invoke(bench_library_ab.main, ["--target", str(DEMO_TARGET), "--precision", "int8",
                                                          "--old-library", str(current_build), "--rows", "4096"])
    assert too_many.exit_code != 0 and "--rows at most" in too_many.output


def test_a_revisions_sources_are_read_from_git(tmp_path):
    repo = tmp_path / "repo"
    folder = repo / bench_library_ab.NATIVE_FOLDER
    folder.mkdir(parents=True)
    (folder / "dovetail.h").write_text("/* header */\n")
    (folder / "kernel.c").write_text("int answer(void) { return 42; }\n")
    (folder / "library.py").write_text("# not a source\n")
    for command in (["init", "-q"], ["add", "."],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "sources"]):
        subprocess.run(["git", *command], cwd=repo, check=True)
    (folder / "kernel.c").write_text("int answer(void) { return 7; }\n")  # a later edit, not committed
    out = tmp_path / "out"
    out.mkdir()
    sources = bench_library_ab.sources_at("HEAD", out, repo=repo)
    assert sources == [out / "kernel.c"] and "42" in (out / "kernel.c").read_text()
    assert (out / "dovetail.h").exists() and not (out / "library.py").exists()
    with pytest.raises(click.ClickException, match="git ls-tree"):
        bench_library_ab.sources_at("no-such-revision", out, repo=repo)
