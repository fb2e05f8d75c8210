"""The OpenAI-compatible API as plain data: request validation, the GenerateRequest it becomes,
and the response bodies and server-sent events built from the coordinator's replies.

No web server here (``http_server`` moves the bytes), so every rule can be tested alone.
Requests are checked strictly (msgspec): a wrong type or an out-of-range value is a 400 that
names the field. Unknown fields are ignored (logged at debug level), as vLLM and llama-server
ignore them: clients send their own extensions (``extra_body``) to every server. Fields of
OpenAI's API that Dovetail does not implement are accepted only at their no-effect values
(``presence_penalty: 0``, ``echo: false``, ...), so a client never silently gets something
other than what it asked for. ``n`` choices, and a completion's list of prompts (at most 16
choices in all), are decoded side by side in the batch, each a request of its own (choice i of a
prompt seeded with seed + i); a prompt's greedy choices are the same tokens, so one decode answers
them all. ``logprobs`` (and chat's ``top_logprobs``) are the target's own
log-probabilities (``ipc.messages.TokenLogprob``), in OpenAI's shapes.

Extensions: ``top_k`` (0 or -1: off) and ``mode`` (``dovetail``/``ar``/``lookup``) in requests; a
``dovetail`` field in responses with the request's statistics and generated token ids.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from ipc import messages as m

log = logging.getLogger(__name__)

MAX_NEW_TOKENS = 1 << 20  # GenerateRequest's limit: "until the context is full"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: send 0 for greedy decoding

# OpenAI fields Dovetail does not implement, with the values that ask for nothing.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
}
# OpenAI fields that change nothing about the generated text: accepted and ignored.
IGNORED_FIELDS = frozenset({"store", "metadata", "service_tier"})

# Coordinator error codes -> HTTP status. deadline_exceeded (--request-timeout) is 504, as gRPC maps
# DEADLINE_EXCEEDED: the server's own limit ran out, not a fault of the server (it was a 500).
ERROR_STATUS = {
    "bad_message": 400, "prompt_too_long": 400, "empty_prompt": 400, "unsupported": 400, "no_chat_template": 400,
    "bad_messages": 400, "kv_budget_exceeded": 400, "busy": 429, "shutting_down": 503, "worker_failed": 503,
    "deadline_exceeded": 504, "worker_error": 500, "internal": 500,
}


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    @property
    def kind(self) -> str:
        if self.status == 429:
            return "rate_limit_error"
        if self.status == 404:
            return "not_found_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def error_from_reply(reply: m.ErrorReply) -> ApiError:
    return ApiError(ERROR_STATUS.get(reply.code, 500), reply.message, code=reply.code)


# Choices per request at most (n): each is a request of its own in the batch and its queue.
MAX_CHOICES = 16


# --- requests ----------------------------------------------------------------------------


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class Params(Struct, kw_only=True):
    """What both endpoints take."""

    model: str | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_NEW_TOKENS)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1000.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=(1 << 31) - 1)] | None = None  # extension (vLLM's spelling)
    seed: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None  # choices, each decoded as a request of its own
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    mode: Literal["dovetail", "ar", "lookup"] | None = None  # extension
    # Whose turn in the queue the request waits for: one user's requests take one turn between them
    # (``request_queue``); without one, a request's choices take one turn between them.
    user: str | None = None  # a longer one is cut to 256 characters (OpenAI sets no bound)


LogprobCount = Annotated[int, Meta(ge=0, le=m.MAX_LOGPROBS)]


class CompletionRequest(Params, kw_only=True):
    prompt: str | list[str]
    logprobs: LogprobCount | None = None  # the legacy API's: alternatives per token (OpenAI allows 5)


class TextPart(Struct, tag="text", tag_field="type"):
    text: str


class ChatTurn(Struct, kw_only=True):
    role: Annotated[str, Meta(min_length=1, max_length=64)]
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted, not shown to the template (transformers passes it; few templates read it)


class ChatRequest(Params, kw_only=True):
    messages: Annotated[list[ChatTurn], Meta(min_length=1, max_length=m.MAX_CHAT_MESSAGES)]
    max_completion_tokens: Annotated[int, Meta(ge=1, le=MAX_NEW_TOKENS)] | None = None
    logprobs: bool | None = None
    top_logprobs: LogprobCount | None = None  # alternatives per token; needs logprobs: true


def parse_request(body: bytes, kind: type[CompletionRequest] | type[ChatRequest]) -> Any:
    """The validated request; ApiError(400) naming the first problem."""
    data = decode_object(body)
    for name, neutral in NEUTRAL_VALUES.items():
        if name in data:
            value = data.pop(name)
            if not any(_same(value, allowed) for allowed in neutral):
                raise ApiError(400, f"{name}={value!r} is not supported by Dovetail (only "
                                    f"{' or '.join(_json_text(v) for v in neutral)})", code="unsupported", param=name)
    for name in IGNORED_FIELDS:
        data.pop(name, None)
    if log.isEnabledFor(logging.DEBUG):
        ignored = unknown_fields(data, kind)
        if ignored:
            log.debug("ignoring unknown request fields: %s", ", ".join(ignored))
    return convert(data, kind)


def decode_object(body: bytes) -> dict[str, Any]:
    """A request body's JSON object; ApiError(400) when it is not one."""
    if not body.strip():
        raise ApiError(400, "the request body is empty: send a JSON object", code="invalid_json")
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
    except RecursionError:  # [[[[...]]]] deeper than the stack: a 400 like any bad JSON, not a 500
        raise ApiError(400, "the request body is not valid JSON: nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return data


def convert(data: dict[str, Any], kind: type[Any]) -> Any:
    """``data`` as the struct ``kind`` (unknown fields dropped); ApiError(400) naming the field."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as error:
        raise ApiError(400, f"invalid request: {error}", code="invalid_request",
                       param=_field_of(str(error))) from None


def _unknown(data: Any, kind: type[Struct], where: str) -> list[str]:
    if not isinstance(data, dict):
        return []
    known = set(kind.__struct_fields__) | ({"type"} if kind is TextPart else set())
    return [f"{where}{name}" for name in data if name not in known]


def unknown_fields(data: dict[str, Any], kind: type[Struct]) -> list[str]:
    """The fields of a request body that its struct does not know (and msgspec drops), with
    their paths (``messages[0].tool_calls``), to log what a client sent in vain."""
    found = _unknown(data, kind, "") + _unknown(data.get("stream_options"), StreamOptions, "stream_options.")
    messages = data.get("messages") if kind is ChatRequest else None
    for index, turn in enumerate(messages if isinstance(messages, list) else []):
        found += _unknown(turn, ChatTurn, f"messages[{index}].")
        parts = turn.get("content") if isinstance(turn, dict) else None
        for number, part in enumerate(parts if isinstance(parts, list) else []):
            found += _unknown(part, TextPart, f"messages[{index}].content[{number}].")
    return found


def _same(value: Any, allowed: Any) -> bool:
    """JSON equality: 0 and 0.0 are the same, false and 0 are not."""
    return isinstance(value, bool) == isinstance(allowed, bool) and value == allowed


def _json_text(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _field_of(message: str) -> str | None:
    """The field a msgspec error is about: ``messages[0].role`` for a missing nested field, not its parent."""
    where = message.rsplit("- at `$.", 1)[1].rstrip("`") if "- at `$." in message else None
    missing = message.split("field `", 1)[1].split("`", 1)[0] if "required field `" in message else None
    if missing is None:
        return where
    return missing if where is None else f"{where}.{missing}"


@dataclass(frozen=True)
class Plan:
    """What the HTTP layer does with one request."""

    request: m.GenerateRequest
    stream: bool
    include_usage: bool
    limit_field: str | None = None  # the field that set max_new_tokens, when the client set it
    choices: int = 1  # n: choices per prompt
    prompts: tuple[str, ...] = ()  # a completion's list of prompts (each n choices); empty: request's own

    @property
    def total_choices(self) -> int:
        return max(1, len(self.prompts)) * self.choices

    def per_prompt(self) -> list[m.GenerateRequest]:
        """The request of each prompt (the first is ``request``)."""
        return [self.request, *(msgspec.structs.replace(self.request, prompt=prompt) for prompt in self.prompts[1:])]

    def decoded(self) -> list[Decode]:
        """The requests that answer the choices, run side by side in the batch: prompt p's choice i is
        choice p * n + i, seeded with seed + i (so choice 0 is what n=1 gives with that seed). Greedy
        choices of a prompt are all the same tokens (lossless), so one request answers them all."""
        decodes = []
        for number, request in enumerate(self.per_prompt()):
            first, sampling = number * self.choices, request.sampling
            if sampling.greedy:
                decodes.append(Decode(request, tuple(range(first, first + self.choices))))
                continue
            for index in range(self.choices):
                seeded = sampling if sampling.seed is None else msgspec.structs.replace(
                    sampling, seed=(sampling.seed + index) % (1 << 63))
                decodes.append(Decode(msgspec.structs.replace(request, sampling=seeded), (first + index,)))
        if len(decodes) == 1:
            return decodes
        # The choices wait for one turn between them in the queue's rotation, as a client's requests do.
        user = self.request.user or f"choices of {self.request.request_id}"[:256]
        return [Decode(msgspec.structs.replace(decode.request, request_id=f"{self.request.request_id}-"
                                               f"{decode.choices[0]}", user=user), decode.choices)
                for decode in decodes]


@dataclass(frozen=True)
class Decode:
    """One request sent for a Plan, and the choices its answer is (several: a greedy prompt's n)."""

    request: m.GenerateRequest
    choices: tuple[int, ...]


def per_choice(decodes: Sequence[Decode], dones: Sequence[m.GenerateDone]) -> list[m.GenerateDone]:
    """Each choice's answer, in choice order, from the answers to ``Plan.decoded``'s requests."""
    answers: dict[int, m.GenerateDone] = {}
    for decode, done in zip(decodes, dones, strict=True):
        answers.update(dict.fromkeys(decode.choices, done))
    return [answers[index] for index in sorted(answers)]


def check_context(plan: Plan, prompt_tokens: int, context: int) -> None:
    """400 when the prompt and the tokens the client asked for cannot both fit the context (vLLM's
    rule and words): running to the context's end instead would not give what was asked."""
    asked = plan.request.max_new_tokens
    # A prompt that leaves no room at all is the coordinator's prompt_too_long, as without max_tokens.
    if plan.limit_field is None or prompt_tokens >= context or prompt_tokens + asked <= context:
        return
    where = "messages" if plan.request.messages is not None else "prompt"
    raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                        f"{prompt_tokens + asked} tokens ({prompt_tokens} in the {where}, {asked} in the "
                        f"completion). Please reduce the length of the {where} or {plan.limit_field}.",
                   code="context_length_exceeded", param=plan.limit_field)


def _sampling(params: Params) -> m.Sampling:
    temperature = DEFAULT_TEMPERATURE if params.temperature is None else params.temperature
    if 0.0 < temperature < m.MIN_TEMPERATURE:
        raise ApiError(400, f"temperature must be 0 (greedy) or >= {m.MIN_TEMPERATURE}, got {temperature}",
                       code="invalid_request", param="temperature")
    top_k = params.top_k if params.top_k is not None and params.top_k > 0 else 0
    return m.Sampling(temperature=temperature, top_k=top_k,
                      top_p=1.0 if params.top_p is None else params.top_p, seed=params.seed)


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    stops = [s for s in stops if s]  # an empty stop string would end every request at once
    if len(stops) > 64 or any(len(s) > 1024 for s in stops):
        raise ApiError(400, "stop: at most 64 strings of at most 1024 characters", code="invalid_request",
                       param="stop")
    return stops


def _plan(params: Params, request_id: str, default_mode: str, max_tokens: int, limit_field: str | None,
          logprobs: int | None, **prompt: Any) -> Plan:
    stream = bool(params.stream)
    if params.stream_options is not None and not stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", code="invalid_request",
                       param="stream_options")
    request = m.GenerateRequest(request_id=request_id, max_new_tokens=max_tokens, stop=_stops(params.stop),
                                sampling=_sampling(params), mode=params.mode or default_mode,  # type: ignore[arg-type]
                                stream=stream, logprobs=logprobs, user=params.user[:256] if params.user else None,
                                **prompt)
    include_usage = bool(params.stream_options and params.stream_options.include_usage)
    return Plan(request, stream, include_usage, limit_field, choices=params.n or 1)


