"""A step-cost measurement taken while other processes shared the cores is told apart and not
trusted by the next start (ipc.core_load, ipc.cost_cache): a verify curve measured during a test
suite once mis-sized every later start's trees until its cache file was deleted by hand."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from ipc.core_load import CoreLoadProbe, busy_core_seconds
from ipc.cost_cache import LOADED, TRUST_LOADED, CostCache, OnlineCurve, loaded_note

HZ = os.sysconf("SC_CLK_TCK")


def write_stat(path: Path, busy_ticks: dict[int, int], idle_ticks: int = 1000) -> None:
    """A /proc/stat with the given busy ticks per core, split over user, system and steal."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    for core, busy in sorted(busy_ticks.items()):
        user, system, steal = busy - busy // 2, busy // 4, busy // 2 - busy // 4
        lines.append(f"cpu{core} {user} 0 {system} {idle_ticks} 9 0 0 {steal} 0 0")
    lines.append("intr 1 2 3")
    path.write_text("\n".join(lines) + "\n")


def test_busy_seconds_count_user_system_and_steal_of_the_named_cores_only(tmp_path):
    stat = tmp_path / "stat"
    write_stat(stat, {0: 300, 1: 500, 2: 10_000})
    assert busy_core_seconds([0, 1], stat) == pytest.approx(800 / HZ)
    assert busy_core_seconds([3], stat) is None  # a core the file does not list
    assert busy_core_seconds([0], tmp_path / "missing") is None


def test_what_others_ran_on_the_cores_is_their_share_of_the_cores_time(tmp_path):
    stat = tmp_path / "stat"
    write_stat(stat, {0: 1000, 1: 1000})
    with CoreLoadProbe([0, 1], stat) as probe:
        time.sleep(0.4)  # 0.8 core-seconds, this process idle
        write_stat(stat, {0: 1000 + round(0.4 * HZ), 1: 1000})  # one core busy for someone else throughout
    assert probe.others_share == pytest.approx(0.5, abs=0.08)
    assert "of cores 0,1" in probe.describe() and "%" in probe.describe()


def test_this_process_own_work_is_not_counted_as_load(tmp_path):
    stat = tmp_path / "stat"
    write_stat(stat, {0: 1000})
    with CoreLoadProbe([0], stat) as probe:
        started, own = time.perf_counter(), time.process_time()
        while time.perf_counter() - started < 0.6:
            pass
        spent = time.process_time() - own
        write_stat(stat, {0: 1000 + round(spent * HZ)})  # the core was busy: with this process
    assert probe.others_share is not None and probe.others_share < 0.05


def test_too_short_a_measurement_is_not_judged(tmp_path):
    stat = tmp_path / "stat"
    write_stat(stat, {0: 1000})
    with CoreLoadProbe([0], stat) as probe:
        write_stat(stat, {0: 2000})
    assert probe.others_share is None


def _spin(seconds: float, core: int) -> None:
    os.sched_setaffinity(0, {core})
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="reads Linux's /proc/stat")
def test_real_processes_spinning_on_the_cores_are_seen():
    cores = sorted(os.sched_getaffinity(0))
    context = multiprocessing.get_context("spawn")
    spinners = [context.Process(target=_spin, args=(2.0, core)) for core in cores]
    for spinner in spinners:
        spinner.start()
    try:
        time.sleep(0.4)  # the spinners are up (a spawned interpreter takes a moment)
        with CoreLoadProbe(cores) as probe:
            time.sleep(1.0)
    finally:
        for spinner in spinners:
            spinner.join()
    assert probe.others_share is not None and probe.others_share > 0.6


def test_a_measurement_on_shared_cores_is_measured_again_until_the_third(tmp_path):
    cache = CostCache(tmp_path / "costs.json")
    for attempt in range(1, TRUST_LOADED):
        assert cache.put_measured("k", [1, 4], [900.0, 950.0], others_share=0.5) == attempt
        assert cache.get("k", [1, 4]) is None  # the next start measures again
    assert cache.put_measured("k", [1, 4], [880.0, 940.0], others_share=0.45) == TRUST_LOADED  # kept
    assert cache.get("k", [1, 4]) == [880.0, 940.0]
    assert "at 3 starts in a row: kept" in (loaded_note("t_verify", TRUST_LOADED, "x") or "")
    assert cache.put_measured("k", [1, 4], [900.0, 950.0], others_share=0.5) == TRUST_LOADED + 1  # still kept
    assert cache.get("k", [1, 4]) == [900.0, 950.0]
    assert cache.put_measured("k", [1, 4], [300.0, 310.0], others_share=0.05) == 0  # a quiet start clears it
    assert cache.loaded_count("k") == 0 and cache.get("k", [1, 4]) == [300.0, 310.0]
    assert cache.put_measured("k", [1, 4], [300.0, 310.0], others_share=None) == 0  # unknown: taken as quiet
    assert loaded_note("t_verify", 0, "x") is None


