"""One request's decoding loop, driven by the coordinator over the two workers.

dovetail mode: prefill (cpu) -> [draft (gpu) -> verify (cpu)] ... , and plain decode steps while
no tree pays (a request alone: ``plain_fallback``; in a busy batch: ``TreePlanner.batch_shape``), back
to trees when one does; ar mode: prefill -> decode -> decode ... on the cpu_worker alone. A long
prompt's prefill is several calls, one per chunk of ``Job.prefill_chunk`` tokens, or in a busy
batch of ``Job.join_chunk()`` where the target allows it (elsewhere a chunk may take several calls
there, a few layers each: ``chunk_steps``; dovetail in a busy batch: the draft reads each chunk's
feature rows before the next chunk). Each loop is a
generator (``ar_steps``, ``dovetail_steps``) that yields its next worker request (a ``Call``) and
is sent the reply, so one driver runs it alone (``run_alone``: ``generate_ar``,
``generate_dovetail``) and another runs many side by side, their calls merged into batches
(``dovetail_runtime.batching``).

Tokens go to ``emit`` as soon as they are accepted, with their log-probabilities when the job
asks for them (else an empty list); ``emit`` returns True to stop (a stop string, a client that
went away). Between two chunks of a long prompt ``emit([], [])`` is asked the same.

Both modes count the context the same way (``Context``): a sequence of ``length`` tokens
has ``length - 1`` of them in the KV cache (the last emitted one is not cached yet), and a
step needs at least one free slot for it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

import msgspec

from ipc import messages as m
from ipc.tree import MAX_TREE_TOKENS, TreeShape

from .lookup import PromptLookup, copied, graft, shared_prefix
from .lookup_policy import BranchPolicy
from .plain_runs import LONGEST_RUN, RunSizer
from .tree_planner import FixedTree, ShapePlanner, draft_path


@dataclass(frozen=True)
class Stop:
    """An emitter's answer that ends the request after the first ``kept`` of the tokens it was given: a
    stop string that ends inside a cycle's tokens (the rest were never ar's: ar would have stopped)."""

    kept: int


# Is given each cycle's tokens (and their log-probabilities, when asked); answers whether the request
# stops there: False to go on, True to stop keeping them all, Stop to keep only the first few.
Emit = Callable[[list[int], list[m.TokenLogprob]], bool | Stop]
# Prompt tokens per prefill call (--prefill-chunk): a GEMM's worth of rows, few enough that a long
# prompt delays the running requests by one such chunk per round.
DEFAULT_PREFILL_CHUNK = 256
FinishReason = Literal["stop", "length"]
R = TypeVar("R", bound=m.Message)


class Worker(Protocol):
    """What the cycle needs of a worker: a WorkerHandle (a process) or a LocalWorker."""

    def request(self, message: m.Message, expect: type[R]) -> R: ...

    def send(self, message: m.Message) -> None: ...


class PromptTooLong(ValueError):
    """The prompt leaves no room in the context for a new token."""


class EmptyPrompt(PromptTooLong):
    """The prompt has no tokens: there is nothing to continue from."""


@dataclass(frozen=True)
class Job:
    """What one request asks of the workers."""

    seq_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: m.Sampling
    eos_token_ids: frozenset[int]
    max_len: int
    logprobs: int | None = None  # alternatives per token's log-probability; None: none
    # Prompt tokens per prefill call (``prefill_steps``); None: the whole prompt in one. Every mode
    # chunks a prompt alike (and in a busy batch only a chunk-invariant target cuts it otherwise,
    # ``join_chunk``), so its bits never depend on the mode or on what else runs.
    prefill_chunk: int | None = None
    # Prompt tokens for the next call while other sequences run, asked call by call (sized so a long
    # prompt stalls them about one cycle a round, ``join_sizing``; None back: no other sequence is
    # decoding, ``prefill_chunk``). Only for a target whose prompt bits do not depend on the chunks
    # (``TargetInfo.chunk_invariant``); None: ``prefill_chunk`` always.
    join_chunk: Callable[[], int | None] | None = None
    # For a target whose prompt bits depend on the chunks: ms of layers a ``prefill_chunk`` piece
    # may run per round while others decode, asked call by call (``PrefillRequest.budget_ms``; None
    # back while nobody decodes: the whole piece at once). None: every piece whole.
    join_budget: Callable[[], float | None] | None = None


@dataclass(frozen=True)
class Context:
    """The KV cache's capacity, counted once for both modes."""

    max_len: int

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        if not prompt_ids:
            raise EmptyPrompt("the prompt is empty after tokenization")
        if len(prompt_ids) >= self.max_len:
            raise PromptTooLong(f"prompt of {len(prompt_ids)} tokens leaves no room in the context of "
                                f"{self.max_len} tokens")

    def room(self, length: int) -> int:
        """Free cache slots for a sequence of ``length`` tokens (the last one not cached yet)."""
        return self.max_len - (length - 1)


