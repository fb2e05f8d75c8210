"""The CPU target engine against transformers: logits, trees, KV compaction, greedy decoding."""

from __future__ import annotations

import random

import pytest
import torch

from cpu_worker.engine import ContextOverflowError, TargetEngine, greedy_decode
from cpu_worker.target_loading import load_target_model

from conftest import TINY_FAMILIES, save_tiny_model
from tree_paths import path_to

TOL = 1e-4


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def engine_for(path, max_len: int = 256) -> TargetEngine:
    return TargetEngine(load_target_model(path), max_len=max_len)


def random_tokens(vocab: int, count: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count,), generator=generator).tolist()


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_prefill_and_decode_logits_match_transformers(tiny_models, family):
    path = tiny_models[family]
    reference = hf_model(path)
    engine = engine_for(path)
    tokens = random_tokens(engine.spec.vocab_size, 24, seed=1)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    step = engine.prefill(tokens[:16])
    assert (step.logits - expected[15]).abs().max() < TOL
    for index in range(16, 24):
        step = engine.decode(tokens[index])
        assert (step.logits - expected[index]).abs().max() < TOL, f"decode at {index}"
    # A multi-token extend after a prefix uses an explicit causal mask: check it too.
    engine.prefill(tokens[:10])
    step = engine.extend(tokens[10:24])
    assert (step.logits - expected[23]).abs().max() < TOL


def test_demo_target_logits_match_transformers(demo_target):
    reference = hf_model(demo_target)
    engine = engine_for(demo_target, max_len=128)
    tokens = random_tokens(engine.spec.vocab_size, 48, seed=2)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    step = engine.prefill(tokens[:40])
    assert (step.logits - expected[39]).abs().max() < TOL
    for index in range(40, 48):
        step = engine.decode(tokens[index])
        assert (step.logits - expected[index]).abs().max() < TOL


def random_tree(size: int, vocab: int, rng: random.Random) -> tuple[list[int], list[int]]:
    parents = [-1] + [rng.randrange(index) for index in range(1, size)]
    tokens = [rng.randrange(3, vocab) for _ in range(size)]
    return tokens, parents


@pytest.mark.parametrize("family", ["llama-gqa-tied", "qwen2"])
@pytest.mark.parametrize("size", [1, 2, 7, 16, 64])
def test_tree_logits_equal_each_path_run_as_a_sequence(tiny_models, family, size):
    engine = engine_for(tiny_models[family])
    rng = random.Random(size)
    prefix = random_tokens(engine.spec.vocab_size, 11, seed=size)
    tokens, parents = random_tree(size, engine.spec.vocab_size, rng)
    engine.prefill(prefix)
    features, logits = engine.tree_logits(tokens, parents)
    reference = engine_for(tiny_models[family])
    for node in range(size):
        path_tokens = [tokens[i] for i in path_to(parents, node)]
        reference.prefill(prefix)
        step = reference.extend(path_tokens)
        assert (logits[node] - step.logits).abs().max() < TOL, f"node {node}"
        assert (features[node] - step.features[-1]).abs().max() < TOL


def test_verify_compacts_cache_to_the_accepted_sequence(tiny_models):
    path = tiny_models["llama-mha"]
    engine = engine_for(path)
    vocab = engine.spec.vocab_size
    prefix = random_tokens(vocab, 9, seed=3)
    engine.prefill(prefix[:-1])
    root = prefix[-1]
    # Build a tree whose deepest branch follows the target's greedy choices, hung off
    # decoy nodes so the accepted path is not the first indices.
    greedy = greedy_decode(engine_for(path), prefix, 4)
    tokens = [root, (greedy[0] + 1) % vocab, greedy[0], (greedy[1] + 5) % vocab, greedy[1], greedy[2]]
    parents = [-1, 0, 0, 2, 2, 4]
    outcome = engine.verify(tokens, parents)
    assert outcome.accepted_nodes == [0, 2, 4, 5]
    assert outcome.tokens == greedy[:4]
    assert engine.committed == len(prefix) + 3
    # Next decode (the bonus token) must equal a fresh prefill of the accepted sequence.
    after = engine.decode(outcome.tokens[-1])
    fresh = engine_for(path)
    expected = fresh.prefill(prefix + outcome.tokens)
    assert (after.logits - expected.logits).abs().max() < TOL
    # The returned features are those of the root and the accepted nodes.
    assert (outcome.features - expected.features[len(prefix) - 1:len(prefix) + 3]).abs().max() < TOL


