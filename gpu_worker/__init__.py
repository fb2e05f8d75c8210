"""The draft worker: feature-level draft heads (DGF, EAGLE fc) and EAGLE-2 dynamic trees.

Coordinator surface: ``Drafter.from_pretrained(...)`` (or ``Drafter(load_head(...), max_len)``),
then ``reset()``, ``extend(features, tokens)``, ``propose(T, depth, top_k) -> DraftTree``.
"""

from .checkpoint import DraftCheckpointError, load_head, save_head
from .device import resolve_device, resolve_dtype
from .drafter import DraftContextError, Drafter
from .head import FUSIONS, DraftHead
from .tree import DraftTree, TreeArgumentError, build_tree

__all__ = [
    "FUSIONS", "DraftCheckpointError", "DraftContextError", "DraftHead", "DraftTree", "Drafter",
    "TreeArgumentError", "build_tree", "load_head", "resolve_device", "resolve_dtype", "save_head",
]
