"""The code's layers (DESIGN.md 11): imports point down, between packages and between the rooms
of cpu_worker; gpu_worker uses only cpu_worker's model box; the coordinator side has no torch."""

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
    "gpu_worker": {"ipc", "cpu_worker", "gpu_worker"},  # the model box only (test below)
    "dovetail_runtime": {"ipc", "cpu_worker", "gpu_worker", "dovetail_runtime"},
    "tools": {"ipc", "cpu_worker", "gpu_worker", "dovetail_runtime", "tools"},
}


# cpu_worker's rooms, bottom up: the C kernels and their loader, the layer kernels, the model both
# workers build, and the engine side (everything else). Where a worker runs (core lists, CPU flags,
# thread placement) is ipc's: ipc.placement.
CPU_WORKER_ROOMS = ("native", "kernels", "model", "engine")


def imported_modules(path: Path) -> set[str]:
    """The absolute modules a file imports, wherever the statement sits; ``from a import b``
    counts as ``a.b`` too (b may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def imported_packages(path: Path) -> set[str]:
    """Our top-level packages that a module imports, wherever the import statement sits."""
    return {name.split(".")[0] for name in imported_modules(path) if name.split(".")[0] in MAY_IMPORT}


def cpu_worker_room(module: str) -> str | None:
    """The room of a cpu_worker module (None for the package itself and for other packages)."""
    parts = module.split(".")
    if parts[0] != "cpu_worker" or len(parts) == 1:
        return None
    return parts[1] if parts[1] in CPU_WORKER_ROOMS[:3] else "engine"


def cpu_worker_rooms_used(path: Path) -> set[str]:
    return {room for room in map(cpu_worker_room, imported_modules(path)) if room is not None}


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


@pytest.mark.parametrize("room", CPU_WORKER_ROOMS[:3])
def test_cpu_worker_rooms_import_only_rooms_below(room):
    """native < kernels < model < the engine side: the C loader and the layer kernels never
    import the model or the engine, the model never imports the engine."""
    below = set(CPU_WORKER_ROOMS[:CPU_WORKER_ROOMS.index(room) + 1])
    wrong = {}
    for path in sorted((ROOT / "cpu_worker" / room).rglob("*.py")):
        upward = cpu_worker_rooms_used(path) - below
        if upward:
            wrong[str(path.relative_to(ROOT))] = sorted(upward)
    assert wrong == {}, f"modules of cpu_worker/{room} importing rooms above it: {wrong}"


def test_gpu_worker_uses_only_the_model_box_of_cpu_worker():
    wrong = {}
    for path in sorted((ROOT / "gpu_worker").rglob("*.py")):
        outside = cpu_worker_rooms_used(path) - {"model"}
        if outside:
            wrong[str(path.relative_to(ROOT))] = sorted(outside)
    assert wrong == {}, f"gpu_worker modules importing cpu_worker beyond its model box: {wrong}"


def test_cpu_worker_never_imports_the_draft_side():
    wrong = {str(path.relative_to(ROOT)) for path in sorted((ROOT / "cpu_worker").rglob("*.py"))
             if "gpu_worker" in imported_packages(path)}
    assert wrong == set()


@pytest.mark.parametrize("package", ["ipc", "cpu_worker", "gpu_worker", "dovetail_runtime"])
def test_installed_packages_never_import_tools(package):
    """tools/ is run from a checkout and not installed: nothing installed may need it."""
    wrong = {str(path.relative_to(ROOT)) for path in sorted((ROOT / package).rglob("*.py"))
             if "tools" in imported_packages(path)}
    assert wrong == set()


def test_the_room_check_names_the_rooms(tmp_path):
    module = tmp_path / "mixed.py"
    module.write_text("from cpu_worker.model import LlamaDecoder\nfrom cpu_worker import engine\n"
                      "import cpu_worker.kernels.int8\nfrom cpu_worker.native import loader\n"
                      "def f():\n    from cpu_worker.target_loading import load_target_model\n")
    assert cpu_worker_rooms_used(module) == {"model", "engine", "kernels", "native"}
    assert cpu_worker_room("cpu_worker.model.model_dir") == "model"
    assert cpu_worker_room("cpu_worker.precision") == "engine"
    assert cpu_worker_room("ipc.placement.apply_placement") is None


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
