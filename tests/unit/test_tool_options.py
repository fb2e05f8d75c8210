"""The tools' options (comma lists, counts, sizes): a bad value is a one-line usage error (exit 2)
before any worker starts or model loads, never a traceback after minutes of set-up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ipc import messages as m
from tools import (
    bench_attention,
    bench_aux_rows,
    bench_batched_step,
    bench_block_kernel,
    bench_concurrent,
    bench_draft_level,
    bench_e2e,
    bench_fp32_kernel,
    bench_int8,
    bench_ipc,
    bench_kv_dtype,
    bench_layer_loop,
    bench_quality,
    check_row_invariance,
    kv_fidelity,
    sim_planner,
)

from conftest import DEMO_DRAFT, DEMO_TARGET

REPO = Path(__file__).resolve().parents[2]


class NoWorkers:
    """Stands in for the Coordinator: a run that gets this far has not checked its options."""

    def __init__(self, *_args, **_kwargs):
        raise AssertionError("the workers started before --temperatures was checked")


@pytest.mark.parametrize(("value", "says"), [
    ("x", "'x' is not a number"),
    ("0,hot", "'hot' is not a number"),
    ("-1", "at least 0"),
    ("nan", "not a finite number"),
    ("1e-9", "temperature must be 0 (greedy) or >= "),
    ("2000", "<= 1000"),
    (",", "give at least one value"),
])
def test_bench_e2e_rejects_a_bad_temperature_before_starting_workers(monkeypatch, value, says):
    monkeypatch.setattr(bench_e2e, "Coordinator", NoWorkers)
    result = CliRunner().invoke(bench_e2e.main, ["--target", "t", "--draft", "d", "--temperatures", value])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--temperatures'" in result.output and says in result.output
    assert "Traceback" not in result.output


def test_bench_e2e_temperatures_parse_to_floats():
    assert bench_e2e.parse_temperatures(None, None, "0, 0.7,,1") == [0.0, 0.7, 1.0]


@pytest.mark.parametrize(("option", "value"), [("--depth", "100"), ("--tree-top-k", "100"),
                                               ("--tree-tokens", "5000"), ("--tree-tokens", "0")])
def test_bench_e2e_rejects_a_tree_out_of_bounds_before_starting_workers(monkeypatch, option, value):
    monkeypatch.setattr(bench_e2e, "Coordinator", NoWorkers)
    result = CliRunner().invoke(bench_e2e.main, ["--target", "t", "--draft", "d", option, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output and "Traceback" not in result.output


class FakeCoordinator:
    """Answers every request at once with fixed statistics; records the settings it was given."""

    settings = None

    def __init__(self, settings):
        FakeCoordinator.settings = settings

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        return False

    def generate(self, request):
        dovetail = request.mode == "dovetail"
        stats = m.RequestStats(new_tokens=8, cycles=4 if dovetail else 8, tau=2.0 if dovetail else 1.0,
                               wall_ms=100.0 if dovetail else 400.0, verify_ms=40.0, ipc_ms=8.0,
                               draft_ms=20.0 if dovetail else 0.0)
        return m.GenerateDone(request_id=request.request_id, token_ids=[1] * 8, text="x", finish_reason="length",
                              stats=stats)


def test_bench_e2e_header_names_the_tree_that_ran(monkeypatch):
    """--depth deeper than T allows is clamped (to T - 1); the header said the depth asked for."""
    monkeypatch.setattr(bench_e2e, "Coordinator", FakeCoordinator)
    result = CliRunner().invoke(bench_e2e.main, ["--target", "t", "--draft", "d", "--tree-tokens", "3",
                                                 "--depth", "6", "--prompts", "1"])
    assert result.exit_code == 0, result.output
    assert FakeCoordinator.settings.tree.depth == 2
    assert "T=3 depth=2 top_k=8" in result.output
    # dovetail 80 tok/s against ar 20: the ratio is dovetail / ar
    assert "| 0 | speedup dovetail / ar | 4.00x |" in result.output


def test_bench_e2e_names_a_missing_target_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tools.bench_e2e", "--target", str(tmp_path / "nope"),
                           "--draft", "demo/draft-dgf", "--prompts", "1", "--max-new-tokens", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"Error: model folder {tmp_path / 'nope'} does not exist"


@pytest.mark.parametrize(("value", "says"), [("x", "'x' is not a whole number"), ("0", "at least 1"),
                                             ("1,,-2", "'-2': each value must be at least 1")])
def test_bench_concurrent_rejects_a_bad_stream_count_before_starting_a_server(monkeypatch, value, says):
    monkeypatch.setattr(bench_concurrent, "Server", NoWorkers)
    result = CliRunner().invoke(bench_concurrent.main, ["--target", "t", "--streams", value])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--streams'" in result.output and says in result.output


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--iters", "0", "0 is below 1"), ("--rows", "0", "0 is below 1"), ("--cols", "-5", "-5 is below 1"),
    ("--tree", "0", "0 is below 1"), ("--iters", "many", "'many' is not a whole number")])
def test_bench_ipc_rejects_a_count_below_one_before_spawning(monkeypatch, capsys, option, value, says):
    """--iters 0 ended in a ChannelTimeout traceback, --rows 0 in a ValueError from the ring."""
    monkeypatch.setattr(bench_ipc, "run", NoWorkers)
    with pytest.raises(SystemExit) as exit_:
        bench_ipc.main([option, value])
    assert exit_.value.code == 2
    assert f"argument {option}: {says}" in capsys.readouterr().err


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--precisions", "bf16,int9", "unknown precision int9: expected some of fp32,"),
    ("--gguf-precisions", "q4_1,q5", "unknown precision q5: expected some of fp32,"),
])
def test_bench_quality_rejects_an_unknown_precision_before_the_reference_runs(monkeypatch, tmp_path, option, value,
                                                                               says):
    """--precisions int9 ran the fp32 reference over every window and prompt, then died in a ValueError traceback."""
    monkeypatch.setattr(bench_quality, "load_texts", NoWorkers)
    result = CliRunner().invoke(bench_quality.main, ["--target", str(tmp_path), option, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output and says in result.output


def test_bench_quality_keeps_auto_for_the_gguf_only():
    gguf, ours = (next(p for p in bench_quality.main.params if p.name == name) for name in ("gguf_precisions",
                                                                                           "precisions"))
    assert bench_quality.parse_precisions(None, gguf, "auto, q4_1") == ["auto", "q4_1"]
    with pytest.raises(click.BadParameter):
        bench_quality.parse_precisions(None, ours, "auto")


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--kv", "fp32,fp16", "fp16: expected some of fp32, bf16"),  # was a KeyError after loading the model
    ("--contexts", "256,x", "'x' is not a whole number"),
    ("--contexts", "0", "0 is below 1"),
    ("--steps", "0", "0 is below 1"),  # was 'no median for empty data' after the prefills
    ("--threads", "-1", "-1 is below 1"),  # was torch's RuntimeError traceback
    ("--dtype", "int9", "invalid choice: 'int9'"),  # was a ValueError traceback from the loader
])
def test_bench_kv_dtype_rejects_bad_lists_before_loading(monkeypatch, capsys, option, value, says):
    monkeypatch.setattr(bench_kv_dtype, "load_target_model", NoWorkers)
    monkeypatch.setattr(sys, "argv", ["bench_kv_dtype", "--target", "t", option, value])
    with pytest.raises(SystemExit) as exit_:
        bench_kv_dtype.main()
    assert exit_.value.code == 2
    assert f"argument {option}: {says}" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "says"), [("0,1", "'0': each value must be at least 1"),
                                             ("1,two", "'two' is not a whole number")])
def test_bench_batched_step_rejects_a_bad_sequence_count_before_loading(monkeypatch, value, says):
    """--sequences 0,1 printed a row '| 0 | 0.00 | 0.00 | 0.08x |' (no engine at all, timed); 'two' was a
    ValueError traceback after the model loaded."""
    monkeypatch.setattr(bench_batched_step, "build_engine", NoWorkers)
    result = CliRunner().invoke(bench_batched_step.main, ["--target", "t", "--precision", "fp32", "--sequences",
                                                          value])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--sequences'" in result.output and says in result.output


def test_bench_batched_step_rejects_an_unknown_precision_before_loading(monkeypatch):
    """--precision int9 ended in the loader's ValueError traceback."""
    monkeypatch.setattr(bench_batched_step, "build_engine", NoWorkers)
    result = CliRunner().invoke(bench_batched_step.main, ["--target", "t", "--precision", "int9"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--precision': 'int9' is not one of 'auto', 'fp32'" in result.output


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--trees", "3,x", "'x' is not a whole number"),  # was a ValueError traceback
    ("--trees", "0", "0 is below 1"),
    ("--steps", "0", "0 is below 1"),  # was 'no median for empty data' after the prefill
    ("--context", "0", "0 is below 1"),
    ("--dtype", "int9", "invalid choice: 'int9'"),  # were ValueError tracebacks from the loader
    ("--kv-dtype", "fp16", "invalid choice: 'fp16'"),
])
def test_bench_layer_loop_rejects_bad_arguments_before_loading(monkeypatch, capsys, option, value, says):
    monkeypatch.setattr(bench_layer_loop, "build_engine", NoWorkers)
    monkeypatch.setattr(sys, "argv", ["bench_layer_loop", "--target", "t", option, value])
    with pytest.raises(SystemExit) as exit_:
        bench_layer_loop.main()
    assert exit_.value.code == 2
    assert f"argument {option}: {says}" in capsys.readouterr().err


