"""Log-probabilities of emitted tokens: the target's own log_softmax at each position, reported by
the cpu_worker with every prefill, decode and verify result when a sequence asks, and identical in
dovetail and ar modes (the verified tree rows carry decoding's bits)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from cpu_worker.logprobs import path_logprobs, token_logprob
from ipc import messages as m
from ipc.codec import ProtocolError, decode, encode
from ipc.tree import TreeShape

DEMO = Path(__file__).resolve().parents[2] / "demo"


def test_a_tokens_logprob_is_log_softmax_with_the_likeliest_first():
    logits = torch.tensor([0.5, 3.0, -1.0, 3.0, 2.0])
    expected = torch.log_softmax(logits, dim=-1)
    entry = token_logprob(logits, 4, top=3)
    assert entry.logprob == float(expected[4])
    assert entry.top_ids == [1, 3, 4]  # the tie (1 and 3) in id order
    assert entry.top_logprobs == [float(expected[1]), float(expected[3]), float(expected[4])]
    assert token_logprob(logits, 2, top=0) == m.TokenLogprob(logprob=float(expected[2]))
    assert token_logprob(logits, 0, top=99).top_ids == [1, 3, 4, 0, 2]  # never more than the vocabulary
    rows = torch.stack([logits, logits.flip(0)])
    assert path_logprobs(rows, [1, 0], [0, 4], top=1) == [token_logprob(rows[1], 0, 1), token_logprob(rows[0], 4, 1)]


def test_logprob_fields_travel_the_protocol_and_are_range_checked():
    request = m.GenerateRequest(request_id="r", prompt="x", logprobs=5)
    assert decode(encode(request)) == request
    done = m.GenerateDone(request_id="r", token_ids=[3], text="a", finish_reason="stop",
                          logprobs=[m.TokenLogprob(logprob=-0.25, top_ids=[3, 7], top_logprobs=[-0.25, -2.0])])
    assert decode(encode(done)) == done
    for bad in (-1, m.MAX_LOGPROBS + 1, True):
        with pytest.raises(ProtocolError, match="logprobs"):
            decode(msgspec.msgpack.encode({"type": "GenerateRequest", "request_id": "r", "prompt": "x",
                                           "logprobs": bad}))


@pytest.fixture(scope="module")
def demo_pair():
    from cpu_worker.server import build_engine
    from gpu_worker.drafter import Drafter

    engine, _ = build_engine(str(DEMO / "target-code-9m"), "int8", 256)
    drafter = Drafter.from_pretrained(DEMO / "draft-dgf", DEMO / "target-code-9m", max_len=256, device="cpu")
    return engine, drafter


def run(engine, drafter, prompt: list[int], sampling: m.Sampling, logprobs: int | None):
    """(tokens, logprobs) of the coordinator's own cycle over in-process workers: dovetail with a
    drafter, ar without."""
    from dovetail_runtime.generation import Job

    from test_sampling import run_job

    job = Job(seq_id=1, prompt_ids=prompt, max_new_tokens=24, sampling=sampling, eos_token_ids=frozenset(),
              max_len=engine.max_len, logprobs=logprobs)
    tokens, entries, _ = run_job(engine, drafter, job, TreeShape.clamped(8, 4, 4))
    return tokens, entries


@pytest.mark.parametrize("sampling", [m.Sampling(), m.Sampling(temperature=0.8, top_k=20, seed=5)])
def test_dovetail_reports_ars_logprobs_exactly(demo_pair, sampling):
    engine, drafter = demo_pair
    prompt = [1, 500, 600, 700, 42]
    ar_tokens, ar_logprobs = run(engine, None, prompt, sampling, logprobs=3)
    tokens, logprobs = run(engine, drafter, prompt, sampling, logprobs=3)
    assert tokens == ar_tokens and len(logprobs) == len(tokens) == 24
    assert logprobs == ar_logprobs  # float for float
    # Entry i is the target's own distribution (temperature 1, no top-k) at token i's position:
    # the prompt's prefill, then one decode step per token, driven here by hand.
    step = engine.prefill(prompt)
    for index, token in enumerate(tokens):
        assert logprobs[index] == token_logprob(step.logits, token, 3), index
        step = engine.decode(token)
    assert all(entry.top_logprobs == sorted(entry.top_logprobs, reverse=True) for entry in logprobs)
    if sampling.greedy:
        assert all(entry.top_ids[0] == token for entry, token in zip(logprobs, tokens))


def test_no_logprobs_unless_asked(demo_pair):
    engine, drafter = demo_pair
    tokens, logprobs = run(engine, drafter, [1, 500, 600], m.Sampling(), logprobs=None)
    assert tokens and logprobs == []
    _, chosen_only = run(engine, drafter, [1, 500, 600], m.Sampling(), logprobs=0)
    assert len(chosen_only) == len(tokens) and all(entry.top_ids == [] for entry in chosen_only)