@dataclass
class Stats:
    new_tokens: int = 0
    cycles: int = 0  # draft/verify cycles (dovetail) or decode steps (ar); prefill not counted
    cycle_tokens: int = 0  # tokens those cycles emitted (all but the prefill's token)
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    draft_prompt_ms: float = 0.0  # of draft_ms, the first step's (the draft absorbing the prompt)
    verify_ms: float = 0.0
    wall_ms: float = 0.0
    accept_per_depth: list[int] = field(default_factory=list)
    trees: collections.Counter[str] = field(default_factory=collections.Counter)  # "T/depth/top_k": cycles
    lookup_nodes: int = 0  # tree nodes a prompt-lookup branch added (``lookup``)
    lookup_tokens: int = 0  # accepted tokens that only such nodes offered

    def record_cycle(self, shape: TreeShape, draft_ms: float, verify_ms: float, accepted: int,
                     grafted: int = 0) -> None:
        """One draft/verify cycle of ``shape`` that emitted ``accepted`` tokens, ``grafted`` of them on a
        lookup branch's own nodes. The first cycle's draft step also absorbed the prompt (or its last
        chunk: ``prefill_steps`` counts the others')."""
        self.lookup_tokens += grafted
        if self.cycles == 0:
            self.draft_prompt_ms += draft_ms
        self.draft_ms += draft_ms
        self.verify_ms += verify_ms
        self.cycles += 1
        self.cycle_tokens += accepted
        self.accept_per_depth[accepted - 1] += 1
        self.trees[f"{shape.tree_tokens}/{shape.depth}/{shape.top_k}"] += 1

    def record_plain_step(self, emitted: int) -> None:
        """A plain step of a dovetail or lookup request (already counted as a cycle) that emitted
        ``emitted`` tokens (more than one: prompt lookup's branch): shown as a one-node tree with
        nothing drafted (top_k 0)."""
        self.trees["1/0/0"] += 1
        self.accept_per_depth[emitted - 1] += 1
        self.lookup_tokens += emitted - 1

    def message(self) -> m.RequestStats:
        compute = self.prefill_ms + self.draft_ms + self.verify_ms
        seconds = self.wall_ms / 1e3
        return m.RequestStats(
            new_tokens=self.new_tokens, cycles=self.cycles,
            tau=self.cycle_tokens / self.cycles if self.cycles else 0.0,
            tokens_per_s=self.new_tokens / seconds if seconds > 0 else 0.0,
            prefill_ms=round(self.prefill_ms, 3), draft_ms=round(self.draft_ms, 3),
            draft_prompt_ms=round(self.draft_prompt_ms, 3), verify_ms=round(self.verify_ms, 3),
            # Time not spent computing in a worker: messages, ring copies, coordinator work.
            ipc_ms=round(max(self.wall_ms - compute, 0.0), 3), wall_ms=round(self.wall_ms, 3),
            accept_per_depth=list(self.accept_per_depth), lookup_nodes=self.lookup_nodes,
            lookup_tokens=self.lookup_tokens,
            trees=dict(self.trees.most_common()))


class Budget:
    """Cuts emitted tokens at max_new_tokens and after an end-of-sequence token; says when to stop."""

    def __init__(self, max_new_tokens: int, eos_token_ids: frozenset[int], emit: Emit, stats: Stats):
        self.left = max_new_tokens
        self.eos = eos_token_ids
        self.emit = emit
        self.stats = stats
        self.finish_reason: FinishReason | None = None
        self.kept: list[int] = []  # every token emitted so far

    def push(self, tokens: Sequence[int], logprobs: Sequence[m.TokenLogprob] = ()) -> bool:
        kept = list(tokens[: self.left])
        end = next((index for index, token in enumerate(kept) if token in self.eos), None)
        if end is not None:
            kept = kept[: end + 1]
        answer = self.emit(kept, list(logprobs[: len(kept)])) if kept else False
        if isinstance(answer, Stop):
            kept = kept[: answer.kept]
        self.left -= len(kept)
        self.kept += kept
        self.stats.new_tokens += len(kept)
        # A stop (an end-of-sequence token, a stop string) on the last token the budget allows is a stop.
        if (end is not None and end < len(kept)) or answer:
            self.finish_reason = "stop"
        elif self.left == 0:
            self.finish_reason = "length"
        return self.finish_reason is not None


