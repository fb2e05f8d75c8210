"""Many requests at once through a real dovetail-run (--max-batch 4, prompts in chunks of 4 tokens)
on the demo pair: each stream's tokens are exactly what it gets alone (greedy dovetail and ar,
seeded sampling), whatever else runs beside it, and one stream's cancel or bad input changes
nobody else's."""

from __future__ import annotations

import time

import pytest

from dovetail_runtime.client import DovetailClient
from ipc import messages as m
from ipc.channels import Channel, connect_client

from runtime_harness import TEST_PROMPTS, Server

WAIT_MS = 180_000
TOKENS = 96
SAMPLED = {"temperature": 0.8, "top_k": 40, "seed": 7}


def request(index: int) -> dict:
    """Request ``index`` of eight: dovetail and ar, greedy and seeded sampling."""
    fields: dict = {"prompt": TEST_PROMPTS[index], "max_new_tokens": TOKENS, "mode": "ar" if index % 4 == 1 else
                    "dovetail"}
    if index % 4 == 3:
        fields["sampling"] = m.Sampling(**SAMPLED)
    return fields


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory, demo_target, demo_draft):
    socket_dir = tmp_path_factory.mktemp("batch")
    # Prompts of more than 4 tokens come in chunks, each stream's chunks between the others' cycles.
    running = Server("--target", str(demo_target), "--draft", str(demo_draft), "--max-batch", "4",
                     "--prefill-chunk", "4", "--bind", f"ipc://{socket_dir}/batch.sock")
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def alone(batch_server) -> dict[int, list[int]]:
    """Each request's tokens when it runs alone."""
    tokens = {}
    with DovetailClient(batch_server.endpoints[0], timeout_s=180) as client:
        for index in range(8):
            fields = request(index)
            tokens[index] = client.generate(fields.pop("prompt"), **fields).token_ids
    assert all(tokens.values()) and sum(map(len, tokens.values())) >= 4 * TOKENS  # some end early (EOS)
    return tokens


def final(client: Channel, request_id: str) -> m.GenerateDone | m.ErrorReply:
    deadline = time.monotonic() + WAIT_MS / 1000
    while True:
        reply = client.recv(timeout_ms=max(0.0, deadline - time.monotonic()) * 1000)
        assert reply is not None, f"no answer for {request_id}"
        if isinstance(reply, (m.GenerateDone, m.ErrorReply)) and reply.request_id == request_id:
            return reply


def test_eight_concurrent_streams_each_get_their_solo_tokens(batch_server, alone):
    endpoint = batch_server.endpoints[0]
    clients = [connect_client(endpoint) for _ in range(8)]
    watcher = connect_client(endpoint)
    try:
        for index, client in enumerate(clients):
            client.send(m.GenerateRequest(request_id=f"r{index}", **request(index)), timeout_ms=5000)
        # Four run together while four wait their turn (never more than four).
        seen = set()
        for _ in range(200):
            watcher.send(m.MetricsRequest(), timeout_ms=5000)
            metrics = watcher.recv(timeout_ms=WAIT_MS)
            assert isinstance(metrics, m.MetricsReply)
            seen.add((metrics.running, metrics.queue_depth))
            if (4, 4) in seen:
                break
        assert (4, 4) in seen and max(running for running, _ in seen) <= 4, seen
        for index, client in enumerate(clients):
            done = final(client, f"r{index}")
            assert isinstance(done, m.GenerateDone), done
            assert done.token_ids == alone[index], index
    finally:
        for client in [*clients, watcher]:
            client.close()


def test_a_cancel_and_a_bad_request_change_nobody_elses_tokens(batch_server, alone):
    endpoint = batch_server.endpoints[0]
    clients = [connect_client(endpoint) for _ in range(4)]
    try:
        clients[0].send(m.GenerateRequest(request_id="cancelled", prompt=TEST_PROMPTS[0], max_new_tokens=2000,
                                          stream=True), timeout_ms=5000)
        for index in (1, 2):
            clients[index].send(m.GenerateRequest(request_id=f"r{index}", **request(index)), timeout_ms=5000)
        # A prompt longer than the context: refused on its own.
        clients[3].send(m.GenerateRequest(request_id="bad", prompt="x = 1\n" * 3000), timeout_ms=5000)
        first = clients[0].recv(timeout_ms=WAIT_MS)
        assert isinstance(first, m.TokenChunk), first
        clients[0].send(m.Cancel(request_id="cancelled"), timeout_ms=5000)
        cancelled = final(clients[0], "cancelled")
        assert isinstance(cancelled, m.GenerateDone) and cancelled.finish_reason == "cancelled"
        refused = final(clients[3], "bad")
        assert isinstance(refused, m.ErrorReply) and refused.code == "prompt_too_long", refused
        for index in (1, 2):
            done = final(clients[index], f"r{index}")
            assert isinstance(done, m.GenerateDone) and done.token_ids == alone[index], index
    finally:
        for client in clients:
            client.close()



def test_a_killed_gpu_worker_fails_only_the_drafting_requests(tmp_path, demo_target, demo_draft):
    """kill -9 of the gpu_worker mid-batch failed the ar requests beside the dovetail one too (worker_failed),
    though they never use it: now they finish with their solo tokens, and the draft is back for the next.
    A fixed tree: the dovetail request drafts every cycle (auto would decode plainly beside them here)."""
    running = Server("--target", str(demo_target), "--draft", str(demo_draft), "--max-batch", "4",
                     "--tree-tokens", "4", "--bind", f"ipc://{tmp_path}/gpu.sock")
    endpoint = running.endpoints[0]
    long_ar = {"prompt": TEST_PROMPTS[2], "max_new_tokens": 600, "mode": "ar", "stream": True}
    drafts = {"prompt": TEST_PROMPTS[0], "max_new_tokens": 40}
    clients = [connect_client(endpoint) for _ in range(3)]
    try:
        with DovetailClient(endpoint, timeout_s=180) as client:
            solo = client.generate(**{key: value for key, value in long_ar.items() if key != "stream"}).token_ids
            solo_drafts = client.generate(**drafts).token_ids
        clients[0].send(m.GenerateRequest(request_id="drafts", prompt=TEST_PROMPTS[0], max_new_tokens=2000,
                                          stream=True), timeout_ms=5000)
        for index in (1, 2):
            clients[index].send(m.GenerateRequest(request_id=f"ar{index}", **long_ar), timeout_ms=5000)
        for index in (0, 1, 2):  # all three are decoding
            assert isinstance(clients[index].recv(timeout_ms=WAIT_MS), m.TokenChunk)
        running.workers()["gpu_worker"].kill()
        failed = final(clients[0], "drafts")
        assert isinstance(failed, m.ErrorReply) and failed.code == "worker_failed", failed
        for index in (1, 2):
            done = final(clients[index], f"ar{index}")
            assert isinstance(done, m.GenerateDone) and done.token_ids == solo, done
        clients[0].send(m.GenerateRequest(request_id="after", **drafts), timeout_ms=5000)
        after = final(clients[0], "after")  # on a restarted gpu_worker
        assert isinstance(after, m.GenerateDone) and after.token_ids == solo_drafts, after
    finally:
        for client in clients:
            client.close()
        assert running.stop() == 0
