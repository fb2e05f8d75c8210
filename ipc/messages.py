"""Message schemas for every process boundary in Dovetail.

Every message is a frozen-free ``@dataclass`` registered with :func:`message`. On the
wire it is one msgpack map::

    {"v": PROTOCOL_VERSION, "type": "<ClassName>", <field>: <value>, ...}

Nested message objects (``RingRef``, ``InlineBlock``, ``Sampling``) are msgpack maps
with a ``"type"`` key and their fields (no ``"v"``), so a field may hold one of several
nested types (``features: RingRef | InlineBlock``).

The schema is declarative: field types come from the dataclass annotations, limits and
value constraints from ``typing.Annotated`` markers (:class:`MaxLen`, :class:`Range`,
:class:`OneOf`). One generic validator, compiled once per class at import, checks every
decoded message (and every message before it is encoded, so a sender cannot emit what
the receiver would refuse). Any problem, from "not msgpack" to "field too long", is a
single :class:`ProtocolError` with a message that names the type and field.

Strictness rules (the same for every message):

- every field must be present; unknown keys are refused; ``v`` must equal
  ``PROTOCOL_VERSION``;
- ``int`` accepts a msgpack integer only (not a bool, not a float) in the int64 range
  unless a :class:`Range` says otherwise;
- ``float`` accepts a msgpack float or integer (not a bool) and gives a Python float;
  NaN is refused wherever a :class:`Range` applies;
- ``bool`` accepts true/false only; ``str`` accepts a msgpack str (UTF-8); ``bytes`` a
  msgpack bin;
- ``X | None`` also accepts nil; ``list[X]`` a msgpack array whose items are all X;
- ``dict`` (statistics, worker info) is plain data: string keys, values of nil, bool,
  int, float, str, or lists/dicts of those, nested at most ``MAX_DICT_DEPTH`` deep and
  ``MAX_DICT_ITEMS`` entries in all;
- sizes: ``str`` is limited in UTF-8 bytes, ``bytes`` in bytes, lists in items, all
  by :class:`MaxLen` or the defaults below; the whole encoded message by
  ``MAX_MESSAGE_BYTES``.

Never pickle: msgpack decodes to plain data only, extension types are refused.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Union

import msgpack

PROTOCOL_VERSION = 1

# Defaults where a field names no MaxLen.
MAX_STR_BYTES = 64 * 1024
MAX_BYTES = 64 * 1024 * 1024
MAX_LIST_ITEMS = 1 << 16
MAX_DICT_DEPTH = 8
MAX_DICT_ITEMS = 4096
# The largest message decode() looks at (an inline hidden-state block fits well below).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
RESERVED_KEYS = frozenset({"v", "type"})


class ProtocolError(ValueError):
    """A message that cannot be encoded or decoded under this protocol.

    ``peer`` is set by channel helpers that know who sent the bad bytes (a ROUTER
    routing id), so the receiver can send an :class:`ErrorReply` back.
    """

    def __init__(self, message: str, *, peer: bytes | None = None):
        super().__init__(message)
        self.peer = peer


# --- declarative constraints (used inside typing.Annotated) ---------------------------


@dataclass(frozen=True)
class MaxLen:
    """Upper bound: UTF-8 bytes for str, bytes for bytes, items for lists."""

    limit: int


@dataclass(frozen=True)
class Range:
    """Inclusive numeric bounds for int/float fields (None: unbounded on that side)."""

    lo: float | None = None
    hi: float | None = None


@dataclass(frozen=True)
class OneOf:
    """The value must be one of these (for str enums)."""

    values: tuple

    def __init__(self, *values):
        object.__setattr__(self, "values", tuple(values))


# Reusable field types.
Id = Annotated[str, MaxLen(256)]
SeqId = Annotated[int, Range(0, INT64_MAX)]
TokenId = Annotated[int, Range(0, (1 << 31) - 1)]
TokenIds = Annotated[list[TokenId], MaxLen(1 << 20)]  # a whole prompt
MAX_TREE = 4096
TreeTokens = Annotated[list[TokenId], MaxLen(MAX_TREE)]
TreeParents = Annotated[list[Annotated[int, Range(-1, MAX_TREE - 1)]], MaxLen(MAX_TREE)]
Millis = Annotated[float, Range(0.0, 1e12)]
Count = Annotated[int, Range(0, INT64_MAX)]
Dim = Annotated[int, Range(0, (1 << 31) - 1)]
DType = Annotated[str, OneOf("float16", "bfloat16", "float32")]
Text = Annotated[str, MaxLen(16 * 1024 * 1024)]
Stop = Annotated[list[Annotated[str, MaxLen(1024)]], MaxLen(64)]


# --- registry -------------------------------------------------------------------------

_REGISTRY: dict[str, type] = {}
_VALIDATORS: dict[type, typing.Callable[[dict, str], dict]] = {}


def message(cls):
    """Class decorator: make ``cls`` a dataclass and register it as a message type."""
    if not dataclasses.is_dataclass(cls):
        cls = dataclass(cls)
    name = cls.__name__
    if name in _REGISTRY:
        raise TypeError(f"message type {name} registered twice")
    for f in dataclasses.fields(cls):
        if f.name in RESERVED_KEYS:
            raise TypeError(f"{name}.{f.name}: field name is reserved")
    _REGISTRY[name] = cls
    _VALIDATORS[cls] = _compile_message(cls)
    return cls


def message_types() -> dict[str, type]:
    """Every registered message type, by wire name."""
    return dict(_REGISTRY)


# --- the generic validator ------------------------------------------------------------
#
# _compile(annotation) returns check(value, where) -> value (possibly converted, e.g.
# int -> float, nested map -> dataclass) or raises ProtocolError.


def _fail(where: str, what: str):
    raise ProtocolError(f"{where}: {what}")


def _describe(value) -> str:
    name = type(value).__name__
    return {"NoneType": "nil", "list": "array", "dict": "map"}.get(name, name)


def _compile(annotation, *, max_len=None, rng=None, one_of=None):
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        base, *extras = typing.get_args(annotation)
        for extra in extras:
            if isinstance(extra, MaxLen):
                max_len = extra.limit
            elif isinstance(extra, Range):
                rng = extra
            elif isinstance(extra, OneOf):
                one_of = extra.values
        return _compile(base, max_len=max_len, rng=rng, one_of=one_of)

    if origin in (Union, types.UnionType):
        args = typing.get_args(annotation)
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        nested = [a for a in rest if dataclasses.is_dataclass(a)]
        if nested and len(nested) == len(rest):
            inner = _compile_nested_union(nested)
        elif len(rest) == 1:
            inner = _compile(rest[0], max_len=max_len, rng=rng, one_of=one_of)
        else:
            raise TypeError(f"unsupported union {annotation!r}: only X | None or a union of messages")
        if not optional:
            return inner

        def check_optional(value, where):
            return None if value is None else inner(value, where)

        return check_optional

    if annotation is bool:
        def check_bool(value, where):
            if type(value) is not bool:
                _fail(where, f"expected bool, got {_describe(value)}")
            return value
        return check_bool

    if annotation is int:
        lo = INT64_MIN if rng is None or rng.lo is None else rng.lo
        hi = INT64_MAX if rng is None or rng.hi is None else rng.hi

        def check_int(value, where):
            if type(value) is not int:
                _fail(where, f"expected int, got {_describe(value)}")
            if not lo <= value <= hi:
                _fail(where, f"int {value} out of range [{lo}, {hi}]")
            return value
        return check_int

    if annotation is float:
        lo = None if rng is None else rng.lo
        hi = None if rng is None else rng.hi
        bounded = rng is not None

        def check_float(value, where):
            kind = type(value)
            if kind is int:
                value = float(value)
            elif kind is not float:
                _fail(where, f"expected float, got {_describe(value)}")
            if bounded:
                if math.isnan(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
                    _fail(where, f"float {value} out of range [{lo}, {hi}]")
            return value
        return check_float

    if annotation is str:
        limit = MAX_STR_BYTES if max_len is None else max_len
        allowed = None if one_of is None else frozenset(one_of)

        def check_str(value, where):
            if type(value) is not str:
                _fail(where, f"expected str, got {_describe(value)}")
            # len(str) <= UTF-8 bytes <= 4 * len(str): encode only when it could matter.
            if len(value) > limit or (4 * len(value) > limit and len(value.encode("utf-8", "surrogatepass")) > limit):
                _fail(where, f"string longer than {limit} bytes")
            if allowed is not None and value not in allowed:
                _fail(where, f"{value!r} is not one of {sorted(allowed)}")
            return value
        return check_str

    if annotation is bytes:
        limit = MAX_BYTES if max_len is None else max_len

        def check_bytes(value, where):
            if type(value) is not bytes:
                _fail(where, f"expected bytes (msgpack bin), got {_describe(value)}")
            if len(value) > limit:
                _fail(where, f"{len(value)} bytes, more than the limit {limit}")
            return value
        return check_bytes

    if origin is list:
        (item_type,) = typing.get_args(annotation)
        limit = MAX_LIST_ITEMS if max_len is None else max_len
        item = _compile(item_type)
        plain = _plain_item_check(item_type)

        def check_list(value, where):
            if type(value) is not list:
                _fail(where, f"expected array, got {_describe(value)}")
            if len(value) > limit:
                _fail(where, f"array of {len(value)} items, more than the limit {limit}")
            if plain is not None and plain(value):
                return value  # fast path: every item has the right type and range
            return [item(x, f"{where}[{i}]") for i, x in enumerate(value)]
        return check_list

    if annotation is dict or origin is dict:
        limit = MAX_DICT_ITEMS if max_len is None else max_len

        def check_dict(value, where):
            if type(value) is not dict:
                _fail(where, f"expected map, got {_describe(value)}")
            _check_plain_data(value, where, limit)
            return value
        return check_dict

    if dataclasses.is_dataclass(annotation):
        return _compile_nested_union([annotation])

    raise TypeError(f"unsupported field type {annotation!r}")


def _plain_item_check(item_type):
    """A fast whole-list check for lists of ints/floats, or None."""
    base, rng = item_type, None
    if typing.get_origin(item_type) is Annotated:
        base, *extras = typing.get_args(item_type)
        for extra in extras:
            if isinstance(extra, Range):
                rng = extra
            elif isinstance(extra, (MaxLen, OneOf)):
                return None
    if base is int:
        lo = INT64_MIN if rng is None or rng.lo is None else rng.lo
        hi = INT64_MAX if rng is None or rng.hi is None else rng.hi
        return lambda xs: all(type(x) is int and lo <= x <= hi for x in xs)
    if base is float and rng is None:
        return lambda xs: all(type(x) is float for x in xs)
    return None


def _check_plain_data(value, where: str, limit: int):
    budget = [limit]

    def walk(node, path, depth):
        if depth > MAX_DICT_DEPTH:
            _fail(path, f"nested deeper than {MAX_DICT_DEPTH}")
        kind = type(node)
        if kind is dict:
            budget[0] -= len(node)
            if budget[0] < 0:
                _fail(where, f"more than {limit} entries in all")
            for key, sub in node.items():
                if type(key) is not str:
                    _fail(path, f"map key {key!r} is not a str")
                if len(key) > 1024:
                    _fail(path, "map key longer than 1024 characters")
                walk(sub, f"{path}.{key}", depth + 1)
        elif kind is list:
            budget[0] -= len(node)
            if budget[0] < 0:
                _fail(where, f"more than {limit} entries in all")
            for i, sub in enumerate(node):
                walk(sub, f"{path}[{i}]", depth + 1)
        elif kind is str:
            if len(node) > MAX_STR_BYTES:
                _fail(path, f"string longer than {MAX_STR_BYTES} characters")
        elif node is None or kind in (bool, int, float):
            pass
        else:
            _fail(path, f"{_describe(node)} is not plain data (nil/bool/int/float/str/array/map)")

    walk(value, where, 0)


def _compile_nested_union(classes):
    by_name = {c.__name__: c for c in classes}
    names = " | ".join(by_name)

    def check_nested(value, where):
        if isinstance(value, tuple(by_name.values())):  # encode side: already an object
            value = _to_wire_fields(value, nested=True)
        if type(value) is not dict:
            _fail(where, f"expected a {names} map, got {_describe(value)}")
        kind = value.get("type")
        cls = by_name.get(kind) if type(kind) is str else None
        if cls is None:
            _fail(where, f"nested type {kind!r} is not one of {names}")
        fields = {k: v for k, v in value.items() if k != "type"}
        return cls(**_VALIDATORS[cls](fields, f"{where}<{cls.__name__}>"))

    return check_nested


def _compile_message(cls):
    hints = typing.get_type_hints(cls, include_extras=True)
    checks = {f.name: _compile(hints[f.name]) for f in dataclasses.fields(cls)}
    required = frozenset(checks)
    name = cls.__name__

    def validate(fields: dict, where: str) -> dict:
        keys = set(fields)
        if keys != required:
            missing = sorted(required - keys)
            extra = sorted(str(k) for k in keys - required)
            parts = []
            if missing:
                parts.append(f"missing field(s) {missing}")
            if extra:
                parts.append(f"unknown field(s) {extra}")
            _fail(where or name, "; ".join(parts))
        return {k: check(fields[k], f"{where or name}.{k}") for k, check in checks.items()}

    return validate


def _to_wire_fields(obj, *, nested: bool) -> dict:
    out = {"type": type(obj).__name__}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = _to_wire_fields(value, nested=True)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


# --- public encode / decode -----------------------------------------------------------


def encode(msg) -> bytes:
    """Encode a registered message as msgpack bytes; ProtocolError if it is invalid."""
    cls = type(msg)
    if _REGISTRY.get(cls.__name__) is not cls:
        raise ProtocolError(f"{cls.__name__} is not a registered message type")
    wire = _to_wire_fields(msg, nested=False)
    fields = {k: v for k, v in wire.items() if k != "type"}
    _VALIDATORS[cls](fields, cls.__name__)  # refuse to send what the receiver would refuse
    wire["v"] = PROTOCOL_VERSION
    try:
        return msgpack.packb(wire, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"{cls.__name__}: cannot encode: {exc}") from None


def _refuse_ext(code, data):
    raise ValueError(f"msgpack extension type {code} is not allowed")


def decode(data: bytes, allowed: typing.Iterable[type] | None = None):
    """Decode and validate one message; ProtocolError on anything wrong.

    ``allowed``: the message classes this receiver accepts (None: any registered type).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    size = len(data) if not isinstance(data, memoryview) else data.nbytes
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {size} bytes exceeds the limit {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True, ext_hook=_refuse_ext,
            timestamp=0, max_str_len=MAX_BYTES, max_bin_len=MAX_BYTES,
            max_array_len=1 << 22, max_map_len=1 << 16, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many kinds (ExtraData, ValueError, ...)
        raise ProtocolError(f"not a valid msgpack message: {type(exc).__name__}: {exc}") from None
    if type(obj) is not dict:
        raise ProtocolError(f"message must be a msgpack map, got {_describe(obj)}")
    version = obj.get("v")
    kind = obj.get("type")
    if type(kind) is not str:
        raise ProtocolError(f"message has no string 'type' (got {_describe(kind)})")
    if type(version) is not int or isinstance(version, bool):
        raise ProtocolError(f"{kind}: message has no integer protocol version 'v'")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"{kind}: protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message type {kind[:64]!r}")
    if allowed is not None and cls not in allowed:
        raise ProtocolError(f"message type {kind} is not accepted here")
    fields = {k: v for k, v in obj.items() if k not in RESERVED_KEYS}
    return cls(**_VALIDATORS[cls](fields, kind))


