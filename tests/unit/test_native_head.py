"""A CPU draft head's layers in native calls (``cpu_worker.model.native_head``): the torch layers'
values for both EAGLE-3 fusions and for DGF and EAGLE-1/2 heads, one layer and two, over a prompt, a
tree level's masked beam and two sequences at once: to float rounding with projections on the fp32 row
kernel (nothing quantized, so nothing to flip), and within an activation's quantization step at int8
and q4_0 (the draft is held to no more: the target verifies every token); each row's bits independent
of its call-mates; the torch layers wherever the native calls cannot run; bad calls refused."""

from __future__ import annotations

import pytest
import torch
from test_draft_support import HIDDEN, tiny_head

from cpu_worker.kernels.exact_attention import TreePaths
from cpu_worker.kernels.fp32_rows import RowInvariantFp32Linear, use_fp32_row_kernel
from cpu_worker.model import native_head
from cpu_worker.model.fusion import fuse_projections
from cpu_worker.model.llama import CacheSegment, KVCache, LlamaSpec, RotaryTable
from cpu_worker.model.native_head import MAX_ROWS, NativeEagle3Layer, attention_span
from cpu_worker.native import library as native
from gpu_worker.eagle3 import Eagle3Head
from gpu_worker.head import DraftHead
from gpu_worker.head_formats import FUSION_WEIGHTS, quantize_projections

pytestmark = pytest.mark.skipif(native.load() is None, reason="needs a C compiler for the native library")

# Widths that are multiples of 32, so q4_0's blocks fit every projection.
H, TARGET_H, VOCAB, DRAFT_VOCAB, FFN, MAX_LEN = 64, 32, 120, 48, 96, 48


