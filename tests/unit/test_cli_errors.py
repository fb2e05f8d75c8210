"""A newcomer's mistakes with dovetail-run and dovetail-train end in one line (exit 2, no
traceback) or a warning, and one-shot stdout is the completion alone (issue 33)."""

from __future__ import annotations

import inspect
import io
import json
import logging
import os
import sys
import types
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from cpu_worker.model.model_dir import ModelLoadError
from dovetail_runtime import cli, preflight, train_cli
from dovetail_runtime.coordinator import RuntimeSettings
from dovetail_runtime.preflight import (
    PreflightError,
    check_pair,
    check_settings,
    check_target,
    crowded_threads_warnings,
    shared_cores_warning,
)
from ipc import messages as m
from ipc.endpoints import EndpointError, normalize_endpoint

from conftest import DEMO, DEMO_DRAFT, DEMO_TARGET, save_tiny_model

EAGLE3_HEAD = DEMO / "draft-smollm2"  # an EAGLE-3 head for SmolLM2-135M, not for the 9M code model


def refused(command: click.Command, args: list[str]) -> str:
    """The one-line message click refuses ``args`` with (before the command runs)."""
    with pytest.raises(click.UsageError) as info:
        command.make_context(command.name or "dovetail", args)
    return info.value.format_message()


def run(command: click.Command, args: list[str]):
    result = CliRunner().invoke(command, args)
    assert "Traceback" not in result.output, result.output
    return result


# ------------------------------------------------------------------ dovetail-run: usage errors

@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_an_empty_prompt_file_is_refused_not_served(tmp_path, text, monkeypatch):
    def serve(*_args, **_kwargs):
        raise AssertionError("an empty --prompt-file started a server")

    monkeypatch.setattr(cli, "serve_clients", serve)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(text)
    result = run(cli.run_main, ["--target", str(DEMO_TARGET), "--draft", str(DEMO_DRAFT),
                                "--prompt-file", str(prompts)])
    assert result.exit_code == 2 and "holds no prompts" in result.output


def test_a_prompt_file_of_dash_is_stdin(monkeypatch):
    """`... | dovetail-run --prompt-file -`: "-" was a file that does not exist."""
    ran: list[list[str]] = []
    monkeypatch.setattr(cli, "run_one_shot", lambda settings, prompts, *rest: ran.append(prompts) or 0)
    common = ["--target", str(DEMO_TARGET), "--draft", str(DEMO_DRAFT), "--prompt-file", "-"]
    result = CliRunner().invoke(cli.run_main, common, input="\ufeffdef a():\n\nclass B:\r\n".encode("utf-8"))
    assert result.exit_code == 0 and ran == [["def a():", "class B:"]], result.output
    result = run(cli.run_main, [*common, "--prompt", "x"])  # an empty stdin: nothing from there
    assert result.exit_code == 2 and "stdin holds no prompts" in result.output
    result = CliRunner().invoke(cli.run_main, common, input='{"prompt": "a"}\n{"prompt": 3}\n')
    assert result.exit_code == 2 and 'stdin:2: a JSON line needs a string "prompt" field' in result.output
    result = CliRunner().invoke(cli.client_main, ["--messages", "-", "--connect", "ipc:///nobody/serves.sock"],
                                input="[]")
    assert result.exit_code == 2 and "stdin: the chat has no messages" in result.output, result.output


def test_a_one_shot_run_never_reads_the_api_key(monkeypatch):
    # A DOVETAIL_API_KEY in the environment that is no valid key (meant for another program, or a
    # client's) stopped one-shot runs, which serve nobody, with exit 2.
    ran = []
    monkeypatch.setattr(cli, "run_one_shot", lambda *args: ran.append(args) or 0)
    result = CliRunner().invoke(cli.run_main, ["--target", str(DEMO_TARGET), "--draft", str(DEMO_DRAFT), "--prompt",
                                               "x"], env={"DOVETAIL_API_KEY": "short"})
    assert result.exit_code == 0 and len(ran) == 1, result.output
    served = []
    monkeypatch.setattr(cli, "serve_clients", lambda *args, **kwargs: served.append(args) or 0)
    result = CliRunner().invoke(cli.run_main, ["--target", str(DEMO_TARGET), "--draft", str(DEMO_DRAFT)],
                                env={"DOVETAIL_API_KEY": "short"})
    assert result.exit_code == 2 and not served  # serving reads it, and refuses it


def test_an_option_or_nothing_given_as_the_model_is_named():
    assert "needs a value, but got the option '--draft'" in refused(cli.run_main, ["--target", "--draft", "x"])
    assert "is empty" in refused(cli.run_main, ["--target", ""])
    assert "is empty" in refused(cli.run_main, ["--target", str(DEMO_TARGET), "--draft", " "])


def test_a_missing_target_is_reported_before_the_draft_it_would_need(tmp_path, caplog):
    result = run(cli.run_main, ["--target", str(tmp_path / "absent"), "--prompt", "x"])
    assert result.exit_code == 2
    assert "--target: model folder" in caplog.text and "--draft is required" not in result.output


def test_a_draft_head_given_as_target_is_called_one(tmp_path):
    with pytest.raises(PreflightError, match="is a draft head folder, not a model: pass it as --draft"):
        check_target(str(DEMO_DRAFT))
    with pytest.raises(PreflightError, match="is a draft head folder"):
        check_target(str(EAGLE3_HEAD))
    with pytest.raises(PreflightError, match="--target: model folder .* does not exist"):
        check_target(str(tmp_path / "absent"))
    check_target(str(DEMO_TARGET))


def test_a_head_for_another_target_names_each_mismatch():
    with pytest.raises(PreflightError) as info:
        check_pair(str(DEMO_TARGET), str(EAGLE3_HEAD))
    message = str(info.value)
    assert "was trained for a different target" in message and "\n" not in message
    assert "its hidden size is 576, the target's 256" in message
    assert "its vocab size is 49152, the target's 8192" in message
    assert "it reads target layers [2, 15, 27], the target has 6 layers" in message
    assert "aux" not in message  # not the layer-id advice it got before
    with pytest.raises(PreflightError, match="different target"):
        check_settings(RuntimeSettings(target=str(DEMO_TARGET), draft=str(EAGLE3_HEAD), draft_device="cpu"))
    check_pair(str(DEMO_TARGET), str(DEMO_DRAFT))


