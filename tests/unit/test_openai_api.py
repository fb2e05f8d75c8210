"""The OpenAI request rules and response shapes, without a server."""

from __future__ import annotations

import json
import logging

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
    assert request.mode == "dovetail" and request.stop == [] and not request.stream and plan.choices == 1
    assert (plan.stream, plan.include_usage) == (False, False)
    assert completion({"prompt": "hi"}, mode="ar").request.mode == "ar"  # the server's mode
    assert completion({"prompt": "hi", "mode": "lookup"}).request.mode == "lookup"  # a request's own
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
    assert plan.request.user == "me"  # whose turn in the queue it waits for
    assert completion({"prompt": "x", "user": ""}).request.user is None  # as if not sent


def test_a_requests_choices_wait_for_one_turn_between_them_or_their_users():
    sampled = completion({"prompt": ["a", "b"], "n": 2, "temperature": 1}).decoded()
    assert {d.request.user for d in sampled} == {"choices of cmpl-1"}
    assert {d.request.user for d in completion({"prompt": ["a", "b"], "user": "ann"}).decoded()} == {"ann"}
    assert completion({"prompt": "a"}).decoded()[0].request.user is None  # one request: its connection's turn
    assert completion({"prompt": "a", "user": "u" * 300}).request.user == "u" * 256  # cut, not refused
    with pytest.raises(api.ApiError, match="user") as refused:
        completion({"prompt": "a", "user": 7})
    assert refused.value.param == "user"


def test_chat_messages_and_their_text_parts():
    plan = chat({"messages": [{"role": "system", "content": "s"}, {"role": "user", "name": "bob", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "assistant", "content": None}],
        "max_tokens": 9, "max_completion_tokens": 4})
    assert plan.request.messages == [m.ChatMessage(role="system", content="s"),
                                     m.ChatMessage(role="user", content="a\nb"),
                                     m.ChatMessage(role="assistant", content="")]
    assert plan.request.prompt is None and plan.request.max_new_tokens == 4  # the newer name wins


@pytest.mark.parametrize("body,status,words", [
    ({"prompt": "x", "n": 0}, 400, "$.n"),
    ({"prompt": "x", "n": api.MAX_CHOICES + 1}, 400, "$.n"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of=2 is not supported"),
    ({"prompt": "x", "logprobs": True}, 400, "$.logprobs"),  # the legacy API's logprobs is a count
    ({"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty=0.5"),
    ({"prompt": "x", "top_p": 0}, 400, "$.top_p"),
    ({"prompt": "x", "seed": -1}, 400, "$.seed"),
    ({"prompt": "x", "stream": "yes"}, 400, "$.stream"),
    ({"prompt": "x", "stop": ["s"] * 65}, 400, "at most 64 strings"),
    ({"prompt": "x", "max_tokens": 10**30}, 400, "$.max_tokens"),
    ({"prompt": []}, 400, "an empty list of prompts"),
    ({"prompt": ["a"] * 9, "n": 2}, 400, "9 prompts x n=2 choices: at most 16"),
    ({"prompt": [1, 2]}, 400, "$.prompt"),
])
def test_refusals_name_the_field(body, status, words):
    with pytest.raises(api.ApiError) as info:
        completion(body)
    assert info.value.status == status and words in info.value.message
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": "x"}},
     "stream_options.include_usage"),
])
def test_a_missing_or_wrong_field_is_named_by_its_whole_path(body, param):
    with pytest.raises(api.ApiError) as info:
        chat(body)
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize("body", [b"", b"  \r\n"])
def test_an_empty_body_is_called_empty(body):
    with pytest.raises(api.ApiError) as info:  # not "not valid JSON: Input data was truncated"
        api.parse_request(body, api.CompletionRequest)
    assert (info.value.status, info.value.code) == (400, "invalid_json") and "body is empty" in info.value.message


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


def test_deadline_exceeded_is_a_504_not_a_500():
    # Found checking docs/usage.md's error list against a server with --request-timeout: a request
    # past it got 500 (an internal error) for a limit the operator set.
    error = api.error_from_reply(m.ErrorReply(request_id="r", code="deadline_exceeded", message="too late"))
    assert (error.status, error.body()["error"]["code"]) == (504, "deadline_exceeded")


