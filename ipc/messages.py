"""The message types of every process boundary in Dovetail, as msgspec Structs.

On the wire each message is one msgpack map: ``{"type": "<ClassName>", "v": 2, <field>: ...}``.
``type`` selects the message; ``v`` is the protocol version (optional, but when present it must
equal :data:`PROTOCOL_VERSION`). Nested values (``Sampling``, ``RingRef``, ``TreeShape``,
``RequestStats``) are plain maps. Unknown fields, wrong types and out-of-range values are
refused when decoding; fields with defaults may be left out. ``docs/protocol.md`` documents
the client messages for implementers in other languages.

The strictness rules are msgspec's (a bool is not an int, an int is accepted for a float,
NaN fails every range); the limits are the ``Meta`` annotations below. ``ipc.codec`` turns
messages into bytes and back.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Raw, Struct, field

from .tree import MAX_DEPTH, MAX_TOP_K, MAX_TREE_TOKENS, TreeShape

PROTOCOL_VERSION = 2
MAX_THREADS = 65536  # a worker's intra-op threads (--cpu-threads, --draft-threads)

# The smallest positive temperature: below it softmax(logits / T) overflows to inf/NaN in fp32.
MIN_TEMPERATURE = 1e-5

Id = Annotated[str, Meta(min_length=1, max_length=256)]
SeqId = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
TokenId = Annotated[int, Meta(ge=0, le=(1 << 31) - 1)]
TokenIds = Annotated[list[TokenId], Meta(max_length=1 << 20)]  # a whole prompt
TreeTokens = Annotated[list[TokenId], Meta(max_length=MAX_TREE_TOKENS)]
TreeParents = Annotated[list[Annotated[int, Meta(ge=-1, le=MAX_TREE_TOKENS - 1)]], Meta(max_length=MAX_TREE_TOKENS)]
Millis = Annotated[float, Meta(ge=0.0, le=1e12)]
Count = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Dim = Annotated[int, Meta(ge=0, le=(1 << 31) - 1)]
# Prompts are limited in characters here; the coordinator checks tokens against the context.
Text = Annotated[str, Meta(max_length=16 * 1024 * 1024)]
MAX_STOPS, MAX_STOP_CHARS = 64, 1024  # a request's stop strings, and the characters of each
Stop = Annotated[list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]], Meta(max_length=MAX_STOPS)]
MAX_NEW_TOKENS = 1 << 20
MAX_DEADLINE_MS = (1 << 31) - 1
Role = Annotated[str, Meta(min_length=1, max_length=64)]
MAX_CHAT_MESSAGES = 16384
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
BlockDType = Literal["float16", "bfloat16", "float32"]
WorkerName = Annotated[str, Meta(max_length=64)]


class Message(Struct, tag_field="type", tag=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every top-level message: tagged by class name, carries the protocol version."""

    v: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if self.v != PROTOCOL_VERSION:
            raise ValueError(f"protocol version {self.v}, this side speaks {PROTOCOL_VERSION}")


