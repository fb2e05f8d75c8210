"""The two-process runtime end to end: real dovetail-run processes, real sockets."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import msgpack
import psutil
import pytest
import torch
import zmq

from dovetail_runtime.client import DovetailClient, GenerationError
from dovetail_runtime.coordinator import DRAFT_SPIN_COUNT, TARGET_SPIN_COUNT
from dovetail_runtime.tokenizer import Tokenizer
from ipc import messages as m
from ipc.codec import ProtocolError, decode

from conftest import DEMO
from runtime_harness import TEST_PROMPTS, Server, descendants_gone, dovetail_run, our_segments, thread_affinities

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def reference_ids(demo_target) -> dict[str, list[int]]:
    """transformers' own greedy continuation of each test prompt (stops after </s> like we do)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo_target))
    model = AutoModelForCausalLM.from_pretrained(str(demo_target), dtype=torch.float32).eval()
    expected = {}
    for prompt in TEST_PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected[prompt] = out[0, len(ids):].tolist()
    return expected


def test_one_shot_json_is_lossless_in_both_modes(tmp_path, demo_target, demo_random_head, reference_ids):
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("\n".join(json.dumps({"prompt": p}) for p in TEST_PROMPTS) + "\n")
    # --compare-ar runs every prompt again in --mode ar on the same workers.
    done = dovetail_run("--target", str(demo_target), "--draft", str(demo_random_head), "--compare-ar",
                        "--prompt-file", str(prompt_file), "--max-new-tokens", str(NEW_TOKENS), "--json",
                        "--log-level", "warning")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == TEST_PROMPTS
    for line in lines:
        assert line["token_ids"] == reference_ids[line["prompt"]]
        assert line["ar"]["same_tokens"] is True
        stats = line["stats"]
        assert stats["new_tokens"] == len(line["token_ids"])
        assert stats["cycles"] >= 1 and stats["tau"] >= 1.0
        assert sum(stats["accept_per_depth"]) == stats["cycles"]
        assert sum(stats["trees"].values()) == stats["cycles"]  # the shapes --tree-tokens auto chose
        for key in ("tokens_per_s", "prefill_ms", "draft_ms", "verify_ms", "ipc_ms"):
            assert stats[key] >= 0
        assert line["ar"]["stats"]["tau"] == 1.0 and line["ar"]["stats"]["draft_ms"] == 0


def test_mode_ar_runs_without_a_draft(demo_target, reference_ids):
    done = dovetail_run("--target", str(demo_target), "--mode", "ar", "--prompt", TEST_PROMPTS[0],
                        "--prompt", TEST_PROMPTS[1], "--max-new-tokens", str(NEW_TOKENS), "--json",
                        "--log-level", "warning")
    assert done.returncode == 0, done.stderr[-3000:]
    for line in map(json.loads, done.stdout.splitlines()):
        assert line["token_ids"] == reference_ids[line["prompt"]]


def test_one_shot_stdout_is_the_completion_alone(demo_target, demo_draft):
    """stdout pipes: each completion and a newline, the text --json gives; the stats lines on stderr."""
    common = ("--target", str(demo_target), "--draft", str(demo_draft), "--prompt", TEST_PROMPTS[0], "--prompt",
              TEST_PROMPTS[2], "--max-new-tokens", "16", "--log-level", "warning")
    plain, as_json = dovetail_run(*common, "--compare-ar"), dovetail_run(*common, "--json")
    assert plain.returncode == 0 and as_json.returncode == 0, plain.stderr[-3000:] + as_json.stderr[-3000:]
    texts = [json.loads(line)["text"] for line in as_json.stdout.splitlines()]
    assert plain.stdout == "".join(text + "\n" for text in texts)
    assert plain.stderr.count("[dovetail: ") == 2 and plain.stderr.count("[ar: ") == 2
    assert plain.stderr.count("same tokens: yes]") == 2