def plan_completion(params: CompletionRequest, request_id: str, default_mode: str) -> Plan:
    prompts = params.prompt if isinstance(params.prompt, list) else [params.prompt]
    if not prompts:
        raise ApiError(400, "prompt: an empty list of prompts", code="invalid_request", param="prompt")
    if len(prompts) * (params.n or 1) > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n={params.n or 1} choices: at most {MAX_CHOICES} choices a "
                            f"request (each is a request of its own in the batch)", code="invalid_request",
                       param="prompt" if len(prompts) > 1 else "n")
    if sum(len(prompt) for prompt in prompts) > 16 * 1024 * 1024:
        raise ApiError(400, "prompt: longer than 16,777,216 characters", code="prompt_too_long", param="prompt")
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if params.max_tokens is None else params.max_tokens
    limit_field = None if params.max_tokens is None else "max_tokens"
    plan = _plan(params, request_id, default_mode, max_tokens, limit_field, params.logprobs, prompt=prompts[0])
    return dataclasses.replace(plan, prompts=tuple(prompts)) if len(prompts) > 1 else plan


def plan_chat(params: ChatRequest, request_id: str, default_mode: str) -> Plan:
    messages = []
    for turn in params.messages:
        if isinstance(turn.content, list):  # text parts are joined as vLLM joins them
            content = "\n".join(part.text for part in turn.content)
        else:
            content = turn.content or ""
        messages.append(m.ChatMessage(role=turn.role, content=content))
    limit_field = ("max_completion_tokens" if params.max_completion_tokens is not None
                   else "max_tokens" if params.max_tokens is not None else None)
    chosen = params.max_completion_tokens if params.max_completion_tokens is not None else params.max_tokens
    if params.top_logprobs is not None and not params.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", code="invalid_request", param="top_logprobs")
    logprobs = (params.top_logprobs or 0) if params.logprobs else None
    return _plan(params, request_id, default_mode, MAX_NEW_TOKENS if chosen is None else chosen, limit_field,
                 logprobs, messages=messages)


