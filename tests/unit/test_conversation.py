"""dovetail-client's conversation loop (``dovetail_runtime.conversation``) against a stand-in client:
what each turn sends, what is kept, and how commands, refusals and Ctrl-C end up."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest

from dovetail_runtime.client import GenerationError
from dovetail_runtime.conversation import converse
from ipc import messages as m


class StandInClient:
    """Answers each turn with the next scripted reply (a list of text pieces, or an exception to
    raise after the pieces), recording the messages of every request."""

    endpoint = "ipc:///stand-in.sock"

    def __init__(self, replies: list[tuple[list[str], BaseException | None]]):
        self.replies = replies
        self.asked: list[list[m.ChatMessage]] = []

    def events(self, messages: list[m.ChatMessage], **params) -> Iterator[m.TokenChunk | m.GenerateDone]:
        assert params == {"max_new_tokens": 8}
        self.asked.append(list(messages))
        pieces, failure = self.replies.pop(0)
        for piece in pieces:
            yield m.TokenChunk(request_id="r", token_ids=[1], text=piece)
        if failure is not None:
            raise failure
        yield m.GenerateDone(request_id="r", token_ids=[1] * len(pieces), text="".join(pieces), finish_reason="stop",
                             stats=m.RequestStats(new_tokens=len(pieces), tokens_per_s=12.5, tau=2.0, draft_ms=3.0))


def run(client: StandInClient, lines: list[str | BaseException], system: str | None = None) -> tuple[int, str, str]:
    script = list(lines)

    def read_line(prompt: str) -> str:
        assert prompt == "> "
        if not script:
            raise EOFError
        line = script.pop(0)
        if isinstance(line, BaseException):
            raise line
        return line

    out, err = io.StringIO(), io.StringIO()
    status = converse(client, {"max_new_tokens": 8}, system, out, err, read_line)  # type: ignore[arg-type]
    return status, out.getvalue(), err.getvalue()


def user(text: str) -> m.ChatMessage:
    return m.ChatMessage(role="user", content=text)


def assistant(text: str) -> m.ChatMessage:
    return m.ChatMessage(role="assistant", content=text)


def test_each_turn_sends_the_whole_chat_and_keeps_the_reply():
    client = StandInClient([(["Hel", "lo."], None), (["Fine", "."], None)])
    status, out, err = run(client, ["Hi", "", "How are you?"], system="Be brief.")
    system = m.ChatMessage(role="system", content="Be brief.")
    assert client.asked == [[system, user("Hi")], [system, user("Hi"), assistant("Hello."), user("How are you?")]]
    assert (status, out) == (0, "Hello.\nFine.\n\n")
    assert "[2 tokens, 12.5 tokens/s, tau 2.00]" in err and "/reset starts over" in err


def test_reset_keeps_the_system_message_and_unknown_commands_are_named():
    client = StandInClient([(["a"], None), (["b"], None)])
    status, _, err = run(client, ["one", "/reset", "/what", "two", "/exit", "never read"], system="S")
    system = m.ChatMessage(role="system", content="S")
    assert client.asked[1] == [system, user("two")] and status == 0
    assert "[a new conversation]" in err and "unknown command '/what'" in err


def test_a_refused_turn_is_dropped_and_the_conversation_goes_on():
    too_long = GenerationError("prompt_too_long", "the prompt leaves no room")
    client = StandInClient([(["a"], None), ([], too_long), (["c"], None)])
    status, _, err = run(client, ["one", "a very long turn", "three"])
    assert client.asked[2] == [user("one"), assistant("a"), user("three")]  # the refused turn is gone
    assert status == 0 and "error: prompt_too_long: the prompt leaves no room (/reset starts over)" in err


def test_ctrl_c_stops_a_reply_keeping_what_was_shown_and_at_the_prompt_ends():
    client = StandInClient([(["par", "tial"], KeyboardInterrupt()), (["b"], None)])
    status, out, err = run(client, ["one", "two", KeyboardInterrupt()])
    assert client.asked[1] == [user("one"), assistant("partial"), user("two")]
    assert status == 130 and out.startswith("partial\n") and "[stopped]" in err


@pytest.mark.parametrize("ending", ["/quit", EOFError()])
def test_exit_and_end_of_input_end_with_status_0(ending):
    status, _, _ = run(StandInClient([]), [ending])
    assert status == 0