class Nested(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base of values nested inside messages (plain maps, no type tag)."""


# --- values -----------------------------------------------------------------------------


class RingRef(Nested, frozen=True):
    """A [rows, cols] block in slot ``slot`` of shared-memory ring ``ring``, written with
    sequence number ``seq`` (see ipc.shm_ring). Hidden states travel only this way."""

    ring: Annotated[str, Meta(max_length=255)]
    slot: Count
    seq: Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
    rows: Dim
    cols: Dim
    dtype: BlockDType


class Sampling(Nested, frozen=True):
    """How the target picks tokens: temperature 0 is greedy; top_k 0 and top_p 1.0 switch
    those filters off; the same seed and settings repeat the output."""

    temperature: Annotated[float, Meta(ge=0.0, le=1000.0)] = 0.0
    top_k: Annotated[int, Meta(ge=0, le=(1 << 31) - 1)] = 0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)] | None = None

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class ChatMessage(Nested, frozen=True):
    """One turn of a chat (``GenerateRequest.messages``): rendered with the model's chat template."""

    role: Role
    content: Text


class RequestStats(Nested, frozen=True):
    """Per-request statistics (``GenerateDone.stats``)."""

    prompt_tokens: Count = 0  # the prompt's tokens (after the chat template, for messages)
    new_tokens: Count = 0
    cycles: Count = 0  # draft/verify cycles (dovetail) or decode steps (ar); the prefill not counted
    tau: float = 0.0  # tokens per cycle
    tokens_per_s: float = 0.0
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    draft_prompt_ms: float = 0.0  # of draft_ms, the first draft step's: the draft absorbing the prompt
    verify_ms: float = 0.0
    ipc_ms: float = 0.0  # wall time not spent computing in a worker
    wall_ms: float = 0.0
    accept_per_depth: list[Count] = []  # cycles that accepted 0, 1, 2, ... draft tokens
    lookup_nodes: Count = 0  # tree nodes a prompt-lookup branch added (copied from earlier in the sequence)
    lookup_tokens: Count = 0  # of the accepted draft tokens, those only such nodes offered
    # Cycles per tree shape verified, keyed "T/depth/top_k" (most used first).
    trees: Annotated[dict[Annotated[str, Meta(max_length=32)], Count], Meta(max_length=1024)] = {}


# --- client <-> coordinator -------------------------------------------------------------


class TokenLogprob(Nested, frozen=True):
    """The target's log-probability of one emitted token, and of the ``top_ids`` most likely
    tokens at that position (most likely first): log_softmax of the target's own logits at
    temperature 1, before top-k/top-p (never the draft's), the same in both modes."""

    logprob: float
    top_ids: Annotated[list[TokenId], Meta(max_length=MAX_LOGPROBS)] = []
    top_logprobs: Annotated[list[float], Meta(max_length=MAX_LOGPROBS)] = []


LogprobCount = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
TokenLogprobs = Annotated[list[TokenLogprob], Meta(max_length=1 << 20)]


class GenerateRequest(Message):
    """Generate for a raw ``prompt``, or for chat ``messages`` (the model's chat template turns
    them into the prompt): exactly one of the two."""

    request_id: Id
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_CHAT_MESSAGES)] | None = None
    max_new_tokens: Annotated[int, Meta(ge=1, le=MAX_NEW_TOKENS)] = 128
    stop: Stop = []
    sampling: Sampling = field(default_factory=Sampling)
    # None: the server's own mode (dovetail where it has a draft head, else ar, or lookup where it
    # was started with --mode lookup). lookup: plain decoding plus prompt lookup's branch, no draft.
    mode: Literal["dovetail", "ar", "lookup"] | None = None
    stream: bool = False
    # Answer within this many ms of the server receiving the request (queueing included),
    # else the request ends with ErrorReply code "deadline_exceeded". None: no limit of its own.
    deadline_ms: Annotated[int, Meta(ge=1, le=MAX_DEADLINE_MS)] | None = None
    # Each new token's log-probability with this many alternatives (TokenLogprob); None: none.
    logprobs: LogprobCount | None = None
    # Who the request is for: a user's requests take one turn between them in the queue's rotation,
    # whatever connections they come by (OpenAI's ``user``). None: the connection is the user.
    user: Id | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a GenerateRequest needs exactly one of prompt and messages")


class TokenChunk(Message):
    """Newly final tokens and text (only when the request asked for ``stream``)."""

    request_id: Id
    token_ids: TokenIds
    text: Text
    logprobs: TokenLogprobs = []  # one per token id, when the request asked for them


class GenerateDone(Message):
    """The end of a request: all new tokens, the whole new text and the statistics."""

    request_id: Id
    token_ids: TokenIds
    text: Text
    finish_reason: Literal["stop", "length", "cancelled"]
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: TokenLogprobs = []  # one per token id, when the request asked for them


class ErrorReply(Message):
    """The request failed, or a message could not be read (then ``request_id`` is None)."""

    request_id: Id | None
    code: Annotated[str, Meta(max_length=64)]
    message: Annotated[str, Meta(max_length=8192)]


class Cancel(Message):
    request_id: Id


class Ping(Message):
    nonce: int = 0


class Pong(Message):
    nonce: int = 0
    # Both workers are up and have said Ready: False while one loads, died or restarts (HTTP /health: 503).
    ready: bool = True


class MetricsRequest(Message):
    """Ask for the server's counters since it started (what HTTP ``GET /metrics`` shows)."""


class HistogramCounts(Nested, frozen=True):
    """A histogram: ``counts[i]`` observations in (bounds[i-1], bounds[i]], the last one above
    every bound; ``total`` their sum (Prometheus' cumulative buckets are built from these)."""

    bounds: Annotated[list[float], Meta(max_length=64)]
    counts: Annotated[list[Count], Meta(max_length=65)]
    total: Annotated[float, Meta(ge=0.0)] = 0.0


