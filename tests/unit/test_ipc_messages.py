"""ipc.messages + ipc.codec: every message round-trips, the wire format is plain msgpack a
foreign client can speak, and everything malformed is one ProtocolError naming the field."""

from __future__ import annotations

import json
import math
import pickle

import msgpack
import msgspec
import pytest

from ipc import codec
from ipc import messages as M
from ipc.codec import MAX_MESSAGE_BYTES, ProtocolError, decode, encode
from ipc.tree import (
    MAX_DEPTH,
    MAX_TOP_K,
    MAX_TREE_TOKENS,
    ROOT_ONLY,
    TreeError,
    TreeShape,
    tree_depths,
    validate_parents,
)

RING = M.RingRef(ring="dovetail-1-abcd", slot=2, seq=7, rows=3, cols=16, dtype="float16")
STATS = M.RequestStats(new_tokens=2, cycles=1, tau=2.0, tokens_per_s=12.5, prefill_ms=3.25, draft_ms=1.0,
                       verify_ms=4.5, ipc_ms=0.5, wall_ms=160.0, accept_per_depth=[0, 1])

RINGS = M.RingNames(cycle="dovetail-1-cycle", prefill="dovetail-1-prefill")
TARGET_SETTINGS = M.TargetSettings(log_level="warning", max_len=4096, rings=RINGS, target="/models/llama",
                                   threads=8, cores=[0, 1, 2, 3, 4, 5, 6, 7], dtype="int8", aux_layers=[2, 16, 29],
                                   kv_dtype="bf16")
DRAFT_SETTINGS = M.DraftSettings(max_len=4096, rings=RINGS, draft="/models/head", target="/models/llama",
                                 device="cuda:0", dtype="fp16", scratch_len=80, row_width=12288,
                                 layout="EAGLE-3 rows of 3 x 4096")
TARGET_INFO = M.TargetInfo(threads=8, cores=[0, 1, 2, 3, 4, 5, 6, 7], max_len=4096, hidden_size=4096,
                           vocab_size=128256, dtype="int8", weight_bytes=7_000_000_000, kv_cache_bytes=536_870_912,
                           kv_dtype="bfloat16", exact_tree=True, kernel="dovetail-amx", feature_size=12288,
                           aux_layers=[2, 16, 29])
DRAFT_INFO = M.DraftInfo(device="cuda:0", dtype="float16", threads=1, cores=[8], layers=1, ring_pinned=True,
                         scratch_len=80, fusion="eagle3", feature_size=12288, draft_vocab_size=32000)

SAMPLES = [
    M.GenerateRequest(request_id="r1", prompt="def f(x):\n    return x é ☃", max_new_tokens=64,
                      stop=["\n\n", "###"], sampling=M.Sampling(temperature=0.8, top_k=50, top_p=0.95, seed=7),
                      mode="ar", stream=True),
    M.GenerateRequest(request_id="r2", prompt=""),
    M.Cancel(request_id="r1"),
    M.Ping(nonce=5),
    M.TokenChunk(request_id="r1", token_ids=[1, 2, 3], text="abc"),
    M.TokenChunk(request_id="r1", token_ids=[], text="tail"),
    M.GenerateDone(request_id="r1", token_ids=[5, 6], text="xy", finish_reason="length", stats=STATS),
    M.GenerateDone(request_id="r1", token_ids=[], text="", finish_reason="cancelled"),
    M.ErrorReply(request_id=None, code="bad_message", message="bad bytes"),
    M.ErrorReply(request_id="r2", code="prompt_too_long", message=""),
    M.Pong(nonce=-5),
    M.PrefillRequest(seq_id=9, token_ids=list(range(300)), sampling=M.Sampling(temperature=1.0, seed=None),
                     return_features=True),
    M.PrefillResult(seq_id=9, token=42, features=RING, compute_ms=12.5),
    M.PrefillResult(seq_id=9, token=42, features=None),
    M.VerifyRequest(seq_id=9, tokens=[4, 5, 6, 7], parents=[-1, 0, 0, 1]),
    M.VerifyResult(seq_id=9, accepted_tokens=[5, 8], features=RING, compute_ms=50.25),
    M.DecodeRequest(seq_id=9, token=17),
    M.DecodeResult(seq_id=9, token=18, compute_ms=23.0),
    M.ReleaseSequence(seq_id=9),
    M.DraftRequest(seq_id=9, tokens=[5, 8], features=RING, shape=TreeShape(tree_tokens=16, depth=6, top_k=8),
                   reset=True),
    M.DraftResult(seq_id=9, tokens=[8, 1, 2], parents=[-1, 0, 0], compute_ms=3.0),
    M.StepBatch(items=[M.DecodeRequest(seq_id=9, token=17),
                       M.VerifyRequest(seq_id=10, tokens=[5, 6], parents=[-1, 0])]),
    M.StepBatchResult(items=[M.DecodeResult(seq_id=9, token=18, compute_ms=23.0),
                             M.WorkerError(worker="cpu_worker", message="sequence 10 is not active", seq_id=10)],
                      compute_ms=23.0),
    M.DraftBatch(items=[M.DraftRequest(seq_id=9, tokens=[8], features=RING, shape=TreeShape(), reset=True),
                        M.DraftExtend(seq_id=10, tokens=[8, 9], features=RING, reset=True)]),
    M.DraftBatchResult(items=[M.DraftResult(seq_id=9, tokens=[8, 1], parents=[-1, 0]),
                              M.DraftExtended(seq_id=10, compute_ms=1.0)], compute_ms=3.0),
    M.DraftExtend(seq_id=9, tokens=[8, 9, 10], features=RING),
    M.DraftExtended(seq_id=9, compute_ms=2.0),
    M.MeasureVerifyCost(tree_sizes=[1, 2, 4, 64]),
    M.VerifyCost(tree_sizes=[1, 2], ms=[400.5, 460.0], cached=True, cache_path="/tmp/x.json"),
    M.MeasureDraftCost(depths=[1, 2, 3], top_k=8),
    M.DraftCost(depths=[1, 2], ms=[30.0, 61.5]),
    M.Ready(worker="cpu_worker", pid=1234, info=codec.encode_info(TARGET_INFO)),
    M.WorkerError(worker="gpu_worker", message="CUDA out of memory", seq_id=9, fatal=True),
    M.WorkerError(worker="gpu_worker", message="boom"),
    M.GenerateRequest(request_id="r3", messages=[M.ChatMessage(role="system", content="Be brief."),
                                                 M.ChatMessage(role="user", content="Hi ☃")], stream=True),
    M.MetricsRequest(),
    M.MetricsReply(finished={"stop": 3, "length": 1}, errors={"prompt_too_long": 2}, prompt_tokens=40,
                   new_tokens=90, cycles=30, cycle_tokens=86, prefill_s=0.5, draft_s=1.25, verify_s=2.0,
                   ipc_s=0.125, queue_depth=2, running=1, worker_restarts=1, uptime_s=12.5),
    M.Shutdown(),
    M.PrefillRequest(seq_id=9, token_ids=[5, 6, 7], offset=256, more=True),  # a prompt chunk
    M.PrefillPartial(seq_id=9, compute_ms=3.5, features=RING),
    M.PrefillRequest(seq_id=9, token_ids=[5, 6, 7], offset=256, more=True, budget_ms=12.5, resume=True),  # in parts
    M.PrefillPending(seq_id=9, layers_done=3, layers=30, compute_ms=11.0),
    M.DecodeRun(seq_id=9, token=17, steps=5, stop_ids=[2, 0]),
    M.DecodeRunResult(seq_id=9, tokens=[18, 19, 2], compute_ms=12.5),
]


