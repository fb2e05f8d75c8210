"""What the tree planner is told at startup: t_verify(T) and t_draft(depth) (each measured once,
cached on disk, kept current by the steps the workers run), and how a server reports them."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from cpu_worker.engine import TargetEngine
from cpu_worker.target_loading import load_target_model
from cpu_worker.verify_cost import VerifyCostCache, cache_key, measure_verify_ms
from gpu_worker.draft_cost import DraftCostCache, beam_key, draft_cost_key, measure_draft_ms
from gpu_worker.drafter import DraftContextError, Drafter
from ipc.cost_cache import TRUST_LOADED

from runtime_harness import BIN


def test_verify_cost_is_measured_per_size_and_leaves_the_engine_empty(demo_target):
    engine = TargetEngine(load_target_model(demo_target), max_len=256)
    engine.prefill([1, 2, 3])
    ms = measure_verify_ms(engine, [1, 4, 16, 64])
    assert len(ms) == 4 and all(value > 0 for value in ms)
    assert engine.committed == 0
    with pytest.raises(ValueError, match="cannot hold a 64-node tree"):
        measure_verify_ms(TargetEngine(load_target_model(demo_target), max_len=40), [64])


def test_verify_cost_cache_round_trips_and_keys_on_what_matters(tmp_path, demo_target):
    cache = VerifyCostCache(tmp_path / "sub" / "costs.json")
    key = cache_key(demo_target, "int8-row", 2, [0, 1])
    assert cache.get(key, [1, 2]) is None
    cache.put(key, [1, 2], [4.25, 5.5])
    assert cache.get(key, [1, 2]) == [4.25, 5.5]
    assert cache.get(key, [1, 2, 4]) is None  # a size never measured: measure again
    for other in (cache_key(demo_target, "fp32", 2, [0, 1]), cache_key(demo_target, "int8-row", 1, [0, 1]),
                  cache_key(demo_target, "int8-row", 2, [0])):
        assert other != key and cache.get(other, [1, 2]) is None
    # The engine's code is in the key too: a fused layer or a new kernel is measured again.
    import cpu_worker.verify_cost as verify_cost

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify_cost, "_engine_code_digest", lambda: "another revision")
        assert cache_key(demo_target, "int8-row", 2, [0, 1]) != key
    assert all((Path(verify_cost.__file__).parent / name).is_file() for name in verify_cost.ENGINE_SOURCES)
    cache.path.write_text("{not json")
    assert cache.get(key, [1, 2]) is None
    cache.put(key, [1], [3.0])  # a broken file is replaced, not fatal
    assert json.loads(cache.path.read_text())[key] == {"1": 3.0}


def test_each_kernel_and_forced_int8_layout_keeps_its_own_verify_costs(monkeypatch):
    """The label the cpu_worker keys its t_verify(T) cache with: one per fp32 kernel (ours, MKL's
    and F.linear's trees cost differently) and per int8 layout forced for a comparison."""
    from cpu_worker.kernels import int8_kernel
    from cpu_worker.server import verify_cost_label

    monkeypatch.delenv(int8_kernel.LAYOUT_VARIABLE, raising=False)
    labels = {verify_cost_label("fp32", kernel) for kernel in ("dovetail-fp32", "mkl-packed", "F.linear")}
    assert len(labels) == 3 and verify_cost_label("bf16", None) == "bf16"
    automatic = verify_cost_label("int8-row", "dovetail-amx")
    assert automatic == "int8-row/dovetail-amx"
    for layout in int8_kernel.LAYOUTS:
        monkeypatch.setenv(int8_kernel.LAYOUT_VARIABLE, layout)
        assert verify_cost_label("int8-row", "dovetail-amx") == f"int8-row/dovetail-amx/{layout}"
    assert verify_cost_label("fp32", "dovetail-fp32") == "fp32/dovetail-fp32"  # int8 layouts only


def test_draft_cost_is_measured_per_depth(demo_target, demo_draft):
    drafter = Drafter.from_pretrained(demo_draft, demo_target, max_len=64, device="cpu", dtype="fp32",
                                      scratch_len=5 * 4)
    ms = measure_draft_ms(drafter, [1, 2, 6], top_k=4)
    assert len(ms) == 3 and all(value > 0 for value in ms)
    assert ms[2] > ms[0]  # six levels of a 4-layer head cost more than one
    assert drafter.length == 0
    with pytest.raises((DraftContextError, ValueError), match="scratch"):
        measure_draft_ms(drafter, [8], top_k=4)


def test_draft_cost_is_cached_per_beam_and_follows_the_draft_steps(tmp_path, monkeypatch, demo_target, demo_draft):
    import torch

    from gpu_worker import server as gpu_server
    from ipc import messages as m
    from ipc.shm_ring import ShmRing, slot_bytes_for
    from ipc.tree import TreeShape

    monkeypatch.setenv("DOVETAIL_CACHE_DIR", str(tmp_path))
    drafter = Drafter.from_pretrained(demo_draft, demo_target, max_len=64, device="cpu", dtype="fp32",
                                      scratch_len=5 * 4)
    key = draft_cost_key(drafter, demo_draft, demo_target, "float32", 1, [0])
    assert key != draft_cost_key(drafter, demo_draft, demo_target, "int8", 1, [0])
    assert key != draft_cost_key(drafter, demo_draft, demo_target, "float32", 2, [0, 1])
    measure = m.MeasureDraftCost(depths=[1, 2], top_k=4)
    first = gpu_server.DraftService(drafter, {}, cost_key=key).measure_draft_cost(measure)
    assert not first.cached and first.cache_path == str(tmp_path / "draft_cost.json")

    def no_measuring(*_args, **_kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(gpu_server, "measure_draft_ms", no_measuring)
    ring = ShmRing.create(slot_bytes_for(8, drafter.feature_size, "float32"), 2)
    try:
        service = gpu_server.DraftService(drafter, {ring.name: ring}, cost_key=key)  # a second start
        second = service.measure_draft_cost(measure)
        assert second.cached and second.ms == pytest.approx(first.ms, rel=1e-3)
        shape = TreeShape.clamped(9, 2, 4)
        for reset, count in ((True, 8), (False, 3), (False, 2)):
            service.draft(m.DraftRequest(seq_id=1, reset=reset, tokens=list(range(5, 5 + count)), shape=shape,
                                         features=ring.write(torch.randn(count, drafter.feature_size))))
    finally:
        ring.close()
    curve = service.curves[4]
    assert curve.observed_sizes() == {2}  # two cycles at depth 2; the first (reset) step is not one
    service.release(m.ReleaseSequence(seq_id=1))
    assert DraftCostCache().entry(beam_key(key, 4)) == pytest.approx(curve.curve(), rel=1e-3)


def test_a_server_measures_verification_once_then_reads_the_cache(tmp_path, demo_target, demo_draft):
    env = {**os.environ, "DOVETAIL_CACHE_DIR": str(tmp_path / "cache")}
    logs = []
    # A measurement taken while other processes used the cores is rightly taken again at the next start
    # (ipc.cost_cache: up to TRUST_LOADED in a row, the last one kept), so starts go on until one reads the cache.
    for _ in range(TRUST_LOADED + 1):
        done = subprocess.run([str(BIN / "dovetail-run"), "--target", str(demo_target), "--draft", str(demo_draft),
                               "--draft-device", "cpu", "--prompt", "def add(a, b):\n", "--max-new-tokens", "16",
                               # A fixed draft precision: auto picks int8 or fp32 by a timing taken at
                               # each start, and on a loaded machine two starts can pick differently
                               # (then the draft cost is rightly measured again, under another key).
                               "--draft-dtype", "fp32", "--json"],
                              capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        logs.append(done.stderr)
        assert sum(json.loads(done.stdout)["stats"]["trees"].values()) >= 1
        if "measured now" not in done.stderr:
            break
    assert "measured now, cached in" in logs[0] and "cached in" in logs[-1] and "measured now" not in logs[-1]
    for before, after in zip(logs, logs[1:]):  # a start measured again only after one measured under load
        assert "measured now" not in after or "other processes used" in before, before[-3000:]
    assert (tmp_path / "cache" / "verify_cost.json").is_file()
    # The draft cost too: the start after a quiet one reads both curves instead of measuring them.
    assert f"(measured now, cached in {tmp_path / 'cache' / 'draft_cost.json'})" in logs[0]
    assert f"(cached in {tmp_path / 'cache' / 'draft_cost.json'})" in logs[-1]
    # (Whether it says "drafting cannot pay" depends on timings, so tests/unit/test_tree_planner.py
    # checks that verdict on fixed costs.)
    # Drafting is measured for both beam widths the planner tries (--tree-top-k 8 and 4).
    # The first tree is the deepest one the measured costs make cheap (tree_planner.first_shape):
    # usually of the wider beam, but the narrower one's when a noisy measurement makes every
    # top_k 8 cell dearer than the budget (tests/unit/test_tree_planner.py checks both on fixed costs).
    assert all("t_draft(depth) ms top_k 4: 1:" in log and "; top_k 8: 1:" in log
               and re.search(r"tree: starting with T=\d+ depth=\d+ top_k=[48] ", log) for log in logs)
