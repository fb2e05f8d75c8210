"""A CPU draft head's cycles on its native calls against the torch layers, side by side in one process.

    python -m tools.bench_native_head --draft demo/draft-smollm2 --target SMOLLM2_GGUF_OR_FOLDER
        [--dtype q4_0] [--shapes 2/1/1,3/2/1,4/3/4] [--cycles 200] [--threads 2]

A cycle is what the draft worker does for one verified tree: it extends the head by ``--accepted`` + 1
pairs (the accepted drafts and the bonus token, random feature rows) and proposes one tree of the shape
(T/depth/top_k). The two paths take turns cycle by cycle on two sequences of one head (the native one
and the torch one each keep their own cache, restarted from a 64-pair prompt before it fills), so on a
noisy host both see the same load. Prints each shape's median cycle on each path and native / torch.
The head runs on the CPU at ``--dtype`` (int8 or q4_0: the formats whose layers have native calls).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import click
import torch

from tools.options import load_errors_in_one_line
from tools.tables import markdown_header, markdown_row

if TYPE_CHECKING:
    from gpu_worker.drafter import Drafter
    from ipc.tree import TreeShape

PROMPT_PAIRS = 64


def parse_shapes(_context: click.Context, _parameter: click.Parameter, text: str) -> list[tuple[int, int, int]]:
    """``"2/1/1,4/3/4"`` as (T, depth, top_k) triples."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            size, depth, top_k = (int(value) for value in item.split("/"))
        except ValueError:
            raise click.BadParameter(f"{item!r} is not T/depth/top_k (three whole numbers)") from None
        if min(size, depth, top_k) < 1:
            raise click.BadParameter(f"{item!r}: T, depth and top_k are at least 1")
        shapes.append((size, depth, top_k))
    if not shapes:
        raise click.BadParameter("give at least one T/depth/top_k")
    return shapes


def torch_layers(head: torch.nn.Module) -> Callable[[], None]:
    """Make ``head`` take its torch layers until the returned function is called."""
    name = "native_layer" if hasattr(head, "native_layer") else "native_layers"
    setattr(head, name, lambda: None)
    return lambda: delattr(head, name)  # the class's method again


@torch.inference_mode()
def cycle_ms(drafter: Drafter, shape: TreeShape, accepted: int, generator: torch.Generator) -> float:
    """One cycle on ``drafter``: its extend by ``accepted`` + 1 random pairs and a tree of ``shape``."""
    spec = drafter.head.spec
    count = accepted + 1
    if drafter.length + count + shape.scratch_slots > drafter.max_len:
        drafter.reset()
        drafter.extend(torch.randn(PROMPT_PAIRS, drafter.feature_size, generator=generator),
                       torch.randint(spec.vocab_size, (PROMPT_PAIRS,), generator=generator))
    features = torch.randn(count, drafter.feature_size, generator=generator)
    tokens = torch.randint(spec.vocab_size, (count,), generator=generator)
    began = time.perf_counter()
    drafter.extend(features, tokens)
    drafter.propose(shape)
    return (time.perf_counter() - began) * 1e3


def compare(drafter: Drafter, shape: TreeShape, accepted: int, cycles: int) -> dict[str, float]:
    """Median cycle of each path, turns taken cycle by cycle (the first tenth warm-up)."""
    runs = {"native": drafter, "torch": drafter.sibling()}
    for path in runs.values():
        path.reset()
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {name: [] for name in runs}
    warmup = max(2, cycles // 10)
    for index in range(warmup + cycles):
        for name, path in runs.items():
            restore = torch_layers(path.head) if name == "torch" else None
            try:
                elapsed = cycle_ms(path, shape, accepted, generator)
            finally:
                if restore is not None:
                    restore()
            if index >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--draft", required=True, help="a draft head folder")
@click.option("--target", default=None, help="the target (folder or GGUF) whose embedding the head reads")
@click.option("--dtype", type=click.Choice(["int8", "q4_0"]), default="q4_0", show_default=True,
              help="the head's projection format on the CPU")
@click.option("--shapes", default="2/1/1,3/2/1,4/3/4,8/4/4", show_default=True, callback=parse_shapes,
              help="comma list of T/depth/top_k")
@click.option("--accepted", type=click.IntRange(min=0), default=1, show_default=True,
              help="accepted drafts a cycle (the head extends by one more: the bonus token)")
@click.option("--cycles", type=click.IntRange(min=3), default=200, show_default=True, help="timed cycles a path")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch threads (default: torch's)")
@load_errors_in_one_line
def main(draft: str, target: str | None, dtype: str, shapes: list[tuple[int, int, int]], accepted: int,
         cycles: int, threads: int | None) -> None:
    from gpu_worker.drafter import Drafter
    from gpu_worker.eagle3 import Eagle3Head
    from ipc.tree import TreeShape

    if threads:
        torch.set_num_threads(threads)
    trees = [TreeShape.clamped(*shape) for shape in shapes]
    scratch = max(tree.scratch_slots for tree in trees)
    drafter = Drafter.from_pretrained(draft, target, max_len=1024, device="cpu", dtype=dtype, scratch_len=scratch)
    head = drafter.head
    native = head.native_layer() if isinstance(head, Eagle3Head) else head.native_layers()
    if native is None:
        raise click.ClickException(f"{draft} at {dtype} has no native calls here (no C compiler, or "
                                   "DOVETAIL_NATIVE_HEAD/DOVETAIL_NATIVE_LAYERS=python): nothing to compare")
    print(f"{draft} at {dtype}, {torch.get_num_threads()} threads; a cycle: extend {accepted + 1} pairs, "
          f"propose one tree; median of {cycles} cycles a path, turns taken")
    print(markdown_header(["T/depth/top_k", "torch ms", "native ms", "native / torch"]))
    for shape, tree in zip(shapes, trees, strict=True):
        medians = compare(drafter, tree, accepted, cycles)
        print(markdown_row(["/".join(map(str, shape)), f"{medians['torch']:.3f}", f"{medians['native']:.3f}",
                            f"{medians['native'] / medians['torch']:.3f}"]), flush=True)


if __name__ == "__main__":
    main()