@dataclass(frozen=True)
class Call:
    """A loop's next request: to the cpu_worker (``"cpu"``) or the gpu_worker, and the reply it expects."""

    worker: Literal["cpu", "gpu"]
    message: m.Message
    expect: type[m.Message]
    # A draft step that also reads the prompt's rows (a dovetail stream's first): its round is
    # not a plain cycle for --join-chunk's measurements (``join_sizing``).
    reads_prompt: bool = False
    # A prompt chunk: the prompt tokens not cached yet, its own included (a batch runs the chunk of
    # the prompt with the fewest first, so a short prompt never waits out a long one's prefill).
    prompt_left: int = 0


# Yields Calls, is sent each one's reply, returns how the request ended.
Steps = Generator[Call, m.Message, tuple[FinishReason, Stats]]


def _reply(reply: m.Message, expect: type[R]) -> R:
    if not isinstance(reply, expect):
        raise TypeError(f"expected {expect.__name__}, got {type(reply).__name__}")
    return reply


Prefilled = tuple[m.PrefillResult, int]  # the last chunk's answer, where its feature rows start


def prefill_steps(job: Job, stats: Stats, emit: Emit, feed_draft: bool, together: Callable[[], int] = lambda: 1,
                  draft_reads: Callable[[int], bool] = lambda _: True) -> Generator[Call, m.Message, Prefilled | None]:
    """The prompt's prefill, ``job.prefill_chunk`` tokens per call (a batch runs one call per round, so a long prompt
    holds up the running streams one chunk at a time, not for its whole prefill), or ``job.join_chunk()`` per
    call while others decode (asked call by call). With ``feed_draft`` (dovetail) the answers carry the
    prompt's feature rows; while other sequences run (``together() > 1``) the draft reads each chunk's rows (a
    DraftExtend) before the next chunk, so it never absorbs a whole long prompt in one step while they wait
    either, unless ``draft_reads(together())`` says no tree may pay at that load: then the cpu_worker keeps
    the rows and the last answer carries them all (a busy batch's sequence decodes plainly and its draft need
    not read them, maybe ever). Alone, it reads them with its first tree, after the first token. Returns the
    last chunk's PrefillResult and the prompt position its rows start at (what the draft has not read); the
    compute times go to ``stats``. Between two chunks ``emit([], [])`` is asked whether to stop (a cancel, a
    deadline, a client gone): then None, the rest of the prompt never run."""
    prompt = job.prompt_ids
    alone_size = job.prefill_chunk or len(prompt)
    if alone_size < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {alone_size}")
    unread = 0  # the first prompt position whose feature row the draft has not read
    offset = 0
    while offset < len(prompt):
        if offset and emit([], []):
            return None
        batched = together()
        busy = batched > 1
        joining = job.join_chunk() if busy and job.join_chunk is not None else None
        size = alone_size if joining is None else joining
        if size < 1:
            raise ValueError(f"a prompt chunk of {size} tokens")
        more = offset + size < len(prompt)
        read_now = feed_draft and more and busy and draft_reads(batched)  # else the rows wait for the last answer
        request = m.PrefillRequest(seq_id=job.seq_id, token_ids=prompt[offset:offset + size], sampling=job.sampling,
                                   return_features=feed_draft, logprobs=job.logprobs, offset=offset, more=more,
                                   features_from=unread, features_now=read_now)
        answer = yield from chunk_steps(job, request, len(prompt) - offset, stats, emit, busy)
        if answer is None:  # stopped between two parts of the chunk
            return None
        if not more:
            result = _reply(answer, m.PrefillResult)
            if feed_draft and result.features is None:
                raise RuntimeError("the cpu_worker returned no prompt features")
            return result, unread
        partial = _reply(answer, m.PrefillPartial)
        if read_now:
            if partial.features is None:
                raise RuntimeError("the cpu_worker returned no features for a prompt chunk")
            # Pairs: the feature of position i with token i + 1, all inside the prompt here.
            end = offset + size
            chunk = m.DraftExtend(seq_id=job.seq_id, tokens=prompt[unread + 1:end + 1], features=partial.features,
                                  reset=unread == 0)
            extended = _reply((yield Call("gpu", chunk, m.DraftExtended)), m.DraftExtended)
            stats.draft_ms += extended.compute_ms
            stats.draft_prompt_ms += extended.compute_ms
            unread = end
        offset += size
    raise EmptyPrompt("the prompt is empty after tokenization")


