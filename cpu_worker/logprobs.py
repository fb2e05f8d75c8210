"""Log-probabilities of emitted tokens from the target's own logits (OpenAI's ``logprobs``).

Each row goes through log_softmax on its own, in fp32, at temperature 1 and before top-k/top-p:
the model's distribution, as OpenAI and vLLM report it. A tree row's logits are the bits a decode
step gives for that position (the kernels are row-invariant), and a row alone always takes the
same path through log_softmax, so dovetail reports exactly ``--mode ar``'s numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ipc.messages import TokenLogprob


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under one row of logits [vocab], with the ``top`` likeliest
    tokens (ties: the lower id first, as topk's sorted order is not specified for ties)."""
    logprobs = torch.log_softmax(logits.reshape(-1).float(), dim=-1)
    if top <= 0:
        return TokenLogprob(logprob=float(logprobs[token]))
    values, ids = logprobs.topk(min(top, logprobs.numel()))
    pairs = sorted(zip(values.tolist(), ids.tolist(), strict=True), key=lambda pair: (-pair[0], pair[1]))
    return TokenLogprob(logprob=float(logprobs[token]), top_ids=[token_id for _, token_id in pairs],
                        top_logprobs=[value for value, _ in pairs])


def path_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """One TokenLogprob per emitted token: ``tokens[i]`` under ``logits[rows[i]]``."""
    return [token_logprob(logits[row], token, top) for row, token in zip(rows, tokens, strict=True)]