def _wire(msg) -> dict:
    """The message as a plain msgpack map, the way a foreign client sees it."""
    return msgpack.unpackb(encode(msg))


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# --- round trip and wire format ---------------------------------------------------------


def test_samples_cover_every_message_type():
    assert {type(m) for m in SAMPLES} == set(M.ALL_MESSAGES)
    assert len({cls.__name__ for cls in M.ALL_MESSAGES}) == len(M.ALL_MESSAGES)
    for group in (M.CLIENT_TO_COORDINATOR, M.COORDINATOR_TO_CLIENT, M.TO_CPU_WORKER, M.FROM_CPU_WORKER,
                  M.TO_GPU_WORKER, M.FROM_GPU_WORKER):
        assert set(group) <= set(M.ALL_MESSAGES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    back = decode(data)
    assert back == msg and type(back) is type(msg)
    assert decode(data, allowed=(type(msg),)) == msg
    # Plain msgpack: a map with the class name as "type", the version, and every field.
    wire = msgpack.unpackb(data)
    assert isinstance(wire, dict)
    assert wire["type"] == type(msg).__name__ and wire["v"] == M.PROTOCOL_VERSION == 2
    assert set(wire) == {"type", *type(msg).__struct_fields__}


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_direction_sets_are_enforced(msg):
    data = encode(msg)
    for group in (M.CLIENT_TO_COORDINATOR, M.COORDINATOR_TO_CLIENT, M.TO_CPU_WORKER, M.FROM_CPU_WORKER,
                  M.TO_GPU_WORKER, M.FROM_GPU_WORKER):
        if type(msg) in group:
            assert decode(data, allowed=group) == msg
        else:
            with pytest.raises(ProtocolError, match=rf"Invalid value '{type(msg).__name__}' - at `\$\.type`"):
                decode(data, allowed=group)


def test_refused_type_names_what_is_accepted():
    accepted = r"'Shutdown'.*accepted here: GenerateRequest, Cancel, Ping, MetricsRequest\)"
    with pytest.raises(ProtocolError, match=accepted):
        decode(encode(M.Shutdown()), allowed=M.CLIENT_TO_COORDINATOR)


def test_nested_values_are_plain_maps_without_a_type_tag():
    wire = _wire(SAMPLES[0])
    assert wire["sampling"] == {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "seed": 7}
    wire = _wire(SAMPLES[6])
    assert wire["stats"] == msgspec.to_builtins(STATS) and "type" not in wire["stats"]
    wire = _wire(SAMPLES[19])
    assert wire["shape"] == {"tree_tokens": 16, "depth": 6, "top_k": 8}
    assert wire["features"] == {"ring": "dovetail-1-abcd", "slot": 2, "seq": 7, "rows": 3, "cols": 16,
                                "dtype": "float16"}
    back = decode(encode(SAMPLES[19]))
    assert isinstance(back.features, M.RingRef) and isinstance(back.shape, TreeShape)


def test_hand_built_plain_msgpack_decodes_with_defaults():
    # What a client in another language sends: only the required fields, "type" anywhere.
    msg = decode(_pack({"prompt": "hi", "request_id": "r", "type": "GenerateRequest"}),
                 allowed=M.CLIENT_TO_COORDINATOR)
    assert msg == M.GenerateRequest(request_id="r", prompt="hi")
    assert (msg.max_new_tokens, msg.stop, msg.mode, msg.stream, msg.v) == (128, [], None, False, 2)
    assert msg.sampling == M.Sampling() and msg.sampling.greedy
    # A partial nested map fills the rest from defaults; an int is accepted for a float.
    msg = decode(_pack({"type": "GenerateRequest", "v": 2, "request_id": "r", "prompt": "hi",
                        "sampling": {"temperature": 1, "seed": 3}}))
    assert msg.sampling == M.Sampling(temperature=1.0, seed=3) and type(msg.sampling.temperature) is float
    # Single-precision floats (what some msgpack libraries write) are fine.
    data = msgpack.packb({"type": "GenerateRequest", "request_id": "r", "prompt": "hi",
                          "sampling": {"temperature": 0.5, "top_p": 0.5}}, use_single_float=True)
    assert decode(data).sampling == M.Sampling(temperature=0.5, top_p=0.5)
    assert decode(_pack({"type": "Cancel", "request_id": "r"})) == M.Cancel(request_id="r")
    assert decode(_pack({"type": "Ping"})) == M.Ping(nonce=0)
    # A server message read the same way: ErrorReply's request_id is nullable but required.
    assert decode(_pack({"type": "ErrorReply", "request_id": None, "code": "bad_message", "message": "m"})) \
        == M.ErrorReply(request_id=None, code="bad_message", message="m")


def test_chat_messages_replace_the_prompt():
    msg = decode(_pack({"type": "GenerateRequest", "request_id": "r",
                        "messages": [{"role": "user", "content": "hi"}]}), allowed=M.CLIENT_TO_COORDINATOR)
    assert msg.prompt is None and msg.messages == [M.ChatMessage(role="user", content="hi")]
    for fields in ({}, {"prompt": "p", "messages": [{"role": "user", "content": "hi"}]}):
        with pytest.raises(ProtocolError, match="exactly one of prompt and messages"):
            decode(_pack({"type": "GenerateRequest", "request_id": "r", **fields}))
    for messages, pattern in (
            ([], r"Expected `array` of length >= 1"),
            ([{"role": "", "content": "x"}], r"Expected `str` of length >= 1 - at `\$\.messages\[0\]\.role`"),
            ([{"role": "user"}], r"missing required field `content` - at `\$\.messages\[0\]`"),
            ([{"role": "user", "content": "x", "name": "n"}], r"unknown field `name`")):
        with pytest.raises(ProtocolError, match=pattern):
            decode(_pack({"type": "GenerateRequest", "request_id": "r", "messages": messages}))


@pytest.mark.parametrize("v", [None, 2])
def test_version_is_optional_but_must_match(v):
    wire = {"type": "Cancel", "request_id": "r"}
    if v is not None:
        wire["v"] = v
    assert decode(_pack(wire)) == M.Cancel(request_id="r")


@pytest.mark.parametrize("v,pattern", [
    (1, "protocol version 1, this side speaks 2"),
    (3, "protocol version 3, this side speaks 2"),
    (True, r"Expected `int`, got `bool` - at `\$\.v`"),
    ("2", r"Expected `int`, got `str` - at `\$\.v`"),
    (2.0, r"Expected `int`, got `float` - at `\$\.v`"),
    (None, r"Expected `int`, got `None` - at `\$\.v`"),
])
def test_wrong_version_is_refused(v, pattern):
    with pytest.raises(ProtocolError, match=pattern):
        decode(_pack({"type": "Cancel", "request_id": "r", "v": v}))


def test_wrong_version_is_refused_on_construction_too():
    with pytest.raises(ValueError, match="protocol version 3"):
        M.Ping(v=3)


# --- strictness -------------------------------------------------------------------------

GEN = M.GenerateRequest(request_id="a", prompt="p")
CHUNK = M.TokenChunk(request_id="a", token_ids=[1], text="t")
DONE = M.GenerateDone(request_id="a", token_ids=[1], text="t", finish_reason="stop")
ERR = M.ErrorReply(request_id=None, code="c", message="m")
VREQ = M.VerifyRequest(seq_id=1, tokens=[1], parents=[-1])
VRES = M.VerifyResult(seq_id=1, accepted_tokens=[1], features=RING)
DREQ = M.DraftRequest(seq_id=1, tokens=[1], features=RING, shape=TreeShape())
PING = M.Ping(nonce=1)
RUN = M.DecodeRun(seq_id=1, token=5, steps=4)
RUNRES = M.DecodeRunResult(seq_id=1, tokens=[5])
DELETE = object()


def _set(wire: dict, path: str, value) -> None:
    """wire[a][b] = value for path "a.b"; DELETE removes the key."""
    *parents, last = path.split(".")
    for key in parents:
        wire = wire[key]
    if value is DELETE:
        del wire[last]
    else:
        wire[last] = value


BAD_VALUES = [
    # unknown and missing fields
    (GEN, "extra", 1, "unknown field `extra`"),
    (GEN, "sampling.temp", 1.0, r"unknown field `temp` - at `\$\.sampling`"),
    (DONE, "stats.bogus", 1, r"unknown field `bogus` - at `\$\.stats`"),
    (GEN, "request_id", DELETE, "missing required field `request_id`"),
    (GEN, "type", DELETE, "missing required field `type`"),
    (ERR, "request_id", DELETE, "missing required field `request_id`"),
    (VRES, "features.dtype", DELETE, r"missing required field `dtype` - at `\$\.features`"),
    # wrong types: a bool is not an int, a str is not a number, bin is not str
    (GEN, "max_new_tokens", True, r"Expected `int`, got `bool` - at `\$\.max_new_tokens`"),
    (GEN, "max_new_tokens", "5", r"Expected `int`, got `str` - at `\$\.max_new_tokens`"),
    (GEN, "max_new_tokens", 5.0, r"Expected `int`, got `float` - at `\$\.max_new_tokens`"),
    (GEN, "max_new_tokens", None, r"Expected `int`, got `None` - at `\$\.max_new_tokens`"),
    (GEN, "sampling.temperature", "0.5", r"Expected `float`, got `str` - at `\$\.sampling\.temperature`"),
    (GEN, "sampling.temperature", True, r"Expected `float`, got `bool` - at `\$\.sampling\.temperature`"),
    (GEN, "sampling.seed", "1", r"got `str` - at `\$\.sampling\.seed`"),
    (GEN, "stream", 1, r"Expected `bool`, got `int` - at `\$\.stream`"),
    (GEN, "prompt", b"bytes", r"Expected `str \| null`, got `bytes` - at `\$\.prompt`"),
    (GEN, "prompt", 5, r"Expected `str \| null`, got `int` - at `\$\.prompt`"),
    (GEN, "stop", "\n", r"Expected `array`, got `str` - at `\$\.stop`"),
    (GEN, "stop", ["ok", 3], r"Expected `str`, got `int` - at `\$\.stop\[1\]`"),
    (GEN, "sampling", [0.5, 0, 1.0, None], r"Expected `object`, got `array` - at `\$\.sampling`"),
    (GEN, "sampling", None, r"Expected `object`, got `None` - at `\$\.sampling`"),
    (CHUNK, "token_ids", [1, True], r"Expected `int`, got `bool` - at `\$\.token_ids\[1\]`"),
    (CHUNK, "token_ids", [1, 2.0], r"Expected `int`, got `float` - at `\$\.token_ids\[1\]`"),
    (DONE, "stats", [1, 2], r"Expected `object`, got `array` - at `\$\.stats`"),
    (VRES, "features", None, r"Expected `object`, got `None` - at `\$\.features`"),
    (ERR, "request_id", 5, r"got `int` - at `\$\.request_id`"),
    (PING, "nonce", 1.5, r"Expected `int`, got `float` - at `\$\.nonce`"),
    # sampling ranges
    (GEN, "sampling.temperature", math.nan, r"Expected `float` >= 0.0 - at `\$\.sampling\.temperature`"),
    (GEN, "sampling.temperature", math.inf, r"Expected `float` <= 1000.0 - at `\$\.sampling\.temperature`"),
    (GEN, "sampling.temperature", -math.inf, r"Expected `float` >= 0.0 - at `\$\.sampling\.temperature`"),
    (GEN, "sampling.temperature", -0.1, r"Expected `float` >= 0.0 - at `\$\.sampling\.temperature`"),
    (GEN, "sampling.temperature", 1000.5, r"Expected `float` <= 1000.0 - at `\$\.sampling\.temperature`"),
    (GEN, "sampling.temperature", 1e-6,
     r"temperature must be 0 \(greedy\) or >= 1e-05, got 1e-06 - at `\$\.sampling`"),
    # below fp32's range: softmax(logits / T) would be inf/NaN, so they never reach a worker
    (GEN, "sampling.temperature", 1e-40, r"temperature must be 0 \(greedy\) or >= 1e-05, got 1e-40"),
    (GEN, "sampling.temperature", 5e-324, r"temperature must be 0 \(greedy\) or >= 1e-05, got 5e-324"),
    (GEN, "deadline_ms", 0, r"Expected `int` >= 1 - at `\$\.deadline_ms`"),
    (GEN, "deadline_ms", 1.5, r"Expected `int \| null`, got `float` - at `\$\.deadline_ms`"),
    (GEN, "deadline_ms", 1 << 31, r"Expected `int` <= 2147483647 - at `\$\.deadline_ms`"),
    (GEN, "sampling.top_p", 0, r"Expected `float` > 0.0 - at `\$\.sampling\.top_p`"),
    (GEN, "sampling.top_p", 0.0, r"Expected `float` > 0.0 - at `\$\.sampling\.top_p`"),
    (GEN, "sampling.top_p", 1.5, r"Expected `float` <= 1.0 - at `\$\.sampling\.top_p`"),
    (GEN, "sampling.top_p", math.nan, r"at `\$\.sampling\.top_p`"),
    (GEN, "sampling.top_k", -1, r"Expected `int` >= 0 - at `\$\.sampling\.top_k`"),
    (GEN, "sampling.top_k", 1 << 31, r"Expected `int` <= 2147483647 - at `\$\.sampling\.top_k`"),
    (GEN, "sampling.seed", -1, r"Expected `int` >= 0 - at `\$\.sampling\.seed`"),
    (GEN, "sampling.seed", 1 << 63, r"Expected `int` <= 9223372036854775807 - at `\$\.sampling\.seed`"),
    # other ranges and enums
    (GEN, "max_new_tokens", 0, r"Expected `int` >= 1 - at `\$\.max_new_tokens`"),
    (GEN, "max_new_tokens", (1 << 20) + 1, r"Expected `int` <= 1048576 - at `\$\.max_new_tokens`"),
    (GEN, "mode", "beam", r"Invalid enum value 'beam' - at `\$\.mode`"),
    (DONE, "finish_reason", "eos", r"Invalid enum value 'eos' - at `\$\.finish_reason`"),
    (DONE, "stats.new_tokens", -1, r"Expected `int` >= 0 - at `\$\.stats\.new_tokens`"),
    (CHUNK, "token_ids", [1, 1 << 31], r"Expected `int` <= 2147483647 - at `\$\.token_ids\[1\]`"),
    (CHUNK, "token_ids", [-1], r"Expected `int` >= 0 - at `\$\.token_ids\[0\]`"),
    (VREQ, "parents", [-2], r"Expected `int` >= -1 - at `\$\.parents\[0\]`"),
    (VREQ, "parents", [MAX_TREE_TOKENS], rf"Expected `int` <= {MAX_TREE_TOKENS - 1} - at `\$\.parents\[0\]`"),
    (VREQ, "seq_id", -1, r"Expected `int` >= 0 - at `\$\.seq_id`"),
    (VRES, "features.seq", 0, r"Expected `int` >= 1 - at `\$\.features\.seq`"),
    (VRES, "features.dtype", "int8", r"Invalid enum value 'int8' - at `\$\.features\.dtype`"),
    (DREQ, "shape.top_k", 0, r"Expected `int` >= 1 - at `\$\.shape\.top_k`"),
    (RUN, "steps", 0, r"Expected `int` >= 1 - at `\$\.steps`"),
    (RUN, "steps", M.MAX_RUN_STEPS + 1, rf"Expected `int` <= {M.MAX_RUN_STEPS} - at `\$\.steps`"),
    (RUN, "stop_ids", [-1], r"Expected `int` >= 0 - at `\$\.stop_ids\[0\]`"),
    (RUNRES, "tokens", [], r"Expected `array` of length >= 1 - at `\$\.tokens`"),
    (DREQ, "shape.tree_tokens", MAX_TREE_TOKENS + 1,
     rf"Expected `int` <= {MAX_TREE_TOKENS} - at `\$\.shape\.tree_tokens`"),
    # too-long strings and lists
    (GEN, "request_id", "", r"Expected `str` of length >= 1 - at `\$\.request_id`"),
    (GEN, "request_id", "x" * 257, r"Expected `str` of length <= 256 - at `\$\.request_id`"),
    (GEN, "stop", ["x"] * 65, r"Expected `array` of length <= 64 - at `\$\.stop`"),
    (GEN, "stop", ["x" * 1025], r"Expected `str` of length <= 1024 - at `\$\.stop\[0\]`"),
    (GEN, "stop", [""], r"Expected `str` of length >= 1 - at `\$\.stop\[0\]`"),
    (ERR, "code", "c" * 65, r"Expected `str` of length <= 64 - at `\$\.code`"),
    (VREQ, "tokens", [1] * (MAX_TREE_TOKENS + 1),
     rf"Expected `array` of length <= {MAX_TREE_TOKENS} - at `\$\.tokens`"),
    # extension types are never data
    (GEN, "prompt", msgpack.ExtType(5, b"x"), r"Expected `str \| null`, got `ext` - at `\$\.prompt`"),
    (GEN, "sampling.seed", msgpack.ExtType(1, b"x"), r"got `ext` - at `\$\.sampling\.seed`"),
    (CHUNK, "token_ids", [msgpack.ExtType(1, b"x")], r"got `ext` - at `\$\.token_ids\[0\]`"),
    (GEN, "prompt", msgpack.Timestamp(1, 0), r"Expected `str \| null`, got `ext` - at `\$\.prompt`"),
]


def _row_id(row) -> str:
    base, path, value, _ = row
    shown = "DELETE" if value is DELETE else repr(value)
    return f"{type(base).__name__}.{path}={shown[:20]}"


@pytest.mark.parametrize("base,path,value,pattern", BAD_VALUES, ids=[_row_id(r) for r in BAD_VALUES])
def test_bad_field_values_are_refused(base, path, value, pattern):
    wire = _wire(base)
    decode(_pack(wire))  # the untouched sample is fine: the change below is what is refused
    _set(wire, path, value)
    with pytest.raises(ProtocolError, match=pattern):
        decode(_pack(wire))


@pytest.mark.parametrize("field,size,limit", [
    ("token_ids", (1 << 20) + 1, 1 << 20),  # a whole prompt's worth of ids, plus one
    ("text", 16 * 1024 * 1024 + 1, 16 * 1024 * 1024),
])
def test_huge_lists_and_strings_are_refused(field, size, limit):
    wire = _wire(CHUNK)
    wire[field] = [1] * size if field == "token_ids" else "x" * size
    with pytest.raises(ProtocolError, match=rf"of length <= {limit} - at `\$\.{field}`"):
        decode(_pack(wire))
    wire[field] = [1] * limit if field == "token_ids" else "x" * limit
    assert len(getattr(decode(_pack(wire)), field)) == limit  # the limit itself is fine


def test_limits_at_their_edges_are_accepted():
    msg = decode(_pack({"type": "GenerateRequest", "request_id": "x" * 256, "prompt": "p", "max_new_tokens": 1 << 20,
                        "stop": ["s" * 1024] * 64,
                        "sampling": {"temperature": M.MIN_TEMPERATURE, "top_k": (1 << 31) - 1, "top_p": 1.0,
                                     "seed": (1 << 63) - 1}}))
    assert msg.sampling.temperature == M.MIN_TEMPERATURE and not msg.sampling.greedy
    assert decode(_pack({**_wire(GEN), "sampling": {"temperature": 1000.0}})).sampling.temperature == 1000.0
    assert decode(_pack({**_wire(CHUNK), "token_ids": [0, (1 << 31) - 1]})).token_ids == [0, (1 << 31) - 1]
    assert decode(_pack({**_wire(GEN), "deadline_ms": (1 << 31) - 1})).deadline_ms == (1 << 31) - 1
    assert decode(_pack({**_wire(GEN), "deadline_ms": None})).deadline_ms is None


@pytest.mark.parametrize("obj", [[1, 2], 5, "Ping", None, b"x", 1.5, True, msgpack.ExtType(5, b"x")],
                         ids=["array", "int", "str", "nil", "bin", "float", "bool", "ext"])
def test_non_map_top_level_is_refused(obj):
    with pytest.raises(ProtocolError, match="Expected `object`"):
        decode(_pack(obj))


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x81\xa4type\xa4Pi", b"\x81\xa1v", b"\x83\xa4type\xa6Cancel\xaarequest_id\xa2\xff\xfe",
    _pack({"type": "Ping", "nonce": 1}) + b"trailing",
], ids=["empty", "reserved-byte", "truncated-str", "truncated-map", "invalid-utf8", "trailing"])
def test_garbage_bytes_are_refused(data):
    with pytest.raises(ProtocolError, match="not a valid msgpack message"):
        decode(data)


