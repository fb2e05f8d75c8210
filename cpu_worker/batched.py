"""Several sequences' steps in one target forward: decode steps and draft trees of different
requests share every linear layer's pass over the weights, each row attending only to its own
sequence's cache.

Why: decoding is memory-bound, so a pass over the weights with a few more rows costs little more
than with one (docs/performance.md), and several users' steps cost about what one user's step
costs. It stays exact: the linear layers of an exact engine give a row the same bits whatever
else shares the call (``kernels.linear.row_invariant_linears``), norms, rotary and the MLP's
activation are row by row, and each sequence's rows attend in their own call over their own
cache, as that sequence alone would. So every request gets exactly the tokens it would get
alone (``tests/unit/test_batched.py``). An engine whose linears are not exact (F.linear, without a C compiler)
runs its steps one by one instead.

A new sequence's prompt chunk rides along (vLLM's chunked prefill, exactly): its rows take the
same linear calls, attend causally over their own cache with the call their own prefill makes,
and only its last row is scored; a chunk whose own prefill takes a GEMM of its own (fp32 from
``PROMPT_GEMM_ROWS`` rows) runs apart, as the bits of that GEMM depend on its row count.

The batched pass takes the engine's native layer loop (``native_layers``: every layer in one foreign
call, each sequence's rows attending over its own cache there) where the model has one, and the
Python layers otherwise; both give the same bits. A prompt chunk rides in the loop, attending
causally (``native_layers.Causal``) where its engine is chunk-invariant, and sends the pass to the Python layers
elsewhere (there its prefill attends with torch's kernel): at a 135M target, a round of two decode
steps took 5 ms, 13 ms with a one-row chunk on the Python layers, 7 ms in the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpu_worker.engine import StepOutput, TargetEngine, VerifyOutcome, tree_paths
from cpu_worker.kernels.exact_attention import TreePaths
from cpu_worker.kernels.fp32_rows import MAX_KERNEL_ROWS
from cpu_worker.model.llama import CacheSegment, DecoderLayer, LlamaDecoder
from cpu_worker.native_layers import Causal, NativeLayers
from cpu_worker.sampling import Sampler


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's part of a batched forward: a decode step (``parents`` None: one token,
    appended to the sequence), a draft tree to verify (``parents`` as ``TargetEngine.verify``
    takes them; ``sampler`` picks at its nodes, greedy when None), or with ``prompt`` a chunk of
    its prompt (``TargetEngine.prefill``'s rows: appended, each attending causally)."""

    engine: TargetEngine
    tokens: Sequence[int]
    parents: Sequence[int] | None = None
    sampler: Sampler | None = None
    prompt: bool = False
    # A chunk that runs apart may run in parts of about this many ms (``TargetEngine.prefill_part``;
    # 0: whole), or go on with the part way one (``resume``): its outcome is then None until done.
    budget_ms: float = 0.0
    resume: bool = False

    def check(self) -> torch.Tensor:
        """The rows' positions, once the step is checked to fit its sequence (ValueError,
        ``ContextOverflowError``: nothing has been written yet)."""
        engine = self.engine
        if self.prompt:
            if not self.tokens:
                raise ValueError("a prompt chunk needs at least one token")
            engine._check_room(len(self.tokens))
            return torch.arange(engine.committed, engine.committed + len(self.tokens))
        if self.parents is None:
            if len(self.tokens) != 1:
                raise ValueError(f"a decode step takes one token, got {len(self.tokens)}")
            engine._check_room(1)
            return torch.tensor([engine.committed])
        return engine.tree_positions(self.tokens, self.parents)

    @property
    def shares_forward(self) -> bool:
        """Whether this step may share a forward with others and keep its bits: a prompt chunk only
        below the rows where its own prefill takes a GEMM of its own (fp32), and not part way
        through its layers already."""
        limit = self.engine.prompt_gemm_rows
        return not self.prompt or (not self.resume and (limit is None or len(self.tokens) < limit))


def can_batch(steps: Sequence[SequenceStep]) -> bool:
    """Whether these steps may share one forward and keep their bits: distinct sequences of one
    model, on exact trees (every linear row-invariant, exact attention)."""
    engines = [step.engine for step in steps]
    model = engines[0].model
    return (len({id(engine) for engine in engines}) == len(engines)
            and all(engine.model is model and engine.exact_tree for engine in engines)
            and all(engine.aux_layers == engines[0].aux_layers for engine in engines))


def run_steps(steps: Sequence[SequenceStep]) -> list[StepOutput | VerifyOutcome | None]:
    """Every step, in one forward where ``can_batch`` allows (else one by one): a decode step's
    ``StepOutput`` (its sequence one token longer) or a tree's ``VerifyOutcome`` (its accepted
    path kept), in the steps' order (None: a chunk run apart in parts, with layers left). Every
    step is checked first (``SequenceStep.check``): one that does not fit its sequence raises
    before anything is computed or written; a caller that wants to run the others checks each
    itself and leaves it out."""
    positions = [step.check() for step in steps]
    together = [index for index, step in enumerate(steps) if step.shares_forward]
    if sum(len(steps[index].tokens) for index in together) > MAX_KERNEL_ROWS:
        # Past the fp32 row kernel's rows every row would take F.linear: a chunk runs apart instead.
        together = [index for index in together if not steps[index].prompt]
    if len(together) <= 1 or not can_batch([steps[index] for index in together]):
        return [_run_alone(step) for step in steps]
    outcomes: dict[int, StepOutput | VerifyOutcome | None] = {
        index: _run_alone(step) for index, step in enumerate(steps) if index not in together}
    batched = _run_together([steps[index] for index in together], [positions[index] for index in together])
    outcomes.update(zip(together, batched, strict=True))
    return [outcomes[index] for index in range(len(steps))]