def head_of(fusion: str, layers: int, projections: str | None, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    spec = LlamaSpec(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_layers=layers, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256)
    head = Eagle3Head(spec, target_hidden_size=TARGET_H, draft_vocab_size=DRAFT_VOCAB, fusion=fusion)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if name.endswith("norm.weight"):  # non-trivial norms, so a swapped norm shows
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
            elif parameter.dim() == 2:
                parameter.normal_(0, 0.3 if not name.startswith("W_") else 0.15)
    head.eval()
    return head if projections is None else quantize_projections(head, projections)


def torch_layers(head: Eagle3Head | DraftHead):
    """``head.forward_segments`` on the torch layers."""
    name = "native_layer" if isinstance(head, Eagle3Head) else "native_layers"

    def run(*args):
        native = getattr(head, name)
        setattr(head, name, lambda: None)
        try:
            return head.forward_segments(*args)
        finally:
            setattr(head, name, native)
    return run


def rows(count: int, width: int, seed: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(count, width, generator=generator),
            torch.randint(0, vocab, (count,), generator=generator))


def beam_mask() -> torch.Tensor:
    """A tree level's mask as the drafter makes it: 10 committed slots, then a beam of 3 in slots 13-15
    under earlier levels' nodes in slots 10-12 (each row its own ancestors among them, and itself)."""
    mask = torch.zeros(3, 16, dtype=torch.bool)
    mask[:, :10] = True
    mask[0, 10] = mask[1, 11] = mask[2, 10] = mask[2, 12] = True
    mask[:, 13:] = torch.eye(3, dtype=torch.bool)
    return mask


def zeroed(cache: KVCache) -> KVCache:
    cache.keys.zero_()
    cache.values.zero_()
    return cache


def row_kernel_projections(head: Eagle3Head | DraftHead) -> Eagle3Head | DraftHead:
    """Every projection of ``head`` on the fp32 row kernel (as a fp32 target's), fused as the CPU formats
    fuse them: nothing is quantized, so the two paths differ by float rounding alone."""
    with torch.no_grad():
        if all(isinstance(getattr(head, name, None), torch.nn.Parameter) for name in FUSION_WEIGHTS):
            head.int8_fusion = torch.nn.ModuleDict({name: RowInvariantFp32Linear(getattr(head, name).t().contiguous())
                                                    for name in FUSION_WEIGHTS})
            for name in FUSION_WEIGHTS:
                delattr(head, name)
        fuse_projections(head, dense=True)
        assert use_fp32_row_kernel(head)
    head.projection_format = "fp32-rows"  # any format but None: the native layers are built for it
    return head


def tight(got: torch.Tensor, want: torch.Tensor) -> None:
    # Float rounding only (attention's order, the library's sigmoid and SiLU): ~1e-7 of the largest value.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def within_a_step(got: torch.Tensor, want: torch.Tensor) -> None:
    # An activation that rounds to the next int8 step in one path moves its row's later values (and,
    # through attention, later rows') by up to ~1% of the largest value; a wiring mistake moves far more.
    torch.testing.assert_close(got, want, rtol=0.0, atol=0.05 * float(want.abs().max()))


def compare_paths(head: Eagle3Head | DraftHead, feature_size: int, close) -> None:
    """The native and torch paths, each on its own caches, over a prompt, one more row, a tree level
    and two sequences in one call: the same outputs and cache rows, as ``close`` judges them."""
    spec = head.spec
    rotary = RotaryTable(spec, MAX_LEN, torch.float32)
    native_caches = [zeroed(head.new_cache(MAX_LEN, torch.float32)) if isinstance(head, Eagle3Head)
                     else zeroed(KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, MAX_LEN, torch.float32))
                     for _ in range(4)]
    torch_caches, native_caches = native_caches[2:], native_caches[:2]

    def both(features, tokens, cos, sin, segments_of):
        got = head.forward_segments(features, tokens, cos, sin, segments_of(native_caches))
        want = torch_layers(head)(features, tokens, cos, sin, segments_of(torch_caches))
        close(got, want)
        for mine, theirs in zip(native_caches, torch_caches, strict=True):
            close(mine.keys, theirs.keys)
            close(mine.values, theirs.values)

    # A prompt of target rows (causal), then one more row.
    features, tokens = rows(9, feature_size, seed=1, vocab=spec.vocab_size)
    both(features, tokens, rotary.cos[:9], rotary.sin[:9], lambda caches: [CacheSegment(caches[0], 0, 0, 9)])
    features, tokens = rows(1, feature_size, seed=2, vocab=spec.vocab_size)
    both(features, tokens, rotary.cos[9:10], rotary.sin[9:10], lambda caches: [CacheSegment(caches[0], 9, 0, 1)])
    # A tree level: the head's own outputs as features, a beam of 3 in scratch slots past 10 committed.
    features, tokens = rows(3, spec.hidden_size, seed=4, vocab=spec.vocab_size)
    position = torch.full((3,), 11)
    both(features, tokens, rotary.cos[position], rotary.sin[position],
         lambda caches: [CacheSegment(caches[0], 13, 0, 3, mask=beam_mask())])
    # Two sequences in one call: the second's prompt beside the first's next row.
    features, tokens = rows(5, feature_size, seed=5, vocab=spec.vocab_size)
    positions = torch.tensor([10, 0, 1, 2, 3])
    both(features, tokens, rotary.cos[positions], rotary.sin[positions],
         lambda caches: [CacheSegment(caches[0], 10, 0, 1), CacheSegment(caches[1], 0, 1, 5)])


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("fusion", ["eagle3", "dgf-eagle3"])
def test_an_eagle3_head_s_native_call_gives_the_torch_layers_values(fusion, layers):
    head = row_kernel_projections(head_of(fusion, layers, None))
    assert head.native_layer() is not None
    compare_paths(head, 3 * TARGET_H, tight)


def test_a_long_prompt_read_takes_the_native_call_and_gives_the_torch_layers_values():
    """A prompt of 70 rows (past the causal kernel's 32-row tiles and the old 64-row limit) on the
    native call attends causally as the torch layers do."""
    head = row_kernel_projections(head_of("eagle3", 2, None))
    layer = head.native_layer()
    assert layer is not None
    length = 80
    rotary = RotaryTable(head.spec, length, torch.float32)
    native_cache, torch_cache = (zeroed(head.new_cache(length, torch.float32)) for _ in range(2))
    features, tokens = rows(70, 3 * TARGET_H, seed=7)
    assert layer.applies(features, [CacheSegment(native_cache, 0, 0, 70)])
    cos, sin = rotary.cos[:70], rotary.sin[:70]
    got = head.forward_segments(features, tokens, cos, sin, [CacheSegment(native_cache, 0, 0, 70)])
    want = torch_layers(head)(features, tokens, cos, sin, [CacheSegment(torch_cache, 0, 0, 70)])
    tight(got, want)
    tight(native_cache.keys, torch_cache.keys)
    tight(native_cache.values, torch_cache.values)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("fusion", ["dgf", "fc"])
