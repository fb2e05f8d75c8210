"""The typed boundary between the coordinator and a worker, in one process: a worker reads its
``--settings`` as a settings Struct (and refuses malformed ones, saying why, to the
coordinator), reports a typed ready info; ``Coordinator.recover`` restarts dead workers within
the restart budget."""

from __future__ import annotations

import os
import sys
import threading
import types

import msgspec
import pytest

from dovetail_runtime import coordinator as coordinator_module
from dovetail_runtime.coordinator import Coordinator, RuntimeSettings, TooManyRestarts
from ipc import messages as M
from ipc import worker_loop
from ipc.channels import Channel, RuntimeDir
from ipc.codec import decode_info, encode_settings

SETTINGS = M.TargetSettings(log_level="warning", max_len=64, rings=M.RingNames(cycle="c", prefill="p"),
                            target="/models/t", threads=2, aux_layers=[1, 2, 3])
INFO = M.TargetInfo(threads=2, cores=[0, 1], max_len=64, hidden_size=32, vocab_size=100, dtype="fp32",
                    weight_bytes=1000, kv_cache_bytes=2000, kv_dtype="float32", exact_tree=True,
                    kernel="dovetail-fp32", feature_size=96, aux_layers=[1, 2, 3])


@pytest.fixture
def worker_process(monkeypatch):
    """Run ``worker_main`` as a worker process would, minus what would change the test process
    itself (its SIGINT handler, its parent-death signal); yields (endpoint, start)."""
    monkeypatch.setattr(worker_loop, "die_with_parent", lambda: None)
    monkeypatch.setattr(worker_loop.signal, "signal", lambda *_: None)
    with RuntimeDir() as rundir:
        endpoint = rundir.endpoint("cpu_worker")

        def start(settings_text: str, load) -> int:
            monkeypatch.setattr(sys, "argv", ["cpu_worker", "--endpoint", endpoint, "--parent-pid",
                                              str(os.getppid()), "--settings", settings_text])
            return worker_loop.worker_main("cpu_worker", M.TO_CPU_WORKER, M.TargetSettings, load)

        yield endpoint, start


def test_a_worker_reads_typed_settings_and_reports_typed_info(worker_process):
    endpoint, start = worker_process
    coordinator = Channel.bind(endpoint, allowed=M.FROM_CPU_WORKER)
    seen: list[M.TargetSettings] = []

    def load(settings: M.TargetSettings):
        seen.append(settings)
        return INFO, {}

    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(start(encode_settings(SETTINGS), load)))
    thread.start()
    try:
        ready = coordinator.recv(5000)
        assert isinstance(ready, M.Ready) and ready.worker == "cpu_worker" and ready.pid == os.getpid()
        assert decode_info(ready.info, M.TargetInfo) == INFO
        assert seen == [SETTINGS] and isinstance(seen[0], M.TargetSettings)
        coordinator.send(M.Shutdown(), timeout_ms=2000)
        thread.join(10)
        assert codes == [0]
    finally:
        coordinator.close()


@pytest.mark.parametrize(("text", "why"), [
    ('{"max_len": 64, "target": "/t"}', "invalid TargetSettings: Object missing required field `rings`"),
    (msgspec.json.encode({**msgspec.to_builtins(SETTINGS), "threads": "2"}).decode(),
     "invalid TargetSettings: Expected `int | null`, got `str` - at `$.threads`"),
    ("{'max_len': 64}", "TargetSettings is not valid JSON"),
], ids=["missing", "type", "not-json"])
def test_a_worker_refuses_malformed_settings_and_tells_the_coordinator_why(worker_process, text, why):
    endpoint, start = worker_process
    coordinator = Channel.bind(endpoint, allowed=M.FROM_CPU_WORKER)
    loaded: list[object] = []
    try:
        assert start(text, loaded.append) == 1  # its startup error: it exits at once
        reply = coordinator.recv(2000)
        assert isinstance(reply, M.WorkerError) and reply.fatal and reply.worker == "cpu_worker"
        assert reply.message.startswith(f"ProtocolError: {why}")
        assert loaded == []  # nothing loaded from settings it could not read
    finally:
        coordinator.close()


def test_a_worker_whose_info_the_coordinator_would_refuse_fails_its_start(worker_process):
    endpoint, start = worker_process
    coordinator = Channel.bind(endpoint, allowed=M.FROM_CPU_WORKER)
    try:
        assert start(encode_settings(SETTINGS), lambda _: (msgspec.structs.replace(INFO, threads=-1), {})) == 1
        reply = coordinator.recv(2000)
        assert isinstance(reply, M.WorkerError) and reply.fatal
        assert "TargetInfo would be refused: Expected `int` >= 0 - at `$.threads`" in reply.message
    finally:
        coordinator.close()


# --- Coordinator.recover ------------------------------------------------------------------