def test_verify_random_trees_keep_decode_consistent(tiny_models):
    path = tiny_models["llama3-rope"]
    engine = engine_for(path)
    rng = random.Random(7)
    sequence = random_tokens(engine.spec.vocab_size, 6, seed=4)
    engine.prefill(sequence[:-1])
    last = sequence[-1]
    for _ in range(5):
        tokens, parents = random_tree(rng.randrange(1, 20), engine.spec.vocab_size, rng)
        tokens[0] = last
        outcome = engine.verify(tokens, parents)
        sequence += outcome.tokens
        last = outcome.tokens[-1]
    step = engine.decode(last)
    fresh = engine_for(path).prefill(sequence)
    assert engine.committed == len(sequence)
    assert (step.logits - fresh.logits).abs().max() < TOL


def test_greedy_decode_equals_transformers_generate(demo_target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo_target))
    reference = hf_model(demo_target)
    # Decode straight through </s> on both sides, so every prompt compares 64 tokens.
    reference.generation_config.eos_token_id = None
    engine = engine_for(demo_target, max_len=256)
    # Ten openings of 64 tokens (640 greedy steps; twenty took 19 s of the suite, mostly transformers' generate).
    heads = ["def ", "class ", "import ", "if __name__", "with open(", "self.", "raise ValueError(",
             "lambda x:", "async def ", "@property\n    def"]
    mismatches = []
    for prompt in heads:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                     pad_token_id=0)
        expected = out[0, len(ids):].tolist()
        assert len(expected) == 64
        got = greedy_decode(engine, ids, 64)
        if got != expected:
            mismatches.append((prompt, first_divergence_gap(reference, ids, expected, got)))
    # A divergence is only acceptable at a near-tie of the reference's top-2 logits.
    assert all(gap < 1e-4 for _, gap in mismatches), mismatches


def first_divergence_gap(reference, prompt_ids, expected, got) -> float:
    index = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt_ids + expected[:index]])).logits[0, -1]
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1])


def test_context_overflow_is_a_clear_error(tiny_models):
    engine = engine_for(tiny_models["llama-mha"], max_len=16)
    with pytest.raises(ContextOverflowError, match="exceeds the context of 16"):
        engine.prefill(list(range(3, 20)))
    engine.prefill(list(range(3, 14)))
    with pytest.raises(ContextOverflowError):
        engine.verify([5] * 8, [-1] + list(range(7)))
    # The failed call left the sequence intact.
    assert engine.committed == 11


def test_sliding_window_bounds_the_context(tmp_path):
    path = save_tiny_model(tmp_path / "mistral-small-window", "mistral", sliding_window=32)
    model = load_target_model(path)
    assert TargetEngine(model).max_len == 32
    with pytest.raises(ValueError, match="1..32"):
        TargetEngine(model, max_len=64)


def test_a_decode_step_s_rotary_rows_are_the_table_s(demo_target):
    """One position's cos/sin come out as a view of the table's row (no gather), equal to the gathered
    rows; a position past the table is an IndexError as the gather's is."""
    engine = TargetEngine(load_target_model(str(demo_target)), max_len=16)
    table = engine.rotary
    for position in (0, 7, 15):
        cos, sin = table.lookup(torch.tensor([position]))
        gathered_cos, gathered_sin = table.cos[torch.tensor([position])], table.sin[torch.tensor([position])]
        assert torch.equal(cos, gathered_cos) and torch.equal(sin, gathered_sin)
        assert cos.shape == (1, table.cos.shape[1])
        assert cos.data_ptr() == table.cos[position].data_ptr()
    with pytest.raises(IndexError):
        table.lookup(torch.tensor([16]))
    cos, _ = table.lookup(torch.tensor([3, 5, 4]))  # a tree's positions: gathered
    assert torch.equal(cos, table.cos[[3, 5, 4]])
