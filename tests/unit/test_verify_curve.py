"""The cached t_verify(T) follows the verifications a worker runs (issue 30, item 4): a curve
measured under load corrects itself within a few cycles and stays corrected for the next start."""

from __future__ import annotations

import pytest

from cpu_worker.verify_cost import OnlineCurve, VerifyCostCache

LOADED = {1: 1471.0, 4: 1500.0, 8: 1600.0, 16: 2200.0}  # measured while the machine was busy
QUIET = {1: 315.0, 4: 298.0, 8: 335.0, 16: 462.0}  # what quiet cycles take


@pytest.fixture
def cache(tmp_path):
    cache = VerifyCostCache(tmp_path / "verify_cost.json")
    sizes = sorted(LOADED)
    cache.put("target", sizes, [LOADED[size] for size in sizes])
    return cache


def test_a_curve_measured_under_load_comes_down_within_a_few_cycles_and_is_saved(cache):
    curve = OnlineCurve(cache, "target", save_every=1000)
    for _ in range(3):  # three quiet cycles at T = 8, three decode steps
        curve.observe(8, QUIET[8])
        curve.observe(1, QUIET[1])
    corrected = curve.curve()
    assert corrected[8] == QUIET[8] and corrected[1] == QUIET[1]
    # Sizes no cycle used move by the observed sizes' ratio, not stay 4-5x too high.
    assert corrected[16] < LOADED[16] / 3 and corrected[4] < LOADED[4] / 3
    assert cache.get("target", [8]) == [LOADED[8]]  # nothing written before save()
    curve.save()
    restarted = cache.entry("target")
    assert restarted == pytest.approx(corrected, rel=1e-3)
    assert set(restarted) == set(LOADED)


def test_one_slow_cycle_moves_a_good_curve_little_and_saves_come_by_themselves(cache):
    sizes = sorted(QUIET)
    cache.put("target", sizes, [QUIET[size] for size in sizes])
    curve = OnlineCurve(cache, "target", save_every=3)
    curve.observe(4, 10 * QUIET[4])  # one cycle while something else ran
    assert curve.curve()[4] == QUIET[4]
    curve.observe(4, QUIET[4])
    curve.observe(4, QUIET[4])  # the third observation writes the cache
    assert cache.entry("target")[4] == pytest.approx(curve.curve()[4], rel=1e-3)


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_cycles(curve: OnlineCurve, clock: Clock, size: int, ms: float, seconds: int, per_second: int = 20) -> None:
    for _ in range(seconds):
        for _ in range(per_second):
            curve.observe(size, ms)
            clock.now += 1.0 / per_second


def test_a_busy_spell_at_the_end_of_a_run_leaves_the_saved_curve_as_the_quiet_cycles_made_it(cache):
    sizes = sorted(QUIET)
    cache.put("target", sizes, [1.2 * QUIET[size] for size in sizes])  # an older, slower curve
    clock = Clock()
    curve = OnlineCurve(cache, "target", save_every=10**6, clock=clock)
    run_cycles(curve, clock, 4, QUIET[4], seconds=120)
    run_cycles(curve, clock, 4, 5 * QUIET[4], seconds=60)  # a neighbour's build, for a minute
    curve.save()
    assert cache.entry("target")[4] == pytest.approx(QUIET[4])
    assert cache.entry("target")[16] == pytest.approx(QUIET[16])  # rescaled by size 4's ratio, 1 / 1.2


def test_a_machine_that_stays_busier_moves_the_curve_within_the_window(cache):
    sizes = sorted(QUIET)
    cache.put("target", sizes, [QUIET[size] for size in sizes])
    clock = Clock()
    curve = OnlineCurve(cache, "target", save_every=10**6, clock=clock)
    run_cycles(curve, clock, 1, QUIET[1], seconds=60)
    run_cycles(curve, clock, 1, 2 * QUIET[1], seconds=120)
    assert curve.estimate(1) == QUIET[1]  # two minutes of three quarters of five are not yet lasting
    run_cycles(curve, clock, 1, 2 * QUIET[1], seconds=180)
    assert curve.estimate(1) == 2 * QUIET[1]
    run_cycles(curve, clock, 1, QUIET[1], seconds=2)  # quiet again: the lower quartile of the bins
    assert curve.estimate(1) == 2 * QUIET[1]
    run_cycles(curve, clock, 1, QUIET[1], seconds=80)
    assert curve.estimate(1) == QUIET[1]


def test_a_busy_spell_right_after_a_start_or_an_idle_stretch_leaves_the_cached_curve(cache):
    sizes = sorted(QUIET)
    cache.put("target", sizes, [QUIET[size] for size in sizes])
    clock = Clock()
    curve = OnlineCurve(cache, "target", save_every=10**6, clock=clock)
    run_cycles(curve, clock, 4, 5 * QUIET[4], seconds=5)  # the first requests beside a neighbour's build
    assert curve.estimate(4) == QUIET[4]
    run_cycles(curve, clock, 4, QUIET[4], seconds=120)
    clock.now += 400  # no request for a while: the window holds none of these seconds
    run_cycles(curve, clock, 4, 5 * QUIET[4], seconds=5)
    curve.save()
    assert cache.entry("target")[4] == pytest.approx(QUIET[4])
    run_cycles(curve, clock, 4, 5 * QUIET[4], seconds=240)  # four minutes of it: the host stays busier
    assert curve.estimate(4) == 5 * QUIET[4]


def test_without_a_cached_curve_the_observations_are_the_curve(tmp_path):
    cache = VerifyCostCache(tmp_path / "verify_cost.json")
    curve = OnlineCurve(cache, "fresh", save_every=2)
    curve.observe(2, 120.0)
    curve.observe(2, 100.0)
    assert cache.entry("fresh") == {2: pytest.approx(110.0)}
    curve.save()  # nothing pending: nothing changes
    assert cache.entry("fresh") == {2: pytest.approx(110.0)}


def test_the_target_worker_feeds_its_verifications_and_decodes_to_the_curve(demo_target, tmp_path, monkeypatch):
    from cpu_worker.server import TargetService, build_engine
    from ipc import messages as m

    monkeypatch.setenv("DOVETAIL_CACHE_DIR", str(tmp_path))
    engine, _ = build_engine(str(demo_target), "int8-row", 256)

    class Ring:  # the feature rows go nowhere here
        def write(self, rows):
            return m.RingRef(ring="none", slot=0, seq=1, rows=len(rows), cols=rows.shape[1], dtype="float32")

    service = TargetService(engine, Ring(), Ring(), cost_key="demo")  # type: ignore[arg-type]
    service.measure_verify_cost(m.MeasureVerifyCost(tree_sizes=[1, 4]))
    measured = VerifyCostCache().entry("demo")
    assert set(measured) == {1, 4}
    service.prefill(m.PrefillRequest(seq_id=1, token_ids=[1, 400, 30, 7], return_features=False))
    service.verify(m.VerifyRequest(seq_id=1, tokens=[7, 8, 9, 10], parents=[-1, 0, 0, 1]))
    service.decode(m.DecodeRequest(seq_id=1, token=11))
    assert service.curve is not None and service.curve.observed_sizes() == {1, 4}
    service.release(m.ReleaseSequence(seq_id=1))
    assert VerifyCostCache().entry("demo") == pytest.approx(service.curve.curve(), rel=1e-3)