@pytest.mark.parametrize("data", [b"garbage bytes here", bytes(range(256)), b"\x00" * 10, b"\x92\x01"])
def test_other_garbage_is_refused(data):
    with pytest.raises(ProtocolError):
        decode(data)


_PICKLE_RAN = []


def _mark():
    _PICKLE_RAN.append(True)


class _Evil:
    def __reduce__(self):
        return (_mark, ())


def test_pickle_is_refused_and_never_executed():
    for payload in (pickle.dumps(_Evil()), pickle.dumps({"type": "Ping", "nonce": 1}),
                    pickle.dumps(_Evil(), protocol=0)):
        with pytest.raises(ProtocolError):
            decode(payload)
    assert _PICKLE_RAN == []


@pytest.mark.parametrize("allowed", [M.ALL_MESSAGES, M.CLIENT_TO_COORDINATOR], ids=["all", "client"])
@pytest.mark.parametrize("data", [
    b"\x91" * 200_000 + b"\x00",  # [[[[...]]]] as the whole message
    b"\x82\xa1x" + b"\x91" * 200_000 + b"\x00" + b"\xa4type\xa4Ping",  # in an unknown field before the tag
    b"\x82\xa1x" + b"\x81\xa1a" * 200_000 + b"\x00" + b"\xa4type\xa4Ping",  # nested maps
    b"\x84\xa4type\xa5Ready\xa6worker\xa1c\xa3pid\x01\xa4info\x81\xa1a" + b"\x91" * 200_000 + b"\x00",  # Raw field
], ids=["top", "unknown-field", "maps", "raw-field"])
def test_deep_nesting_is_refused_not_a_crash(data, allowed):
    # Far deeper than the interpreter's stack: must be a ProtocolError (which the server
    # answers), never a RecursionError escaping the receive loop.
    with pytest.raises(ProtocolError):
        decode(data, allowed=allowed)