def chunk_steps(job: Job, request: m.PrefillRequest, prompt_left: int, stats: Stats, emit: Emit,
                busy: bool) -> Generator[Call, m.Message, m.PrefillAnswer | None]:
    """One prompt chunk's answer (a PrefillPartial, or the last chunk's PrefillResult). While others
    decode, a chunk of a target whose prompt bits depend on the cuts may run in parts of a few
    layers, one per round (``Job.join_budget``: the worker answers PrefillPending until the last
    part); None: stopped between two parts (``emit([], [])``, as between chunks)."""
    budget = job.join_budget() if busy and job.join_budget is not None else None
    request = msgspec.structs.replace(request, budget_ms=budget or 0.0)
    while True:
        answer = _reply((yield Call("cpu", request, m.PrefillAnswer, prompt_left=prompt_left)), m.PrefillAnswer)
        stats.prefill_ms += answer.compute_ms
        if not isinstance(answer, m.PrefillPending):
            return answer
        if emit([], []):
            return None
        # The next part, sized for the batch as it is now (none left running: the rest at once).
        budget = job.join_budget() if job.join_budget is not None else None
        request = msgspec.structs.replace(request, resume=True, budget_ms=budget or 0.0)


def ar_steps(job: Job, emit: Emit, batch: Callable[[], int] = lambda: 1, lookup_tokens: int = 0,
             verify_ms: Mapping[int, float] | None = None) -> Steps:
    """Plain decoding; ``batch()``: how many sequences run together now (a joining prompt's chunks).
    ``lookup_tokens`` > 0: lookup decoding (``--mode lookup``), no draft head: while the sequence runs
    alone, each step also verifies prompt lookup's branch of up to that many tokens (``lookup``), as
    much of it as pays at the costs ``verify_ms`` (t_verify(T); ``lookup_policy``; without them the
    whole branch), so a step emits the target's next token and as many more as the branch copied
    right: ar's tokens."""
    seq_id, context = job.seq_id, Context(job.max_len)
    stats = Stats(accept_per_depth=[0] * (lookup_tokens + 1) if lookup_tokens else [])
    budget = Budget(job.max_new_tokens, job.eos_token_ids, emit, stats)
    lookup, on_step = lookup_decoding(job, budget, stats, batch, lookup_tokens, verify_ms)
    started = time.perf_counter()
    try:
        context.check_prompt(job.prompt_ids)
        prefilled = yield from prefill_steps(job, stats, emit, False, batch)
        if prefilled is None:  # stopped between two prompt chunks
            return "stop", stats
        result = prefilled[0]
        if not budget.push([result.token], [result.logprob] if result.logprob else []):
            yield from plain_steps(seq_id, result.token, len(job.prompt_ids) + 1, context, budget, stats,
                                   lookup=lookup, on_step=on_step, runs=RunSizer(lambda: alone_cap(batch)))
    finally:
        stats.wall_ms = (time.perf_counter() - started) * 1e3
    return budget.finish_reason or "stop", stats


def plain_steps(seq_id: int, token: int, length: int, context: Context, budget: Budget, stats: Stats,
                until: Callable[[], bool] | None = None, lookup: Lookup | None = None,
                on_step: Callable[[int], None] | None = None,
                runs: RunSizer | None = None) -> Generator[Call, m.Message, tuple[int, int] | None]:
    """Plain decode steps from ``token`` (emitted, not cached yet; the sequence ``length`` tokens
    long) until the budget or the context ends (None): ar's loop, and dovetail's under sustained
    load. ``until``: asked before each call but the first (whoever calls has just decided on a plain
    step); when it says so the steps stop there and return the pending token and the length, to go on
    another way. ``lookup``: a dovetail request's prompt lookup (``lookup_step``); ``on_step``: told
    each step's emitted tokens; ``runs``: how many steps one call may take where lookup offers no
    branch (``plain_runs``; one without; with lookup a run ends where it may offer one)."""
    first = True
    while True:
        if context.room(length) < 1:
            budget.finish_reason = "length"
            return None
        if until is not None and not first and until():
            return token, length
        first = False
        if lookup is not None and (branch := lookup(branch_room(context, length, 1))):
            step = yield from lookup_step(seq_id, token, branch, stats)
            emitted, logprobs, sizes = step.accepted_tokens, step.logprobs, [len(step.accepted_tokens)]
        else:
            count = runs.steps(min(budget.left, context.room(length))) if runs is not None else 1
            emitted, logprobs = yield from decode_steps(seq_id, token, count, budget.eos, stats, runs,
                                                        stop_at_repeat=lookup is not None)
            sizes = []
        before = len(budget.kept)
        stopped = budget.push(emitted, logprobs)
        if not sizes:  # plain steps: as many as one a call would have taken (a stop string cuts a run)
            steps = max(len(budget.kept) - before, 1) if stopped else len(emitted)
            stats.cycles += steps
            stats.cycle_tokens += steps
            sizes = [1] * steps
        if on_step is not None:
            for size in sizes:
                on_step(size)
        if stopped:
            return None
        token = emitted[-1]
        length += len(emitted)


