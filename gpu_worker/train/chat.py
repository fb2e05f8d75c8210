"""Conversations to token ids with an assistant-only loss mask.

With a chat template, assistant spans are found by rendering growing prefixes of the
conversation (templates render a prefix as a prefix of the whole): the span of assistant
turn k runs from the end of ``render(turns[:k], add_generation_prompt=True)`` to the end of
``render(turns[:k+1])``, so it covers the reply and the template's end-of-turn marker (the
draft must learn to predict that too) but not the role header. Without a template the turns
are rendered as ``role: content`` lines. Token masks come from character offsets.
"""

from __future__ import annotations

from typing import Any

Span = tuple[int, int]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _template_render(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[Span]]:
    def render(turns: list[dict[str, str]], generation_prompt: bool = False) -> str:
        if not turns:
            return ""
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    full = render(messages)
    spans: list[Span] = []
    cursor = 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start_text = render(messages[:index], generation_prompt=True)
        end_text = render(messages[:index + 1])
        if full.startswith(end_text) and end_text.startswith(start_text):
            spans.append((len(start_text), len(end_text)))
            cursor = len(end_text)
        else:  # a template that rewrites earlier turns: fall back to finding the reply text
            found = full.find(message["content"], cursor)
            if found < 0:
                raise ValueError("cannot locate an assistant reply in the rendered chat template")
            spans.append((found, found + len(message["content"])))
            cursor = found + len(message["content"])
    return full, spans


def _plain_render(messages: list[dict[str, str]]) -> tuple[str, list[Span]]:
    """``role: content`` per turn, one turn per line; the assistant span is its reply and
    the newline that ends it."""
    text = ""
    spans: list[Span] = []
    for message in messages:
        header = f"{message['role']}: "
        start = len(text) + len(header)
        text += header + message["content"] + "\n"
        if message["role"] == "assistant":
            spans.append((start, len(text)))
    return text, spans


def _overlaps(begin: int, end: int, spans: list[Span]) -> bool:
    return any(begin < span_end and end > span_begin for span_begin, span_end in spans)


def render_conversation(tokenizer: Any, messages: list[dict[str, str]],
                        use_template: bool = True) -> tuple[list[int], list[bool]]:
    """Token ids and a mask that is True exactly on tokens of assistant turns."""
    if use_template and has_chat_template(tokenizer):
        text, spans = _template_render(tokenizer, messages)
        # The template writes its own special tokens (start-of-text etc.).
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        mask = [_overlaps(b, e, spans) for b, e in encoded["offset_mapping"]]
        return ids, mask
    text, spans = _plain_render(messages)
    encoded = tokenizer(text, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    # Special tokens the tokenizer adds have empty (0, 0) offsets and stay unmasked.
    mask = [e > b and _overlaps(b, e, spans) for b, e in encoded["offset_mapping"]]
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
        # The end token closes the conversation: learn it only after an assistant reply.
        mask.append(bool(messages) and messages[-1]["role"] == "assistant")
    return ids, mask