def test_event_stream_shapes():
    ids = api.ResponseIds("chatcmpl-1", "model", 123)
    done = m.GenerateDone(request_id="chatcmpl-1", token_ids=[5, 6], text="ab", finish_reason="stop",
                          stats=m.RequestStats(prompt_tokens=3, new_tokens=2))
    stream = api.EventStream(ids, chat=True, include_usage=True)
    events = [*stream.start(), *stream.text(m.TokenChunk(request_id="chatcmpl-1", token_ids=[5], text="ab")),
              *stream.text(m.TokenChunk(request_id="chatcmpl-1", token_ids=[6], text="")), *stream.done(done),
              *stream.end([done])]
    assert events[-1] == b"data: [DONE]\n\n"
    bodies = [json.loads(event.removeprefix(b"data: ")) for event in events[:-1]]
    assert [body["choices"][0]["delta"] for body in bodies[:3]] == [{"role": "assistant", "content": ""},
                                                                    {"content": "ab"}, {}]
    assert bodies[2]["choices"][0]["finish_reason"] == "stop" and bodies[2]["dovetail"]["token_ids"] == [5, 6]
    assert bodies[3]["choices"] == [] and bodies[3]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                                                 "total_tokens": 5}
    assert all(body["usage"] is None for body in bodies[:3])
    assert len(bodies) == 4  # the empty-text chunk sent nothing


def test_unknown_fields_are_ignored_at_every_level():
    # vLLM and llama-server ignore them; clients send their own extensions (the openai client's extra_body).
    plan = completion({"prompt": "hi", "max_tokens": 2, "some_unknown_field": {"x": [1]}, "stream": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert plan.request.prompt == "hi" and plan.request.max_new_tokens == 2 and plan.include_usage
    plan = chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}],
                               "tool_calls": None}], "chat_template_kwargs": {}})
    assert plan.request.messages == [m.ChatMessage(role="user", content="a")]
    body = {"messages": [{"role": "user", "x": 1, "content": [{"type": "text", "text": "a", "y": 2}]}],
            "stream_options": {"z": 3}, "w": 4}
    assert api.unknown_fields(body, api.ChatRequest) == ["w", "stream_options.z", "messages[0].x",
                                                         "messages[0].content[0].y"]


@pytest.mark.parametrize("body,words", [
    ({"prompt": "x", "some_unknown_field": 1, "max_tokens": "4"}, "$.max_tokens"),  # known fields still checked
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes", "other": 1}},
     "$.stream_options.include_usage"),
    ({"prompt": "x", "top_k": -2}, "$.top_k"),
])
def test_known_fields_with_wrong_values_are_still_refused(body, words):
    with pytest.raises(api.ApiError) as info:
        completion(body)
    assert info.value.status == 400 and words in info.value.message


def test_chat_content_parts_other_than_text_are_still_refused():
    with pytest.raises(api.ApiError) as info:
        chat({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert info.value.status == 400 and "$.messages[0].content[0].type" in info.value.message


def test_top_k_zero_and_minus_one_mean_off():
    assert completion({"prompt": "x", "top_k": 0}).request.sampling.top_k == 0
    assert completion({"prompt": "x", "top_k": -1}).request.sampling.top_k == 0
    assert completion({"prompt": "x", "top_k": 5}).request.sampling.top_k == 5


def test_max_tokens_beyond_the_context_is_refused_in_vllms_words():
    plan = completion({"prompt": "x", "max_tokens": 100})
    api.check_context(plan, prompt_tokens=28, context=128)  # 128: just fits
    with pytest.raises(api.ApiError) as info:
        api.check_context(plan, prompt_tokens=29, context=128)
    error = info.value
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "max_tokens")
    assert error.message == ("This model's maximum context length is 128 tokens. However, you requested 129 tokens "
                             "(29 in the prompt, 100 in the completion). Please reduce the length of the prompt or "
                             "max_tokens.")
    plan = chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "max_completion_tokens": 200})
    with pytest.raises(api.ApiError, match=r"\(10 in the messages, 200 in the completion\)") as info:
        api.check_context(plan, prompt_tokens=10, context=128)
    assert info.value.param == "max_completion_tokens"
    # Not set by the client: the request runs until the context is full, as before.
    api.check_context(chat({"messages": [{"role": "user", "content": "x"}]}), prompt_tokens=100, context=128)
    api.check_context(completion({"prompt": "x"}), prompt_tokens=120, context=128)


def test_a_prompt_that_leaves_no_room_is_left_to_the_coordinator():
    # Its error is prompt_too_long, with or without max_tokens.
    api.check_context(completion({"prompt": "x", "max_tokens": 5}), prompt_tokens=128, context=128)


