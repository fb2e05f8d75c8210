"""Decode speed of this engine against llama.cpp at the same bits, side by side in one run.

The issue's bar for the CPU target: fp32 and int8 decoding at least as fast as llama.cpp's F32
and Q8_0, the engine a user would otherwise pick. Rounds alternate between the two engines
(these machines are shared and noisy), each engine decodes ``--tokens`` tokens per round on the
same threads, and the table gives medians, the per-round ratio and each engine against the read
bandwidth measured just before each round (a host whose bandwidth drifts by a quarter within a run
would otherwise move the roofline fraction by as much). ``--prompt-tokens N`` also times a prefill
of N tokens per round against llama-bench's pp test (time to first token).

llama.cpp is not a dependency: bring a ``llama-bench`` binary and GGUF files of the same model.
For an inflated stand-in (``../shared/testbed/inflate.py``), from a llama.cpp checkout::

    python convert_hf_to_gguf.py STANDIN --outtype f32 --outfile standin-f32.gguf
    build/bin/llama-quantize standin-f32.gguf standin-q8_0.gguf Q8_0
    python -m tools.bench_llamacpp --target STANDIN --llama-bench build/bin/llama-bench \\
        --pair fp32=standin-f32.gguf --pair int8=standin-q8_0.gguf --threads 2

(The stand-ins' byte-level BPE tokenizer is unknown to the converter's pre-tokenizer table;
decode speed does not depend on it, so any byte-level choice will do.)
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import psutil
import torch

from cpu_worker.engine import TargetEngine
from cpu_worker.server import build_engine
from ipc.dtypes import KV_DTYPES, TARGET_PRECISIONS
from tools.bench_real import Dims, measure_bandwidth
from tools.tables import markdown_header, markdown_row


@dataclass
class PairResult:
    precision: str
    gguf: Path
    ours_tps: list[float] = field(default_factory=list)
    llama_tps: list[float] = field(default_factory=list)
    ours_rss_gb: float = 0.0
    llama_rss_gb: float = 0.0
    ours_bytes: int = 0
    llama_bytes: int = 0
    llama_type: str = ""
    kernel: str | None = None
    ours_prefill_tps: list[float] = field(default_factory=list)
    llama_prefill_tps: list[float] = field(default_factory=list)
    bandwidth_gbs: list[float] = field(default_factory=list)  # read roofline measured before each round

    def roofline_fractions(self) -> tuple[float, float]:
        """(ours, llama.cpp): median over rounds of the bytes streamed per second against that
        round's read bandwidth."""
        ours = [tps * self.ours_bytes / 1e9 / gbs for tps, gbs in zip(self.ours_tps, self.bandwidth_gbs, strict=True)]
        llama = [tps * self.llama_bytes / 1e9 / gbs
                 for tps, gbs in zip(self.llama_tps, self.bandwidth_gbs, strict=True)]
        return statistics.median(ours), statistics.median(llama)


def parse_pair(_context: click.Context, _parameter: click.Parameter, values: tuple[str, ...]) -> list[tuple[str, Path]]:
    pairs = []
    for value in values:
        precision, _, path = value.partition("=")
        if precision not in TARGET_PRECISIONS or not path:
            raise click.BadParameter(f"{value!r}: expected PRECISION=GGUF with PRECISION one of "
                                     f"{', '.join(TARGET_PRECISIONS)}")
        if not Path(path).is_file():
            raise click.BadParameter(f"{path}: no such GGUF file")
        pairs.append((precision, Path(path)))
    if not pairs:
        raise click.BadParameter("give at least one --pair PRECISION=GGUF")
    return pairs


def check_binary(_context: click.Context, _parameter: click.Parameter, binary: Path) -> Path:
    """A file we cannot run was an OSError traceback, and only after our engine had loaded."""
    if not os.access(binary, os.X_OK):
        raise click.BadParameter(f"{binary} is not executable: give llama.cpp's llama-bench binary")
    return binary


def ours_decode_tps(engine: TargetEngine, tokens: int) -> float:
    """Greedy decode from a short prompt, as llama-bench's tg test (which starts from an empty
    context): logits and argmax included."""
    vocab = engine.spec.vocab_size
    prompt = [1, 450 % vocab, 900 % vocab, 1200 % vocab]
    engine.prefill(prompt)
    token = prompt[-1]
    start = time.perf_counter()
    for _ in range(tokens):
        token = int(engine.decode(token).logits.argmax())
    return tokens / (time.perf_counter() - start)


