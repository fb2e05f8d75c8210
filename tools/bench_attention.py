"""Exact attention: our kernel (cpu_worker/native/attention.c) against torch's, side by side.

    python -m tools.bench_attention [--contexts 256,1024,2048] [--trees 1,4,8,16] [--threads 2]
                                    [--target DIR] [--prompt 256]

1. One layer at llama2-7b's attention shape (32 heads of 128, fp32 cache): ms for a decode step
   (T = 1) and for a T-node tree at each context length, on the kernel and on torch's exact
   path (one single-query call per row, ``kernels.attention.attend_per_row``), plus torch's batched
   masked call for reference (one pass, but not exact).
2. With --target (e.g. a stand-in with few layers, ``inflate.py ... --layers 6``): the engine
   as the cpu_worker builds it, decode and t_verify(T) after a --prompt-token prefix, kernel
   against ``DOVETAIL_ATTENTION=torch``, and the worst tree-vs-decode logit gap of each (0: exact).
The candidates take turns on every repeat (a shared machine's noise hits all); medians.
"""

from __future__ import annotations

import os
from pathlib import Path

import click
import torch
import torch.nn.functional as F

from cpu_worker.engine import TargetEngine, tree_paths
from cpu_worker.kernels import exact_attention
from cpu_worker.kernels.attention import attend_per_row
from cpu_worker.kernels.exact_attention import TreePaths
from cpu_worker.server import build_engine
from cpu_worker.verify_cost import measure_verify_ms, measurement_tree
from tools.bench_fp32_kernel import tree_vs_decode_gap
from tools.bench_int8 import interleaved_ms
from tools.bench_kv_dtype import decode_ms
from tools.options import load_errors_in_one_line
from tools.tables import markdown_header, markdown_row

HEADS, HEAD_DIM = 32, 128


def parse_sizes(text: str, name: str) -> list[int]:
    """A comma-separated list of positive integers from option ``name``."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"not a list of integers: {text!r}", param_hint=name) from None
    if not sizes or min(sizes) < 1:
        raise click.BadParameter("give at least one size, each >= 1", param_hint=name)
    return sizes


@torch.inference_mode()
def layer_table(contexts: list[int], trees: list[int], repeats: int) -> None:
    print("\none layer, 32 heads x 128, fp32 cache; ms (median)")
    print(markdown_header(["context", "T", "kernel", "torch exact (per row)", "torch masked (not exact)",
                           "torch exact / kernel"]))
    for context in contexts:
        length = context + max(trees)
        keys, values = torch.randn(1, HEADS, length, HEAD_DIM), torch.randn(1, HEADS, length, HEAD_DIM)
        for size in trees:
            results = time_tree(keys, values, context, size, repeats)
            print(markdown_row([context, size, f"{results['kernel']:.2f}", f"{results['per row']:.2f}",
                                f"{results['masked']:.2f}", f"{results['per row'] / results['kernel']:.2f}x"]),
                  flush=True)


def time_tree(keys: torch.Tensor, values: torch.Tensor, context: int, size: int, repeats: int) -> dict[str, float]:
    """Median ms of one layer's attention for a ``size``-node tree after ``context`` cached tokens."""
    tree = TreePaths.from_paths(tree_paths(measurement_tree(size)))
    q = torch.randn(1, HEADS, size, HEAD_DIM)
    k, v = keys[:, :, context:context + size].clone(), values[:, :, context:context + size].clone()
    mask = torch.zeros(size, context + size, dtype=torch.bool)
    mask[:, :context] = True
    for row, path in enumerate(tree.rows):
        mask[row, context + path] = True
    seen_keys, seen_values = keys[:, :, :context + size], values[:, :, :context + size]
    return interleaved_ms({
        "kernel": lambda: exact_attention.attend(q, keys, values, context, tree),
        "per row": lambda: attend_per_row(q, k, v, keys, values, context, tree, gqa=False),
        "masked": lambda: F.scaled_dot_product_attention(q, seen_keys, seen_values, attn_mask=mask),
    }, repeats)


def set_attention(kernel: bool, engine: TargetEngine) -> None:
    """Force torch's attention or not, and have ``engine`` choose its kernels again."""
    if kernel:
        os.environ.pop(exact_attention.FORCE_VARIABLE, None)
    else:
        os.environ[exact_attention.FORCE_VARIABLE] = "torch"
    exact_attention.clear_cache()
    assert exact_attention.available() is kernel
    assert (engine.choose_kernels().attention.name == "exact") is kernel


@torch.inference_mode()
def engine_table(target: Path, precision: str, prompt: int, trees: list[int], repeats: int) -> None:
    engine, linear_kernel = build_engine(str(target), precision, prompt + max(trees) + 8)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(engine.spec.vocab_size, (prompt,), generator=generator).tolist()
    rows: dict[str, list[list[float]]] = {"kernel": [], "torch": []}
    gaps = {}
    for _ in range(repeats):
        for name in rows:
            set_attention(name == "kernel", engine)
            rows[name].append([decode_ms(engine, prompt, steps=8), *measure_verify_ms(engine, trees, repeats=1)])
    for name in rows:
        set_attention(name == "kernel", engine)
        gaps[name] = tree_vs_decode_gap(engine, prefix, size=min(8, max(trees)))
    set_attention(True, engine)
    best = {name: [min(column) for column in zip(*values, strict=True)] for name, values in rows.items()}
    print(f"\n{target.name} ({precision}, linears on {linear_kernel}), {prompt}-token prefix; best ms of {repeats} "
          "(decode: the median of 8 steps)")
    print(markdown_header(["attention", "decode", *(f"verify T={size}" for size in trees),
                           "worst tree-decode logit gap"]))
    for name, values in best.items():
        print(markdown_row([name, *(f"{value:.1f}" for value in values), f"{gaps[name]:.1e}"]))
    ratios = [torch_ms / kernel_ms for torch_ms, kernel_ms in zip(best["torch"], best["kernel"], strict=True)]
    print(markdown_row(["torch / kernel", *(f"{ratio:.2f}x" for ratio in ratios), ""]))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--contexts", default="256,1024,2048", show_default=True, help="cached tokens (comma-separated)")
@click.option("--trees", default="1,4,8,16", show_default=True, help="tree sizes T (comma-separated)")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--target", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="also time this target's decode and verification on either attention")
@click.option("--precision", type=click.Choice(["int8-row", "fp32"]), default="int8-row", show_default=True)
@click.option("--prompt", type=click.IntRange(min=1), default=256, show_default=True,
              help="prefix tokens before the engine's decode and verification")
@load_errors_in_one_line
def main(contexts: str, trees: str, threads: int, repeats: int, target: Path | None, precision: str,
         prompt: int) -> None:
    context_sizes, tree_sizes = parse_sizes(contexts, "--contexts"), parse_sizes(trees, "--trees")
    torch.set_num_threads(threads)
    if not exact_attention.available():
        raise click.ClickException("the exact attention kernel is not available (no C compiler, or "
                                   f"{exact_attention.FORCE_VARIABLE}=torch)")
    print(f"python -m tools.bench_attention --contexts {contexts} --trees {trees} --threads {threads}"
          + (f" --target {target} --precision {precision} --prompt {prompt}" if target else ""))
    layer_table(context_sizes, tree_sizes, repeats)
    if target is not None:
        engine_table(target, precision, prompt, tree_sizes, repeats)


if __name__ == "__main__":
    main()
