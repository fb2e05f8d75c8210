"""Round-trip latency of one verify cycle's messages between two processes.

A requester (the coordinator's side) owns a shared-memory ring and sends a VerifyRequest
(a T-node tree) over a ZMQ PAIR channel on ipc://; a responder process (the cpu_worker's
side) writes a [rows, cols] hidden-state block into the ring and answers with a
VerifyResult carrying its RingRef; the requester reads the block back as a torch tensor
(a private copy, as the coordinator does). One round trip is all of that. Hidden states
never travel inside the message, so its size stays the same whatever the block.

Configurations (rows x dtype) take turns every iteration, so load drift on the machine
hits all alike; the first tenth of the iterations is warm-up. Both processes run one
torch thread. Usage:

    python -m tools.bench_ipc [--iters 2000] [--rows 1 8 16 64] [--dtypes float16 float32] [--cols 5120]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import torch

from ipc import messages as m
from ipc.channels import Channel, RuntimeDir
from ipc.codec import encode
from ipc.shm_ring import ShmRing, get_block, slot_bytes_for
from tools.options import positive_int


def responder(endpoint: str, ring_name: str, configs: list[tuple[int, str]], cols: int) -> None:
    """Answer each VerifyRequest with the block of configuration ``seq_id`` (a benchmark
    shortcut, not protocol semantics), written into the ring, until Shutdown."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    blocks = [torch.randn(rows, cols, generator=generator).to(getattr(torch, dtype)) for rows, dtype in configs]
    ring = ShmRing.attach(ring_name)
    channel = Channel.connect(endpoint, allowed=(m.VerifyRequest, m.Shutdown))
    try:
        while True:
            request = channel.recv()
            if isinstance(request, m.Shutdown):
                break
            if not isinstance(request, m.VerifyRequest):
                raise RuntimeError(f"unexpected message {type(request).__name__}")
            channel.send(m.VerifyResult(seq_id=request.seq_id, accepted_tokens=request.tokens[:4],
                                        features=ring.write(blocks[request.seq_id]), compute_ms=0.0))
    finally:
        channel.close()
        ring.close()


def run(configs: list[tuple[int, str]], cols: int, iters: int, tree: int) -> list[tuple[float, int]]:
    """(median microseconds per round trip, VerifyResult bytes) per configuration."""
    torch.set_num_threads(1)
    slot_bytes = max(slot_bytes_for(rows, cols, dtype) for rows, dtype in configs)
    tokens = list(range(100, 100 + tree))
    parents = [-1] + [i // 2 for i in range(1, tree)]
    requests = [m.VerifyRequest(seq_id=index, tokens=tokens, parents=parents) for index in range(len(configs))]
    samples: list[list[float]] = [[] for _ in configs]
    msg_bytes = [0] * len(configs)
    warmup = iters // 10
    with RuntimeDir() as rundir, ShmRing.create(slot_bytes, nslots=4) as ring:
        channel = Channel.bind(rundir.endpoint("bench"), allowed=(m.VerifyResult,))
        process = mp.get_context("spawn").Process(
            target=responder, args=(channel.endpoint, ring.name, configs, cols), daemon=True)
        process.start()
        try:
            for iteration in range(warmup + iters):
                for index, request in enumerate(requests):
                    started = time.perf_counter_ns()
                    channel.send(request, timeout_ms=60_000)
                    result = channel.recv(timeout_ms=60_000)  # the first one waits for the spawn
                    if not isinstance(result, m.VerifyResult):
                        raise RuntimeError(f"no VerifyResult from the responder: {result!r}")
                    block = get_block(result.features, ring)
                    finished = time.perf_counter_ns()
                    del block
                    if iteration >= warmup:
                        samples[index].append((finished - started) / 1e3)
                    if iteration == 0:
                        msg_bytes[index] = len(encode(result))
            channel.send(m.Shutdown(), timeout_ms=1000)
            process.join(30)
        finally:
            if process.is_alive():
                process.kill()
                process.join(10)
            channel.close()
    return [(statistics.median(times), size) for times, size in zip(samples, msg_bytes)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=positive_int, default=2000, help="timed round trips per configuration")
    parser.add_argument("--rows", type=positive_int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--dtypes", nargs="+", choices=["float16", "bfloat16", "float32"],
                        default=["float16", "float32"])
    parser.add_argument("--cols", type=positive_int, default=5120, help="hidden size (5120: 13B)")
    parser.add_argument("--tree", type=positive_int, default=16, help="tree size T of the VerifyRequest")
    args = parser.parse_args(argv)
    configs = [(rows, dtype) for dtype in args.dtypes for rows in args.rows]
    results = run(configs, args.cols, args.iters, args.tree)
    print(f"one verify cycle round trip: VerifyRequest (T={args.tree}) -> VerifyResult + RingRef to a "
          f"[rows x {args.cols}] block in a shared-memory ring, read back as a tensor; ipc://, "
          f"{args.iters} iterations, cpus={os.cpu_count()}")
    header = f"{'rows':>5} {'dtype':>9} {'block KiB':>10} {'msg bytes':>10} {'median us':>10}"
    print(header)
    print("-" * len(header))
    for (rows, dtype), (median_us, size) in zip(configs, results):
        block_kib = slot_bytes_for(rows, args.cols, dtype) / 1024
        print(f"{rows:>5} {dtype:>9} {block_kib:>10.1f} {size:>10} {median_us:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