def test_marks_are_per_size_so_a_quiet_measurement_of_others_keeps_them(tmp_path):
    # One entry holds every size any start asked for: a tree planner's and lookup's.
    cache = CostCache(tmp_path / "costs.json")
    trees = [1, 2, 3, 4, 6, 8]
    cache.put_measured("k", trees, [9.0] * len(trees), others_share=0.6)
    cache.put_measured("k", [1, 2, 3, 4, 5], [1.0] * 5, others_share=0.0)  # lookup's sizes, quiet
    assert cache.get("k", [1, 2, 3, 4, 5]) == [1.0] * 5
    assert cache.get("k", trees) is None  # 6 and 8 are still the loaded ones: measured again
    assert cache.loaded_count("k", [6, 8]) == 1 and cache.loaded_count("k", [1, 5]) == 0
    cache.put_measured("k", trees, [1.0] * len(trees), others_share=0.0)
    assert cache.get("k", trees) == [1.0] * len(trees) and LOADED not in json.loads(cache.path.read_text())["k"]


def test_online_corrections_keep_the_mark_of_a_loaded_measurement(tmp_path):
    cache = CostCache(tmp_path / "costs.json")
    cache.put_measured("k", [1, 4], [900.0, 950.0], others_share=0.5)
    curve = OnlineCurve(cache, "k", save_every=1000)
    for _ in range(3):
        curve.observe(1, 300.0)
    curve.save()
    assert cache.entry("k")[1] == pytest.approx(300.0) and cache.loaded_count("k") == 1
    assert cache.get("k", [1, 4]) is None  # corrected for this run, still measured again next start


class LoadedProbe(CoreLoadProbe):
    """A probe that reports other processes on the cores, whatever the host does."""

    def __exit__(self, *exc) -> None:
        self.others_share = 0.55


def test_both_workers_say_so_and_mark_a_curve_measured_on_busy_cores(demo_target, demo_draft, tmp_path,
                                                                   monkeypatch, caplog):
    import cpu_worker.server as target_server
    import gpu_worker.server as draft_server
    from cpu_worker.verify_cost import VerifyCostCache
    from gpu_worker.draft_cost import DraftCostCache
    from ipc import messages as m

    monkeypatch.setenv("DOVETAIL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(target_server, "CoreLoadProbe", LoadedProbe)
    monkeypatch.setattr(draft_server, "CoreLoadProbe", LoadedProbe)
    engine, _ = target_server.build_engine(str(demo_target), "int8-row", 256)
    service = target_server.TargetService(engine, None, None, cost_key="demo")  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        first = service.measure_verify_cost(m.MeasureVerifyCost(tree_sizes=[1, 4]))
        again = service.measure_verify_cost(m.MeasureVerifyCost(tree_sizes=[1, 4]))
    assert not first.cached and not again.cached  # not trusted: measured again
    assert VerifyCostCache().loaded_count("demo") == 2
    assert "t_verify was measured while other processes used 55% of cores" in caplog.text

    from gpu_worker.drafter import Drafter

    drafter = Drafter.from_pretrained(demo_draft, demo_target, max_len=64, device="cpu", dtype="fp32",
                                      scratch_len=5 * 4)
    drafter_service = draft_server.DraftService(drafter, {}, cost_key="head")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cost = drafter_service.measure_draft_cost(m.MeasureDraftCost(depths=[1, 2], top_k=4))
        again = drafter_service.measure_draft_cost(m.MeasureDraftCost(depths=[1, 2], top_k=4))
    assert not cost.cached and not again.cached
    assert "t_draft (top_k 4) was measured while other processes used 55%" in caplog.text
    assert DraftCostCache().loaded_count("head/top_k=4") == 2
