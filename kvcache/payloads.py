"""``Payloads``: a cache's K/V as data: ``get_kv``, exports (``SequencePayload``, or the batched
``export_sequences`` a transfer sends) and imports, whole (``import_sequence``) or in three
phases (``reserve_import`` / ``write_import`` / ``commit_import``) for K/V that arrives later.

Exports read pages as stored (fp8 as the values read back, with the layer scales in the
header; int8 / int4 as packed rows). Imports check everything first (the payload's header
against the cache's config, the fp8 scales against the layers', the ids, the pages), then write
and commit, so a refused import changes nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from .arrays import np_dtype, to_host
from .core.imports import ImportReservation, ImportSpec, pages_needed as import_pages
from .core.state import as_int
from .core.validate import bool_arg, int_values, seq_id_arg, seq_id_list
from .errors import ForwardStateError, InvalidArgumentError, KVCacheError, UnsupportedFeatureError
from .forward_run import layer_arg
from .transfer import SequencePayload, payload_fields

# A backend-native array (numpy.ndarray, torch.Tensor, mlx.core.array): the core never looks inside.
Array = Any


def copy_pages(backend, pages, copies) -> None:
    """Run the core's page copies (``PageCopy``: a fork's or a pop's partial page)."""
    for c in copies:
        backend.copy_page_prefix(pages, c.src_page, c.dst_page, c.length)