# --- responses ---------------------------------------------------------------------------


TokenText = Callable[[int], str]  # a token id as text (the tokenizer's piece, special tokens shown)


@dataclass(frozen=True)
class ResponseIds:
    """What every body of one response repeats, and how it shows a token id as text."""

    id: str
    model: str
    created: int
    token_text: TokenText = str

    @classmethod
    def now(cls, request_id: str, model: str, token_text: TokenText = str) -> ResponseIds:
        return cls(request_id, model, int(time.time()), token_text)


def completion_logprobs(token_text: TokenText, token_ids: Sequence[int], entries: Sequence[m.TokenLogprob],
                        offset: int = 0) -> dict[str, Any] | None:
    """The legacy completions API's ``logprobs``: tokens, their logprobs, the alternatives as
    {text: logprob} (the chosen token alone when none were asked for) and each token's offset
    in the text (from ``offset``: where earlier chunks of a stream ended)."""
    if not entries:
        return None
    tokens = [token_text(token) for token in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = [{token_text(top_id): value for top_id, value in zip(entry.top_ids, entry.top_logprobs, strict=True)}
           or {text: entry.logprob} for entry, text in zip(entries, tokens, strict=True)]
    return {"tokens": tokens, "token_logprobs": [entry.logprob for entry in entries], "top_logprobs": top,
            "text_offset": offsets}


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_text: TokenText, token_ids: Sequence[int],
                  entries: Sequence[m.TokenLogprob]) -> dict[str, Any] | None:
    """The chat API's ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}."""
    if not entries:
        return None
    content = []
    for token, entry in zip(token_ids, entries, strict=True):
        item = _chat_token(token_text(token), entry.logprob)
        item["top_logprobs"] = [_chat_token(token_text(top_id), value)
                                for top_id, value in zip(entry.top_ids, entry.top_logprobs, strict=True)]
        content.append(item)
    return {"content": content, "refusal": None}