def test_message_size_limit():
    assert MAX_MESSAGE_BYTES == 64 * 1024 * 1024
    with pytest.raises(ProtocolError, match=f"of {MAX_MESSAGE_BYTES + 1} bytes exceeds the limit {MAX_MESSAGE_BYTES}"):
        decode(bytearray(MAX_MESSAGE_BYTES + 1))


def test_message_size_limit_is_read_at_call_time(monkeypatch):
    data = encode(M.GenerateRequest(request_id="a", prompt="x" * 5000))
    assert decode(data).prompt == "x" * 5000
    monkeypatch.setattr(codec, "MAX_MESSAGE_BYTES", 4096)
    with pytest.raises(ProtocolError, match="exceeds the limit 4096"):
        decode(data)
    with pytest.raises(ProtocolError, match="exceeds the limit 4096"):
        decode(memoryview(data))


def test_unknown_type_names_are_refused():
    for name in ("Nope", "__class__", "Message", "Sampling", "RingRef", "TreeShape", "generaterequest"):
        with pytest.raises(ProtocolError, match=rf"Invalid value '{name}' - at `\$\.type`"):
            decode(_pack({"type": name, "request_id": "a"}))
    with pytest.raises(ProtocolError, match=r"Expected `str`, got `int` - at `\$\.type`"):
        decode(_pack({"type": 3, "request_id": "a"}))