def test_ignored_fields_are_logged_at_debug_level(caplog):
    with caplog.at_level(logging.DEBUG, logger="dovetail_runtime.openai_api"):
        completion({"prompt": "x", "some_unknown_field": 1})
    assert [record.getMessage() for record in caplog.records] == ["ignoring unknown request fields: some_unknown_field"]
    assert all(record.levelno == logging.DEBUG for record in caplog.records)


def test_n_choices_are_requests_seeded_apart_and_greedy_ones_are_one_decode():
    plan = completion({"prompt": "x", "n": 3, "temperature": 0.8, "seed": (1 << 63) - 2})
    decodes = plan.decoded()
    assert [decode.choices for decode in decodes] == [(0,), (1,), (2,)]
    asked = [decode.request for decode in decodes]
    assert [one.request_id for one in asked] == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
    assert [one.sampling.seed for one in asked] == [(1 << 63) - 2, (1 << 63) - 1, 0]  # choice 0: n=1's seed
    assert {one.prompt for one in asked} == {"x"} and {one.sampling.temperature for one in asked} == {0.8}
    unseeded = completion({"prompt": "x", "n": 2, "temperature": 0.8}).decoded()
    assert [decode.request.sampling.seed for decode in unseeded] == [None, None]  # each its own randomness
    greedy = completion({"prompt": "x", "n": 4, "temperature": 0})
    assert greedy.decoded() == [api.Decode(greedy.request, (0, 1, 2, 3))]  # four equal choices, one decode


def test_a_list_of_prompts_is_n_choices_each_in_prompt_order():
    greedy = completion({"prompt": ["a", "b", "c"], "n": 2, "temperature": 0}).decoded()
    assert [(d.request.prompt, d.request.request_id, d.choices) for d in greedy] == [
        ("a", "cmpl-1-0", (0, 1)), ("b", "cmpl-1-2", (2, 3)), ("c", "cmpl-1-4", (4, 5))]
    sampled = completion({"prompt": ["a", "b"], "n": 2, "temperature": 1, "seed": 5}).decoded()
    assert [(d.request.prompt, d.request.sampling.seed, d.choices) for d in sampled] == [
        ("a", 5, (0,)), ("a", 6, (1,)), ("b", 5, (2,)), ("b", 6, (3,))]  # each prompt as its n=2 request
    dones = [m.GenerateDone(request_id=d.request.request_id, token_ids=[1] * (k + 1), text=str(k),
                            finish_reason="length", stats=m.RequestStats(prompt_tokens=10 * (k + 1)))
             for k, d in enumerate(greedy)]
    answers = api.per_choice(greedy, dones)
    assert [done.text for done in answers] == ["0", "0", "1", "1", "2", "2"]
    assert api.usage(answers, 2) == {"prompt_tokens": 60, "completion_tokens": 12, "total_tokens": 72}


def test_n_choices_in_a_body_and_in_a_stream():
    ids = api.ResponseIds("cmpl-1", "model", 123)
    one = m.GenerateDone(request_id="cmpl-1-0", token_ids=[5, 6], text="ab", finish_reason="length",
                         stats=m.RequestStats(prompt_tokens=3, new_tokens=2))
    two = m.GenerateDone(request_id="cmpl-1-1", token_ids=[7], text="c", finish_reason="stop",
                         stats=m.RequestStats(prompt_tokens=3, new_tokens=1))
    body = api.completion_body(ids, [one, two], 2)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "ab", "length"),
                                                                                      (1, "c", "stop")]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}  # the prompt once
    assert [c["token_ids"] for c in body["dovetail"]["choices"]] == [[5, 6], [7]]
    assert api.per_choice([api.Decode(m.GenerateRequest(request_id="r", prompt="x"), (0, 1, 2))], [one]) == [one] * 3
    stream = api.EventStream(ids, chat=True, include_usage=True, choices=2, per_prompt=2)
    events = [*stream.start(), *stream.text(m.TokenChunk(request_id="cmpl-1-1", token_ids=[7], text="c"), 1),
              *stream.done(two, 1), *stream.done(one, 0), *stream.end([one, two])]
    bodies = [json.loads(event.removeprefix(b"data: ")) for event in events[:-1]]
    assert [[c["index"] for c in body["choices"]] for body in bodies] == [[0], [1], [1], [1], [0], []]
    assert bodies[2]["choices"][0]["delta"] == {"content": "c"} and bodies[-1]["usage"]["completion_tokens"] == 3