@pytest.mark.parametrize("args", [["--http", "127.0.0.1:99999"], ["--bind", "tcp://127.0.0.1:99999"],
                                  ["--bind", "localhost:65536"], ["--bind", "70000"]])
def test_a_port_out_of_range_is_called_that(args):
    message = refused(cli.run_main, args)
    assert "the port must be 1-65535" in message and "expected HOST:PORT" not in message


@pytest.mark.parametrize("second", ["ipc:///tmp/twice.sock", "/tmp/./twice.sock"])
def test_one_endpoint_bound_twice_is_refused_naming_it(second):
    """It was refused at startup as 'already served by another dovetail-run (pid N)', N this process."""
    message = refused(cli.run_main, ["--bind", "/tmp/twice.sock", "--bind", second])
    assert "Invalid value for '--bind'" in message and "is given twice" in message and "another" not in message
    assert cli.without_repeats(("tcp://127.0.0.1:5555", "ipc:///tmp/a.sock")) == ("tcp://127.0.0.1:5555",
                                                                                "ipc:///tmp/a.sock")


def test_binding_an_inproc_endpoint_is_refused():
    """--bind inproc://x served where no client could reach it, saying 'dovetail serving on ' and nothing."""
    message = refused(cli.run_main, ["--bind", "inproc://x"])
    assert "Invalid value for '--bind'" in message and "reachable only inside this process" in message


def test_ports_in_range_and_free_port_spellings_pass():
    assert normalize_endpoint("tcp://127.0.0.1:65535") == "tcp://127.0.0.1:65535"
    assert normalize_endpoint(":0") == "tcp://127.0.0.1:0" and normalize_endpoint("*:*") == "tcp://*:*"
    with pytest.raises(EndpointError, match="must be 1-65535"):
        normalize_endpoint("tcp://[::1]:123456")
    assert "the port must be" in refused(cli.client_main, ["--connect", "127.0.0.1:99999"])
    assert "reachable only inside the server's process" in refused(cli.client_main, ["--connect", "inproc://x"])
    with cli.run_main.make_context("dovetail-run", ["--http", "127.0.0.1:0"]) as context:
        assert context.params["http_address"] == "127.0.0.1:0"


@pytest.mark.parametrize("piped,says", [
    (b"", "no prompt: give --prompt or --messages, or pipe the prompt in"), (b"\n", "no prompt"),
    (b"def \xff", "stdin is not UTF-8 text (byte 0xff at offset 4)")])
def test_dovetail_client_without_a_prompt_reads_stdin_and_refuses_nothing_or_bytes(piped, says):
    result = CliRunner().invoke(cli.client_main, ["--connect", "ipc:///nobody/serves.sock"], input=piped)
    assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output, result.output


def test_an_empty_stop_string_is_refused():
    assert "an empty stop string matches nothing" in refused(cli.run_main, ["--stop", "\n", "--stop", ""])
    assert "an empty stop string matches nothing" in refused(cli.client_main, ["--stop", ""])


def test_dovetail_client_refuses_what_the_protocol_cannot_carry_naming_the_flag(tmp_path):
    """Each of these once failed with a traceback as the client encoded the request."""
    undecodable = "def \udcff(x):"  # a non-UTF-8 argument, as Python receives it
    assert "'--prompt': is not valid text (character 4" in refused(cli.client_main, ["--prompt", undecodable])
    assert "'--system': is not valid text" in refused(cli.client_main, ["--chat", "--system", "\udcfe"])
    assert "1048577 is not in the range" in refused(cli.client_main, ["--max-new-tokens", "1048577"])
    assert "'--deadline'" in refused(cli.client_main, ["--deadline", "3000000"])
    assert "more than 1024 characters" in refused(cli.client_main, ["--stop", "a" * 1025])
    assert "65 stop strings" in refused(cli.client_main, [arg for i in range(65) for arg in ("--stop", f"s{i}")])
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "user", "content": "x"}] * (m.MAX_CHAT_MESSAGES + 1)))
    with pytest.raises(click.BadParameter, match="16385 messages; a request takes at most 16384"):
        cli.chat_messages(None, False, None, chat)
    with cli.client_main.make_context("dovetail-client", ["--prompt", "é", "--max-new-tokens", "1048576",
                                                          "--stop", "b" * 1024, "--deadline", "2147483"]) as context:
        assert context.params["max_new_tokens"] == m.MAX_NEW_TOKENS  # the bounds themselves pass


def test_dovetail_client_reads_a_messages_file_saved_with_a_byte_order_mark(tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"role": "user", "content": "h\u00e9"}]).encode())
    assert cli.chat_messages(None, False, None, chat) == [m.ChatMessage(role="user", content="hé")]


