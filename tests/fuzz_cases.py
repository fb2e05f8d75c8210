"""Malformed client input for tests/system/test_fuzz.py, made deterministically from a seeded RNG.

Each case carries what the server must answer, known by construction: a case is a valid message
or body with exactly one thing wrong (so the first error found is that one), bytes that cannot
be a message at all, or a valid message with random bytes changed (then either its own answer
or bad_message). Values that are extreme but valid ride along only with a prompt the server
refuses before running it, and garbled messages are of kinds that never run: no case makes the
model generate.

ZMQ: one case is the frames of one ZeroMQ message and the reply labels it may get (an ErrorReply's
code, or a reply type's name). HTTP: one case is a request and the status and error codes it may get.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack

from dovetail_runtime.http_server import body_limit

NAN, INF = float("nan"), float("inf")
U64, I64 = 2**64 - 1, -(2**63)  # the largest and smallest ints msgpack carries
# The demo target: context 2048 tokens, tokens of at most 64 characters.
DEMO_PROMPT_CHARS = 2048 * 64
# Over the character bound: refused by its length, untokenized.
LONG_TEXT = "def f(x):\n    return x\n" * (DEMO_PROMPT_CHARS // 23 + 1)
# 50,002 tokens in fewer characters than the bound: tokenized, then refused by its token count.
TOKENS_50K = "a " * 50_000
BODY_LIMIT = body_limit(DEMO_PROMPT_CHARS)  # the largest HTTP body the demo server reads


# --- ZMQ ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZmqCase:
    kind: str
    frames: list[bytes]
    expect: frozenset[str]
    request_id: str | None = None  # the id an answer that names one must carry


BAD = frozenset({"bad_message"})


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def raw_map(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """A msgpack map from packed keys and values (for what msgpack.packb will not build)."""
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(key + value for key, value in pairs)


def generate_base(request_id: str) -> dict[str, Any]:
    return {"type": "GenerateRequest", "v": 2, "request_id": request_id, "prompt": "def f(x):",
            "max_new_tokens": 4, "sampling": {"temperature": 0.0}}


# Values that are wrong for a field, one field at a time. The field's own valid values are absent.
FIELD_BAD: dict[str, list[Any]] = {
    "type": ["", "generaterequest", "GenerateDone", "TokenChunk", "ErrorReply", "Pong", "MetricsReply",
             "PrefillRequest", "VerifyRequest", "Shutdown", "Ready", 1, None, b"GenerateRequest",
             ["GenerateRequest"], "GenerateRequest\x00"],
    "v": [0, 1, 3, -1, U64, I64, 2.0, "2", None, True, [2]],
    "request_id": ["", "x" * 257, 0, None, b"id", [], {}, True, 1.5, U64],
    "prompt": [0, 1.5, True, b"bytes", [], ["a"], {}, {"text": "a"}, NAN],
    "max_new_tokens": [0, -1, 2**20 + 1, U64, I64, 4.0, NAN, INF, -INF, "4", True, None, [4]],
    "stop": ["\n", [""], ["x" * 1025], ["a"] * 65, [1], [None], None, {"a": 1}, [b"x"], [["x"]]],
    "sampling": [None, [], "greedy", 0, {"temperature": -1.0}, {"temperature": NAN}, {"temperature": INF},
                 {"temperature": -INF}, {"temperature": 1000.5}, {"temperature": 1e-6}, {"temperature": 5e-324},
                 {"temperature": "0"}, {"temperature": True}, {"temperature": None}, {"top_k": -1},
                 {"top_k": 2**31}, {"top_k": U64}, {"top_k": 1.5}, {"top_p": 0.0}, {"top_p": -0.5},
                 {"top_p": 1.0000001}, {"top_p": NAN}, {"top_p": INF}, {"top_p": I64}, {"seed": -1},
                 {"seed": 2**63}, {"seed": U64}, {"seed": 1.0}, {"typical_p": 0.5},
                 {"temperature": 0.5, "extra": 1}, {"type": "Sampling"}],
    "mode": ["", "fast", "AR", "Dovetail", 1, True, []],
    "stream": [0, 1, "true", None, [], 1.0],
    "deadline_ms": [0, -1, 2**31, U64, I64, 1.5, NAN, INF, "10", True],
}
MESSAGES_BAD: list[Any] = [[], "hi", [{}], [{"role": "", "content": "x"}], [{"role": "u"}],
                           [{"content": "x"}], [{"role": "u", "content": 1}], [{"role": "u", "content": None}],
                           [{"role": "u", "content": "x", "name": "n"}], [["user", "x"]],
                           [{"role": "x" * 65, "content": "x"}], [{"role": "u", "content": "x"}] * 16385, [None],
                           {"role": "u", "content": "x"}]
# Extreme values the schema allows: sent only with a prompt refused before it runs.
EXTREME_VALID: dict[str, list[Any]] = {
    "max_new_tokens": [1, 2**20],
    "stop": [["x" * 1024] * 64, ["\x00"], ["☃"]],
    "sampling": [{"temperature": 1000.0, "top_k": 2**31 - 1, "top_p": 5e-324, "seed": 2**63 - 1},
                 {"temperature": 1e-5, "top_p": 1.0, "seed": 0}, {}],
    "mode": ["ar", "dovetail", None],
    "stream": [True, False],
    "deadline_ms": [2**31 - 1, None],
    "request_id": ["x" * 256, "☃", "\x00"],
}


def _unknown_name(rng: random.Random) -> str:
    return "x_" + "".join(rng.choice(string.ascii_lowercase + "_") for _ in range(rng.randint(1, 24)))


def _any_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "big", "float", "str", "bytes", "none", "bool", "list", "map", "ext"]
    kind = rng.choice(kinds if depth < 3 else kinds[:7])
    if kind == "int":
        return rng.randint(-1000, 1000)
    if kind == "big":
        return rng.choice([U64, I64, 2**32, -(2**31) - 1])
    if kind == "float":
        return rng.choice([NAN, INF, -INF, 0.0, -0.0, 5e-324, 1e308, rng.uniform(-1e6, 1e6)])
    if kind == "str":
        return "".join(rng.choice(string.printable + "☃é\x00") for _ in range(rng.randint(0, 40)))
    if kind == "bytes":
        return rng.randbytes(rng.randint(0, 40))
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [_any_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "map":
        return {_unknown_name(rng): _any_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return msgpack.ExtType(rng.randint(0, 127), rng.randbytes(rng.randint(0, 8)))


def _field_mutation(rng: random.Random, rid: str) -> ZmqCase:
    """One field of a GenerateRequest wrong; the other fields valid, some at their extremes."""
    message = generate_base(rid)
    name = rng.choice([*FIELD_BAD, "messages", "missing", "unknown", "neither", "both"])
    if name == "messages":
        del message["prompt"]
        message["messages"] = rng.choice(MESSAGES_BAD)
    elif name == "missing":
        del message[rng.choice(["type", "request_id"])]
    elif name == "unknown":
        message[_unknown_name(rng)] = _any_value(rng)
    elif name == "neither":
        message["prompt"] = None
    elif name == "both":
        message["messages"] = [{"role": "user", "content": "x"}]
    else:
        message[name] = rng.choice(FIELD_BAD[name])
    items = list(message.items())
    rng.shuffle(items)  # key order does not matter to the server
    return ZmqCase(f"field:{name}", [pack(dict(items))], BAD)


def _other_message_mutation(rng: random.Random, rid: str) -> ZmqCase:
    message = rng.choice([{"type": "Cancel", "request_id": rng.choice(["", "x" * 257, 5, None, b"id", []])},
                          {"type": "Cancel"},
                          {"type": "Ping", "nonce": rng.choice([1.5, "1", None, [], NAN, b"1", True])},
                          {"type": "Ping", "nonce": 1, _unknown_name(rng): 1},
                          {"type": "MetricsRequest", _unknown_name(rng): _any_value(rng)},
                          {"type": rng.choice(["Ping", "Cancel", "MetricsRequest"]), "v": rng.choice([1, 3, "2"])}])
    return ZmqCase("other-message", [pack(message)], BAD)


def _random_bytes(rng: random.Random, rid: str) -> ZmqCase:
    size = rng.choice([0, 1, 2, 3, rng.randint(4, 64), rng.randint(65, 4096)])
    data = rng.randbytes(size)
    if data[:1] and 0x80 <= data[0] <= 0x8F or data[:1] in (b"\xde", b"\xdf"):  # a map: keep it garbage
        data = b"\xc1" + data[1:]
    return ZmqCase("random-bytes", [data], BAD)


def _valid_messages(rid: str) -> list[tuple[dict[str, Any], str]]:
    """Valid client messages, and the reply each gets: all cheap (refused before running, or no model)."""
    long_request = {**generate_base(rid), "prompt": LONG_TEXT}
    chat = {**generate_base(rid), "messages": [{"role": "user", "content": "hi"}]}
    del chat["prompt"]
    return [(long_request, "prompt_too_long"), (chat, "no_chat_template"), ({"type": "Ping", "nonce": 7}, "Pong"),
            ({"type": "MetricsRequest"}, "MetricsReply")]


def _truncated(rng: random.Random, rid: str) -> ZmqCase:
    message, _ = rng.choice(_valid_messages(rid)[1:])  # a prefix of one msgpack value never decodes
    data = pack(message)
    return ZmqCase("truncated", [data[:rng.randrange(len(data))]], BAD)


def _garbled(rng: random.Random, rid: str) -> ZmqCase:
    """1-3 bytes of a valid message changed: still valid (its own answer) or refused."""
    message, label = rng.choice(_valid_messages(rid)[1:])
    data = bytearray(pack(message))
    for _ in range(rng.randint(1, 3)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return ZmqCase("garbled", [bytes(data)], BAD | {label})  # the id itself may be garbled


def _wrong_shape(rng: random.Random, rid: str) -> ZmqCase:
    """Valid msgpack that is not a message: not a map, keys that are not strings, ..."""
    shapes: list[Callable[[], bytes]] = [
        lambda: pack(rng.choice([0, -1, U64, 1.5, NAN, "GenerateRequest", b"x", None, True, [], [1, 2],
                                 ["GenerateRequest", rid]])),
        lambda: pack(msgpack.ExtType(rng.randint(0, 127), b"abc")),
        lambda: raw_map([(pack(1), pack(2))]),
        lambda: raw_map([(pack(b"type"), pack("Ping"))]),
        lambda: raw_map([(pack("type"), pack("Ping")), (pack(None), pack(1))]),
        lambda: raw_map([(pack([1]), pack("x")), (pack("type"), pack("Ping"))]),
        lambda: pack({}),
        lambda: pack({"type": "Ping"}) + rng.randbytes(rng.randint(1, 8)),  # trailing bytes
        lambda: pack(msgpack.Timestamp(1, 2)),
        lambda: raw_map([(pack("type"), pack("Ping")), (pack("nonce"), b"\xd7\xff" + bytes(8))]),  # timestamp ext
        lambda: raw_map([(pack("type"), pack("GenerateRequest")), (pack("request_id"), pack(rid)),
                         (pack("prompt"), b"\xa3\xed\xa0\x80")]),  # a UTF-8 surrogate: invalid UTF-8
        lambda: raw_map([(pack("type"), pack("GenerateRequest")), (pack("request_id"), pack(rid)),
                         (pack("prompt"), rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                                                      b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"]))]),
    ]
    return ZmqCase("wrong-shape", [rng.choice(shapes)()], BAD)


def _depth_bomb(rng: random.Random, rid: str) -> ZmqCase:
    depth = rng.choice([100, 1000, 10_000, 100_000, 300_000])
    opener = rng.choice([b"\x91", b"\x81\xa1k"])  # [[[...]]] or {"k": {"k": ...}}
    bomb = opener * depth + b"\xc0"
    where = rng.choice(["unknown-first", "unknown-last", "prompt", "stop", "sampling", "messages", "top"])
    if where == "top":
        return ZmqCase("depth-bomb", [bomb], BAD)
    pairs = [(pack(k), pack(v)) for k, v in generate_base(rid).items() if k != where]
    if where.startswith("unknown"):
        entry = (pack(_unknown_name(rng)), bomb)
        pairs = [entry, *pairs] if where == "unknown-first" else [*pairs, entry]
    else:
        pairs.append((pack(where), bomb))
    return ZmqCase("depth-bomb", [raw_map(pairs)], BAD)


def _frames(rng: random.Random, rid: str) -> ZmqCase:
    """Not exactly one frame: empty frames, several frames (valid messages among them)."""
    valid = pack(rng.choice(_valid_messages(rid))[0])
    choice = rng.choice(["empty", "empty+valid", "valid+empty", "many"])
    if choice == "empty":
        return ZmqCase("frames", [b""], BAD)
    if choice == "empty+valid":
        return ZmqCase("frames", [b"", valid], BAD)
    if choice == "valid+empty":
        return ZmqCase("frames", [valid, b""], BAD)
    return ZmqCase("frames", [rng.choice([valid, rng.randbytes(8), b""]) for _ in range(rng.randint(2, 6))], BAD)


def _long_prompt(rng: random.Random, rid: str) -> ZmqCase:
    """Prompts that cannot fit the context: refused with prompt_too_long, never run; the other
    fields at valid extremes."""
    message = generate_base(rid)
    for name, values in EXTREME_VALID.items():
        if rng.random() < 0.5:
            message[name] = rng.choice(values)
    rid = message["request_id"]
    text = rng.choice([LONG_TEXT, TOKENS_50K, "x" * (DEMO_PROMPT_CHARS + 1), "é" * (DEMO_PROMPT_CHARS + 1)])
    if rng.random() < 0.3:  # a chat: refused by its length before the missing template is noticed
        del message["prompt"]
        count = rng.randint(1, 4)
        message["messages"] = [{"role": "user", "content": text[:len(text) // count + 1]} for _ in range(count)]
        if text is TOKENS_50K:  # within the character bound: the template's absence answers
            return ZmqCase("long-chat", [pack(message)], frozenset({"no_chat_template"}), rid)
    else:
        message["prompt"] = text
    return ZmqCase("long-prompt", [pack(message)], frozenset({"prompt_too_long"}), rid)


ZMQ_MAKERS: list[tuple[Callable[[random.Random, str], ZmqCase], int]] = [
    (_field_mutation, 30), (_other_message_mutation, 4), (_random_bytes, 16), (_truncated, 12), (_garbled, 16),
    (_wrong_shape, 10), (_depth_bomb, 4), (_frames, 6), (_long_prompt, 1),
]


def zmq_cases(seed: int, count: int) -> Iterator[ZmqCase]:
    """``count`` cases, the same for the same seed; request ids are "fz-<seed>-<index>"."""
    rng = random.Random(seed)
    makers = [maker for maker, _ in ZMQ_MAKERS]
    weights = [weight for _, weight in ZMQ_MAKERS]
    for index in range(count):
        yield rng.choices(makers, weights)[0](rng, f"fz-{seed}-{index}")


def pipelined_cases(seed: int, count: int) -> list[ZmqCase]:
    """Cases answered at once by bad_message (no queueing), for sending in bursts."""
    rng = random.Random(seed)
    makers = [_random_bytes, _truncated, _wrong_shape, _frames, _other_message_mutation]
    return [rng.choice(makers)(rng, f"fp-{seed}-{index}") for index in range(count)]


# --- HTTP --------------------------------------------------------------------------------


@dataclass(frozen=True)
class HttpCase:
    kind: str
    method: str
    path: str
    body: bytes | None
    status: int
    codes: frozenset[str | None]  # acceptable error.code
    param: str | None = None  # when set, error.param must start with it
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
INVALID_JSON = frozenset({"invalid_json"})
INVALID = frozenset({"invalid_request"})
UNSUPPORTED = frozenset({"unsupported"})


def completion_base() -> dict[str, Any]:
    return {"model": "target-code-9m", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}


def chat_base() -> dict[str, Any]:
    return {"model": "target-code-9m", "messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 4,
            "temperature": 0}


def dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


# Wrong for the field whichever endpoint (type, range); each with the code it gets.
HTTP_FIELD_BAD: dict[str, list[Any]] = {
    "model": [1, True, [], {}, 1.5],
    "max_tokens": [0, -1, -(2**63), 2**20 + 1, 2**64, 10**30, 4.5, "4", True, [], {}],
    "temperature": [-0.1, -1e308, 1000.1, 1e308, "0", True, [], {}, 1e-300, 5e-324],
    "top_p": [0, 0.0, -1, 1.0001, 1e308, "1", True, [], -(2**63)],
    "top_k": [-2, -(2**63), 2**31, 2**64, 1.5, "5", True, []],
    "seed": [-1, -(2**63), 2**63, 2**64, 10**30, 1.5, "1", True, []],
    "stop": [1, True, {}, [1], [None], [["x"]], ["x"] * 65, ["x" * 1025], {"a": "b"}],
    "n": [0, 17, -1, 2**64, 10**30, 1.5, "1", True, []],
    "stream": [1, 0, "true", "yes", [], {}],
    "stream_options": [1, "x", [], {"include_usage": "yes"}, {"include_usage": 1},
                       {"include_usage": True}],  # the last: without stream
    "mode": ["fast", "", "AR", 1, True, []],
    # An int (completions) or a bool (chat): neither takes these.
    "logprobs": ["5", -1, 21, [], 1.5],
    # Not implemented: only their no-effect values pass.
    "presence_penalty": [0.5, -1, 2], "frequency_penalty": [1.0],
    "logit_bias": [{"50": 1}], "echo": [True], "suffix": ["x"], "best_of": [2, 0], "tools": [[{"type": "function"}]],
    "tool_choice": ["auto"], "response_format": [{"type": "json_object"}],
}
COMPLETION_ONLY_BAD: dict[str, list[Any]] = {
    "prompt": [1, True, None, {}, [1], [[1, 2]], [], ["a"] * 17, 1.5],
}
CHAT_ONLY_BAD: dict[str, list[Any]] = {
    "messages": [None, "hi", [], {}, [1], [None], [{}], [{"content": "x"}],
                 [{"role": "", "content": "x"}], [{"role": "x" * 65, "content": "x"}], [{"role": 1, "content": "x"}],
                 [{"role": "user", "content": "x"}, {"role": "user", "content": 1}],
                 [{"role": "user", "content": 1}], [{"role": "user", "content": [{"type": "image_url"}]}],
                 [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": 1}]}],
                 [{"role": "user", "content": "x", "name": 1}]],
    "max_completion_tokens": [0, -1, 2**20 + 1, 2**64, 1.5, "4", True],
    "top_logprobs": [-1, 21, "2", 1.5, 2],  # the last: without logprobs: true
}


def _field_code(name: str, value: Any) -> frozenset[str]:
    if name in ("presence_penalty", "frequency_penalty", "logit_bias", "echo", "suffix",
                "best_of", "tools", "tool_choice", "response_format"):
        return UNSUPPORTED
    return INVALID


def _http_field(rng: random.Random) -> HttpCase:
    chat = rng.random() < 0.4
    body = chat_base() if chat else completion_base()
    table = {**HTTP_FIELD_BAD, **(CHAT_ONLY_BAD if chat else COMPLETION_ONLY_BAD)}
    name = rng.choice(list(table))
    value = rng.choice(table[name])
    body[name] = value
    if name != "stream" and rng.random() < 0.3:
        body["stream"] = True  # refused before anything streams: a JSON error, not events
    if name == "stream_options" and value == {"include_usage": True}:
        body.pop("stream", None)  # what is wrong: it needs stream: true
    items = list(body.items())
    rng.shuffle(items)
    return HttpCase(f"field:{name}", "POST", CHAT if chat else COMPLETIONS, dumps(dict(items)), 400,
                    _field_code(name, value), name)


def _http_unknown(rng: random.Random) -> HttpCase:
    """An unknown field is ignored (as vLLM and llama-server ignore them), and hides nothing: the
    known field beside it with a bad value is still the 400."""
    chat = rng.random() < 0.4
    body = chat_base() if chat else completion_base()
    body[_unknown_name(rng)] = rng.choice([1, "x", None, [], {}, True, 1.5])
    body["max_tokens"] = rng.choice([0, -1, "4", 1.5])
    return HttpCase("unknown-field", "POST", CHAT if chat else COMPLETIONS, dumps(body), 400, INVALID,
                    "max_tokens")


def _http_bad_json(rng: random.Random) -> HttpCase:
    chat = rng.random() < 0.4
    path = CHAT if chat else COMPLETIONS
    valid = dumps(chat_base() if chat else completion_base())
    choice = rng.choice(["truncated", "nan", "literal", "garbage", "trailing", "quotes", "utf8", "deep", "empty",
                         "not-object", "bom", "comment", "number"])
    if choice == "truncated":
        body = valid[:rng.randrange(len(valid))]
    elif choice == "nan":
        body = valid[:-1] + b', "temperature": ' + rng.choice([b"NaN", b"Infinity", b"-Infinity", b"nan"]) + b"}"
    elif choice == "literal":
        body = valid.replace(b'"temperature": 0', b'"temperature": ' + rng.choice([b"undefined", b"None", b"True",
                                                                                 b"0x10", b"+1", b".5", b"01"]))
    elif choice == "garbage":
        body = b"\x00" + rng.randbytes(rng.randint(0, 200))
    elif choice == "trailing":
        body = valid + rng.choice([b"x", b"}", b",", b"{}", b"\x00"])
    elif choice == "quotes":
        body = valid.replace(b'"', b"'")
    elif choice == "utf8":
        body = valid.replace(b"def", rng.choice([b"\xff\xfe", b"\xed\xa0\x80", b"\xc3", b"\\ud800", b"\\uZZZZ"]))
    elif choice == "deep":
        depth = rng.choice([10_000, 100_000])  # beyond the decoder's stack
        body = valid[:-1] + b', "' + _unknown_name(rng).encode() + b'": ' + b"[" * depth + b"]" * depth + b"}"
    elif choice == "empty":
        body = rng.choice([b"", b" ", b"\n", b"null"])
    elif choice == "not-object":
        body = rng.choice([b"[]", b"[1]", b'"prompt"', b"1", b"true", b"[{}]", b"1e400"])
    elif choice == "bom":
        body = b"\xef\xbb\xbf" + valid
    elif choice == "comment":
        body = b"// hi\n" + valid
    else:
        body = valid.replace(b'"max_tokens": 4', b'"max_tokens": ' + rng.choice([b"1e400", b"-1e400"]))
    return HttpCase(f"bad-json:{choice}", "POST", path, body, 400, INVALID_JSON)


def _http_content_type(rng: random.Random) -> HttpCase:
    """A body that is not JSON, said to be something else (the type itself is not checked)."""
    kind, body = rng.choice([("text/plain", b"def f(x):"), ("application/x-www-form-urlencoded", b"prompt=a&n=1"),
                             ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data; "
                                                                 b'name="prompt"\r\n\r\na\r\n--x--\r\n'),
                             ("application/xml", b"<prompt>a</prompt>"), ("application/msgpack", pack({"prompt": "a"})),
                             ("", b"prompt: a")])
    return HttpCase(f"content-type:{kind.split(';')[0] or 'none'}", "POST", rng.choice([COMPLETIONS, CHAT]), body,
                    400, INVALID_JSON, headers={"content-type": kind} if kind else {})


def _http_route(rng: random.Random) -> HttpCase:
    method, path, status = rng.choice([
        ("GET", COMPLETIONS, 405), ("PUT", COMPLETIONS, 405), ("DELETE", CHAT, 405), ("PATCH", CHAT, 405),
        ("POST", "/v1/models", 405), ("POST", "/health", 405), ("DELETE", "/metrics", 405),
        ("GET", "/", 404), ("POST", "/v1/completion", 404), ("POST", "/v1/chat/completion", 404),
        ("GET", "/v2/models", 404), ("POST", "/v1/completions/x", 404), ("GET", "/%00", 404),
        ("GET", "/" + "a" * rng.randint(100, 8000), 404), ("POST", "/v1/../v1/x", 404), ("GET", "/v1/models/x", 404),
        ("POST", "/v1/embeddings", 404), ("GET", "/docs", 404), ("GET", "/openapi.json", 404)])
    body = dumps(completion_base()) if method in ("POST", "PUT", "PATCH") else None
    code = "model_not_found" if path.startswith("/v1/models/") else None  # the route exists, the model does not
    return HttpCase(f"route:{method}", method, path, body, status, frozenset({code}))


def _http_model(rng: random.Random) -> HttpCase:
    chat = rng.random() < 0.4
    body = chat_base() if chat else completion_base()
    body["model"] = rng.choice(["", "gpt-4", "target-code-9m ", "TARGET-CODE-9M", "x" * rng.randint(300, 100_000)])
    return HttpCase("model", "POST", CHAT if chat else COMPLETIONS, dumps(body), 404,
                    frozenset({"model_not_found"}), "model")


def _http_long(rng: random.Random) -> HttpCase:
    """Prompts that cannot fit the context (50k tokens, or beyond the character bound): refused
    quickly, never run; valid extremes in the other fields."""
    text = rng.choice([LONG_TEXT, TOKENS_50K, "é" * (DEMO_PROMPT_CHARS + 1)])
    extremes: dict[str, Any] = rng.choice([{}, {"max_tokens": 2**20}, {"temperature": 1000, "top_p": 1e-300,
                                                                       "top_k": 2**31 - 1, "seed": 2**63 - 1},
                                           {"stream": True, "stop": ["x" * 1024] * 64}, {"n": 1, "logprobs": None}])
    if rng.random() < 0.3:
        body = {**chat_base(), **extremes, "messages": [{"role": "user", "content": text}]}
        code = "no_chat_template" if text is TOKENS_50K else "prompt_too_long"
        return HttpCase("long-chat", "POST", CHAT, dumps(body), 400, frozenset({code}))
    body = {**completion_base(), **extremes, "prompt": rng.choice([text, [text]])}
    return HttpCase("long-prompt", "POST", COMPLETIONS, dumps(body), 400, frozenset({"prompt_too_long"}))


def _http_oversized(rng: random.Random) -> HttpCase:
    """A whole JSON body a little over the limit: refused by its Content-Length, unread."""
    chat = rng.random() < 0.4
    base = dumps(chat_base() if chat else completion_base())
    padding = b"a" * (BODY_LIMIT - len(base) + rng.randint(1, 4096))
    body = base.replace(b"def f(x):", b"def f(x):" + padding)
    return HttpCase("oversized", "POST", CHAT if chat else COMPLETIONS, body, 413, frozenset({"body_too_large"}))


HTTP_MAKERS: list[tuple[Callable[[random.Random], HttpCase], int]] = [
    (_http_field, 40), (_http_unknown, 8), (_http_bad_json, 25), (_http_content_type, 6), (_http_route, 8),
    (_http_model, 4), (_http_long, 2), (_http_oversized, 1),
]


def http_cases(seed: int, count: int) -> Iterator[HttpCase]:
    rng = random.Random(seed)
    makers = [maker for maker, _ in HTTP_MAKERS]
    weights = [weight for _, weight in HTTP_MAKERS]
    for _ in range(count):
        yield rng.choices(makers, weights)[0](rng)


# Malformed HTTP itself (the server's HTTP parser answers): raw bytes and the status line expected.
RAW_HTTP: list[tuple[str, bytes, bytes]] = [
    ("garbage", b"\x00\x01\x02garbage\r\n\r\n", b"HTTP/1.1 400"),
    ("no-version", b"GET /health\r\n\r\n", b"HTTP/1.1 400"),
    ("bad-content-length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", b"HTTP/1.1 400"),
    ("negative-content-length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
     b"HTTP/1.1 400"),
    ("two-content-lengths", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3"
                            b"\r\n\r\n{}", b"HTTP/1.1 400"),
    ("bad-chunk", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"zz\r\nabc\r\n0\r\n\r\n", b"HTTP/1.1 400"),
    ("no-host", b"GET /health HTTP/1.1\r\n\r\n", b"HTTP/1.1 400"),
    ("header-without-colon", b"GET /health HTTP/1.1\r\nHost: x\r\nbroken header\r\n\r\n", b"HTTP/1.1 400"),
    ("space-in-header-name", b"GET /health HTTP/1.1\r\nHost: x\r\nX Y: z\r\n\r\n", b"HTTP/1.1 400"),
    ("control-in-target", b"GET /he\x01alth HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 400"),
]
