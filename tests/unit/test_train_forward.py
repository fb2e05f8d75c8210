"""The batched training forward of gpu_worker.train equals the inference path (DraftHead with a KV
cache, as the Drafter runs it) on the same pairs, in fp32; so does the batched cache-free
DecoderLayer it is built on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpu_worker.model.llama import DecoderLayer, KVCache, LlamaSpec, RotaryTable
from gpu_worker.drafter import Drafter
from gpu_worker.head import DraftHead
from gpu_worker.train.forward import train_forward

SPEC = LlamaSpec(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=4,
                 head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256)


def make_head(fusion: str, kv_heads: int, layers: int = 2) -> DraftHead:
    torch.manual_seed(0)
    head = DraftHead(dataclasses.replace(SPEC, num_kv_heads=kv_heads, num_layers=layers), fusion=fusion)
    with torch.no_grad():  # non-trivial norms and fc bias, so every module counts
        for name, param in head.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.3)
    return head.eval()


def cached_forward(head: DraftHead, features: torch.Tensor, tokens: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """The inference path: consecutive chunks through DraftHead.forward with one KV cache."""
    spec = head.spec
    length = tokens.shape[0]
    cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, length, torch.float32)
    rotary = RotaryTable(spec, length, torch.float32)
    outs, start = [], 0
    for size in chunks:
        end = start + size
        outs.append(head(features[start:end], tokens[start:end], rotary.cos[start:end], rotary.sin[start:end],
                         cache, start, None))
        start = end
    return torch.cat(outs)


@pytest.mark.parametrize("fusion,kv_heads", [("dgf", 4), ("fc", 4), ("dgf", 2), ("fc", 1)])
def test_training_forward_equals_cached_inference(fusion, kv_heads):
    head = make_head(fusion, kv_heads)
    torch.manual_seed(1)
    lengths = [23, 17, 9]
    batch = len(lengths)
    size = max(lengths)
    features = torch.randn(batch, size, SPEC.hidden_size) * 1.5
    tokens = torch.randint(0, SPEC.vocab_size, (batch, size))
    for row, length in enumerate(lengths):  # end padding must not touch the real positions
        features[row, length:] = 1e3
        tokens[row, length:] = 0
    with torch.no_grad():
        batched = train_forward(head, features, tokens)
        for row, length in enumerate(lengths):
            whole = cached_forward(head, features[row, :length], tokens[row, :length], [length])
            pieces = cached_forward(head, features[row, :length], tokens[row, :length], [5, 1, length - 6])
            torch.testing.assert_close(batched[row, :length], whole, rtol=0, atol=1e-5)
            torch.testing.assert_close(batched[row, :length], pieces, rtol=0, atol=1e-5)


def test_training_forward_equals_drafter_root_prediction():
    """What the Drafter keeps after extend (the predicted feature and log-probs scoring the
    root's children) is the training forward's last output."""
    head = make_head("dgf", 4)
    torch.manual_seed(2)
    features = torch.randn(12, SPEC.hidden_size)
    tokens = torch.randint(0, SPEC.vocab_size, (12,))
    drafter = Drafter(head, max_len=32)
    drafter.extend(features[:7], tokens[:7])
    drafter.extend(features[7:], tokens[7:])
    with torch.no_grad():
        out = train_forward(head, features[None], tokens[None])[0]
    torch.testing.assert_close(drafter._root_feature, out[-1], rtol=0, atol=1e-5)
    torch.testing.assert_close(drafter._root_log_probs, head.log_probs(out[-1:])[0], rtol=0, atol=1e-5)


def test_training_forward_has_gradients_for_trainable_weights_only():
    head = make_head("fc", 4, layers=1).train()
    features = torch.randn(2, 6, SPEC.hidden_size)
    tokens = torch.randint(0, SPEC.vocab_size, (2, 6))
    train_forward(head, features, tokens).pow(2).mean().backward()
    assert head.embed_tokens.weight.grad is None and head.lm_head.weight.grad is None
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)


@pytest.mark.parametrize("kv_heads,input_norm", [(4, True), (2, False), (1, True)])
def test_batched_layer_without_cache_equals_per_row_cached_layer(kv_heads, input_norm):
    """DecoderLayer on [B, S] rows with no cache == each row alone through a KV cache, whether
    prefilled at once or continued in chunks (the engine's and drafter's path)."""
    spec = dataclasses.replace(SPEC, num_kv_heads=kv_heads, num_layers=1)
    torch.manual_seed(3)
    layer = DecoderLayer(spec, input_norm=input_norm).eval()
    lengths = [19, 11, 1]
    size = max(lengths)
    rotary = RotaryTable(spec, size, torch.float32)
    x = torch.randn(len(lengths), size, spec.hidden_size)
    for row, length in enumerate(lengths):
        x[row, length:] = 1e3  # end padding
    with torch.no_grad():
        batched = layer(x, rotary.cos, rotary.sin)
        for row, length in enumerate(lengths):
            for chunks in ([length], [1] * min(length, 3) + [length - min(length, 3)]):
                cache = KVCache(1, spec.num_kv_heads, spec.head_dim, size, torch.float32)
                outs, start = [], 0
                for chunk in (c for c in chunks if c):
                    end = start + chunk
                    outs.append(layer(x[row:row + 1, start:end], rotary.cos[start:end], rotary.sin[start:end],
                                      cache.keys[0], cache.values[0], start, None)[0])
                    start = end
                torch.testing.assert_close(batched[row, :length], torch.cat(outs), rtol=0, atol=1e-5)


def test_layer_without_cache_starts_at_position_zero():
    layer = DecoderLayer(SPEC)
    rotary = RotaryTable(SPEC, 4, torch.float32)
    with pytest.raises(ValueError):
        layer(torch.randn(1, 2, SPEC.hidden_size), rotary.cos[2:], rotary.sin[2:], start=2)
