"""Draft cost per cycle: extend with a few accepted pairs + propose a tree, against T, depth
and head depth (layers), at the testbed's size and at 13B size (random weights).

    python -m tools.bench_draft                      # testbed size, all configs
    python -m tools.bench_draft --size 13b           # 13B size, a short default set
    python -m tools.bench_draft --size both --device cuda --dtype fp16

Times are medians over ``--repeats`` cycles after ``--warmup`` cycles; each cycle extends
``--accepted`` + 1 pairs (k accepted drafts + bonus) and then proposes one tree.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from cpu_worker.model.llama import LlamaSpec
from gpu_worker.device import resolve_device, resolve_dtype
from gpu_worker.drafter import Drafter
from gpu_worker.head import DraftHead
from ipc.tree import TreeShape
from tools.options import non_negative_int, positive_int

SIZES = {
    # target-code-9m: hidden 256, vocab 8192, 4 heads, intermediate 768
    "testbed": LlamaSpec(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=1, num_heads=4,
                         num_kv_heads=4, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                         max_position_embeddings=2048),
    # Vicuna/Llama-2-13B
    "13b": LlamaSpec(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=1, num_heads=40,
                     num_kv_heads=40, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=4096),
}


def random_head(spec: LlamaSpec, layers: int, fusion: str, device: torch.device, dtype: torch.dtype) -> DraftHead:
    """Random weights without the slow default init (13B size: billions of parameters)."""
    with torch.device("meta"):
        head = DraftHead(replace(spec, num_layers=layers), fusion=fusion)
    head = head.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("layernorm.weight"):
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                param.normal_(0, param.shape[-1] ** -0.5, generator=generator)
    return head.to(dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_config(drafter: Drafter, prefix: int, accepted: int, shape: TreeShape,
                 warmup: int, repeats: int) -> tuple[float, float]:
    """Median (extend ms, propose ms) over ``repeats`` cycles."""
    hidden = drafter.head.spec.hidden_size
    vocab = drafter.head.spec.vocab_size
    generator = torch.Generator().manual_seed(1)
    drafter.reset()
    drafter.extend(torch.randn(prefix, hidden, generator=generator),
                   torch.randint(0, vocab, (prefix,), generator=generator))
    step = accepted + 1
    features = torch.randn(step, hidden, generator=generator)
    extend_ms: list[float] = []
    propose_ms: list[float] = []
    for cycle in range(warmup + repeats):
        tokens = torch.randint(0, vocab, (step,), generator=generator)
        sync(drafter.device)
        started = time.perf_counter()
        drafter.extend(features, tokens)
        sync(drafter.device)
        extended = time.perf_counter()
        drafter.propose(shape)
        finished = time.perf_counter()  # propose ends with a device-to-host copy: synchronised
        if cycle >= warmup:
            extend_ms.append((extended - started) * 1e3)
            propose_ms.append((finished - extended) * 1e3)
    return statistics.median(extend_ms), statistics.median(propose_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["testbed", "13b", "both"], default="testbed")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dtype", default=None, help="fp16/bf16/fp32 on CUDA (default fp16); fp32 on the CPU")
    parser.add_argument("--fusion", choices=["dgf", "fc"], default="dgf")
    parser.add_argument("--layers", type=positive_int, nargs="+", default=[1, 2, 5])
    parser.add_argument("--trees", type=positive_int, nargs="+", default=[4, 8, 16, 32, 64], help="tree sizes T")
    parser.add_argument("--depths", type=positive_int, nargs="+", default=[4, 6, 8])
    parser.add_argument("--tree-top-k", dest="top_k", type=positive_int, default=8)
    parser.add_argument("--accepted", type=non_negative_int, default=3,
                        help="accepted drafts per cycle (extend adds +1)")
    parser.add_argument("--prefix", type=positive_int, default=256, help="committed length before timing")
    parser.add_argument("--warmup", type=non_negative_int, default=3)
    parser.add_argument("--repeats", type=positive_int, default=15)
    # 13B size on a CPU is slow (a 1-layer head reads ~3.4 GB per forward in fp32): its own, shorter set.
    parser.add_argument("--13b-layers", dest="big_layers", type=positive_int, nargs="+", default=[1])
    parser.add_argument("--13b-trees", dest="big_trees", type=positive_int, nargs="+", default=[16])
    parser.add_argument("--13b-depths", dest="big_depths", type=positive_int, nargs="+", default=[4, 6])
    parser.add_argument("--13b-repeats", dest="big_repeats", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(device, args.dtype)
    sizes = ["testbed", "13b"] if args.size == "both" else [args.size]
    print(f"device {device}, dtype {str(dtype).removeprefix('torch.')}, fusion {args.fusion}, top_k {args.top_k}, "
          f"prefix {args.prefix}, extend {args.accepted + 1} pairs/cycle, threads {torch.get_num_threads()}")
    header = f"{'size':>7} {'layers':>6} {'depth':>5} {'T':>4} {'extend ms':>10} {'propose ms':>11} {'cycle ms':>9}"
    print(header)
    print("-" * len(header))
    for size in sizes:
        big = size == "13b"
        layers_list = args.big_layers if big else args.layers
        trees = args.big_trees if big else args.trees
        depths = args.big_depths if big else args.depths
        repeats = args.big_repeats if big else args.repeats
        warmup = min(args.warmup, 1) if big else args.warmup
        # Depth is clamped to what T allows (depth <= T - 1): the table shows the depth used, each shape once
        # (--trees 4 --depths 4 6 asks for T=4 depth 3 twice).
        shapes = list(dict.fromkeys(TreeShape.clamped(tree_tokens, depth, args.top_k)
                                    for depth in depths for tree_tokens in trees))
        for layers in layers_list:
            head = random_head(SIZES[size], layers, args.fusion, device, dtype)
            drafter = Drafter(head, max_len=args.prefix + (args.accepted + 1) * (warmup + repeats) + 8,
                              scratch_len=max(shape.scratch_slots for shape in shapes))
            for shape in shapes:
                extend_ms, propose_ms = bench_config(drafter, args.prefix, args.accepted, shape, warmup, repeats)
                print(f"{size:>7} {layers:>6} {shape.depth:>5} {shape.tree_tokens:>4} {extend_ms:>10.2f} "
                      f"{propose_ms:>11.2f} {extend_ms + propose_ms:>9.2f}", flush=True)
            del drafter, head


if __name__ == "__main__":
    main()