class Payloads:
    """The payload calls of a cache with ``config``, ``backend``, ``pages`` (one array per
    layer), core ``state``, KV ``manager`` and fp8 ``scales`` (None unless fp8 pages).
    ``PagedKVCache`` checks the thread and the forward state before each call and passes the
    open forward (``run``) to the calls that may run inside one. It holds no reference to the
    cache: a dropped cache is freed at once, without a cycle for the collector."""

    def __init__(self, config, backend, pages, state, manager, scales) -> None:
        self.config, self.backend, self.pages = config, backend, pages
        self.state, self.manager, self.scales = state, manager, scales
        self.packed = self.config.kv_format.packed
        """Whether pages move as packed rows (int8 / int4: ``gather_kv(..., packed=True)``)."""
        self._last_export: Optional[tuple] = None
        """``(epoch, key, known)`` of the last ``export_sequences`` outside a forward: a
        transfer asks for the headers, then each layer group's rows, of the same sequences
        with nothing changed between (the plan epoch says so), and their slots are computed
        once."""

    def _gather_kw(self, layers) -> dict:
        return {} if self.scales is None else self.scales.gather_kw(layers)

    def get_kv(self, seq_id: int, start: int = 0, end: Optional[int] = None,
               layer: Optional[int] = None, run=None) -> tuple[Array, Array]:
        """The K/V of tokens ``start .. end-1`` (None: to the end) of sequence ``seq_id``, K as
        stored: ``(k, v)`` each ``(num_layers, end-start, num_kv_heads, head_dim)`` (v:
        ``head_dim_v``), or with ``layer`` that layer's only, ``(end-start, num_kv_heads,
        head_dim)``.

        With ``layer`` it may also be called inside a forward (by the thread that opened it), for
        a model that computes its attention itself (see ``append_kv``): the tokens from before
        the forward are there, and the forward's own once the layer has run. Raises
        SequenceNotFoundError, InvalidArgumentError for a range outside [0, length] or a layer
        outside [0, num_layers), ForwardStateError inside a forward without ``layer``, for a
        range reaching the forward's tokens before the layer has written them, or in a forward
        over a sliding-window sequence (its new tokens may take the slots of old ones)."""
        seq = self.state.seq(seq_id)
        length = self.state.pt.length(seq)
        start = as_int(start, "start")
        end = length if end is None else as_int(end, "end")
        if not 0 <= start <= end <= length:
            raise InvalidArgumentError(
                f"get_kv range [{start}, {end}) of sequence {seq.seq_id} must lie in [0, {length}]")
        pages, layers = self.pages, range(self.config.num_layers)
        if layer is not None:
            layer = layer_arg(layer, self.config.num_layers, "get_kv layer")
            pages, layers = [self.pages[layer]], range(layer, layer + 1)
            if run is not None:
                run.check_read(seq, layer, end, length)
        slots = self.state.pt.position_slots(seq, start, end)
        k, v = self.backend.gather_kv(pages, self.backend.aux_to_device(slots),
                                      **self._gather_kw(layers))
        return (k, v) if layer is None else (k[0], v[0])

    def _stored_rows(self, slots: np.ndarray, layers: Optional[range] = None,
                     dev: Optional[Array] = None) -> tuple[Array, Array]:
        """(k, v) of ``layers`` (None: every layer) at ``slots`` as a payload carries them:
        packed rows for int8 / int4 pages, else the values (fp8: read back with the layer
        scales). ``dev``: ``slots`` on the device already."""
        b = self.backend
        layers = range(self.config.num_layers) if layers is None else layers
        pages = self.pages[layers.start:layers.stop]
        dev = b.aux_to_device(slots) if dev is None else dev
        if self.packed:
            return b.gather_kv(pages, dev, packed=True)
        return b.gather_kv(pages, dev, **self._gather_kw(layers))

    def _layer_range(self, layers, what: str) -> range:
        """``layers`` (None: all, or a ``range`` of consecutive layers, step 1, non-empty)
        checked against the cache's layer count."""
        n = self.config.num_layers
        if layers is None:
            return range(n)
        if not isinstance(layers, range) or layers.step != 1 or not 0 <= layers.start < layers.stop <= n:
            raise InvalidArgumentError(
                f"{what}: layers={layers!r} must be None or a range of consecutive layers "
                f"within [0, {n}) (e.g. range(0, {n}))")
        return layers

    def export_sequence(self, seq_id: int, start: int = 0, end: Optional[int] = None) -> SequencePayload:
        """The K/V of tokens ``start .. end-1`` (None: to the end) of sequence ``seq_id`` as
        stored, with what another cache needs to take them (``kvcache.SequencePayload``: the
        arrays are this backend's, each (num_layers, end-start, num_kv_heads, head_dim); the
        copy is queued on the device, ``payload.to_numpy()`` waits for it). Raises
        SequenceNotFoundError, InvalidArgumentError for a range outside [0, length],
        ForwardStateError inside a forward or for an uncommitted token tree; changes nothing."""
        header, slots = self._export_range(seq_id, start, end)
        k, v = self._stored_rows(slots)
        return dataclasses.replace(header, k=k, v=v)

    def export_sequence_into(self, seq_id: int, start: int, end: int, k_out: np.ndarray,
                             v_out: np.ndarray) -> Optional[SequencePayload]:
        """``export_sequence`` with its K and V written into the host arrays ``k_out`` and
        ``v_out`` (C-contiguous, ``(num_layers, end-start, ...)`` in the payload's dtype), not
        new arrays: the header-only payload, or None (nothing written) where the backend or
        the format has no such path (``Backend.gather_kv_into``; then ``export_sequence``)."""
        if self.packed or self.scales is not None:
            return None
        header, slots = self._export_range(seq_id, start, end)
        if not self.backend.gather_kv_into(self.pages, slots, k_out, v_out):
            return None
        return header

    def export_sequences(self, seq_ids: Sequence[int], starts: Optional[Sequence[int]] = None,
                         *, layers: Optional[range] = None, run=None
                         ) -> tuple[list[SequencePayload], Array, Array]:
        """Several sequences' tails in one gather: ``(headers, k, v)`` with ``headers[i]`` the
        header-only payload of ``seq_ids[i]`` from ``starts[i]`` (None: 0) to its end, and
        ``k``, ``v`` (num_layers, total tokens, num_kv_heads, head_dim) holding their tokens
        one sequence after another (``kvcache.distributed`` sends them as they are). From fp8
        pages, as ``export_sequence``: ``k`` and ``v`` hold the values read back (``code *
        scale``) in the compute dtype, and each header the layer scales (``kv_scales``).
        ``layers``: a ``range`` of consecutive layers to gather (None: all); ``k`` and ``v``
        then hold ``len(layers)`` layers (a transfer sends a large batch a few layers at a
        time, gathering the next while the last is on the wire). Inside an open forward (its
        own thread) the sequences are as they will be after it, and ``layers`` must be layers
        the forward has written (``layers_run``): a transfer sends each layer while the next
        computes (ForwardStateError otherwise, and for sliding-window forwards, whose new
        tokens may take old tokens' slots). Errors as ``export_sequence``; a sequence listed
        twice is refused. ``layers=range(i, i)`` (empty): the headers alone, ``k`` and ``v``
        None (inside a forward too: what a transfer announces before the layers are written)."""
        headers_only = (isinstance(layers, range) and len(layers) == 0 and layers.step == 1
                        and 0 <= layers.start <= self.config.num_layers)
        layers = range(0, 0) if headers_only else self._layer_range(layers, "export_sequences")
        if run is not None:
            run.check_export(layers)
        seq_ids = seq_id_list(seq_ids, "seq_ids")
        starts = [0] * len(seq_ids) if starts is None else int_values(starts, "starts")
        if len(starts) != len(seq_ids):
            raise InvalidArgumentError(
                f"export_sequences got {len(seq_ids)} seq_ids but {len(starts)} starts")
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgumentError(f"export_sequences: seq_ids {seq_ids} repeat a sequence")
        key = (tuple(seq_ids), tuple(starts))
        if run is not None:
            known = run.exports.get(key)
        else:
            last = self._last_export
            known = (last[2] if last is not None and last[:2] == (self.state.epoch, key)
                     else None)
        if known is None:
            parts = [self._export_range(sid, st, None) for sid, st in zip(seq_ids, starts)]
            slots = (np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int32))
            known = [[p[0] for p in parts], slots, None]
            # a transfer inside the forward asks again for each layer (not with fp8 pages:
            # the headers carry scales this forward may still calibrate)
            if run is not None and self.scales is None:
                run.exports[key] = known
            elif run is None and self.scales is None:
                self._last_export = (self.state.epoch, key, known)
        headers, slots, dev = known
        if headers_only:
            return list(headers), None, None
        if dev is None:
            dev = known[2] = self.backend.aux_to_device(slots)
        k, v = self._stored_rows(slots, layers, dev)
        return list(headers), k, v

    def _payloads_supported(self, what: str) -> None:
        c = self.config
        if c.head_dim_v != c.head_dim:
            raise UnsupportedFeatureError(
                f"{what}: sequence payloads carry K and V with one head dim, but this cache has "
                f"head_dim={c.head_dim} and head_dim_v={c.head_dim_v} (not supported yet)")

    def _export_range(self, seq_id, start, end) -> tuple[SequencePayload, np.ndarray]:
        """(header-only payload, slots) of an export, validated."""
        seq = self.state.seq(seq_id)
        self._payloads_supported(f"export of sequence {seq.seq_id}")
        if not seq.committed:
            raise ForwardStateError(
                f"sequence {seq.seq_id} has {len(seq.tree_parent)} uncommitted token-tree tokens; "
                f"call commit_accepted_token_tree_nodes before exporting it")
        length = self.state.pt.length(seq)
        start = as_int(start, "start")
        end = length if end is None else as_int(end, "end")
        if not 0 <= start <= end <= length:
            raise InvalidArgumentError(
                f"export range [{start}, {end}) of sequence {seq.seq_id} must lie in "
                f"[0, {length}]")
        windowed = seq.window != -1
        header = SequencePayload(
            None, None, start=start, num_tokens=end - start, source_length=length,
            window_size=seq.window if windowed else -1,
            sink_size=seq.sink_request if windowed else 0,
            backend=self.backend.name, device=self.backend.device,
            kv_scales=None if self.scales is None else self.scales.for_payload(),
            **payload_fields(self.config))
        return header, self.state.pt.position_slots(seq, start, end)

    def import_sequence(self, seq_id: int, payload: SequencePayload, *,
                        parent_id: Optional[int] = None, fork_pos: Optional[int] = None,
                        convert_dtype: bool = False) -> None:
        """Add sequence ``seq_id`` holding ``payload``'s tokens (from ``export_sequence`` of
        any cache and backend; the page size may differ).

        Without ``parent_id`` the payload must start at token 0. With ``parent_id`` the new
        sequence forks from that sequence at ``fork_pos`` (default ``payload.start``; it must
        lie in ``[payload.start, payload.end]``): it shares the parent's first ``fork_pos``
        tokens (their pages, as ``fork_sequence``) and gets the payload's tokens from
        ``fork_pos`` on. The caller vouches that the parent's first ``fork_pos`` tokens are the
        source's; a payload with a sliding window shares only its sink tokens.
        ``convert_dtype``: accept a payload stored in another dtype (rounded to this cache's).
        An fp8 cache takes fp8 payloads: it adopts their scales for layers that have none and
        stores their values again (the source's codes); a layer with other scales refuses
        unless ``convert_dtype`` (docs/quantized-kv.md). A sliding window in the payload is
        enabled on the new sequence.
        Raises SequenceExistsError / SequenceNotFoundError for the ids, InvalidArgumentError
        for a payload this cache would store or read otherwise (layers, KV heads, head_dim,
        RoPE mode or settings, dtype) or a bad ``fork_pos``, UnsupportedFeatureError for an
        unknown format version, CacheFullError when the free pages do not suffice,
        ForwardStateError inside a forward; nothing changes then."""
        convert_dtype = bool_arg(convert_dtype, "convert_dtype")
        spec = self._import_spec(seq_id, payload, parent_id, fork_pos, convert_dtype)
        if payload.k is None or payload.v is None:
            raise InvalidArgumentError(
                f"import of sequence {spec.seq_id}: the payload has no arrays (a header-only "
                f"payload can only be reserved: reserve_import)")
        adopt = self._import_adopts(spec.seq_id, payload, convert_dtype, None)
        k, v, packed = self._native_kv(spec.seq_id, payload)
        res = self._reserve_import([spec])
        res.scales = dict(adopt)        # adopted by the commit only: a failure leaves none
        try:
            self._write_import(res, k, v, packed)
            self._commit_import(res)
        except BaseException:
            self.state.cancel_import(res)
            raise

    def _import_spec(self, seq_id, payload, parent_id, fork_pos, convert_dtype) -> ImportSpec:
        """The checked ``ImportSpec`` of importing ``payload`` as ``seq_id``."""
        seq_id = seq_id_arg(seq_id)
        if not isinstance(payload, SequencePayload):
            raise InvalidArgumentError(
                f"import of sequence {seq_id}: payload must be a kvcache.SequencePayload "
                f"(from export_sequence), got {type(payload).__name__}")
        self._payloads_supported(f"import of sequence {seq_id}")
        payload.check_fits(self.config, seq_id, convert_dtype)
        start, end = payload.start, payload.end
        if parent_id is None:
            if start != 0 or fork_pos not in (None, 0):
                raise InvalidArgumentError(
                    f"import of sequence {seq_id}: the payload starts at token {start} and "
                    f"fork_pos={fork_pos!r}; tokens before the payload's come from a parent: pass "
                    f"parent_id (and fork_pos in [{start}, {end}])")
            fork_pos = 0
        else:
            parent_id = seq_id_arg(parent_id, "parent_id")
            fork_pos = start if fork_pos is None else as_int(fork_pos, "fork_pos")
            if not start <= fork_pos <= end:
                raise InvalidArgumentError(
                    f"import of sequence {seq_id}: fork_pos {fork_pos} must lie in the payload's "
                    f"tokens [{start}, {end}] (the positions after the shared prefix)")
        return ImportSpec(seq_id, end - fork_pos, payload.window_size, payload.sink_size,
                          parent_id, fork_pos, skip=fork_pos - start)

    def _native_kv(self, seq_id: int, payload: SequencePayload) -> tuple[Array, Array, bool]:
        """``(k, v, packed)``: the payload's K and V as this backend's arrays, either packed
        rows of this cache's int8 / int4 format (``packed``: stored unchanged) or values in
        the dtype ``append_kv`` takes (the storage dtype; the compute dtype for quantized
        pages, which it quantizes)."""
        b, c = self.backend, self.config
        src = payload.array_dtype
        packed = (self.packed and payload.kv_dtype == c.kv_dtype and payload.dtype == c.dtype
                  and payload.kv_quant_group == c.kv_quant_group)
        kv = "uint8" if packed else c.dtype if c.kv_format.quantized else c.kv_dtype
        k, v = payload.k, payload.v
        if (payload.backend == b.name and payload.device == b.device and src == kv
                and b.is_native(k) and b.is_native(v)):
            return k, v, packed
        if (src == kv and type(k) is np.ndarray and type(v) is np.ndarray and b.is_native(k)
                and b.is_native(v) and b.dtype_name(k) == kv and b.dtype_name(v) == kv):
            # host arrays a host backend takes as they are (the reference backend's): the
            # write copies them into the pages; a from_numpy copy first (through float64 for
            # bfloat16) was most of a KV file's load
            return k, v, packed
        try:
            if payload.affine and not packed:       # converted: the values the rows read back
                hk, hv = payload.values()
            else:
                # (no host copy of host arrays in the right dtype: from_numpy copies them)
                hk, hv = (a if type(a) is np.ndarray and a.dtype == np_dtype(src)
                          else to_host(a, src) for a in (k, v))
            return b.from_numpy(hk, kv), b.from_numpy(hv, kv), packed
        except KVCacheError:
            raise
        except Exception as e:
            raise InvalidArgumentError(
                f"import of sequence {seq_id}: cannot read the payload's arrays "
                f"({type(k).__name__}): {e}") from None

    def _write_import(self, res: ImportReservation, k: Array, v: Array,
                      packed: bool = False, layers: Optional[range] = None,
                      tokens: Optional[range] = None) -> None:
        """Write ``k`` / ``v`` (the layers ``layers``, None: all; the reservation's tokens
        ``tokens``, None: all) at ``res.slots``: ``packed`` rows of this cache's int8 / int4
        format unchanged, else values in the dtype ``append_kv`` takes, which fp8 pages
        quantize with each layer's scales: the cache's, or those ``res`` adopts (checked
        first: ``KVScales.still_adoptable``)."""
        self._still_adoptable(res, "write_import")
        if res.num_tokens == 0 or (tokens is not None and len(tokens) == 0):
            return
        b = self.backend
        layers = range(self.config.num_layers) if layers is None else layers
        slots = b.aux_to_device(res.slots if tokens is None
                                else res.slots[tokens.start:tokens.stop])
        if packed or not self.config.kv_format.quantized:
            # rows stored as they come: one call for every layer (one launch where the backend
            # can; launches per layer were most of a small transfer's time)
            b.append_kv_layers([self.pages[layer] for layer in layers], k, v, slots,
                               **({"packed": True} if packed else {}))
            return
        for i, layer in enumerate(layers):
            quant = {} if self.scales is None else {"kv_scale": self.scales.for_import(layer, res)}
            b.append_kv(self.pages[layer], k[i], v[i], slots, **quant)

    def _commit_import(self, res: ImportReservation) -> None:
        """Commit ``res`` (checked first, its adopted scales too) and then, only then, adopt
        its fp8 scales."""
        b = self.backend
        adopt = [(layer, host, b.from_numpy(host, "float32"))
                 for layer, host in self._still_adoptable(res, "commit_import")]
        copies = self.state.commit_import(res)          # validates, then changes the tables
        for layer, host, device in adopt:
            self.scales.adopt(layer, host, device)     # type: ignore[union-attr]
        copy_pages(self.backend, self.pages, copies)

    def reserve_import(self, items: Sequence[tuple], convert_dtype: bool = False) -> ImportReservation:
        """The first phase of an import whose K/V arrives later (``kvcache.distributed``).

        ``items``: ``(seq_id, payload, parent_id, fork_pos)`` tuples as ``import_sequence``
        takes them (``payload`` may be header-only; an item may fork from an earlier item);
        ``convert_dtype`` as for ``import_sequence``. Checks everything ``import_sequence``
        checks and takes the pages; the sequences appear at ``commit_import`` after
        ``write_import``, or ``cancel_import`` gives the pages back. Between the two the pages
        count as used (forwards may run, but none may be open at a reserve or commit).

        An fp8 cache checks the payloads' scales as ``import_sequence`` does (a layer whose
        scales differ is refused unless ``convert_dtype``; a layer with no scales on either
        side refused for a payload with tokens) and adopts them for the layers that have none,
        all or nothing: the reservation holds the adopted scales (``reservation.scales``, the
        cache's to read: layer -> (2, Hkv) float32), ``write_import`` stores the values with
        them, and only ``commit_import`` makes them the cache's. ``cancel_import``, a refused
        write or commit, or a cleared cache leave the cache's scales as they were. Items
        adopting different scales for one layer are refused unless ``convert_dtype`` (then the
        first item's are adopted and the later items' values stored with them, rounded twice,
        as successive ``import_sequence`` calls would). The affine formats (int8 / int4) are
        taken as packed rows of this cache's format, group size and compute dtype
        (``write_import`` stores them unchanged)."""
        convert_dtype = bool_arg(convert_dtype, "convert_dtype")
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise InvalidArgumentError(
                f"reserve_import: items must be a list of (seq_id, payload, parent_id, fork_pos) "
                f"tuples, got {type(items).__name__}")
        for i, item in enumerate(items):
            if not isinstance(item, (tuple, list)) or len(item) != 4:
                raise InvalidArgumentError(
                    f"reserve_import: item {i} must be a (seq_id, payload, parent_id, fork_pos) "
                    f"tuple, got {item!r:.80}")
        specs = [self._import_spec(sid, p, parent, pos, convert_dtype)
                 for sid, p, parent, pos in items]
        pending: dict = {}              # layer -> (seq_id, host scales) the items adopt
        for spec, item in zip(specs, items):
            for layer, host in self._import_adopts(spec.seq_id, item[1], convert_dtype, pending):
                pending[layer] = (spec.seq_id, host)
        res = self._reserve_import(specs)
        res.scales = {layer: host for layer, (_, host) in pending.items()}
        return res

    def _reserve_import(self, specs) -> ImportReservation:
        ps = self.config.page_size
        return self.manager.with_room(lambda: self.state.reserve_import(specs),
                               lambda: sum(import_pages(s, ps) for s in specs) - self.state.pt.num_free)

    def write_import(self, reservation: ImportReservation, k: Array, v: Array, *,
                     layers: Optional[range] = None, tokens: Optional[range] = None) -> None:
        """Write a reservation's K/V: ``k``, ``v`` this backend's arrays of shape (num_layers,
        ``reservation.num_tokens``, num_kv_heads, head_dim), the items' payload tokens in order
        (queued on the device like any append), in the storage dtype; for fp8 pages in the
        compute dtype instead: the values (as ``export_sequences`` gives them), which are
        quantized with each layer's scales (the cache's, or those the reservation adopts).
        ``layers``: a ``range`` of consecutive layers that ``k`` and ``v`` hold (None: all;
        their first axis is then ``len(layers)``): a transfer writes each message's layers as
        it arrives. ``tokens``: a ``range`` of the reservation's tokens (in
        ``[0, reservation.num_tokens]``, step 1) that ``k`` and ``v`` hold (None: all; their
        second axis is then ``len(tokens)``): a KV file's load writes a few pages at a time,
        each as it is read. Raises InvalidArgumentError for other arrays or ranges, or when a
        layer whose scales the reservation adopts got other scales since (a forward
        calibrated them: cancel and import again); ForwardStateError inside a forward or for
        a closed reservation."""
        self.state.check_reservation(reservation, "write_import")
        layers = self._layer_range(layers, "write_import")
        n = reservation.num_tokens
        if tokens is not None and (not isinstance(tokens, range) or tokens.step != 1
                                   or not 0 <= tokens.start <= tokens.stop <= n):
            raise InvalidArgumentError(
                f"write_import of sequences {reservation.seq_ids}: tokens={tokens!r} must be "
                f"None or a range of consecutive tokens within [0, {n}]")
        b, c = self.backend, self.config
        want = (len(layers), n if tokens is None else len(tokens), c.num_kv_heads, c.head_dim)
        fmt = c.kv_format
        dtype = c.dtype if fmt.quantized else c.kv_dtype
        what = (f"{dtype} (the compute dtype: the values, which this {c.kv_dtype} cache "
                f"quantizes with the layer scales)" if fmt.quantized else dtype)
        if self.packed:
            want = want[:3] + (fmt.row_bytes(c.head_dim, c.dtype, c.kv_quant_group),)
            dtype, what = "uint8", f"uint8 (packed {c.kv_dtype} rows, as export_sequences gives)"
        for name, a in (("k", k), ("v", v)):
            if not b.is_native(a) or b.shape_of(a) != want or b.dtype_name(a) != dtype:
                got = (f"{b.dtype_name(a)} {b.shape_of(a)}" if b.is_native(a)
                       else type(a).__name__)
                raise InvalidArgumentError(
                    f"write_import of sequences {reservation.seq_ids}: {name} must be a {b.name} "
                    f"array {want} in {what}, got {got}")
        self._write_import(reservation, k, v, self.packed, layers, tokens)

    def commit_import(self, reservation: ImportReservation) -> None:
        """Make a reservation's sequences appear (their K/V written by then), and adopt the
        fp8 scales the reservation holds for layers that have none. Checks again that the
        ids are free, the parents there and the adopted scales still agree with the cache's
        (InvalidArgumentError when a forward calibrated a layer since); on error nothing
        changes and the reservation stays open."""
        self.state.check_reservation(reservation, "commit_import")
        self._commit_import(reservation)

    def cancel_import(self, reservation: ImportReservation) -> None:
        """Give a reservation's pages back (no-op when already committed or cancelled); the fp8
        scales it would have adopted go with it (the cache never held them)."""
        self.state.cancel_import(reservation)

    def _import_adopts(self, seq_id: int, payload, convert: bool, pending) -> list:
        """The (layer, host scales) an fp8 import adopts (``KVScales.import_adopts``)."""
        if self.scales is None:
            return []
        return self.scales.import_adopts(seq_id, payload, convert, pending)

    def _still_adoptable(self, res: ImportReservation, what: str) -> list:
        """``res``'s adopted scales the cache still lacks (``KVScales.still_adoptable``)."""
        return [] if self.scales is None else self.scales.still_adoptable(res, what)
