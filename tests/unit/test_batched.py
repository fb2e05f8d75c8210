"""Several sequences in one target forward (cpu_worker/batched.py): each sequence gets exactly the
bits it gets alone (decode steps, draft trees, sampled trees, EAGLE-3 feature rows), at every exact
precision and cache dtype; a step that does not fit is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from cpu_worker.batched import SequenceStep, can_batch, run_steps
from cpu_worker.engine import ContextOverflowError, StepOutput, TargetEngine, VerifyOutcome
from cpu_worker.native_layers import NativeLayers
from cpu_worker.sampling import Sampler
from cpu_worker.server import build_engine
from ipc import messages as m

PROMPTS = [[5, 17, 230, 41, 9, 300, 77, 12], [8, 150, 33], [64, 2, 99, 101, 102, 7, 7, 7, 7, 1, 250],
           [400, 12]]
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 5]


def tree_for(sequence: int, cycle: int, vocab: int) -> list[int]:
    return [(40 + 13 * sequence + 7 * cycle + node * 3) % vocab for node in range(len(TREE_PARENTS))]


def solo_run(engine: TargetEngine, prompt: list[int], sequence: int, cycles: int,
             sampler_seed: int | None) -> list[torch.Tensor]:
    """A prefill, then per cycle a decode step and a tree verified, one sequence alone."""
    vocab = engine.spec.vocab_size
    sampler = None if sampler_seed is None else Sampler(m.Sampling(temperature=0.9, seed=sampler_seed))
    step = engine.prefill(prompt)
    outputs: list[torch.Tensor] = []
    token = int(step.logits.argmax())
    for cycle in range(cycles):
        step = engine.decode(token)
        outputs += [step.features, step.logits]
        outcome = engine.verify(tree_for(sequence, cycle, vocab), TREE_PARENTS, sampler)
        outputs += [outcome.features, outcome.logits, torch.tensor(outcome.tokens)]
        token = outcome.tokens[-1]
    return outputs


def batched_run(engines: list[TargetEngine], cycles: int, sampler_seeds: list[int | None]) -> list[list[torch.Tensor]]:
    """The same per sequence, every sequence's decode steps in one forward and their trees in another
    (after each sequence's own prefill)."""
    vocab = engines[0].spec.vocab_size
    samplers = [None if seed is None else Sampler(m.Sampling(temperature=0.9, seed=seed)) for seed in sampler_seeds]
    tokens = [int(engine.prefill(prompt).logits.argmax()) for engine, prompt in zip(engines, PROMPTS, strict=False)]
    outputs: list[list[torch.Tensor]] = [[] for _ in engines]
    for cycle in range(cycles):
        decoded = run_steps([SequenceStep(engine, [token]) for engine, token in zip(engines, tokens, strict=True)])
        for index, result in enumerate(decoded):
            assert isinstance(result, StepOutput)
            outputs[index] += [result.features, result.logits]
        verified = run_steps([SequenceStep(engine, tree_for(index, cycle, vocab), TREE_PARENTS, samplers[index])
                              for index, engine in enumerate(engines)])
        for index, result in enumerate(verified):
            assert isinstance(result, VerifyOutcome)
            outputs[index] += [result.features, result.logits, torch.tensor(result.tokens)]
            tokens[index] = result.tokens[-1]
    return outputs


def assert_same_bits(left: list[torch.Tensor], right: list[torch.Tensor]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b), (a - b).abs().max() if a.is_floating_point() else (a, b)


@pytest.mark.parametrize(("precision", "kv_dtype"), [("fp32", "fp32"), ("int8", "bf16"), ("q4_0", "fp32"),
                                                     ("q4_1-a16", "bf16"), ("int8-row", "fp32")])
@pytest.mark.parametrize("batched_layers", ["native", "python"])
def test_each_sequence_gets_its_solo_bits(demo_target, precision, kv_dtype, batched_layers):
    """Solo runs on the engine's own path (the native loop); the batched ones on the native loop's
    segments or on the Python layers."""
    engine, _ = build_engine(str(demo_target), precision, 128, kv_dtype)
    assert engine.exact_tree
    loop = engine.model.layer_loop
    assert isinstance(loop, NativeLayers)
    cycles, seeds = 3, [None, 11, None, 12]
    expected = [solo_run(engine.sibling(), prompt, index, cycles, seeds[index]) for index, prompt in enumerate(PROMPTS)]
    engines = [engine.sibling() for _ in PROMPTS]
    assert can_batch([SequenceStep(one, [1]) for one in engines])
    calls = []
    if batched_layers == "python":
        engine.model.layer_loop = None
    else:
        original = loop.run_segments
        loop.run_segments = lambda x, cos, sin, segments, *args: calls.append(len(segments)) or original(  # type: ignore[method-assign]
            x, cos, sin, segments, *args)
    for solo, together in zip(expected, batched_run(engines, cycles, seeds), strict=True):
        assert_same_bits(solo, together)
    if batched_layers == "native":  # prefills of one segment (int8's), then 2 batched forwards of 4 per cycle
        assert calls.count(len(PROMPTS)) == 2 * cycles


LONG_PROMPT = [(31 * index) % 900 + 20 for index in range(100)]
CHUNKS = [16, 1, 80, 3]


@pytest.mark.parametrize(("precision", "kv_dtype"), [("fp32", "fp32"), ("int8", "bf16"), ("q4_0", "fp32"),
                                                     ("q4_1-a16", "bf16"), ("int8-row", "fp32")])
def test_a_prompt_chunk_shares_the_steps_forward_and_keeps_its_solo_prefill_bits(demo_target, precision, kv_dtype,
                                                                                 monkeypatch):
    """Each chunk of a long prompt beside another sequence's decode step and a third's tree: every
    one gets its solo bits, and the chunk's rows ride in the same forward unless its own prefill
    takes a GEMM of its own (fp32 from 64 rows), where it runs apart. A chunk-invariant engine's
    forwards take the native layer loop (the chunk attending causally there), the others' the Python layers."""
    import cpu_worker.batched as batched

    engine, _ = build_engine(str(demo_target), precision, 256, kv_dtype)
    loop = engine.model.layer_loop
    assert isinstance(loop, NativeLayers)
    native_rows: list[int] = []  # the rows of each C loop call a batched forward makes
    in_batch = [False]
    original = loop.run_segments
    loop.run_segments = lambda x, *args: (in_batch[0] and native_rows.append(x.shape[1])) or original(x, *args)  # type: ignore[method-assign]
    vocab = engine.spec.vocab_size
    solo, lone_decoder, lone_verifier = engine.sibling(), engine.sibling(), engine.sibling()
    chunked, decoder, verifier = engine.sibling(), engine.sibling(), engine.sibling()
    for one, prompt in ((lone_decoder, PROMPTS[0]), (decoder, PROMPTS[0]), (lone_verifier, PROMPTS[1]),
                        (verifier, PROMPTS[1])):
        one.prefill(prompt)
    rows: list[int] = []
    forward = batched._forward

    def counted_forward(steps, positions):
        rows.append(sum(len(step.tokens) for step in steps))
        in_batch[0] = True
        try:
            return forward(steps, positions)
        finally:
            in_batch[0] = False

    monkeypatch.setattr(batched, "_forward", counted_forward)
    token, offset = 7, 0
    for cycle, size in enumerate(CHUNKS):
        chunk = LONG_PROMPT[offset:offset + size]
        tree = tree_for(1, cycle, vocab)
        expected = [solo.prefill(chunk, offset), lone_decoder.decode(token), lone_verifier.verify(tree, TREE_PARENTS)]
        got = run_steps([SequenceStep(decoder, [token]), SequenceStep(chunked, chunk, prompt=True),
                         SequenceStep(verifier, tree, TREE_PARENTS)])
        decoded, prefilled, verified = got
        assert isinstance(prefilled, StepOutput) and isinstance(decoded, StepOutput)
        assert isinstance(verified, VerifyOutcome) and isinstance(expected[2], VerifyOutcome)
        assert_same_bits([expected[0].features, expected[0].logits, expected[1].features, expected[1].logits,
                          expected[2].features, expected[2].logits, torch.tensor(expected[2].tokens)],
                         [prefilled.features, prefilled.logits, decoded.features, decoded.logits,
                          verified.features, verified.logits, torch.tensor(verified.tokens)])
        offset += size
        assert chunked.committed == offset
        token = int(decoded.logits.argmax())
    apart = precision == "fp32"  # 80 rows: its own prefill's GEMM
    assert rows == [1 + 16 + 7, 1 + 1 + 7, 1 + (0 if apart else 80) + 7, 1 + 3 + 7]
    # The batched forwards through the C loop (one call each, no aux layers): with their chunk where
    # the engine is chunk-invariant; at fp32 only the round whose chunk ran apart.
    assert native_rows == (rows if engine.chunk_invariant else [1 + 7])
    assert engine.chunk_invariant == (precision != "fp32")
    # The chunks' cache rows: a decode after the whole prompt reads them all.
    after_solo, after_chunks = solo.decode(token), chunked.decode(token)
    assert_same_bits([after_solo.features, after_solo.logits], [after_chunks.features, after_chunks.logits])


def test_eagle3_feature_rows_are_each_sequences_own(demo_target):
    engine, _ = build_engine(str(demo_target), "int8", 128, "fp32", aux_layers=[0, 1, 2])
    expected = [solo_run(engine.sibling(), prompt, index, 2, None) for index, prompt in enumerate(PROMPTS[:3])]
    together = batched_run([engine.sibling() for _ in PROMPTS[:3]], 2, [None] * 3)
    assert together[0][0].shape[-1] == 3 * engine.spec.hidden_size
    for solo, mine in zip(expected, together, strict=True):
        assert_same_bits(solo, mine)


def test_a_lone_sequence_and_a_repeated_one_run_alone(demo_target):
    engine, _ = build_engine(str(demo_target), "int8", 64, "fp32")
    one, two = engine.sibling(), engine.sibling()
    assert not can_batch([SequenceStep(one, [1]), SequenceStep(one, [2])])  # one cache cannot take both
    assert can_batch([SequenceStep(one, [1]), SequenceStep(two, [2])])
    one.prefill([3, 4, 5])
    two.prefill([3, 4, 5])
    (alone,) = run_steps([SequenceStep(one, [6])])
    assert isinstance(alone, StepOutput) and one.committed == 4
    assert torch.equal(alone.logits, two.decode(6).logits)


def test_a_step_that_does_not_fit_is_refused_before_anything_runs(demo_target):
    engine, _ = build_engine(str(demo_target), "int8", 16, "fp32")
    full, other = engine.sibling(), engine.sibling()
    full.prefill(list(range(1, 13)))
    other.prefill([1, 2, 3])
    steps = [SequenceStep(other, [4]), SequenceStep(full, [5, 6, 7, 8, 9], [-1, 0, 1, 2, 3])]
    with pytest.raises(ContextOverflowError):
        steps[1].check()
    with pytest.raises(ContextOverflowError):
        run_steps(steps)
    assert (full.committed, other.committed) == (12, 3)
    with pytest.raises(ValueError, match="one token"):
        SequenceStep(other, [4, 5]).check()


def test_the_benchmark_prints_a_row_per_sequence_count(demo_target):
    from click.testing import CliRunner

    from tools.bench_batched_step import main

    result = CliRunner().invoke(main, ["--target", str(demo_target), "--precision", "int8", "--sequences", "1,3",
                                       "--repeats", "3"])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "3"] and all(row.endswith("x |") for row in rows)


