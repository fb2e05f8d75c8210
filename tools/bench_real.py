"""Real-cost benchmark: the demo pair inflated to real model shapes, dovetail vs --mode ar.

    python -m tools.bench_real [--runs llama3-3b:fp32,llama2-7b:int8,llama2-13b:int8] [--layers N]
    python -m tools.bench_real --dry-run        # tiny-1k, 2 prompts x 8 tokens: a smoke test

DESIGN.md 10: ``../shared/testbed/inflate.py`` turns the small trained target (and its draft
head) into a stand-in with a real model's matrix shapes that computes exactly the same tokens,
so tau stays the trained pair's while every step streams the bytes and does the FLOPs of the
real model. For each shape x target precision this bench starts one Coordinator (both worker
processes, as a user runs them), runs held-out prompts in both modes back to back, and prints
one markdown table with the terms of DESIGN.md 9 side by side: ar and dovetail decode speed,
tau, draft / verify / ipc ms per cycle, ar against the memory-bandwidth roofline, and each
worker's peak RSS. With --verify-sweep it then measures t_verify(T) for each target and plots
it with the speedup the performance model predicts from it.

Inflated models are cached in --work-dir (a 7B stand-in is 13 GB in fp16: never in the repo).
Speeds exclude the prefill: tok/s = (new tokens - 1) / (wall - prefill), since the first new
token comes from the prefill and a 256-token prefill would otherwise dilute both modes alike.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import click
from click.core import ParameterSource

from dovetail_runtime.chat_template import encode_chat
from dovetail_runtime.cli import AUTO_MAX_DEPTH, DRAFT_DTYPES, MAX_LOOKUP_TOKENS, cores_option
from dovetail_runtime.coordinator import Coordinator, RuntimeSettings
from dovetail_runtime.lookup import DEFAULT_LOOKUP_TOKENS
from dovetail_runtime.tokenizer import Tokenizer
from dovetail_runtime.tree_planner import TREE_SIZES, AutoTree, TreePlanner
from gpu_worker.train.corpus import stdlib_files
from ipc import messages as m
from ipc.dtypes import KV_DTYPES, TARGET_PRECISIONS
from ipc.tree import MAX_DEPTH, MAX_TOP_K, TreeError, TreeShape
from tools.bench_e2e import FALLBACK_PROMPTS
from tools.chat_prompts import heldout_prompts as heldout_chat_prompts
from tools.inflate_eagle3 import inflate_module, inflate_path
from tools.tables import markdown_header, markdown_row

REPO = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO / "demo" / "target-code-9m"
DEMO_DRAFT = REPO / "demo" / "draft-dgf"
DEFAULT_RUNS = "llama3-3b:fp32,llama2-7b:int8,llama2-13b:int8"
DEFAULT_WORK_DIR = Path("~/.cache/dovetail/standins")
SWEEP_SIZES = (1, 2, 4, 8, 16, 32, 64)
MARKER = "INFLATED.json"  # written last: a folder without it is incomplete
STORE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
# Bytes per linear weight (the block formats: GGUF's block sizes over 32 weights).
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "int8-row": 1, "int8": 34 / 32, "q8_0": 34 / 32, "q4_0": 18 / 32,
                   "int4": 18 / 32, "q4_1": 20 / 32, "q4_0-a16": 18 / 32, "q4_1-a16": 20 / 32}
Mode = Literal["dovetail", "ar"]
# What --dry-run sets, for every option left at its default.
DRY_RUN = {"runs": "tiny-1k:fp32", "layers": 2, "prompt_count": 2, "max_new_tokens": 8, "sweep_repeats": 2}


# --- inflation -----------------------------------------------------------------------------


def load_shapes() -> dict[str, tuple[int, ...]]:
    """inflate.py's SHAPES table (hidden, heads, kv_heads, head_dim, intermediate, layers): one source of truth."""
    return dict(inflate_module().SHAPES)


@dataclass(frozen=True)
class Dims:
    """The matrix sizes of a Llama-family model, enough to count its bytes."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Dims:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(hidden, heads, int(config.get("num_key_value_heads") or heads),
                   int(config.get("head_dim") or hidden // heads), int(config["intermediate_size"]),
                   int(config["num_hidden_layers"]), int(config["vocab_size"]))

    @classmethod
    def from_shape(cls, shape: tuple[int, ...], layers: int, vocab: int) -> Dims:
        hidden, heads, kv_heads, head_dim, intermediate, _ = shape
        return cls(hidden, heads, kv_heads, head_dim, intermediate, layers, vocab)

    @property
    def linear_params(self) -> int:
        """Every matrix a decode step reads: the layers' projections and the lm_head."""
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        return self.layers * (attention + 3 * self.hidden * self.intermediate) + self.vocab * self.hidden

    @property
    def norm_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden

    @property
    def all_params(self) -> int:
        return self.linear_params + self.norm_params + self.vocab * self.hidden  # + the embedding

    def streamed_bytes(self, precision: str) -> int:
        """Bytes one decode step must read at this precision. The embedding is left out: a
        step reads one row of it. Every precision keeps norms in fp32 (int8-row's per-channel
        scales are ~0.1%)."""
        return int(self.linear_params * PRECISION_BYTES[precision]) + self.norm_params * 4


def fingerprint(*folders: Path) -> str:
    """Short hash of the source folders (path, file names, sizes, mtimes): a retrained source
    gets a new cache folder instead of a stale stand-in."""
    digest = hashlib.sha1()
    for folder in folders:
        digest.update(str(folder.resolve()).encode())
        for file in sorted(folder.iterdir()):
            stat = file.stat()
            digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:8]


def folder_bytes(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.iterdir() if file.is_file())