def test_bench_layer_loop_trees_may_be_empty():
    assert bench_layer_loop.tree_sizes("") == [] and bench_layer_loop.tree_sizes("3, 8") == [3, 8]


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--kinds", "int8-row,q9", "'q9': expected int8-row or one of"),  # a ValueError after the header
    ("--kinds", "q4_0-a12", "'q4_0-a12'"),
    ("--shapes", "64by64", "'64by64': expected NxK"),  # a ValueError traceback
    ("--shapes", "0x64", "'0x64': expected NxK"),
    ("--rows", "1,0", "'0': each value must be at least 1"),
])
def test_bench_block_kernel_rejects_bad_lists_before_quantizing(monkeypatch, option, value, says):
    monkeypatch.setattr(bench_block_kernel, "layers_for", NoWorkers)
    result = CliRunner().invoke(bench_block_kernel.main, [option, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output and says in result.output


def test_bench_block_kernel_shapes_parse():
    assert bench_block_kernel.parse_shapes(None, None, "64x32, 8X16") == [(64, 32), (8, 16)]


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--tree-tokens", "1", "1 is not in the range 2<=x<=1024"),  # a ring of 0 bytes: ValueError after timing
    ("--repeats", "0", "0 is not in the range x>=1"),  # an IndexError in the summary
    ("--prompt-tokens", "4000", "4000 is not in the range 1<=x<=1024"),  # past the engines' context
    ("--layers", "1,x", "'x' is not a whole number"),
])
def test_bench_aux_rows_rejects_bad_arguments_before_loading(monkeypatch, option, value, says):
    monkeypatch.setattr(bench_aux_rows, "load_target_model", NoWorkers)
    result = CliRunner().invoke(bench_aux_rows.main, [option, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output and says in result.output


def test_bench_aux_rows_names_layers_the_target_lacks():
    result = CliRunner().invoke(bench_aux_rows.main, ["--target", str(DEMO_TARGET), "--layers", "1,99"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--layers': aux layers [1, 99] must be distinct, increasing and in 0..5" in result.output


def test_bench_aux_rows_says_how_many_calls_of_each_it_timed():
    """The header said '200 calls each' though the prefills ran max(10, repeats // 10) times (20)."""
    result = CliRunner().invoke(bench_aux_rows.main, ["--target", str(DEMO_TARGET), "--layers", "", "--repeats",
                                                      "3", "--prompt-tokens", "8", "--tree-tokens", "2"])
    assert result.exit_code == 0, result.output
    assert "3 verify calls and 10 prefills each" in result.output.splitlines()[0]


@pytest.mark.parametrize("option", ["--files", "--tokens", "--threads"])
def test_kv_fidelity_counts_start_at_one(monkeypatch, capsys, option):
    """--tokens 0 ran every prompt and died in a ZeroDivisionError; --files 0 said no held-out file was found;
    --threads 0 was torch's 'must be positive' traceback."""
    monkeypatch.setattr(kv_fidelity, "load_target_model", NoWorkers)
    monkeypatch.setattr(sys, "argv", ["kv_fidelity", "--target", "t", option, "0"])
    with pytest.raises(SystemExit) as exit_:
        kv_fidelity.main()
    assert exit_.value.code == 2
    assert f"argument {option}: 0 is below 1" in capsys.readouterr().err


CLICK_TOOLS = [
    (bench_batched_step.main, ["--precision", "fp32", "--target", "{empty}"], "has no config.json"),
    (bench_aux_rows.main, ["--target", "{empty}"], "has no config.json"),
    (bench_draft_level.main, ["--draft", str(DEMO_DRAFT), "--target", "{empty}"], "has no config.json"),
    (bench_quality.main, ["--target", "{empty}"], "has no tokenizer.json"),
    (bench_int8.main, ["--dim", "16", "--repeats", "1", "--threads", "1", "--target", "{empty}"], "has no config.json"),
    (bench_attention.main, ["--contexts", "8", "--trees", "1", "--repeats", "1", "--threads", "1", "--target",
                            "{empty}"], "has no config.json"),
    (sim_planner.main, ["dump", "--out", "{empty}/trees.json", "--target", "{empty}"], "has no tokenizer"),
]
ARGV_TOOLS = [(bench_kv_dtype.main, "has no config.json"), (bench_layer_loop.main, "has no config.json"),
              (kv_fidelity.main, "has no config.json")]


@pytest.mark.parametrize(("main", "arguments", "says"), CLICK_TOOLS)
def test_a_click_tool_names_a_folder_that_is_no_model_in_one_line(tmp_path, main, arguments, says):
    """Each ended in a ModelLoadError / TokenizerLoadError / DraftCheckpointError traceback."""
    result = CliRunner().invoke(main, [argument.format(empty=tmp_path) for argument in arguments])
    assert result.exit_code == 1, result.output
    assert f"Error: {tmp_path} {says}" in result.output
    assert not isinstance(result.exception, ValueError)  # the loaders' errors are ValueErrors


@pytest.mark.parametrize(("main", "says"), ARGV_TOOLS)
def test_an_argparse_tool_names_a_folder_that_is_no_model_in_one_line(tmp_path, monkeypatch, main, says):
    monkeypatch.setattr(sys, "argv", ["tool", "--target", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == f"Error: {tmp_path} {says}"


def test_bench_fp32_kernel_names_a_folder_that_is_no_model_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        bench_fp32_kernel.main(["--target", str(tmp_path)])
    assert exit_.value.code == f"Error: {tmp_path} has no config.json"


def test_check_row_invariance_threads_start_at_one(monkeypatch, capsys):
    """--threads 0 was torch's 'set_num_threads expects a positive integer' traceback."""
    monkeypatch.setattr(sys, "argv", ["check_row_invariance", "--threads", "0"])
    with pytest.raises(SystemExit) as exit_:
        check_row_invariance.main()
    assert exit_.value.code == 2
    assert "argument --threads: 0 is below 1" in capsys.readouterr().err


def test_bench_concurrent_says_too_few_tokens_instead_of_nan_for_a_p95():
    one_chunk = [{"times": [(0.0, 3)]}, {"times": [(0.0, 1)]}]
    assert bench_concurrent.format_ms(bench_concurrent.p95_itl_ms(one_chunk)) == "- (too few tokens)"
    streams = [{"times": [(0.0, 1), (0.1, 1), (0.3, 2)]}]  # gaps: 100 ms for one token, 100 ms each for two
    assert bench_concurrent.format_ms(bench_concurrent.p95_itl_ms(streams)) == "100.0"


def test_bench_lookup_names_a_bad_set_or_branch_before_starting_a_server(tmp_path):
    from tools import bench_lookup

    result = CliRunner().invoke(bench_lookup.main, ["--target", "t", "--sets", "chat,novels"])
    assert result.exit_code == 2 and "'novels' is not chat, edit or a JSONL file" in result.output
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"text": "x"}\n')
    result = CliRunner().invoke(bench_lookup.main, ["--target", "t", "--sets", str(bad)])
    assert result.exit_code == 2 and "not JSONL with a \"prompt\" field" in result.output
    result = CliRunner().invoke(bench_lookup.main, ["--target", "t", "--lookup-tokens", "0"])
    assert result.exit_code == 2 and "1-16" in result.output
    assert len(bench_lookup.prompt_set("edit")) == 8 and len(bench_lookup.prompt_set("chat")) == 24
    for modes, words in (("lookup", "ar among them"), ("lookup,ar,lookup", "distinct modes"),
                         ("beam,ar", "distinct modes"), ("dovetail,ar", "need a --draft")):
        result = CliRunner().invoke(bench_lookup.main, ["--target", "t", "--modes", modes])
        assert result.exit_code == 2 and words in result.output, modes
