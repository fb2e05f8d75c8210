"""Stopping is quick: a worker told to stop exits without the interpreter's teardown (0.8 s with
torch loaded), and the coordinator asks both workers before it waits for either. Asserted by
mechanism, not by a stopwatch: a timed bound would be flaky on a loaded 2-core machine."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest

from dovetail_runtime.coordinator import Coordinator, RuntimeSettings
from dovetail_runtime.workers import WorkerFailed, WorkerHandle
from ipc import messages as m
from ipc.channels import RuntimeDir
from ipc.shm_ring import ShmRing, slot_bytes_for

REPO = Path(__file__).resolve().parents[2]
# The cpu_worker as ``python -m cpu_worker.server`` runs it, plus an exit hook that leaves a file
# behind when the interpreter's normal teardown runs.
PROBE = """import atexit, os, runpy
atexit.register(lambda: open(os.environ["DOVETAIL_EXIT_MARK"], "w").close())
runpy.run_module("cpu_worker.server", run_name="__main__", alter_sys=True)
"""


def test_a_stopped_worker_exits_at_once_without_the_interpreters_teardown(demo_target, tmp_path):
    (tmp_path / "exit_probe.py").write_text(PROBE)
    mark = tmp_path / "finalized"
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "DOVETAIL_EXIT_MARK": str(mark)}
    slot = slot_bytes_for(64, 256, "float32")  # the demo target's hidden size
    rings = [ShmRing.create(slot, 4), ShmRing.create(slot, 1)]
    settings = m.TargetSettings(log_level="warning", max_len=64, threads=1, target=str(demo_target),
                                rings=m.RingNames(cycle=rings[0].name, prefill=rings[1].name))
    try:
        with RuntimeDir() as rundir:
            worker = WorkerHandle("cpu_worker", "exit_probe", settings, rundir, m.FROM_CPU_WORKER, m.TargetInfo,
                                  env=env)
            try:
                worker.spawn()
                worker.wait_ready(120)
                assert worker.process is not None
                process = worker.process
                assert worker.ask_to_stop()
                assert process.wait(timeout=60) == 0  # a clean stop, not a terminate or kill
            finally:
                worker.kill()
                worker.stop()
    finally:
        for ring in rings:
            ring.close()
    assert not mark.exists(), "the worker ran the interpreter's teardown after Shutdown"


def test_closing_asks_every_worker_to_stop_before_waiting_for_any():
    calls: list[str] = []

    def fake(name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(ask_to_stop=lambda: calls.append(f"ask {name}"),
                                     stop=lambda: calls.append(f"wait {name}"))

    coordinator = Coordinator(RuntimeSettings(target="unused", draft="unused"))
    coordinator.cpu, coordinator.gpu = fake("cpu"), fake("gpu")  # type: ignore[assignment]
    coordinator.close()
    assert calls == ["ask cpu", "ask gpu", "wait cpu", "wait gpu"]


def test_a_worker_killed_while_loading_says_memory_is_the_likely_cause(demo_target, tmp_path):
    """SIGKILL before the handshake is most often the out-of-memory killer: the error says so
    instead of only "exited with code -9"."""
    (tmp_path / "kill_probe.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])}
    settings = m.TargetSettings(log_level="warning", max_len=64, threads=1, target=str(demo_target),
                                rings=m.RingNames(cycle="unused", prefill="unused"))
    with RuntimeDir() as rundir:
        worker = WorkerHandle("cpu_worker", "kill_probe", settings, rundir, m.FROM_CPU_WORKER, m.TargetInfo, env=env)
        try:
            worker.spawn()
            with pytest.raises(WorkerFailed, match=r"exited with code -9 before it was ready \(killed: most often the "
                                                   r"system ran out of memory\)"):
                worker.wait_ready(120)
        finally:
            worker.kill()
            worker.stop()