def told_planner(on_step: Callable[[int], None], planner: ShapePlanner,
                 batch: Callable[[], int]) -> Callable[[int], None]:
    """``on_step``, and the planner told of each plain step a lone sequence takes: its fallback's probe
    trees come after so many, however many a call takes (``plain_runs``) and wherever a stretch ends."""

    def stepped(emitted: int) -> None:
        on_step(emitted)
        if batch() == 1:
            planner.plain_stepped()

    return stepped


def alone_cap(batch: Callable[[], int], cap: Callable[[], int] = lambda: LONGEST_RUN) -> int:
    """A plain call's most steps: ``cap()`` while the sequence runs alone, one in a batch."""
    return cap() if batch() == 1 else 1


def decode_steps(seq_id: int, token: int, steps: int, stop_ids: frozenset[int], stats: Stats,
                 runs: RunSizer | None, stop_at_repeat: bool = False,
                 ) -> Generator[Call, m.Message, tuple[list[int], list[m.TokenLogprob]]]:
    """``steps`` plain steps from ``token``: a DecodeRequest for one, a DecodeRun for more (it ends
    early after an id of ``stop_ids``, and with ``stop_at_repeat`` where prompt lookup may have a
    branch: ``cpu_worker.repeat_watch``). Returns the picked tokens and their logprobs (when asked);
    the stats (``verify_ms``; the caller counts the steps the answer keeps) and ``runs`` are told what
    the steps cost."""
    if steps == 1:
        decoded = _reply((yield Call("cpu", m.DecodeRequest(seq_id=seq_id, token=token), m.DecodeResult)),
                         m.DecodeResult)
        tokens, logprobs, compute_ms = [decoded.token], [decoded.logprob] if decoded.logprob else [], decoded.compute_ms
    else:
        # (More end ids than a message holds: the rest end the answer in Budget, after a longer run.)
        request = m.DecodeRun(seq_id=seq_id, token=token, steps=steps, stop_ids=sorted(stop_ids)[:m.MAX_STOP_IDS],
                              stop_at_repeat=stop_at_repeat)
        ran = _reply((yield Call("cpu", request, m.DecodeRunResult)), m.DecodeRunResult)
        if len(ran.tokens) > steps or len(ran.logprobs) not in (0, len(ran.tokens)):
            raise RuntimeError(f"a run of {steps} steps answered {len(ran.tokens)} tokens, "
                               f"{len(ran.logprobs)} logprobs")
        tokens, logprobs, compute_ms = ran.tokens, ran.logprobs, ran.compute_ms
    stats.verify_ms += compute_ms
    if runs is not None:
        runs.observe(len(tokens), compute_ms)
    return tokens, logprobs


# A dovetail request's prompt lookup: the branch to graft after its emitted tokens, at most this long.
Lookup = Callable[[int], list[int]]


def branch_room(context: Context, length: int, tree_tokens: int) -> int:
    """The longest branch a tree of ``tree_tokens`` nodes may grow by: its cache slots and a message's
    nodes are bounded."""
    return min(context.room(length), MAX_TREE_TOKENS) - tree_tokens


def lookup_step(seq_id: int, token: int, branch: Sequence[int], stats: Stats,
                ) -> Generator[Call, m.Message, m.VerifyResult]:
    """A plain step with prompt lookup's branch after ``token``: a chain verified as a tree, so the
    step emits the target's next token and as many more as the branch guessed right."""
    request = m.VerifyRequest(seq_id=seq_id, tokens=[token, *branch], parents=list(range(-1, len(branch))))
    verified = _reply((yield Call("cpu", request, m.VerifyResult)), m.VerifyResult)
    stats.lookup_nodes += len(branch)
    stats.verify_ms += verified.compute_ms
    stats.cycles += 1
    stats.cycle_tokens += len(verified.accepted_tokens)
    return verified


