"""The device side of window groups (``CacheConfig.layer_kinds``, docs/hybrid.md): the page
arrays of a cache with groups, the page copies of a fork or a pop per group, and ``get_kv`` of
a windowed layer. The host side (pools, live lists, index arrays) is ``core.groups``.

A cache with window groups has one page array per layer as before (``PagedKVCache.pages``),
but a windowed layer's array has its group's pages (``CacheConfig.window_group_pages``), far
fewer than ``num_pages``; the kernels take it as they take any layer's array."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .core.validate import int_arg
from .errors import InvalidArgumentError, UnsupportedFeatureError
from .forward_run import layer_arg

Array = Any


def allocate(backend, config) -> list:
    """One page array per layer: ``num_pages`` pages for a full-attention layer, its group's
    pool for a windowed one (``Backend.allocate_group_pages``, one call per group)."""
    if not config.layer_kinds:
        return backend.allocate_pages(config.num_pages)
    pages: list = [None] * config.num_layers
    parts = [(config.full_layers, config.num_pages)] + [
        (layers, config.window_group_pages(g)) for g, (_, layers) in enumerate(config.window_groups)]
    for layers, count in parts:
        if layers:
            for layer, array in zip(layers, backend.allocate_group_pages(count, len(layers))):
                pages[layer] = array
    return pages


def describe(config) -> str:
    """The page arrays in words (the memory refusal's message)."""
    parts = [f"{len(config.full_layers)} full layers x {config.num_pages} pages"]
    parts += [f"{len(layers)} layers of {kind} x {config.window_group_pages(g)} pages"
              for g, (kind, layers) in enumerate(config.window_groups)]
    parts += [f"{len(layers)} layers of {kind} x {config.num_state_slots} state slots"
              for kind, layers in config.state_groups]
    return ", ".join(parts)


def copy_pages(backend, config, pages: list, copies) -> None:
    """Run a fork's or a pop's partial-page copies (``core.sequences.PageCopy``) on the page
    arrays of their group: the full-attention layers' for ``group == -1``."""
    layers_of = [config.full_layers] + [layers for _, layers in config.window_groups]
    for c in copies:
        layers = layers_of[c.group + 1]
        if layers:
            backend.copy_page_prefix([pages[layer] for layer in layers], c.src_page,
                                     c.dst_page, c.length)


def refuse(config, what: str) -> None:
    """UnsupportedFeatureError for ``what`` (a whole-sequence export, import, file or host-tier
    call) in a cache with window groups or state layers."""
    if config.window_groups:
        raise UnsupportedFeatureError(
            f"{what} in a cache with window groups (CacheConfig.layer_kinds "
            f"{dict(config.layer_kinds)}): its windowed layers hold only the keys their windows "
            f"still see, and payloads, files and the host tier carry whole sequences; not "
            f"composed with window groups yet (docs/hybrid.md)")
    if config.state_layers:
        raise UnsupportedFeatureError(
            f"{what} in a cache with state layers {list(config.state_layers)} "
            f"(CacheConfig.layer_kinds State): payloads, files and the host tier carry K/V "
            f"pages, not recurrent states; not composed with state slots yet (docs/hybrid.md)")


def get_kv(cache, seq_id: int, start: int = 0, end: Optional[int] = None,
           layer: Optional[int] = None) -> tuple[Array, Array]:
    """``get_kv`` in a cache with layer groups: a full-attention layer's as without groups,
    a windowed layer's from its group's pages (``start`` at or after the first position the
    group still holds: ``window_pages``), a state layer's refused (InvalidArgumentError: no
    K/V), every layer at once refused (UnsupportedFeatureError: pass ``layer``)."""
    config = cache.config
    if layer is None:
        raise UnsupportedFeatureError(
            f"get_kv of every layer of sequence {seq_id!r:.40} in a cache with layer groups: "
            f"its windowed layers hold only their windows, its state layers no K/V; pass "
            f"layer=")
    layer = layer_arg(layer, config.num_layers, "get_kv layer")
    if layer in config.state_layers:
        raise InvalidArgumentError(
            f"get_kv of layer {layer}, a state layer ({config.state_layers[layer]}): it holds "
            f"no K/V (its states: get_state inside a forward)")
    g = config.layer_group(layer)
    if g < 0:
        return cache.payloads.get_kv(seq_id, start, end, layer, cache._run)
    state = cache.state
    seq = state.seq(seq_id)
    length = state.pt.length(seq)
    start = int_arg(start, "start")
    end = length if end is None else int_arg(end, "end")
    group = state.pt.groups.groups[g]
    first, ps = group.first[seq.seq_id] * group.page_size, group.page_size
    if not first <= start <= end <= length:
        if 0 <= start <= end <= length:
            raise InvalidArgumentError(
                f"get_kv range [{start}, {end}) of sequence {seq.seq_id}, layer {layer}: its "
                f"window group {group.spec.name!r} holds the keys from position {first} on (the "
                f"keys before slid out of every window and were freed)")
        raise InvalidArgumentError(
            f"get_kv range [{start}, {end}) of sequence {seq.seq_id} must lie in [0, {length}]")
    if cache._run is not None:
        cache._run.check_read(seq, layer, end, length)
    live = np.asarray(group.live[seq.seq_id], np.int64)
    positions = np.arange(start, end)
    slots = (live[positions // ps - first // ps] * ps + positions % ps).astype(np.int32)
    b = cache.backend
    k, v = b.gather_kv([cache.pages[layer]], b.aux_to_device(slots),
                       **cache.payloads._gather_kw(range(layer, layer + 1)))
    return k[0], v[0]
