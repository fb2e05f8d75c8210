"""tools.bench_target's bandwidth ceiling counts the bytes a decode step reads: not the embedding
(a step reads one row of it) unless it is tied to the lm_head, which every step reads whole."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from cpu_worker.target_loading import load_target_model
from tools import bench_target
from tools.bench_target import decode_bytes

from conftest import save_tiny_model


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_an_untied_embedding_is_not_streamed(tmp_path):
    model = load_target_model(save_tiny_model(tmp_path / "untied", "llama", tie_word_embeddings=False))
    embedding = model.embed_tokens.weight
    assert decode_bytes(model) == weight_bytes(model) - embedding.numel() * embedding.element_size()
    assert decode_bytes(model) < weight_bytes(model)


def test_a_tied_embedding_is_read_as_the_lm_head(tmp_path):
    model = load_target_model(save_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True))
    assert model.lm_head.weight is model.embed_tokens.weight
    assert decode_bytes(model) == weight_bytes(model)


def not_measured(*_args, **_kwargs):
    raise AssertionError("the bench started before its options were checked")


def test_more_tokens_than_the_context_holds_is_a_usage_error(monkeypatch):
    """--tokens 400 measured bandwidth, loaded the model, timed transformers, then died in a
    ContextOverflowError traceback: 128 prompt tokens + 400 exceed the engine's 512."""
    monkeypatch.setattr(bench_target, "measure_bandwidth", not_measured)
    result = CliRunner().invoke(bench_target.main, ["--models", "testbed", "--tokens", "400"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--tokens': 400 is not in the range 8<=x<=384" in result.output


def test_an_unknown_model_name_is_a_usage_error(monkeypatch):
    """--models testbed,randm-110m benchmarked a random 110M model and titled it 'randm-110m'."""
    monkeypatch.setattr(bench_target, "measure_bandwidth", not_measured)
    result = CliRunner().invoke(bench_target.main, ["--models", "testbed,randm-110m"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--models': randm-110m: expected a comma list of testbed, random-110m" in result.output
    assert bench_target.parse_models(None, None, " random-110m,testbed ") == ["random-110m", "testbed"]


class ClockedEngine:
    """An engine whose prefill takes 1 s and each decode step 10 ms of a fake clock."""

    def __init__(self, clock: list[float]):
        self.clock = clock

    def _step(self, seconds: float):
        self.clock[0] += seconds
        return SimpleNamespace(logits=torch.tensor([0.0, 1.0]))

    def prefill(self, _prompt):
        return self._step(1.0)

    def decode(self, _token):
        return self._step(0.01)


def test_decode_speed_leaves_the_prompts_prefill_out(monkeypatch):
    """The table says decode tokens/s; the prefill of its 128-token prompt was inside the clock."""
    clock = [0.0]
    monkeypatch.setattr(bench_target.time, "perf_counter", lambda: clock[0])
    assert bench_target.engine_decode_tps(ClockedEngine(clock), [1, 2, 3], 10) == pytest.approx(100.0)
