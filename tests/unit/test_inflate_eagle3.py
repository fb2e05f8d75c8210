"""tools/inflate_eagle3.py: an EAGLE-3 head inflated to a stand-in shape computes what the small one does.

Uses the shared testbed's inflate.py (its geometry), which sits beside the repo (../shared/testbed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from click.testing import CliRunner

from cpu_worker.model.llama import LlamaSpec, RotaryTable
from dovetail_runtime.demo_models import SMOLLM2_DRAFT
from gpu_worker.eagle3 import Eagle3Head
from tools import inflate_eagle3

from conftest import DEMO_TARGET

if not inflate_eagle3.INFLATE.is_file():  # the testbed is part of this workplace, not of the repo
    pytest.skip(f"needs the shared testbed's {inflate_eagle3.INFLATE}", allow_module_level=True)

SMALL = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "intermediate_size": 48, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "vocab_size": 50, "max_position_embeddings": 128}


def small_head(fusion: str) -> Eagle3Head:
    torch.manual_seed(0)
    spec = LlamaSpec(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128)
    head = Eagle3Head(spec, target_hidden_size=32, draft_vocab_size=20, fusion=fusion)
    with torch.no_grad():
        for _, parameter in head.named_parameters():
            parameter.normal_(0, 0.3)
    head.set_draft_vocab(torch.arange(7, 27))
    return head.eval()


def inflated_head(small: Eagle3Head, geo) -> Eagle3Head:
    config = geo.config(SMALL, 1)
    spec = dataclasses.replace(small.spec, hidden_size=geo.H, num_heads=geo.nh, num_kv_heads=geo.nkv, head_dim=geo.hd,
                               intermediate_size=geo.inter, rms_norm_eps=config["rms_norm_eps"],
                               rope_theta=config["rope_theta"])
    big = Eagle3Head(spec, target_hidden_size=geo.H, draft_vocab_size=20, fusion=small.fusion)
    files = {name: tensor for name, tensor in small.file_state_dict().items() if name not in ("d2t", "t2d")}
    state = inflate_eagle3.inflate_eagle3_weights(geo, files)
    embed = torch.zeros(50, geo.H)
    embed[:, :geo.h] = small.embed_tokens.weight  # the inflated target's embedding: zero-padded
    big.load_state_dict(state | {"d2t": small.d2t, "t2d": small.t2d, "embed_tokens.weight": embed})
    return big.eval()


@pytest.mark.parametrize("fusion", ["eagle3", "dgf-eagle3"])
def test_an_inflated_head_drafts_what_the_small_one_drafts(fusion):
    geo = inflate_eagle3.inflate_module().Geometry(SMALL, "tiny-1k")
    small = small_head(fusion)
    big = inflated_head(small, geo)
    h, H, n = geo.h, geo.H, 7
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(n, 3 * h, generator=gen)
    big_rows = torch.zeros(n, 3 * H)
    for j in range(3):  # the inflated target's three residual streams, each zero-padded
        big_rows[:, j * H:j * H + h] = rows[:, j * h:(j + 1) * h]
    tokens = torch.randint(0, 50, (n,), generator=gen)
    outputs = []
    for head, features in ((small, rows), (big, big_rows)):
        table = RotaryTable(head.spec, 16, torch.float32)
        cache = head.new_cache(16, torch.float32)
        with torch.inference_mode():
            committed = head(features, tokens, table.cos[:n], table.sin[:n], cache, 0, None)
            # One tree level: two nodes fed the last output, attending the prefix and themselves.
            mask = torch.ones(2, n + 2, dtype=torch.bool)
            mask[0, n + 1] = mask[1, n] = False
            level = head(committed[-1:].expand(2, -1), torch.tensor([3, 9]), table.cos[n].expand(2, -1),
                         table.sin[n].expand(2, -1), cache, n, mask)
            outputs.append((committed, level, head.log_probs(level)))
    (small_out, small_level, small_lp), (big_out, big_level, big_lp) = outputs
    torch.testing.assert_close(big_out[:, :h], small_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(big_level[:, :h], small_level, rtol=1e-4, atol=1e-5)
    assert not big_out[:, h:].any() and not big_level[:, h:].any()  # padded dims stay exactly zero
    torch.testing.assert_close(big_lp, small_lp, rtol=1e-4, atol=1e-4)
    assert torch.equal(big_lp.argmax(-1), small_lp.argmax(-1))


@pytest.mark.parametrize(("target_src", "says"), [
    (DEMO_TARGET, f"reads a target of hidden size 576; {DEMO_TARGET} has 256"),
    (DEMO_TARGET.parent, f"{DEMO_TARGET.parent} has no config.json: not a model folder"),
])
def test_a_target_the_head_was_not_trained_for_is_named(tmp_path, target_src, says):
    """demo/draft-smollm2 with --target-src demo/target-code-9m died in a RuntimeError about expanded
    sizes, and a folder without a config.json in a FileNotFoundError: tracebacks both."""
    result = CliRunner().invoke(inflate_eagle3.main, [str(SMOLLM2_DRAFT), str(tmp_path / "out"), "--target-src",
                                                      str(target_src), "--shape", "tiny-1k"])
    assert result.exit_code == 1, result.output
    assert says in result.output
    assert not (tmp_path / "out").exists()
