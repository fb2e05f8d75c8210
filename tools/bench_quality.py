"""Quality of each precision against fp32 on a real model's text, side by side in one run.

Three figures per precision, each against our fp32 engine on the same weights:
- teacher-forced top-1 agreement: on windows of English prose (the standard library's
  ``pydoc_data`` topics) and of code (standard-library modules), the share of positions whose
  argmax equals fp32's;
- mean KL divergence KL(fp32 || precision) over the same positions, in nats (llama.cpp's
  ``llama-perplexity --kl-divergence`` reports the same two figures as "Mean KLD" and "Same top p",
  over the second half of each window only: ``--scored second-half`` scores those positions, for
  figures to set beside it; a window's first positions see little context and diverge more);
- greedy common prefix on chat prompts (the model's chat template): how many of ``--new-tokens``
  greedy tokens equal fp32's before the first difference, and how many continuations fall into a
  loop (a short cycle repeated to the end).

Rows: our engine at each ``--precisions`` (exactly what the cpu_worker runs), and each
``--formats`` of ``tools/quant_reference`` (llama.cpp's Q8_0, Q4_0, Q4_1 and others, rounded as
their reference quantizers round, over F.linear), and ``--gguf``: a GGUF file as the cpu_worker loads
it (its own precision, or ``--gguf-precisions``). The default target is the SmolLM2-135M-Instruct
fixture that ``scripts/fetch_fixture.sh`` makes, whose fp32 folder is transformers' dequantization of
the fixture's GGUF::

    bash scripts/fetch_fixture.sh
    python -m tools.bench_quality                      # or --target DIR --windows 4 --prompts 8
    python -m tools.bench_quality --gguf ~/.cache/dovetail/fixtures/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import json
import statistics
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import torch
from tqdm import tqdm

from cpu_worker.engine import TargetEngine, greedy_decode
from cpu_worker.kernels.fp32_rows import prompt_rows
from cpu_worker.server import build_engine
from dovetail_runtime.chat_template import ChatTemplate
from dovetail_runtime.tokenizer import Tokenizer
from ipc.dtypes import TARGET_PRECISIONS
from tools import quant_reference
from tools.fixtures import SMOLLM2_DIR, SMOLLM2_GGUF
from tools.options import load_errors_in_one_line
from tools.tables import markdown_header, markdown_row

CODE_FILES = ("json/decoder.py", "textwrap.py", "heapq.py", "bisect.py", "string.py", "fractions.py",
              "graphlib.py", "shlex.py")
# Two dozen chat prompts of different kinds: facts, how-to, writing, code, reasoning.
CHAT_PROMPTS = (
    "What is the capital of France?", "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.", "How do I reverse a list in Python?",
    "Give me three tips for better sleep.", "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet.", "Write a short email asking for a meeting next week.",
    "What are prime numbers?", "How does a refrigerator keep food cold?",
    "Translate 'good morning' into Spanish and French.",
    "Write a Python function that checks if a string is a palindrome.",
    "Why is the sky blue?", "List the planets of the solar system in order.",
    "What is a healthy breakfast?", "Explain what a neural network is to a child.",
    "Write a limerick about a cat.", "How do vaccines work?",
    "What should I pack for a weekend hiking trip?", "What is the Pythagorean theorem?",
    "Describe the water cycle.", "Give me a recipe for pancakes.",
    "What causes earthquakes?", "How can I learn to play the guitar?",
)


@dataclass
class Texts:
    windows: list[list[int]]  # teacher-forced token windows (prose, then code)
    kinds: list[str]
    chats: list[list[int]]  # chat prompts, rendered and tokenized


@dataclass
class Reference:
    logits: list[torch.Tensor]  # per window: [positions, vocab] log-probabilities of fp32
    greedy: list[list[int]]


@dataclass
class Row:
    name: str
    top1: dict[str, float] = field(default_factory=dict)  # by text kind: share of positions agreeing
    kl: dict[str, float] = field(default_factory=dict)  # by text kind: mean KL(fp32 || this), nats
    prefixes: list[int] = field(default_factory=list)
    loops: int = 0
    seconds: float = 0.0


def prose_and_code(tokenizer: Tokenizer, windows: int, window_tokens: int) -> tuple[list[list[int]], list[str]]:
    """``windows`` windows of prose and as many of code, each ``window_tokens`` long."""
    from pydoc_data import topics

    prose = tokenizer.encode("\n\n".join(topics.topics[key] for key in sorted(topics.topics)))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = tokenizer.encode("\n\n".join((stdlib / name).read_text(encoding="utf-8") for name in CODE_FILES))
    chosen, kinds = [], []
    for kind, ids in (("prose", prose), ("code", code)):
        stride = max(window_tokens, (len(ids) - window_tokens) // max(windows, 1))
        for index in range(windows):
            start = index * stride
            if start + window_tokens <= len(ids):
                chosen.append(ids[start:start + window_tokens])
                kinds.append(kind)
    return chosen, kinds


def load_texts(target: Path, windows: int, window_tokens: int, prompts: int) -> Texts:
    tokenizer = Tokenizer.from_dir(target)
    template = ChatTemplate.from_dir(target, tokenizer.special_tokens)
    if not template.available:
        raise click.UsageError(f"{target} has no chat template: the greedy figures need a chat model")
    chats = [tokenizer.encode(template.render([{"role": "user", "content": prompt}]), add_special_tokens=False)
             for prompt in CHAT_PROMPTS[:prompts]]
    chosen, kinds = prose_and_code(tokenizer, windows, window_tokens)
    return Texts(chosen, kinds, chats)


@torch.inference_mode()
def window_log_probs(engine: TargetEngine, ids: Sequence[int]) -> torch.Tensor:
    """Log-probabilities at every position of a window, from one prompt-style forward."""
    engine.reset()
    tokens = torch.as_tensor(ids, dtype=torch.long)
    with prompt_rows():
        _, logits = engine.model(tokens, torch.arange(len(ids)), engine.cache, engine.rotary, 0, None)
    return torch.log_softmax(logits.float(), dim=-1)


def ends_in_loop(tokens: Sequence[int], longest_cycle: int = 8, repeats: int = 3) -> bool:
    """True when the continuation ends in a cycle of at most ``longest_cycle`` tokens repeated
    ``repeats`` times or more ("1.1.1.1.1", "the the the")."""
    for period in range(1, longest_cycle + 1):
        span = period * repeats
        if len(tokens) >= span and all(tokens[-1 - i] == tokens[-1 - i - period] for i in range(span - period)):
            return True
    return False


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


SCORED = {"all": 0.0, "second-half": 0.5}  # --scored: the share of each window's first positions left out


def window_figures(log_probs: torch.Tensor, base: torch.Tensor, first: int) -> tuple[float, float]:
    """Top-1 agreement and mean KL(base || log_probs) of a window's positions from ``first`` on
    (both [positions, vocab] log-probabilities)."""
    log_probs, base = log_probs[first:], base[first:]
    agreement = (log_probs.argmax(-1) == base.argmax(-1)).float().mean().item()
    divergence = (base.exp() * (base - log_probs)).sum(-1)
    return agreement, divergence.mean().item()


def measure(name: str, engine: TargetEngine, texts: Texts, reference: Reference | None,
            new_tokens: int, scored: str = "all") -> tuple[Row, Reference]:
    """One row (None reference: this engine is the reference) and what it produced; ``scored``: the
    positions of each window the figures average (``SCORED``)."""
    row, started = Row(name), time.perf_counter()
    produced = Reference([], [])
    agree: dict[str, list[float]] = {}
    kl: dict[str, list[float]] = {}
    for index, ids in enumerate(tqdm(texts.windows, desc=f"{name}: windows", leave=False)):
        log_probs = window_log_probs(engine, ids)
        produced.logits.append(log_probs)
        if reference is not None:
            kind = texts.kinds[index]
            agreement, divergence = window_figures(log_probs, reference.logits[index], int(SCORED[scored] * len(ids)))
            agree.setdefault(kind, []).append(agreement)
            kl.setdefault(kind, []).append(divergence)
    for index, prompt in enumerate(tqdm(texts.chats, desc=f"{name}: chats", leave=False)):
        tokens = greedy_decode(engine, prompt, new_tokens)
        produced.greedy.append(tokens)
        row.loops += ends_in_loop(tokens)
        if reference is not None:
            row.prefixes.append(common_prefix(tokens, reference.greedy[index]))
    row.top1 = {kind: statistics.fmean(values) for kind, values in agree.items()}
    row.kl = {kind: statistics.fmean(values) for kind, values in kl.items()}
    row.seconds = time.perf_counter() - started
    return row, produced


def format_engine(target: Path, format_name: str, max_len: int) -> TargetEngine:
    """A float32 engine whose linear layers round as ``format_name`` does (F.linear underneath)."""
    from cpu_worker.target_loading import load_target_model

    model = load_target_model(target, "fp32")
    quant_reference.apply_format(model, quant_reference.FORMATS[format_name])
    return TargetEngine(model, max_len=max_len)


def gguf_rows(gguf: Path, precisions: list[str], max_len: int, texts: Texts, reference: Reference,
              new_tokens: int, scored: str = "all") -> list[Row]:
    """Rows for a GGUF file at each precision ("auto": the file's own), loaded as the cpu_worker loads it."""
    from dovetail_runtime.coordinator import target_precision

    rows = []
    for precision in precisions:
        precision = target_precision(gguf) if precision == "auto" else precision
        started = time.perf_counter()
        engine, kernel = build_engine(str(gguf), precision, max_len)
        loaded = time.perf_counter() - started
        row = measure(f"gguf {precision} ({kernel}, loaded in {loaded:.1f} s)", engine, texts, reference,
                      new_tokens, scored)[0]
        rows.append(row)
    return rows


def print_table(rows: Sequence[Row], new_tokens: int) -> None:
    kinds = sorted({kind for row in rows for kind in row.top1}, reverse=True)
    header = ["precision", *(f"top-1 {kind}" for kind in kinds), *(f"KL {kind}" for kind in kinds),
              f"common prefix (of {new_tokens})", "loops", "per prompt", "s"]
    print(markdown_header(header))
    for row in rows:
        cells = [row.name, *(f"{100 * row.top1[k]:.2f}%" if k in row.top1 else "-" for k in kinds),
                 *(f"{row.kl[k]:.5f}" if k in row.kl else "-" for k in kinds),
                 f"{statistics.fmean(row.prefixes):.1f}" if row.prefixes else "(reference)", str(row.loops),
                 " ".join(map(str, row.prefixes)), f"{row.seconds:.0f}"]
        print(markdown_row(cells))


def parse_precisions(_context: click.Context, parameter: click.Parameter, text: str) -> list[str]:
    """The comma list of precisions, checked before the fp32 reference runs (minutes) rather than after."""
    allowed = (*TARGET_PRECISIONS, "auto") if parameter.name == "gguf_precisions" else TARGET_PRECISIONS
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise click.BadParameter(f"unknown precision {', '.join(unknown)}: expected some of {', '.join(allowed)}")
    return names


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--target", type=click.Path(exists=True, file_okay=False, path_type=Path), default=SMOLLM2_DIR,
              show_default=True, help="An HF model folder with a chat template (the fixture by default).")
