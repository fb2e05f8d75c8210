"""Where a draft step's time goes on CUDA: precision x intra-op threads x a busy CPU x attention kernels,
then torch's profiler over three cycles. Written for the device machine (tools/device_check.sh runs it);
it found cuDNN's attention costing ~50 ms per fp16 draft level (docs/performance.md, 2026-12-04 H200).

    python -m tools.profile_draft [--draft demo/draft-dgf] [--target demo/target-code-9m] [--device cuda]
"""
import argparse
import multiprocessing as mp
import time

import torch
from torch.nn.attention import SDPBackend

import gpu_worker.drafter as drafter_module
from gpu_worker.draft_cost import measure_draft_ms
from gpu_worker.drafter import Drafter
from ipc.tree import TreeShape

DEPTHS = [1, 2, 3, 4, 6]
HOG_PROCESSES = 16


def spin(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        pass


def load(args: argparse.Namespace, dtype: str) -> Drafter:
    return Drafter.from_pretrained(args.draft, args.target, max_len=1024, device=args.device, dtype=dtype)


def line(label: str, drafter: Drafter) -> None:
    ms = measure_draft_ms(drafter, DEPTHS, 8, repeats=3)
    print(f"{label:48s}", " ".join(f"{d}:{v:7.2f}" for d, v in zip(DEPTHS, ms)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="demo/draft-dgf")
    parser.add_argument("--target", default="demo/target-code-9m")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    dtypes = ("fp16", "bf16", "fp32") if args.device.startswith("cuda") else ("fp32",)
    print("shipped backends:", drafter_module.CUDA_ATTENTION_BACKENDS)
    print("depths", DEPTHS, "top_k 8, ms per draft step (best of 3)")
    drafters = {dtype: load(args, dtype) for dtype in dtypes}
    for dtype, drafter in drafters.items():
        line(f"{dtype} warm-up", drafter)
    for threads in (16, 1):
        torch.set_num_threads(threads)
        for dtype, drafter in drafters.items():
            line(f"{dtype} threads={threads}", drafter)
    torch.set_num_threads(16)
    backends = {"math": [SDPBackend.MATH], "efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
                "flash+eff (no cudnn)": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
                "cudnn first": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}
    shipped = drafter_module.CUDA_ATTENTION_BACKENDS
    for name, allowed in backends.items():
        drafter_module.CUDA_ATTENTION_BACKENDS = allowed
        for dtype in drafters:
            line(f"{dtype} sdpa {name}", drafters[dtype])
    drafter_module.CUDA_ATTENTION_BACKENDS = shipped
    hogs = [mp.Process(target=spin, args=(25.0,)) for _ in range(HOG_PROCESSES)]
    for hog in hogs:
        hog.start()
    time.sleep(0.5)
    for threads in (16, 1):
        torch.set_num_threads(threads)
        for dtype in drafters:
            line(f"{dtype} threads={threads} + {HOG_PROCESSES} spinning processes", drafters[dtype])
    for hog in hogs:
        hog.terminate()
    torch.set_num_threads(16)
    drafter = drafters[dtypes[0]]
    gen = torch.Generator().manual_seed(0)
    drafter.reset()
    drafter.extend(torch.randn(64, drafter.feature_size, generator=gen), torch.randint(8192, (64,), generator=gen))
    shape = TreeShape.clamped(25, 4, 8)

    def cycle() -> None:
        drafter.extend(torch.randn(3, drafter.feature_size, generator=gen), torch.randint(8192, (3,), generator=gen))
        drafter.propose(shape)

    for _ in range(2):
        cycle()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if drafter.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            cycle()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    if drafter.device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    root = drafter._root_feature
    assert root is not None
    probs = drafter.head.log_probs(root[None])
    print(f"{dtypes[0]} root log-probs finite:", bool(torch.isfinite(probs).all()))


if __name__ == "__main__":
    main()
