"""A prompt chunk run through the target's layers in parts, a few layers per call.

Why: a target whose prompt bits depend on how the prompt is cut (fp32's and bf16's prompt GEMM) must
prefill a prompt in the same chunks however busy the server is (``--prefill-chunk``), and a
chunk of 256 rows runs apart from the others' steps (``cpu_worker.batched``): while one joins,
every running stream waited out the whole chunk each round (a 135M fp32 target: ~0.5 s gaps
between tokens where a cycle is ~15 ms). Cut by layers instead of rows, the chunk keeps its bits:
each layer's calls are exactly the ones its whole prefill makes (the same rows, the same GEMM),
only spread over several rounds, each part as long as about one of the others' cycles.

The sequence's KV rows of the layers done are written; ``committed`` moves only once every layer
has run, and nothing else may touch the sequence meanwhile (the cpu_worker refuses its steps until
its prompt is complete).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cpu_worker.kernels.fp32_rows import prompt_rows

if TYPE_CHECKING:
    from cpu_worker.engine import StepOutput, TargetEngine


@dataclass
class PendingChunk:
    """A chunk's state between two parts: the residual stream after ``layers_done`` layers."""

    tokens: list[int]
    offset: int
    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    streams: list[torch.Tensor] = field(default_factory=list)  # aux layers' inputs so far (EAGLE-3 rows)
    layers_done: int = 0

    @classmethod
    @torch.inference_mode()
    def start(cls, engine: TargetEngine, token_ids: Sequence[int], offset: int) -> PendingChunk:
        """A chunk about to run: checked as ``TargetEngine.prefill`` checks it, embedded, no layer run."""
        if len(token_ids) == 0:
            raise ValueError("prefill needs at least one token")
        if offset == 0:
            engine.reset()
        elif offset != engine.committed:
            raise ValueError(f"a prompt chunk at offset {offset}, but the sequence holds {engine.committed} tokens")
        engine._check_room(len(token_ids))
        positions = torch.arange(engine.committed, engine.committed + len(token_ids))
        cos, sin = engine.rotary.lookup(positions)
        tokens = [int(token) for token in token_ids]
        x = engine.model.embed_tokens(torch.as_tensor(tokens, dtype=torch.long)).unsqueeze(0)
        return cls(tokens, offset, x, cos, sin)

    @torch.inference_mode()
    def advance(self, engine: TargetEngine, budget_ms: float) -> StepOutput | None:
        """Run layers until about ``budget_ms`` have passed (at least one; all when it is 0): the
        chunk's StepOutput once the last has run (the sequence is then ``len(tokens)`` longer), else None."""
        from cpu_worker.engine import StepOutput

        model = engine.model
        total = len(model.layers)
        started = time.perf_counter()
        first = self.layers_done
        with prompt_rows():
            while self.layers_done < total:
                end = total if budget_ms <= 0 else self.layers_done + 1
                self.x = model.run_layers(self.x, self.cos, self.sin, engine.cache, engine.committed, None, None,
                                          engine.aux_layers, self.streams, self.layers_done, end)
                self.layers_done = end
                spent = (time.perf_counter() - started) * 1e3
                # Stop where one more layer (at the average so far) would overrun the budget.
                if budget_ms > 0 and spent * (end - first + 1) / (end - first) > budget_ms:
                    break
            if self.layers_done < total:
                return None
            count = len(self.tokens)
            features, logits = model.finish(self.x, self.streams, slice(count - 1, count), engine.aux_layers)
        engine.committed += count
        return StepOutput(features=features, logits=logits[0].float())
