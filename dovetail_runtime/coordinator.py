"""The coordinator: owns the workers and the tokenizer, and runs one request at a time.

Serving clients (the socket, the fair queue, deadlines, shutdown) is ``serving.Serving``;
it reads clients through ``while_waiting``, which the workers call while they compute, load
or hang.

A worker that dies, or does not answer within ``worker_timeout_s`` (it is then killed),
fails the request in flight with ``worker_failed``; the coordinator then restarts that
worker and keeps serving. More than ``max_restarts`` restarts in ten minutes means something
is persistently wrong: the coordinator stops with an error (non-zero exit) rather than
crash-looping.

The coordinator owns (creates and unlinks) the two shared-memory rings the cpu_worker writes
hidden states into and the gpu_worker reads from: the cycle ring (a verification's few rows)
and the prefill ring (one slot for a whole prompt). Their rows are as wide as the draft head
reads (``gpu_worker.head_layout``: the hidden size, or 3 x it for an EAGLE-3 head, whose three
target layers the coordinator passes to the cpu_worker). It never imports torch: it handles
text, token ids and messages; tensors live in the workers.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec
import psutil

from cpu_worker.model.model_dir import ModelLoadError, context_limit, is_gguf, read_config, resolve_model_dir
from cpu_worker.native.library import find_compiler
from gpu_worker.head_layout import FeatureLayout, feature_layout
from ipc import messages as m
from ipc.channels import RuntimeDir
from ipc.dtypes import BLOCK_PRECISIONS
from ipc.shm_ring import ShmRing, cycle_slots, slot_bytes_for
from ipc.tree import TreeShape

from .admission import KvBudget, size_text
from .batching import Batcher, Outcome
from .chat_template import ChatTemplate, ChatTemplateError, encode_chat
from .generation import (
    DEFAULT_PREFILL_CHUNK,
    EmptyPrompt,
    Job,
    PromptTooLong,
    Steps,
    Stop,
    ar_steps,
    dovetail_steps,
    run_alone,
)
from .join_sizing import JoinSizer
from .lookup import DEFAULT_LOOKUP_TOKENS, accepted_rows
from .memory_fit import TargetSize, auto_precision, gguf_need_bytes, machine_memory, shortfall
from .metrics import ServerMetrics
from .text import TextStream
from .tokenizer import Tokenizer
from .tree_planner import AutoTree, TreePlanner, drafting_cannot_pay
from .workers import WorkerFailed, WorkerHandle, WorkerRequestError

log = logging.getLogger(__name__)

# The share of the memory free after the models load that running requests' KV caches may take by default.
KV_MEMORY_SHARE = 0.8

RESTART_WINDOW_S = 600.0
# One block is in flight per cycle; spare slots keep a slow reader from ever seeing a reused one.
# Ring slots are sized for fp32 rows, the widest features any target precision returns.
FEATURE_DTYPE = "float32"
# The context when --max-len is not given (capped by the model's own): a 128k-context model
# would otherwise reserve a KV cache for 128k tokens (committed only as used, but reserved).
DEFAULT_CONTEXT = 4096
# --worker-timeout's default: this many times the longest step the measured costs predict, at
# least the floor; before anything is measured (or when nothing is: --mode ar, a fixed tree) the
# fallback. A 9M model's longest step takes under a second, a 7B one's on few cores minutes.
WORKER_TIMEOUT_STEPS = 4
WORKER_TIMEOUT_FLOOR_S = 30.0
UNMEASURED_WORKER_TIMEOUT_S = 300.0
# A request's newly final tokens, their text and (when asked) their log-probabilities -> cancel?
OnText = Callable[[list[int], str, list[m.TokenLogprob]], bool]


# OpenMP waits of two workers on shared cores. libgomp's idle threads spin GOMP_SPINCOUNT times before
# they sleep: 300,000 by default (~9 ms on a 2-core Zen 4: CPU burnt by an idle process after one parallel
# region), none under OMP_WAIT_POLICY=PASSIVE, and a count given explicitly overrides PASSIVE's none. Each
# cycle hands the cores from the target's verify pass to the draft's step and back, so each worker must
# sleep soon after its own step (both workers at libgomp's default doubled the verify pass: 16.4 ms a
# cycle against 8.2 with a passive draft, tools/bench_e2e), yet stay awake across the microsecond gaps
# between its step's native calls (a sleeping thread is woken through the kernel for each of them: a
# passive target's steps took 2.5x as long at the demo's size). Measured on 2 cores (docs/performance.md):
# - at the llama2-7b stand-in the target at libgomp's default spun through most of the draft's step: the
#   draft cost 18-20% of a verify pass, 15-16% at 30,000 target spins (~1 ms), 14-15% with both counts
#   below; 3,000 (~0.1 ms) decodes the 7B as fast as the default;
# - at the demo's size (4/3/4 trees) a passive draft beside a target at 30,000 spent 40% longer on its
#   steps than one spinning 10,000 times (~0.3 ms) beside a target at 3,000; verify passes kept their speed;
# - on a busy 2-core Zen 3 (AVX2) the 7B chat stand-in at q4_0 decoded 1.26-1.37x faster, ar and dovetail
#   alike, with its target at 30,000 than at 3,000 (its threads slept inside a step's regions: a quiet
#   host's 0.1 ms of imbalance is a busy one's more), and its draft's steps took no longer.
# So a target of LARGE_TARGET_PROJECTIONS weights or more (a step of tens of ms and up, where ~1 ms of spin
# after it is little of the draft's step) spins ~1 ms, a smaller one ~0.1 ms.
TARGET_SPIN_COUNT = "3000"
LARGE_TARGET_SPIN_COUNT = "30000"
LARGE_TARGET_PROJECTIONS = 1_000_000_000  # its decoder layers' linear weights (memory_fit.TargetSize)
DRAFT_SPIN_COUNT = "10000"


def _user_chose_waits(environ: Mapping[str, str]) -> bool:
    """Whether the user set OpenMP's waits: then both workers inherit them as set."""
    return "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ


