"""Messages to msgpack bytes and back, with one error type for everything that can go wrong.

Never pickle: msgpack carries plain data only, and msgspec decodes it straight into the
declared Structs of ``ipc.messages`` (types, ranges and unknown fields checked on the way).
``encode`` checks too, by decoding what it made, so a sender cannot emit what its receiver
would refuse: the error then surfaces where the bad value was made.

A worker's settings (``messages.WorkerSettings``) and its ready info (``messages.TargetInfo``,
``DraftInfo``) are checked the same way: the settings as the JSON text of a worker's
``--settings`` argument (a command line carries text), the info as the map inside ``Ready``.
"""

from __future__ import annotations

import functools
from typing import TypeVar, Union

import msgspec

from .messages import ALL_MESSAGES, Message, Nested, WorkerSettings

# The largest message decode() looks at. Hidden states never travel inline (shared-memory
# rings carry them), so the biggest honest message is a 1M-token prompt.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

_encoder = msgspec.msgpack.Encoder()
V = TypeVar("V", bound=Nested)


class ProtocolError(ValueError):
    """A message that cannot be encoded or decoded under this protocol.

    ``peer`` is set by the channel helpers that know who sent the bad bytes (a ROUTER routing
    id), so the receiver can answer with an ErrorReply.
    """

    def __init__(self, message: str, *, peer: bytes | None = None):
        super().__init__(message)
        self.peer = peer


@functools.cache
def _decoder(allowed: tuple[type[Message], ...]) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Union[allowed])  # noqa: UP007 - a runtime union of a tuple of types


def _name(allowed: tuple[type[Message], ...]) -> str:
    return ", ".join(cls.__name__ for cls in allowed)


def decode(data: bytes | bytearray | memoryview, allowed: tuple[type[Message], ...] = ALL_MESSAGES) -> Message:
    """Decode and validate one message of one of the ``allowed`` types; ProtocolError otherwise."""
    size = memoryview(data).nbytes
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {size} bytes exceeds the limit {MAX_MESSAGE_BYTES}")
    try:
        return _decoder(allowed).decode(data)
    except msgspec.ValidationError as error:
        text = str(error)
        if "at `$.type`" in text:
            text = f"{text} (accepted here: {_name(allowed)})"
        raise ProtocolError(f"invalid message: {text}") from None
    except msgspec.DecodeError as error:
        raise ProtocolError(f"not a valid msgpack message: {error}") from None
    except RecursionError:
        # msgpack nested deeper than the stack allows (e.g. [[[...]]] in an unknown field,
        # which is parsed before the "type" tag is found): refuse it like any bad message.
        raise ProtocolError("not a valid msgpack message: nested too deeply") from None


def encode(message: Message) -> bytes:
    """The message as msgpack bytes; ProtocolError if its receiver would refuse it."""
    if not isinstance(message, ALL_MESSAGES):
        raise ProtocolError(f"{type(message).__name__} is not a message type")
    try:
        data = _encoder.encode(message)
    except (TypeError, ValueError, OverflowError) as error:  # a value msgpack cannot carry
        raise ProtocolError(f"{type(message).__name__} cannot be encoded: {error}") from None
    try:
        _decoder((type(message),)).decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise ProtocolError(f"{type(message).__name__} would be refused: {error}") from None
    return data


def encode_settings(settings: WorkerSettings) -> str:
    """A worker's settings as the JSON text of its ``--settings`` argument; ProtocolError if
    the worker would refuse them."""
    kind = type(settings)
    data = msgspec.json.encode(settings)
    try:
        msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as error:
        raise ProtocolError(f"{kind.__name__} would be refused: {error}") from None
    return data.decode()


def decode_settings(text: str | bytes, kind: type[V]) -> V:
    """A worker's ``--settings`` JSON as ``kind``; ProtocolError naming the bad field otherwise."""
    try:
        return msgspec.json.decode(text, type=kind)
    except msgspec.ValidationError as error:
        raise ProtocolError(f"invalid {kind.__name__}: {error}") from None
    except msgspec.DecodeError as error:
        raise ProtocolError(f"{kind.__name__} is not valid JSON: {error}") from None


def encode_info(info: Nested) -> msgspec.Raw:
    """A worker's ready info as the map ``Ready.info`` carries; ProtocolError if the
    coordinator would refuse it."""
    kind = type(info)
    try:
        data = _encoder.encode(info)
        msgspec.msgpack.decode(data, type=kind)
    except (TypeError, ValueError, OverflowError, msgspec.ValidationError) as error:
        raise ProtocolError(f"{kind.__name__} would be refused: {error}") from None
    return msgspec.Raw(data)


def decode_info(raw: msgspec.Raw, kind: type[V]) -> V:
    """``Ready.info`` as the ``kind`` this worker reports; ProtocolError naming the bad field otherwise."""
    try:
        return msgspec.msgpack.decode(raw, type=kind)
    except msgspec.ValidationError as error:
        raise ProtocolError(f"invalid {kind.__name__}: {error}") from None
    except msgspec.DecodeError as error:
        raise ProtocolError(f"{kind.__name__} is not valid msgpack: {error}") from None
    except RecursionError:
        raise ProtocolError(f"{kind.__name__} is not valid msgpack: nested too deeply") from None
