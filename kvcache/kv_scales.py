"""The fp8 scales of one cache (``CacheConfig(kv_dtype="float8_e4m3")``): per layer one (2,
num_kv_heads) float32 array, K's then V's, that a stored code times is the value read back.

A layer's scales come from ``set_kv_scales`` (kept by ``clear()``), from the first forward that
writes the layer (calibrated from its finite values; heads it cannot calibrate wait for later
forwards) or from an import (adopted at its commit). Once some bind stored codes they never
change: the codes would mean something else. ``PagedKVCache`` holds one ``KVScales`` for fp8
pages and None otherwise; its forwards, exports and imports ask it."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .core.validate import float_arg
from .errors import ForwardStateError, InvalidArgumentError
from .kv_quant import FP8_SCALE_LIMITS, fp8_calibration

FP8_CALIBRATION_FORWARDS = 8
"""Eager forwards that may calibrate an fp8 head in all (the first one that writes the layer
included): a head that only ever held zeros or NaN / inf by then keeps the provisional scale
(``kv_quant.FP8_PROVISIONAL_SCALE``), and the layer's forwards stop reading K/V back."""


class KVScales:
    """The fp8 scales of a cache's layers, and which heads still wait for a calibration.

    ``entries[layer]``: None (not set yet) or (host (2, Hkv) float32, backend array);
    ``pending[layer]``: None or (bool (2, Hkv): the heads no forward could calibrate yet, stored
    with the provisional scale; eager forwards left to try)."""

    def __init__(self, config, backend) -> None:
        self.config, self.backend = config, backend
        self.entries: list = [None] * config.num_layers
        self.pending: list = [None] * config.num_layers
        self.pinned: set = set()        # layers set_kv_scales gave scales (clear() keeps them)
        self.undo: dict = {}            # layer -> (entry, pending) before the open forward
        self._ones: Any = None

    # ------------------------------------------------------------------ reading
    def get(self, layer: int) -> Optional[tuple]:
        """``(k_scale, v_scale)`` of ``layer``, each a tuple of floats, or None while not set."""
        entry = self.entries[layer]
        return None if entry is None else (tuple(entry[0][0].tolist()), tuple(entry[0][1].tolist()))

    def for_payload(self) -> tuple:
        """A payload's ``kv_scales``: per layer ((K's), (V's)) or None."""
        return tuple(self.get(layer) for layer in range(self.config.num_layers))

    def fixed(self, layer: int) -> Optional[np.ndarray]:
        """Layer ``layer``'s host (2, Hkv) scales once some bind its stored codes; None while
        none do (never set, or every head still waiting for a forward to calibrate it: what
        such a head holds reads the same at any scale)."""
        entry, pending = self.entries[layer], self.pending[layer]
        if entry is None or (pending is not None and pending[0].all()):
            return None
        return entry[0]

    def all_calibrated(self) -> bool:
        """Every head of every layer has its scale (a captured step cannot calibrate one)."""
        return all(entry is not None and pending is None
                   for entry, pending in zip(self.entries, self.pending))

    def gather_kw(self, layers) -> dict:
        """``gather_kv``'s ``kv_scale`` keyword for ``layers``: per layer its scales (1.0 for
        a layer never written: nothing stored to read)."""
        return {"kv_scale": [self.ones() if entry is None else entry[1]
                             for entry in (self.entries[layer] for layer in layers)]}

    def ones(self) -> Any:
        """Scales of 1.0 on the device (made once): for rows no scale has bound yet."""
        if self._ones is None:
            self._ones = self.backend.from_numpy(
                np.ones((2, self.config.num_kv_heads), np.float32), "float32")
        return self._ones

    # ------------------------------------------------------------------ setting
    def set(self, layer: int, k_scale, v_scale) -> None:
        """``set_kv_scales`` after its checks of the cache: each scale one float > 0 or
        ``num_kv_heads`` of them, checked as the float32 it is stored as."""
        c = self.config
        if self.fixed(layer) is not None:
            raise InvalidArgumentError(
                f"set_kv_scales: layer {layer} has its scales already (set, imported or "
                f"calibrated when it was first written); its stored codes depend on them")
        lo, hi = FP8_SCALE_LIMITS
        rows = []
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            vals = value.tolist() if hasattr(value, "tolist") else value
            one = not isinstance(vals, (list, tuple))
            vals = [vals] * c.num_kv_heads if one else list(vals)
            if len(vals) != c.num_kv_heads:
                raise InvalidArgumentError(
                    f"set_kv_scales: {name} has {len(vals)} values, expected 1 or num_kv_heads="
                    f"{c.num_kv_heads}")
            row = []
            for head, x in enumerate(vals):
                what = f"set_kv_scales: {name}" + ("" if one else f"[{head}]")
                f = float_arg(x, what, positive=True)
                with np.errstate(over="ignore", under="ignore"):
                    f32 = float(np.float32(f))
                if not lo <= f32 <= hi:
                    raise InvalidArgumentError(
                        f"{what}={f!r} is {f32!r} as the float32 it is stored as; a scale must "
                        f"be in [{lo!r}, {hi!r}] after that cast (a normal float32 whose "
                        f"saturated code, 448 x scale, is finite)")
                row.append(f32)
            rows.append(row)
        self.put(layer, np.asarray(rows, np.float32))
        self.pending[layer] = None
        self.pinned.add(layer)

    def put(self, layer: int, host, device=None) -> None:
        """Make ``host`` (2, Hkv) float32 layer ``layer``'s scales (``device``: its copy on the
        device, made when not given)."""
        self.entries[layer] = (host, self.backend.from_numpy(host, "float32")
                               if device is None else device)

    def adopt(self, layer: int, host, device) -> None:
        """An import's commit: its scales become the layer's, every head calibrated."""
        self.put(layer, host, device)
        self.pending[layer] = None

    def forget(self) -> None:
        """``clear()``: calibrated and imported scales go, those ``set`` gave stay."""
        for layer in range(self.config.num_layers):
            if layer not in self.pinned:
                self.entries[layer] = None
            self.pending[layer] = None

    # ------------------------------------------------------------------ forwards
    def kernel_kw(self, plan, layer: int, k, v, positions, rope) -> dict:
        """The ``kv_scale`` keyword of layer ``layer``'s kernels, calibrating the layer's
        scales from this forward's ``k`` / ``v`` as they are stored (K rotated at ``positions``
        by ``rope`` where the cache applies RoPE as it writes: a rotation can raise a
        coordinate up to sqrt(2) times) when none are set, or those of its heads no forward
        could calibrate yet."""
        pending = self.pending[layer]
        if self.entries[layer] is None or pending is not None:
            if plan.static_bucket is None:
                self.calibrate(layer, k, v, positions, rope)
            elif self.entries[layer] is None:
                raise ForwardStateError(
                    f"layer {layer} has no fp8 scales, and a static-shape decode step (which "
                    f"may be captured) cannot calibrate them: set_kv_scales, or run an eager "
                    f"forward first (forward over sequences {plan.seq_ids})")
            else:
                # a captured step cannot look at its values: the heads still uncalibrated keep
                # the provisional scale for good (not undone by an abort either: a capture may
                # hold this scale array, which a later calibration would replace)
                self.pending[layer] = None
        return {"kv_scale": self.entries[layer][1]}

    def calibrate(self, layer: int, k, v, positions, rope) -> None:
        """Calibrate layer ``layer``'s scales, or its heads still uncalibrated, from this
        forward's ``k`` / ``v`` (``kv_quant.fp8_calibration``: finite values only, outliers
        clipped). A head left uncalibrated (all zeros, NaN, inf) keeps the provisional scale
        and is tried again by the next eager forwards that write the layer, up to
        ``FP8_CALIBRATION_FORWARDS`` in all, then keeps it for good (each try reads the
        layer's K/V back to the host). ``rollback`` undoes it."""
        b = self.backend
        if rope is not None:
            k = b.rope(k, positions, rope)
        (ks, k_ok), (vs, v_ok) = fp8_calibration(b.to_numpy(k)), fp8_calibration(b.to_numpy(v))
        new, ok = np.stack([ks, vs]), np.stack([k_ok, v_ok])
        entry, pending = self.entries[layer], self.pending[layer]
        self.undo.setdefault(layer, (entry, pending))
        host: Optional[np.ndarray]
        if entry is None:
            host, waiting, left = new, ~ok, FP8_CALIBRATION_FORWARDS
        else:
            waiting, left = pending
            take = waiting & ok
            host = np.where(take, new, entry[0]).astype(np.float32) if take.any() else None
            waiting = waiting & ~ok
        if host is not None:
            self.put(layer, host)
        left -= 1
        self.pending[layer] = (waiting, left) if waiting.any() and left > 0 else None

    def rollback(self) -> None:
        """``abort_forward``: the scales the forward calibrated are forgotten with it."""
        for layer, (entry, pending) in self.undo.items():
            self.entries[layer], self.pending[layer] = entry, pending
        self.undo = {}

    # ------------------------------------------------------------------ imports
    def import_adopts(self, seq_id: int, payload, convert: bool,
                      pending: Optional[dict] = None) -> list:
        """The (layer, host (2, Hkv) float32 scales) an import adopts: the payload's, for
        each layer whose scales are not set yet. ``pending``: layer -> (seq_id, host scales)
        that earlier items of the same reservation adopt; they count as this cache's (one
        reservation adopts one set of scales per layer, as successive ``import_sequence``
        calls would). Raises InvalidArgumentError for a layer whose scales differ from the
        payload's (its codes would change) unless ``convert`` (then stored again with the
        scales the layer has: rounded twice), and for a payload with tokens and no scales for
        a layer that has none either. Checks only; changes nothing."""
        if payload.kv_scales is None:
            return []
        pending = {} if pending is None else pending
        adopt = []
        for layer, theirs in enumerate(payload.kv_scales):
            fixed = self.fixed(layer)
            owner, mine = (None, fixed) if fixed is not None else pending.get(layer, (None, None))
            if theirs is None:
                if mine is None and self.entries[layer] is None and payload.num_tokens:
                    raise InvalidArgumentError(
                        f"import of sequence {seq_id}: the payload has no fp8 scales for layer "
                        f"{layer} and this cache has none either: its values cannot be stored")
                continue
            host = np.asarray(theirs, np.float32)
            if mine is None:
                adopt.append((layer, host))
            elif not np.array_equal(mine, host) and not convert:
                where = "" if owner is None else (
                    f" (adopted from sequence {owner}, earlier in this reservation)")
                raise InvalidArgumentError(
                    f"import of sequence {seq_id}: layer {layer}'s fp8 scales are "
                    f"{scales_text(mine)}{where}, the payload's {theirs}; pass "
                    f"convert_dtype=True to store its values again with those scales (rounded "
                    f"twice)")
        return adopt

    def still_adoptable(self, res, what: str) -> list:
        """The (layer, host scales) of ``res.scales`` that the cache still lacks, each checked
        against the layer's scales now: a forward may have calibrated the layer since the
        reservation, or ``set_kv_scales`` or another import set it. InvalidArgumentError when
        they differ from the reservation's (its values are stored with the payloads' scales:
        the codes would mean something else); equal scales need no adopting. Changes
        nothing."""
        out = []
        for layer, host in sorted(res.scales.items()):
            fixed = self.fixed(layer)
            if fixed is None:
                out.append((layer, host))
            elif not np.array_equal(fixed, host):
                raise InvalidArgumentError(
                    f"{what} of sequences {res.seq_ids}: layer {layer} got the fp8 scales "
                    f"{scales_text(fixed)} after the import was reserved (a forward "
                    f"calibrated them, or set_kv_scales or another import set them), but the "
                    f"reservation stores its values with the payloads' {scales_text(host)}: "
                    f"cancel_import, then import again (convert_dtype=True stores them with "
                    f"the cache's scales)")
        return out

    def for_import(self, layer: int, res) -> Any:
        """The device scales an import's values of ``layer`` are stored with: those ``res``
        adopts, else the layer's (its heads still waiting for a calibration then keep their
        provisional scale: a cancelled reservation does not undo this, it only ends the wait),
        else ``ones()`` (no item holds tokens with this layer's values: checked)."""
        if layer in res.scales:
            return self.backend.from_numpy(res.scales[layer], "float32")
        entry = self.entries[layer]
        if entry is not None:
            self.pending[layer] = None
            return entry[1]
        return self.ones()


def scales_text(host) -> str:
    """A layer's (2, Hkv) fp8 scales as ``kv_scales`` shows them: ((K's), (V's))."""
    return str((tuple(host[0].tolist()), tuple(host[1].tolist())))