def test_protocol_error_is_a_value_error_with_a_peer():
    error = ProtocolError("x", peer=b"id")
    assert isinstance(error, ValueError) and error.peer == b"id"
    assert ProtocolError("x").peer is None


# --- encode -----------------------------------------------------------------------------


def test_encode_refuses_what_the_receiver_would_refuse():
    # msgspec checks Meta ranges only when decoding: these construct, but do not encode.
    bad = M.GenerateRequest(request_id="a", prompt="p", max_new_tokens=0)
    with pytest.raises(ProtocolError,
                       match=r"GenerateRequest would be refused: Expected `int` >= 1 - at `\$\.max_new_tokens`"):
        encode(bad)
    with pytest.raises(ProtocolError, match=r"Expected `int`, got `str` - at `\$\.tokens\[1\]`"):
        encode(M.VerifyRequest(seq_id=1, tokens=[1, "2"], parents=[-1, 0]))
    with pytest.raises(ProtocolError, match=r"Invalid enum value 'beam' - at `\$\.mode`"):
        encode(M.GenerateRequest(request_id="a", prompt="p", mode="beam"))
    with pytest.raises(ProtocolError, match=r"length >= 1 - at `\$\.request_id`"):
        encode(M.Cancel(request_id=""))
    with pytest.raises(ProtocolError, match=r"Expected `int`, got `float` - at `\$\.nonce`"):
        encode(M.Ping(nonce=1.5))
    mutated = M.Cancel(request_id="a")
    mutated.v = 3
    with pytest.raises(ProtocolError, match="protocol version 3"):
        encode(mutated)