# ======================================================================================
# The messages
# ======================================================================================

# --- blocks of hidden states ----------------------------------------------------------


@message
class RingRef:
    """A [rows, cols] block in slot ``slot`` of shared-memory ring ``ring``, written
    with sequence number ``seq`` (see ipc.shm_ring)."""

    ring: Annotated[str, MaxLen(255)]
    slot: Count
    seq: Annotated[int, Range(1, INT64_MAX)]
    rows: Dim
    cols: Dim
    dtype: DType


@message
class InlineBlock:
    """The inline fallback: the same block carried in the message itself
    (row-major, little-endian raw bytes; see ipc.shm_ring.pack_block)."""

    rows: Dim
    cols: Dim
    dtype: DType
    data: bytes


Block = RingRef | InlineBlock


@message
class Sampling:
    """Sampling parameters for the target. temperature 0 means greedy; top_k 0 and
    top_p 1.0 switch those filters off."""

    temperature: Annotated[float, Range(0.0, 1000.0)] = 0.0
    top_k: Annotated[int, Range(0, 1 << 31)] = 0
    top_p: Annotated[float, Range(0.0, 1.0)] = 1.0
    seed: int | None = None


# --- client <-> coordinator -----------------------------------------------------------


@message
class GenerateRequest:
    request_id: Id
    prompt: Text
    max_new_tokens: Annotated[int, Range(1, 1 << 20)] = 128
    stop: Stop = field(default_factory=list)
    temperature: Annotated[float, Range(0.0, 1000.0)] = 0.0
    top_k: Annotated[int, Range(0, 1 << 31)] = 0
    top_p: Annotated[float, Range(0.0, 1.0)] = 1.0
    seed: int | None = None
    mode: Annotated[str, OneOf("dovetail", "ar")] = "dovetail"
    stream: bool = False


