"""The code's layers (DESIGN.md 11): imports point down, and the coordinator side has no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each package and the packages it may import (its own included).
MAY_IMPORT = {
    "ipc": {"ipc"},
    "cpu_worker": {"ipc", "cpu_worker"},
    "gpu_worker": {"ipc", "cpu_worker", "gpu_worker"},  # the head reuses the target's decoder layers
    "dovetail_runtime": {"ipc", "cpu_worker", "gpu_worker", "dovetail_runtime"},
    "tools": {"ipc", "cpu_worker", "gpu_worker", "dovetail_runtime", "tools"},
}


def imported_packages(path: Path) -> set[str]:
    """Our top-level packages that a module imports, wherever the import statement sits."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in MAY_IMPORT)
    return found


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_imports_point_down(package):
    wrong = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        upward = imported_packages(path) - MAY_IMPORT[package]
        if upward:
            wrong[str(path.relative_to(ROOT))] = sorted(upward)
    assert wrong == {}, f"modules importing layers above {package}: {wrong}"


def test_the_layer_check_catches_an_upward_import(tmp_path):
    module = tmp_path / "bad.py"
    module.write_text("def f():\n    from dovetail_runtime.coordinator import Coordinator\n")
    assert imported_packages(module) == {"dovetail_runtime"}


def test_client_cli_and_coordinator_import_no_torch():
    # The CLI module holds both dovetail-run and dovetail-client; the coordinator process runs it.
    # The HTTP front end runs in the coordinator's process too.
    code = ("import sys, dovetail_runtime.client, dovetail_runtime.cli, dovetail_runtime.coordinator, "
            "dovetail_runtime.http_server; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('torch', 'transformers')))[:5]")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_dovetail_client_help_answers_without_torch():
    done = subprocess.run([str(Path(sys.executable).parent / "dovetail-client"), "--help"], capture_output=True,
                          text=True, timeout=60, env={"PYTHONVERBOSE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and "--connect" in done.stdout
    assert "import 'torch'" not in done.stderr