def test_bad_flags_and_inputs_are_refused_clearly(tmp_path, demo_target, demo_random_head):
    done = dovetail_run("--target", str(demo_target), "--draft", str(demo_random_head), "--cpu-cores", "3-1",
                        "--prompt", "x")
    assert done.returncode == 2 and "bad range" in done.stderr
    done = dovetail_run("--target", str(demo_target), "--prompt", "x")
    assert done.returncode == 2 and "--draft is required" in done.stderr
    done = dovetail_run("--target", str(tmp_path / "missing"), "--draft", str(demo_random_head), "--prompt", "x")
    assert done.returncode == 2 and "does not exist" in done.stderr
    done = dovetail_run("--target", str(demo_target), "--draft", str(demo_random_head), "--max-len", "8",
                        "--prompt", "def " * 20, "--json", "--log-level", "error")
    assert done.returncode == 1
    assert json.loads(done.stdout)["error"]["code"] == "prompt_too_long"
    # --top-k meant sampling elsewhere and the beam here: refused with both spellings named.
    done = dovetail_run("--target", str(demo_target), "--top-k", "8", "--prompt", "x")
    assert done.returncode == 2 and "--tree-top-k 8" in done.stderr and "--sample-top-k 8" in done.stderr
    for bad, says in (("banana", "is not 'auto'"), ("auto:1", "auto:N needs 2 <= N"), ("0", "must be in 1..")):
        done = dovetail_run("--target", str(demo_target), "--tree-tokens", bad, "--prompt", "x")
        assert done.returncode == 2 and says in done.stderr, done.stderr
    done = dovetail_run("--target", str(demo_target), "--mode", "ar", "--temperature", "1e-30", "--prompt", "x")
    assert done.returncode == 2 and "temperature must be 0" in done.stderr
    done = dovetail_run("--target", str(demo_target), "--mode", "ar", "--max-len", "999999", "--prompt", "x",
                        "--log-level", "error")
    assert done.returncode == 2 and "exceeds this model's context" in done.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_target, demo_random_head):
    socket_dir = tmp_path_factory.mktemp("sock")
    running = Server("--target", str(demo_target), "--draft", str(demo_random_head), "--cpu-cores", "0",
                     "--bind", f"ipc://{socket_dir}/dovetail.sock", "--bind", "tcp://127.0.0.1:*")
    yield running
    pids = [running.pid] + [worker.pid for worker in running.workers().values()]
    assert running.stop() == 0
    assert descendants_gone(pids)
    assert our_segments(running.pid) == []