def test_a_dgf_or_eagle_head_s_native_calls_give_the_torch_layers_values(fusion, layers):
    head = row_kernel_projections(tiny_head(fusion, layers=layers, seed=3))
    assert head.native_layers() is not None
    compare_paths(head, HIDDEN, tight)


@pytest.mark.parametrize("projections", ["int8", "q4_0"])
@pytest.mark.parametrize("kind", ["dgf-eagle3", "eagle3", "dgf", "fc"])
def test_quantized_heads_native_calls_stay_within_a_quantization_step(kind, projections):
    if kind in ("dgf", "fc"):
        head: Eagle3Head | DraftHead = quantize_projections(tiny_head(kind, layers=2, seed=3), projections)
        assert head.native_layers() is not None
        compare_paths(head, HIDDEN, within_a_step)
    else:
        head = head_of(kind, 2, projections)
        assert head.native_layer() is not None
        compare_paths(head, 3 * TARGET_H, within_a_step)


@pytest.mark.parametrize("kind", ["dgf-eagle3 q4_0", "dgf int8"])
def test_each_row_s_bits_do_not_depend_on_its_call_mates(kind):
    if kind == "dgf int8":
        head: Eagle3Head | DraftHead = quantize_projections(tiny_head("dgf", layers=2, seed=1), "int8")
        width = HIDDEN
    else:
        head, width = head_of("dgf-eagle3", 2, "q4_0", seed=1), 3 * TARGET_H
    spec = head.spec
    rotary = RotaryTable(spec, MAX_LEN, torch.float32)
    prompt, prompt_tokens = rows(6, width, seed=6, vocab=spec.vocab_size)
    other, other_tokens = rows(4, width, seed=7, vocab=spec.vocab_size)
    alone_cache, together_cache, mate_cache = (
        zeroed(KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, MAX_LEN, torch.float32)) for _ in range(3))
    calls = []
    native = head.native_layer() if isinstance(head, Eagle3Head) else head.native_layers()
    assert native is not None
    run = native.run
    native.run = lambda *args: calls.append(1) or run(*args)  # type: ignore[method-assign]
    alone = head.forward_segments(prompt, prompt_tokens, rotary.cos[:6], rotary.sin[:6],
                                  [CacheSegment(alone_cache, 0, 0, 6)])
    positions = torch.cat([torch.arange(6), torch.arange(4)])
    together = head.forward_segments(torch.cat([prompt, other]), torch.cat([prompt_tokens, other_tokens]),
                                     rotary.cos[positions], rotary.sin[positions],
                                     [CacheSegment(together_cache, 0, 0, 6), CacheSegment(mate_cache, 0, 6, 10)])
    assert calls == [1, 1]  # both forwards took the native calls
    assert torch.equal(together[:6], alone)
    assert torch.equal(together_cache.keys, alone_cache.keys) and torch.equal(together_cache.values,
                                                                              alone_cache.values)
    assert not torch.equal(mate_cache.keys, alone_cache.keys)  # the mate wrote its own cache, not this one