def test_encode_refuses_what_msgpack_cannot_carry():
    with pytest.raises(ProtocolError, match="Ping cannot be encoded"):
        encode(M.Ping(nonce=1 << 70))
    with pytest.raises(ProtocolError, match="TargetInfo would be refused"):
        codec.encode_info(msgspec.structs.replace(TARGET_INFO, cores=[object()]))


@pytest.mark.parametrize("thing", [object(), M.Sampling(), RING, TreeShape(), {"type": "Ping"}],
                         ids=["object", "Sampling", "RingRef", "TreeShape", "dict"])
def test_encode_takes_only_top_level_messages(thing):
    with pytest.raises(ProtocolError, match="is not a message type"):
        encode(thing)


def test_tuples_encode_as_lists():
    msg = M.VerifyRequest(seq_id=1, tokens=(1, 2), parents=(-1, 0))
    assert decode(encode(msg)) == M.VerifyRequest(seq_id=1, tokens=[1, 2], parents=[-1, 0])


# --- Sampling ---------------------------------------------------------------------------


def test_sampling_rules_on_construction():
    assert M.Sampling().greedy and M.Sampling(temperature=0.0).greedy
    assert not M.Sampling(temperature=M.MIN_TEMPERATURE).greedy
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or >= 1e-05"):
        M.Sampling(temperature=M.MIN_TEMPERATURE / 2)
    with pytest.raises(AttributeError):
        M.Sampling().temperature = 1.0  # frozen: shared defaults cannot be changed in place
    first, second = M.GenerateRequest(request_id="a", prompt="p"), M.GenerateRequest(request_id="b", prompt="p")
    assert first.sampling == second.sampling and first.sampling is not second.sampling