class MetricsReply(Message):
    """Counters since the server started; times are the sums of every request's statistics, but for the
    workers' busy seconds."""

    finished: dict[Annotated[str, Meta(max_length=64)], Count] = {}  # requests ended, by finish_reason
    errors: dict[Annotated[str, Meta(max_length=64)], Count] = {}  # requests failed, by error code
    prompt_tokens: Count = 0
    new_tokens: Count = 0
    cycles: Count = 0
    cycle_tokens: Count = 0  # tokens the cycles emitted: tau = cycle_tokens / cycles
    prefill_s: Annotated[float, Meta(ge=0.0)] = 0.0
    draft_s: Annotated[float, Meta(ge=0.0)] = 0.0
    verify_s: Annotated[float, Meta(ge=0.0)] = 0.0
    ipc_s: Annotated[float, Meta(ge=0.0)] = 0.0
    queue_depth: Count = 0  # requests waiting, the running one not counted
    running: Count = 0
    worker_restarts: Count = 0
    uptime_s: Annotated[float, Meta(ge=0.0)] = 0.0
    draft_tokens: Count = 0  # tree nodes drafted and verified (the root, the last token, not counted)
    accepted_tokens: Count = 0  # drafted tokens the target accepted
    # Seconds each worker computed for the requests, a batched pass once (the *_s above sum the requests').
    target_busy_s: Annotated[float, Meta(ge=0.0)] = 0.0
    draft_busy_s: Annotated[float, Meta(ge=0.0)] = 0.0
    # Latencies in seconds, by name: queue_time, time_to_first_token, inter_token_latency, e2e_request_latency.
    latency: dict[Annotated[str, Meta(max_length=64)], HistogramCounts] = {}


# --- coordinator <-> cpu_worker (target) ------------------------------------------------


class PrefillRequest(Message):
    """Run a prompt, or one chunk of it. ``offset`` 0 starts sequence ``seq_id`` (the worker keeps
    ``sampling`` and ``logprobs`` for the whole sequence); a later chunk names the prompt tokens
    already cached as its ``offset``. ``more``: chunks follow, answered with a PrefillPartial; the
    last chunk is answered with the PrefillResult of the whole prompt. With ``return_features``
    each answer carries the prompt's feature rows from position ``features_from`` (a chunk's start,
    at most ``offset``) through this chunk: the rows before it were read already, and the worker
    keeps the later ones until an answer carries them; a PrefillPartial carries them only with
    ``features_now`` (someone reads them now; else they stay kept).

    ``budget_ms`` > 0 lets the worker run a chunk that would run apart from a batch's other steps
    (one whose bits depend on its rows: fp32's prompt GEMM, bf16) a few layers at a time: it stops
    after the layers that fit in about that time (at least one) and answers PrefillPending; the
    same request again with ``resume`` runs the next layers. The chunk's bits are the same however
    its layers are split (``cpu_worker.prompt_parts``). 0: the whole chunk in this call."""

    seq_id: SeqId
    token_ids: TokenIds
    sampling: Sampling = field(default_factory=Sampling)
    return_features: bool = True
    logprobs: LogprobCount | None = None  # every result of the sequence carries TokenLogprobs
    offset: Count = 0
    more: bool = False
    features_from: Count = 0
    features_now: bool = False
    budget_ms: Millis = 0.0
    resume: bool = False  # go on with this chunk, part way through the layers (after a PrefillPending)


class PrefillAnswer(Message):
    """Any answer to a PrefillRequest (never sent itself): PrefillPending, PrefillPartial or PrefillResult."""

    seq_id: SeqId
    compute_ms: Millis = 0.0


class PrefillPending(PrefillAnswer, kw_only=True):
    """A chunk sent with a ``budget_ms`` has run ``layers_done`` of the target's ``layers`` layers:
    send the same request again with ``resume`` for the rest."""

    layers_done: Count
    layers: Count


class PrefillPartial(PrefillAnswer, kw_only=True):
    """A prompt chunk is cached; send the next one. ``features``: the rows from ``features_from``
    through this chunk (as the PrefillResult's), for the draft to read now (``DraftExtend``) or
    with a later answer."""

    features: RingRef | None = None