def test_dovetail_client_refuses_a_system_message_it_would_drop(tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    with pytest.raises(click.UsageError, match="put the system message first in the file"):
        cli.chat_messages(None, True, "Be brief.", chat)
    with_system = cli.chat_messages("hi", True, "Be brief.", None)
    assert with_system is not None and [turn.role for turn in with_system] == ["system", "user"]


def test_dovetail_client_ctrl_c_while_connecting_exits_130(monkeypatch, tmp_path):
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("dovetail_runtime.client.DovetailClient", interrupted)
    result = CliRunner().invoke(cli.client_main, ["--connect", "127.0.0.1:5555", "--prompt", "x"])
    assert result.exit_code == 130 and "Aborted" not in result.output


# ------------------------------------------------------------------ dovetail-run: warnings

def warnings_for(args: list[str], one_shot_run: bool, mode: str, caplog) -> str:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dovetail"), cli.run_main.make_context("dovetail-run", args):
        cli.warn_ignored_options(one_shot_run=one_shot_run, mode=mode)
    return caplog.text


def test_options_the_run_will_not_use_are_named(caplog):
    text = warnings_for(["--json", "--temperature", "0.5"], False, "dovetail", caplog)
    assert "--json, --temperature only apply to one-shot runs" in text
    text = warnings_for(["--prompt", "x", "--mode", "ar", "--compare-ar"], True, "ar", caplog)
    assert "with --mode ar there is nothing to compare" in text
    text = warnings_for(["--prompt", "x", "--mode", "ar", "--draft", "d", "--tree-tokens", "8"], True, "ar", caplog)
    assert "--draft, --tree-tokens: no draft runs with --mode ar" in text
    assert "--bind only applies to serving" in warnings_for(["--prompt", "x", "--bind", "127.0.0.1:5555"], True,
                                                            "dovetail", caplog)
    assert warnings_for(["--prompt", "x", "--json", "--compare-ar"], True, "dovetail", caplog) == ""
    # --mode lookup: no draft either, but it uses --lookup-tokens, and --compare-ar compares it with ar.
    text = warnings_for(["--prompt", "x", "--mode", "lookup", "--draft", "d", "--lookup-tokens", "8", "--compare-ar"],
                        True, "lookup", caplog)
    assert "--draft: no draft runs with --mode lookup" in text and "compare" not in text
    assert warnings_for(["--bind", "127.0.0.1:5555", "--max-queue", "3"], False, "dovetail", caplog) == ""


def test_a_cpu_draft_on_the_targets_cores_is_warned_with_a_fix(monkeypatch):
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        pytest.skip("needs two cores")
    first, rest = available[:1], available[1:]

    def placed(**fields) -> str | None:
        return shared_cores_warning(RuntimeSettings(target="t", draft="d", **fields))

    warning = placed(draft_device="cpu", cpu_cores=first)
    assert warning is not None and f"runs on core {first[0]}, which the target uses too" in warning
    assert f"--draft-cores {rest[0]}" in warning
    assert "fewer --cpu-cores" in (placed(draft_device="cpu", cpu_cores=available, draft_cores=first) or "")
    assert placed(draft_device="cpu", cpu_cores=first, draft_cores=rest) is None
    assert placed(draft_device="cpu") is None  # the default: both everywhere, said nowhere
    assert placed(draft_device="cuda", cpu_cores=first) is None
    monkeypatch.setattr(preflight, "cuda_device_count", lambda: 0)
    assert placed(draft_device="auto", cpu_cores=first) is not None
    monkeypatch.setattr(preflight, "cuda_device_count", lambda: 1)
    assert placed(draft_device="auto", cpu_cores=first) is None


def test_more_threads_than_their_cores_is_warned():
    """--cpu-threads 4 --cpu-cores 0 ran 4 OpenMP threads on one core without a word (2.7x slower)."""
    available = sorted(os.sched_getaffinity(0))

    def warned(**fields) -> list[str]:
        return crowded_threads_warnings(RuntimeSettings(target="t", draft="d", **fields))

    [warning] = warned(cpu_threads=4, cpu_cores=available[:1])
    assert warning.startswith(f"--cpu-threads 4 on 1 core (--cpu-cores {available[0]})")
    assert "--cpu-threads 1 or fewer" in warning
    [warning] = warned(draft_threads=len(available) + 1)
    assert warning.startswith(f"--draft-threads {len(available) + 1} on {len(available)} core")
    assert warned(cpu_threads=1, cpu_cores=available[:1], draft_threads=len(available)) == []
    assert warned() == []
    assert crowded_threads_warnings(RuntimeSettings(target="t", draft=None, draft_threads=99)) == []  # --mode ar


# ------------------------------------------------------------------ dovetail-run: pipeable stdout

class FakeCoordinator:
    """Streams a fixed completion in two chunks, as Coordinator.generate does."""

    def __init__(self, chunks: list[str]):
        self.chunks = chunks

    def generate(self, request: m.GenerateRequest, on_text=None):
        if on_text is not None:
            arity = len(inspect.signature(on_text).parameters)  # (ids, text[, logprobs])
            for chunk in self.chunks:
                on_text(*([1], chunk, [])[:arity])
        stats = m.RequestStats(new_tokens=2, tokens_per_s=10.0 if request.mode == "dovetail" else 5.0)
        return m.GenerateDone(request_id=request.request_id, token_ids=[1, 1], text="".join(self.chunks),
                              finish_reason="length", stats=stats)


def test_one_shot_stdout_is_the_completion_alone_and_the_stats_go_to_stderr(capsys):
    params = dict(max_new_tokens=2, stop=[], mode="dovetail", sampling=m.Sampling())
    failures = cli.run_prompts(FakeCoordinator([" walk", "(path)"]), ["import os", "def f():"], params,
                               as_json=False, compare_ar=True)
    out, err = capsys.readouterr()
    assert failures == 0 and out == " walk(path)\n walk(path)\n"
    assert err.count("[dovetail: 2 tokens") == 2 and "[ar: 2 tokens" in err
    assert "[dovetail / ar: 2.00x; same tokens: yes]" in err


def test_json_output_is_unchanged(capsys):
    params = dict(max_new_tokens=2, stop=[], mode="dovetail", sampling=m.Sampling())
    cli.run_prompts(FakeCoordinator(["a", "b"]), ["p"], params, as_json=True, compare_ar=True)
    out, err = capsys.readouterr()
    (record,) = [json.loads(line) for line in out.splitlines()]
    assert record["prompt"] == "p" and record["text"] == "ab" and record["ar"]["same_tokens"] is True
    assert err == ""


def test_stdout_closed_by_its_reader_ends_the_run_quietly(monkeypatch, caplog):
    """`dovetail-run ... | head -c 5`: 'ERROR dovetail: [Errno 32] Broken pipe' and exit 2, the status of a
    run that could not start; now 141, as a process SIGPIPE ends."""
    from dovetail_runtime import coordinator as coordinator_module
    from dovetail_runtime.cli_options import OneShotOptions

    read_end, write_end = os.pipe()
    os.close(read_end)
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.FileIO(write_end, "w"), write_through=True))
    fake = FakeCoordinator(["one", "two"])
    fake.start = fake.close = lambda: None  # type: ignore[attr-defined]
    monkeypatch.setattr(coordinator_module, "Coordinator", lambda settings: fake)
    options = OneShotOptions(prompts=("a", "b"), prompt_file=None, stops=(), as_json=False, compare_ar=False,
                             max_new_tokens=2, chat=False)
    with caplog.at_level(logging.WARNING):
        status = cli.run_one_shot(RuntimeSettings(target="t", draft="d"), ["a", "b"], options, m.Sampling())
    assert status == 141 and caplog.text == ""


