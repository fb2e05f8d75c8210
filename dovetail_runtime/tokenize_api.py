"""llama-server's ``POST /tokenize`` and ``POST /detokenize`` as plain data (no web server here).

``{"content": "text", "add_special": false, "with_pieces": false}`` -> ``{"tokens": [ids]}``
(with ``with_pieces``: ``[{"id": id, "piece": "text"}]``), and ``{"tokens": [ids]}`` ->
``{"content": "text"}``, with llama-server's field names and defaults: ``add_special`` (BOS and
the like) is off, and detokenizing shows special tokens, so the two round-trip. Unknown fields
are ignored, as llama-server ignores them. A piece that is part of a character (byte-level
tokens) reads as U+FFFD, where llama-server gives its bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from msgspec import Meta, Struct

from .openai_api import ApiError, convert, decode_object

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

MAX_CONTENT_CHARS = 16 * 1024 * 1024  # as a completion's prompt


class TokenizeRequest(Struct, kw_only=True):
    content: Annotated[str, Meta(max_length=MAX_CONTENT_CHARS)]
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[Annotated[int, Meta(ge=0)]]


def parse_tokenize(body: bytes) -> TokenizeRequest:
    return convert(decode_object(body), TokenizeRequest)


def parse_detokenize(body: bytes) -> DetokenizeRequest:
    return convert(decode_object(body), DetokenizeRequest)


def tokenize_body(tokenizer: Tokenizer, request: TokenizeRequest) -> dict[str, Any]:
    ids = tokenizer.encode(request.content, add_special_tokens=request.add_special)
    if not request.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": token, "piece": tokenizer.decode([token], skip_special_tokens=False)}
                       for token in ids]}


def check_ids(ids: list[int], vocabulary: int) -> None:
    """ApiError(400) naming the first id beyond the vocabulary (the tokenizer would skip it silently)."""
    for index, token in enumerate(ids):
        if token >= vocabulary:
            shown = str(token) if token < 10**20 else f"{str(token)[:20]}..."  # never echo a megabyte of digits
            raise ApiError(400, f"tokens[{index}] = {shown} is not a token id of this model (its ids are 0 to "
                                f"{vocabulary - 1})", code="invalid_request", param=f"tokens[{index}]")


def detokenize_body(tokenizer: Tokenizer, request: DetokenizeRequest) -> dict[str, str]:
    check_ids(request.tokens, len(tokenizer))
    return {"content": tokenizer.decode(request.tokens, skip_special_tokens=False)}