class PrefillResult(PrefillAnswer, kw_only=True):
    """The first new token, and when asked the prompt's feature rows from ``features_from`` on (the
    whole prompt's unless the draft read its first chunks already): the last layer's state after
    the final norm (hidden floats), or for an EAGLE-3 head the residual streams entering its three
    target layers side by side (3 x hidden)."""

    token: TokenId
    features: RingRef | None
    logprob: TokenLogprob | None = None  # when the sequence asked for logprobs


class VerifyRequest(Message):
    """Verify a compact draft tree (see ipc.tree): node 0 is the root."""

    seq_id: SeqId
    tokens: TreeTokens
    parents: TreeParents


class VerifyResult(Message):
    """k accepted draft tokens + 1 bonus token, and the k+1 feature rows of the root and the
    accepted nodes (the bonus token has none yet)."""

    seq_id: SeqId
    accepted_tokens: TreeTokens
    features: RingRef
    compute_ms: Millis = 0.0
    logprobs: Annotated[list[TokenLogprob], Meta(max_length=MAX_TREE_TOKENS)] = []  # one per accepted token


class DecodeRequest(Message):
    """One plain autoregressive step (``--mode ar``): feed ``token`` (the last emitted one,
    not cached yet) and pick the next."""

    seq_id: SeqId
    token: TokenId


class DecodeResult(Message):
    seq_id: SeqId
    token: TokenId
    compute_ms: Millis = 0.0
    logprob: TokenLogprob | None = None  # when the sequence asked for logprobs


MAX_RUN_STEPS = 64  # plain steps in one DecodeRun
MAX_STOP_IDS = 1024  # end-of-sequence ids one DecodeRun names


class DecodeRun(Message):
    """Up to ``steps`` plain steps in one call, for a sequence that runs alone: feed ``token`` (not
    cached yet), pick the next, feed that, and so on; the run ends early after a token in
    ``stop_ids`` (the end of the sequence), and with ``stop_at_repeat`` after a token that, with the
    one before it, repeats an earlier pair of the sequence (where prompt lookup has a branch to offer).
    The same tokens as ``steps`` DecodeRequests, without a round trip between them (~0.5-1 ms each at
    a 135M target's 4 ms step, on two cores)."""

    seq_id: SeqId
    token: TokenId
    steps: Annotated[int, Meta(ge=1, le=MAX_RUN_STEPS)]
    stop_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_IDS)] = []
    stop_at_repeat: bool = False


class DecodeRunResult(Message):
    """The run's picked tokens in order (the last one not cached yet); ``compute_ms``: all its steps."""

    seq_id: SeqId
    tokens: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_RUN_STEPS)]
    compute_ms: Millis = 0.0
    logprobs: Annotated[list[TokenLogprob], Meta(max_length=MAX_RUN_STEPS)] = []  # one per token, when asked


class ReleaseSequence(Message):
    """Forget sequence ``seq_id`` (its KV cache); sent to both workers."""

    seq_id: SeqId


# --- coordinator <-> gpu_worker (draft) -------------------------------------------------


class DraftRequest(Message):
    """Feed ``tokens`` paired with the rows of ``features`` (row i with tokens[i]) into the
    draft's KV cache, then expand a tree of ``shape``. ``reset``: a new sequence."""

    seq_id: SeqId
    tokens: TokenIds
    features: RingRef
    shape: TreeShape
    reset: bool = False


class DraftExtend(Message):
    """Feed ``tokens`` paired with the rows of ``features`` into the draft's KV cache, no tree: a
    long prompt's chunks so far, read while other sequences run (so no single draft step absorbs a
    whole long prompt while they wait). ``reset``: a new sequence. ``defer``: keep the pairs (off
    the ring) without reading them yet; the sequence's next draft step reads them with its own (a
    request that decodes plainly in a busy batch to its end never pays for reading its prompt)."""

    seq_id: SeqId
    tokens: Annotated[list[TokenId], Meta(min_length=1, max_length=1 << 20)]
    features: RingRef
    reset: bool = False
    defer: bool = False


class DraftExtended(Message):
    seq_id: SeqId
    compute_ms: Millis = 0.0