def test_text_stdout_cannot_encode_is_escaped_and_every_prompt_is_answered(monkeypatch):
    """PYTHONIOENCODING=ascii (or a Latin-1 locale) and an answer with 'é': UnicodeEncodeError
    mid-answer ended the run with exit 2, the later prompts unanswered."""
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    params = dict(max_new_tokens=2, stop=[], mode="dovetail", sampling=m.Sampling())
    failures = cli.run_prompts(FakeCoordinator(["Caf", "\u00e9"]), ["a", "b"], params, as_json=False)
    sys.stdout.flush()
    assert failures == 0 and raw.getvalue() == b"Caf\\xe9\nCaf\\xe9\n"


def test_a_one_shot_prompt_no_context_can_hold_is_refused_untokenized(monkeypatch):
    """--prompt-file with a 23 MB line: the coordinator tokenized it all (4.4 GB, a minute; a bigger
    file was killed for memory) to say prompt_too_long; serving refused it by its length already."""
    from dovetail_runtime.coordinator import Coordinator
    from dovetail_runtime.tokenizer import Tokenizer

    coordinator = Coordinator(RuntimeSettings(target="unused", draft=None))
    coordinator.tokenizer, coordinator.max_len = Tokenizer.from_dir(DEMO_TARGET), 64
    coordinator.chat_template = object()  # type: ignore[assignment]
    coordinator.cpu = types.SimpleNamespace(alive=lambda: True)  # type: ignore[assignment]
    monkeypatch.setattr(coordinator.tokenizer, "encode", lambda text: pytest.fail("the prompt was tokenized"))
    limit = coordinator.max_prompt_chars()
    assert limit is not None
    request = m.GenerateRequest(request_id="r", prompt="x" * (limit + 1), max_new_tokens=1, mode="ar")
    reply = coordinator.generate(request)
    assert isinstance(reply, m.ErrorReply) and reply.code == "prompt_too_long", reply
    assert f"prompt of {limit + 1} characters cannot fit the context of 64 tokens" in reply.message
    # The bound scans the vocabulary (~20 ms): once per tokenizer, not once per prompt.
    monkeypatch.setattr(coordinator.tokenizer, "_backend", None)  # a second scan would fail on it
    assert coordinator.generate(request).code == "prompt_too_long"  # type: ignore[union-attr]


# ------------------------------------------------------------------ dovetail-train