class StandInWorker:
    """What recover() uses of a WorkerHandle."""

    def __init__(self, name: str):
        self.name = name
        self.up = True
        self.events: list[str] = []

    def alive(self) -> bool:
        return self.up

    def stop(self) -> None:
        self.events.append("stop")

    def spawn(self) -> None:
        self.events.append("spawn")
        self.up = True

    def wait_ready(self, timeout_s: float) -> None:
        self.events.append(f"wait_ready {timeout_s:g}")


@pytest.fixture
def recovering(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(coordinator_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    coordinator = Coordinator(RuntimeSettings(target="unused", draft=None, max_restarts=2, startup_timeout_s=7.0))
    cpu, gpu = StandInWorker("cpu_worker"), StandInWorker("gpu_worker")
    coordinator.cpu, coordinator.gpu = cpu, gpu  # type: ignore[assignment]
    return coordinator, cpu, gpu, clock


def test_recover_restarts_only_dead_workers_and_counts_them(recovering):
    coordinator, cpu, gpu, _ = recovering
    coordinator.recover()
    assert cpu.events == gpu.events == []  # both alive: nothing to do
    gpu.up = False
    coordinator.recover()
    assert gpu.events == ["stop", "spawn", "wait_ready 7"] and cpu.events == []
    assert coordinator.metrics.reply(queue_depth=0).worker_restarts == 1


def test_recover_gives_up_beyond_the_restart_budget_until_the_window_passes(recovering):
    coordinator, cpu, gpu, clock = recovering
    for worker in (cpu, gpu):  # the budget: 2 restarts in ten minutes
        worker.up = False
        coordinator.recover()
    clock[0] += 599.0
    cpu.up = False
    with pytest.raises(TooManyRestarts, match="^cpu_worker died 3 times in 10 minutes; giving up$"):
        coordinator.recover()
    assert cpu.events == ["stop", "spawn", "wait_ready 7"]  # not restarted a second time
    clock[0] += 2.0  # the first restarts are now more than ten minutes old
    coordinator.recover()
    assert cpu.events[-3:] == ["stop", "spawn", "wait_ready 7"] and len(cpu.events) == 6
    assert coordinator.metrics.reply(queue_depth=0).worker_restarts == 3


def test_the_target_spins_briefly_only_beside_a_draft_and_only_where_the_user_chose_no_policy():
    from dovetail_runtime.coordinator import TARGET_SPIN_COUNT, target_worker_env

    assert target_worker_env(True, {"PATH": "/bin"}) == {"GOMP_SPINCOUNT": TARGET_SPIN_COUNT}
    assert target_worker_env(False, {"PATH": "/bin"}) == {}  # --mode ar without a draft: libgomp's default
    assert target_worker_env(True, {"GOMP_SPINCOUNT": "5"}) == {}
    assert target_worker_env(True, {"OMP_WAIT_POLICY": "ACTIVE"}) == {}


def test_a_large_target_spins_longer_beside_a_draft():
    """~1 ms where a step takes tens of ms and up (a 1B model's layers and larger), ~0.1 ms below."""
    from dovetail_runtime.coordinator import (
        LARGE_TARGET_PROJECTIONS,
        LARGE_TARGET_SPIN_COUNT,
        TARGET_SPIN_COUNT,
        target_worker_env,
    )
    from dovetail_runtime.memory_fit import TargetSize

    def projections(config: dict) -> int:
        return TargetSize.from_config(config).projections

    demo = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "intermediate_size": 1536}  # SmolLM2-135M
    llama2_7b = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "intermediate_size": 11008}
    assert projections(demo) < LARGE_TARGET_PROJECTIONS <= projections(llama2_7b)
    assert int(TARGET_SPIN_COUNT) < int(LARGE_TARGET_SPIN_COUNT) <= 30_000  # libgomp's default: 300,000
    environ = {"PATH": "/bin"}
    assert target_worker_env(True, environ, projections(demo)) == {"GOMP_SPINCOUNT": TARGET_SPIN_COUNT}
    assert target_worker_env(True, environ, projections(llama2_7b)) == {"GOMP_SPINCOUNT": LARGE_TARGET_SPIN_COUNT}
    assert target_worker_env(False, environ, projections(llama2_7b)) == {}  # no draft: libgomp's default
    assert target_worker_env(True, {"GOMP_SPINCOUNT": "5"}, projections(llama2_7b)) == {}  # the user's choice


def test_the_draft_sleeps_after_a_short_spin_unless_the_user_chose_a_policy():
    from dovetail_runtime.coordinator import DRAFT_SPIN_COUNT, TARGET_SPIN_COUNT, draft_worker_env

    assert draft_worker_env({"PATH": "/bin"}) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": DRAFT_SPIN_COUNT}
    # Short, but longer than the target's: a draft step's calls are many and small.
    assert 0 < int(TARGET_SPIN_COUNT) < int(DRAFT_SPIN_COUNT) <= 30_000
    assert draft_worker_env({"GOMP_SPINCOUNT": "5"}) == {}  # the user's count reaches it through the environment
    assert draft_worker_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
