"""logprobs over HTTP in OpenAI's shapes: the legacy completions API's ``logprobs: N`` and the chat
API's ``logprobs: true`` with ``top_logprobs: N``, whole and streamed, read by the real openai client
from the app in-process; the numbers are the coordinator's TokenLogprobs, the token texts the
tokenizer's pieces."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from starlette.testclient import TestClient
from test_http_routes import StandIn, model, openai_client  # noqa: F401  (model: a fixture)

from dovetail_runtime import openai_api as api
from dovetail_runtime.http_server import build_app
from ipc import messages as m
from ipc.codec import decode, encode

TOKENS = [29, 1000, 2]
ENTRIES = [m.TokenLogprob(logprob=-0.5, top_ids=[29, 7], top_logprobs=[-0.5, -1.25]),
           m.TokenLogprob(logprob=-2.0, top_ids=[3, 1000], top_logprobs=[-0.75, -2.0]),
           m.TokenLogprob(logprob=-0.125, top_ids=[2, 5], top_logprobs=[-0.125, -3.0])]


class WithLogprobs(StandIn):
    """Answers with three tokens and their logprobs (streamed in two chunks when asked)."""

    def _serve(self) -> None:
        while not self.stopped.is_set():
            if not self.socket.poll(50):
                continue
            peer, data = self.socket.recv_multipart()
            request = decode(data)
            assert isinstance(request, m.GenerateRequest)
            self.requests.append(request)
            asked = request.logprobs is not None
            entries = [m.TokenLogprob(logprob=entry.logprob, top_ids=entry.top_ids[: request.logprobs],
                                      top_logprobs=entry.top_logprobs[: request.logprobs])
                       for entry in ENTRIES] if asked else []
            if request.stream:
                for start, end in ((0, 2), (2, 3)):
                    chunk = m.TokenChunk(request_id=request.request_id, token_ids=TOKENS[start:end],
                                         text="ab"[start:end], logprobs=entries[start:end])
                    self.socket.send_multipart([peer, encode(chunk)])
            done = m.GenerateDone(request_id=request.request_id, token_ids=TOKENS, text="ab", finish_reason="stop",
                                  stats=m.RequestStats(prompt_tokens=3, new_tokens=3), logprobs=entries)
            self.socket.send_multipart([peer, encode(done)])


@pytest.fixture
def coordinator() -> Iterator[WithLogprobs]:
    stand_in = WithLogprobs()
    yield stand_in
    stand_in.close()


@pytest.fixture
def http(coordinator, model) -> Iterator[TestClient]:
    with TestClient(build_app(coordinator.endpoint, model)) as client:
        yield client


def piece(model, token: int) -> str:
    return model.tokenizer.decode([token], skip_special_tokens=False)


def test_chat_logprobs_with_alternatives(http, coordinator, model):
    done = openai_client(http).chat.completions.create(model="code-9m", messages=[{"role": "user", "content": "hi"}],
                                                       logprobs=True, top_logprobs=2, max_tokens=3)
    assert coordinator.requests[-1].logprobs == 2
    content = done.choices[0].logprobs.content
    assert [item.token for item in content] == [piece(model, token) for token in TOKENS]
    assert [item.logprob for item in content] == [entry.logprob for entry in ENTRIES]
    assert content[1].bytes == list(piece(model, 1000).encode())
    assert [(top.token, top.logprob) for top in content[1].top_logprobs] == [(piece(model, 3), -0.75),
                                                                             (piece(model, 1000), -2.0)]


def test_completion_logprobs_with_offsets(http, coordinator, model):
    done = openai_client(http).completions.create(model="code-9m", prompt="x", logprobs=1, max_tokens=3)
    assert coordinator.requests[-1].logprobs == 1
    logprobs = done.choices[0].logprobs
    texts = [piece(model, token) for token in TOKENS]
    assert logprobs.tokens == texts and logprobs.token_logprobs == [-0.5, -2.0, -0.125]
    assert logprobs.top_logprobs == [{texts[0]: -0.5}, {piece(model, 3): -0.75}, {texts[2]: -0.125}]
    assert logprobs.text_offset == [0, len(texts[0]), len(texts[0]) + len(texts[1])]


def test_streamed_logprobs_come_once_per_token_in_order(http, coordinator, model):
    client = openai_client(http)
    chunks = list(client.chat.completions.create(model="code-9m", messages=[{"role": "user", "content": "hi"}],
                                                 logprobs=True, max_tokens=3, stream=True))
    streamed = [item for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert [item.logprob for item in streamed] == [-0.5, -2.0, -0.125]
    assert all(item.top_logprobs == [] for item in streamed)  # logprobs alone: no alternatives
    legacy = list(client.completions.create(model="code-9m", prompt="x", logprobs=0, max_tokens=3, stream=True))
    offsets = [offset for chunk in legacy if chunk.choices[0].logprobs
               for offset in chunk.choices[0].logprobs.text_offset]
    texts = [piece(model, token) for token in TOKENS]
    assert offsets == [0, len(texts[0]), len(texts[0]) + len(texts[1])]  # running across chunks


def test_no_logprobs_unless_asked(http, coordinator):
    client = openai_client(http)
    assert client.completions.create(model="code-9m", prompt="x", max_tokens=3).choices[0].logprobs is None
    chat = client.chat.completions.create(model="code-9m", messages=[{"role": "user", "content": "hi"}],
                                          logprobs=False, max_tokens=3)
    assert chat.choices[0].logprobs is None
    assert [request.logprobs for request in coordinator.requests] == [None, None]


@pytest.mark.parametrize("body, says", [
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
])
def test_bad_logprob_requests_are_a_400(body, says):
    kind = api.ChatRequest if "messages" in body else api.CompletionRequest
    with pytest.raises(api.ApiError) as info:
        params = api.parse_request(api.msgspec.json.encode(body), kind)
        (api.plan_chat if kind is api.ChatRequest else api.plan_completion)(params, "r", "dovetail")
    assert info.value.status == 400 and says in info.value.message


def test_the_openai_client_errors_too(http, coordinator):
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        openai_client(http).chat.completions.create(model="code-9m", messages=[{"role": "user", "content": "hi"}],
                                                    top_logprobs=2)
    assert not coordinator.requests
