"""How the coordinator starts a worker: ``python -m <module>`` with the coordinator's code, whatever
folder dovetail-run is started from."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ipc
from dovetail_runtime import workers
from dovetail_runtime.workers import WorkerHandle
from ipc import messages as m
from ipc.channels import RuntimeDir

REPO = Path(__file__).resolve().parents[2]
# A stand-in worker: it writes where its ``ipc`` package came from, then exits.
PROBE = "import os, ipc\nopen(os.environ['DOVETAIL_PROBE_OUT'], 'w').write(ipc.__file__)\n"


def test_a_folder_in_the_working_directory_never_replaces_the_workers_packages(tmp_path, monkeypatch):
    """dovetail-run started in a folder holding an ipc/ package (any project's): ``python -m`` put the
    working directory first on the worker's sys.path, so the worker imported that ipc and failed."""
    shadow = tmp_path / "project"
    (shadow / "ipc").mkdir(parents=True)
    (shadow / "ipc" / "__init__.py").write_text("raise ImportError('the working directory shadowed ipc')\n")
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "spawn_probe.py").write_text(PROBE)
    out = tmp_path / "ipc_file"
    env = {"PYTHONPATH": os.pathsep.join([str(modules), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "DOVETAIL_PROBE_OUT": str(out)}
    monkeypatch.chdir(shadow)
    settings = m.TargetSettings(log_level="warning", max_len=64, threads=1, target="unused",
                                rings=m.RingNames(cycle="unused", prefill="unused"))
    with RuntimeDir() as rundir:
        worker = WorkerHandle("cpu_worker", "spawn_probe", settings, rundir, m.FROM_CPU_WORKER, m.TargetInfo, env=env)
        try:
            worker.spawn()
            assert worker.process is not None and worker.process.wait(timeout=60) == 0
        finally:
            worker.kill()
            worker.stop()
    assert Path(out.read_text()) == Path(ipc.__file__)


def test_a_checkout_found_only_as_the_working_directory_is_handed_on(monkeypatch):
    """Started from a checkout without installing (``python -c`` there), the coordinator found its
    packages only in the working directory, which -P leaves out: the worker gets it on PYTHONPATH."""
    monkeypatch.setattr(sys, "path", ["", *sys.path[1:]])
    monkeypatch.chdir(REPO)
    assert workers.code_root_env({"PYTHONPATH": "/elsewhere"}) == {"PYTHONPATH": f"{REPO}{os.pathsep}/elsewhere"}
    monkeypatch.chdir(REPO / "docs")
    assert workers.code_root_env({}) == {}
