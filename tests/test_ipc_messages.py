"""ipc.messages: every message round-trips; everything malformed is one ProtocolError."""

from __future__ import annotations

import math
import pickle

import msgpack
import pytest

from ipc import messages as M
from ipc.messages import ProtocolError, decode, encode

RING = M.RingRef(ring="dovetail-1-abcd", slot=2, seq=7, rows=3, cols=16, dtype="float16")
INLINE = M.InlineBlock(rows=1, cols=2, dtype="float32", data=b"\x00" * 8)

SAMPLES = [
    RING,
    INLINE,
    M.Sampling(temperature=0.7, top_k=40, top_p=0.9, seed=1234),
    M.GenerateRequest(request_id="r1", prompt="def f(x):\n    return x é ☃", max_new_tokens=64,
                      stop=["\n\n", "###"], temperature=0.8, top_k=50, top_p=0.95, seed=None,
                      mode="ar", stream=True),
    M.TokenChunk(request_id="r1", token_ids=[1, 2, 3], text="abc"),
    M.GenerateDone(request_id="r1", token_ids=[5, 6], text="xy", finish_reason="length",
                   stats={"new_tokens": 2, "tau": 3.5, "per_depth": [1.0, 0.5], "nested": {"ok": True, "n": None}}),
    M.ErrorReply(request_id=None, code="protocol", message="bad bytes"),
    M.ErrorReply(request_id="r2", code="cancelled", message=""),
    M.Cancel(request_id="r1"),
    M.PrefillRequest(seq_id=9, token_ids=list(range(300)), sampling=M.Sampling(seed=None), return_features=True),
    M.PrefillResult(seq_id=9, token=42, features=RING, n_features=300, compute_ms=12.5),
    M.PrefillResult(seq_id=9, token=42, features=None, n_features=0, compute_ms=0.0),
    M.PrefillResult(seq_id=9, token=42, features=INLINE, n_features=1, compute_ms=1.0),
    M.VerifyRequest(seq_id=9, tokens=[4, 5, 6, 7], parents=[-1, 0, 0, 1]),
    M.VerifyResult(seq_id=9, accepted_tokens=[5, 8], accepted_nodes=[0, 1], features=RING, compute_ms=50.25),
    M.VerifyResult(seq_id=9, accepted_tokens=[5, 8], accepted_nodes=[0, 1], features=INLINE, compute_ms=50.25),
    M.DecodeRequest(seq_id=9, token=17),
    M.DecodeResult(seq_id=9, token=18, compute_ms=23.0),
    M.ReleaseSequence(seq_id=9),
    M.DraftRequest(seq_id=9, tokens=[5, 8], features=RING, tree_tokens=16, depth=6, top_k=8, reset=False),
    M.DraftResult(seq_id=9, tokens=[8, 1, 2], parents=[-1, 0, 0], scores=[0.0, -0.1, -2.5], compute_ms=3.0),
    M.Ready(worker="cpu", pid=1234, info={"hidden_size": 5120, "dtype": "float32", "rings": ["a", "b"]}),
    M.WorkerError(worker="gpu", message="CUDA out of memory", seq_id=9, fatal=True),
    M.WorkerError(worker="gpu", message="boom"),
    M.Shutdown(),
    M.Ping(nonce=5),
    M.Pong(nonce=5),
]


def test_samples_cover_every_message_type():
    assert {type(m) for m in SAMPLES} == set(M.message_types().values())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    wire = msgpack.unpackb(data)
    assert wire["v"] == M.PROTOCOL_VERSION and wire["type"] == type(msg).__name__
    back = decode(data)
    assert back == msg and type(back) is type(msg)
    assert decode(data, allowed={type(msg)}) == msg


def test_nested_blocks_decode_to_their_own_types():
    back = decode(encode(SAMPLES[14]))
    assert isinstance(back.features, M.RingRef) and back.features == RING
    back = decode(encode(SAMPLES[15]))
    assert isinstance(back.features, M.InlineBlock) and back.features.data == INLINE.data