def check_free_space(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed + (1 << 30):
        raise click.ClickException(f"inflating needs about {needed / 1e9:.1f} GB in {folder}; "
                                   f"{free / 1e9:.1f} GB free (pick another --work-dir)")


def ensure_inflated(what: str, arguments: list[str], destination: Path, size_estimate: int,
                    program: list[str] | None = None) -> Path:
    """Run ``inflate.py`` (or ``program``) with ``arguments`` into ``DESTINATION.partial``, mark it
    complete, then rename it, so a cache folder is either complete or absent. Reused when its
    marker is there."""
    if (destination / MARKER).is_file():
        print(f"reusing {what}: {destination} ({folder_bytes(destination) / 1e9:.2f} GB)", flush=True)
        return destination
    partial = destination.with_name(destination.name + ".partial")
    for stale in (partial, destination):  # an interrupted earlier run's leftovers in our own cache
        if stale.exists():
            shutil.rmtree(stale)
    check_free_space(destination.parent, size_estimate)
    print(f"inflating {what} (~{size_estimate / 1e9:.1f} GB) -> {destination} ...", flush=True)
    command = [*(program or [sys.executable, str(inflate_path())]), *arguments, str(partial)]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise click.ClickException(f"inflating failed (exit {result.returncode}): {shlex.join(command)}")
    (partial / MARKER).write_text(json.dumps({"command": command, "seconds": round(seconds, 1)}, indent=1))
    partial.rename(destination)
    print(f"  done in {seconds:.1f} s, {folder_bytes(destination) / 1e9:.2f} GB on disk", flush=True)
    return destination


@dataclass(frozen=True)
class Sources:
    target: Path  # the small trained target
    draft: Path  # its head
    work_dir: Path
    store_dtype: str  # dtype of the inflated target's files


def inflate_target(sources: Sources, shape_name: str, shape: tuple[int, ...], layers: int) -> Path:
    config = json.loads((sources.target / "config.json").read_text())
    name = (f"target-{sources.target.name}-{fingerprint(sources.target)}-{shape_name}-"
            f"L{layers}-{sources.store_dtype}")
    size = Dims.from_shape(shape, layers, int(config["vocab_size"])).all_params * STORE_BYTES[sources.store_dtype]
    arguments = ["target", str(sources.target), "--shape", shape_name, "--dtype", sources.store_dtype,
                 "--layers", str(layers)]
    return ensure_inflated(f"target {shape_name} ({layers} layers, {sources.store_dtype})", arguments,
                           sources.work_dir / name, size)


def check_sources(sources: Sources) -> None:
    """Both source folders are model folders: a folder without config.json was a FileNotFoundError traceback
    (for --draft, after the target had been inflated)."""
    for folder, option in ((sources.target, "--target"), (sources.draft, "--draft")):
        if not (folder / "config.json").is_file():
            raise click.BadParameter(f"{folder} has no config.json: not a model folder", param_hint=f"'{option}'")


def inflate_head(sources: Sources, shape_name: str, shape: tuple[int, ...]) -> Path:
    """The head's inflation depends on the shape and the small target only (not on --layers).
    A DGF or fc head goes through inflate.py, an EAGLE-3 head through ``tools.inflate_eagle3``."""
    config = json.loads((sources.draft / "config.json").read_text())
    head_layers = int(config["num_hidden_layers"])
    name = (f"head-{sources.draft.name}-{fingerprint(sources.draft, sources.target)}-{shape_name}-"
            f"L{head_layers}-fp16")
    size = Dims.from_shape(shape, head_layers, 0).all_params * 2 + 4 * shape[0] ** 2 * 2  # layers + W_1, W_2, W_z
    what = f"head {sources.draft.name} for {shape_name} ({head_layers} layers, fp16)"
    if "draft_vocab_size" in config:  # EAGLE-3: fc over 3 target rows, attention over 2H, a draft vocabulary
        hidden, heads, head_dim = shape[0], shape[1], shape[3]
        size += (3 * hidden ** 2 + 3 * hidden * heads * head_dim + int(config["draft_vocab_size"]) * hidden) * 2
        arguments = [str(sources.draft), "--target-src", str(sources.target), "--shape", shape_name]
        return ensure_inflated(what, arguments, sources.work_dir / name, size,
                               program=[sys.executable, "-m", "tools.inflate_eagle3"])
    arguments = ["head", str(sources.draft), "--target-src", str(sources.target), "--shape", shape_name,
                 "--dtype", "fp16"]
    return ensure_inflated(what, arguments, sources.work_dir / name, size)


GGUF_KINDS = ("q4_0", "q4_1", "q8_0")


def gguf_target(target_dir: Path, kind: str) -> Path:
    """The inflated target as a GGUF file, as llama.cpp's converter and quantizer would make it
    (``tools.gguf_standin``: projections and embedding in ``kind`` blocks, the output matrix Q8_0, the
    tokenizer and chat template in its metadata), cached beside the folder."""
    from gguf import GGMLQuantizationType

    from tools.gguf_standin import chat_template_metadata, tokenizer_metadata, write_gguf

    path = target_dir.with_name(f"{target_dir.name}.{kind}.gguf")
    if path.is_file():
        print(f"reusing {path} ({path.stat().st_size / 1e9:.2f} GB)", flush=True)
        return path
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    check_free_space(path.parent, folder_bytes(target_dir) // 2)  # 4-8.5 bits a weight against fp16's 16
    print(f"writing the target as a {kind} GGUF -> {path} ...", flush=True)
    started = time.perf_counter()
    block = GGMLQuantizationType[kind.upper()]
    write_gguf(target_dir, partial, {"proj": block, "embd": block, "output": GGMLQuantizationType.Q8_0},
               tokenizer_metadata(target_dir) | chat_template_metadata(target_dir))
    partial.rename(path)
    print(f"  done in {time.perf_counter() - started:.1f} s, {path.stat().st_size / 1e9:.2f} GB", flush=True)
    return path


# --- prompts -------------------------------------------------------------------------------


def heldout_prompts(tokenizer: Tokenizer, count: int, tokens: int) -> tuple[list[str], str]:
    """The first ``tokens`` tokens of held-out stdlib files (DESIGN.md 10), cut with the
    runtime's own tokenizer and decoded back to text; files shorter than that are skipped so
    every prompt has the same length. Falls back to built-in code prompts without the stdlib."""
    prompts: list[str] = []
    for path in stdlib_files("heldout"):
        # 16 characters per token is far more than this BPE averages: enough text, not a whole file.
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")[: tokens * 16])
        if len(ids) >= tokens:
            prompts.append(tokenizer.decode(ids[:tokens]))
        if len(prompts) == count:
            return prompts, f"the first {tokens} tokens of {count} held-out stdlib files"
    missing = count - len(prompts)
    fallback = [FALLBACK_PROMPTS[i % len(FALLBACK_PROMPTS)] for i in range(missing)]
    note = f"{len(prompts)} held-out stdlib prompts of {tokens} tokens + {missing} short built-in prompts"
    return prompts + fallback, note


def chat_prompts(count: int) -> tuple[list[list[m.ChatMessage]], str]:
    """Held-out chat prompts (``tools.chat_prompts``: topics no training prompt names), one user
    turn each, which the target's chat template renders."""
    prompts = heldout_chat_prompts(count)
    return ([[m.ChatMessage(role="user", content=text)] for text in prompts],
            f"{len(prompts)} held-out chat prompts (tools/chat_prompts.py), the target's chat template")


Prompt = str | list[m.ChatMessage]  # raw text, or chat messages the target's template renders


def prompt_ids(coordinator: Coordinator, prompt: Prompt) -> list[int]:
    assert coordinator.tokenizer is not None and coordinator.chat_template is not None
    if isinstance(prompt, str):
        return coordinator.tokenizer.encode(prompt)
    return encode_chat(coordinator.tokenizer, coordinator.chat_template, prompt)


# --- one run: a Coordinator, prompts in both modes -----------------------------------------


@dataclass
class ModeTotals:
    """One mode's statistics summed over its requests."""

    requests: int = 0
    new_tokens: int = 0
    cycles: int = 0
    cycle_tokens: float = 0.0
    wall_ms: float = 0.0
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    draft_prompt_ms: float = 0.0  # of draft_ms, the first steps' (the draft absorbing each prompt)
    verify_ms: float = 0.0
    ipc_ms: float = 0.0
    trees: Counter[str] = field(default_factory=Counter)  # cycles per "T/depth/top_k"

    def add(self, stats: m.RequestStats) -> None:
        self.requests += 1
        self.new_tokens += stats.new_tokens
        self.cycles += stats.cycles
        self.cycle_tokens += stats.tau * stats.cycles
        self.wall_ms += stats.wall_ms
        self.prefill_ms += stats.prefill_ms
        self.draft_ms += stats.draft_ms
        self.draft_prompt_ms += stats.draft_prompt_ms
        self.verify_ms += stats.verify_ms
        self.ipc_ms += stats.ipc_ms
        self.trees.update(stats.trees)

    @property
    def decode_tokens(self) -> int:
        return self.new_tokens - self.requests  # the first token of each request is the prefill's

    @property
    def decode_ms(self) -> float:
        return self.wall_ms - self.prefill_ms

    def tokens_per_s(self) -> float | None:
        return self.decode_tokens / (self.decode_ms / 1e3) if self.decode_tokens > 0 and self.decode_ms > 0 else None

    def ms_per_token(self) -> float | None:
        return self.decode_ms / self.decode_tokens if self.decode_tokens > 0 else None

    def per_cycle(self, total_ms: float) -> float | None:
        return total_ms / self.cycles if self.cycles else None

    def tau(self) -> float | None:
        return self.cycle_tokens / self.cycles if self.cycles else None


@dataclass
class RunResult:
    shape: str
    precision: str
    layers: int
    trees: list[TreeSetting]
    target_dir: Path | None = None
    modes: dict[str, ModeTotals] = field(default_factory=dict)  # "ar" and one per tree setting's label
    compared: int = 0  # dovetail requests compared with ar
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    rss_kb: dict[str, dict[str, int]] = field(default_factory=dict)  # worker -> VmHWM / VmRSS
    weight_bytes: int | None = None
    weight_bytes_source: str = ""
    threads: int | None = None
    prompt_lengths: list[int] = field(default_factory=list)
    sweep_prompt: list[int] = field(default_factory=list)
    sweep_ms: dict[int, float] = field(default_factory=dict)
    draft_dtype: str = "auto"  # the draft's --draft-dtype
    # Each tree setting's --lookup-tokens (None: dovetail-run's default), parallel to ``trees``.
    lookups: list[int | None] = field(default_factory=list)

    @property
    def precision_label(self) -> str:
        return self.precision if self.draft_dtype == "auto" else f"{self.precision}, draft {self.draft_dtype}"

    @property
    def label(self) -> str:
        return f"{self.shape} {self.precision_label}"

    def __post_init__(self) -> None:
        self.lookups = self.lookups or [None] * len(self.trees)
        self.modes = {"ar": ModeTotals(), **{label: ModeTotals() for label in self.tree_labels}}

    @property
    def tree_labels(self) -> list[str]:
        return [tree_label(tree, lookup) for tree, lookup in zip(self.trees, self.lookups, strict=True)]

    def ratio(self, label: str) -> float | None:
        dovetail, ar = self.modes[label].tokens_per_s(), self.modes["ar"].tokens_per_s()
        return dovetail / ar if dovetail and ar else None

    def best_fixed(self) -> str | None:
        """The fixed tree setting with the highest dovetail tok/s."""
        rated = [(rate, label) for tree, label in zip(self.trees, self.tree_labels)
                 if isinstance(tree, TreeShape) and (rate := self.modes[label].tokens_per_s())]
        return max(rated)[1] if rated else None


TreeSetting = TreeShape | AutoTree


def tree_label(tree: TreeSetting, lookup: int | None = None) -> str:
    shown = "" if lookup is None else f"@{lookup}"
    if isinstance(tree, AutoTree):
        return ("auto" if tree.max_tree_tokens == TREE_SIZES[-1] else f"auto:{tree.max_tree_tokens}") + shown
    return f"{tree.tree_tokens}/{tree.depth}/{tree.top_k}{shown}"


def parse_trees(text: str, depth: int | None, top_k: int) -> tuple[list[TreeSetting], list[int | None]]:
    """``auto``, ``auto:N`` or ``T/depth/top_k`` items, comma-separated, each with an optional ``@N``:
    its --lookup-tokens (else dovetail-run's default). Returns the trees and their lookups."""
    trees: list[TreeSetting] = []
    lookups: list[int | None] = []
    for setting in (part.strip() for part in text.split(",") if part.strip()):
        item, _, lookup = setting.partition("@")
        try:
            lookups.append(int(lookup) if lookup else None)
            if lookups[-1] is not None and not 0 <= lookups[-1] <= MAX_LOOKUP_TOKENS:
                raise ValueError(f"lookup tokens must be in 0..{MAX_LOOKUP_TOKENS}")
            if item == "auto" or item.startswith("auto:"):
                largest = int(item.removeprefix("auto:")) if item != "auto" else TREE_SIZES[-1]
                trees.append(AutoTree(max_tree_tokens=largest, max_depth=depth or AUTO_MAX_DEPTH, top_k=top_k))
            else:
                size, tree_depth, tree_top_k = (int(value) for value in item.split("/"))
                trees.append(TreeShape.clamped(size, tree_depth, tree_top_k))
        except (ValueError, TreeError) as error:
            raise click.BadParameter(f"{setting!r}: want auto, auto:N or T/depth/top_k, each with an optional "
                                     f"@lookup-tokens ({error})", param_hint="--trees") from None
    if not trees:
        raise click.BadParameter("no tree settings given", param_hint="--trees")
    return trees, lookups


def envelope_of(trees: list[TreeSetting]) -> TreeShape:
    """One shape whose caches and rings fit every setting (the coordinator is sized once)."""
    shapes = [tree.envelope if isinstance(tree, AutoTree) else tree for tree in trees]
    largest = max(shape.tree_tokens for shape in shapes)
    return TreeShape.clamped(largest, max(shape.depth for shape in shapes), max(shape.top_k for shape in shapes))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix), None if equal."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def proc_status_kb(pid: int) -> dict[str, int]:
    """VmHWM (peak resident) and VmRSS of a live process, in kB, from /proc/<pid>/status."""
    found = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                found[key] = int(value.split()[0])
    except OSError:
        pass
    return found


def run_prompt(coordinator: Coordinator, result: RunResult,
               planners: dict[str, tuple[TreePlanner | TreeShape, int]], index: int, prompt: Prompt,
               max_new_tokens: int) -> None:
    """ar and every tree setting on one prompt back to back (the order rotates per prompt, so no
    setting always runs on a warmer machine), each dovetail result compared with ar's tokens."""
    labels = ["ar", *planners]
    shift = index % len(labels)
    tokens: dict[str, list[int]] = {}
    for label in labels[shift:] + labels[:shift]:
        if label != "ar":
            coordinator.tree, coordinator.lookup_tokens = planners[label]
        text, messages = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        reply = coordinator.generate(m.GenerateRequest(request_id=uuid.uuid4().hex, prompt=text, messages=messages,
                                                       max_new_tokens=max_new_tokens,
                                                       mode="ar" if label == "ar" else "dovetail"))
        if isinstance(reply, m.ErrorReply):
            message = f"prompt {index} {label}: {reply.code}: {reply.message}"
            print(f"ERROR {result.label}: {message}", file=sys.stderr, flush=True)
            result.errors.append(message)
            return
        result.modes[label].add(reply.stats)
        tokens[label] = list(reply.token_ids)
    for label in planners:
        result.compared += 1
        where = first_difference(tokens[label], tokens["ar"])
        if where is not None:
            result.mismatches.append(f"prompt {index} tree {label} at token {where}")
            print(f"MISMATCH {result.label}: tree {label} and ar differ on prompt {index} from new token {where}",
                  file=sys.stderr, flush=True)


def read_worker_memory(coordinator: Coordinator, result: RunResult) -> None:
    for worker in coordinator.workers():
        if worker.process is not None:
            result.rss_kb[worker.name] = proc_status_kb(worker.process.pid)


def target_weight_bytes(coordinator: Coordinator, target_dir: Path, precision: str) -> tuple[int, str]:
    """The bytes a decode step streams: the cpu_worker's own count when it reports one, else
    an estimate from the config (parameters x bytes per parameter at the precision)."""
    info = coordinator.cpu.info if coordinator.cpu is not None else None
    if info is not None:
        return info.weight_bytes, "cpu_worker"
    config = json.loads((target_dir / "config.json").read_text())
    return Dims.from_config(config).streamed_bytes(precision), "config estimate"


@dataclass(frozen=True)
class RunOptions:
    prompt_count: int
    prompt_tokens: int
    max_new_tokens: int
    trees: list[TreeSetting]
    lookups: list[int | None]  # each tree setting's --lookup-tokens (None: the default)
    cpu_threads: int | None
    cpu_cores: list[int] | None
    draft_device: str
    startup_timeout_s: float
    kv_dtype: str = "auto"
    draft_threads: int | None = None
    draft_cores: list[int] | None = None
    chat: bool = False  # held-out chat prompts instead of stdlib code


def measure_run(result: RunResult, target_dir: Path, head_dir: Path, options: RunOptions) -> str:
    """One Coordinator for one target: warm-up, then every prompt with ar and each tree setting.
    Returns the prompt note."""
    envelope = envelope_of(options.trees)
    lookups = [DEFAULT_LOOKUP_TOKENS if lookup is None else lookup for lookup in options.lookups]
    settings = RuntimeSettings(
        target=str(target_dir), draft=str(head_dir), target_dtype=result.precision, kv_dtype=options.kv_dtype,
        cpu_threads=options.cpu_threads, cpu_cores=options.cpu_cores, draft_device=options.draft_device,
        draft_threads=options.draft_threads, draft_cores=options.draft_cores, draft_dtype=result.draft_dtype,
        tree=envelope, lookup_tokens=max(lookups), log_level="warning", startup_timeout_s=options.startup_timeout_s,
        # Room for the prompt (re-encoding a cut prompt can add a token or two; a templated chat prompt
        # is well under 256 tokens), the new tokens and one tree.
        max_len=max(options.prompt_tokens, 256 if options.chat else 0) + options.max_new_tokens
        + envelope.tree_tokens + 32)
    print(f"\n== {result.label}: starting the workers ...", flush=True)
    started = time.perf_counter()
    with Coordinator(settings) as coordinator:
        assert coordinator.tokenizer is not None and coordinator.cpu is not None
        print(f"   workers ready in {time.perf_counter() - started:.1f} s "
              f"(cpu_worker {coordinator.cpu.info}, gpu_worker {coordinator.gpu.info if coordinator.gpu else {}})",
              flush=True)
        result.threads = coordinator.cpu.info.threads if coordinator.cpu.info is not None else None
        result.weight_bytes, result.weight_bytes_source = target_weight_bytes(coordinator, target_dir,
                                                                              result.precision)
        prompts: list[Prompt]
        prompts, note = (chat_prompts(options.prompt_count) if options.chat else  # type: ignore[assignment]
                         heldout_prompts(coordinator.tokenizer, options.prompt_count, options.prompt_tokens))
        result.prompt_lengths = [len(prompt_ids(coordinator, prompt)) for prompt in prompts]
        result.sweep_prompt = prompt_ids(coordinator, prompts[0])
        # Each auto setting gets its own planner (costs measured as a server measures them; the
        # target's t_verify comes from the cache after the first).
        planners: dict[str, tuple[TreePlanner | TreeShape, int]] = {}
        for tree, lookup, label in zip(options.trees, lookups, result.tree_labels, strict=True):
            planners[label] = (coordinator.plan_trees(tree) if isinstance(tree, AutoTree) else tree, lookup)
        for mode in ("dovetail", "ar"):  # first-call costs (allocations, thread pools) out of the numbers
            coordinator.tree = envelope
            coordinator.generate(m.GenerateRequest(request_id=f"warmup-{mode}", prompt=FALLBACK_PROMPTS[0],
                                                   max_new_tokens=4, mode=mode))
        for index, prompt in enumerate(prompts):
            step = time.perf_counter()
            run_prompt(coordinator, result, planners, index, prompt, options.max_new_tokens)
            print(f"   prompt {index + 1}/{len(prompts)}: ar and {len(planners)} tree setting(s) in "
                  f"{time.perf_counter() - step:.1f} s", flush=True)
        for label, (planner, _) in planners.items():
            if isinstance(planner, TreePlanner):
                print(f"   {label}: settled on {planner.describe()}", flush=True)
        read_worker_memory(coordinator, result)
    return note


# --- bandwidth and the verify sweep --------------------------------------------------------


def measure_bandwidth(threads: int | None, megabytes: int = 1024, repeats: int = 5) -> tuple[float, float]:
    """(read GB/s, copy GB/s), best of ``repeats``. Read (a sum: every byte read once, nothing
    written) is the roofline of a decode step; copy counts read + written bytes. The buffer sits
    on huge pages, as the workers' weights do (cpu_worker/kernels/huge_pages.py): where the OS grants
    them a stream reads a few percent faster, and the roofline is the fastest read."""
    import torch

    from cpu_worker.kernels.huge_pages import on_huge_pages

    if threads:
        torch.set_num_threads(threads)
    source = on_huge_pages(torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32))
    target = torch.empty_like(source)
    nbytes = source.numel() * 4
    read, copy = [], []
    for _ in range(repeats + 1):  # the first round faults pages in
        start = time.perf_counter()
        source.sum()
        read.append(time.perf_counter() - start)
        start = time.perf_counter()
        target.copy_(source)
        copy.append(time.perf_counter() - start)
    del source, target
    gc.collect()
    return nbytes / min(read[1:]) / 1e9, 2 * nbytes / min(copy[1:]) / 1e9