def test_server_runs_exactly_our_three_processes(server):
    workers = server.workers()
    assert sorted(workers) == ["cpu_worker", "gpu_worker"]
    ours = [p for p in psutil.Process(server.pid).children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(ours) == 2


def test_cpu_cores_confine_every_target_thread(server):
    cpu = server.workers()["cpu_worker"]
    assert len(cpu.threads()) > 1
    assert thread_affinities(cpu) == {(0,)}


def test_a_wait_policy_the_user_set_reaches_the_workers_unchanged(server):
    # The suite runs with an OMP_WAIT_POLICY (conftest sets one unless the caller did): no spin count of ours.
    policy = os.environ["OMP_WAIT_POLICY"]
    workers = server.workers()
    assert workers["cpu_worker"].environ().get("GOMP_SPINCOUNT") == os.environ.get("GOMP_SPINCOUNT")
    assert workers["cpu_worker"].environ()["OMP_WAIT_POLICY"] == policy
    assert workers["gpu_worker"].environ()["OMP_WAIT_POLICY"] == policy
    assert workers["gpu_worker"].environ().get("GOMP_SPINCOUNT") == os.environ.get("GOMP_SPINCOUNT")


def test_beside_a_draft_the_target_spins_briefly_and_the_draft_sleeps(demo_target, demo_random_head):
    """Without a policy of the user's, each worker's idle OpenMP threads spin briefly, not libgomp's
    ~9 ms (they would spin on the cores the other's step runs on next), then sleep."""
    environment = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    running = Server("--target", str(demo_target), "--draft", str(demo_random_head), "--cpu-cores", "0",
                     env=environment)
    try:
        workers = running.workers()
        assert workers["cpu_worker"].environ()["GOMP_SPINCOUNT"] == TARGET_SPIN_COUNT
        assert "OMP_WAIT_POLICY" not in workers["cpu_worker"].environ()
        assert workers["gpu_worker"].environ()["OMP_WAIT_POLICY"] == "PASSIVE"
        assert workers["gpu_worker"].environ()["GOMP_SPINCOUNT"] == DRAFT_SPIN_COUNT
    finally:
        assert running.stop() == 0


def test_ipc_and_tcp_clients_stream_correct_output_at_once(server, reference_ids):
    ipc_endpoint, tcp_endpoint = server.endpoints
    assert ipc_endpoint.startswith("ipc://") and tcp_endpoint.startswith("tcp://127.0.0.1:")
    outcomes: dict[str, tuple[list[int], m.GenerateDone]] = {}

    def run(endpoint: str, prompt: str) -> None:
        with DovetailClient(endpoint, timeout_s=120) as client:
            streamed: list[int] = []
            for event in client.events(prompt, max_new_tokens=NEW_TOKENS):
                if isinstance(event, m.TokenChunk):
                    streamed += event.token_ids
                else:
                    outcomes[endpoint] = (streamed, event)

    threads = [threading.Thread(target=run, args=(ipc_endpoint, TEST_PROMPTS[0])),
               threading.Thread(target=run, args=(tcp_endpoint, TEST_PROMPTS[1]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    for endpoint, prompt in ((ipc_endpoint, TEST_PROMPTS[0]), (tcp_endpoint, TEST_PROMPTS[1])):
        streamed, done = outcomes[endpoint]
        assert done.token_ids == reference_ids[prompt]
        assert streamed == done.token_ids


def test_client_that_leaves_mid_stream_does_not_disturb_others(server, reference_ids):
    leaver = DovetailClient(server.endpoints[0], timeout_s=60)
    events = leaver.events(TEST_PROMPTS[2], max_new_tokens=500)
    assert isinstance(next(events), m.TokenChunk)
    leaver.close()
    with DovetailClient(server.endpoints[1], timeout_s=120) as client:
        done = client.generate(TEST_PROMPTS[3], max_new_tokens=NEW_TOKENS)
    assert done.token_ids == reference_ids[TEST_PROMPTS[3]]


def raw_exchange(endpoint: str, frames: list[bytes], timeout_ms: int = 10000) -> list:
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    replies = []
    try:
        for frame in frames:
            sock.send(frame)
            if sock.poll(timeout_ms):
                replies.append(decode(sock.recv()))
            else:
                replies.append(None)
    finally:
        sock.close()
    return replies


def test_malformed_messages_get_error_replies_and_serving_goes_on(server, reference_ids):
    endpoint = server.endpoints[1]
    wrong_types = msgpack.packb({"type": "GenerateRequest", "request_id": 5, "prompt": ["x"],
                                 "max_new_tokens": "many"})
    unknown = msgpack.packb({"v": m.PROTOCOL_VERSION, "type": "LaunchMissiles"})
    old_version = msgpack.packb({"v": 0, "type": "Ping", "nonce": 1})
    bad_sampling = msgpack.packb({"type": "GenerateRequest", "request_id": "r", "prompt": "x",
                                  "sampling": {"temperature": 1.0, "top_p": 0.0}})
    flat_sampling = msgpack.packb({"type": "GenerateRequest", "request_id": "r", "prompt": "x", "temperature": 0.5})
    pickled = b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x01."
    replies = raw_exchange(endpoint, [b"\xff\x00garbage", wrong_types, unknown, old_version, bad_sampling,
                                      flat_sampling, pickled])
    assert all(isinstance(r, m.ErrorReply) and r.code == "bad_message" for r in replies), replies
    assert "top_p" in replies[4].message and "temperature" in replies[5].message
    # A message over the socket's size limit: that connection is dropped, the server lives on.
    huge = raw_exchange(endpoint, [b"\x00" * (40 * 1024 * 1024)], timeout_ms=2000)
    assert huge == [None]
    with DovetailClient(endpoint, timeout_s=120) as client:
        done = client.generate(TEST_PROMPTS[4], max_new_tokens=NEW_TOKENS)
        assert done.token_ids == reference_ids[TEST_PROMPTS[4]]
        with pytest.raises(GenerationError, match="prompt_too_long"):
            client.generate("a = 1\n" * 1500, max_new_tokens=4)


def test_killed_cpu_worker_fails_request_fast_then_server_recovers(demo_target, demo_random_head,
                                                                   reference_ids, tmp_path):
    running = Server("--target", str(demo_target), "--draft", str(demo_random_head),
                     "--bind", f"ipc://{tmp_path}/kill.sock")
    try:
        victim = running.workers()["cpu_worker"]
        with DovetailClient(running.endpoints[0], timeout_s=120) as client:
            events = client.events(TEST_PROMPTS[5], max_new_tokens=2000)
            assert isinstance(next(events), m.TokenChunk)
            os.kill(victim.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(GenerationError, match="worker_failed"):
                for _ in events:
                    pass
            assert time.monotonic() - killed_at < 2.0
            # The coordinator restarted the worker and serves correctly again.
            done = client.generate(TEST_PROMPTS[6], max_new_tokens=NEW_TOKENS)
            assert done.token_ids == reference_ids[TEST_PROMPTS[6]]
        assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
        pids = [running.pid] + [worker.pid for worker in running.workers().values()]
    except BaseException:
        print("".join(running.log[-60:]))  # the server's side of the story, shown on failure
        raise
    finally:
        code = running.stop()
    assert code == 0
    assert descendants_gone(pids)
    assert our_segments(running.pid) == []


def test_sampling_through_the_server(server, reference_ids):
    prompt = TEST_PROMPTS[7]
    with DovetailClient(server.endpoints[0], timeout_s=120) as client:
        for mode in ("dovetail", "ar"):
            first = client.generate(prompt, max_new_tokens=32, temperature=0.8, seed=5, mode=mode)
            again = client.generate(prompt, max_new_tokens=32, temperature=0.8, seed=5, mode=mode)
            assert first.token_ids == again.token_ids, mode
            # top-k 1 leaves one allowed token per step: sampling must then be the greedy decode.
            only_best = client.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=1, mode=mode)
            assert only_best.token_ids == reference_ids[prompt], mode
        # The client validates by the same schema the server does: nothing invalid leaves it.
        with pytest.raises(ProtocolError, match="top_p"):
            client.generate(prompt, max_new_tokens=4, temperature=1.0, top_p=0.0)
        with pytest.raises(ValueError, match="temperature must be 0"):
            client.generate(prompt, max_new_tokens=4, temperature=1e-30)


def test_workers_and_memory_go_when_the_coordinator_is_killed(demo_target, demo_random_head, tmp_path):
    running = Server("--target", str(demo_target), "--draft", str(demo_random_head),
                     "--bind", f"ipc://{tmp_path}/orphan.sock")
    workers = running.workers()
    assert sorted(workers) == ["cpu_worker", "gpu_worker"] and our_segments(running.pid)
    assert running.stop(signal.SIGKILL) == -signal.SIGKILL
    assert descendants_gone([worker.pid for worker in workers.values()], within_s=5)
    deadline = time.monotonic() + 5
    while our_segments(running.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert our_segments(running.pid) == []


def test_a_plain_msgpack_zmq_client_streams_a_completion(server, reference_ids):
    """What a client in another language does (docs/protocol.md): no Dovetail code on its side."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoints[1])
    prompt = TEST_PROMPTS[8]
    try:
        sock.send(msgpack.packb({"type": "GenerateRequest", "request_id": "plain-1", "prompt": prompt,
                                 "max_new_tokens": NEW_TOKENS, "stream": True}))
        chunks, done = [], None
        while done is None:
            assert sock.poll(120_000), "no answer from the server"
            reply = msgpack.unpackb(sock.recv())
            assert reply["request_id"] == "plain-1", reply
            if reply["type"] == "TokenChunk":
                chunks.append(reply)
            else:
                assert reply["type"] == "GenerateDone", reply
                done = reply
    finally:
        sock.close()
    assert done["token_ids"] == reference_ids[prompt]
    assert [t for chunk in chunks for t in chunk["token_ids"]] == done["token_ids"]
    assert "".join(chunk["text"] for chunk in chunks) == done["text"]
    assert done["finish_reason"] in ("stop", "length") and done["stats"]["new_tokens"] == len(done["token_ids"])


def test_coordinator_process_never_loads_torch(server):
    coordinator_maps = Path(f"/proc/{server.pid}/maps").read_text()
    worker_maps = Path(f"/proc/{server.workers()['cpu_worker'].pid}/maps").read_text()
    assert "libtorch" not in coordinator_maps and "libtorch" in worker_maps


# Real code, as the demo head was trained on: its trees should be accepted deeply.
CODE_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    \"\"\"Parse the command line and run.\"\"\"\n"
    "    if argv is None:\n        argv = sys.argv[1:]\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n        self._items = []\n\n"
    "    def push(self, item):\n",
    "def read_lines(path, encoding='utf-8'):\n    \"\"\"Return the lines of a text file.\"\"\"\n"
    "    with open(path, encoding=encoding) as f:\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, self._data)\n\n"
    "    def __eq__(self, other):\n",
]


@pytest.mark.parametrize("head", ["draft-dgf", "draft-dgf-1"])
def test_trained_demo_pair_is_lossless_with_high_acceptance(tmp_path, demo_target, head):
    """Both shipped heads: the 4-layer one (for a GPU) and the 1-layer one (for drafting on a CPU)."""
    prompt_file = tmp_path / "code.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CODE_PROMPTS))
    # A fixed tree: tau measures the head (--tree-tokens auto picks small trees where drafting is dear).
    done = dovetail_run("--target", str(demo_target), "--draft", str(DEMO / head), "--compare-ar", "--json",
                        "--prompt-file", str(prompt_file), "--max-new-tokens", "64", "--log-level", "warning",
                        "--tree-tokens", "16", "--depth", "6")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == len(CODE_PROMPTS) and all(line["ar"]["same_tokens"] for line in lines)
    cycles = sum(line["stats"]["cycles"] for line in lines)
    # tau = tokens emitted by cycles / cycles (the prefill's token is not a cycle's).
    tau = sum(line["stats"]["new_tokens"] - 1 for line in lines) / cycles
    assert tau > 3.0, f"tau {tau:.2f} over {cycles} cycles"


def test_both_modes_count_the_context_once(demo_target, demo_draft):
    done = dovetail_run("--target", str(demo_target), "--draft", str(demo_draft), "--max-len", "24", "--compare-ar",
                        "--prompt", TEST_PROMPTS[0], "--max-new-tokens", "100", "--json", "--log-level", "warning")
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout)
    prompt_tokens = len(Tokenizer.from_dir(demo_target).encode(TEST_PROMPTS[0]))
    assert line["finish_reason"] == "length" and line["ar"]["same_tokens"] is True
    # Every cache slot is used: the prompt and all new tokens but the last (never fed back) fill 24.
    assert prompt_tokens + len(line["token_ids"]) - 1 == 24


def test_any_tree_the_cli_accepts_works(demo_target, demo_draft):
    done = dovetail_run("--target", str(demo_target), "--draft", str(demo_draft), "--tree-tokens", "64",
                        "--depth", "10", "--tree-top-k", "32", "--compare-ar", "--prompt", CODE_PROMPTS[1],
                        "--max-new-tokens", "24", "--json", "--log-level", "warning")
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout)
    assert line["ar"]["same_tokens"] is True and line["stats"]["cycles"] >= 1