class DraftResult(Message):
    """A compact tree: ``tokens[T]`` and ``parents[T]``, target ids only (a head with a reduced
    draft vocabulary maps its ids before the tree leaves the gpu_worker)."""

    seq_id: SeqId
    tokens: TreeTokens
    parents: TreeParents
    compute_ms: Millis = 0.0


# --- several sequences at once (``--max-batch``) ------------------------------------------

MAX_BATCH = 64  # sequences a worker holds at once, and items in one batch message


class StepBatch(Message):
    """cpu_worker: several sequences' decode steps and trees, and a new sequence's prompt chunk,
    verified in one target forward (``cpu_worker.batched``); each gets exactly the result it would
    get alone."""

    items: Annotated[list[DecodeRequest | VerifyRequest | PrefillRequest], Meta(min_length=1, max_length=MAX_BATCH)]


class StepBatchResult(Message):
    """One result per item, in order; a WorkerError for an item that failed (the others ran)."""

    items: Annotated[list[DecodeResult | VerifyResult | PrefillPending | PrefillPartial | PrefillResult | WorkerError],
                     Meta(max_length=MAX_BATCH)]
    compute_ms: Millis = 0.0  # the whole batch's


class DraftBatch(Message):
    """gpu_worker: several sequences' draft steps (and prompt chunks: ``DraftExtend``), drafted
    together (their extends in one head forward, then one per tree level)."""

    items: Annotated[list[DraftRequest | DraftExtend], Meta(min_length=1, max_length=MAX_BATCH)]


class DraftBatchResult(Message):
    items: Annotated[list[DraftResult | DraftExtended | WorkerError], Meta(max_length=MAX_BATCH)]  # compute_ms: a share
    compute_ms: Millis = 0.0  # the whole batch's


# --- cost measurements (the tree planner's inputs, asked once at startup) ----------------

TreeSizes = Annotated[list[Annotated[int, Meta(ge=1, le=MAX_TREE_TOKENS)]], Meta(min_length=1, max_length=64)]
Depths = Annotated[list[Annotated[int, Meta(ge=1, le=MAX_DEPTH)]], Meta(min_length=1, max_length=MAX_DEPTH)]


class MeasureVerifyCost(Message):
    """cpu_worker: time one tree verification of each size (a cache may answer)."""

    tree_sizes: TreeSizes


class VerifyCost(Message):
    tree_sizes: TreeSizes
    ms: list[Millis]
    cached: bool = False  # read from the cost cache, not measured now
    cache_path: Annotated[str, Meta(max_length=4096)] = ""


class MeasureDraftCost(Message):
    """gpu_worker: time one draft step (absorb the accepted pairs, propose a tree) per depth."""

    depths: Depths
    top_k: Annotated[int, Meta(ge=1, le=MAX_TOP_K)]


class DraftCost(Message):
    depths: Depths
    ms: list[Millis]
    cached: bool = False  # read from the cost cache, not measured now
    cache_path: Annotated[str, Meta(max_length=4096)] = ""


# --- worker lifecycle -------------------------------------------------------------------
# A worker's settings reach it as JSON in its --settings argument (``ipc.codec.encode_settings``,
# ``decode_settings``); what it reports once loaded travels in ``Ready.info``.

Folder = Annotated[str, Meta(min_length=1, max_length=4096)]  # a model folder
Name = Annotated[str, Meta(max_length=64)]  # a dtype, device, kernel or log level
RingName = Annotated[str, Meta(min_length=1, max_length=255)]
Cores = Annotated[list[Count], Meta(max_length=65536)]
Layers = Annotated[list[Count], Meta(max_length=1024)]


class RingNames(Nested, frozen=True):
    """The coordinator's two shared-memory rings (ipc.shm_ring): a cycle's few feature rows,
    and a whole prompt's."""

    cycle: RingName
    prefill: RingName


class WorkerSettings(Nested, frozen=True, kw_only=True):
    """What the coordinator tells either worker when it starts it. ``threads``/``cores``: its
    CPU placement (None: torch's own threads, unpinned)."""

    log_level: Name = "info"
    max_len: Annotated[int, Meta(ge=1, le=(1 << 31) - 1)]  # the context in tokens
    rings: RingNames
    threads: Annotated[int, Meta(ge=1, le=MAX_THREADS)] | None = None
    cores: Cores | None = None
    max_sequences: Annotated[int, Meta(ge=1, le=MAX_BATCH)] = 1  # sequences held at once (--max-batch)