def dovetail_steps(job: Job, tree: TreeShape | ShapePlanner, emit: Emit,
                   batch: Callable[[], int] = lambda: 1, lookup_tokens: int = 0,
                   verify_ms: Mapping[int, float] | None = None) -> Steps:
    """Speculative decoding; ``tree``: a fixed shape, or a planner that picks each cycle's; ``batch()``: how
    many sequences' cycles are verified together now (the planner sizes trees by it); ``lookup_tokens``: the
    longest branch copied from earlier in the sequence onto each tree (``lookup``) and its plain steps, as much
    as pays at ``verify_ms`` (``branch_sources``); its plain steps several a call while alone (``plain_runs``),
    up to the fallback's next probe."""
    planner = FixedTree(tree) if isinstance(tree, TreeShape) else tree
    seq_id, prompt_ids, context = job.seq_id, job.prompt_ids, Context(job.max_len)
    stats = Stats(accept_per_depth=[0] * (max(planner.envelope.depth, lookup_tokens) + 1))  # branches run deeper
    budget = Budget(job.max_new_tokens, job.eos_token_ids, emit, stats)
    lookup = prompt_lookup(prompt_ids, budget, lookup_tokens) if lookup_tokens else None
    policy, plain_lookup, on_plain_step = branch_sources(lookup, batch, stats, verify_ms)
    runs, started = RunSizer(lambda: alone_cap(batch, planner.plain_run_cap)), time.perf_counter()
    try:
        context.check_prompt(prompt_ids)
        prefilled = yield from prefill_steps(job, stats, emit, True, batch, planner.trees_may_pay)
        if prefilled is None:  # stopped between two prompt chunks
            return "stop", stats
        prefill, unread = prefilled
        assert prefill.features is not None  # prefill_steps checked (feed_draft)
        # Draft pairs: feature of position i with token i+1; the first new token closes the prompt. The first
        # step reads the rows from ``unread`` on (all, unless the draft read chunks while others ran).
        feed = DraftFeed(prompt_ids[unread + 1:] + [prefill.token], prefill.features, fresh=unread == 0)
        length, planned = len(prompt_ids) + 1, None
        if budget.push([prefill.token], [prefill.logprob] if prefill.logprob else []):
            return budget.finish_reason or "stop", stats
        while True:
            if (room := context.room(length)) < 1:
                budget.finish_reason = "length"
                break
            together = batch()
            shape, planned = (planned or planner.shape(together)).fitted(room), None  # planned: what ended plain
            if shape.tree_tokens == 1 and (not feed.prompt or together > 1 or not planner.trees_may_pay(together)):
                # No tree pays (alone: the planner's fallback; in a busy batch: its load): plain steps until one
                # does, not one-node trees (a head's step and a round trip each, for nothing: the draft goes on
                # well without those positions, below). Alone the first cycle drafts: the prompt; in a busy batch,
                # or where the costs leave no tree a chance, the draft keeps the prompt's rows unread until then.
                if feed.prompt and not feed.kept:
                    yield from defer_prompt(seq_id, feed)
                resumed = yield from plain_until_tree(seq_id, feed.tokens[-1], length, context, budget, stats,
                                                      lambda: planner.shape(batch()), plain_lookup,
                                                      told_planner(on_plain_step, planner, batch), runs)
                if resumed is None:
                    break
                verified, length, planned = resumed
                # The draft goes on from its own context, without the plain steps: restarted from this
                # one row it accepted 1.27 tokens a cycle at first (real pair, 8/4/4); this way 2.59.
                feed.tokens, feed.features = verified.accepted_tokens, verified.features
                continue
            branch = [] if lookup is None else lookup(branch_room(context, length, shape.tree_tokens))
            verified = yield from tree_cycle(seq_id, feed, shape, planner, together, stats, branch, policy)
            length += len(verified.accepted_tokens)
            feed = DraftFeed(verified.accepted_tokens, verified.features, fresh=False, prompt=False)
            if budget.push(verified.accepted_tokens, verified.logprobs):
                break
    finally:
        stats.wall_ms = (time.perf_counter() - started) * 1e3
    return budget.finish_reason or "stop", stats


def prompt_lookup(prompt_ids: Sequence[int], budget: Budget, max_tokens: int) -> Lookup:
    """The sequence's prompt lookup (``lookup.PromptLookup``) over its prompt and every token the
    budget has emitted so far: its branch, at most so many tokens long and no longer than the
    tokens the budget has left need. The index is built at the first ask (a prompt refused, or one
    that never reaches a tree, never pays for it: ~70 ms at 32k tokens)."""
    indexes: list[PromptLookup] = []

    def branch(limit: int) -> list[int]:
        if not indexes:
            indexes.append(PromptLookup(prompt_ids, max_tokens))
        index = indexes[0]
        index.extend(budget.kept[len(index.tokens) - len(prompt_ids):])
        # A cycle emits its accepted nodes and one more token: budget.left - 1 nodes are enough.
        return index.continuation(min(limit, budget.left - 1))

    return branch


def lookup_decoding(job: Job, budget: Budget, stats: Stats, batch: Callable[[], int], lookup_tokens: int,
                    verify_ms: Mapping[int, float] | None) -> tuple[Lookup | None, Callable[[int], None] | None]:
    """A lookup-mode request's branch source and its step callback (none with ``lookup_tokens`` 0):
    prompt lookup while the sequence runs alone, cut by a ``BranchPolicy`` where costs are known."""
    if not lookup_tokens:
        return None, None
    return cut_by_policy(alone(prompt_lookup(job.prompt_ids, budget, lookup_tokens), batch), stats,
                         BranchPolicy(verify_ms) if verify_ms else None)