def test_allowed_set_is_enforced():
    with pytest.raises(ProtocolError, match="not accepted here"):
        decode(encode(M.Shutdown()), allowed=M.CLIENT_TO_COORDINATOR)


def test_tuples_encode_as_lists():
    msg = M.VerifyRequest(seq_id=1, tokens=(1, 2), parents=(-1, 0))
    assert decode(encode(msg)) == M.VerifyRequest(seq_id=1, tokens=[1, 2], parents=[-1, 0])


def test_int_accepted_for_float_and_converted():
    wire = _wire(M.GenerateRequest(request_id="a", prompt="p"))
    wire["temperature"] = 1
    msg = decode(msgpack.packb(wire))
    assert msg.temperature == 1.0 and type(msg.temperature) is float


# --- rejection ------------------------------------------------------------------------

_PICKLE_RAN = []


def _mark():
    _PICKLE_RAN.append(True)


class _Evil:
    def __reduce__(self):
        return (_mark, ())


def _wire(msg) -> dict:
    return msgpack.unpackb(encode(msg))


def _decode_wire(wire: dict):
    return decode(msgpack.packb(wire, use_bin_type=True))


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x92\x01", b"garbage bytes here", b"\x81\xa1v", bytes(range(256)),
    msgpack.packb({"v": 1, "type": "Ping", "nonce": 1}) + b"trailing",
], ids=["empty", "reserved-byte", "truncated-array", "text", "truncated-map", "all-bytes", "trailing"])
def test_garbage_is_rejected(data):
    with pytest.raises(ProtocolError, match="msgpack"):
        decode(data)


def test_pickle_is_rejected_and_never_executed():
    for payload in (pickle.dumps(_Evil()), pickle.dumps({"v": 1, "type": "Ping", "nonce": 1}),
                    pickle.dumps(M.Ping(nonce=1), protocol=0)):
        with pytest.raises(ProtocolError):
            decode(payload)
    assert _PICKLE_RAN == []


@pytest.mark.parametrize("obj", [[1, 2], 5, "Ping", None, b"x", 1.5])
def test_non_map_is_rejected(obj):
    with pytest.raises(ProtocolError, match="map"):
        decode(msgpack.packb(obj, use_bin_type=True))


def test_not_bytes_is_rejected():
    with pytest.raises(ProtocolError, match="bytes"):
        decode("a str")


@pytest.mark.parametrize("mutate,pattern", [
    (lambda w: w.update(type="Nope"), "unknown message type"),
    (lambda w: w.update(type="__class__"), "unknown message type"),
    (lambda w: w.pop("type"), "no string 'type'"),
    (lambda w: w.update(type=3), "no string 'type'"),
    (lambda w: w.update(v=2), "protocol version 2"),
    (lambda w: w.update(v=0), "protocol version 0"),
    (lambda w: w.pop("v"), "protocol version 'v'"),
    (lambda w: w.update(v="1"), "protocol version 'v'"),
    (lambda w: w.update(v=True), "protocol version 'v'"),
])
def test_envelope_is_checked(mutate, pattern):
    wire = _wire(M.Cancel(request_id="a"))
    mutate(wire)
    with pytest.raises(ProtocolError, match=pattern):
        _decode_wire(wire)


def test_missing_and_extra_fields():
    wire = _wire(M.VerifyRequest(seq_id=1, tokens=[1], parents=[-1]))
    del wire["parents"]
    with pytest.raises(ProtocolError, match=r"VerifyRequest: missing field\(s\) \['parents'\]"):
        _decode_wire(wire)
    wire = _wire(M.VerifyRequest(seq_id=1, tokens=[1], parents=[-1]))
    wire["evil"] = "x"
    with pytest.raises(ProtocolError, match=r"unknown field\(s\) \['evil'\]"):
        _decode_wire(wire)
    # Fields with Python defaults are still required on the wire.
    wire = _wire(M.GenerateRequest(request_id="a", prompt="p"))
    del wire["stream"]
    with pytest.raises(ProtocolError, match="missing"):
        _decode_wire(wire)


