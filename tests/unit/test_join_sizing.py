"""--join-chunk: how a prompt joining running requests is cut. The sizer learns a round's cost and a
prompt row's from the rounds it is told of and sizes a chunk to about one cycle, growing at most
twofold a round; the coordinator uses it only for a target whose prompt bits do not depend on their
chunks, and the flag parses as auto or a positive count."""

from __future__ import annotations

import click
import pytest

from dovetail_runtime import cli
from dovetail_runtime.cli_options import run_options
from dovetail_runtime.coordinator import Coordinator, RuntimeSettings
from dovetail_runtime.join_sizing import FIRST_ROWS, JoinSizer
from ipc import messages as m


def test_a_chunk_settles_at_about_one_cycle_of_the_running_streams():
    sizer = JoinSizer(limit=256)
    assert sizer.rows() == FIRST_ROWS  # nothing measured yet
    sizer.observe(40.0, steps=2, chunk_rows=0, prompt_work=False)  # a cycle of 40 ms
    assert sizer.rows() == FIRST_ROWS  # no chunk measured yet
    rows = sizer.rows()
    for _ in range(12):  # each prompt row adds 1.25 ms: 32 rows make one more cycle
        sizer.observe(40.0 + 1.25 * rows, steps=2, chunk_rows=rows, prompt_work=True)
        following = sizer.rows()
        assert following <= 2 * rows  # never more than twice the last chunk
        rows = following
    assert rows == 32
    assert sizer.describe() == "32 rows (cycle 40.0 ms, 1.25 ms a prompt row)"


def test_rounds_without_running_streams_teach_nothing_and_the_limit_holds():
    sizer = JoinSizer(limit=20)
    sizer.observe(500.0, steps=0, chunk_rows=256, prompt_work=True)  # a prompt alone: nobody waited
    sizer.observe(500.0, steps=0, chunk_rows=0, prompt_work=False)
    assert sizer.cycle_ms is None and sizer.row_ms is None
    sizer.observe(10.0, steps=1, chunk_rows=0, prompt_work=False)
    sizer.observe(9.0, steps=1, chunk_rows=8, prompt_work=True)  # noise: the chunk seemed free
    assert sizer.row_ms == 0.0 and sizer.rows() == 16  # twice the last chunk, no more
    sizer.observe(10.0, steps=1, chunk_rows=16, prompt_work=True)
    assert sizer.rows() == 20  # --prefill-chunk caps it
    # The draft reading a chunk's rows is prompt work: that round is not a cycle.
    sizer.observe(300.0, steps=1, chunk_rows=0, prompt_work=True)
    assert sizer.cycle_ms == 10.0
    assert JoinSizer(limit=4).rows() == 4


def info(chunk_invariant: bool, dtype: str = "int8") -> m.TargetInfo:
    return m.TargetInfo(threads=2, cores=[0, 1], max_len=512, hidden_size=64, vocab_size=100, dtype=dtype,
                        weight_bytes=1, kv_cache_bytes=1, kv_dtype="float32", exact_tree=True, kernel=None,
                        feature_size=64, aux_layers=[], chunk_invariant=chunk_invariant)


@pytest.mark.parametrize(("join_chunk", "max_batch", "invariant", "expected"), [
    ("auto", 4, True, "auto"), (16, 4, True, 16), (999, 4, True, 64),  # never more than --prefill-chunk
    ("auto", 4, False, None), (16, 4, False, None),  # fp32/bf16: --prefill-chunk pieces
    ("auto", 1, True, None), (None, 4, True, None)])
def test_the_coordinator_sizes_joining_chunks_only_where_the_target_allows_it(join_chunk, max_batch, invariant,
                                                                              expected):
    coordinator = Coordinator(RuntimeSettings(target="/t", draft=None, max_batch=max_batch, prefill_chunk=64,
                                              join_chunk=join_chunk))
    sizer, join = coordinator._joining(info(invariant))
    if expected is None:
        assert sizer is None and join is None
    elif expected == "auto":
        assert sizer is not None and sizer.limit == 64 and join == sizer.rows and join() == FIRST_ROWS
    else:
        assert sizer is None and join is not None and join() == expected


def test_the_flag_takes_auto_or_a_positive_count():
    def parsed(*flags: str):
        context = cli.run_main.make_context("dovetail-run", ["--target", "/t", *flags])
        return cli.runtime_settings(run_options(context.params), "/t", None).join_chunk

    assert parsed() == "auto" and parsed("--join-chunk", "AUTO") == "auto"
    assert parsed("--join-chunk", "12") == 12
    for bad in ("0", "-3", "many"):
        with pytest.raises(click.BadParameter):
            parsed("--join-chunk", bad)
