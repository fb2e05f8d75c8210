"""The OpenAI request rules and response shapes, without a server."""

from __future__ import annotations

import json

import pytest

from dovetail_runtime import openai_api as api
from ipc import messages as m


def completion(body: dict, mode: str = "dovetail") -> api.Plan:
    return api.plan_completion(api.parse_request(json.dumps(body).encode(), api.CompletionRequest), "cmpl-1", mode)


def chat(body: dict, mode: str = "dovetail") -> api.Plan:
    return api.plan_chat(api.parse_request(json.dumps(body).encode(), api.ChatRequest), "chatcmpl-1", mode)


def test_openai_defaults():
    plan = completion({"prompt": "hi"})
    request = plan.request
    assert request.prompt == "hi" and request.messages is None
    assert request.max_new_tokens == 16  # OpenAI's default for completions
    assert request.sampling == m.Sampling(temperature=1.0)  # OpenAI's default temperature
    assert request.mode == "dovetail" and request.stop == [] and not request.stream
    assert (plan.stream, plan.include_usage) == (False, False)
    assert completion({"prompt": "hi"}, mode="ar").request.mode == "ar"  # the server's mode
    assert chat({"messages": [{"role": "user", "content": "hi"}]}).request.max_new_tokens == api.MAX_NEW_TOKENS


def test_fields_map_onto_the_generate_request():
    plan = completion({"prompt": ["hi"], "max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 7, "seed": 3,
                       "stop": "\n", "stream": True, "stream_options": {"include_usage": True}, "mode": "ar",
                       "user": "me", "presence_penalty": 0.0, "logprobs": None, "echo": False, "n": 1})
    assert plan.request.sampling == m.Sampling(temperature=0.0, top_k=7, top_p=0.5, seed=3)
    assert (plan.request.max_new_tokens, plan.request.stop, plan.request.mode) == (5, ["\n"], "ar")
    assert plan.stream and plan.request.stream and plan.include_usage
    assert completion({"prompt": "x", "top_k": -1, "stop": ["", "a"]}).request.sampling.top_k == 0
    assert completion({"prompt": "x", "stop": ["", "a"]}).request.stop == ["a"]


def test_chat_messages_and_their_text_parts():
    plan = chat({"messages": [{"role": "system", "content": "s"}, {"role": "user", "name": "bob", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "assistant", "content": None}],
        "max_tokens": 9, "max_completion_tokens": 4})
    assert plan.request.messages == [m.ChatMessage(role="system", content="s"),
                                     m.ChatMessage(role="user", content="a\nb"),
                                     m.ChatMessage(role="assistant", content="")]
    assert plan.request.prompt is None and plan.request.max_new_tokens == 4  # the newer name wins


@pytest.mark.parametrize("body,status,words", [
    ({"prompt": "x", "n": 3}, 400, "n=3 is not supported"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of=2 is not supported"),
    ({"prompt": "x", "logprobs": True}, 400, "logprobs=True is not supported"),  # true is not 0
    ({"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty=0.5"),
    ({"prompt": "x", "top_p": 0}, 400, "$.top_p"),
    ({"prompt": "x", "seed": -1}, 400, "$.seed"),
    ({"prompt": "x", "stream": "yes"}, 400, "$.stream"),
    ({"prompt": "x", "stop": ["s"] * 65}, 400, "at most 64 strings"),
    ({"prompt": "x", "max_tokens": 10**30}, 400, "$.max_tokens"),
    ({"prompt": []}, 400, "a list of 0 prompts"),
    ({"prompt": [1, 2]}, 400, "$.prompt"),
])
def test_refusals_name_the_field(body, status, words):
    with pytest.raises(api.ApiError) as info:
        completion(body)
    assert info.value.status == status and words in info.value.message
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000,
                                  b'{"prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                  b'{"prompt": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001])
def test_json_nested_too_deeply_is_a_400(body):
    # Found by fuzzing: the decoder's RecursionError escaped as a 500 (and closed the connection).
    with pytest.raises(api.ApiError) as info:
        api.parse_request(body, api.CompletionRequest)
    assert (info.value.status, info.value.code) == (400, "invalid_json") and "nested too deeply" in info.value.message


def test_coordinator_errors_map_to_statuses():
    for code, status in (("prompt_too_long", 400), ("no_chat_template", 400), ("busy", 429),
                         ("worker_failed", 503), ("shutting_down", 503), ("internal", 500), ("new_code", 500)):
        error = api.error_from_reply(m.ErrorReply(request_id="r", code=code, message="why"))
        assert (error.status, error.body()["error"]["code"], error.message) == (status, code, "why")
    assert api.error_from_reply(m.ErrorReply(request_id="r", code="busy", message="")).kind == "rate_limit_error"


def test_event_stream_shapes():
    ids = api.ResponseIds("chatcmpl-1", "model", 123)
    done = m.GenerateDone(request_id="chatcmpl-1", token_ids=[5, 6], text="ab", finish_reason="stop",
                          stats=m.RequestStats(prompt_tokens=3, new_tokens=2))
    stream = api.EventStream(ids, chat=True, include_usage=True)
    events = [*stream.start(), *stream.text(m.TokenChunk(request_id="chatcmpl-1", token_ids=[5], text="ab")),
              *stream.text(m.TokenChunk(request_id="chatcmpl-1", token_ids=[6], text="")), *stream.done(done)]
    assert events[-1] == b"data: [DONE]\n\n"
    bodies = [json.loads(event.removeprefix(b"data: ")) for event in events[:-1]]
    assert [body["choices"][0]["delta"] for body in bodies[:3]] == [{"role": "assistant", "content": ""},
                                                                    {"content": "ab"}, {}]
    assert bodies[2]["choices"][0]["finish_reason"] == "stop" and bodies[2]["dovetail"]["token_ids"] == [5, 6]
    assert bodies[3]["choices"] == [] and bodies[3]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                                                 "total_tokens": 5}
    assert all(body["usage"] is None for body in bodies[:3])
    assert len(bodies) == 4  # the empty-text chunk sent nothing
