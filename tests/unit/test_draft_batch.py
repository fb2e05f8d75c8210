"""Several sequences' draft steps in one head forward (``Drafter.extend_together``,
``propose_together``, the gpu_worker's DraftBatch): each sequence gets the tree it gets alone
(bit for bit where the head's projections are row-invariant: int8 and q4_0 heads), the head runs
once per tree level for all of them, and an item that does not fit fails alone."""

from __future__ import annotations

import pytest
import torch
from test_draft_support import tiny_head
from test_eagle3_head import TARGET_H, tiny_eagle3

from gpu_worker.drafter import DraftContextError, Drafter
from gpu_worker.head_formats import quantize_projections
from gpu_worker.server import DraftService
from gpu_worker.tree import DraftTree
from ipc import messages as m
from ipc.shm_ring import ShmRing
from ipc.tree import TreeShape
from ipc.worker_loop import SequenceError

# Different shapes in one batch: a deep narrow tree, a one-node tree (plain decoding), a wide one.
SHAPES = [TreeShape.clamped(8, 4, 2), TreeShape.clamped(1, 1, 1), TreeShape.clamped(12, 3, 4)]
PREFIXES = [7, 3, 12]  # committed pairs before the first tree: different cache lengths


def heads():
    return {
        "dgf-int8": quantize_projections(tiny_head("dgf", layers=2, seed=1), "int8"),
        "dgf-q4_0": quantize_projections(tiny_head("dgf", layers=2, seed=2), "q4_0"),
        "fc-int8": quantize_projections(tiny_head("fc", layers=1, seed=3), "int8"),
        "dgf-eagle3-int8": tiny_eagle3("dgf-eagle3", kv_heads=2, layers=2).quantize_int8(),
        "dgf-fp32-sharp": tiny_head("dgf", layers=2, seed=4, sharpen=40.0),
    }