def target_worker_env(with_draft: bool, environ: Mapping[str, str], projections: int = 0) -> dict[str, str]:
    """The target worker's environment beyond ``environ``: a short OpenMP spin where a draft worker
    runs beside it (alone, --mode ar, libgomp's default), longer for a target of ``projections``
    decoder weights from ``LARGE_TARGET_PROJECTIONS`` on, unless the user chose the waits."""
    if not with_draft or _user_chose_waits(environ):
        return {}
    return {"GOMP_SPINCOUNT": LARGE_TARGET_SPIN_COUNT if projections >= LARGE_TARGET_PROJECTIONS else TARGET_SPIN_COUNT}


def draft_worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The draft worker's environment beyond ``environ``: its idle threads sleep (PASSIVE, for any
    OpenMP runtime) after a short spin (libgomp's count, which overrides PASSIVE), unless the user
    chose the waits."""
    if _user_chose_waits(environ):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": DRAFT_SPIN_COUNT}


# A GGUF's own weights, activations at 16 bits per block: the file's model as near its fp32 meaning as its
# weights allow (SmolLM2's Q4_1: KL 0.00005 against fp32, llama.cpp's 8-bit activations 0.0032), at the
# decode speed of 8-bit activations; a verify pass of 16 rows costs about a third more (docs/performance.md).
WIDE_FOR_BLOCK = {"q8_0": "int8", "q4_0": "q4_0-a16", "q4_1": "q4_1-a16"}


def target_precision(target_dir: Path) -> str:
    """The precision a target runs at unless --target-dtype says: a GGUF file's own blocks (the type
    most of its projections are stored in, ``gguf_model.native_precision``) with 16-bit activations,
    fp32 for a model folder."""
    if not is_gguf(target_dir):
        return "fp32"
    from cpu_worker.model.gguf_file import GGUFFile
    from cpu_worker.model.gguf_model import native_precision

    with GGUFFile(target_dir) as file:
        native = native_precision(file)
    return WIDE_FOR_BLOCK.get(native, native)


@dataclass
class RuntimeSettings:
    target: str
    draft: str | None
    target_dtype: str = "fp32"  # or "auto": a GGUF file's own precision, else fp32 if it fits (``_settle_precision``)
    kv_dtype: str = "auto"
    cpu_threads: int | None = None
    cpu_cores: list[int] | None = None
    draft_device: str = "auto"
    draft_dtype: str = "auto"
    draft_threads: int | None = None
    draft_cores: list[int] | None = None
    tree: TreeShape | AutoTree = field(default_factory=AutoTree)
    # Prompt lookup (``lookup``): the longest branch copied from earlier in a sequence onto its trees; 0: none.
    lookup_tokens: int = DEFAULT_LOOKUP_TOKENS
    mode: str = "dovetail"
    max_len: int | None = None
    log_level: str = "info"
    startup_timeout_s: float = 300.0
    max_restarts: int = 3
    # A worker that has not answered one request within this is hung: killed and restarted.
    # "auto": fitted to the measured step costs (``fitted_worker_timeout``); None: no limit.
    worker_timeout_s: float | Literal["auto"] | None = "auto"
    # Requests run at once, their steps verified together (``batching``); 1: one at a time.
    max_batch: int = 1
    # The KV memory the running requests may reserve (``admission``); None: a share of what is free
    # once the models are loaded (KV_MEMORY_SHARE).
    kv_memory_bytes: int | None = None
    # Prompt tokens per prefill call: a long prompt joins a running batch one chunk per round.
    # Every request and mode takes the same chunks (a busy batch cuts otherwise only where that
    # cannot change a bit: join_chunk), so a prompt's bits never depend on what runs beside it.
    # None: each prompt in one call.
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK
    # Prompt tokens per call while other requests run: "auto" sizes each chunk to about one of their
    # cycles (``join_sizing``); None: --prefill-chunk. Only where the target's prompt bits do not
    # depend on their chunks (``TargetInfo.chunk_invariant``); elsewhere --prefill-chunk throughout.
    join_chunk: int | Literal["auto"] | None = "auto"


class TooManyRestarts(RuntimeError):
    pass


def fitted_worker_timeout(verify_ms: dict[int, float], draft_ms: list[float], max_len: int) -> float:
    """--worker-timeout's default in seconds: WORKER_TIMEOUT_STEPS times the longest step the
    measured costs predict (a prompt that fills the context, prefilled at the largest measured
    tree's cost per token; or the largest tree or draft step), at least WORKER_TIMEOUT_FLOOR_S."""
    largest = max(verify_ms)
    prefill_ms = verify_ms[largest] / largest * max_len
    longest_ms = max([prefill_ms, *verify_ms.values(), *draft_ms])
    return max(WORKER_TIMEOUT_FLOOR_S, WORKER_TIMEOUT_STEPS * longest_ms / 1000)


def error_reply(request_id: str | None, code: str, message: str) -> m.ErrorReply:
    """An ErrorReply whose message fits the protocol's limit (a worker's error text may not)."""
    limit = 8000
    return m.ErrorReply(request_id=request_id, code=code,
                        message=message if len(message) <= limit else message[:limit] + " [...]")


def refuse_untokenized(request: m.GenerateRequest, prompt_chars: int | None, max_len: int) -> m.ErrorReply | None:
    """prompt_too_long for a prompt longer than any prompt that fits the context (``prompt_chars``,
    ``Coordinator.max_prompt_chars``), judged by its characters alone: tokenizing megabytes takes a
    minute and ~200 bytes of memory a character."""
    # A chat's template adds a few characters per message: within this bound's slack.
    chars = len(request.prompt or "") + sum(len(turn.content) for turn in request.messages or ())
    if prompt_chars is None or chars <= prompt_chars:
        return None
    return error_reply(request.request_id, "prompt_too_long",
                       f"prompt of {chars} characters cannot fit the context of {max_len} tokens (at most "
                       f"{prompt_chars} characters with this tokenizer); not tokenized")


class Joining(NamedTuple):
    """How prompts join running requests: the sizer the batch tells its rounds' costs (auto), what
    a request asks for its next chunk's tokens (``Job.join_chunk``) or, where the target's prompt
    bits depend on the cuts, for the ms a piece's layers may take per round (``Job.join_budget``);
    each callable answers None while nobody decodes."""

    sizer: JoinSizer | None
    chunk: Callable[[], int | None] | None
    budget: Callable[[], float | None] | None


class Coordinator:
    def __init__(self, settings: RuntimeSettings):
        self.settings = settings
        self.runtime_dir: RuntimeDir | None = None
        self.rings: list[ShmRing] = []
        self.cpu: WorkerHandle[m.TargetInfo] | None = None
        self.gpu: WorkerHandle[m.DraftInfo] | None = None
        self.tokenizer: Tokenizer | None = None
        self.chat_template: ChatTemplate | None = None
        self.metrics = ServerMetrics()
        self.max_len = 0
        # The tree each cycle verifies: a fixed shape, or the planner of --tree-tokens auto.
        self.tree: TreeShape | TreePlanner = settings.tree if isinstance(settings.tree, TreeShape) else TreeShape()
        # Prompt lookup's longest branch per tree (at most settings.lookup_tokens: the rings are sized for it).
        self.lookup_tokens = settings.lookup_tokens
        # t_verify(T) for lookup-mode requests' branch policy (None: verify whole branches).
        self.lookup_costs: dict[int, float] | None = None
        self._seq_ids = itertools.count(1)
        self._batcher: Batcher | None = None
        self._join_chunk: Callable[[], int | None] | None = None  # Job.join_chunk, set by batcher()
        self._join_budget: Callable[[], float | None] | None = None  # Job.join_budget, set by batcher()
        self._restarts: collections.deque[float] = collections.deque()
        # Called every ~100 ms while a worker computes or starts (serving reads its clients).
        self.while_waiting: Callable[[], None] | None = None

    def _waiting(self) -> None:
        if self.while_waiting is not None:
            self.while_waiting()

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Read the target's folder, create the rings, start the workers (both load at once)
        and, for --tree-tokens auto, measure what trees cost here."""
        settings = self.settings
        if settings.mode == "dovetail" and not settings.draft:
            raise ValueError("dovetail mode needs a draft head (--draft)")
        target_dir = resolve_model_dir(settings.target)
        config, limit = self._read_target(target_dir)
        self._settle_precision(target_dir, config)
        # The draft head decides what a feature row holds (EAGLE-3: three target layers).
        draft_dir = resolve_model_dir(settings.draft) if settings.draft else None
        layout = feature_layout(draft_dir, config) if draft_dir else FeatureLayout(config["hidden_size"])
        if layout.aux_layers:
            log.info("EAGLE-3 head: feature %s", layout.describe())
        envelope = settings.tree.envelope if isinstance(settings.tree, AutoTree) else settings.tree
        rows = accepted_rows(envelope.depth, settings.lookup_tokens)
        self.rings = [ShmRing.create(slot_bytes_for(rows, layout.row_width, FEATURE_DTYPE),
                                     cycle_slots(settings.max_batch)),
                      ShmRing.create(slot_bytes_for(self.max_len, layout.row_width, FEATURE_DTYPE), 1)]
        self.runtime_dir = RuntimeDir()
        self.cpu = self._target_worker(target_dir, layout, draft_dir is not None, TargetSize.from_config(config))
        if draft_dir is not None:
            self.gpu = self._draft_worker(draft_dir, target_dir, layout, envelope)
        for worker in self.workers():
            worker.spawn()
        for worker in self.workers():
            worker.wait_ready(settings.startup_timeout_s)
        assert self.cpu.info is not None
        self._report_target(self.cpu.info, limit)
        if isinstance(settings.tree, AutoTree) and self.gpu is not None:
            self.tree = self.plan_trees(settings.tree)
            self.lookup_costs = dict(self.tree.verify_ms) if isinstance(self.tree, TreePlanner) else None
        elif settings.mode == "lookup" and self.lookup_tokens:
            self.lookup_costs = self.measure_lookup_costs()

    def _settle_precision(self, target_dir: Path, config: dict[str, Any]) -> None:
        """--target-dtype auto resolved (a GGUF file's own blocks; for a model folder fp32, or where
        that would take nearly all of this machine's memory int8, then q4_0), and the precision checked
        against the memory free now (``memory_fit``): a warning naming what would fit, a refusal
        where even all of the machine's memory and swap could not hold it."""
        settings = self.settings
        size = TargetSize.from_config(config)
        gguf = is_gguf(target_dir)
        if settings.target_dtype == "auto":
            if gguf:
                settings.target_dtype = target_precision(target_dir)
                why = "the GGUF file's own blocks, 16-bit activations"
            else:
                settings.target_dtype = auto_precision(size)
                fp32_gb = size.need_bytes("fp32") / 1e9
                total_gb = machine_memory()[0] / 1e9
                why = ("a model folder's default" if settings.target_dtype == "fp32" else
                       f"fp32 would take ~{fp32_gb:.1f} GB of this machine's {total_gb:.1f} GB")
            if settings.target_dtype in BLOCK_PRECISIONS and find_compiler() is None:
                # Block formats run on the native kernels only: without a compiler the worker failed to
                # start. int8-row (fbgemm) takes int8's memory and keeps trees exact.
                why = f"{why}, but no C compiler is found to build its kernels ({settings.target_dtype})"
                settings.target_dtype = "int8-row"
                # Exact, but one scale per row and per token: a real model's text drifts from fp32's far sooner.
                log.warning("no C compiler: the target runs at int8-row, which keeps far less of a real model's "
                            "quality than the block formats (docs/kernels.md); install gcc for them, or give "
                            "--target-dtype fp32 where it fits (without the kernels its trees are exact on Intel "
                            "CPUs only)")
            log.info("target precision %s (%s; --target-dtype sets another)", settings.target_dtype, why)
        precision = settings.target_dtype
        need = gguf_need_bytes(target_dir, size, precision) if gguf else size.need_bytes(precision)
        memory = machine_memory()[0] + psutil.swap_memory().total
        if need > memory:
            raise ValueError(f"the target at {precision} needs about {need / 1e9:.1f} GB, more than this machine's "
                             f"{memory / 1e9:.1f} GB of memory and swap"
                             + ("" if gguf else "; try --target-dtype int8 or q4_0"))
        warning = shortfall(need, precision, None if gguf else size)
        if warning:
            log.warning(warning)

    def _read_target(self, target_dir: Path) -> tuple[dict[str, Any], int]:
        """The target's config and context limit; loads the tokenizer and chat template and
        settles the context (``max_len``)."""
        config = read_config(target_dir)
        self.tokenizer = Tokenizer.from_dir(target_dir)
        self.chat_template = ChatTemplate.from_dir(target_dir, self.tokenizer.special_tokens)
        if self.chat_template.problem and self.chat_template.source is not None:
            log.warning("chat requests will be refused: %s", self.chat_template.problem)
        limit = context_limit(config)
        self.max_len = self.settings.max_len or min(limit, DEFAULT_CONTEXT)
        if self.max_len > limit:
            raise ValueError(f"--max-len {self.max_len} exceeds this model's context of {limit} tokens")
        for key in ("hidden_size", "num_hidden_layers"):
            if not isinstance(config.get(key), int):
                raise ModelLoadError(f"{target_dir / 'config.json'} has no integer {key}")
        return config, limit

    def _rings(self) -> m.RingNames:
        return m.RingNames(cycle=self.rings[0].name, prefill=self.rings[1].name)

    def _target_worker(self, target_dir: Path, layout: FeatureLayout, with_draft: bool,
                       size: TargetSize) -> WorkerHandle[m.TargetInfo]:
        settings = self.settings
        worker_settings = m.TargetSettings(
            log_level=settings.log_level, max_len=self.max_len, rings=self._rings(), target=str(target_dir),
            threads=settings.cpu_threads, cores=settings.cpu_cores, dtype=settings.target_dtype,
            aux_layers=list(layout.aux_layers or []), kv_dtype=settings.kv_dtype, max_sequences=settings.max_batch)
        assert self.runtime_dir is not None
        return WorkerHandle("cpu_worker", "cpu_worker.server", worker_settings, self.runtime_dir, m.FROM_CPU_WORKER,
                            m.TargetInfo, env=target_worker_env(with_draft, os.environ, size.projections),
                            reply_timeout_s=self._initial_worker_timeout(), on_wait=self._waiting)

    def _draft_worker(self, draft_dir: Path, target_dir: Path, layout: FeatureLayout,
                      envelope: TreeShape) -> WorkerHandle[m.DraftInfo]:
        settings = self.settings
        worker_settings = m.DraftSettings(
            log_level=settings.log_level, max_len=self.max_len, rings=self._rings(), draft=str(draft_dir),
            target=str(target_dir), device=settings.draft_device, dtype=settings.draft_dtype,
            threads=settings.draft_threads, cores=settings.draft_cores, scratch_len=envelope.scratch_slots,
            row_width=layout.row_width, layout=layout.describe(), max_sequences=settings.max_batch)
        assert self.runtime_dir is not None
        return WorkerHandle("gpu_worker", "gpu_worker.server", worker_settings, self.runtime_dir, m.FROM_GPU_WORKER,
                            m.DraftInfo, env=draft_worker_env(os.environ),
                            reply_timeout_s=self._initial_worker_timeout(), on_wait=self._waiting)

    def _initial_worker_timeout(self) -> float | None:
        """--worker-timeout, or for its default the fallback until the step costs are measured."""
        timeout = self.settings.worker_timeout_s
        return UNMEASURED_WORKER_TIMEOUT_S if timeout == "auto" else timeout

    def measure_lookup_costs(self) -> dict[int, float] | None:
        """t_verify(T) for T = 1 .. --lookup-tokens + 1 (a branch under its step's token), measured once
        and cached like the trees' costs: what a lookup-mode step weighs a branch against."""
        assert self.cpu is not None
        sizes = [size for size in range(1, self.lookup_tokens + 2) if size < self.max_len]
        if len(sizes) < 2:
            return None
        verify = self.cpu.request(m.MeasureVerifyCost(tree_sizes=sizes), m.VerifyCost)
        costs = dict(zip(verify.tree_sizes, verify.ms))
        log.info("lookup: branches of up to %d tokens, verified as far as pays at t_verify(T) ms %s (%s %s)",
                 self.lookup_tokens, " ".join(f"{t}:{ms:.1f}" for t, ms in costs.items()),
                 "cached in" if verify.cached else "measured now, cached in", verify.cache_path or "nowhere")
        self.fit_worker_timeout(costs, [])
        return costs

    def fit_worker_timeout(self, verify_ms: dict[int, float], draft_ms: list[float]) -> None:
        """Without --worker-timeout, let each worker take WORKER_TIMEOUT_STEPS times the longest
        step the measured costs predict: a hang is caught in seconds on a small model and a long
        prompt is not cut short on a big one."""
        if self.settings.worker_timeout_s != "auto":
            return
        timeout = fitted_worker_timeout(verify_ms, draft_ms, self.max_len)
        for worker in self.workers():
            worker.reply_timeout_s = timeout
        log.info("worker timeout %.0f s (%dx the longest step the measured costs predict, at least %.0f s; "
                 "--worker-timeout sets another)", timeout, WORKER_TIMEOUT_STEPS, WORKER_TIMEOUT_FLOOR_S)

    def _report_target(self, info: m.TargetInfo, limit: int) -> None:
        """Say how the target runs, and when its trees can differ from one-token decoding."""
        # fp32 or bf16 without the row kernel, where trees (or lookup's branches) are verified.
        inexact = not info.exact_tree and (self.gpu is not None or self.settings.mode == "lookup")
        if inexact and info.dtype in ("fp32", "bf16") and info.kv_dtype == "bfloat16":
            log.warning("%s target with a bf16 KV cache: tree verification differs from one-token decoding by "
                        "~1e-2 (bf16 rounding of K/V amplifies its linears' ~1e-6), so --mode %s can differ from "
                        "--mode ar where two tokens nearly tie; an int8 target is exact with it", info.dtype,
                        self.default_mode)
        elif inexact and info.dtype == "bf16":
            log.warning("bf16 target without the row kernel: tree verification rounds differently from one-token "
                        "decoding (~1e-6), so --mode %s can differ from --mode ar where two tokens nearly tie",
                        self.default_mode)
        kernel = f" ({info.kernel})" if info.kernel else ""
        log.info("target: %s%s, %.2f GB of weights; context %d tokens (model: %d; --max-len sets it), KV cache %s "
                 "%.2f GB at full context, committed as it fills; trees verified %s", info.dtype, kernel,
                 info.weight_bytes / 1e9, self.max_len, limit, info.kv_dtype, info.kv_cache_bytes / 1e9,
                 "bit-exact against decoding" if info.exact_tree else "to float tolerance")

    def plan_trees(self, bounds: AutoTree) -> TreeShape | TreePlanner:
        """Ask the workers what verification and drafting cost here; say so when drafting cannot pay."""
        assert self.cpu is not None and self.gpu is not None
        # Trees no larger than the context leaves room for next to a measuring prefix.
        sizes = [size for size in bounds.tree_sizes if size < self.max_len]
        if len(sizes) < 2:
            return TreeShape.clamped(2, 1, bounds.top_k)
        bounds = dataclasses.replace(bounds, max_tree_tokens=sizes[-1],
                                     max_depth=min(bounds.max_depth, sizes[-1] - 1))
        depths = list(range(1, bounds.envelope.depth + 1))
        # Minutes on a large model or a deep --depth, once (cached): said, so a quiet start does not look hung.
        log.info("tree: the cost of verifying T = 1..%d and drafting depth 1..%d on this machine: measuring, or "
                 "read from the cache of an earlier start", sizes[-1], depths[-1])
        verify = self.cpu.request(m.MeasureVerifyCost(tree_sizes=sizes), m.VerifyCost)
        draft_ms_by_top_k: dict[int, dict[int, float]] = {}
        drafts = []
        for top_k in bounds.top_ks:
            draft = self.gpu.request(m.MeasureDraftCost(depths=depths, top_k=top_k), m.DraftCost)
            draft_ms_by_top_k[top_k] = dict(zip(draft.depths, draft.ms))
            drafts.append(draft)
        verify_ms = dict(zip(verify.tree_sizes, verify.ms))
        draft_ms = draft_ms_by_top_k[bounds.top_k]
        log.info("tree: auto (T <= %d, depth <= %d, top_k %s). t_verify(T) ms %s (%s %s); t_draft(depth) ms %s "
                 "(%s %s)", bounds.envelope.tree_tokens, bounds.envelope.depth, " or ".join(map(str, bounds.top_ks)),
                 " ".join(f"{t}:{ms:.1f}" for t, ms in verify_ms.items()),
                 "cached in" if verify.cached else "measured now, cached in", verify.cache_path or "nowhere",
                 "; ".join(f"top_k {k}: " + " ".join(f"{d}:{ms:.1f}" for d, ms in by_depth.items())
                           for k, by_depth in draft_ms_by_top_k.items()),
                 "cached in" if all(d.cached for d in drafts) else "measured now, cached in",
                 drafts[0].cache_path or "nowhere")
        self.fit_worker_timeout(verify_ms, [ms for by_depth in draft_ms_by_top_k.values() for ms in by_depth.values()])
        warning = drafting_cannot_pay(verify_ms, draft_ms, bounds)
        if warning:
            log.warning("%s", warning)
        planner = TreePlanner(bounds, verify_ms, draft_ms, draft_ms_by_top_k=draft_ms_by_top_k)
        log.info("tree: starting with %s", planner.describe())
        return planner

    def max_prompt_chars(self) -> int | None:
        """More characters than any prompt that fits the context can have (the context times the
        longest token), so that longer prompts are refused untokenized; None before start()."""
        return None if self.tokenizer is None else self.max_len * self.tokenizer.max_chars_per_token()

    @property
    def default_mode(self) -> str:
        """A request's mode when it names none: dovetail with a draft head, else the server's --mode
        (ar, or lookup)."""
        return "dovetail" if self.gpu is not None else ("lookup" if self.settings.mode == "lookup" else "ar")

    def workers(self) -> list[WorkerHandle[Any]]:
        return [w for w in (self.cpu, self.gpu) if w is not None]

    def workers_ready(self) -> bool:
        """Both workers run and have said Ready (False before start, and while one is dead or restarting)."""
        workers = self.workers()
        return bool(workers) and all(worker.ready and worker.alive() for worker in workers)

    def draft_worker_dead(self) -> bool:
        """The gpu_worker is dead and the cpu_worker lives: ar requests run on while it restarts."""
        return (self.gpu is not None and not self.gpu.alive()
                and self.cpu is not None and self.cpu.alive())

    def close(self) -> None:
        for worker in self.workers():  # all asked first: they exit side by side, not one after the other
            worker.ask_to_stop()
        for worker in self.workers():
            worker.stop()
        for ring in self.rings:
            ring.close()
        self.rings = []
        if self.runtime_dir is not None:
            self.runtime_dir.close()
            self.runtime_dir = None

    def __enter__(self) -> Coordinator:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def recover(self) -> None:
        """Restart dead workers (within the restart budget: TooManyRestarts beyond it), so that
        the next request finds both running. Serving calls it after each request; ``generate``
        calls it first."""
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
            self._restarts.popleft()
        for worker in self.workers():
            if worker.alive():
                continue
            if len(self._restarts) >= self.settings.max_restarts:
                raise TooManyRestarts(f"{worker.name} died {len(self._restarts) + 1} times in "
                                      f"{RESTART_WINDOW_S / 60:.0f} minutes; giving up")
            self._restarts.append(now)
            self.metrics.worker_restarted()
            log.warning("restarting %s", worker.name)
            worker.stop()
            worker.spawn()
            worker.wait_ready(self.settings.startup_timeout_s)

    # --- requests -------------------------------------------------------------------

    def begin(self, request: m.GenerateRequest, on_text: OnText | None = None) -> Started | m.ErrorReply:
        """A request's decoding loop, not yet run (``run_alone`` or a ``Batcher`` runs it), or the
        reply that refuses it. ``on_text(new_ids, new_text, their_logprobs)`` sees each accepted
        chunk (logprobs: empty unless the request asked for them) and returns True to cancel."""
        if self.cpu is None or self.tokenizer is None or self.chat_template is None:
            raise RuntimeError("a request before start()")
        if request.mode is None:  # the server's own mode
            request = msgspec.structs.replace(request, mode=self.default_mode)
        if request.mode == "dovetail" and self.gpu is None:
            return error_reply(request.request_id, "unsupported",
                                message="this server runs without a draft head: use mode 'ar' or 'lookup'")
        if request.mode == "lookup" and not self.lookup_tokens:
            return error_reply(request.request_id, "unsupported",
                                message="this server runs with --lookup-tokens 0 (no prompt lookup): use mode 'ar'")
        try:
            prompt_ids = (self.tokenizer.encode(request.prompt or "") if request.messages is None
                          else encode_chat(self.tokenizer, self.chat_template, request.messages))
        except ChatTemplateError as error:
            return error_reply(request.request_id, error.code, message=str(error))
        # Chunks by load only while the target (a restarted one too) says they cannot change a bit.
        invariant = self.cpu.info is not None and self.cpu.info.chunk_invariant
        job = Job(next(self._seq_ids), prompt_ids, request.max_new_tokens, request.sampling,
                  self.tokenizer.eos_token_ids, self.max_len, logprobs=request.logprobs,
                  prefill_chunk=self.settings.prefill_chunk, join_chunk=self._join_chunk if invariant else None,
                  join_budget=None if invariant else self._join_budget)
        # The text is decoded onwards from the prompt, as the tokenizer means it (see .text).
        started = Started(request, prompt_ids, TextStream(self.tokenizer, request.stop, prompt_ids=prompt_ids),
                          job.seq_id, request.mode == "dovetail", on_text)
        started.steps = (dovetail_steps(job, self.tree, started.emit, self._batch_size, self.lookup_tokens,
                                        self.lookup_costs)
                         if started.uses_gpu
                         else ar_steps(job, started.emit, self._batch_size,
                                       lookup_tokens=self.lookup_tokens if request.mode == "lookup" else 0,
                                       verify_ms=self.lookup_costs))
        return started

    def conclude(self, started: Started, outcome: Outcome) -> m.GenerateDone | m.ErrorReply:
        """The reply of a request whose loop ended with ``outcome``: how it finished, or the
        exception that ended it (one no request should raise propagates)."""
        request = started.request
        if isinstance(outcome, PromptTooLong):
            code = "empty_prompt" if isinstance(outcome, EmptyPrompt) else "prompt_too_long"
            return error_reply(request.request_id, code, message=str(outcome))
        if isinstance(outcome, WorkerRequestError):
            return error_reply(request.request_id, "worker_error", message=str(outcome))
        if isinstance(outcome, WorkerFailed):
            # Answer first (within a second of the death); the restart happens before the next request.
            log.error("request %s failed: %s", request.request_id, outcome)
            return error_reply(request.request_id, "worker_failed", message=str(outcome))
        if isinstance(outcome, BaseException):
            raise outcome
        finish, stats = outcome
        tail = started.stream.finish()
        if tail and started.on_text is not None:
            started.on_text([], tail, [])
        return m.GenerateDone(request_id=request.request_id, token_ids=started.stream.token_ids,
                              text=started.stream.text, finish_reason="cancelled" if started.cancelled else finish,
                              stats=msgspec.structs.replace(stats.message(), prompt_tokens=len(started.prompt_ids)),
                              logprobs=started.logprobs)

    def batcher(self) -> Batcher:
        """The batch of requests over this coordinator's workers (``--max-batch``); its size sizes
        each request's trees (``TreePlanner.batch_shape``)."""
        if self.cpu is None or self.cpu.info is None:
            raise RuntimeError("a batch before start()")
        batcher = Batcher(self.cpu, self.gpu)
        batcher.join, self._join_chunk, self._join_budget = self._joining(self.cpu.info, batcher)
        self._batcher = batcher
        return batcher

    def _joining(self, info: m.TargetInfo, batcher: Batcher) -> Joining:
        """How a prompt is cut while other requests decode (--join-chunk, ``Joining``). A target whose
        prompt bits depend on the cuts keeps its --prefill-chunk pieces; with auto, a piece that runs
        apart from the others' steps goes in parts of its layers, each about one of their cycles."""
        setting, alone = self.settings.join_chunk, self.settings.prefill_chunk or self.max_len
        if setting is None or self.settings.max_batch <= 1:
            return Joining(None, None, None)
        if not info.chunk_invariant:
            parts = setting == "auto"
            log.info("a prompt joins running requests in --prefill-chunk pieces%s: this target's prompt bits depend "
                     "on how it is cut (%s, %s; so do fp32's and bf16's, and any without the native kernels)",
                     ", each in parts of about one of their cycles (--join-chunk auto)" if parts else "",
                     info.dtype, info.kernel or "torch's kernels")
            if not parts:
                return Joining(None, None, None)
            sizer = JoinSizer(alone)  # it measures the running streams' cycle here, not a row's cost

            def budget() -> float | None:
                running = batcher.running()
                return sizer.part_budget_ms(running) if running else None
            return Joining(sizer, None, budget)
        if setting == "auto":
            sizer = JoinSizer(alone)
            log.info("a prompt joins running requests in chunks of about one of their cycles (--join-chunk auto)")

            def measured() -> int | None:
                running = batcher.running()
                return sizer.rows(running) if running else None
            return Joining(sizer, measured, None)
        fixed = min(setting, alone)
        return Joining(None, lambda: fixed if batcher.running() else None, None)

    def kv_budget(self) -> KvBudget | None:
        """The running requests' KV memory budget (serving admits by it): --kv-memory, or a share of
        the memory free now that the models are loaded; None for a single request at a time unless
        --kv-memory is given (then a request that could never fit it is refused, as in a batch)."""
        if self.cpu is None or self.cpu.info is None:
            raise RuntimeError("a KV budget before start()")
        info = self.cpu.info
        budget = self.settings.kv_memory_bytes
        if (self.settings.max_batch <= 1 and budget is None) or info.kv_cache_bytes == 0:
            return None
        if budget is None:
            budget = int(machine_memory()[1] * KV_MEMORY_SHARE)
        per_token = info.kv_cache_bytes / info.max_len
        log.info("KV memory budget %s: %d full-context sequences of %s at once (--max-batch %d)",
                 size_text(budget), budget // info.kv_cache_bytes, size_text(info.kv_cache_bytes),
                 self.settings.max_batch)
        return KvBudget(budget, per_token, info.max_len)

    def _batch_size(self) -> int:
        return max(1, len(self._batcher.streams)) if self._batcher is not None else 1

    def generate(self, request: m.GenerateRequest,
                 on_text: OnText | None = None) -> m.GenerateDone | m.ErrorReply:
        """Run one request alone to the end (``begin`` has the arguments); a prompt too long for the
        context is refused untokenized (a one-shot prompt file of 23 MB took 4.4 GB and a minute to say so)."""
        refused = refuse_untokenized(request, self.max_prompt_chars(), self.max_len)
        if refused is not None:
            return refused
        self.recover()
        started = self.begin(request, on_text)
        if isinstance(started, m.ErrorReply):
            return started
        assert self.cpu is not None
        outcome: Outcome
        try:
            outcome = run_alone(started.loop, self.cpu, self.gpu if started.uses_gpu else None)
        except (PromptTooLong, WorkerRequestError, WorkerFailed) as error:
            outcome = error
        finally:
            self.cpu.send(m.ReleaseSequence(seq_id=started.seq_id))
            if started.uses_gpu and self.gpu is not None:
                self.gpu.send(m.ReleaseSequence(seq_id=started.seq_id))
        return self.conclude(started, outcome)


@dataclass(eq=False)
class Started:
    """A request between ``Coordinator.begin`` and ``conclude``: its prompt, text and loop."""

    request: m.GenerateRequest
    prompt_ids: list[int]
    stream: TextStream
    seq_id: int
    uses_gpu: bool  # dovetail mode (else ar: the cpu_worker alone)
    on_text: OnText | None
    steps: Steps | None = None  # the loop, set by begin (it calls emit)
    logprobs: list[m.TokenLogprob] = field(default_factory=list)  # one per token of stream.token_ids, when asked
    cancelled: bool = False

    @property
    def loop(self) -> Steps:
        assert self.steps is not None
        return self.steps

    def emit(self, token_ids: list[int], token_logprobs: list[m.TokenLogprob]) -> bool | Stop:
        """The loop's ``Emit``: the text so far, on_text, and whether to stop (``Stop`` where a stop string
        ends before the cycle's last token: the tokens after it are not the request's, as in ar)."""
        given, before = len(token_ids), len(self.stream.token_ids)
        text = self.stream.push(token_ids)
        kept = len(self.stream.token_ids) - before
        token_ids, token_logprobs = token_ids[:kept], token_logprobs[:kept]
        self.logprobs.extend(token_logprobs)
        if self.on_text is not None and self.on_text(token_ids, text, token_logprobs):
            self.cancelled = True
        if kept < given:
            return Stop(kept)
        return self.cancelled or self.stream.stopped