@message
class TokenChunk:
    """Streamed new tokens (only when the request asked for ``stream``)."""

    request_id: Id
    token_ids: TokenIds
    text: Text


@message
class GenerateDone:
    """The end of a request: all new tokens and the full new text, plus statistics
    (new_tokens, cycles, tau, tokens_per_s, draft_ms, verify_ms, ipc_ms, ...)."""

    request_id: Id
    token_ids: TokenIds
    text: Text
    finish_reason: Annotated[str, OneOf("stop", "length", "cancelled")]
    stats: dict = field(default_factory=dict)


@message
class ErrorReply:
    """The request failed (or a message could not be read: request_id None)."""

    request_id: Id | None
    code: Annotated[str, MaxLen(64)]
    message: Annotated[str, MaxLen(8192)]


@message
class Cancel:
    request_id: Id


# --- coordinator <-> cpu_worker (target) ----------------------------------------------


@message
class PrefillRequest:
    """Start sequence ``seq_id`` with its prompt; the worker keeps ``sampling`` for
    every later step of the sequence."""

    seq_id: SeqId
    token_ids: TokenIds
    sampling: Sampling = field(default_factory=Sampling)
    return_features: bool = True


@message
class PrefillResult:
    """The first new token and the last-layer features (after the final norm) of the
    ``n_features`` prompt positions (None when not requested)."""

    seq_id: SeqId
    token: TokenId
    features: Block | None
    n_features: Count
    compute_ms: Millis = 0.0


