"""tools/quant_reference rounds as llama.cpp's reference quantizers do (the gguf package's copy of
them is the oracle), and the quality benchmark's small measures say what they claim."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from tools import quant_reference
from tools.bench_quality import SCORED, common_prefix, ends_in_loop, window_figures


def awkward_rows(seed: int = 0) -> np.ndarray:
    """Rows of very different scales, a zero block, a constant block and exact ties."""
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((24, 256)) * rng.exponential(1.0, (24, 1))).astype(np.float32)
    rows[0, :32] = 0.0
    rows[1, 32:64] = 0.75
    rows[2, :32] = np.linspace(-1.0, 1.0, 32, dtype=np.float32)
    rows[3, :4] = [-3.0, 3.0, -3.0, 3.0]
    rows[4, :32] = 0.0
    rows[4, :6] = [127.0, 40.5, -2.5, 0.5, -0.5, 1.5]  # Q8_0's d = 1: exact halves, which roundf takes away from 0
    return rows


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1"])
def test_block_formats_equal_the_gguf_reference(name):
    rows = awkward_rows()
    kind = getattr(GGMLQuantizationType, name.upper())
    expected = quants.dequantize(quants.quantize(rows, kind), kind)
    ours = getattr(quant_reference, name)(torch.from_numpy(rows)).numpy()
    np.testing.assert_array_equal(ours, expected)


def test_a_width_off_the_block_is_refused():
    with pytest.raises(ValueError, match="multiple of the block"):
        quant_reference.q8_0(torch.ones(2, 40))


def test_int8_per_row_keeps_each_rows_maximum_and_127_levels():
    rows = torch.from_numpy(awkward_rows(1))
    rounded = quant_reference.int8_per_row(rows)
    torch.testing.assert_close(rounded.abs().amax(-1), rows.abs().amax(-1))
    steps = rounded / (rows.abs().amax(-1, keepdim=True) / 127)
    torch.testing.assert_close(steps, steps.round())


def test_a_formatted_model_rounds_its_weights_and_inputs():
    linear = torch.nn.Linear(64, 8, bias=True)
    model = torch.nn.Sequential(linear)
    x = torch.randn(3, 64)
    expected = torch.nn.functional.linear(quant_reference.q8_0(x), quant_reference.q4_0(linear.weight.detach()),
                                          linear.bias.detach())
    quant_reference.apply_format(model, quant_reference.FORMATS["q4_0"])
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_loops_and_prefixes():
    assert ends_in_loop([5, 6, 1, 2, 1, 2, 1, 2])
    assert ends_in_loop([3, 9, 9, 9])
    assert not ends_in_loop([1, 2, 3, 4, 5, 6, 1, 2])
    assert not ends_in_loop([1, 2, 1, 2, 7])
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0


def test_window_figures_score_only_the_positions_asked_for():
    """--scored second-half averages what llama-perplexity scores: a window whose first half alone
    differs from the reference scores as a perfect match there, and half right over every position."""
    torch.manual_seed(0)
    base = torch.log_softmax(torch.randn(8, 50), dim=-1)
    other = base.clone()
    other[:4] = torch.log_softmax(torch.randn(4, 50) * 4, dim=-1)  # the first half: another distribution
    other[:4, base[:4].argmax(-1)] = -1e4  # whose top token is never the reference's
    agreement, divergence = window_figures(other, base, int(SCORED["second-half"] * 8))
    assert agreement == 1.0 and abs(divergence) < 1e-6
    agreement, divergence = window_figures(other, base, int(SCORED["all"] * 8))
    first_half_kl = (base[:4].exp() * (base[:4] - other[:4])).sum(-1).mean().item()
    assert agreement == 0.5 and divergence == pytest.approx(first_half_kl / 2, rel=1e-5) and divergence > 0.1
