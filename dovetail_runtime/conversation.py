"""``dovetail-client --chat`` without ``--prompt`` in a terminal: a conversation, turn by turn.

Each turn sends the whole chat so far (the server renders it with the model's chat template and
keeps nothing between requests), streams the reply, and keeps it for the next turn. ``/reset``
starts over (the system message stays), ``/exit`` or Ctrl-D ends it; Ctrl-C during a reply stops
that reply (the request is cancelled on the server; what was shown stays in the chat), at the
prompt it ends the conversation. A refused turn (e.g. the chat outgrew the context) is dropped,
and the conversation goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TextIO

from ipc import messages as m

from .client import DovetailClient, GenerationError

COMMANDS = "/reset starts over, /exit or Ctrl-D ends"


def stats_note(stats: m.RequestStats) -> str:
    """One short line after a reply: its length and speed, and tau where a draft was used."""
    tau = f", tau {stats.tau:.2f}" if stats.draft_ms > 0 else ""
    return f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s{tau}]"


class Conversation:
    """The chat so far: an optional system message, then user and assistant turns."""

    def __init__(self, system: str | None = None):
        self.opening = [m.ChatMessage(role="system", content=system)] if system is not None else []
        self.turns: list[m.ChatMessage] = list(self.opening)

    def reset(self) -> None:
        self.turns = list(self.opening)

    def ask(self, client: DovetailClient, text: str, params: dict[str, Any], out: TextIO, err: TextIO) -> bool:
        """One turn: the reply streamed to ``out`` and kept; False when it was refused (nothing kept).
        Ctrl-C stops the reply where it is (the client cancels the request) and keeps what was shown."""
        asked = [*self.turns, m.ChatMessage(role="user", content=text)]
        reply: list[str] = []
        try:
            for event in client.events(messages=asked, **params):
                if isinstance(event, m.TokenChunk):
                    reply.append(event.text)
                    out.write(event.text)
                    out.flush()
                else:
                    out.write("\n")
                    err.write(stats_note(event.stats) + "\n")
        except GenerationError as error:
            out.write("\n" if reply else "")
            hint = " (/reset starts over)" if error.code == "prompt_too_long" else ""
            err.write(f"error: {error}{hint}\n")
            return False
        except KeyboardInterrupt:
            out.write("\n")
            err.write("[stopped]\n")
        self.turns = [*asked, m.ChatMessage(role="assistant", content="".join(reply))]
        return True


def converse(client: DovetailClient, params: dict[str, Any], system: str | None, out: TextIO, err: TextIO,
             read_line: Callable[[str], str] = input) -> int:
    """The conversation loop; the exit status (130 after Ctrl-C at the prompt, as the shell counts it)."""
    conversation = Conversation(system)
    err.write(f"chatting with {client.endpoint}: {COMMANDS}\n")
    while True:
        try:
            text = read_line("> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            return 130
        command = text.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            conversation.reset()
            err.write("[a new conversation]\n")
        elif command.startswith("/"):
            err.write(f"unknown command {command!r}: {COMMANDS}\n")
        elif command:
            conversation.ask(client, text, params, out, err)