def _run_together(steps: Sequence[SequenceStep], positions: Sequence[torch.Tensor]) -> list[StepOutput | VerifyOutcome]:
    features, logits = _forward(steps, positions)
    results: list[StepOutput | VerifyOutcome] = []
    row = scored = 0  # scored: the logits rows so far
    for step in steps:
        end = row + len(step.tokens)
        engine = step.engine
        if step.prompt:
            engine.committed += len(step.tokens)
            results.append(StepOutput(features=features[row:end], logits=logits[scored]))
            scored += 1
        elif step.parents is None:
            engine.committed += 1
            results.append(StepOutput(features=features[row:end], logits=logits[scored]))
            scored += 1
        else:
            results.append(engine.accept_tree(step.tokens, step.parents, features[row:end],
                                              logits[scored:scored + len(step.tokens)], step.sampler))
            scored += len(step.tokens)
        row = end
    return results


def _run_alone(step: SequenceStep) -> StepOutput | VerifyOutcome | None:
    engine = step.engine
    if step.prompt:  # whole, or in parts of its layers (``TargetEngine.prefill_part``)
        return engine.prefill_part(step.tokens, engine.committed, step.budget_ms, step.resume)
    if step.parents is None:
        return engine.decode(int(step.tokens[0]))
    return engine.verify(step.tokens, step.parents, step.sampler)


@torch.inference_mode()
def _forward(steps: Sequence[SequenceStep], positions: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """features [N, feature_size] for every step's rows, in order, and fp32 logits for the rows that
    need them: every row of a decode step or tree, a prompt chunk's last."""
    lead = steps[0].engine
    model: LlamaDecoder = lead.model
    tokens = torch.as_tensor([int(token) for step in steps for token in step.tokens], dtype=torch.long)
    cos, sin = lead.rotary.lookup(torch.cat(list(positions)))
    bounds: list[tuple[int, int]] = []
    row = 0
    for step in steps:
        bounds.append((row, row + len(step.tokens)))
        row += len(step.tokens)
    trees = [None if step.parents is None else TreePaths.from_paths(tree_paths(step.parents)) for step in steps]
    aux_layers = lead.aux_layers or ()
    x = model.embed_tokens(tokens).unsqueeze(0)
    streams: list[torch.Tensor] = []
    loop = model.layer_loop
    # The C loop takes decode steps, trees and a chunk-invariant engine's prompt chunk (attending
    # causally, as its own prefill does there); any other chunk attends on the Python layers, as its
    # own prefill does (the two paths give decode and tree rows the same bits).
    with_prompt = any(step.prompt for step in steps)
    if isinstance(loop, NativeLayers) and _loop_applies(loop, x, steps) and (not with_prompt or loop.causal_prompts()):
        # As LlamaDecoder.forward: every layer in one foreign call, the aux layers' streams copied out.
        segments = [(step.engine.cache, step.engine.committed, Causal(len(step.tokens)) if step.prompt else paths)
                    for step, paths in zip(steps, trees, strict=True)]
        x = loop.run_segments(x, cos, sin, segments, 0, len(model.layers), streams, aux_layers)
    else:
        by_sequence = [CacheSegment(step.engine.cache, step.engine.committed, begin, end, paths=paths)
                       for step, (begin, end), paths in zip(steps, bounds, trees, strict=True)]
        for index, layer in enumerate(model.layers):
            assert isinstance(layer, DecoderLayer)  # a target's layers are
            if index in aux_layers:
                streams.append(x)
            # DecoderLayer.forward's two residual steps, the attention split by sequence.
            x = x + layer.self_attn.forward_segments(layer.input_layernorm(x), cos, sin, by_sequence, index)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
    features = model.norm(x)[0]
    if with_prompt:  # a prompt chunk needs its last row's logits only, as its own prefill computes them
        wanted = [row for step, (begin, end) in zip(steps, bounds, strict=True)
                  for row in ([end - 1] if step.prompt else range(begin, end))]
        logits = model.lm_head(features[torch.tensor(wanted)])
    else:
        logits = model.lm_head(features)
    if aux_layers:
        features = torch.cat(streams, dim=-1)[0]
    return features, logits.float()


def _loop_applies(loop: NativeLayers, x: torch.Tensor, steps: Sequence[SequenceStep]) -> bool:
    caches = [step.engine.cache for step in steps]
    return (x.shape[1] <= loop.max_rows and x.dtype == torch.float32 and x.device.type == "cpu"
            and all(loop.cache_qualifies(cache) for cache in caches)
            and len({(cache.max_len, cache.keys.dtype) for cache in caches}) == 1)

