"""dovetail-run's and dovetail-client's options sort into typed groups, each option into exactly one."""

from __future__ import annotations

from pathlib import Path

import pytest

from dovetail_runtime import cli
from dovetail_runtime.cli_options import (
    CpuPlacement,
    ModelOptions,
    SamplingOptions,
    check_grouped,
    client_options,
    run_options,
)


def parsed(command, args: list[str]) -> dict:
    """The keywords click hands the command for ``args``."""
    with command.make_context(command.name or "dovetail", args) as context:
        return dict(context.params)


def test_every_dovetail_run_option_lands_in_its_group():
    values = parsed(cli.run_main, ["--target", "/t", "--draft", "/d", "--cpu-cores", "0-3", "--draft-threads", "2",
                                   "--tree-tokens", "auto:32", "--depth", "5", "--prompt", "a", "--prompt", "b",
                                   "--stop", "\n", "--bind", "127.0.0.1:5555", "--max-queue", "9", "--seed", "3",
                                   "--log-level", "debug", "--worker-timeout", "12", "--prefill-chunk", "64"])
    options = run_options(values)
    assert options.models == ModelOptions(target="/t", draft="/d", target_dtype="auto", kv_dtype="auto",
                                          draft_device="auto", draft_dtype="auto", max_len=None, mode="dovetail",
                                          prefill_chunk=64)
    assert options.placement == CpuPlacement(cpu_threads=None, cpu_cores=[0, 1, 2, 3], draft_threads=2,
                                             draft_cores=None)
    assert (options.tree.tree_tokens, options.tree.depth, options.tree.tree_top_k) == (("auto", 32), 5, 8)
    assert (options.one_shot.prompts, options.one_shot.stops, options.one_shot.max_new_tokens) == (("a", "b"),
                                                                                                   ("\n",), 128)
    assert options.serving.binds == ("tcp://127.0.0.1:5555",) and options.serving.max_queue == 9
    assert (options.workers.worker_timeout, options.workers.startup_timeout, options.workers.max_restarts) == (
        12.0, 300.0, 3)
    assert options.sampling == SamplingOptions(temperature=0.0, sample_top_k=0, top_p=1.0, seed=3)
    assert options.log_level == "debug"


def test_every_dovetail_client_option_lands_in_its_group(tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text('[{"role": "user", "content": "hi"}]')
    options = client_options(parsed(cli.client_main, ["--messages", str(chat), "--json", "--deadline", "2.5",
                                                      "--mode", "ar", "--temperature", "0.5"]))
    assert options.as_json and options.connect.endpoint is None and options.connect.timeout == 600.0
    assert options.request.messages_file == Path(chat) and options.request.prompt is None
    assert (options.request.mode, options.request.deadline, options.request.chat) == ("ar", 2.5, False)
    assert options.sampling.temperature == 0.5


def test_an_option_in_no_group_or_in_two_is_caught():
    values = {"cpu_threads": 1, "cpu_cores": None, "draft_threads": None, "draft_cores": None}
    check_grouped(values, (CpuPlacement,))
    with pytest.raises(TypeError, match=r"options in no group: \['new_flag'\]"):
        check_grouped({**values, "new_flag": True}, (CpuPlacement,))
    with pytest.raises(TypeError, match=r"groups without their option: \['cpu_threads'\]"):
        check_grouped({k: v for k, v in values.items() if k != "cpu_threads"}, (CpuPlacement,))
    with pytest.raises(TypeError, match=r"in two groups: \['cpu_threads'\]"):
        check_grouped(values, (CpuPlacement,), "cpu_threads")


def test_without_a_target_the_real_pair_where_fetched_else_the_code_pair_and_how_to_fetch(monkeypatch, tmp_path,
                                                                                            capsys):
    gguf, head = tmp_path / "real.gguf", tmp_path / "draft-real"
    monkeypatch.setattr(cli, "SMOLLM2_GGUF", gguf)
    monkeypatch.setattr(cli, "SMOLLM2_DRAFT", head)
    monkeypatch.setattr(cli, "real_pair_present", lambda: gguf.is_file() and head.is_dir())
    assert cli.resolve_models(None, None, "dovetail") == (str(cli.CODE_TARGET), str(cli.CODE_DRAFT))
    assert "bash scripts/fetch_fixture.sh" in capsys.readouterr().err
    gguf.write_bytes(b"GGUF")
    head.mkdir()
    assert cli.resolve_models(None, None, "dovetail") == (str(gguf), str(head))
    assert cli.resolve_models(None, None, "ar") == (str(gguf), None)
    assert cli.resolve_models(None, None, "lookup") == (str(gguf), None)  # lookup needs no head
    assert cli.resolve_models("/mine", None, "lookup") == ("/mine", None)
    assert capsys.readouterr().err == ""
    assert cli.resolve_models("/mine", "/head", "dovetail") == ("/mine", "/head")  # never overrides a choice
    with pytest.raises(Exception, match="--draft is required"):
        cli.resolve_models("/mine", None, "dovetail")


def test_cors_origins_are_off_by_default_and_reach_the_http_frontend():
    assert run_options(parsed(cli.run_main, ["--http", "127.0.0.1:0"])).serving.cors_origins == ()
    values = parsed(cli.run_main, ["--http", "127.0.0.1:0", "--cors-origin", "http://localhost:3000",
                                   "--cors-origin", "*"])
    origins = run_options(values).serving.cors_origins
    assert origins == ("http://localhost:3000", "*")
    assert "--cors-origin ORIGIN" in cli.run_main.get_help(cli.run_main.make_context("dovetail-run", []))
    bound = cli.bind_clients([], None, "127.0.0.1:0", origins)
    assert bound is not None
    server, frontend = bound
    try:
        assert frontend is not None and frontend.cors_origins == origins
    finally:
        if frontend is not None:
            frontend.close()
        server.close()