def ours_prefill_tps(engine: TargetEngine, tokens: int) -> float:
    """A prefill of ``tokens`` tokens into an empty context, as llama-bench's pp test."""
    prompt = torch.randint(0, engine.spec.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
    start = time.perf_counter()
    engine.prefill(prompt.tolist())
    return tokens / (time.perf_counter() - start)


def peak_rss_kb(pid: int) -> int:
    """VmHWM of a running process (kB; 0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def llama_bench_round(binary: Path, gguf: Path, tokens: int, threads: int,
                      prompt_tokens: int = 0) -> tuple[float, float, dict]:
    """(tokens/s, peak RSS GB, llama-bench's JSON record) of one tg run in a child process, or
    of one pp run of ``prompt_tokens`` (a prefill) when that is given."""
    test = ["-p", str(prompt_tokens), "-n", "0"] if prompt_tokens else ["-p", "0", "-n", str(tokens)]
    command = [str(binary), "-m", str(gguf), *test, "-t", str(threads), "-r", "1", "-o", "json"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            child = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        except OSError as error:  # executable, yet not a program (a script without #!, another platform's)
            raise click.ClickException(f"cannot run {binary}: {error.strerror}") from None
        # Polled, not read from rusage: Linux carries a forked child's peak RSS (ours, with a model
        # loaded) across exec, so the child's ru_maxrss would report this process's size.
        peak_kb = 0
        while child.poll() is None:
            peak_kb = max(peak_kb, peak_rss_kb(child.pid))
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if child.returncode != 0:
        raise click.ClickException(f"llama-bench failed ({' '.join(command)}):\n{stderr[-2000:]}")
    record = json.loads(stdout)[0]
    return float(record["avg_ts"]), peak_kb * 1024 / 1e9, record  # /proc's kB are KiB; GB as ours (psutil's bytes)


def streamed_fraction(record: dict, dims: Dims) -> float:
    """llama.cpp reads every tensor per token but the embedding (one row of it)."""
    return 1.0 - dims.vocab * dims.hidden / float(record["model_n_params"])


def run_pair(target: Path, precision: str, gguf: Path, binary: Path, options: dict, dims: Dims) -> PairResult:
    result = PairResult(precision, gguf)
    max_len = max(64 + options["tokens"], options["prompt_tokens"] + 1)
    # --ours-from-gguf: this engine loads the very file llama.cpp runs (its blocks as stored).
    source = gguf if options["ours_from_gguf"] else target
    engine, result.kernel = build_engine(str(source), precision, max_len, options["kv_dtype"])
    if options["ours_from_gguf"]:
        result.kernel = f"{result.kernel}, from the GGUF"
    result.ours_rss_gb = psutil.Process().memory_info().rss / 1e9
    result.ours_bytes = dims.streamed_bytes(precision)
    # First-call costs out of the numbers, and the GGUF in the page cache before llama.cpp is timed.
    ours_decode_tps(engine, 4)
    llama_bench_round(binary, gguf, 8, options["threads"])
    for round_index in range(options["rounds"]):
        bandwidth = measure_bandwidth(options["threads"], megabytes=512, repeats=3)[0]
        ours = ours_decode_tps(engine, options["tokens"])
        llama, rss_gb, record = llama_bench_round(binary, gguf, options["tokens"], options["threads"])
        result.ours_tps.append(ours)
        result.llama_tps.append(llama)
        result.bandwidth_gbs.append(bandwidth)
        result.llama_rss_gb = max(result.llama_rss_gb, rss_gb)
        result.llama_bytes = int(int(record["model_size"]) * streamed_fraction(record, dims))
        result.llama_type = str(record.get("model_type", ""))
        print(f"   {precision} round {round_index + 1}: ours {ours:.2f} tok/s, llama.cpp {llama:.2f} tok/s "
              f"({ours / llama:.2f}x); read bandwidth {bandwidth:.1f} GB/s", flush=True)
        if options["prompt_tokens"]:
            ours = ours_prefill_tps(engine, options["prompt_tokens"])
            llama, _, _ = llama_bench_round(binary, gguf, 0, options["threads"], options["prompt_tokens"])
            result.ours_prefill_tps.append(ours)
            result.llama_prefill_tps.append(llama)
            print(f"   {precision} round {round_index + 1}, prefill of {options['prompt_tokens']}: ours {ours:.1f} "
                  f"tok/s, llama.cpp {llama:.1f} tok/s ({ours / llama:.2f}x)", flush=True)
    del engine
    gc.collect()
    return result


def print_table(results: list[PairResult], threads: int) -> None:
    print("\n" + markdown_header(["ours", "llama.cpp", "ours tok/s", "llama.cpp tok/s",
                                  "ours / llama.cpp (median of rounds)", "ours % of read bw", "llama.cpp % of read bw",
                                  "RSS ours / llama.cpp GB"]))
    for r in results:
        ours, llama = statistics.median(r.ours_tps), statistics.median(r.llama_tps)
        ratio = statistics.median(mine / theirs for mine, theirs in zip(r.ours_tps, r.llama_tps, strict=True))
        kernel = f" ({r.kernel})" if r.kernel else ""
        ours_roofline, llama_roofline = r.roofline_fractions()
        print(markdown_row([f"{r.precision}{kernel}", r.llama_type, f"{ours:.2f}", f"{llama:.2f}", f"{ratio:.2f}x",
                            f"{100 * ours_roofline:.0f}%", f"{100 * llama_roofline:.0f}%",
                            f"{r.ours_rss_gb:.2f} / {r.llama_rss_gb:.2f}"]))
    prefills = [r for r in results if r.ours_prefill_tps]
    if prefills:
        print("\n" + markdown_header(["prefill", "ours tok/s", "llama.cpp tok/s",
                                      "ours / llama.cpp (median of rounds)"]))
        for r in prefills:
            ratio = statistics.median(mine / theirs for mine, theirs in zip(r.ours_prefill_tps, r.llama_prefill_tps,
                                                                             strict=True))
            print(markdown_row([f"{r.precision} / {r.llama_type}", f"{statistics.median(r.ours_prefill_tps):.1f}",
                                f"{statistics.median(r.llama_prefill_tps):.1f}", f"{ratio:.2f}x"]))
    measured = [gbs for r in results for gbs in r.bandwidth_gbs]
    print(f"\nread bandwidth {min(measured):.1f}-{max(measured):.1f} GB/s ({threads} threads, best of 3 sums of "
          f"512 MB on huge pages before each round; % of read bw: median over rounds); bytes per token: "
          + ", ".join(f"{r.precision} ours {r.ours_bytes / 1e9:.2f} GB, llama.cpp {r.llama_bytes / 1e9:.2f} GB"
                      for r in results))


@click.command()
@click.option("--target", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="The Hugging Face folder the GGUF files were converted from.")
@click.option("--llama-bench", "binary", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              callback=check_binary, help="llama.cpp's llama-bench binary.")
@click.option("--pair", "pairs", multiple=True, callback=parse_pair,
              help="PRECISION=GGUF: this engine at PRECISION against llama.cpp on GGUF (repeat: fp32=...f32.gguf, "
                   "int8=...q8_0.gguf).")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True,
              help="Threads for both engines.")
@click.option("--tokens", type=click.IntRange(min=8), default=64, show_default=True, help="Tokens decoded per round.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Alternating rounds per pair (the table gives medians).")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default="auto", show_default=True,
              help="This engine's KV cache dtype, as dovetail-run's (llama.cpp keeps its default, f16).")
@click.option("--prompt-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also time a prefill of this many tokens each round (llama-bench's pp test); 0: decode only.")
@click.option("--ours-from-gguf", is_flag=True,
              help="Load this engine from each pair's GGUF file (its blocks as stored) instead of --target's folder.")
def main(target: Path, binary: Path, pairs: list[tuple[str, Path]], threads: int, tokens: int, rounds: int,
         kv_dtype: str, prompt_tokens: int, ours_from_gguf: bool) -> None:
    """Decode (and prefill) tokens/s of this engine and llama.cpp at the same bits, alternating rounds."""
    torch.set_num_threads(threads)
    dims = Dims.from_config(json.loads((target / "config.json").read_text()))
    options = {"tokens": tokens, "rounds": rounds, "threads": threads, "kv_dtype": kv_dtype,
               "prompt_tokens": prompt_tokens, "ours_from_gguf": ours_from_gguf}
    print(f"{target.name}: {dims.linear_params / 1e9:.2f}B streamed parameters, {threads} threads, "
          f"{tokens} tokens per round, {rounds} rounds", flush=True)
    results = [run_pair(target, precision, gguf, binary, options, dims) for precision, gguf in pairs]
    print_table(results, threads)


if __name__ == "__main__":
    main()