# --- TreeShape --------------------------------------------------------------------------


def test_tree_shape_defaults_and_derived_sizes():
    shape = TreeShape()
    assert (shape.tree_tokens, shape.depth, shape.top_k) == (16, 6, 8)
    assert shape.scratch_slots == (6 - 1) * 8 and shape.feature_rows == 7
    assert TreeShape(tree_tokens=8, depth=3, top_k=3).scratch_slots == 6
    assert TreeShape(tree_tokens=2, depth=1, top_k=4).scratch_slots == 0
    assert TreeShape(tree_tokens=1, depth=0, top_k=1) == ROOT_ONLY
    assert ROOT_ONLY.scratch_slots == 0 and ROOT_ONLY.feature_rows == 1
    with pytest.raises(AttributeError):
        shape.depth = 2  # frozen


@pytest.mark.parametrize("tree_tokens,depth,top_k,expect_depth", [
    (5, 8, 4, 4), (16, 6, 4, 6), (16, 15, 2, 15), (16, 40, 2, 15), (1, 3, 2, 0), (2, 1, 1, 1),
    (MAX_TREE_TOKENS, MAX_DEPTH, MAX_TOP_K, MAX_DEPTH),
])
def test_tree_shape_clamped_caps_depth_at_t_minus_1(tree_tokens, depth, top_k, expect_depth):
    shape = TreeShape.clamped(tree_tokens, depth, top_k)
    assert shape == TreeShape(tree_tokens=tree_tokens, depth=expect_depth, top_k=top_k)


@pytest.mark.parametrize("args,pattern", [
    ((16, 0, 8), r"depth must be in 1\.\.64, got 0"),
    ((0, 3, 2), "tree size T must be in 1..1024"),
    ((MAX_TREE_TOKENS + 1, 3, 2), "tree size T must be in 1..1024"),
    ((4, 2, 0), "top_k must be in 1..64"),
    ((4, 2, MAX_TOP_K + 1), "top_k must be in 1..64"),
    ((200, MAX_DEPTH + 1, 2), r"depth must be in 1\.\.64, got 65"),
])
def test_tree_shape_clamped_refuses_what_it_cannot_fix(args, pattern):
    with pytest.raises(TreeError, match=pattern):
        TreeShape.clamped(*args)


@pytest.mark.parametrize("fields", [
    dict(tree_tokens=4, depth=6, top_k=2),  # depth > T - 1
    dict(tree_tokens=16, depth=0, top_k=8),  # depth 0 only with T = 1
    dict(tree_tokens=1, depth=1, top_k=1),
    dict(tree_tokens=200, depth=MAX_DEPTH + 1, top_k=2),
    dict(tree_tokens=0, depth=0, top_k=1),
    dict(tree_tokens=16, depth=6, top_k=0),
])
def test_inconsistent_tree_shape_is_refused_on_construction_and_decode(fields):
    with pytest.raises(TreeError):
        TreeShape(**fields)
    wire = _wire(DREQ)
    wire["shape"] = fields
    with pytest.raises(ProtocolError, match=r"at `\$\.shape"):
        decode(_pack(wire))


def test_tree_shape_inconsistency_message_on_decode():
    wire = _wire(DREQ)
    wire["shape"] = {"tree_tokens": 4, "depth": 6, "top_k": 2}
    with pytest.raises(ProtocolError, match=r"depth 6 does not fit T=4.* - at `\$\.shape`"):
        decode(_pack(wire))


def test_tree_shape_fitted_to_the_room_left():
    shape = TreeShape(tree_tokens=16, depth=6, top_k=8)
    assert shape.fitted(16) is shape and shape.fitted(1000) is shape
    assert shape.fitted(10) == TreeShape(tree_tokens=10, depth=6, top_k=8)
    assert shape.fitted(5) == TreeShape(tree_tokens=5, depth=4, top_k=8)
    assert shape.fitted(2) == TreeShape(tree_tokens=2, depth=1, top_k=8)
    assert shape.fitted(1) is ROOT_ONLY
    for room in range(1, 20):
        fitted = shape.fitted(room)
        assert fitted.tree_tokens <= room and fitted.depth <= shape.depth and fitted.top_k <= shape.top_k
    with pytest.raises(TreeError, match="no room left"):
        shape.fitted(0)
    assert ROOT_ONLY.fitted(1) is ROOT_ONLY


def test_tree_shape_has_no_type_tag_and_refuses_unknown_fields():
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(TreeShape()), type=TreeShape) == TreeShape()
    wire = _wire(DREQ)
    wire["shape"]["width"] = 3
    with pytest.raises(ProtocolError, match=r"unknown field `width` - at `\$\.shape`"):
        decode(_pack(wire))


def test_compact_tree_rules():
    validate_parents([-1])
    validate_parents([-1, 0, 0, 1, 3])
    assert tree_depths([-1, 0, 0, 1, 3]) == [0, 1, 1, 2, 3]
    for parents, pattern in (([], "at least its root"), ([0], "parent -1"), ([-1, 1], "node 1 has parent 1"),
                             ([-1, 0, 3, 0], "node 2 has parent 3"), ([-1, -1], "node 1 has parent -1")):
        with pytest.raises(TreeError, match=pattern):
            validate_parents(parents)


