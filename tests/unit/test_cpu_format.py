"""The CPU draft's format under --draft-dtype auto: measured once per layer shape and machine, then read
from the cache, so every later start picks the same format whatever the load."""

from __future__ import annotations

import pytest
from test_draft_support import tiny_spec

import gpu_worker.cpu_format as cpu_format
from cpu_worker.native import library as native
from gpu_worker.cpu_format import (
    DraftFormatCache,
    candidate_formats,
    fastest_cpu_format,
    format_key,
    layer_shapes,
)


def test_the_verdict_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    cache = DraftFormatCache(tmp_path / "draft_format.json")
    spec = tiny_spec(hidden=64)
    first = fastest_cpu_format(spec, cache=cache)
    assert first in (None, "int8", "q4_0")
    assert cache.path.is_file()

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached verdict was measured again")

    monkeypatch.setattr(cpu_format, "time_layer_formats", no_timing)
    assert fastest_cpu_format(spec, cache=cache) == first
    with pytest.raises(AssertionError, match="measured again"):  # another shape is measured
        fastest_cpu_format(tiny_spec(hidden=128), cache=cache)


@pytest.mark.parametrize(("times", "expected"), [((3.0, 2.0, 1.0), "q4_0"), ((1.0, 2.0, 3.0), None),
                                                 ((3.0, 1.0, 2.0), "int8"),
                                                 ((3.0, 2.0, 1.8), "int8")])  # q4_0 not clearly faster
def test_the_fastest_cached_format_wins(tmp_path, times, expected):
    cache = DraftFormatCache(tmp_path / "draft_format.json")
    spec = tiny_spec(hidden=64)
    shapes = layer_shapes(spec)
    cache.put(format_key(shapes, ("fp32", "int8", "q4_0")), [1, 2, 3], list(times))
    assert fastest_cpu_format(spec, cache=cache) == expected
    # Asked to choose between fp32 and int8 only, a different entry: measured, never q4_0.
    assert fastest_cpu_format(spec, formats=("fp32", "int8"), cache=cache) in (None, "int8")


def test_q4_0_is_a_candidate_only_where_every_input_width_is_whole_blocks():
    assert candidate_formats(layer_shapes(tiny_spec(hidden=64))) == ("fp32", "int8", "q4_0")
    assert candidate_formats([(64, 64), (64, 48)]) == ("fp32", "int8")


def test_without_the_native_library_auto_never_times_or_picks_q4_0(tmp_path, monkeypatch):
    # No C compiler (or a failed build): q4_0's block kernel cannot load, and timing it raised
    # RuntimeError, so a CPU draft at --draft-dtype auto failed to start on a fresh cache.
    monkeypatch.setattr(native, "load", lambda: None)
    assert candidate_formats(layer_shapes(tiny_spec(hidden=64))) == ("fp32", "int8")
    cache = DraftFormatCache(tmp_path / "draft_format.json")
    assert fastest_cpu_format(tiny_spec(hidden=64), cache=cache) in (None, "int8")