class TargetSettings(WorkerSettings, frozen=True, kw_only=True):
    """The cpu_worker's: the target folder, its precision, and for an EAGLE-3 head the three
    target layers whose inputs make a feature row."""

    target: Folder
    dtype: Name = "fp32"
    aux_layers: Layers = []
    kv_dtype: Name = "auto"


class DraftSettings(WorkerSettings, frozen=True, kw_only=True):
    """The gpu_worker's: the head folder (and the target's, for an EAGLE head's embeddings),
    the scratch slots its trees need, and the feature rows the coordinator sized the rings for
    (``row_width`` floats, ``layout`` in words), which the loaded head must read."""

    draft: Folder
    target: Folder | None = None
    device: Name = "auto"
    dtype: Name = "auto"
    scratch_len: Count
    row_width: Dim | None = None
    layout: Annotated[str, Meta(max_length=1024)] | None = None


class TargetInfo(Nested, frozen=True):
    """The cpu_worker's ``Ready.info``: its placement, context, sizes, precision and kernel
    (None for bf16), and whether trees verify bit-exact against one-token decoding."""

    threads: Count
    cores: Cores
    max_len: Count
    hidden_size: Dim
    vocab_size: Dim
    dtype: Name
    weight_bytes: Count
    kv_cache_bytes: Count
    kv_dtype: Name
    exact_tree: bool
    kernel: Name | None
    feature_size: Dim
    aux_layers: Layers
    # A prompt's bits do not depend on its chunks: the coordinator may cut it by load (--join-chunk).
    chunk_invariant: bool = False


class DraftInfo(Nested, frozen=True):
    """The gpu_worker's ``Ready.info``: its device and precision, placement and head shape."""

    device: Name
    dtype: Name
    threads: Count
    cores: Cores
    layers: Count
    ring_pinned: bool  # the cycle ring is page-locked memory for CUDA
    scratch_len: Count
    fusion: Name
    feature_size: Dim
    draft_vocab_size: Dim




class Ready(Message):
    """Handshake: the worker has loaded its model and serves. ``info``: what it reports, a
    ``TargetInfo`` (cpu_worker) or a ``DraftInfo`` (gpu_worker) as a plain map, kept undecoded
    here (one message type for both workers) and read by the coordinator as the one it expects
    of that worker (``ipc.codec.encode_info``/``decode_info``)."""

    worker: WorkerName
    pid: Count
    info: Raw = Raw(b"\x80")  # an empty map


class WorkerError(Message):
    """A worker could not do what was asked (``seq_id`` when it concerns one sequence;
    ``fatal``: the worker is about to exit)."""

    worker: WorkerName
    message: Annotated[str, Meta(max_length=65536)]
    seq_id: SeqId | None = None
    fatal: bool = False


class Shutdown(Message):
    """Ask a worker to release everything and exit."""


CLIENT_TO_COORDINATOR: tuple[type[Message], ...] = (GenerateRequest, Cancel, Ping, MetricsRequest)
COORDINATOR_TO_CLIENT: tuple[type[Message], ...] = (TokenChunk, GenerateDone, ErrorReply, Pong, MetricsReply)
TO_CPU_WORKER: tuple[type[Message], ...] = (PrefillRequest, VerifyRequest, DecodeRequest, DecodeRun, StepBatch,
                                            ReleaseSequence, MeasureVerifyCost, Shutdown, Ping)
FROM_CPU_WORKER: tuple[type[Message], ...] = (PrefillResult, PrefillPartial, PrefillPending, VerifyResult, DecodeResult,
                                              DecodeRunResult, StepBatchResult, VerifyCost, Ready, WorkerError, Pong)
TO_GPU_WORKER: tuple[type[Message], ...] = (DraftRequest, DraftExtend, DraftBatch, ReleaseSequence, MeasureDraftCost,
                                            Shutdown, Ping)
FROM_GPU_WORKER: tuple[type[Message], ...] = (DraftResult, DraftExtended, DraftBatchResult, DraftCost, Ready,
                                              WorkerError, Pong)
ALL_MESSAGES: tuple[type[Message], ...] = tuple(dict.fromkeys(
    CLIENT_TO_COORDINATOR + COORDINATOR_TO_CLIENT + TO_CPU_WORKER + FROM_CPU_WORKER + TO_GPU_WORKER
    + FROM_GPU_WORKER))
