"""dovetail-run --http: the OpenAI-compatible API against real processes, with the real openai client and curl.

The demo target is not a chat model, so the chat server runs on a copy of it whose
tokenizer_config.json gets a small chat template, and whose generation_config.json names a
second end-of-sequence id (one the greedy output of EOS_PROMPT reaches early), so that every
eos id is seen to stop generation.
"""

from __future__ import annotations

import io
import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dovetail_runtime.client import DovetailClient
from dovetail_runtime.conversation import converse

from conftest import DEMO_DRAFT, DEMO_TARGET
from runtime_harness import BIN, FIXED_TREE, Server, dovetail_run

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os"]
EOS_PROMPT = "for i in range(10):"
NEW_TOKENS = 24
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}# {{ message['role'] }}: {{ message['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}def {% endif %}")
CHAT = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "Add two numbers."}]


def one_shot_ar(target: Path, prompts: list[str]) -> dict[str, dict]:
    """``dovetail-run --mode ar`` greedy, one JSON line per prompt."""
    args = ["--target", str(target), "--mode", "ar", "--max-new-tokens", str(NEW_TOKENS), "--json",
            "--log-level", "warning"]
    for prompt in prompts:
        args += ["--prompt", prompt]
    done = dovetail_run(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    return {line["prompt"]: line for line in map(json.loads, done.stdout.splitlines())}


@pytest.fixture(scope="module")
def demo_ar() -> dict[str, dict]:
    return one_shot_ar(DEMO_TARGET, [*PROMPTS, EOS_PROMPT])


@pytest.fixture(scope="module")
def extra_eos(demo_ar) -> tuple[int, int]:
    """(a token the demo's greedy EOS_PROMPT output first reaches at index k >= 3, k), one that
    the other prompts' outputs never reach (they are to run to max_tokens)."""
    ids = demo_ar[EOS_PROMPT]["token_ids"]
    elsewhere = {token for prompt in PROMPTS for token in demo_ar[prompt]["token_ids"]}
    index = next(k for k in range(3, len(ids)) if ids[k] not in {*ids[:k], *elsewhere, 2})
    return ids[index], index


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory, extra_eos) -> Path:
    folder = tmp_path_factory.mktemp("chat") / "code-chat-9m"
    folder.mkdir()
    for path in DEMO_TARGET.iterdir():
        if path.suffix == ".safetensors":
            (folder / path.name).symlink_to(path)
        else:
            shutil.copy(path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [2, extra_eos[0]]}))
    return folder


@pytest.fixture(scope="module")
def ar(chat_target) -> dict[str, dict]:
    return one_shot_ar(chat_target, [*PROMPTS, EOS_PROMPT])