@message
class VerifyRequest:
    """Verify a compact draft tree (see ipc.tree): node 0 is the root."""

    seq_id: SeqId
    tokens: TreeTokens
    parents: TreeParents


@message
class VerifyResult:
    """``accepted_tokens``: k accepted drafts + 1 bonus token; ``accepted_nodes``: the
    tree indices of the root and the k accepted nodes (k+1 entries); ``features``: their
    k+1 feature rows."""

    seq_id: SeqId
    accepted_tokens: TreeTokens
    accepted_nodes: Annotated[list[Annotated[int, Range(0, MAX_TREE - 1)]], MaxLen(MAX_TREE)]
    features: Block
    compute_ms: Millis = 0.0


@message
class DecodeRequest:
    """Plain autoregressive step (``--mode ar``): feed ``token`` (the last emitted one,
    not cached yet) and sample the next."""

    seq_id: SeqId
    token: TokenId


@message
class DecodeResult:
    seq_id: SeqId
    token: TokenId
    compute_ms: Millis = 0.0


@message
class ReleaseSequence:
    """Forget sequence ``seq_id`` (its KV cache); sent to both workers."""

    seq_id: SeqId


# --- coordinator <-> gpu_worker (draft) -----------------------------------------------


@message
class DraftRequest:
    """Feed ``tokens`` paired with the feature rows in ``features`` into the draft's KV
    cache (pair i: feature row i with tokens[i]), then expand a tree of ``tree_tokens``
    nodes (root included), at most ``depth`` draft tokens on a path, beam ``top_k``.
    ``reset``: drop the draft's cache for this sequence first (a new sequence)."""

    seq_id: SeqId
    tokens: TokenIds
    features: Block
    tree_tokens: Annotated[int, Range(1, MAX_TREE)]
    depth: Annotated[int, Range(0, MAX_TREE)]
    top_k: Annotated[int, Range(1, 1024)]
    reset: bool = False