# --- worker settings (a worker's --settings JSON) and ready info (Ready.info) ---------------


@pytest.mark.parametrize("settings", [TARGET_SETTINGS, DRAFT_SETTINGS,
                                      M.TargetSettings(max_len=2, rings=RINGS, target="t")],
                         ids=["target", "draft", "target-defaults"])
def test_worker_settings_round_trip_as_json(settings):
    text = codec.encode_settings(settings)
    assert json.loads(text) == msgspec.to_builtins(settings)  # a JSON object, every field by name
    back = codec.decode_settings(text, type(settings))
    assert back == settings and type(back) is type(settings)


def test_settings_left_out_take_what_a_worker_assumed_before():
    rings = '"rings": {"cycle": "c", "prefill": "p"}'
    target = codec.decode_settings(f'{{"max_len": 64, {rings}, "target": "/t"}}', M.TargetSettings)
    assert (target.log_level, target.dtype, target.kv_dtype, target.threads, target.cores, target.aux_layers) == (
        "info", "fp32", "auto", None, None, [])
    draft = codec.decode_settings(f'{{"max_len": 64, {rings}, "draft": "/d", "scratch_len": 8}}', M.DraftSettings)
    assert (draft.target, draft.device, draft.dtype, draft.row_width, draft.layout) == (None, "auto", "auto", None,
                                                                                        None)


RINGS_JSON = '"rings": {"cycle": "c", "prefill": "p"}'


@pytest.mark.parametrize(("text", "error"), [
    (f'{{"max_len": 64, {RINGS_JSON}}}', r"invalid TargetSettings: Object missing required field `target`$"),
    (f'{{"max_len": "64", {RINGS_JSON}, "target": "t"}}', r"Expected `int`, got `str` - at `\$\.max_len`"),
    (f'{{"max_len": 0, {RINGS_JSON}, "target": "t"}}', r"Expected `int` >= 1 - at `\$\.max_len`"),
    (f'{{"max_len": 64, {RINGS_JSON}, "target": "t", "thread": 2}}', r"Object contains unknown field `thread`"),
    ('{"max_len": 64, "rings": {"cycle": "c"}, "target": "t"}',
     r"Object missing required field `prefill` - at `\$\.rings`"),
    (f'{{"max_len": 64, {RINGS_JSON}, "target": "t", "threads": 0}}', r"Expected `int` >= 1 - at `\$\.threads`"),
    (f'{{"max_len": 64, {RINGS_JSON}, "target": "t", "cores": [-1]}}',
     r"Expected `int` >= 0 - at `\$\.cores\[0\]`"),
    (f'{{"max_len": 64, {RINGS_JSON}, "target": ""}}', r"Expected `str` of length >= 1 - at `\$\.target`"),
    ('["max_len", 64]', r"invalid TargetSettings: Expected `object`, got `array`"),
    ('{"max_len": 64', r"TargetSettings is not valid JSON"),
    ("", r"TargetSettings is not valid JSON"),
], ids=["missing", "type", "range", "unknown", "nested", "threads", "cores", "empty-folder", "array", "cut", "empty"])
def test_malformed_worker_settings_are_refused_naming_the_field(text, error):
    with pytest.raises(ProtocolError, match=error):
        codec.decode_settings(text, M.TargetSettings)


def test_settings_a_worker_would_refuse_are_never_sent():
    with pytest.raises(ProtocolError, match=r"TargetSettings would be refused: Expected `int` >= 1 - at `\$\.threads`"):
        codec.encode_settings(msgspec.structs.replace(TARGET_SETTINGS, threads=0))
    with pytest.raises(ProtocolError, match=r"DraftSettings would be refused: .* at `\$\.scratch_len`"):
        codec.encode_settings(msgspec.structs.replace(DRAFT_SETTINGS, scratch_len="80"))


@pytest.mark.parametrize(("info", "group"), [(TARGET_INFO, M.FROM_CPU_WORKER), (DRAFT_INFO, M.FROM_GPU_WORKER)],
                         ids=["target", "draft"])
def test_ready_info_round_trips_as_a_plain_map(info, group):
    ready = M.Ready(worker="w", pid=7, info=codec.encode_info(info))
    back = decode(encode(ready), group)
    assert isinstance(back, M.Ready) and codec.decode_info(back.info, type(info)) == info
    # On the wire: the plain map a worker's info always was, its keys in declaration order.
    wire = _wire(ready)["info"]
    assert wire == msgspec.to_builtins(info) and list(wire) == list(type(info).__struct_fields__)


def test_ready_info_of_another_worker_or_malformed_is_refused():
    with pytest.raises(ProtocolError, match=r"invalid TargetInfo: Object contains unknown field `device`"):
        codec.decode_info(codec.encode_info(DRAFT_INFO), M.TargetInfo)
    with pytest.raises(ProtocolError, match=r"invalid DraftInfo: Object missing required field `device`"):
        codec.decode_info(M.Ready(worker="w", pid=1).info, M.DraftInfo)  # a Ready without its info
    bad = {**msgspec.to_builtins(DRAFT_INFO), "ring_pinned": 1}
    with pytest.raises(ProtocolError, match=r"Expected `bool`, got `int` - at `\$\.ring_pinned`"):
        codec.decode_info(msgspec.Raw(_pack(bad)), M.DraftInfo)
    with pytest.raises(ProtocolError, match="DraftInfo is not valid msgpack"):
        codec.decode_info(msgspec.Raw(b"\xc1"), M.DraftInfo)
    with pytest.raises(ProtocolError, match=r"TargetInfo would be refused: Expected `int` >= 0 - at `\$\.threads`"):
        codec.encode_info(msgspec.structs.replace(TARGET_INFO, threads=-1))