def test_train_on_a_folder_that_holds_no_features_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    result = run(train_cli.main, ["train", "--target", str(DEMO_TARGET), "--features", str(tmp_path),
                                  "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "is not a feature folder (no manifest.json)" in result.output
    (tmp_path / "manifest.json").write_text(json.dumps({"complete": False, "shards": []}))
    result = run(train_cli.main, ["train", "--target", str(DEMO_TARGET), "--features", str(tmp_path),
                                  "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "feature extraction did not finish" in result.output


@pytest.mark.parametrize("args, message", [
    (["eval", "--target", str(DEMO_TARGET), "--draft", "/nonexistent"], "draft head folder /nonexistent does not"),
    (["eval", "--target", "/nonexistent", "--draft", str(DEMO_DRAFT)], "model folder /nonexistent does not exist"),
    (["eval", "--target", str(DEMO_TARGET), "--draft", str(DEMO_TARGET.parent)], "has no config.json"),
    (["eval", "--target", str(DEMO_TARGET), "--draft", str(EAGLE3_HEAD)], "was trained for a different target"),
    (["export", "--target", str(DEMO_TARGET), "--draft", "/nonexistent", "--out", "/tmp/x"], "does not exist"),
    (["features", "--target", "/nonexistent", "--out", "/tmp/x", "--stdlib"], "does not exist"),
])
def test_train_commands_refuse_missing_folders_in_one_line(args, message):
    result = run(train_cli.main, args)
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("command", ["features", "train", "export"])
def test_an_out_folder_under_a_file_is_refused_before_loading(tmp_path, command):
    (tmp_path / "notes.txt").write_text("hi")  # was NotADirectoryError from mkdir, after the target loaded
    message = refused(train_cli.main.commands[command], ["--out", str(tmp_path / "notes.txt" / "run")])
    assert f"{tmp_path / 'notes.txt'} is a file, so {tmp_path / 'notes.txt' / 'run'} cannot be a folder" in message


def test_sampling_options_at_temperature_0_are_named(caplog, tmp_path):
    assert "--top-p, --seed: no sampling at --temperature 0" in warnings_for(
        ["--prompt", "x", "--top-p", "0.9", "--seed", "3"], True, "dovetail", caplog)
    assert warnings_for(["--prompt", "x", "--temperature", "0.7", "--seed", "3"], True, "dovetail", caplog) == ""
    result = CliRunner().invoke(cli.client_main, ["--connect", f"ipc://{tmp_path}/none.sock", "--prompt", "x",
                                                  "--sample-top-k", "5"])
    assert result.exit_code == 1 and "warning: --sample-top-k: no sampling at --temperature 0" in result.output


def feature_args(tmp_path, window: int) -> list[str]:
    text = tmp_path / "corpus.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 20)
    return ["features", "--target", str(DEMO_TARGET), "--out", str(tmp_path / "features"), "--input", str(text),
            "--window", str(window), "--max-tokens", "64", "--dtype", "fp32"]


def demo_target_without(folder, *left_out: str):
    """The demo target's files linked into ``folder``, but for ``left_out``."""
    folder.mkdir()
    for path in DEMO_TARGET.iterdir():
        if path.name not in left_out:
            (folder / path.name).symlink_to(path)
    return folder


@pytest.mark.parametrize("left_out, message", [
    (("model.safetensors",), "Error: no weights in"),  # was a ModelLoadError traceback
    (("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"), "has no tokenizer"),  # "sentencepiece"
])
def test_features_with_a_target_that_cannot_load_is_one_line(tmp_path, left_out, message):
    target = demo_target_without(tmp_path / "target", *left_out)
    args = feature_args(tmp_path, 32)
    args[args.index("--target") + 1] = str(target)
    result = run(train_cli.main, args)
    assert result.exit_code == 1 and message in result.output, result.output
    assert not (tmp_path / "features").exists()


def test_eval_with_a_text_file_named_gguf_is_one_line(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("hello world\n")  # was transformers' ValueError traceback from its GGUF tokenizer
    result = run(train_cli.main, ["eval", "--target", str(fake), "--draft", str(DEMO_DRAFT), "--input", str(fake)])
    assert result.exit_code == 1 and "the magic number is b'hell', not b'GGUF'" in result.output, result.output


def test_a_head_that_cannot_load_is_one_line(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text((DEMO_DRAFT / "config.json").read_text())  # no weights
    result = run(train_cli.main, ["export", "--target", str(DEMO_TARGET), "--draft", str(head), "--out",
                                  str(tmp_path / "out")])  # was a DraftCheckpointError traceback
    assert result.exit_code == 1 and f"Error: no weights in {head}" in result.output, result.output
    (head / "config.json").write_text("{bad")
    for command in ("eval", "export"):  # was a JSONDecodeError traceback
        out = ["--out", str(tmp_path / "out")] if command == "export" else []
        result = run(train_cli.main, [command, "--target", str(DEMO_TARGET), "--draft", str(head), *out])
        assert result.exit_code == 2 and f"cannot read {head / 'config.json'}" in result.output, result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra", [[], ["--aux-layers", "1,3,5"]])
def test_windows_past_the_targets_context_are_refused_before_anything_is_written(tmp_path, extra):
    text = tmp_path / "long.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 400)  # one document of some 5,000 tokens
    limit = json.loads((DEMO_TARGET / "config.json").read_text())["max_position_embeddings"]
    result = run(train_cli.main, ["features", "--target", str(DEMO_TARGET), "--out", str(tmp_path / "features"),
                                  "--input", str(text), "--window", str(2 * limit), *extra])
    # was "max_len must be in 1..2048" after a manifest was written (then the fixed command was refused
    # for other settings), and with --aux-layers rows past the trained context, silently
    assert result.exit_code == 2 and f"past the target's context of {limit}" in result.output, result.output
    assert f"use --window {limit} or less" in result.output
    assert not (tmp_path / "features").exists()


@pytest.mark.parametrize("tree, message", [("0,6,8", "tree size T must be in 1..1024"),
                                           ("16,-1,8", "depth must be in 1..64, got -1"),
                                           ("16,6,99", "top_k must be in 1..64, got 99")])
def test_eval_trees_out_of_bounds_are_refused_before_loading(tree, message):
    message_given = refused(train_cli.main.commands["eval"], ["--tree", tree])  # was a TreeError traceback
    assert f"--tree': {tree}: {message}" in message_given, message_given
    assert "not in the range 1<=x<=1024" in refused(train_cli.main.commands["eval"], ["--tree-tokens", "100000"])


def test_eval_past_the_targets_context_is_refused_before_it_loads(tmp_path):
    text = tmp_path / "prompt.py"
    text.write_text("def add(a, b):\n    return a + b\n")
    result = run(train_cli.main, ["eval", "--target", str(DEMO_TARGET), "--draft", str(DEMO_DRAFT), "--input",
                                  str(text), "--prompt-tokens", "4", "--new-tokens", "100000"])
    # was "max_len must be in 1..2048 for this model" in a traceback, once the target had loaded
    assert result.exit_code == 2 and "need 100021 positions, past the target's context of 2048" in result.output, \
        result.output


def test_export_refuses_what_it_cannot_copy_before_writing(tmp_path):
    import shutil

    target = Path(shutil.copytree(DEMO_TARGET, tmp_path / "target"))  # copies: the old code wrote into it
    before = (target / "model.safetensors").read_bytes()
    result = run(train_cli.main, ["export", "--target", str(target), "--out", str(target), "--dtype", "bf16"])
    # was: the target's weights rewritten in place, then a SameFileError traceback
    assert result.exit_code == 2 and "is the folder it would export from" in result.output, result.output
    assert (target / "model.safetensors").read_bytes() == before
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")  # the option's check only looks at the name; export refuses GGUF targets by kind
    result = run(train_cli.main, ["export", "--target", str(fake), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "is a GGUF file: export copies a model folder" in result.output, result.output
    result = run(train_cli.main, ["export", "--target", str(DEMO_TARGET), "--draft", str(EAGLE3_HEAD), "--out",
                                  str(tmp_path / "out")])  # was a ValueError traceback
    assert result.exit_code == 2 and "is an EAGLE-3 head" in result.output, result.output
    assert not (tmp_path / "out").exists()  # the GGUF case wrote model.safetensors there before failing


def test_eval_chat_prompts_for_a_target_without_a_chat_template_are_refused(tmp_path):
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')  # the demo code model has no chat template
    result = run(train_cli.main, ["eval", "--target", str(DEMO_TARGET), "--draft", str(DEMO_DRAFT), "--chat",
                                  str(prompts)])  # was transformers' ValueError in a traceback
    assert result.exit_code == 2 and "has no chat template to render the prompts with" in result.output, \
        result.output


@pytest.mark.parametrize("content", ['{"name": "my-extension", "version": "1"}', '{"trunc'])
def test_features_never_take_over_another_programs_manifest(tmp_path, content):
    args = feature_args(tmp_path, 32)
    (tmp_path / "features").mkdir()
    (tmp_path / "features" / "manifest.json").write_text(content)
    result = run(train_cli.main, [*args, "--overwrite"])  # was a KeyError / JSONDecodeError traceback
    assert result.exit_code == 2 and "manifest.json was not written by dovetail-train features" in result.output
    assert (tmp_path / "features" / "manifest.json").read_text() == content


def test_eval_on_a_folder_without_matching_files_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("def add(a, b):\n    return a + b\n" * 50)  # not *.py, eval's pattern
    result = run(train_cli.main, ["eval", "--target", str(DEMO_TARGET), "--draft", str(DEMO_DRAFT), "--input",
                                  str(tmp_path), "--split", "all"])
    assert result.exit_code == 2 and "the inputs name no files (folders are searched for --pattern *.py" in \
        result.output, result.output  # was "no file has more than 256 tokens"
    (tmp_path / "notes.txt").rename(tmp_path / "notes.py")
    result = run(train_cli.main, ["features", "--target", str(DEMO_TARGET), "--input", str(tmp_path), "--out",
                                  str(tmp_path / "features")])  # a folder of .py under the default *.txt
    assert result.exit_code == 2 and "no files (folders are searched for --pattern *.txt" in result.output


def test_a_long_document_raises_no_false_alarm_about_indexing_errors(capfd, caplog):
    ids = train_cli.target_tokenizer(DEMO_TARGET)("x = 1\n" * 3000)["input_ids"]  # past the 2,048-token context
    assert len(ids) > 2048  # cut into windows by features, into prompts by eval: nothing indexes past the context
    captured = capfd.readouterr()
    assert "indexing errors" not in captured.err + captured.out + caplog.text


def test_a_gguf_target_whose_tokenizer_transformers_cannot_build_is_one_line(tmp_path):
    from gguf_support import write_gguf

    folder = save_tiny_model(tmp_path / "hf", "llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                             num_attention_heads=2, num_key_value_heads=1)
    tokens = [f"t{index}" for index in range(97)]  # a byte-level BPE vocabulary without its merges
    target = write_gguf(folder, tmp_path / "model.gguf", extra={"tokenizer.ggml.model": "gpt2",
                                                                "tokenizer.ggml.tokens": tokens})
    with pytest.raises(ModelLoadError, match="its tokenizer.ggml metadata is incomplete"):
        train_cli.target_tokenizer(target)  # was transformers' KeyError traceback


@pytest.mark.parametrize("command", ["features", "train", "eval", "export"])
def test_a_head_given_as_the_target_is_called_one_by_every_train_command(command):
    message = refused(train_cli.main.commands[command], ["--target", str(DEMO_DRAFT)])
    # was "has no tokenizer: copy the model's tokenizer files into it" (features, eval) or a shape error
    assert "is a draft head folder, not a model: pass it as --draft" in message, message


def test_features_into_a_folder_made_with_other_settings_is_refused_in_one_line(tmp_path):
    first = run(train_cli.main, feature_args(tmp_path, 32))
    assert first.exit_code == 0 and "tokenize" not in first.output  # no progress bar into a log or pipe
    result = run(train_cli.main, feature_args(tmp_path, 16))
    assert result.exit_code == 2 and "was written with different settings" in result.output
    half_written = tmp_path / "features" / "shard-00007.tmp"  # a run stopped while saving a shard
    half_written.write_bytes(b"x" * 1000)
    assert run(train_cli.main, [*feature_args(tmp_path, 16), "--overwrite"]).exit_code == 0
    assert not half_written.exists()  # starting over removes it with the finished shards (it stayed)


def test_training_over_a_state_with_other_settings_is_refused_in_one_line(tmp_path, monkeypatch):
    from gpu_worker.train import trainer

    def other_settings(*_args, **_kwargs):
        raise ValueError("out/train_state.pt was written with other settings; use another --out or --restart")

    monkeypatch.setattr(trainer, "train", other_settings)
    (tmp_path / "manifest.json").write_text(json.dumps({"complete": True, "shards": []}))
    result = run(train_cli.main, ["train", "--target", str(DEMO_TARGET), "--features", str(tmp_path),
                                  "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "use another --out or --restart" in result.output


def test_chat_with_a_model_without_a_chat_template_is_refused_before_loading(tmp_path, caplog):
    from dovetail_runtime.preflight import check_chat_template

    with pytest.raises(PreflightError, match="--chat: .* has no chat template"):
        check_chat_template(str(DEMO_TARGET))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    check_chat_template(str(tmp_path))
    result = run(cli.run_main, ["--target", str(DEMO_TARGET), "--draft", str(DEMO_DRAFT), "--chat", "--prompt", "hi"])
    assert result.exit_code == 2 and "has no chat template" in caplog.text


def test_a_draft_without_its_target_says_the_demo_target_stood_in(monkeypatch, caplog):
    monkeypatch.setattr(cli, "real_pair_present", lambda: True)
    monkeypatch.setattr(cli, "SMOLLM2_GGUF", DEMO_TARGET)  # the demo target that stands in
    monkeypatch.setattr(cli, "SMOLLM2_DRAFT", DEMO_DRAFT)
    result = run(cli.run_main, ["--draft", str(EAGLE3_HEAD), "--prompt", "x"])
    assert result.exit_code == 2 and "was trained for a different target" in caplog.text
    assert f"no --target was given, so the demo target {DEMO_TARGET} stood in" in caplog.text


# ------------------------------------------------------------------ values no check caught (an audit, 2026-12-06)

@pytest.mark.parametrize("args", [["--temperature", "nan"], ["--top-p", "nan"], ["--startup-timeout", "nan"],
                                  ["--worker-timeout", "nan"], ["--request-timeout", "inf"], ["--kv-memory", "nan"],
                                  ["--kv-memory", "inf"], ["--kv-memory", "1e300"]])
def test_nan_and_infinite_numbers_are_refused_before_anything_loads(args):
    message = refused(cli.run_main, args)
    assert "is not a finite number" in message or "not in the range" in message, message


@pytest.mark.parametrize("args", [["--clip", "nan"], ["--epochs", "0"], ["--epochs", "-1"], ["--clip", "-3"],
                                  ["--noise", "-1"], ["--min-lr-ratio", "5"], ["--lr", "inf"],
                                  ["--seed", "20261206123456"],  # was "Overflow when unpacking long long"
                                  ["--layers", "100000"]])  # filled memory once the features had loaded
def test_training_settings_that_cannot_train_are_refused(args, tmp_path):
    command = train_cli.main.commands["train"]  # click checks options in the order given: this one first
    message = refused(command, [*args, "--target", str(DEMO_TARGET), "--features", str(tmp_path), "--out",
                                str(tmp_path / "out")])
    assert args[0] in message and ("not in the range" in message or "not a finite number" in message), message


def one_window_features(folder, hidden: int, tokens: int = 32):
    """A finished feature folder of one window of ``tokens`` tokens (zero features and three-layer rows)."""
    import numpy as np
    import torch

    from gpu_worker.train.shards import write_shard

    folder.mkdir()
    write_shard(folder / "shard-00000.safetensors", np.arange(tokens), torch.zeros(tokens, hidden, dtype=torch.float16),
                np.ones(tokens, dtype=bool), np.array([0, tokens]), aux=torch.zeros(tokens, 3 * hidden))
    (folder / "manifest.json").write_text(json.dumps({"complete": True, "hidden_size": hidden, "config": {},
                                                      "aux_layers": [1, 3, 5],
                                                      "shards": [{"index": 0, "file": "shard-00000.safetensors"}]}))
    return folder


@pytest.mark.parametrize("recipe", ["eagle1", "eagle3"])
@pytest.mark.parametrize("flag", ["--max-tokens", "--eval-tokens"])
def test_a_token_cap_below_the_first_window_names_its_flag_and_leaves_no_folder(tmp_path, flag, recipe):
    hidden = json.loads((DEMO_TARGET / "config.json").read_text())["hidden_size"]
    features = one_window_features(tmp_path / "features", hidden)
    result = run(train_cli.main, ["train", "--target", str(DEMO_TARGET), "--features", str(features), "--heldout",
                                  str(features), "--out", str(tmp_path / "head"), "--recipe", recipe, flag, "2"])
    # was "no windows (max_tokens 2)" for --eval-tokens too, and an empty --out folder left behind
    assert result.exit_code == 2 and f"{flag} 2 keeps no window (its first has 32 tokens)" in result.output
    assert not (tmp_path / "head").exists()


def test_training_never_overwrites_a_model_it_is_not_resuming(tmp_path):
    import shutil

    target = Path(shutil.copytree(DEMO_TARGET, tmp_path / "target"))  # a copy: the old code overwrote it
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    features = one_window_features(tmp_path / "features", hidden)
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text((DEMO_DRAFT / "config.json").read_text())  # a finished head from elsewhere
    for out, message in ((head, "already holds a model (config.json) and no train_state.pt to resume"),
                         (target, "is the target's folder")):  # each was overwritten at the end of the run
        result = run(train_cli.main, ["train", "--target", str(target), "--features", str(features), "--out",
                                      str(out), "--steps", "1"])
        assert result.exit_code == 2 and message in result.output, result.output
    assert (head / "config.json").read_text() == (DEMO_DRAFT / "config.json").read_text()
    assert (target / "config.json").read_text() == (DEMO_TARGET / "config.json").read_text()


@pytest.mark.parametrize("recipe", ["eagle1", "eagle3"])
def test_a_diverging_run_stops_without_writing_a_head_of_nans(tmp_path, recipe):
    hidden = json.loads((DEMO_TARGET / "config.json").read_text())["hidden_size"]
    features = one_window_features(tmp_path / "features", hidden)
    result = run(train_cli.main, ["train", "--target", str(DEMO_TARGET), "--features", str(features), "--out",
                                  str(tmp_path / "head"), "--recipe", recipe, "--draft-vocab", "8192", "--ttt-steps",
                                  "1", "--steps", "6", "--warmup", "0", "--lr", "1e30", "--clip", "inf"])
    # was "6 steps ...; head written" with every weight NaN
    assert result.exit_code == 2 and "training diverged at step" in result.output, result.output
    assert not (tmp_path / "head" / "model.safetensors").exists()


def test_an_eagle3_batch_with_no_counted_rows_is_no_update_not_a_crash(tmp_path):
    hidden = json.loads((DEMO_TARGET / "config.json").read_text())["hidden_size"]
    features = one_window_features(tmp_path / "features", hidden)  # zero rows: every argmax is token 0
    result = run(train_cli.main, ["train", "--target", str(DEMO_TARGET), "--features", str(features), "--out",
                                  str(tmp_path / "head"), "--recipe", "eagle3", "--draft-vocab", "4", "--ttt-steps",
                                  "1", "--steps", "2"])  # token 0 is not among the 4 most frequent predicted
    # was a RuntimeError traceback from backward() ("element 0 of tensors does not require grad")
    assert result.exit_code == 0 and "2 steps in" in result.output, result.output
    assert (tmp_path / "head" / "model.safetensors").exists()


@pytest.mark.parametrize("recipe", ["eagle1", "eagle3"])
def test_features_of_a_target_with_another_vocabulary_are_named(tmp_path, recipe):
    hidden = json.loads((DEMO_TARGET / "config.json").read_text())["hidden_size"]
    features = one_window_features(tmp_path / "features", hidden, tokens=64)
    target = save_tiny_model(tmp_path / "target", "llama", hidden_size=hidden, vocab_size=40)  # same hidden size
    result = run(train_cli.main, ["train", "--target", str(target), "--features", str(features), "--out",
                                  str(tmp_path / "head"), "--recipe", recipe, "--draft-vocab", "8", "--steps", "1"])
    # was an IndexError traceback in the first step
    assert result.exit_code == 2 and "holds token ids up to 63, past the target's vocabulary of 40" in result.output
    assert not (tmp_path / "head").exists()


def test_eagle3_held_out_windows_longer_than_the_training_ones_are_evaluated(tmp_path):
    hidden = json.loads((DEMO_TARGET / "config.json").read_text())["hidden_size"]
    features = one_window_features(tmp_path / "features", hidden, tokens=32)
    heldout = one_window_features(tmp_path / "heldout", hidden, tokens=64)  # e.g. another --window
    result = run(train_cli.main, ["train", "--target", str(DEMO_TARGET), "--features", str(features), "--heldout",
                                  str(heldout), "--out", str(tmp_path / "head"), "--recipe", "eagle3",
                                  "--draft-vocab", "8192", "--ttt-steps", "2", "--steps", "1"])
    # was a RuntimeError (tensor sizes 63 and 34) at the first held-out evaluation, the last step here
    assert result.exit_code == 0 and "1 steps in" in result.output, result.output


def test_a_core_range_past_any_machine_is_refused_without_expanding_it():
    message = refused(cli.run_main, ["--cpu-cores", "0-70000"])  # 0-4294967295, expanded, filled memory
    assert "no machine has that many cores" in message


def test_a_prompt_file_is_utf8_its_byte_order_mark_skipped_and_other_bytes_refused(tmp_path):
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "def f("}).encode() + b"\n")
    assert cli.read_prompt_file(marked) == ["def f("]
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"caf\xe9\n")
    with pytest.raises(click.BadParameter, match=r"latin1.txt: not UTF-8 text \(byte 0xe9 at offset 3\)"):
        cli.read_prompt_file(latin1)
    with pytest.raises(click.BadParameter, match="prompt 2 is not valid text"):
        cli.check_prompts_text(["fine", "abc\udcff"])  # a non-UTF-8 argument, as Python hands it over


def test_a_one_shot_run_cut_short_by_a_signal_is_not_a_success(monkeypatch, capsys):
    class Interrupted:
        def __init__(self, _settings):
            pass

        def start(self):
            raise KeyboardInterrupt  # Ctrl-C while the workers load

        def close(self):
            pass

    monkeypatch.setattr("dovetail_runtime.coordinator.Coordinator", Interrupted)
    options = cli.OneShotOptions(prompts=("x",), prompt_file=None, max_new_tokens=4, stops=(), as_json=False,
                                 compare_ar=False, chat=False)
    assert cli.run_one_shot(None, ["x"], options, m.Sampling()) == 130
    assert capsys.readouterr().out == ""  # nothing was printed, so no newline ends it either


@pytest.mark.parametrize("flag", ["--cpu-threads", "--draft-threads"])
def test_a_thread_count_past_the_protocols_bound_names_its_flag(flag):
    message = refused(cli.run_main, [flag, "70000"])  # was "TargetSettings would be refused ... $.threads"
    assert flag in message and "70000 is not in the range" in message


def test_a_bad_corpus_for_features_is_one_line(tmp_path):
    result = run(train_cli.main, ["features", "--target", str(DEMO_TARGET), "--out", str(tmp_path / "features"),
                                  "--input", str(tmp_path / "missing.txt")])
    assert result.exit_code == 1 and "is neither a file, a folder nor a glob" in result.output, result.output


def test_no_clipping_is_still_inf():
    (clip,) = [param for param in train_cli.main.commands["train"].params if param.name == "clip"]
    assert clip.type.convert("inf", clip, None) == float("inf")
    with pytest.raises(click.BadParameter, match="not a finite number"):
        clip.type.convert("nan", clip, None)


def test_features_of_another_target_are_named_before_training(tmp_path):
    hidden = json.loads((DEMO_TARGET / "config.json").read_text())["hidden_size"]
    (tmp_path / "manifest.json").write_text(json.dumps({"complete": True, "shards": [], "hidden_size": hidden + 320,
                                                        "config": {}}))
    result = run(train_cli.main, ["train", "--target", str(DEMO_TARGET), "--features", str(tmp_path),
                                  "--out", str(tmp_path / "out"), "--steps", "1"])
    assert result.exit_code == 2 and f"hidden size {hidden + 320}, but --target" in result.output, result.output


def test_a_prompt_file_splits_lines_at_newlines_only(tmp_path):
    """A JSONL line whose prompt holds U+2028 or U+0085 raw (json.dumps(..., ensure_ascii=False) writes
    them so) was cut in two by str.splitlines: the file then read as plain lines, and the JSON text
    itself went out as prompts, without a word; a form feed in a line of code cut it too."""
    prompts = ["def f():\u2028    return 1", "next\u0085line", "import os"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("\r\n".join(json.dumps({"prompt": p}, ensure_ascii=False) for p in prompts) + "\r\n",
                     encoding="utf-8")
    assert cli.read_prompt_file(jsonl) == prompts
    code = tmp_path / "code.txt"
    code.write_text("x = 1\x0c y = 2\r\n\nz = 3\n", encoding="utf-8")
    assert cli.read_prompt_file(code) == ["x = 1\x0c y = 2", "z = 3"]


def test_a_prompt_file_is_jsonl_only_when_every_line_is_an_object(tmp_path):
    code = tmp_path / "code.txt"  # one prompt per line, one of them C: once refused as invalid JSON
    code.write_text('int main(void)\n{ return 0; }\n{"prompt": "read as an object"}\n')
    assert cli.read_prompt_file(code) == ["int main(void)", "{ return 0; }", "read as an object"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    with pytest.raises(click.BadParameter, match="prompts.jsonl:3: invalid JSON"):
        cli.read_prompt_file(jsonl)
    jsonl.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(click.BadParameter, match='prompts.jsonl:2: a JSON line needs a string "prompt" field'):
        cli.read_prompt_file(jsonl)


def test_lookup_mode_needs_a_branch_and_no_draft(caplog):
    result = run(cli.run_main, ["--target", str(DEMO_TARGET), "--mode", "lookup", "--lookup-tokens", "0",
                                "--prompt", "x"])
    assert result.exit_code == 2 and "--mode lookup copies up to --lookup-tokens tokens a step" in result.output
    result = run(cli.run_main, ["--target", str(DEMO_TARGET), "--prompt", "x"])
    assert result.exit_code == 2 and "or use --mode lookup, which needs no draft head" in result.output