@message
class DraftResult:
    """A compact tree: ``tokens[T]``, ``parents[T]`` and the cumulative log-probability
    ``scores[T]`` of each node (root 0.0)."""

    seq_id: SeqId
    tokens: TreeTokens
    parents: TreeParents
    scores: Annotated[list[float], MaxLen(MAX_TREE)]
    compute_ms: Millis = 0.0


# --- worker lifecycle -----------------------------------------------------------------


@message
class Ready:
    """Handshake: the worker has loaded its model and serves. ``info``: plain data
    (device, dtype, hidden size, vocab size, ring names, ...)."""

    worker: Annotated[str, MaxLen(64)]
    pid: Annotated[int, Range(0, INT64_MAX)]
    info: dict = field(default_factory=dict)


@message
class WorkerError:
    """A worker could not do what was asked (``seq_id`` when it concerns one sequence;
    ``fatal``: the worker is about to exit)."""

    worker: Annotated[str, MaxLen(64)]
    message: Annotated[str, MaxLen(65536)]
    seq_id: SeqId | None = None
    fatal: bool = False


@message
class Shutdown:
    """Ask a worker to release everything and exit."""


@message
class Ping:
    nonce: int = 0


@message
class Pong:
    nonce: int = 0


CLIENT_TO_COORDINATOR = frozenset({GenerateRequest, Cancel, Ping})
COORDINATOR_TO_CLIENT = frozenset({TokenChunk, GenerateDone, ErrorReply, Pong})
TO_CPU_WORKER = frozenset({PrefillRequest, VerifyRequest, DecodeRequest, ReleaseSequence, Shutdown, Ping})
FROM_CPU_WORKER = frozenset({PrefillResult, VerifyResult, DecodeResult, Ready, WorkerError, Pong})
TO_GPU_WORKER = frozenset({DraftRequest, ReleaseSequence, Shutdown, Ping})
FROM_GPU_WORKER = frozenset({DraftResult, Ready, WorkerError, Pong})

__all__ = [
    "PROTOCOL_VERSION", "ProtocolError", "MaxLen", "Range", "OneOf", "message", "message_types",
    "encode", "decode", "Block", "RingRef", "InlineBlock", "Sampling",
    "GenerateRequest", "TokenChunk", "GenerateDone", "ErrorReply", "Cancel",
    "PrefillRequest", "PrefillResult", "VerifyRequest", "VerifyResult", "DecodeRequest",
    "DecodeResult", "ReleaseSequence", "DraftRequest", "DraftResult",
    "Ready", "WorkerError", "Shutdown", "Ping", "Pong",
    "CLIENT_TO_COORDINATOR", "COORDINATOR_TO_CLIENT", "TO_CPU_WORKER", "FROM_CPU_WORKER",
    "TO_GPU_WORKER", "FROM_GPU_WORKER",
]