def branch_sources(lookup: Lookup | None, batch: Callable[[], int], stats: Stats,
                   verify_ms: Mapping[int, float] | None,
                   ) -> tuple[BranchPolicy | None, Lookup | None, Callable[[int], None]]:
    """A dovetail request's one estimate of how far copies hold (a ``BranchPolicy`` at the costs
    ``verify_ms``; none without costs or lookup: whole branches), which cuts its trees' branches
    (``tree_cycle``) and its plain steps' (``cut_by_policy``, those only while it runs alone)."""
    policy = BranchPolicy(verify_ms) if lookup is not None and verify_ms else None
    return policy, *cut_by_policy(alone(lookup, batch), stats, policy)


def cut_by_policy(branches: Lookup | None, stats: Stats, policy: BranchPolicy | None,
                  ) -> tuple[Lookup | None, Callable[[int], None]]:
    """Plain steps' prompt lookup cut by ``policy`` (whole branches without one: no costs known),
    and what each plain step's emitted tokens are told to: the stats, and the policy's acceptance."""
    if branches is None or policy is None:
        return branches, stats.record_plain_step

    def stepped(emitted: int) -> None:
        stats.record_plain_step(emitted)
        policy.observe(emitted - 1)

    return (lambda limit: policy.choose(branches(limit))), stepped


def alone(lookup: Lookup | None, batch: Callable[[], int]) -> Lookup | None:
    """Prompt lookup for plain steps, only while the sequence runs alone: in a batch whose load
    leaves no tree room its rows would slow every sequence in it, and plain batched decoding is
    the floor there (a branch's row emits ~0.4 tokens on the real pair's chat)."""
    if lookup is None:
        return None
    return lambda limit: lookup(limit) if batch() == 1 else []


@dataclass
class DraftFeed:
    """What a dovetail sequence's next draft step feeds in: pairs (token i + 1, the target's feature
    row of position i), and how the draft stands."""

    tokens: list[int]
    features: m.RingRef
    fresh: bool  # the draft holds nothing of this sequence yet: its next call starts it (reset)
    prompt: bool = True  # the next draft step reads the prompt's rows (so its time misleads the planner)
    kept: bool = False  # the prompt's rows are with the draft, unread (``defer_prompt``)


def tree_cycle(seq_id: int, feed: DraftFeed, shape: TreeShape, planner: ShapePlanner, together: int,
               stats: Stats, branch: Sequence[int] = (), policy: BranchPolicy | None = None,
               ) -> Generator[Call, m.Message, m.VerifyResult]:
    """One speculative cycle: the draft reads ``feed`` and proposes a tree of ``shape``, ``branch``
    (prompt lookup's guess) is grafted onto it, as much of it as ``policy`` finds pays beside the
    tree (all of it without a policy, or where the planner knows no costs), the target verifies it
    (beside ``together - 1`` other sequences); the planner, the policy and the stats are told."""
    cycle_started = time.perf_counter()
    request = m.DraftRequest(seq_id=seq_id, tokens=feed.tokens, features=feed.features, shape=shape,
                             reset=feed.fresh)
    draft = _reply((yield Call("gpu", request, m.DraftResult, feed.prompt)), m.DraftResult)
    if branch and policy is not None:
        branch = cut_branch(branch, policy, planner, shape, together, draft)
    tokens, parents = graft(draft.tokens, draft.parents, branch) if branch else (draft.tokens, draft.parents)
    stats.lookup_nodes += len(tokens) - len(draft.tokens)
    verified = _reply((yield Call("cpu", m.VerifyRequest(seq_id=seq_id, tokens=tokens, parents=parents),
                                  m.VerifyResult)), m.VerifyResult)
    accepted = verified.accepted_tokens
    if policy is not None:
        policy.observe(copied(branch, accepted))
    # A draft step that read (the last chunk of) the prompt too: its times mislead the planner.
    planner.observe(shape, tokens, parents, accepted, draft.compute_ms, verified.compute_ms,
                    (time.perf_counter() - cycle_started) * 1e3, together, timed=not feed.prompt,
                    drafted=len(draft.tokens))
    grafted = len(accepted) - 1 - len(draft_path(tokens, parents, accepted, len(draft.tokens))) if branch else 0
    stats.record_cycle(shape, draft.compute_ms, verified.compute_ms, len(accepted), grafted)
    return verified