def balanced_parents(size: int) -> list[int]:
    """A balanced binary tree of ``size`` nodes in compact form (node i's parent is (i-1)//2)."""
    return [-1] + [(index - 1) // 2 for index in range(1, size)]


def sweep_main() -> None:
    """Child process of the sweep (run as ``python -c``): load one target, time tree_logits per T,
    print {T: ms} as JSON on the last stdout line. A child, so that running out of memory loading
    a large target ends the sweep for that target, not the bench."""
    job = json.loads(sys.argv[1])
    if job["cores"]:
        os.sched_setaffinity(0, job["cores"])  # before torch starts its pool: its threads inherit this
    import torch

    from cpu_worker.server import build_engine

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    prompt: list[int] = job["prompt"]
    sizes: list[int] = job["sizes"]
    # The worker's own engine: its kernels (fp32 packed) and KV dtype decide t_verify(T).
    engine, _ = build_engine(job["target"], job["precision"], len(prompt) + max(sizes), job["kv_dtype"])
    engine.prefill(prompt)
    timings = {}
    for size in sizes:
        tokens = [prompt[(index * 7) % len(prompt)] for index in range(size)]
        parents = balanced_parents(size)
        engine.tree_logits(tokens, parents)  # warm-up; the tree's KV stays in scratch slots, never committed
        times = []
        for _ in range(job["repeats"]):
            start = time.perf_counter()
            engine.tree_logits(tokens, parents)
            times.append(time.perf_counter() - start)
        timings[size] = statistics.median(times) * 1e3
        print(f"   T={size}: {timings[size]:.2f} ms", file=sys.stderr, flush=True)
    print(json.dumps(timings))


def verify_sweep(result: RunResult, sizes: tuple[int, ...], repeats: int, cores: list[int] | None,
                 kv_dtype: str) -> None:
    if result.target_dir is None or not result.sweep_prompt:
        return
    print(f"\n== t_verify(T) for {result.label} ({result.threads} threads, prefix {len(result.sweep_prompt)} "
          f"tokens, balanced binary trees, median of {repeats}) ...", flush=True)
    job = {"target": str(result.target_dir), "precision": result.precision, "threads": result.threads,
           "cores": cores, "prompt": result.sweep_prompt, "sizes": list(sizes), "repeats": repeats,
           "kv_dtype": kv_dtype}
    child = subprocess.run([sys.executable, "-c", "from tools.bench_real import sweep_main; sweep_main()",
                            json.dumps(job)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    if child.returncode != 0:
        why = " (killed: likely out of memory)" if child.returncode == -9 else ""
        print(f"ERROR sweep for {result.label} failed with exit {child.returncode}{why}", file=sys.stderr)
        return
    result.sweep_ms = {int(size): float(ms) for size, ms in json.loads(child.stdout.strip().splitlines()[-1]).items()}


# --- report --------------------------------------------------------------------------------


REPORT_HEADER = (
    "shape", "precision", "ar tok/s", "tree setting", "trees verified (T/depth/top_k x cycles)", "dovetail tok/s",
    "dovetail / ar", "tau", "draft ms/cycle", "verify ms/cycle", "ipc ms/cycle", "ar ms/token", "ar % of roofline",
    "cpu_worker peak RSS GB", "gpu_worker peak RSS GB", "same tokens as ar")


def cell(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def same_tokens_cell(result: RunResult, label: str) -> str:
    compared = result.modes[label].requests
    if not compared:
        return "n/a"
    differ = [mismatch for mismatch in result.mismatches if f" tree {label} " in mismatch]
    if differ:
        return f"**NO** ({len(differ)}/{compared} differ: {'; '.join(differ)})"
    return f"yes ({compared}/{compared})"


def roofline_tps(result: RunResult, bandwidth_gbs: float) -> float | None:
    return bandwidth_gbs * 1e9 / result.weight_bytes if result.weight_bytes else None


def table_rows(result: RunResult, bandwidth_gbs: float) -> list[str]:
    ar = result.modes["ar"]
    if result.errors and not result.compared:
        failed = f"failed: {result.errors[0][:200]}"
        return [markdown_row([f"{result.shape} ({result.layers} L)", result.precision_label, failed])]
    ar_tps, roof = ar.tokens_per_s(), roofline_tps(result, bandwidth_gbs)
    rss = {name: result.rss_kb.get(name, {}).get("VmHWM") for name in ("cpu_worker", "gpu_worker")}
    rows = []
    for label in result.tree_labels:
        dovetail = result.modes[label]
        used = ", ".join(f"{shape} x{count}" for shape, count in dovetail.trees.most_common(3))
        cells = [
            f"{result.shape} ({result.layers} L)", result.precision_label, cell(ar_tps), label, used or "n/a",
            cell(dovetail.tokens_per_s()), cell(result.ratio(label), suffix="x"), cell(dovetail.tau()),
            cell(dovetail.per_cycle(dovetail.draft_ms)), cell(dovetail.per_cycle(dovetail.verify_ms)),
            cell(dovetail.per_cycle(dovetail.ipc_ms)), cell(ar.ms_per_token()),
            cell(100 * ar_tps / roof if ar_tps and roof else None, 0, "%"),
            *(cell(kb / 1024**2 if kb else None) for kb in rss.values()), same_tokens_cell(result, label)]
        rows.append(markdown_row(cells))
    return rows


def print_report(command: str, context: list[str], results: list[RunResult], bandwidth_gbs: float) -> None:
    print("\n" + command)
    for line in context:
        print(line)
    print("\n" + markdown_header(REPORT_HEADER))
    for result in results:
        for row in table_rows(result, bandwidth_gbs):
            print(row)
    print()
    for result in results:
        print(run_notes(result, bandwidth_gbs))


def run_notes(result: RunResult, bandwidth_gbs: float) -> str:
    """The numbers behind a row: roofline inputs, prefill, memory now, errors."""
    parts = [f"- {result.label}:"]
    roof = roofline_tps(result, bandwidth_gbs)
    if result.weight_bytes:
        parts.append(f"streams {result.weight_bytes / 1e9:.2f} GB/token ({result.weight_bytes_source}), "
                     f"roofline {cell(roof)} tok/s at {bandwidth_gbs:.1f} GB/s;")
    if result.threads is not None:
        parts.append(f"{result.threads} target threads;")
    if result.prompt_lengths:
        parts.append(f"prompts of {min(result.prompt_lengths)}-{max(result.prompt_lengths)} tokens;")
    for mode, totals in result.modes.items():
        if totals.requests:
            parts.append(f"{mode} prefill {totals.prefill_ms / totals.requests:.0f} ms/prompt;")
        if totals.requests and totals.draft_prompt_ms and totals.cycles:
            # In decode time and in draft ms/cycle: the first cycle's draft step reads the whole prompt.
            parts.append(f"{mode}'s draft absorbs the prompt in {totals.draft_prompt_ms / totals.requests:.0f} "
                         f"ms/prompt ({totals.draft_prompt_ms / totals.cycles:.1f} of its draft ms/cycle);")
    for name, status in result.rss_kb.items():
        if status:
            parts.append(f"{name} VmRSS {status.get('VmRSS', 0) / 1024**2:.2f} GB at the end;")
    best = result.best_fixed()
    autos = [label for tree, label in zip(result.trees, result.tree_labels) if isinstance(tree, AutoTree)]
    for label in autos:
        auto_tps = result.modes[label].tokens_per_s()
        best_tps = result.modes[best].tokens_per_s() if best else None
        if auto_tps and best_tps:
            parts.append(f"{label} / best fixed tree ({best}): {auto_tps / best_tps:.3f};")
    if result.errors:
        parts.append(f"ERRORS: {' | '.join(result.errors)}")
    return " ".join(parts)


PLOT_INSTALL_HINT = "pip install -e '.[bench]'"


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def check_plot_request(plot_path: Path | None, verify_sweep: bool) -> None:
    """An explicit --plot that cannot be drawn fails now, not after the hour of runs before it."""
    if plot_path is None:
        return
    if not verify_sweep:
        raise click.ClickException("--plot draws the verify sweep, which --no-verify-sweep turns off")
    if not matplotlib_available():
        raise click.ClickException(f"--plot needs matplotlib, which is not installed ({PLOT_INSTALL_HINT})")


def write_plot(results: list[RunResult], path: Path) -> None:
    """The sweep figure (sweep_figure) as a PNG; skipped with a note when it cannot be drawn (main has
    already refused an explicit --plot without matplotlib)."""
    if not matplotlib_available():
        print(f"plot skipped: matplotlib is missing ({PLOT_INSTALL_HINT})", file=sys.stderr)
        return
    swept = [result for result in results if result.sweep_ms]
    if not swept:
        print("plot skipped: no t_verify(T) measured", file=sys.stderr)
        return
    figure = sweep_figure(swept)
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"plot written to {path}")


def sweep_figure(swept: list[RunResult]) -> Any:
    """Left: measured t_verify(T). Right: speedup from DESIGN.md 9 with that curve, the measured
    draft and ipc times, and the measured tau held for every T (capped at T): tau(T) itself was
    measured only at the run's trees, which give the one measured point per run."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    modelled = 0
    for result in swept:
        sizes = sorted(result.sweep_ms)
        line = left.plot(sizes, [result.sweep_ms[size] for size in sizes], "o-", label=result.label)[0]
        modelled += plot_model(right, result, sizes, line.get_color())
    left.set(xlabel="tree size T (tokens verified per cycle)", ylabel="t_verify(T), ms (median, log scale)",
             title="measured tree verification time")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    right.set_xscale("log", base=2)
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set(xlabel="tree size T", ylabel="speedup over ar (decode, prefill excluded)")
    right.set_title("modelled: tau x t_ar / (t_draft + t_verify(T) + t_ipc), t_verify from the left panel;\n"
                    "tau(T) unknown: lines hold the measured tau for every T (capped at T);\n"
                    "auto settings vary T per cycle: their points sit at the mean T", fontsize=10)
    left.legend(fontsize=8)
    if modelled:
        right.legend(fontsize=8)
    else:  # say why the panel is empty instead of leaving a blank frame
        right.text(0.5, 0.5, "nothing to model: no tree setting decoded with drafts in these runs",
                   ha="center", va="center", transform=right.transAxes)
    for axis in (left, right):
        axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    return figure


def mean_tree_size(trees: Counter[str]) -> float | None:
    """Tokens per verified tree, over the cycles of a run ("T/depth/top_k" -> cycles)."""
    cycles = sum(trees.values())
    return sum(int(shape.split("/")[0]) * count for shape, count in trees.items()) / cycles if cycles else None


def modelled_setting(result: RunResult) -> tuple[str, float, str] | None:
    """(label, T, how T reads) of the tree setting the right panel models: the best fixed setting at
    its T; else, as with the default --trees auto, the fastest auto setting at the mean T of the
    trees it chose (its trees vary per cycle, so its tau and times are means over those trees)."""
    label = result.best_fixed()
    if label is not None:
        return label, float(label.split("/")[0]), f"T={label.split('/')[0]}"
    rated = [(rate, label) for tree, label in zip(result.trees, result.tree_labels)
             if isinstance(tree, AutoTree) and (rate := result.modes[label].tokens_per_s())]
    if not rated:
        return None
    label = max(rated)[1]
    size = mean_tree_size(result.modes[label].trees)
    return (label, size, f"mean T={size:.1f}") if size is not None else None


def plot_model(axis: Any, result: RunResult, sizes: list[int], color: str) -> bool:
    """The model around one tree setting of the run (modelled_setting); False when there is none."""
    chosen = modelled_setting(result)
    if chosen is None:
        return False
    label, measured_size, at = chosen
    dovetail, ar = result.modes[label], result.modes["ar"]
    tau, t_ar = dovetail.tau(), ar.ms_per_token()
    t_draft, t_ipc = dovetail.per_cycle(dovetail.draft_ms), dovetail.per_cycle(dovetail.ipc_ms)
    if tau is None or t_ar is None or t_draft is None or t_ipc is None:
        return False
    name = f"{result.label} {label}"
    model = [min(tau, size) * t_ar / (t_draft + result.sweep_ms[size] + t_ipc) for size in sizes]
    axis.plot(sizes, model, "--", color=color, label=f"{name}: model, tau {tau:.2f} for all T")
    ratio, t_verify = result.ratio(label), dovetail.per_cycle(dovetail.verify_ms)
    if ratio is not None:
        axis.plot([measured_size], [ratio], "o", color=color, markersize=8, label=f"{name}: measured at {at}")
    if t_verify is not None:  # the model with the runtime's own verify time: shows what the sweep misses
        axis.plot([measured_size], [tau * t_ar / (t_draft + t_verify + t_ipc)], "x", color=color, markersize=9,
                  label=f"{name}: model with the run's own verify ms at {at}")
    return True


# --- CLI -----------------------------------------------------------------------------------


def parse_runs(text: str, shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, str, str]]:
    """SHAPE:PRECISION[:DRAFT_DTYPE] items: the target's shape and precision, the draft's --draft-dtype."""
    runs = []
    for item in text.split(","):
        shape, _, rest = item.strip().partition(":")
        precision, _, draft_dtype = rest.partition(":")
        if shape not in shapes:
            raise click.BadParameter(f"unknown shape {shape!r}; inflate.py knows {', '.join(sorted(shapes))}",
                                     param_hint="--runs")
        if precision not in TARGET_PRECISIONS:
            raise click.BadParameter(f"{item!r}: precision must be one of {', '.join(TARGET_PRECISIONS)}",
                                     param_hint="--runs")
        if draft_dtype and draft_dtype not in DRAFT_DTYPES:
            raise click.BadParameter(f"{item!r}: the draft dtype must be one of {', '.join(DRAFT_DTYPES)}",
                                     param_hint="--runs")
        runs.append((shape, precision, draft_dtype or "auto"))
    return runs


def resolve_work_dir(work_dir: Path) -> Path:
    folder = work_dir.expanduser().resolve()
    if folder == REPO or REPO in folder.parents:
        raise click.BadParameter(f"{folder} is inside the repository: stand-ins are GBs, keep them elsewhere",
                                 param_hint="--work-dir")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def apply_dry_run(context: click.Context, values: dict[str, Any]) -> None:
    """--dry-run: the small settings, for every option the user left at its default."""
    for name, value in DRY_RUN.items():
        if context.get_parameter_source(name) == ParameterSource.DEFAULT:
            values[name] = value


def command_line() -> str:
    return shlex.join(["python", "-m", "tools.bench_real", *sys.argv[1:]])


def machine_line(threads: int | None, bandwidth: tuple[float, float]) -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"machine: {model}, {len(os.sched_getaffinity(0))} cores available; bandwidth measured with "
            f"{threads or 'default'} threads: read {bandwidth[0]:.1f} GB/s (roofline), copy {bandwidth[1]:.1f} GB/s")


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--runs", default=DEFAULT_RUNS,
              help="Comma list of SHAPE:PRECISION[:DRAFT_DTYPE]. Shapes are inflate.py's (tiny-1k, llama-1b, "
                   "llama3-3b, llama2-7b, llama3-8b, llama2-13b); precisions fp32, bf16, int8, int8-row, q8_0, q4_0, "
                   "q4_1; the draft's dtype as dovetail-run's --draft-dtype (default auto). One Coordinator per item.")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Layer count for every target instead of the shape's own (quick runs). Never fewer than the "
                   "small target's own layers: inflate.py keeps every trained layer.")
@click.option("--target", "target_src", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=DEMO_TARGET, help="The small trained target to inflate.")
@click.option("--draft", "draft_src", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=DEMO_DRAFT, help="The draft head trained for --target (Dovetail dgf or fc) to inflate.")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_WORK_DIR,
              help="Cache of inflated models (GBs each; never inside the repo). Complete ones are reused.")
@click.option("--store-dtype", type=click.Choice(sorted(STORE_BYTES)), default="fp16",
              help="Dtype of the inflated target's files on disk (the worker converts to --runs' precision).")
@click.option("--prompts", "prompt_count", type=click.IntRange(min=1), default=4,
              help="Held-out prompts per run (each runs in both modes).")
@click.option("--prompt-tokens", type=click.IntRange(min=2), default=256,
              help="Prompt length: the first N tokens of each held-out stdlib file.")
@click.option("--chat", is_flag=True,
              help="Held-out chat prompts (tools/chat_prompts.py's held-out topics) in the target's chat template "
                   "instead of stdlib code: for a chat target and head, e.g. --target <SmolLM2 folder> --draft "
                   "demo/draft-smollm2.")
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=64, help="New tokens per request (greedy).")
@click.option("--trees", default="auto",
              help="Tree settings to run, comma-separated, each on every prompt beside one ar run: auto, auto:N "
                   "(--tree-tokens auto), or T/depth/top_k (fixed), e.g. auto,8/5/8,16/6/8; @N after one sets its "
                   "--lookup-tokens (prompt lookup's branch; default dovetail-run's), e.g. auto,auto@0.")
@click.option("--depth", type=click.IntRange(min=1, max=MAX_DEPTH), default=None,
              help=f"Deepest tree auto tries.  [default: {AUTO_MAX_DEPTH}]")
@click.option("--tree-top-k", "top_k", type=click.IntRange(min=1, max=MAX_TOP_K), default=8,
              help="The widest beam of the auto settings (they also try half of it).")
@click.option("--cpu-threads", type=click.IntRange(min=1), default=None,
              help="Intra-op threads of the target worker (also used for the bandwidth test and the sweep). "
                   "[default: one per pinned core, else torch's]")
@click.option("--cpu-cores", callback=cores_option, default=None,
              help="Pin the target worker (and the sweep) to these cores, e.g. 0-7,16-23.")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default="auto", show_default=True,
              help="The target's KV cache dtype, as dovetail-run's --kv-dtype (auto: bf16 for a bf16 target, and for "
                   "integer ones where the native library builds or the CPU has native bf16; else fp32).")
@click.option("--draft-device", default="auto", help="Draft device: auto (CUDA if present, else CPU), cpu, cuda:N.")
@click.option("--draft-threads", type=click.IntRange(min=1), default=None,
              help="Intra-op threads of the draft worker, as dovetail-run's. [default: as dovetail-run]")
@click.option("--draft-cores", callback=cores_option, default=None,
              help="Pin the draft worker to these cores, e.g. 15 (a CUDA draft's host thread off the target's cores).")
@click.option("--startup-timeout", type=click.FloatRange(min=1), default=1800.0,
              help="Seconds to wait for the workers to load (a 13B target loads for minutes).")
@click.option("--verify-sweep/--no-verify-sweep", default=True,
              help="After the runs, time t_verify(T) for T in 1..64 on each target (in a child process, one "
                   "target at a time) and write --plot.")
@click.option("--sweep-repeats", type=click.IntRange(min=1), default=5, help="Timed verifications per T (median).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG of the sweep and the modelled speedup; needs matplotlib (pip install -e '.[bench]'). "
                   "[default: WORK_DIR/bench_real.png]")
@click.option("--gguf", type=click.Choice(GGUF_KINDS), default=None,
              help="Run each target from a GGUF file of these blocks (projections and embedding; output Q8_0), "
                   "written from the inflated folder and cached beside it, as a llama.cpp user would load it.")
@click.option("--dry-run", is_flag=True,
              help="Smoke test: --runs tiny-1k:fp32 --layers 2 --prompts 2 --max-new-tokens 8 --sweep-repeats 2, "
                   "for each of those options not given.")
@click.pass_context
def main(context: click.Context, **values: Any) -> None:
    """Real-cost benchmark: the demo pair inflated to real shapes (../shared/testbed/inflate.py),
    dovetail vs --mode ar on held-out prompts, one markdown table, then t_verify(T) and a plot.
    Run on a quiet machine: both modes share it, and so does anything else running."""
    if values.pop("dry_run"):
        apply_dry_run(context, values)
    check_plot_request(values["plot_path"], values["verify_sweep"])
    shapes = load_shapes()
    runs = parse_runs(values["runs"], shapes)
    work_dir = resolve_work_dir(values["work_dir"])
    sources = Sources(values["target_src"].resolve(), values["draft_src"].resolve(), work_dir, values["store_dtype"])
    check_sources(sources)
    trees, lookups = parse_trees(values["trees"], values["depth"], values["top_k"])
    options = RunOptions(values["prompt_count"], values["prompt_tokens"], values["max_new_tokens"], trees, lookups,
                         values["cpu_threads"], values["cpu_cores"], values["draft_device"], values["startup_timeout"],
                         values["kv_dtype"], values["draft_threads"], values["draft_cores"], values["chat"])
    source_layers = int(json.loads((sources.target / "config.json").read_text())["num_hidden_layers"])

    if values["layers"] and values["layers"] < source_layers:
        print(f"note: --layers {values['layers']} is below the small target's {source_layers} layers; "
              f"using {source_layers} (inflate.py keeps every trained layer)")

    started = time.perf_counter()
    plan = []
    for shape_name, precision, draft_dtype in runs:
        layers = max(values["layers"] or shapes[shape_name][5], source_layers)
        target_dir = inflate_target(sources, shape_name, shapes[shape_name], layers)
        if values["gguf"]:
            target_dir = gguf_target(target_dir, values["gguf"])
        head_dir = inflate_head(sources, shape_name, shapes[shape_name])
        plan.append((RunResult(shape_name, precision, layers, trees, target_dir, draft_dtype=draft_dtype,
                               lookups=lookups), head_dir))
    inflate_s = time.perf_counter() - started

    bandwidth = measure_bandwidth(values["cpu_threads"])  # before any worker holds memory
    started = time.perf_counter()
    prompt_note = "no run reached its prompts"
    for result, head_dir in plan:
        try:
            assert result.target_dir is not None
            prompt_note = measure_run(result, result.target_dir, head_dir, options) or prompt_note
        except Exception as error:  # one failed shape (e.g. out of memory) must not lose the others
            traceback.print_exc()
            result.errors.append(f"{type(error).__name__}: {error}")
    runs_s = time.perf_counter() - started

    results = [result for result, _ in plan]
    context_lines = [
        machine_line(values["cpu_threads"], bandwidth),
        f"prompts: {prompt_note}; {options.max_new_tokens} new tokens, greedy; ar and every tree setting per prompt "
        f"back to back; "
        f"tok/s and ms/token exclude the prefill; source pair {sources.target.name} + {sources.draft.name}",
        f"time: inflation {inflate_s:.1f} s, runs {runs_s:.1f} s",
    ]
    print_report(command_line(), context_lines, results, bandwidth[0])  # before the sweep: a crash there keeps it

    if values["verify_sweep"]:
        started = time.perf_counter()
        for result in results:
            verify_sweep(result, SWEEP_SIZES, values["sweep_repeats"], values["cpu_cores"], values["kv_dtype"])
        print_sweep(results)
        write_plot(results, values["plot_path"] or work_dir / "bench_real.png")
        print(f"sweep time {time.perf_counter() - started:.1f} s")


def print_sweep(results: list[RunResult]) -> None:
    swept = [result for result in results if result.sweep_ms]
    if not swept:
        return
    print("\n" + markdown_header(["T", *(f"{result.label} verify ms" for result in swept)]))
    for size in SWEEP_SIZES:
        print(markdown_row([size, *(cell(result.sweep_ms.get(size)) for result in swept)]))


if __name__ == "__main__":
    main()