GEN = M.GenerateRequest(request_id="a", prompt="p")
DONE = M.GenerateDone(request_id="a", token_ids=[1], text="t", finish_reason="stop", stats={})
VRES = M.VerifyResult(seq_id=1, accepted_tokens=[1], accepted_nodes=[0], features=RING)
DRES = M.DraftResult(seq_id=1, tokens=[1], parents=[-1], scores=[0.0])
PRE = M.PrefillRequest(seq_id=1, token_ids=[1])
ERR = M.ErrorReply(request_id=None, code="c", message="m")


@pytest.mark.parametrize("base,field,value,pattern", [
    # int fields
    (GEN, "max_new_tokens", "5", "expected int, got str"),
    (GEN, "max_new_tokens", 5.0, "expected int, got float"),
    (GEN, "max_new_tokens", True, "expected int, got bool"),
    (GEN, "max_new_tokens", None, "expected int, got nil"),
    (GEN, "max_new_tokens", 0, "out of range"),
    (GEN, "max_new_tokens", 2**64 - 1, "out of range"),
    # str fields
    (GEN, "prompt", 5, "expected str, got int"),
    (GEN, "prompt", b"bytes", "expected str, got bytes"),
    (GEN, "prompt", ["p"], "expected str, got array"),
    (GEN, "mode", "beam", "not one of"),
    # bool
    (GEN, "stream", 1, "expected bool, got int"),
    (GEN, "stream", "true", "expected bool, got str"),
    # float
    (GEN, "temperature", "0.5", "expected float, got str"),
    (GEN, "temperature", True, "expected float, got bool"),
    (GEN, "temperature", math.nan, "out of range"),
    (GEN, "top_p", 1.5, "out of range"),
    (GEN, "temperature", -0.1, "out of range"),
    # optional
    (GEN, "seed", "42", "expected int, got str"),
    (GEN, "seed", 1.0, "expected int, got float"),
    (ERR, "request_id", 5, "expected str, got int"),
    # list[str]
    (GEN, "stop", "\n", "expected array, got str"),
    (GEN, "stop", ["ok", 3], r"stop\[1\]: expected str, got int"),
    # list[int]
    (VRES, "accepted_tokens", [1, "2"], r"accepted_tokens\[1\]: expected int, got str"),
    (VRES, "accepted_tokens", [1, True], r"accepted_tokens\[1\]: expected int, got bool"),
    (VRES, "accepted_tokens", [1, 2.0], r"accepted_tokens\[1\]: expected int, got float"),
    (VRES, "accepted_tokens", [-3], "out of range"),
    (VRES, "accepted_tokens", 5, "expected array, got int"),
    (VRES, "accepted_tokens", None, "expected array, got nil"),
    (M.VerifyRequest(seq_id=1, tokens=[1], parents=[-1]), "parents", [-2], "out of range"),
    # list[float]
    (DRES, "scores", ["x"], r"scores\[0\]: expected float, got str"),
    # nested message
    (VRES, "features", None, "expected a RingRef | InlineBlock map, got nil"),
    (VRES, "features", {"type": "Ping", "nonce": 1}, "not one of RingRef | InlineBlock"),
    (VRES, "features", {"ring": "r", "slot": 0, "seq": 1, "rows": 1, "cols": 1, "dtype": "float16"}, "nested type None"),
    (VRES, "features", {"type": "RingRef", "ring": "r", "slot": 0, "seq": 1, "rows": 1, "cols": 1}, r"missing field\(s\) \['dtype'\]"),
    (VRES, "features", {"type": "RingRef", "ring": "r", "slot": 0, "seq": 1, "rows": 1, "cols": 1, "dtype": "int8"}, "not one of"),
    (VRES, "features", {"type": "RingRef", "ring": "r", "slot": "0", "seq": 1, "rows": 1, "cols": 1, "dtype": "float16"}, r"features<RingRef>\.slot: expected int"),
    (VRES, "features", {"type": "RingRef", "ring": "r", "slot": 0, "seq": 1, "rows": 1, "cols": 1, "dtype": "float16", "x": 1}, "unknown field"),
    (PRE, "sampling", {"type": "Sampling", "temperature": 1.0, "top_k": 0, "top_p": 1.0}, "missing"),
    (PRE, "sampling", [1.0, 0, 1.0, None], "expected a Sampling map, got array"),
    # nested dict (plain data)
    (DONE, "stats", [1, 2], "expected map, got array"),
    (DONE, "stats", {"a": b"bytes"}, "not plain data"),
    (DONE, "stats", {"a": msgpack.ExtType(5, b"x")}, "msgpack"),
    (DONE, "stats", {b"k": 1}, "is not a str"),
    (DONE, "stats", {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": {}}}}}}}}}}, "nested deeper"),
    (DONE, "stats", {str(i): i for i in range(5000)}, "entries in all"),
    (DONE, "finish_reason", "eos", "not one of"),
])
def test_wrong_field_values_are_rejected(base, field, value, pattern):
    wire = _wire(base)
    wire[field] = value
    with pytest.raises(ProtocolError, match=pattern):
        _decode_wire(wire)


def test_int_map_keys_are_rejected():
    data = msgpack.packb({"v": 1, "type": "Ping", "nonce": 1, 5: 1})
    with pytest.raises(ProtocolError):
        decode(data)


@pytest.mark.parametrize("base,field,value,pattern", [
    (GEN, "request_id", "x" * 257, "longer than 256 bytes"),
    (GEN, "request_id", "é" * 200, "longer than 256 bytes"),  # 200 chars, 400 UTF-8 bytes
    (GEN, "prompt", lambda: "é" * (9 << 20), "longer than 16777216 bytes"),  # 9 Mi chars, 18 MiB
    (GEN, "stop", ["x"] * 65, "more than the limit 64"),
    (GEN, "stop", ["x" * 1025], "longer than 1024"),
    (M.VerifyRequest(seq_id=1, tokens=[1], parents=[-1]), "tokens", lambda: [1] * (M.MAX_TREE + 1), "more than the limit 4096"),
    (PRE, "token_ids", lambda: [1] * ((1 << 20) + 1), "more than the limit 1048576"),
    (INLINE, "data", lambda: b"\x00" * (M.MAX_BYTES + 1), "max_bin_len|more than the limit"),
])
def test_oversize_values_are_rejected(base, field, value, pattern):
    wire = _wire(base)
    wire[field] = value() if callable(value) else value  # big values built only when run
    with pytest.raises(ProtocolError, match=pattern):
        _decode_wire(wire)


def test_whole_message_size_limit(monkeypatch):
    data = encode(M.GenerateRequest(request_id="a", prompt="x" * 5000))
    monkeypatch.setattr(M, "MAX_MESSAGE_BYTES", 4096)
    with pytest.raises(ProtocolError, match="exceeds the limit 4096"):
        decode(data)


def test_deep_msgpack_nesting_is_rejected():
    data = b"\x91" * 100_000 + b"\x00"  # [[[[...]]]] far deeper than any stack
    with pytest.raises(ProtocolError):
        decode(data)


def test_encode_refuses_what_decode_would_refuse():
    with pytest.raises(ProtocolError, match=r"tokens\[1\]: expected int"):
        encode(M.VerifyRequest(seq_id=1, tokens=[1, "2"], parents=[-1, 0]))
    with pytest.raises(ProtocolError, match="not one of"):
        encode(M.GenerateRequest(request_id="a", prompt="p", mode="beam"))
    with pytest.raises(ProtocolError, match="not a registered message type"):
        encode(object())
    with pytest.raises(ProtocolError, match="expected int"):
        encode(M.Ping(nonce=1.5))
