"""The forward plan: what ``begin_forward`` decided, as frozen records whose fields are the
int32 index arrays the kernels read.

``ForwardPlan`` holds the host arrays (``TokenArrays`` for the new tokens, one ``HostDepth`` per
block depth); the aux managers (``core.aux``) move them to the device and hand back
``ForwardAux``, the same records with device arrays under the same names (each ``HostDepth``
becomes the backend-facing ``DepthAux``, whose fields it mirrors). Arrays travel in one fixed
order, ``walk`` (page lists last in every depth), and ``device_twin`` rebuilds the records
from the device arrays in that order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from ..backend import DepthAux, TreeMask


@dataclass(frozen=True)
class TokenArrays:
    """Per-token and per-sequence arrays of a forward (``T`` new tokens of ``B`` sequences).

    ``qo_indptr`` (B+1,): sequence ``i``'s tokens are rows ``qo_indptr[i]:qo_indptr[i+1]``.
    ``q_positions`` (T,): RoPE position of each new token.
    ``append_slots`` (T,): page slot (``page * page_size + row``) each new token's K/V is
    written to; -1: written nowhere (a token that slid out within this forward, or a padded row).
    ``k_rope_offset`` (B,): position of each sequence's first new key (its committed length):
    the ragged pass rotates new key ``r`` of sequence ``i`` at ``k_rope_offset[i] + r``.
    ``self_tree``: token-tree visibility among the new tokens, for the ragged pass (None: causal).
    """

    qo_indptr: Any
    q_positions: Any
    append_slots: Any
    k_rope_offset: Any
    self_tree: Optional[TreeMask] = None


@dataclass(frozen=True)
class HostDepth(DepthAux):
    """One block depth on the host: the fields of ``kvcache.backend.DepthAux`` (which documents
    them) as host arrays; ``num_pages`` is the length of ``page_indices`` in use."""


DEPTH_ARRAYS = ("qo_indptr", "page_indptr", "last_page_len", "kv_len", "sink_size",
                "window_offset", "k_rope_offset", "page_indices")
"""The array fields of a depth in transfer order: the page list last, so a static-shape copy
stops at the end of the data, not of the list's capacity."""
DEPTH_SIZES = ("num_entries", "use_decode", "max_kv_len", "max_qo_len", "num_pages", "shared",
               "covers_rows", "uniform")


@dataclass(frozen=True)
class ForwardPlan:
    """A forward as ``begin_forward`` planned it.

    ``seq_ids`` (B ids), ``append_lengths`` (B,) int64, ``total_tokens`` (T) and
    ``max_append`` (longest append) describe the batch.
    ``paged_only``: no ragged pass; K/V are written first and the paged depths cover the new
    tokens too (decode batches without sliding windows, token trees continuing a tree).
    Otherwise a ragged pass attends among the new tokens and the depths cover the history.
    ``write_after``: K/V are written after attention (sliding windows: a token may overwrite a
    row that slides out in this forward).
    ``static_bucket``: static-shape decode (``CacheConfig(static_decode=True)``): the batch bucket the
    plan is padded to; None for an eager plan. ``static_mixed``: a static-shape mixed step
    (``CacheConfig(static_mixed=True)``): ``static_bucket`` is then its token bucket.
    ``static_kind``: which family of static-shape steps the plan belongs to (see there).
    ``undo``: what the forward changed in the page table (``ForwardUndo``), for ``rollback``.
    """

    seq_ids: list
    append_lengths: np.ndarray
    total_tokens: int
    max_append: int
    paged_only: bool
    write_after: bool
    tokens: TokenArrays
    depths: tuple
    undo: Any = None
    static_bucket: Optional[int] = None
    static_mixed: bool = False
    groups: tuple = ()
    """Window groups (``CacheConfig.layer_kinds``): one ``core.groups.GroupPlan`` per group,
    the append slots and the one depth a windowed layer uses instead of ``tokens.append_slots``
    and ``depths`` (empty without window groups)."""

    @property
    def static_kind(self) -> tuple:
        """``(static_mixed, number of depths)``: static-shape steps of one kind share one fixed
        device buffer and, per bucket, one capture (a mixed step whose sequences share a prefix
        has two depths: the shared blocks read once, merged with each sequence's own pages)."""
        return (self.static_mixed, len(self.depths))


@dataclass(frozen=True)
class ForwardAux:
    """The device twin of a plan's arrays: ``tokens``, one ``DepthAux`` per depth, and per
    window group a ``GroupPlan`` of device arrays (``append_slots``, ``depth``)."""

    tokens: TokenArrays
    depths: tuple
    groups: tuple = ()