@pytest.fixture(scope="module")
def chat_reference(chat_target) -> dict:
    """transformers' greedy answer to CHAT: apply_chat_template, then generate (its eos ids included)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_target))
    model = AutoModelForCausalLM.from_pretrained(str(chat_target), dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    return {"prompt_ids": ids, "token_ids": new, "text": tokenizer.decode(new, skip_special_tokens=True)}


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory, chat_target):
    socket_dir = tmp_path_factory.mktemp("sock")
    running = Server("--target", str(chat_target), "--draft", str(DEMO_DRAFT), "--cpu-cores", "0",
                     "--bind", f"ipc://{socket_dir}/dovetail.sock", "--http", "127.0.0.1:0", *FIXED_TREE)
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def plain_server():
    """The demo target as it is (no chat template), --mode ar, HTTP only."""
    running = Server("--target", str(DEMO_TARGET), "--mode", "ar", "--http", "127.0.0.1:0")
    yield running
    assert running.stop() == 0


def http_url(server: Server) -> str:
    return next(endpoint for endpoint in server.endpoints if endpoint.startswith("http://"))


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_url(server) + "/v1", api_key="unused", max_retries=0, timeout=300)


def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "--max-time", "300", *args], capture_output=True, text=True, timeout=320)


def sse_events(body: str) -> list[str]:
    """The data of each server-sent event; every event is one ``data:`` line and a blank line."""
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(event.startswith("data: ") and "\n" not in event for event in events), body
    return [event.removeprefix("data: ") for event in events]


# --- completions -------------------------------------------------------------------------


def test_openai_completion_equals_ar(chat_server, ar):
    api = client(chat_server)
    for prompt in PROMPTS:
        done = api.completions.create(model="code-chat-9m", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        assert done.choices[0].text == ar[prompt]["text"]
        assert done.choices[0].finish_reason == ar[prompt]["finish_reason"] == "length"
        extension = done.model_extra["dovetail"]
        assert extension["token_ids"] == ar[prompt]["token_ids"]
        assert extension["stats"]["tau"] >= 1.0 and extension["stats"]["cycles"] >= 1
        assert done.usage.completion_tokens == NEW_TOKENS
        assert done.usage.prompt_tokens == ar[prompt]["stats"]["prompt_tokens"]
        assert done.usage.total_tokens == done.usage.prompt_tokens + NEW_TOKENS
        assert done.object == "text_completion" and done.model == "code-chat-9m" and done.id.startswith("cmpl-")


def test_logprobs_are_the_targets_and_the_same_in_both_modes(chat_server, ar):
    """Each token's logprob and alternatives, whole and streamed, dovetail and ar: the same numbers
    (a verified tree row has a decode step's bits), the greedy token the likeliest each time."""
    api, prompt = client(chat_server), PROMPTS[0]
    answers = [api.completions.create(model="code-chat-9m", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                      logprobs=3, extra_body={"mode": mode}) for mode in ("dovetail", "ar")]
    logprobs = [answer.choices[0].logprobs for answer in answers]
    assert answers[0].choices[0].text == answers[1].choices[0].text == ar[prompt]["text"]
    assert logprobs[0].token_logprobs == logprobs[1].token_logprobs and len(logprobs[0].tokens) == NEW_TOKENS
    assert logprobs[0].top_logprobs == logprobs[1].top_logprobs
    assert all(max(top.values()) == chosen for top, chosen in zip(logprobs[0].top_logprobs, logprobs[0].token_logprobs))
    chunks = api.chat.completions.create(model="code-chat-9m", messages=[{"role": "user", "content": prompt}],
                                         max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stream=True)
    streamed = [item for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    whole = api.chat.completions.create(model="code-chat-9m", messages=[{"role": "user", "content": prompt}],
                                        max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
                                        extra_body={"mode": "ar"}).choices[0].logprobs.content
    assert [(item.token, item.logprob) for item in streamed] == [(item.token, item.logprob) for item in whole]
    assert len(whole) == 8 and all(len(item.top_logprobs) == 2 for item in whole)


def test_openai_completion_stream_equals_ar(chat_server, ar):
    prompt = PROMPTS[1]
    chunks = list(client(chat_server).completions.create(
        model="code-chat-9m", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert len(chunks) >= 4  # some text, the finish, the usage
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == ar[prompt]["text"]
    *texts, finish, last = chunks
    assert all(chunk.usage is None and chunk.choices[0].finish_reason is None for chunk in texts)
    assert finish.choices[0].finish_reason == "length"
    assert finish.model_extra["dovetail"]["token_ids"] == ar[prompt]["token_ids"]
    assert last.choices == [] and last.usage.completion_tokens == NEW_TOKENS
    assert len({chunk.id for chunk in chunks}) == 1


def test_every_eos_id_stops(chat_server, ar, demo_ar, extra_eos):
    token, index = extra_eos
    # The demo's own config knows only </s>: its greedy output goes on past the token.
    assert len(demo_ar[EOS_PROMPT]["token_ids"]) > index + 1
    # With the token listed in generation_config.json's eos_token_id, --mode ar stops on it ...
    assert ar[EOS_PROMPT]["token_ids"] == demo_ar[EOS_PROMPT]["token_ids"][:index + 1]
    assert ar[EOS_PROMPT]["finish_reason"] == "stop"
    # ... and so does dovetail over HTTP, though the draft proposed tokens beyond it.
    done = client(chat_server).completions.create(model="code-chat-9m", prompt=EOS_PROMPT,
                                                  max_tokens=NEW_TOKENS, temperature=0)
    assert done.choices[0].finish_reason == "stop"
    assert done.model_extra["dovetail"]["token_ids"] == ar[EOS_PROMPT]["token_ids"]
    assert done.model_extra["dovetail"]["token_ids"][-1] == token


def test_curl_completion_plain_and_streamed(chat_server, ar):
    url = http_url(chat_server) + "/v1/completions"
    prompt = PROMPTS[2]
    body = json.dumps({"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0})
    done = curl(url, "-H", "Content-Type: application/json", "-d", body)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["choices"][0]["text"] == ar[prompt]["text"]
    assert answer["dovetail"]["token_ids"] == ar[prompt]["token_ids"]

    streamed = curl("-N", url, "-d", json.dumps({"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                                                 "stream": True}))
    assert streamed.returncode == 0, streamed.stderr
    events = sse_events(streamed.stdout)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == ar[prompt]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in chunk for chunk in chunks)  # only with stream_options.include_usage


# --- chat --------------------------------------------------------------------------------


def test_openai_chat_equals_transformers(chat_server, chat_reference):
    api = client(chat_server)
    done = api.chat.completions.create(model="code-chat-9m", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0)
    message = done.choices[0].message
    assert message.role == "assistant" and message.content == chat_reference["text"]
    assert done.model_extra["dovetail"]["token_ids"] == chat_reference["token_ids"]
    assert done.usage.prompt_tokens == len(chat_reference["prompt_ids"])
    assert done.object == "chat.completion" and done.id.startswith("chatcmpl-")

    chunks = list(api.chat.completions.create(model="code-chat-9m", messages=CHAT, max_tokens=NEW_TOKENS,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == chat_reference["text"]
    assert chunks[-2].choices[0].finish_reason == done.choices[0].finish_reason
    assert chunks[-1].usage.prompt_tokens == len(chat_reference["prompt_ids"])
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)


def test_curl_chat_plain_and_streamed(chat_server, chat_reference):
    url = http_url(chat_server) + "/v1/chat/completions"
    body = {"model": "code-chat-9m", "messages": CHAT, "max_completion_tokens": NEW_TOKENS, "temperature": 0}
    done = curl(url, "-H", "Content-Type: application/json", "-d", json.dumps(body))
    assert json.loads(done.stdout)["choices"][0]["message"]["content"] == chat_reference["text"]
    # Content given as text parts is the same message.
    parts = [{**turn, "content": [{"type": "text", "text": turn["content"]}]} for turn in CHAT]
    streamed = curl("-N", url, "-d", json.dumps({**body, "messages": parts, "stream": True}))
    events = sse_events(streamed.stdout)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks) == chat_reference["text"]


def test_zmq_chat_messages_share_the_queue(chat_server, chat_reference):
    endpoint = chat_server.endpoints[0]
    assert endpoint.startswith("ipc://")
    with DovetailClient(endpoint, timeout_s=300) as zmq_client:
        done = zmq_client.chat(CHAT, max_new_tokens=NEW_TOKENS)
        assert done.token_ids == chat_reference["token_ids"] and done.text == chat_reference["text"]
        assert done.stats.prompt_tokens == len(chat_reference["prompt_ids"])
        streamed = "".join(chunk.text for chunk in zmq_client.stream(messages=CHAT, max_new_tokens=NEW_TOKENS))
        assert streamed == chat_reference["text"]
    messages_file = Path(chat_server.endpoints[0].removeprefix("ipc://")).with_name("chat.json")
    messages_file.write_text(json.dumps(CHAT))
    cli = subprocess.run([str(BIN / "dovetail-client"), "--connect", endpoint, "--messages", str(messages_file),
                          "--max-new-tokens", str(NEW_TOKENS), "--json"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["token_ids"] == chat_reference["token_ids"]
    cli = subprocess.run([str(BIN / "dovetail-client"), "--connect", endpoint, "--messages", "-",
                          "--max-new-tokens", str(NEW_TOKENS), "--json"], input=json.dumps(CHAT), capture_output=True,
                         text=True, timeout=300)
    assert cli.returncode == 0 and json.loads(cli.stdout)["token_ids"] == chat_reference["token_ids"], cli.stderr
    cli = subprocess.run([str(BIN / "dovetail-client"), "--connect", endpoint, "--chat", "--system", "Write Python.",
                          "--prompt", "Add two numbers.", "--max-new-tokens", str(NEW_TOKENS)],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and cli.stdout == chat_reference["text"] + "\n"
    piped = subprocess.run([str(BIN / "dovetail-client"), "--connect", endpoint, "--chat", "--system", "Write Python.",
                            "--max-new-tokens", str(NEW_TOKENS)], input="Add two numbers.\n", capture_output=True,
                           text=True, timeout=300)
    assert piped.returncode == 0 and piped.stdout == chat_reference["text"] + "\n", piped.stderr


def test_a_client_whose_reader_leaves_exits_as_sigpipe_would(chat_server):
    """`dovetail-client ... | head -c 1`: the next write found the pipe closed; a traceback and exit 1,
    where dovetail-run (and any tool SIGPIPE ends) gives 141 and says nothing."""
    client = subprocess.Popen([str(BIN / "dovetail-client"), "--connect", chat_server.endpoints[0], "--prompt",
                               "def main():", "--max-new-tokens", "256", "--mode", "ar"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert client.stdout is not None and client.stderr is not None
    assert client.stdout.read(1)  # the first text came; the reader leaves
    client.stdout.close()
    assert client.wait(timeout=120) == 141
    assert client.stderr.read() == b""


def test_a_conversation_sends_each_turn_with_the_chat_so_far(chat_server, chat_reference):
    """dovetail-client's conversation (--chat without --prompt in a terminal; here its loop in this
    process, lines scripted) against the server: each reply what the whole chat gives one-shot."""
    endpoint = chat_server.endpoints[0]
    second = [*CHAT, {"role": "assistant", "content": chat_reference["text"]},
              {"role": "user", "content": "Now three."}]
    lines = ["Add two numbers.", "/reset", "Add two numbers.", "Now three."]
    out, err = io.StringIO(), io.StringIO()

    def typed(prompt: str) -> str:
        out.write(prompt)
        if not lines:
            raise EOFError
        return lines.pop(0)

    with DovetailClient(endpoint, timeout_s=300) as zmq_client:
        expected = zmq_client.chat(second, max_new_tokens=NEW_TOKENS).text
        status = converse(zmq_client, {"max_new_tokens": NEW_TOKENS}, "Write Python.", out, err, typed)
    assert status == 0, err.getvalue()
    assert out.getvalue() == f"> {chat_reference['text']}\n> > {chat_reference['text']}\n> {expected}\n> \n"
    assert err.getvalue().count("tokens/s, tau") == 3 and "[a new conversation]" in err.getvalue()


# --- the rest of the API -----------------------------------------------------------------


def test_models_health_and_metrics(chat_server):
    url = http_url(chat_server)
    models = json.loads(curl(url + "/v1/models").stdout)
    assert [model["id"] for model in models["data"]] == ["code-chat-9m"]
    assert models["data"][0]["max_model_len"] == 2048 and models["object"] == "list"
    assert [model.id for model in client(chat_server).models.list()] == ["code-chat-9m"]
    assert json.loads(curl(url + "/health").stdout) == {"status": "ok"}

    client(chat_server).completions.create(model="code-chat-9m", prompt="x = 1", max_tokens=4, temperature=0)
    metrics = curl("-i", url + "/metrics").stdout
    assert "content-type: text/plain; version=0.0.4" in metrics.lower()
    samples = {}
    for family in text_string_to_metric_families(metrics.split("\n\n", 1)[1]):  # (text mode: \r\n is \n)
        for sample in family.samples:
            labels = {name: value for name, value in sample.labels.items() if name != "model"}
            assert sample.labels["model"] == "code-chat-9m"
            samples[sample.name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"] = sample.value
    for name in ("dovetail_generation_tokens_total{}", "dovetail_prompt_tokens_total{}", "dovetail_cycles_total{}",
                 "dovetail_draft_seconds_total{}", "dovetail_verify_seconds_total{}", "dovetail_ipc_seconds_total{}",
                 "dovetail_target_busy_seconds_total{}", "dovetail_draft_busy_seconds_total{}",
                 'dovetail_requests_total{finish_reason="length"}'):
        assert samples[name] > 0, name
    assert samples["dovetail_tau{}"] > 1.0
    assert samples["dovetail_queue_depth{}"] == 0 and samples["dovetail_worker_restarts_total{}"] == 0
    # Every answered request is timed; the drafted tokens include the accepted ones.
    for name in ("queue_time", "time_to_first_token", "e2e_request_latency"):
        assert samples[f'dovetail_{name}_seconds_count{{}}'] >= 1, name
    assert samples["dovetail_inter_token_latency_seconds_count{}"] >= 3
    assert samples["dovetail_spec_decode_num_draft_tokens_total{}"] >= samples[
        "dovetail_spec_decode_num_accepted_tokens_total{}"] > 0


def api_error(server: Server, path: str, body: str | bytes) -> tuple[int, dict]:
    done = curl("-w", "\n%{http_code}", http_url(server) + path, "-H", "Content-Type: application/json",
                "--data-binary", body if isinstance(body, str) else body.decode())
    text, status = done.stdout.rsplit("\n", 1)
    return int(status), json.loads(text)


@pytest.mark.parametrize("path,body,status,code,words", [
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "invalid_request", "$.n"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "invalid_request", "$.temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e-30}, 400, "invalid_request", "temperature must be 0"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "invalid_request", "$.max_tokens"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "unsupported", "echo=True is not supported"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "invalid_request", "$.logprobs"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1, "max_tokens": "4"}, 400, "invalid_request", "$.max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "context_length_exceeded",
     "This model's maximum context length is 2048 tokens. However, you requested 100002 tokens (2 in the prompt, "
     "100000 in the completion)"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "invalid_request",
     "only allowed with stream=true"),
    ("/v1/completions", {"prompt": ["a"] * 17}, 400, "invalid_request", "at most 16 choices"),
    ("/v1/completions", {"max_tokens": 3}, 400, "invalid_request", "missing required field `prompt`"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model_not_found", "'gpt-4' does not exist"),
    ("/v1/completions", {"prompt": "def " * 3000}, 400, "prompt_too_long", "leaves no room"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "invalid_request", "$.messages[0].content"),
    ("/v1/chat/completions", {"messages": []}, 400, "invalid_request", "length >= 1"),
])
def test_bad_requests_get_openai_errors(chat_server, path, body, status, code, words):
    got_status, error = api_error(chat_server, path, json.dumps(body))
    assert got_status == status, error
    assert error["error"]["code"] == code and words in error["error"]["message"], error
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_malformed_bodies_and_unknown_routes(chat_server):
    status, error = api_error(chat_server, "/v1/completions", "{not json")
    assert status == 400 and error["error"]["code"] == "invalid_json"
    status, error = api_error(chat_server, "/v1/completions", "[1, 2]")
    assert status == 400 and "JSON object" in error["error"]["message"]
    done = curl("-w", "\n%{http_code}", http_url(chat_server) + "/v1/nothing")
    text, status_text = done.stdout.rsplit("\n", 1)
    assert status_text == "404" and json.loads(text)["error"]["type"] == "not_found_error"
    # The server is still there and right.
    assert json.loads(curl(http_url(chat_server) + "/health").stdout) == {"status": "ok"}


def test_openai_client_sees_errors(chat_server):
    with pytest.raises(openai.BadRequestError, match="best_of=2 is not supported"):
        client(chat_server).completions.create(model="code-chat-9m", prompt="x", best_of=2)


def test_n_choices_are_each_what_their_own_request_gives(chat_server, ar):
    """n sampled choices run side by side, choice i as a request seeded seed + i would alone; streamed,
    each choice's text comes under its index; greedy choices are all ar's answer."""
    api, prompt, seed = client(chat_server), PROMPTS[2], 11
    sampled: dict = dict(model="code-chat-9m", prompt=prompt, max_tokens=12, temperature=1.0)
    together = api.completions.create(**sampled, n=3, seed=seed)
    alone = [api.completions.create(**sampled, seed=seed + index).choices[0] for index in range(3)]
    assert [choice.index for choice in together.choices] == [0, 1, 2]
    assert [choice.text for choice in together.choices] == [choice.text for choice in alone]
    assert len({choice.text for choice in alone}) > 1  # the seeds gave different samples
    assert together.usage.completion_tokens == 36
    assert together.usage.prompt_tokens == ar[prompt]["stats"]["prompt_tokens"]
    assert [len(choice["token_ids"]) for choice in together.model_extra["dovetail"]["choices"]] == [12, 12, 12]
    chunks = api.completions.create(**sampled, n=3, seed=seed, stream=True, stream_options={"include_usage": True})
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [choice.text for choice in alone] and chunk.usage.completion_tokens == 36
    greedy = api.completions.create(model="code-chat-9m", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, n=2)
    assert [choice.text for choice in greedy.choices] == [ar[prompt]["text"]] * 2
    assert greedy.usage.completion_tokens == 2 * NEW_TOKENS


def test_a_list_of_prompts_gets_a_choice_each_in_order(chat_server, ar):
    api = client(chat_server)
    whole = api.completions.create(model="code-chat-9m", prompt=PROMPTS, max_tokens=NEW_TOKENS, temperature=0)
    assert [choice.text for choice in whole.choices] == [ar[prompt]["text"] for prompt in PROMPTS]
    assert whole.usage.prompt_tokens == sum(ar[prompt]["stats"]["prompt_tokens"] for prompt in PROMPTS)
    chunks = api.completions.create(model="code-chat-9m", prompt=PROMPTS[:2], max_tokens=NEW_TOKENS, temperature=0,
                                    n=2, stream=True)
    texts = [""] * 4
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [ar[PROMPTS[0]]["text"]] * 2 + [ar[PROMPTS[1]]["text"]] * 2


def test_llama_server_and_vllm_habits(chat_server, ar):
    """Unknown fields ignored, a model by id, /tokenize and /detokenize with the server's own tokenizer."""
    api, url = client(chat_server), http_url(chat_server)
    done = api.completions.create(model="code-chat-9m", prompt=PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0,
                                  extra_body={"some_unknown_field": 1, "repetition_penalty": 1.0})
    assert done.model_extra["dovetail"]["token_ids"] == ar[PROMPTS[0]]["token_ids"]
    assert api.models.retrieve("code-chat-9m").model_extra["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4")
    tokens = json.loads(curl(url + "/tokenize", "-d", json.dumps({"content": PROMPTS[0]})).stdout)["tokens"]
    assert len(tokens) == done.usage.prompt_tokens - 1  # the server's prompt had BOS; add_special is off
    text = json.loads(curl(url + "/detokenize", "-d", json.dumps({"tokens": tokens + done.model_extra["dovetail"][
        "token_ids"]})).stdout)["content"]
    assert text == PROMPTS[0] + done.choices[0].text


def test_chat_without_a_template_is_a_clear_400(plain_server):
    with pytest.raises(openai.BadRequestError, match="has no chat template") as info:
        client(plain_server).chat.completions.create(model="target-code-9m", messages=CHAT)
    assert info.value.status_code == 400 and info.value.code == "no_chat_template"
    # The same server completes prompts (in ar mode: it has no draft head).
    done = client(plain_server).completions.create(model="target-code-9m", prompt="import os", max_tokens=4,
                                                   temperature=0)
    assert done.usage.completion_tokens == 4 and done.model_extra["dovetail"]["stats"]["draft_ms"] == 0
    assert done.model_extra["dovetail"]["stats"]["cycles"] == 3


def test_a_client_that_leaves_is_cancelled(plain_server):
    url = http_url(plain_server)

    def cancelled() -> int:
        for line in curl(url + "/metrics").stdout.splitlines():
            if line.startswith("dovetail_requests_total") and 'finish_reason="cancelled"' in line:
                return int(float(line.rsplit(" ", 1)[1]))
        raise AssertionError("no cancelled count")

    before = cancelled()
    body = {"prompt": "import os", "max_tokens": 1900, "temperature": 0}
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as raw:  # streamed, then gone
        data = json.dumps({**body, "stream": True, "n": 2, "temperature": 1}).encode()  # two requests
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        assert raw.recv(65536).startswith(b"HTTP/1.1 200")
    # Not streamed, then gone: two prompts, two requests.
    curl("--max-time", "1", url + "/v1/completions", "-d", json.dumps({**body, "prompt": ["import os", "import re"]}))
    deadline = time.monotonic() + 120
    while cancelled() < before + 4:  # all four requests end as cancelled, long before 1900 tokens
        assert time.monotonic() < deadline, "the requests of clients that left were not cancelled"
        time.sleep(0.2)
    done = client(plain_server).completions.create(model="target-code-9m", prompt="x", max_tokens=2, temperature=0)
    assert done.usage.completion_tokens == 2


def test_http_flags_fail_fast(tmp_path):
    done = dovetail_run("--target", str(DEMO_TARGET), "--mode", "ar", "--http", "nonsense")
    assert done.returncode == 2 and "expected HOST:PORT" in done.stderr
    done = dovetail_run("--target", str(DEMO_TARGET), "--mode", "ar", "--http", "0.0.0.0:0")
    assert done.returncode == 2 and "without an API key" in done.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = dovetail_run("--target", str(DEMO_TARGET), "--mode", "ar", "--http", f"127.0.0.1:{port}")
        assert done.returncode == 2 and f"cannot serve HTTP on 127.0.0.1:{port}" in done.stderr
        assert "target:" not in done.stderr  # refused before the model loaded (that line reports it)
    done = dovetail_run("--target", str(DEMO_TARGET), "--mode", "ar", "--http", "127.0.0.1:0", "--prompt", "x")
    assert done.returncode == 2 and "cannot be combined" in done.stderr