def usage(dones: Sequence[m.GenerateDone], choices: int = 1) -> dict[str, int]:
    """Each prompt once (``choices`` answers a prompt, in order), every choice's tokens (as OpenAI counts)."""
    prompt = sum(done.stats.prompt_tokens for done in dones[::choices])
    completion = sum(len(done.token_ids) for done in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def extension(done: m.GenerateDone) -> dict[str, Any]:
    """Dovetail's own fields: the request's statistics and every generated token id."""
    return {"stats": msgspec.to_builtins(done.stats), "token_ids": list(done.token_ids)}


def extensions(dones: Sequence[m.GenerateDone]) -> dict[str, Any]:
    """``extension`` of the one choice, or with n > 1 a list of them under ``choices`` (by index)."""
    return extension(dones[0]) if len(dones) == 1 else {"choices": [extension(done) for done in dones]}


def completion_body(meta: ResponseIds, dones: Sequence[m.GenerateDone], per_prompt: int = 1) -> dict[str, Any]:
    """``dones``: every choice's answer in order, ``per_prompt`` (n) of them for each prompt."""
    choices = [{"index": index, "text": done.text, "finish_reason": done.finish_reason,
                "logprobs": completion_logprobs(meta.token_text, done.token_ids, done.logprobs)}
               for index, done in enumerate(dones)]
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": choices, "usage": usage(dones, per_prompt), "dovetail": extensions(dones)}


def chat_body(meta: ResponseIds, dones: Sequence[m.GenerateDone], per_prompt: int = 1) -> dict[str, Any]:
    choices = [{"index": index, "message": {"role": "assistant", "content": done.text},
                "logprobs": chat_logprobs(meta.token_text, done.token_ids, done.logprobs),
                "finish_reason": done.finish_reason} for index, done in enumerate(dones)]
    return {"id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "choices": choices, "usage": usage(dones, per_prompt), "dovetail": extensions(dones)}


class EventStream:
    """The server-sent events of one streamed response, built from the coordinator's replies; each
    choice's events carry its index (one choice per event, as OpenAI streams n choices)."""

    def __init__(self, meta: ResponseIds, chat: bool, include_usage: bool, choices: int = 1, per_prompt: int = 1):
        self.meta = meta
        self.chat = chat
        self.include_usage = include_usage
        self.choices = choices  # in all
        self.per_prompt = per_prompt  # n
        self.offsets = [0] * choices  # the completions API's text_offset: characters of token text sent so far

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body: dict[str, Any] = {"id": self.meta.id, "object": "chat.completion.chunk" if self.chat
                                else "text_completion", "created": self.meta.created, "model": self.meta.model,
                                "choices": choices}
        if self.include_usage:
            body["usage"] = None  # OpenAI: every chunk has the field; only the last one fills it
        body.update(extra)
        return sse(body)

    def _choice(self, index: int, text: str | None, finish_reason: str | None, role: bool = False,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, chunk: m.TokenChunk, index: int) -> dict[str, Any] | None:
        if self.chat:
            return chat_logprobs(self.meta.token_text, chunk.token_ids, chunk.logprobs)
        logprobs = completion_logprobs(self.meta.token_text, chunk.token_ids, chunk.logprobs, self.offsets[index])
        if logprobs is not None:
            self.offsets[index] += sum(len(token) for token in logprobs["tokens"])
        return logprobs

    def start(self) -> list[bytes]:
        """Before any text: a chat stream first names the assistant's role, for each choice."""
        return [self._chunk([self._choice(index, "", None, role=True)]) for index in range(self.choices)] \
            if self.chat else []

    def text(self, chunk: m.TokenChunk, index: int = 0) -> list[bytes]:
        """A chunk's text, with its tokens' logprobs when asked for (then even while its text is
        held back: every token's entry is sent once, in order)."""
        logprobs = self._logprobs(chunk, index)
        if not chunk.text and logprobs is None:
            return []
        return [self._chunk([self._choice(index, chunk.text, None, logprobs=logprobs)])]

    def done(self, done: m.GenerateDone, index: int = 0) -> list[bytes]:
        """The choice's last event: how it finished, with Dovetail's fields."""
        return [self._chunk([self._choice(index, None, done.finish_reason)], dovetail=extension(done))]

    def end(self, dones: Sequence[m.GenerateDone]) -> list[bytes]:
        """After every choice's ``done``: the usage (when asked for), then the end."""
        return [*([self._chunk([], usage=usage(dones, self.per_prompt))] if self.include_usage else []), DONE]

    def error(self, error: ApiError) -> list[bytes]:
        """A failure after the 200 was sent: an error event, then the end (as vLLM does)."""
        return [sse(error.body()), DONE]


def sse(body: Any) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


DONE = b"data: [DONE]\n\n"
