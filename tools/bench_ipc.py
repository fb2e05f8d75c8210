"""Round-trip latency of one verify cycle's IPC between two processes.

A requester (the coordinator's side) sends a VerifyRequest (a T-node tree); a responder
process (the cpu_worker's side) answers with a VerifyResult carrying a [rows, cols]
float16 hidden-state block, and the requester turns the block into a torch tensor.
Compared paths:

  control only      VerifyResult with an empty block (the floor: ZMQ + msgpack)
  zmq inline        the block's bytes inside the msgpack message (InlineBlock)
  shm ring (copy)   the block in a shared-memory ring, a RingRef in the message,
                    the requester copies it out (ShmRing.read)
  shm ring (view)   same, but the requester takes a zero-copy view (read(copy=False))

Paths alternate every iteration. Both processes run one torch thread; the channel is a PAIR socket over ipc:// (or
loopback tcp:// with --transport tcp). Usage:

    python tools/bench_ipc.py [--iters 3000] [--rows 16] [--cols 5120] [--transport ipc|tcp]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ipc import messages as M  # noqa: E402
from ipc.channels import Channel, RuntimeDir  # noqa: E402
from ipc.shm_ring import ShmRing, get_block, pack_block, slot_bytes_for  # noqa: E402

# The request's seq_id selects the path (a benchmark shortcut, not protocol semantics).
MODES = ["control only", "zmq inline", "shm ring (copy)", "shm ring (view)"]
CONTROL, INLINE, RING_COPY, RING_VIEW = range(4)


def responder(endpoint: str, rows: int, cols: int, ring_name_out) -> None:
    import torch

    torch.set_num_threads(1)
    block = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).half()
    empty = torch.empty(0, cols, dtype=torch.float16)
    ring = ShmRing.create(slot_bytes_for(rows, cols, "float16"), nslots=4)
    channel = Channel.connect(endpoint, allowed={M.VerifyRequest, M.Shutdown})
    try:
        ring_name_out.send(ring.name)
        while True:
            req = channel.recv()
            if isinstance(req, M.Shutdown):
                break
            mode = req.seq_id
            if mode == CONTROL:
                features = pack_block(empty)
            elif mode == INLINE:
                features = pack_block(block)
            else:
                features = ring.write(block)
            n = len(req.tokens)
            channel.send(M.VerifyResult(seq_id=req.seq_id, accepted_tokens=req.tokens[:4],
                                        accepted_nodes=list(range(min(4, n))), features=features,
                                        compute_ms=0.0))
    finally:
        channel.close()
        ring.close()


def run(iters: int, rows: int, cols: int, transport: str, tree: int = 16) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    results = []
    with RuntimeDir() as rundir:
        endpoint = rundir.endpoint("bench") if transport == "ipc" else "tcp://127.0.0.1:*"
        channel = Channel.bind(endpoint, allowed={M.VerifyResult})
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=responder, args=(channel.endpoint, rows, cols, child_end), daemon=True)
        proc.start()
        try:
            if not parent_end.poll(60):
                raise RuntimeError("responder did not start")
            ring = ShmRing.attach(parent_end.recv())
            tokens = list(range(100, 100 + tree))
            parents = [-1] + [i // 2 for i in range(1, tree)]
            requests = [M.VerifyRequest(seq_id=mode, tokens=tokens, parents=parents) for mode in range(len(MODES))]
            samples = [[] for _ in MODES]
            msg_bytes = [0] * len(MODES)
            # Paths take turns every iteration, so load drift on the machine hits all alike.
            for i in range(iters + iters // 10):  # the first tenth is warm-up
                for mode, req in enumerate(requests):
                    t0 = time.perf_counter_ns()
                    channel.send(req)
                    res = channel.recv(timeout_ms=10_000)
                    if mode == RING_VIEW:
                        out = ring.read(res.features, copy=False)
                    else:
                        out = get_block(res.features, ring)
                    t1 = time.perf_counter_ns()
                    if i == 0:
                        assert tuple(out.shape) == (0 if mode == CONTROL else rows, cols), out.shape
                    del out
                    if i >= iters // 10:
                        samples[mode].append((t1 - t0) / 1000)
                    if i == 0:
                        msg_bytes[mode] = len(M.encode(res))
            for mode, label in enumerate(MODES):
                xs = sorted(samples[mode])
                results.append(dict(
                    path=label, msg_bytes=msg_bytes[mode],
                    p50=statistics.median(xs), p99=xs[int(0.99 * (len(xs) - 1))],
                    mean=statistics.fmean(xs), n=len(xs),
                ))
            ring.close()
            channel.send(M.Shutdown())
            proc.join(30)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
            channel.close()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--cols", type=int, default=5120)
    ap.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    args = ap.parse_args(argv)
    results = run(args.iters, args.rows, args.cols, args.transport)
    block = args.rows * args.cols * 2
    print(f"one cycle round trip, VerifyRequest (T=16) -> VerifyResult + [{args.rows} x {args.cols}] fp16 block "
          f"({block / 1024:.0f} KiB), {args.transport}://, {args.iters} iterations, cpus={os.cpu_count()}")
    print(f"{'path':<18} {'msg bytes':>10} {'p50 us':>9} {'p99 us':>9} {'mean us':>9}")
    for r in results:
        print(f"{r['path']:<18} {r['msg_bytes']:>10} {r['p50']:>9.1f} {r['p99']:>9.1f} {r['mean']:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