@click.option("--precisions", default="bf16,int8", show_default=True, callback=parse_precisions,
              help="Our engine's precisions to judge against its fp32 (comma list; empty for none).")
@click.option("--formats", default="int8-row,q8_0,w8b32-a32,q4_0,q4_1", show_default=True,
              help=f"Reference formats of tools/quant_reference ({', '.join(quant_reference.FORMATS)}).")
@click.option("--windows", type=click.IntRange(1), default=8, show_default=True,
              help="Teacher-forced windows of prose, and as many of code.")
@click.option("--window-tokens", type=click.IntRange(2, 2048), default=256, show_default=True)
@click.option("--prompts", type=click.IntRange(1, len(CHAT_PROMPTS)), default=len(CHAT_PROMPTS), show_default=True,
              help="Chat prompts for the greedy figures.")
@click.option("--new-tokens", type=click.IntRange(1), default=48, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=None, help="torch threads (default: torch's).")
@click.option("--gguf", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help=f"Also judge this GGUF file as the cpu_worker loads it, against --target's fp32 (the same model: "
                   f"e.g. {SMOLLM2_GGUF.name} against the fixture's folder).")
@click.option("--gguf-precisions", default="auto", show_default=True, callback=parse_precisions,
              help="The GGUF's precisions (comma list; auto: as dovetail-run's default, the file's blocks x 16-bit "
                   "activations).")
