"""scripts/venv.sh installs with pip once, then again only when pyproject.toml changes or the installed
copy is not this repository's: the demo and the test command run it every time, and pip's resolving
took ~12 s of each run even with nothing to do."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Stands in for .venv/bin/python: records every pip call instead of running it, else runs this Python
# with the fake repository's packages importable (as an editable install makes them).
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$*" >> "{log}"; exit 0; fi
PYTHONPATH="{packages}" exec "{python}" "$@"
"""


def fake_repo(root: Path, packages: Path | None = None) -> tuple[Path, Path]:
    """A repository with venv.sh, a pyproject.toml and a .venv whose python logs pip and finds
    dovetail_runtime in ``packages`` (default: inside the repository); (repo, log)."""
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "venv.sh", root / "scripts" / "venv.sh")
    (root / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["a"]\n')
    packages = packages or root / "installed"
    (packages / "dovetail_runtime").mkdir(parents=True, exist_ok=True)
    (packages / "dovetail_runtime" / "__init__.py").write_text("")
    log = root / "pip.log"
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(FAKE_PYTHON.format(log=log, packages=packages, python=sys.executable))
    python.chmod(0o755)
    (bin_dir / "dovetail-run").write_text("")
    (bin_dir / "dovetail-run").chmod(0o755)
    return root, log


def pip_calls(repo: Path, log: Path) -> list[str]:
    log.unlink(missing_ok=True)
    done = subprocess.run(["bash", str(repo / "scripts" / "venv.sh")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_pip_runs_once_then_only_when_pyproject_changes(tmp_path):
    repo, log = fake_repo(tmp_path / "repo")
    assert pip_calls(repo, log) == ["-m pip install --quiet -e .[test,fixture]"]  # torch is found, so not installed
    assert pip_calls(repo, log) == []
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["a", "b"]\n')
    assert pip_calls(repo, log) == ["-m pip install --quiet -e .[test,fixture]"]
    assert pip_calls(repo, log) == []


def test_a_lost_command_or_an_install_of_another_copy_installs_again(tmp_path):
    repo, log = fake_repo(tmp_path / "repo")
    pip_calls(repo, log)
    (repo / ".venv" / "bin" / "dovetail-run").unlink()
    assert pip_calls(repo, log) != []
    other, log = fake_repo(tmp_path / "clone", packages=tmp_path / "repo" / "installed")
    assert pip_calls(other, log) != [] and pip_calls(other, log) != []  # its venv runs the first clone's code