def evolve(record, **changes):
    """A copy of a frozen record with ``changes``: the decode-step path's constructor (a frozen
    dataclass's ``__init__`` costs microseconds a step; this copies its dict)."""
    new = object.__new__(type(record))
    fields = new.__dict__
    fields.update(record.__dict__)
    fields.update(changes)
    return new


_DEFAULTS: dict = {}


def build(cls, **fields):
    """A frozen record of dataclass ``cls`` from ``fields`` (the others take their defaults)
    without the dataclass ``__init__``, which costs about 2 us on the planner's paths; the
    record is the same as ``cls(**fields)``."""
    defaults = _DEFAULTS.get(cls)
    if defaults is None:
        defaults = _DEFAULTS[cls] = {f.name: f.default for f in dataclasses.fields(cls)
                                     if f.default is not dataclasses.MISSING}
    new = object.__new__(cls)
    values = new.__dict__
    values.update(defaults)
    values.update(fields)
    return new


def walk(record) -> Iterator[tuple[Optional[int], str, Any]]:
    """Every array of a ``ForwardPlan`` or ``ForwardAux`` in transfer order, as
    ``(depth index or None for the token arrays, field name, array)``; tree arrays are named
    ``"tree.indptr"`` / ``"tree.mask"`` (``"self_tree.*"`` among the token arrays)."""
    t = record.tokens
    yield None, "qo_indptr", t.qo_indptr
    yield None, "q_positions", t.q_positions
    yield None, "append_slots", t.append_slots
    yield None, "k_rope_offset", t.k_rope_offset
    if t.self_tree is not None:
        yield None, "self_tree.indptr", t.self_tree.indptr
        yield None, "self_tree.mask", t.self_tree.mask
    for d, depth in enumerate(record.depths):
        for name in DEPTH_ARRAYS:
            yield d, name, getattr(depth, name)
        if depth.tree is not None:
            yield d, "tree.indptr", depth.tree.indptr
            yield d, "tree.mask", depth.tree.mask
    # window groups last, named "group<g>.<field>", with no depth index (none of ``depths``)
    for g, group in enumerate(getattr(record, "groups", ())):
        yield None, f"group{g}.append_slots", group.append_slots
        for name in DEPTH_ARRAYS:
            yield None, f"group{g}.{name}", getattr(group.depth, name)


def device_twin(plan: ForwardPlan, device: Callable[[], Any]) -> ForwardAux:
    """``ForwardAux`` of ``plan``: ``device()`` returns the device array of each host array in
    ``walk`` order."""
    t = plan.tokens
    tokens = TokenArrays(device(), device(), device(), device())
    if t.self_tree is not None:
        tokens = evolve(tokens, self_tree=TreeMask(device(), device()))
    depths = []
    for depth in plan.depths:
        arrays = {name: device() for name in DEPTH_ARRAYS}
        tree = None if depth.tree is None else TreeMask(device(), device(), depth.tree.chains)
        depths.append(DepthAux(**arrays, tree=tree,
                               **{name: getattr(depth, name) for name in DEPTH_SIZES}))
    groups = []
    for group in plan.groups:
        slots = device()
        arrays = {name: device() for name in DEPTH_ARRAYS}
        groups.append(type(group)(slots, DepthAux(
            **arrays, tree=None, **{name: getattr(group.depth, name) for name in DEPTH_SIZES})))
    return ForwardAux(tokens, tuple(depths), tuple(groups))


class ForwardUndo:
    """The state a forward changed, recorded as it reserved (no copy of the page table): its
    sequences' lengths, their last blocks' lengths and page counts, the free-page count, and for
    the rare cases a sliding block's pages and the tree sizes."""

    __slots__ = ("num_free", "slots", "last", "seq_len", "block_len", "npages", "free_top",
                 "slid", "trees", "groups")

    def __init__(self, num_free, slots, last, seq_len, block_len, npages):
        self.num_free, self.slots, self.last = num_free, slots, last
        self.seq_len, self.block_len, self.npages = seq_len, block_len, npages
        # free-stack entries above the reserved pages, as they were
        self.free_top: Optional[np.ndarray] = None
        # (block, pages, sink, window offset) of each sliding sequence
        self.slid: Sequence[tuple[int, np.ndarray, int, int]] = ()
        # (sequence: a core.pagetable.SeqState, uncommitted tree size) of each tree sequence
        self.trees: Sequence[tuple[Any, int]] = ()
        # the window groups' reservation (``core.groups.GroupUndo``), or None
        self.groups: Any = None
