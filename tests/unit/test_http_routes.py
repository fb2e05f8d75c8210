"""The HTTP app's routes as OpenAI clients and llama-server users expect them, driven in-process
(starlette's TestClient, the real openai client on top) against a stand-in coordinator: a ROUTER
socket on an inproc endpoint that answers every request at once and remembers what it got.
The tokenizer is the demo target's, as a real server hands it over."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from dataclasses import replace

import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from dovetail_runtime.api_key import ApiKey
from dovetail_runtime.chat_template import ChatTemplate
from dovetail_runtime.http_server import ServedModel, build_app
from dovetail_runtime.tokenizer import Tokenizer
from ipc import messages as m
from ipc.codec import decode, encode

from conftest import DEMO_TARGET

CONTEXT = 64
TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
_endpoints = itertools.count()


class StandIn:
    """A coordinator that answers each GenerateRequest with the text "ok", Pings with Pong and
    MetricsRequests with counters; ``requests`` holds the GenerateRequests it got."""

    def __init__(self) -> None:
        self.endpoint = f"inproc://dovetail-test-routes-{next(_endpoints)}"
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.bind(self.endpoint)
        self.requests: list[m.GenerateRequest] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            if not self.socket.poll(50):
                continue
            peer, data = self.socket.recv_multipart()
            self.socket.send_multipart([peer, encode(self._answer(decode(data)))])

    def _answer(self, message: m.Message) -> m.Message:
        if isinstance(message, m.Ping):
            return m.Pong(nonce=message.nonce)
        if isinstance(message, m.MetricsRequest):
            return m.MetricsReply(finished={"stop": len(self.requests)}, queue_depth=2)
        assert isinstance(message, m.GenerateRequest)
        self.requests.append(message)
        return m.GenerateDone(request_id=message.request_id, token_ids=[5], text="ok", finish_reason="stop",
                              stats=m.RequestStats(prompt_tokens=3, new_tokens=1))

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        self.socket.close(linger=0)


@pytest.fixture(scope="module")
def model() -> ServedModel:
    tokenizer = Tokenizer.from_dir(DEMO_TARGET)
    return ServedModel(name="code-9m", context=CONTEXT, default_mode="ar", created=0, tokenizer=tokenizer,
                       chat_template=ChatTemplate(TEMPLATE, tokenizer.special_tokens))


@pytest.fixture
def coordinator() -> Iterator[StandIn]:
    stand_in = StandIn()
    yield stand_in
    stand_in.close()


@pytest.fixture
def http(coordinator: StandIn, model: ServedModel) -> Iterator[TestClient]:
    with TestClient(build_app(coordinator.endpoint, model)) as client:
        yield client


def openai_client(http: TestClient, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key=key, http_client=http, max_retries=0)


# --- unknown fields ------------------------------------------------------------------------


def test_unknown_fields_from_the_openai_client_are_ignored(http, coordinator):
    client = openai_client(http)
    done = client.completions.create(model="code-9m", prompt="def f(x):", max_tokens=4,
                                     extra_body={"some_unknown_field": 1, "repetition_penalty": 1.1})
    assert done.choices[0].text == "ok"
    chat = client.chat.completions.create(
        model="code-9m", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "stream_options": None})
    assert chat.choices[0].message.content == "ok"
    assert [request.max_new_tokens for request in coordinator.requests] == [4, 4]


def test_known_fields_with_wrong_types_are_still_a_400(http, coordinator):
    with pytest.raises(openai.BadRequestError, match=r"\$\.temperature") as info:
        openai_client(http).completions.create(model="code-9m", prompt="x", extra_body={"temperature": "hot",
                                                                                      "frobnicate": 1})
    assert info.value.code == "invalid_request" and not coordinator.requests


# --- max_tokens against the context --------------------------------------------------------


def test_max_tokens_beyond_the_context_is_a_400_before_the_queue(http, coordinator, model):
    client = openai_client(http)
    prompt_tokens = len(model.tokenizer.encode("def f(x):"))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="code-9m", prompt="def f(x):", max_tokens=100000)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    assert (f"maximum context length is {CONTEXT} tokens. However, you requested {prompt_tokens + 100000} tokens "
            f"({prompt_tokens} in the prompt, 100000 in the completion)") in info.value.message
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="in the messages, 64 in the completion") as info:
        client.chat.completions.create(model="code-9m", messages=messages, max_completion_tokens=64)
    assert info.value.param == "max_completion_tokens"
    assert not coordinator.requests  # refused before the coordinator heard of them
    fits = CONTEXT - prompt_tokens
    client.completions.create(model="code-9m", prompt="def f(x):", max_tokens=fits)
    client.chat.completions.create(model="code-9m", messages=messages)  # no limit asked: up to the context
    assert [request.max_new_tokens for request in coordinator.requests] == [fits, 1 << 20]


# --- /v1/models/{id} -----------------------------------------------------------------------


def test_one_model_by_id_and_a_404_for_others(http):
    client = openai_client(http)
    card = client.models.retrieve("code-9m")
    assert (card.id, card.object, card.owned_by, card.model_extra["max_model_len"]) == ("code-9m", "model",
                                                                                          "dovetail", CONTEXT)
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.code == "model_not_found" and "'gpt-4' does not exist" in info.value.message
    response = http.get("/v1/models/org/other-model")
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}


# --- /tokenize and /detokenize ---------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(http, model):
    text = "def fibonacci(n):\n    return n"
    tokens = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert tokens == model.tokenizer.encode(text, add_special_tokens=False)  # llama-server's default
    assert http.post("/detokenize", json={"tokens": tokens}).json() == {"content": text}
    with_bos = http.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert with_bos == [model.tokenizer.bos_token_id, *tokens]
    assert http.post("/detokenize", json={"tokens": with_bos}).json() == {"content": "<s>" + text}
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True, "parse_special": True}).json()
    assert [piece["id"] for piece in pieces["tokens"]] == tokens
    assert "".join(piece["piece"] for piece in pieces["tokens"]) == text
    assert http.post("/detokenize", json={"tokens": []}).json() == {"content": ""}


@pytest.mark.parametrize("path,body,words", [
    ("/tokenize", {}, "missing required field `content`"),
    ("/tokenize", {"content": 5}, "$.content"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, "$.add_special"),
    ("/detokenize", {"tokens": "1 2 3"}, "$.tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, "$.tokens[1]"),
    ("/detokenize", {"tokens": [1, -1]}, "$.tokens[1]"),
    ("/detokenize", {"tokens": [1, 2.5]}, "$.tokens[1]"),
    ("/detokenize", {"tokens": [1, 8192]}, "tokens[1] = 8192 is not a token id of this model (its ids are 0 to "
                                           "8191)"),
    ("/detokenize", {"tokens": [2**70]}, "tokens[0] = 11805916207174113034..."),
])
def test_bad_token_requests_are_clear_400s(http, path, body, words):
    response = http.post(path, json=body)
    assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
    assert http.post("/detokenize", json={"tokens": [532]}).json() == {"content": "def"}  # still serving
    assert http.post(path, content=b"[1, 2]").status_code == 400


def test_token_routes_need_the_api_key_like_the_others(coordinator, model):
    key = ApiKey("k" * 32)
    with TestClient(build_app(coordinator.endpoint, model, api_key=key)) as http:
        assert http.post("/tokenize", json={"content": "x"}).status_code == 401
        assert http.post("/detokenize", json={"tokens": [1]}).status_code == 401
        headers = {"Authorization": "Bearer " + "k" * 32}
        assert http.post("/tokenize", json={"content": "def"}, headers=headers).json() == {"tokens": [532]}
        assert http.get("/v1/models/code-9m", headers=headers).status_code == 200
        assert http.get("/v1/models/code-9m").status_code == 401


def test_token_routes_without_a_tokenizer_answer_503(coordinator, model):
    with TestClient(build_app(coordinator.endpoint, replace(model, tokenizer=None))) as http:
        response = http.post("/tokenize", json={"content": "x"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "unavailable"


# --- CORS ------------------------------------------------------------------------------------


PREFLIGHT = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


def test_no_cors_headers_by_default(http):
    response = http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in response.headers
    response = http.get("/v1/models", headers={"Origin": "http://localhost:3000"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_cors_origins_when_asked_and_the_key_still_needed(coordinator, model):
    key = ApiKey("k" * 32)
    app = build_app(coordinator.endpoint, model, api_key=key, cors_origins=["http://localhost:3000"])
    with TestClient(app) as http:
        response = http.options("/v1/chat/completions", headers=PREFLIGHT)  # browsers send no key here
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in response.headers["access-control-allow-methods"]
        assert "authorization" in response.headers["access-control-allow-headers"].lower()
        refused = http.get("/v1/models", headers={"Origin": "http://localhost:3000"})
        assert refused.status_code == 401  # the key is still needed; the browser may read why
        assert refused.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = http.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    with TestClient(build_app(coordinator.endpoint, model, cors_origins=["*"])) as http:
        response = http.get("/v1/models", headers={"Origin": "http://anywhere.example"})
        assert response.headers["access-control-allow-origin"] == "*"


# --- /metrics --------------------------------------------------------------------------------


def test_metrics_in_prometheus_text_and_openmetrics(http):
    openai_client(http).completions.create(model="code-9m", prompt="x", max_tokens=1)
    response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {(sample.name, json.dumps(sample.labels, sort_keys=True)): sample.value
               for family in text_string_to_metric_families(response.text) for sample in family.samples}
    assert samples[("dovetail_requests_total", json.dumps({"finish_reason": "stop", "model": "code-9m"},
                                                          sort_keys=True))] == 1
    assert samples[("dovetail_queue_depth", json.dumps({"model": "code-9m"}))] == 2
    response = http.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")


def test_a_prompt_too_long_for_the_context_is_left_to_the_coordinator(http, coordinator):
    # Its answer is prompt_too_long with or without max_tokens; beyond the character bound it is not tokenized.
    client = openai_client(http)
    client.completions.create(model="code-9m", prompt="def f(x): " * 40, max_tokens=1000)
    client.completions.create(model="code-9m", prompt="é" * (CONTEXT * 1000), max_tokens=1000)
    assert len(coordinator.requests) == 2


def test_a_wrong_method_is_a_405_that_says_which_methods_the_path_takes(http):
    response = http.get("/v1/completions")
    assert response.status_code == 405 and response.headers.get("allow") == "POST"  # RFC 9110: a 405 has Allow
    assert response.json()["error"]["message"] == "Method Not Allowed"
    assert http.head("/health").status_code == 200  # load balancers probe with HEAD


def http_responses(http, key: str | None = None) -> dict[tuple[str, str, str], float]:
    """dovetail_http_requests_total's samples from /metrics, by (method, route, status)."""
    text = http.get("/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}).text
    return {(s.labels["method"], s.labels["route"], s.labels["status"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "dovetail_http_requests_total"}


def test_every_http_answer_is_counted_by_route_and_status_refusals_included(http, coordinator):
    openai_client(http).completions.create(model="code-9m", prompt="x", max_tokens=1)
    assert http.post("/v1/completions", content=b"{not json").status_code == 400
    assert http.post("/v1/chat/completions", json={"model": "code-9m", "messages": "nope"}).status_code == 400
    for path in ("/wp-login.php", "/.env", "/v1/nothing"):
        assert http.get(path).status_code == 404
    assert http.get("/v1/models/code-9m").status_code == 200
    assert http.get("/v1/completions").status_code == 405
    counts = http_responses(http)
    assert counts[("POST", "/v1/completions", "200")] == 1
    assert counts[("POST", "/v1/completions", "400")] == 1
    assert counts[("POST", "/v1/chat/completions", "400")] == 1
    assert counts[("GET", "other", "404")] == 3  # a scanner's paths: one series, not one each
    assert counts[("GET", "/v1/models/{model_id}", "200")] == 1
    assert counts[("GET", "/v1/completions", "405")] == 1
    assert len(coordinator.requests) == 1  # the refusals never reached the coordinator's own counters
    assert http_responses(http)[("GET", "/metrics", "200")] == 1  # the scrape before this one


def test_a_missing_api_key_is_counted_as_a_401(model, coordinator):
    key = "k" * 32
    with TestClient(build_app(coordinator.endpoint, model, api_key=ApiKey(key))) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http_responses(client, key)[("GET", "/v1/models", "401")] == 2