def pairs(drafter: Drafter, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(count, drafter.feature_size, generator=generator)
    tokens = torch.randint(0, drafter.head.spec.vocab_size, (count,), generator=generator)
    return features, tokens


def same(tree: DraftTree, other: DraftTree) -> bool:
    return torch.equal(tree.tokens, other.tokens) and torch.equal(tree.parents, other.parents)


@pytest.mark.parametrize("name", list(heads()))
def test_batched_draft_steps_give_each_sequence_its_solo_tree(name):
    head = heads()[name]
    solo = Drafter(head, max_len=64, scratch_len=32)
    alone = [solo, solo.sibling(), solo.sibling()]
    batched = [solo.sibling() for _ in alone]
    calls: list[int] = []
    forward = head.forward_segments
    head.forward_segments = lambda *args: calls.append(1) or forward(*args)  # type: ignore[method-assign]
    for cycle in range(3):
        extends = [pairs(solo, PREFIXES[index] if cycle == 0 else 1 + index, seed=10 * cycle + index)
                   for index in range(3)]
        for drafter, (features, tokens) in zip(alone, extends, strict=True):
            drafter.extend(features, tokens)
        Drafter.extend_together([(drafter, drafter.check_extend(features, tokens))
                                 for drafter, (features, tokens) in zip(batched, extends, strict=True)])
        expected = [drafter.propose(shape) for drafter, shape in zip(alone, SHAPES, strict=True)]
        calls.clear()
        trees = Drafter.propose_together(batched, SHAPES)
        assert [len(tree) for tree in trees] == [8, 1, 12]
        assert all(same(tree, want) for tree, want in zip(trees, expected, strict=True)), (name, cycle)
        # One forward per level of the deepest tree (its root's children need none), not per sequence.
        assert len(calls) == max(shape.depth for shape in SHAPES) - 1
        assert [drafter.length for drafter in batched] == [drafter.length for drafter in alone]


def test_extend_together_matches_extend_on_an_eagle3_heads_target_rows():
    head = tiny_eagle3("eagle3", kv_heads=2).quantize_int8()
    first = Drafter(head, max_len=32, scratch_len=8)
    alone, together = [first, first.sibling()], [first.sibling(), first.sibling()]
    assert first.feature_size == 3 * TARGET_H
    extends = [pairs(first, count, seed=count) for count in (5, 2)]
    for drafter, (features, tokens) in zip(alone, extends, strict=True):
        drafter.extend(features, tokens)
    Drafter.extend_together([(drafter, drafter.check_extend(*pair)) for drafter, pair in zip(together, extends,
                                                                                            strict=True)])
    for mine, theirs in zip(together, alone, strict=True):
        assert mine.length == theirs.length and torch.equal(mine._root_feature, theirs._root_feature)
        assert torch.equal(mine.cache.keys[:, :, :, :mine.length], theirs.cache.keys[:, :, :, :theirs.length])


def test_batched_steps_refuse_what_a_solo_step_refuses():
    head = quantize_projections(tiny_head("dgf", layers=1, seed=5), "int8")
    drafter = Drafter(head, max_len=8, scratch_len=4)
    other = Drafter(tiny_head("dgf", layers=1, seed=5), max_len=8)
    with pytest.raises(DraftContextError, match="draft cache full"):
        drafter.check_extend(*pairs(drafter, 9, seed=1))
    with pytest.raises(ValueError, match="share one head"):
        Drafter.extend_together([(drafter, drafter.check_extend(*pairs(drafter, 2, 1))),
                                 (other, other.check_extend(*pairs(other, 2, 1)))])
    drafter.extend(*pairs(drafter, 2, seed=2))
    with pytest.raises(DraftContextError, match="scratch slots"):
        Drafter.propose_together([drafter], [TreeShape.clamped(16, 5, 4)])
    with pytest.raises(RuntimeError, match="before extend"):
        Drafter.propose_together([drafter.sibling()], [TreeShape.clamped(4, 2, 2)])


def test_a_draft_batch_fails_bad_items_alone_and_shares_its_time():
    head = quantize_projections(tiny_head("dgf", layers=2, seed=6), "int8")
    drafter = Drafter(head, max_len=16, scratch_len=16)
    with ShmRing.create(1 << 16, 8) as ring:
        service = DraftService(drafter, {ring.name: ring}, max_sequences=4)
        reference = drafter.sibling()

        def request(seq_id: int, count: int, reset: bool = True, shape: TreeShape = SHAPES[0]) -> m.DraftRequest:
            features, tokens = pairs(drafter, count, seed=seq_id)
            return m.DraftRequest(seq_id=seq_id, tokens=tokens.tolist(), features=ring.write(features), shape=shape,
                                  reset=reset)

        items = [request(1, 5), request(2, 3), request(1, 2), request(3, 40), request(4, 2, reset=False),
                 request(5, 4, shape=TreeShape.clamped(30, 8, 4))]
        reply = service.draft_batch(m.DraftBatch(items=items))
        good, second, twice, too_long, unknown, too_big = reply.items
        assert isinstance(good, m.DraftResult) and isinstance(second, m.DraftResult)
        assert isinstance(twice, m.WorkerError) and "twice" in twice.message
        assert isinstance(too_long, m.WorkerError) and "draft cache full" in too_long.message
        assert isinstance(unknown, m.WorkerError) and "not active" in unknown.message
        assert isinstance(too_big, m.WorkerError) and "scratch slots" in too_big.message
        assert good.compute_ms == second.compute_ms and good.compute_ms * 2 <= reply.compute_ms + 1e-9
        reference.extend(*pairs(drafter, 5, seed=1))
        assert good.tokens == reference.propose(SHAPES[0]).tokens.tolist()


def test_a_prompt_chunk_in_a_draft_batch_only_extends_its_sequence():
    """A long prompt's chunks (DraftExtend), each beside another sequence's draft step: the chunked
    sequence holds every pair and drafts the tree it drafts after reading the prompt whole."""
    head = quantize_projections(tiny_head("dgf", layers=2, seed=7), "int8")
    drafter = Drafter(head, max_len=64, scratch_len=16)
    with ShmRing.create(1 << 16, 8) as ring:
        service = DraftService(drafter, {ring.name: ring}, max_sequences=4)
        features, tokens = pairs(drafter, 30, seed=11)
        other_features, other_tokens = pairs(drafter, 6, seed=12)
        first = service.draft(m.DraftRequest(seq_id=2, tokens=other_tokens.tolist(),
                                             features=ring.write(other_features), shape=SHAPES[0], reset=True))
        for begin, end in ((0, 12), (12, 24)):
            chunk = m.DraftExtend(seq_id=1, tokens=tokens[begin:end].tolist(), features=ring.write(features[begin:end]),
                                  reset=begin == 0)
            step = m.DraftRequest(seq_id=2, tokens=first.tokens[:1], features=ring.write(other_features[-1:]),
                                  shape=SHAPES[2])
            reply = service.draft_batch(m.DraftBatch(items=[chunk, step]))
            extended, drafted = reply.items
            assert isinstance(extended, m.DraftExtended) and extended.seq_id == 1 and extended.compute_ms > 0
            assert isinstance(drafted, m.DraftResult) and len(drafted.tokens) == 12
        assert service.sequences[1].length == 24
        last = service.draft(m.DraftRequest(seq_id=1, tokens=tokens[24:].tolist(), features=ring.write(features[24:]),
                                            shape=SHAPES[0]))
        whole = drafter.sibling()
        whole.extend(features, tokens)
        assert last.tokens == whole.propose(SHAPES[0]).tokens.tolist()
        # A chunk of a sequence the worker does not hold (not reset) is refused alone.
        stray = m.DraftExtend(seq_id=9, tokens=[1], features=ring.write(features[:1]))
        refused, = service.draft_batch(m.DraftBatch(items=[stray])).items
        assert isinstance(refused, m.WorkerError) and "not active" in refused.message


def test_a_prompt_kept_unread_is_read_with_the_next_draft_step_as_if_read_first():
    """A busy batch's new sequence hands the draft its prompt's pairs to keep (DraftExtend with defer):
    nothing computed, the ring slot free; its next draft step, alone or batched, reads them with its
    own pairs and proposes the tree the sequence gets when it reads the prompt first. Released
    before that, the kept pairs are dropped; kept pairs count against the cache."""
    head = quantize_projections(tiny_head("dgf", layers=2, seed=8), "int8")
    drafter = Drafter(head, max_len=40, scratch_len=16)
    features, tokens = pairs(drafter, 30, seed=21)
    step_features, step_tokens = pairs(drafter, 2, seed=22)
    whole = drafter.sibling()
    whole.extend(features, tokens)
    whole.extend(step_features, step_tokens)
    expected = whole.propose(SHAPES[2]).tokens.tolist()
    forwards: list[int] = []
    forward = head.forward_segments
    head.forward_segments = lambda *args: forwards.append(1) or forward(*args)  # type: ignore[method-assign]
    with ShmRing.create(1 << 16, 8) as ring:
        service = DraftService(drafter, {ring.name: ring}, max_sequences=4)
        for batched in (False, True):
            forwards.clear()
            keep = m.DraftExtend(seq_id=1, tokens=tokens.tolist(), features=ring.write(features), reset=True,
                                 defer=True)
            kept = service.draft_batch(m.DraftBatch(items=[keep])).items[0] if batched else service.extend(keep)
            assert isinstance(kept, m.DraftExtended) and forwards == []  # nothing read yet
            sequence = service.sequences[1]
            assert sequence.length == 0 and sequence.deferred == 30
            step = m.DraftRequest(seq_id=1, tokens=step_tokens.tolist(), features=ring.write(step_features),
                                  shape=SHAPES[2])
            other = m.DraftRequest(seq_id=2, tokens=step_tokens.tolist(), features=ring.write(step_features),
                                   shape=SHAPES[0], reset=True)
            drafted = (service.draft_batch(m.DraftBatch(items=[step, other])).items[0] if batched
                       else service.draft(step))
            assert isinstance(drafted, m.DraftResult) and drafted.tokens == expected, batched
            assert sequence.length == 32 and sequence.deferred == 0 and forwards
        # Released with its pairs still kept: gone; a later sequence in its drafter starts empty.
        service.extend(m.DraftExtend(seq_id=3, tokens=tokens.tolist(), features=ring.write(features), reset=True,
                                     defer=True))
        service.release(m.ReleaseSequence(seq_id=3))
        assert 3 not in service.sequences and all(held.deferred == 0 for held in service._spare)
        # Kept pairs take their room: 30 kept and 11 more overflow a 40-pair cache.
        service.extend(m.DraftExtend(seq_id=4, tokens=tokens.tolist(), features=ring.write(features), reset=True,
                                     defer=True))
        more_features, more_tokens = pairs(drafter, 11, seed=23)
        with pytest.raises(SequenceError, match="draft cache full"):
            service.draft(m.DraftRequest(seq_id=4, tokens=more_tokens.tolist(), features=ring.write(more_features),
                                         shape=SHAPES[0]))