def cut_branch(branch: Sequence[int], policy: BranchPolicy, planner: ShapePlanner, shape: TreeShape, together: int,
               draft: m.DraftResult) -> Sequence[int]:
    """As much of lookup's ``branch`` as ``policy`` finds pays on this cycle's tree: a one-node tree (a
    first cycle whose draft reads the prompt, no tree paying) as a plain step's; a tree as its planner
    weighs it; whole where the planner knows no costs (a fixed tree)."""
    if shape.tree_tokens == 1:
        return policy.choose(branch)
    terms = planner.branch_terms(shape, together)
    if terms is None:
        return branch
    shared = shared_prefix(draft.tokens, draft.parents, branch)
    return policy.choose_grafted(branch, shared, terms.tree_tokens, terms.tree_ms, terms.extra_ms)


def defer_prompt(seq_id: int, feed: DraftFeed) -> Generator[Call, m.Message, None]:
    """Hand the prompt's pairs to the draft to keep, unread (a DraftExtend that defers): a sequence
    that joins a busy batch decodes plainly, maybe to its end, and only a tree needs them read (the
    draft's next step reads them with its own pairs). The feed keeps its last token, the next step's."""
    message = m.DraftExtend(seq_id=seq_id, tokens=feed.tokens, features=feed.features, reset=feed.fresh, defer=True)
    _reply((yield Call("gpu", message, m.DraftExtended)), m.DraftExtended)
    feed.fresh, feed.kept = False, True


# What plain steps end with: the root-only verify's result, the sequence's length, the next tree.
Resumed = tuple[m.VerifyResult, int, TreeShape]


def plain_until_tree(seq_id: int, token: int, length: int, context: Context, budget: Budget, stats: Stats,
                     next_shape: Callable[[], TreeShape], lookup: Lookup | None,
                     on_step: Callable[[int], None], runs: RunSizer | None = None,
                     ) -> Generator[Call, m.Message, Resumed | None]:
    """A dovetail request's plain steps (the tokens stay ar's; with ``lookup``'s branch where it has
    one) while ``next_shape()`` (asked before each call) says one node, then one more step as a tree
    without draft nodes: the same tokens, plus the feature rows the draft goes on from. Returns that
    verify's result, the sequence's length after it and the tree to draft next, or None when the
    answer ended first. ``on_step``: told each step's emitted tokens (``cut_by_policy``); ``runs``: steps a
    call (``plain_steps``)."""
    planned: list[TreeShape] = []

    def tree_fits() -> bool:
        planned[:] = [next_shape()]
        return planned[0].tree_tokens > 1

    pending = yield from plain_steps(seq_id, token, length, context, budget, stats, until=tree_fits, lookup=lookup,
                                     on_step=on_step, runs=runs)
    if pending is None:
        return None
    token, length = pending
    branch = lookup(branch_room(context, length, 1)) if lookup is not None else []
    verified = yield from lookup_step(seq_id, token, branch, stats)
    accepted = verified.accepted_tokens
    on_step(len(accepted))
    return None if budget.push(accepted, verified.logprobs) else (verified, length + len(accepted), planned[0])


def run_alone(steps: Steps, cpu: Worker, gpu: Worker | None) -> tuple[FinishReason, Stats]:
    """Run one loop to its end, each call a request of its own; a worker's failure propagates
    (the loop is closed first, so its stats are final)."""
    try:
        call = next(steps)
        while True:
            worker = cpu if call.worker == "cpu" else gpu
            if worker is None:
                raise RuntimeError("a draft step without a gpu_worker")
            call = steps.send(worker.request(call.message, call.expect))
    except StopIteration as stop:
        return stop.value
    finally:
        steps.close()


def generate_ar(cpu: Worker, job: Job, emit: Emit, lookup_tokens: int = 0,
                verify_ms: Mapping[int, float] | None = None) -> tuple[FinishReason, Stats]:
    """Plain decoding, one request alone; ``lookup_tokens`` > 0: lookup decoding (``ar_steps``)."""
    try:
        return run_alone(ar_steps(job, emit, lookup_tokens=lookup_tokens, verify_ms=verify_ms), cpu, None)
    finally:
        cpu.send(m.ReleaseSequence(seq_id=job.seq_id))


def generate_dovetail(cpu: Worker, gpu: Worker, job: Job, tree: TreeShape | ShapePlanner,
                      emit: Emit, lookup_tokens: int = 0,
                      verify_ms: Mapping[int, float] | None = None) -> tuple[FinishReason, Stats]:
    """Speculative decoding, one request alone; ``tree``: a fixed shape, or a planner that picks each
    cycle's; ``lookup_tokens``: prompt lookup's longest branch, cut to what pays at the costs
    ``verify_ms`` (``dovetail_steps``)."""
    try:
        return run_alone(dovetail_steps(job, tree, emit, lookup_tokens=lookup_tokens, verify_ms=verify_ms), cpu, gpu)
    finally:
        cpu.send(m.ReleaseSequence(seq_id=job.seq_id))
        gpu.send(m.ReleaseSequence(seq_id=job.seq_id))