@click.option("--scored", type=click.Choice(list(SCORED)), default="all", show_default=True,
              help="The positions of each window the top-1 and KL figures average: all, or the second half "
                   "(what llama-perplexity --kl-divergence scores, for figures to set beside it).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write every figure to this file.")
@load_errors_in_one_line
def main(target: Path, precisions: list[str], formats: str, windows: int, window_tokens: int, prompts: int,
         new_tokens: int, threads: int | None, gguf: Path | None, gguf_precisions: list[str], scored: str,
         json_path: Path | None) -> None:
    unknown = [name for name in formats.split(",") if name and name not in quant_reference.FORMATS]
    if unknown:
        raise click.BadParameter(f"unknown formats {unknown}", param_hint="--formats")
    if threads:
        torch.set_num_threads(threads)
    texts = load_texts(target, windows, window_tokens, prompts)
    max_len = max(window_tokens, max(len(chat) for chat in texts.chats) + new_tokens)
    engine, kernel = build_engine(str(target), "fp32", max_len)
    fp32_row, reference = measure(f"fp32 ({kernel})", engine, texts, None, new_tokens)
    rows = [fp32_row]
    for precision in precisions:
        engine, kernel = build_engine(str(target), precision, max_len)
        rows.append(measure(f"ours {precision}" + (f" ({kernel})" if kernel else ""), engine, texts, reference,
                            new_tokens, scored)[0])
    for name in filter(None, formats.split(",")):
        rows.append(measure(f"ref {name}", format_engine(target, name, max_len), texts, reference, new_tokens,
                            scored)[0])
    if gguf is not None:
        rows += gguf_rows(gguf, gguf_precisions, max_len, texts, reference, new_tokens, scored)
    print(f"\n{target.name}: {len(texts.windows)} windows of {window_tokens} tokens "
          f"({texts.kinds.count('prose')} prose, {texts.kinds.count('code')} code; positions scored: {scored}), "
          f"{len(texts.chats)} chat prompts x {new_tokens} greedy tokens, against fp32\n")
    print_table(rows, new_tokens)
    if json_path is not None:
        json_path.write_text(json.dumps([asdict(row) for row in rows], indent=1))


if __name__ == "__main__":
    main()
