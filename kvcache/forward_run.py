"""``ForwardRun``: one open forward of a cache (FlashInfer's plan once, run per layer).

``PagedKVCache.begin_forward`` plans the step (the core reserves its pages) and returns a
``ForwardRun``, which owns what the step fixed: the plan, its index arrays on the device
(uploaded on first use), the RoPE recipe, the layers that ran and the watchers of the step.
``attention`` / ``append_kv`` validate one layer's call and run its kernels; the fp8 scales
come from the cache's ``KVScales``. The run is the caller's while its thread holds the cache:
every call checks that through the cache first, so a closed run or another thread's call gets
ForwardStateError."""

from __future__ import annotations

import functools
from typing import Any, Optional, Union

import numpy as np

from .backend import Capabilities
from .config import DTYPES
from .core.plan import ForwardAux, ForwardPlan
from .core.state import as_int
from .core.validate import bool_arg, float_arg, int_arg, int_values
from .errors import ForwardStateError, InvalidArgumentError, UnsupportedFeatureError

# A backend-native array (numpy.ndarray, torch.Tensor, mlx.core.array): the core never looks inside.
Array = Any


class ForwardRun:
    """The open forward ``plan`` of ``cache`` (made by ``begin_forward``; ``aux``: its index
    arrays when they were uploaded at plan time, as a static-shape step's are)."""

    def __init__(self, cache, plan: ForwardPlan, aux: Optional[ForwardAux]) -> None:
        self.cache, self.plan, self.aux = cache, plan, aux
        c = cache.config
        self.config, self.backend, self.pages = c, cache.backend, cache.pages
        self.scales = cache.scales
        mode = c.effective_rope_mode
        rope = cache.rope
        self.rope_on_write = rope if mode == "normal" else None    # K rotated as it is stored
        self.rope_inline = rope if mode == "inline" else None      # rotated inside attention
        # window groups: layer -> (group index, window) of each windowed layer
        self.windowed = layer_windows(c) if c.layer_kinds else {}
        # state layers: {layer: State}, and this forward's writes {(layer, name): values},
        # scattered into the slots at end_forward only (an aborted forward leaves the states)
        self.state_layers = c.state_layers if c.layer_kinds else {}
        self.staged: dict = {}
        self.state_index = None     # the forward's slots on the device (first state call)
        # state checkpoints: the boundaries the forward passes ((row, position), computed on
        # first use), and the states the model gave at the ones inside its appends
        self.wanted: Optional[list] = None
        self.inner: Optional[list] = None
        self.staged_checkpoints: dict = {}
        self.layers_done: set = set()
        self.watchers: list = []
        self.exports: dict = {}     # (ids, starts) -> [headers, slots, device slots]

    def _open(self, what: str) -> ForwardPlan:
        """This run's plan, if it is the cache's open forward and the calling thread holds it."""
        if self.cache._checked_run(what) is not self:
            raise ForwardStateError(f"{what}: this forward was closed (end_forward or abort_forward)")
        return self.plan

    # ------------------------------------------------------------------ state
    @property
    def static_bucket(self) -> Optional[int]:
        """The batch bucket of a static-shape decode step, the token bucket of a static-shape
        mixed step (``plan.static_mixed`` tells which): q/k/v may have this many rows, padded
        rows give zeros. None for an eager forward."""
        return self.plan.static_bucket

    def device_aux(self) -> ForwardAux:
        """Upload this forward's index arrays on first use (lazy; see core.aux)."""
        if self.aux is None:
            self.aux = self.cache.aux_manager.upload(self.plan)
        return self.aux

    def forward_aux(self) -> ForwardAux:
        """The forward's index arrays on the device (``ForwardAux``, read-only), copying
        them now if no call has yet."""
        self._open("forward_aux")
        return self.device_aux()

    def query_positions(self) -> Array:
        """RoPE position of each new token of the forward (device int32 array).

        The array belongs to the forward: it holds these positions until the next
        ``begin_forward`` and may be overwritten after (on merged-aux backends, cuda and rocm,
        it is a view into the forward's index buffer, which a later forward refills). Copy
        it (``kvcache.to_numpy``, ``.clone()``) to keep it longer."""
        self._open("query_positions")
        return self.device_aux().tokens.q_positions

    def rerun_layers(self, layers=None) -> None:
        """Let ``layers`` (None: every layer) of the forward run attention again: capture
        helpers run one step's layers several times (warm-up, capture). Appending the same
        K/V again writes the same rows, so the repeated runs leave the cache as one run."""
        self._open("rerun_layers")
        self.layers_done = set() if layers is None else self.layers_done - set(
            self._layer_list(layers, "rerun_layers"))

    def mark_layers_run(self, layers) -> None:
        """Record that ``layers`` ran attention in the forward without ``attention`` being
        called: a replayed capture of a step ran them."""
        self._open("mark_layers_run")
        self.written(sorted(set(self._layer_list(layers, "mark_layers_run")) - self.layers_done))

    def watch_forward(self, watcher) -> None:
        """Tell ``watcher`` about the forward as it runs: ``watcher.layer_written(layer)``
        after each layer's K/V is written (queued on the device; an ``attention``,
        ``append_kv`` or ``mark_layers_run`` call), ``watcher.forward_closed(committed)`` when
        it ends (True) or is aborted (False); then the watcher is dropped. What a watcher
        raises propagates from that call (after the layer counts as run; after the forward
        closed). ``kvcache.distributed.send_sequence`` inside a forward watches it to send
        each layer while the next computes."""
        self._open("watch_forward")
        self.watchers.append(watcher)

    def written(self, layers: list) -> None:
        self.layers_done.update(layers)
        for watcher in list(self.watchers):
            for layer in layers:
                watcher.layer_written(layer)

    def missing_layers(self) -> list:
        """The attention layers that have not run (``end_forward`` needs none)."""
        return sorted(set(range(self.config.num_layers)) - self.layers_done
                      - set(self.state_layers))

    def missing_states(self) -> list:
        """``"layer <l> <name>"`` of each state not written in this forward (``end_forward``
        needs none)."""
        return [f"layer {layer} {name!r}" for layer, kind in self.state_layers.items()
                for name in kind.names if (layer, name) not in self.staged]

    # ------------------------------------------------------------------ state layers
    def get_state(self, layer_id: int, name: str) -> Array:
        """The states ``name`` of state layer ``layer_id`` of the forward's sequences, in
        ``begin_forward`` order: an array ``(B, *shape)`` in the cache dtype, ``shape`` the
        layer's ``State.shape(name)`` and row ``i`` the state of ``seq_ids[i]`` after its
        last token (zeros for a sequence no forward has written yet). A new array: changing it
        changes no state. After ``set_state(layer_id, name, ...)`` in the same forward it is
        the array written (read your writes).

        A model's recurrent layer reads its states here, computes, and writes them back with
        ``set_state``: what mlx-lm's ``ArraysCache`` and transformers' hybrid caches hold.
        Raises InvalidArgumentError for a layer that is not a state layer or a name it has
        not, ForwardStateError outside a forward."""
        plan = self._open("get_state")
        layer_id, name = self._state_arg(plan, layer_id, name, "get_state")
        staged = self.staged.get((layer_id, name))
        if staged is not None:
            return staged
        return self.backend.gather_state(self.cache.state_arrays.arrays[layer_id][name],
                                         self._state_index(plan))

    def set_state(self, layer_id: int, name: str, values: Array) -> None:
        """Write the states ``name`` of state layer ``layer_id`` for the forward's sequences:
        ``values`` ``(B, *shape)``, a backend array in the cache dtype, row ``i`` the state of
        ``seq_ids[i]`` after this forward's tokens. Staged: the slots take it at
        ``end_forward`` (an aborted forward leaves every state as it was), so the cache reads
        ``values`` then: do not change it in place before. A second call for the same state
        replaces the first. ``end_forward`` needs every state of every state layer written.
        Raises InvalidArgumentError for the layer, the name, the type, shape or dtype,
        ForwardStateError outside a forward."""
        plan = self._open("set_state")
        layer_id, name = self._state_arg(plan, layer_id, name, "set_state")
        want = (len(plan.seq_ids),) + self.state_layers[layer_id].shape(name)
        self._check_values(f"set_state({layer_id}, {name!r})", values, want,
                           f"one state per sequence of {plan.seq_ids}", layer_id)
        self.staged[layer_id, name] = values

    def _check_values(self, what: str, values, want: tuple, rows: str, layer: int) -> None:
        """InvalidArgumentError unless ``values`` is a backend array of shape ``want`` in the
        dtype of state layer ``layer``'s states (``rows``: what its rows are, for the
        message)."""
        b = self.backend
        if not b.is_native(values):
            raise InvalidArgumentError(
                f"{what}: values must be a {b.name} backend array (use cache.from_numpy), got "
                f"{type(values).__name__}")
        if b.shape_of(values) != want:
            raise InvalidArgumentError(
                f"{what}: values has shape {b.shape_of(values)}, expected {want} ({rows})")
        dtype = self.state_layers[layer].storage(self.config.dtype)
        if b.dtype_name(values) != dtype:
            raise InvalidArgumentError(
                f"{what}: values has dtype {b.dtype_name(values)}, the cache stores these "
                f"states in {dtype}")

    def _wanted(self) -> list:
        if self.wanted is None:
            self.wanted = self.cache.manager.checkpoint_positions(self.plan)
        return self.wanted

    def _inner(self) -> list:
        """The wanted boundaries inside the appends (not at a sequence's new end)."""
        if self.inner is None:
            ends = self._ends()
            self.inner = [(row, p) for row, p in self._wanted() if p != ends[row]]
        return self.inner

    def _ends(self) -> np.ndarray:
        pt = self.cache.state.pt
        return pt.s_len[[pt.seqs[int(s)].slot for s in self.plan.seq_ids]]

    def state_checkpoints(self) -> tuple:
        """The boundaries inside this forward's appends whose states the cache would keep as
        prefix-cache checkpoints (``CacheConfig.state_checkpoint_interval`` pages apart):
        ``((row, n), ...)``, ``row`` the sequence's index in the forward (``begin_forward``
        order) and ``n`` (``0 < n < append_lengths[row]``) how many of its new tokens come
        before the boundary: the state wanted is the one after its first ``n`` new tokens.
        A boundary at a sequence's new end is kept from ``set_state`` itself and is not
        listed. Empty without the prefix cache or state layers. A model that can compute
        these states passes them to ``set_state_checkpoints``, so that later prompts sharing
        a shorter prefix hit too; one that does not loses only those hits. Raises
        ForwardStateError outside a forward."""
        self._open("state_checkpoints")
        ends, appends = self._ends(), self.plan.append_lengths
        return tuple((row, int(p - ends[row] + appends[row])) for row, p in self._inner())

    def set_state_checkpoints(self, layer_id: int, name: str, values: Array) -> None:
        """The states ``name`` of state layer ``layer_id`` at the ``state_checkpoints()``
        positions: ``values`` ``(n, *shape)``, a backend array in the cache dtype, row ``j``
        the state of ``state_checkpoints()[j]``. Staged and read at ``end_forward``, as
        ``set_state``'s; the checkpoints are kept only when every state of every state layer
        was given (else none of this forward's inner ones). Raises InvalidArgumentError for
        the layer, the name, the type, shape or dtype, ForwardStateError outside a forward."""
        plan = self._open("set_state_checkpoints")
        layer_id, name = self._state_arg(plan, layer_id, name, "set_state_checkpoints")
        want = (len(self._inner()),) + self.state_layers[layer_id].shape(name)
        self._check_values(f"set_state_checkpoints({layer_id}, {name!r})", values, want,
                           "one state per position of state_checkpoints()", layer_id)
        self.staged_checkpoints[layer_id, name] = values

    def commit_checkpoints(self) -> None:
        """After ``end_forward`` indexed the forward's pages: the boundaries it passed whose
        nodes hold no checkpoint yet take the states (queued device copies): those at a
        sequence's new end from its slot, the others from ``set_state_checkpoints``."""
        wanted = self._wanted()
        keep = self.cache.manager.keep_checkpoints(self.plan, wanted)
        if not keep:
            return
        arrays = self.cache.state_arrays
        ends, slot = self._ends(), self.cache.state.slots.slot
        inner = {w: j for j, w in enumerate(self._inner())}
        given = all((layer, name) in self.staged_checkpoints
                    for layer, kind in self.state_layers.items() for name in kind.names)
        at_end = [(ck, slot[int(self.plan.seq_ids[wanted[i][0]])]) for i, ck in keep
                  if wanted[i][1] == ends[wanted[i][0]]]
        inside = [(ck, inner[wanted[i]]) for i, ck in keep if wanted[i] in inner]
        if at_end:
            rows, picks = zip(*at_end)
            arrays.save(np.array(rows, np.int32), arrays.arrays, np.array(picks, np.int32))
        if inside and given:
            rows, picks = zip(*inside)
            source: dict = {}
            for (layer, name), values in self.staged_checkpoints.items():
                source.setdefault(layer, {})[name] = values
            arrays.save(np.array(rows, np.int32), source, np.array(picks, np.int32))
        elif inside:            # not given: the rows taken for them go back
            self.cache.manager.drop_checkpoints([ck for ck, _ in inside])

    def commit_states(self) -> None:
        """``end_forward``: scatter the staged states into the forward's slots."""
        if not self.staged:
            return
        index = self._state_index(self.plan)
        arrays = self.cache.state_arrays.arrays
        for (layer, name), values in self.staged.items():
            self.backend.scatter_state(arrays[layer][name], index, values)

    def _state_index(self, plan: ForwardPlan):
        """The forward's sequences' slots, an int32 device array (uploaded once)."""
        if self.state_index is None:
            slot = self.cache.state.slots.slot
            self.state_index = self.backend.aux_to_device(
                np.array([slot[int(s)] for s in plan.seq_ids], np.int32))
        return self.state_index

    def _state_arg(self, plan: ForwardPlan, layer_id, name, what: str) -> tuple:
        """``(layer, name)`` checked: a state layer and one of its state names."""
        layer_id = layer_arg(layer_id, self.config.num_layers, f"{what}: layer_id")
        kind = self.state_layers.get(layer_id)
        if kind is None:
            raise InvalidArgumentError(
                f"{what}: layer {layer_id} is not a state layer (state layers: "
                f"{sorted(self.state_layers)}; CacheConfig.layer_kinds)")
        if not isinstance(name, str) or name not in kind.names:
            raise InvalidArgumentError(
                f"{what}: layer {layer_id} has the states {list(kind.names)}, not {name!r:.40}")
        return layer_id, name

    def close(self, committed: bool) -> None:
        """The forward ended (``committed``) or was aborted: free its index buffer for the
        next copy and tell the watchers."""
        if self.aux is not None:    # the next copy into that aux buffer waits for its readers
            self.cache.aux_manager.release()
        watchers, self.watchers = self.watchers, []
        for watcher in watchers:
            watcher.forward_closed(committed)

    def _layer_list(self, layers, what: str) -> list:
        n = self.config.num_layers
        if isinstance(layers, (set, frozenset)):         # e.g. ``layers_run``: order is moot
            layers = list(layers)
        out = int_values(layers, f"{what}: layers")      # None, a string, floats: typed errors
        bad = [layer for layer in out if not 0 <= layer < n]
        if bad:
            raise InvalidArgumentError(f"{what}: layers {bad} are not in [0, {n})")
        return out

    # ------------------------------------------------------------------ reads inside a forward
    def check_read(self, seq, layer: int, end: int, length: int) -> None:
        """ForwardStateError unless tokens ``.. end-1`` of ``seq`` hold layer ``layer``'s K/V
        now (``get_kv`` inside the forward)."""
        plan = self.plan
        if plan.write_after:
            raise ForwardStateError(
                f"get_kv(layer={layer}) inside a forward over sliding-window sequences "
                f"({plan.seq_ids}): a new token may take the slot of an old one")
        written = length
        if seq.seq_id in plan.seq_ids and layer not in self.layers_done:
            written -= int(plan.append_lengths[plan.seq_ids.index(seq.seq_id)])
        if end > written:
            raise ForwardStateError(
                f"get_kv range up to {end} of sequence {seq.seq_id} reaches this forward's new "
                f"tokens (from {written}), which layer {layer} has not written yet (attention "
                f"or append_kv first)")

    def check_export(self, layers: range) -> None:
        """ForwardStateError unless ``layers`` may be exported inside the forward: written
        already, and no sliding-window forward (its new tokens may take old tokens' slots)."""
        plan = self.plan
        unwritten = sorted(set(layers) - self.layers_done)
        if plan.write_after or unwritten:
            raise ForwardStateError(
                f"export_sequences inside the forward over sequences {plan.seq_ids}: "
                + ("a sliding-window forward's new tokens may take old tokens' slots"
                   if plan.write_after else f"layers {unwritten} are not written yet "
                   f"(attention or append_kv first)"))

    # ------------------------------------------------------------------ layers
    def attention(self, layer_id: int, q: Array, k: Array, v: Array,
                  sm_scale: Optional[float] = None, return_lse: bool = False,
                  window_left: int = -1, logit_softcap: Optional[float] = None,
                  sinks: Optional[Array] = None) -> Union[Array, tuple[Array, Array]]:
        """Write layer ``layer_id``'s new K/V into the cache and attend: each new token's query
        over its sequence's history and the new tokens before it (its tree ancestors in a
        token tree, the window and sinks of a sliding window).

        ``q``: (T, num_qo_heads, head_dim), ``k``: (T, num_kv_heads, head_dim), ``v``: (T,
        num_kv_heads, head_dim_v), backend arrays in the cache dtype, rows in ``begin_forward``
        order (a static-shape step may pass ``static_bucket`` rows; padded rows give zeros);
        ``sm_scale``: logit scale (default ``head_dim ** -0.5``); ``window_left``: -1 (every
        key), or ``w >= 0``: a query at position ``p`` sees only keys at positions ``p - w ..
        p`` (FlashInfer's ``window_left``; capability ``window_left``; not with a token tree;
        a per-call value, so sliding and full layers mix in one forward); any ``w >=
        num_pages * page_size`` (no sequence is that long: every key is in the window) is
        taken as -1, on every backend. Positions are the
        cache's (``query_positions``). ``logit_softcap``: None, or ``c > 0``: each score
        ``s = q . k * sm_scale`` becomes ``c * tanh(s / c)`` before the softmax (capability
        ``logit_softcap``). ``sinks``: None, or a backend array of ``num_qo_heads`` logits
        (float) that join each query head's softmax denominator and carry no value (learned
        attention sinks; capability ``attention_sinks``); the lse includes them.
        Returns ``o`` (T, num_qo_heads, head_dim_v), with ``return_lse`` also ``lse``
        (T, num_qo_heads) float32. Each layer runs once per forward."""
        plan = self._open("attention")
        c = self.config
        layer_id = as_int(layer_id, "layer_id")
        return_lse = bool_arg(return_lse, "return_lse")
        scale = c.head_dim ** -0.5 if sm_scale is None else float_arg(sm_scale, "sm_scale")
        window_left = self._window_left(plan, window_left, layer_id)
        softcap = self._softcap(plan, logit_softcap)
        self._layer_to_run(layer_id)
        total = plan.total_tokens
        self._check_input("q", q, c.num_qo_heads, total)
        rows = self.backend.shape_of(q)[0]
        self._check_input("k", k, c.num_kv_heads, rows)
        self._check_input("v", v, c.num_kv_heads, rows, c.head_dim_v)
        self._check_sinks(plan, sinks)
        o, lse = self._attend(plan, self.device_aux(), layer_id, q, k, v, scale, window_left,
                              softcap, sinks)
        self.written([layer_id])                # a layer that raised has not run
        return (o, lse) if return_lse else o

    def append_kv(self, layer_id: int, k: Array, v: Array) -> None:
        """Write layer ``layer_id``'s new K/V into the cache without attending: for a model
        that computes its attention itself over ``get_kv(seq_id, layer=layer_id)`` (e.g. its own
        soft-capped or latent attention). It counts as the layer's run in this forward.

        ``k``: (T, num_kv_heads, head_dim), ``v``: (T, num_kv_heads, head_dim_v), backend arrays
        in the cache dtype, rows in ``begin_forward`` order (or ``static_bucket`` rows). With
        ``rope_mode="normal"`` K is rotated at its position on the way in, as in
        ``attention``. Raises InvalidArgumentError for shapes, dtypes or the layer,
        ForwardStateError outside a forward or for a layer that already ran."""
        plan = self._open("append_kv")
        c = self.config
        layer_id = self._layer_to_run(layer_id)
        self._check_input("k", k, c.num_kv_heads, plan.total_tokens)
        rows = self.backend.shape_of(k)[0]
        self._check_input("v", v, c.num_kv_heads, rows, c.head_dim_v)
        aux = self.device_aux()
        positions, slots = self._write_rows(plan, aux, rows)
        if layer_id in self.windowed:              # its window group's pages
            slots = aux.groups[self.windowed[layer_id][0]].append_slots
        quant = self._quant(plan, layer_id, k, v, positions)
        if self.rope_on_write is not None:
            self.backend.append_kv(self.pages[layer_id], k, v, slots, positions,
                                   self.rope_on_write, **quant)
        else:
            self.backend.append_kv(self.pages[layer_id], k, v, slots, **quant)
        self.written([layer_id])

    def attention_with_fused_qkv(self, layer_id: int, qkv: Array, sm_scale: Optional[float] = None,
                                 return_lse: bool = False, window_left: int = -1,
                                 logit_softcap: Optional[float] = None,
                                 sinks: Optional[Array] = None) -> Union[Array, tuple[Array, Array]]:
        """``attention`` with q, k, v packed in ``qkv`` (T, num_qo_heads + 2*num_kv_heads,
        head_dim), in that order along the heads; ``layer_id``, ``sm_scale``, ``return_lse``,
        ``window_left``, ``logit_softcap`` and ``sinks`` as there, and so is the result.
        Needs ``head_dim_v == head_dim`` (else InvalidArgumentError)."""
        plan = self._open("attention_with_fused_qkv")
        c = self.config
        if c.head_dim_v != c.head_dim:
            raise InvalidArgumentError(
                f"attention_with_fused_qkv packs q, k and v with one head dim, but the cache has "
                f"head_dim={c.head_dim} and head_dim_v={c.head_dim_v}; call attention(q, k, v)")
        self._check_input("qkv", qkv, c.num_qo_heads + 2 * c.num_kv_heads, plan.total_tokens)
        q, k, v = self.backend.split_qkv(qkv)
        return self.attention(layer_id, q, k, v, sm_scale, return_lse, window_left,
                              logit_softcap, sinks)

    def _attend(self, plan: ForwardPlan, aux: ForwardAux, layer: int, q, k, v, scale,
                window_left: int, softcap: float, sinks):
        b, pages, tokens = self.backend, self.pages[layer], aux.tokens
        inline = self.rope_inline
        positions, slots = self._write_rows(plan, aux, b.shape_of(q)[0])
        depths = aux.depths
        if layer in self.windowed:
            # a windowed layer: its group's pages (``pages`` is that pool already), the new
            # tokens' slots there and one depth over each sequence's live keys
            group = aux.groups[self.windowed[layer][0]]
            slots, depths = group.append_slots, (group.depth,)
        # quantized pages: every kernel reads K/V as stored, the forward's own rows included
        quant = self._quant(plan, layer, k, v, positions)
        if not plan.write_after:
            if self.rope_on_write is not None:
                q, k = b.rope_append(pages, q, k, v, slots, positions, self.rope_on_write,
                                     **quant)
            else:
                b.append_kv(pages, k, v, slots, **quant)
        # the features go to a kernel only when used: a backend without the capability never
        # sees their keywords; the sinks go to the first call only (partials merge by lse:
        # the sink counts once)
        features = _features(window_left, softcap)
        o = lse = None
        if not plan.paged_only:
            o, lse = b.ragged_attention(q, k, v, tokens.qo_indptr, scale,
                                        num_seqs=len(plan.seq_ids), max_len=plan.max_append,
                                        tree=tokens.self_tree, rope=inline, q_positions=positions,
                                        k_rope_offset=tokens.k_rope_offset, **quant,
                                        **features, **_sinks(sinks))
        for depth in depths:
            if depth.num_pages == 0 and plan.static_bucket is None:
                continue
            o_d, lse_d = b.paged_attention(q, pages, depth, scale, rope=inline,
                                           q_positions=positions, **quant, **features,
                                           **_sinks(sinks if o is None else None))
            if o is None:
                o, lse = o_d, lse_d
            else:
                o, lse = b.merge_attention(o, lse, o_d, lse_d)
        if plan.write_after:
            b.append_kv(pages, k, v, slots, **quant)
        return o, lse

    def _quant(self, plan, layer: int, k, v, positions) -> dict:
        """The kernels' ``kv_scale`` keyword ({} unless fp8 pages)."""
        if self.scales is None:
            return {}
        return self.scales.kernel_kw(plan, layer, k, v, positions, self.rope_on_write)

    @staticmethod
    def _write_rows(plan: ForwardPlan, aux: ForwardAux, rows: int):
        """(positions, slots) of the ``rows`` input rows: a static-shape step's arrays cut to
        unpadded inputs (run eagerly)."""
        positions, slots = aux.tokens.q_positions, aux.tokens.append_slots
        if plan.static_bucket is not None and rows != plan.static_bucket:
            positions, slots = positions[:rows], slots[:rows]
        return positions, slots

    # ------------------------------------------------------------------ checks
    def _window_left(self, plan: ForwardPlan, window_left, layer=None) -> int:
        """The validated ``window_left`` of an attention call: -1 (no window) or an int in
        ``[0, num_pages * page_size)``. No sequence holds more tokens than the cache has slots,
        so a window of that many positions or more sees every key: it is -1, decided here
        once, so no backend sees a value beyond int32 (2**31, 2**64-1: overflow, or a wrong
        window) and one without the capability runs it. A windowed ``layer``
        (``CacheConfig.layer_kinds``) takes its group's window ``w`` for -1 and refuses one
        above ``w`` (its keys below ``p - w`` are freed)."""
        group = self.windowed.get(layer) if self.windowed else None
        if type(window_left) is int and window_left == -1:     # the default: nothing to check
            if group is None:
                return -1
            window_left = group[1]
        try:
            window_left = int_arg(window_left, "window_left", lo=-1, limit="-1: no window")
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{exc} (forward over sequences {plan.seq_ids})") from None
        if group is not None:
            if window_left == -1:
                window_left = group[1]
            elif window_left > group[1]:
                raise InvalidArgumentError(
                    f"window_left={window_left} for layer {layer}, a layer of window group "
                    f"Window({group[1]}): the group frees the keys a window above {group[1]} "
                    f"would see; pass at most {group[1]} (-1: the group's)")
        if window_left >= self.config.num_pages * self.config.page_size:
            return -1
        if window_left >= 0:
            self._need(plan, "window_left", f"window_left={window_left}")
            # a static-shape mixed step's trees are chains (causal): positions order its keys
            if plan.tokens.self_tree is not None or any(
                    d.tree is not None and not d.tree.chains for d in plan.depths):
                raise UnsupportedFeatureError(
                    f"window_left={window_left} with a token tree (forward over sequences "
                    f"{plan.seq_ids}): tree attention has no per-query window")
        return window_left

    def _softcap(self, plan: ForwardPlan, logit_softcap) -> float:
        """The validated soft cap of an attention call: 0.0 (off) or a finite float > 0."""
        if logit_softcap is None:
            return 0.0
        try:
            cap = float_arg(logit_softcap, "logit_softcap", positive=True)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{exc} (forward over sequences {plan.seq_ids})") from None
        self._need(plan, "logit_softcap", f"logit_softcap={cap}")
        return cap

    def _need(self, plan: ForwardPlan, capability: str, what: str) -> None:
        """UnsupportedFeatureError naming ``what``, the forward and the capability, unless the
        backend declares ``capability``."""
        if not getattr(self.cache.capabilities, capability):
            raise UnsupportedFeatureError(
                f"backend {self.backend.name!r} does not support {what} (forward over sequences "
                f"{plan.seq_ids}): {Capabilities.reason(capability)}")

    def _check_sinks(self, plan: ForwardPlan, sinks) -> None:
        if sinks is None:
            return
        b, heads = self.backend, self.config.num_qo_heads
        self._need(plan, "attention_sinks", "attention sinks")
        if not b.is_native(sinks):
            raise InvalidArgumentError(
                f"sinks must be a {b.name} backend array of {heads} logits (use cache.from_numpy), "
                f"got {type(sinks).__name__}")
        if b.shape_of(sinks) != (heads,) or b.dtype_name(sinks) not in DTYPES:
            raise InvalidArgumentError(
                f"sinks has shape {b.shape_of(sinks)} and dtype {b.dtype_name(sinks)}, expected "
                f"({heads},) (one logit per query head) of one of {DTYPES}")

    def _check_input(self, name, array, heads, total, dim=None):
        """InvalidArgumentError unless ``array`` is a native array of shape ``(total, heads,
        dim)`` (or the static-shape bucket's rows) in the cache dtype."""
        b, c = self.backend, self.config
        dim = c.head_dim if dim is None else dim
        if not b.is_native(array):
            raise InvalidArgumentError(
                f"{name} must be a {b.name} backend array (use cache.from_numpy), got {type(array).__name__}")
        shape = b.shape_of(array)
        plan = self.plan
        bucket = plan.static_bucket
        if shape != (total, heads, dim) and (bucket is None or shape != (bucket, heads, dim)):
            padded = f" (or {bucket} rows: the static-shape bucket)" if bucket is not None else ""
            raise InvalidArgumentError(
                f"{name} has shape {shape}, expected ({total}, {heads}, {dim}){padded} "
                f"for {total} new tokens of sequences {plan.seq_ids}")
        if b.dtype_name(array) != c.dtype:
            raise InvalidArgumentError(f"{name} has dtype {b.dtype_name(array)}, the cache stores {c.dtype}")

    def _layer_to_run(self, layer_id) -> int:
        """``layer_id`` as an int in [0, num_layers) that has not run in this forward (typed
        errors otherwise): the layer an ``attention`` or ``append_kv`` call runs."""
        layer_id = layer_arg(layer_id, self.config.num_layers, "layer_id")
        if layer_id in self.state_layers:
            raise InvalidArgumentError(
                f"layer {layer_id} is a state layer ({self.state_layers[layer_id]}): it has no "
                f"K/V; it reads and writes its states (get_state / set_state)")
        if layer_id in self.layers_done:
            raise ForwardStateError(f"layer {layer_id} already ran attention in this forward")
        return layer_id


@functools.lru_cache(maxsize=32)
def layer_windows(config) -> dict:
    """``{layer: (group index, window)}`` of the windowed layers of ``config``."""
    return {layer: (g, kind.size) for g, (kind, layers) in enumerate(config.window_groups)
            for layer in layers}


def layer_arg(layer_id, num_layers: int, what: str) -> int:
    """``layer_id`` as an int in [0, num_layers); InvalidArgumentError naming ``what``."""
    layer_id = as_int(layer_id, what)
    if not 0 <= layer_id < num_layers:
        raise InvalidArgumentError(f"{what} {layer_id} must be in [0, {num_layers})")
    return layer_id


def _features(window_left: int, softcap: float) -> dict:
    """The optional keywords of an attention kernel call that are in use."""
    if window_left < 0 and not softcap:
        return {}
    out: dict = {"window_left": window_left} if window_left >= 0 else {}
    if softcap:
        out["logit_softcap"] = softcap
    return out


def _sinks(sinks) -> dict:
    return {} if sinks is None else {"sinks": sinks}
