"""A stop string that ends inside a cycle's tokens: the request ends where ar's would, with ar's tokens,
log-probabilities and finish reason (a cycle hands over several tokens at once; ar one at a time)."""

from __future__ import annotations

import pytest

from dovetail_runtime.coordinator import Started
from dovetail_runtime.generation import Budget, Stats, Stop
from dovetail_runtime.text import TextStream
from dovetail_runtime.tokenizer import Tokenizer
from ipc import messages as m

from conftest import DEMO_TARGET


@pytest.fixture(scope="module")
def demo() -> Tokenizer:
    return Tokenizer.from_dir(DEMO_TARGET)


def logprob(token: int) -> m.TokenLogprob:
    return m.TokenLogprob(logprob=-float(token % 7), top_ids=[token], top_logprobs=[-0.5])


def started(tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str], seen: list) -> Started:
    request = m.GenerateRequest(request_id="r", prompt="x", max_new_tokens=64, stop=stop)
    return Started(request, prompt_ids, TextStream(tokenizer, stop, prompt_ids=prompt_ids), 1, True,
                   lambda ids, text, logprobs: seen.append((list(ids), text, list(logprobs))) and False)


def run(tokenizer: Tokenizer, prompt_ids: list[int], answer: list[int], stop: list[str], cycle: int,
        max_new_tokens: int = 64):
    """The answer pushed ``cycle`` tokens at a time (1: as ar does) through a request's emit and budget."""
    seen: list = []
    request = started(tokenizer, prompt_ids, stop, seen)
    stats = Stats()
    budget = Budget(max_new_tokens, frozenset(), request.emit, stats)
    for start in range(0, len(answer), cycle):
        chunk = answer[start:start + cycle]
        if budget.push(chunk, [logprob(token) for token in chunk]):
            break
    request.stream.finish()
    return request, budget, stats, seen


def test_tokens_after_the_one_that_completes_a_stop_string_are_not_taken(demo):
    prompt_ids = demo.encode("x =")
    ids = demo.encode(" 1\n\ny = 2\nz = 3\n", add_special_tokens=False)
    one_by_one = TextStream(demo, stop=["\n\ny"], prompt_ids=prompt_ids)
    for token in ids:
        one_by_one.push([token])
        if one_by_one.stopped:
            break
    together = TextStream(demo, stop=["\n\ny"], prompt_ids=prompt_ids)
    assert together.push(ids) == together.text == one_by_one.text == " 1"
    assert together.stopped and together.token_ids == one_by_one.token_ids and len(together.token_ids) < len(ids)
    assert together.push(ids) == "" and together.token_ids == one_by_one.token_ids


@pytest.mark.parametrize("cycle", [4, 5, 7, 64])
def test_a_request_fed_whole_cycles_ends_as_ar_does(demo, cycle):
    prompt_ids = demo.encode("def f(x):")
    answer = demo.encode("\n    return x + 1\n\n\ndef g(y):\n    return y\n", add_special_tokens=False)
    ar = run(demo, prompt_ids, answer, ["+ 1\n"], 1)
    assert len(ar[0].stream.token_ids) % cycle != 0  # the stop string ends inside a cycle, not at its end
    cycles = run(demo, prompt_ids, answer, ["+ 1\n"], cycle)
    for solo, batched in ((ar, cycles),):
        assert batched[0].stream.token_ids == solo[0].stream.token_ids and len(solo[0].stream.token_ids) < len(answer)
        assert batched[0].stream.text == solo[0].stream.text == "\n    return x "
        assert batched[0].logprobs == solo[0].logprobs == [logprob(t) for t in solo[0].stream.token_ids]
        assert batched[1].finish_reason == solo[1].finish_reason == "stop"
        assert batched[2].new_tokens == solo[2].new_tokens == len(solo[0].stream.token_ids)
        assert batched[1].kept == solo[0].stream.token_ids
        # What the client was sent (tokens, logprobs) is what the reply holds.
        assert [t for ids, _, _ in batched[3] for t in ids] == solo[0].stream.token_ids
        assert [p for _, _, lps in batched[3] for p in lps] == solo[0].logprobs


def test_a_stop_on_the_last_token_the_budget_allows_is_a_stop(demo):
    prompt_ids = demo.encode("def f(x):")
    answer = demo.encode("\n    return x + 1\n", add_special_tokens=False)
    to_stop = next(n for n in range(1, len(answer) + 1)
                   if "+" in demo.decode(answer[:n]))  # the token that completes "+"
    for cycle in (1, 3):
        _, budget, _, _ = run(demo, prompt_ids, answer, ["+"], cycle, max_new_tokens=to_stop)
        assert budget.finish_reason == "stop" and len(budget.kept) == to_stop
        _, budget, _, _ = run(demo, prompt_ids, answer, ["+"], cycle, max_new_tokens=to_stop - 1)
        assert budget.finish_reason == "length"


def test_the_budget_keeps_what_the_emitter_kept():
    stats = Stats()
    budget = Budget(10, frozenset({99}), lambda tokens, _: Stop(2) if len(tokens) > 2 else False, stats)
    assert not budget.push([1, 2])
    assert budget.push([3, 4, 5, 6]) and budget.kept == [1, 2, 3, 4] and stats.new_tokens == 4
    assert budget.finish_reason == "stop" and budget.left == 6
    eos = Budget(3, frozenset({99}), lambda tokens, _: False, Stats())
    assert eos.push([7, 8, 99, 5]) and eos.kept == [7, 8, 99] and eos.finish_reason == "stop"