def test_attention_spans_of_a_mask_paths_and_causal_rows():
    cache = KVCache(1, 2, 16, MAX_LEN, torch.float32)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    shared, extra, offsets = attention_span(CacheSegment(cache, 4, 0, 2, mask=mask))
    assert shared == 3 and extra.tolist() == [0, 1, 2] and offsets.tolist() == [0, 1, 3]
    # Causal rows: no extra slots (the C loop attends causally from start)
    assert attention_span(CacheSegment(cache, 7, 2, 5)) == (7, None, None)
    paths = TreePaths.from_paths([[0], [0, 1]])
    shared, extra, offsets = attention_span(CacheSegment(cache, 5, 0, 2, paths=paths))
    assert shared == 5 and extra is paths.flat and offsets is paths.offsets
    with pytest.raises(ValueError, match="mask of shape"):
        attention_span(CacheSegment(cache, 3, 0, 2, mask=mask))
    with pytest.raises(ValueError, match="mask of shape"):
        attention_span(CacheSegment(cache, 4, 0, 2, mask=mask.float()))
    with pytest.raises(ValueError, match="paths of 2 rows"):
        attention_span(CacheSegment(cache, 5, 0, 3, paths=paths))


def test_what_the_native_call_cannot_take_keeps_the_torch_layers(monkeypatch):
    float_head = head_of("eagle3", 1, None)
    assert float_head.native_layer() is None  # torch's nn.Linear: no kernel of ours
    quantize_projections(float_head, "int8")
    native_layer = float_head.native_layer()  # built again for the new format
    assert native_layer is not None
    cache = float_head.new_cache(MAX_LEN + 40, torch.float32)
    features = torch.randn(MAX_ROWS + 1, 3 * TARGET_H)
    assert not native_layer.applies(features, [CacheSegment(cache, 0, 0, MAX_ROWS + 1)])  # a long prompt
    assert native_layer.applies(features[:MAX_ROWS], [CacheSegment(cache, 0, 0, MAX_ROWS)])
    assert not native_layer.applies(features[:2].double(), [CacheSegment(cache, 0, 0, 2)])
    assert not native_layer.applies(features[:2].requires_grad_(), [CacheSegment(cache, 0, 0, 2)])
    for dtype in (torch.float16, torch.bfloat16):  # a drafter's cache has its rows' dtype: fp32 here
        other_cache = float_head.new_cache(MAX_LEN, dtype)
        assert not native_layer.applies(features[:2], [CacheSegment(other_cache, 0, 0, 2)])
    assert tiny_head("dgf").native_layers() is None
    monkeypatch.setenv(native_head.FORCE_VARIABLE, "python")
    assert head_of("eagle3", 1, "int8").native_layer() is None
    assert quantize_projections(tiny_head("dgf"), "int8").native_layers() is None


def test_bad_calls_are_refused():
    head = head_of("eagle3", 1, "int8")
    native_layer = head.native_layer()
    assert isinstance(native_layer, NativeEagle3Layer)
    rotary = RotaryTable(head.spec, MAX_LEN, torch.float32)
    cache = head.new_cache(MAX_LEN, torch.float32)
    g, tokens = rows(3, H, seed=8)
    embedded = head.embed_tokens(tokens)
    with pytest.raises(ValueError, match="do not fit"):
        native_layer.run(g, embedded, rotary.cos[:2], rotary.sin[:2], [CacheSegment(cache, 0, 0, 3)])
    with pytest.raises(ValueError, match="cover the 3 rows"):
        native_layer.run(g, embedded, rotary.cos[:3], rotary.sin[:3], [CacheSegment(cache, 0, 0, 2)])
    with pytest.raises(ValueError, match="outside"):
        native_layer.run(g, embedded, rotary.cos[:3], rotary.sin[:3], [CacheSegment(cache, MAX_LEN - 2, 0, 3)])


def test_a_call_the_library_refuses_is_a_value_error():
    head = quantize_projections(tiny_head("dgf", layers=1, seed=2), "int8")
    native_layers = head.native_layers()
    assert native_layers is not None
    native_layers._fusion.kind = 7  # no such fusion: dovetail_draft_fusion says so, nothing is computed
    spec = head.spec
    rotary = RotaryTable(spec, MAX_LEN, torch.float32)
    features, tokens = rows(2, HIDDEN, seed=9, vocab=spec.vocab_size)
    cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, MAX_LEN, torch.float32)
    with pytest.raises(ValueError, match="refused the call"):
        native_layers.run(features, head.embed_tokens(tokens), rotary.cos[:2], rotary.sin[:2],
                          [CacheSegment(cache, 0, 0, 2)])