def test_a_chunk_that_would_push_a_call_past_the_row_kernel_runs_apart(demo_target, monkeypatch):
    """fp32's row kernel hands calls of more than MAX_KERNEL_ROWS rows to F.linear (other bits for
    every row): a chunk that would take the shared call there runs on its own."""
    import cpu_worker.batched as batched
    from cpu_worker.kernels.fp32_rows import MAX_KERNEL_ROWS

    engine, _ = build_engine(str(demo_target), "fp32", 1200, "fp32")
    chunked, solo, decoder, verifier = (engine.sibling() for _ in range(4))
    for one in (decoder, verifier):
        one.prefill(PROMPTS[0])
    rows: list[int] = []
    forward = batched._forward
    monkeypatch.setattr(batched, "_forward", lambda steps, positions: rows.append(
        sum(len(step.tokens) for step in steps)) or forward(steps, positions))
    star = MAX_KERNEL_ROWS - 34  # a wide tree: with a decode step and a 40-row chunk, past the limit
    parents = [-1] + [0] * (star - 1)
    tree = [(5 + node) % engine.spec.vocab_size for node in range(star)]
    _, prefilled, _ = run_steps([SequenceStep(decoder, [7]), SequenceStep(chunked, LONG_PROMPT[:40], prompt=True),
                                 SequenceStep(verifier, tree, parents)])
    assert rows == [1 + star]
    expected = solo.prefill(LONG_PROMPT[:40])
    assert isinstance(prefilled, StepOutput)
    assert_same_bits([expected.features, expected.logits], [prefilled.features, prefilled.logits])
