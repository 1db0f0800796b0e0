"""Bad input, atomicity (a call that raises changes nothing), capability enforcement and the
backend's own discovery contract."""

from __future__ import annotations

from .base import Conformance

import numpy as np
import pytest

import kvcache
from kvcache import (CacheFullError, ForwardStateError, InvalidArgumentError, SequenceExistsError,
                     SequenceNotFoundError, UnsupportedFeatureError)


class TestBadInput(Conformance):
    """Invalid calls raise the documented error on both caches and change nothing: unknown or
    duplicate sequence ids, out-of-range positions and lengths, malformed ``begin_forward``
    batches, ``attention`` inputs of the wrong shape, dtype or layer, calls made in the wrong
    forward state, bad token trees and bad sliding-window settings. Each case is followed by
    work that must still run as if the refused call never happened."""

    def test_sequence_ids(self, busy):
        p = busy
        p.expect_error(SequenceExistsError, "add_sequence", 0)
        p.expect_error(SequenceNotFoundError, "remove_sequence", 9)
        p.expect_error(SequenceNotFoundError, "fork_sequence", 9, 10)
        p.expect_error(SequenceExistsError, "fork_sequence", 0, 2)
        p.expect_error(SequenceNotFoundError, "popn", 9, 1)
        p.expect_error(SequenceNotFoundError, "get_kv", 9)
        p.expect_error(SequenceNotFoundError, "sequence_length", 9)
        p.expect_error(InvalidArgumentError, "add_sequence", True)
        p.expect_error(InvalidArgumentError, "add_sequence", 1.5)

    def test_positions_and_lengths(self, busy):
        p = busy
        n = p.ref.sequence_length(0)
        p.expect_error(InvalidArgumentError, "fork_sequence", 0, 7, n + 1)
        p.expect_error(InvalidArgumentError, "fork_sequence", 0, 7, -2)
        p.expect_error(InvalidArgumentError, "popn", 0, n + 1)
        p.expect_error(InvalidArgumentError, "popn", 0, -1)
        p.expect_error(InvalidArgumentError, "get_kv", 0, 2, 1)
        p.expect_error(InvalidArgumentError, "get_kv", 0, 0, n + 1)
        p.expect_error(InvalidArgumentError, "get_kv", 0, -1)

    def test_begin_forward(self, busy):
        p = busy
        c = p.config
        p.expect_error(SequenceNotFoundError, "begin_forward", [0, 9], [1, 1])
        p.expect_error(InvalidArgumentError, "begin_forward", [0, 0], [1, 1])
        p.expect_error(InvalidArgumentError, "begin_forward", [0, 1], [1])
        p.expect_error(InvalidArgumentError, "begin_forward", [0], [0])
        p.expect_error(InvalidArgumentError, "begin_forward", [], [])
        p.expect_error(InvalidArgumentError, "begin_forward", [0], [c.prefill_chunk_size + 1])
        p.expect_error(InvalidArgumentError, "begin_forward", [0], [1.0])
        p.forward([0, 1, 2], [1, 2, 1])

    def test_attention_inputs(self, busy):
        p = busy
        c = p.config
        p.begin([0, 2], [3, 1])
        q = np.zeros((4, c.num_qo_heads, c.head_dim))
        k = np.zeros((4, c.num_kv_heads, c.head_dim))
        cases = [
            ((0, q[:3], k, k), InvalidArgumentError),                       # wrong token count
            ((0, q, q, k), InvalidArgumentError),                           # wrong head count
            ((0, q[..., :-2], k, k), InvalidArgumentError),                 # wrong head_dim
            ((c.num_layers, q, k, k), InvalidArgumentError),                # layer out of range
            ((-1, q, k, k), InvalidArgumentError),
        ]
        for (layer, qq, kk, vv), exc in cases:
            for cache in (p.ref, p.dut):
                with pytest.raises(exc):
                    cache.attention(layer, cache.from_numpy(qq), cache.from_numpy(kk), cache.from_numpy(vv))
        for cache in (p.ref, p.dut):
            with pytest.raises(InvalidArgumentError):     # not a native array of this backend
                cache.attention(0, [[0.0]], cache.from_numpy(k), cache.from_numpy(k))
            with pytest.raises(InvalidArgumentError):     # non-finite sm_scale
                cache.attention(0, cache.from_numpy(q), cache.from_numpy(k), cache.from_numpy(k),
                                sm_scale=float("nan"))
            with pytest.raises(InvalidArgumentError):     # fused qkv of the wrong width
                cache.attention_with_fused_qkv(0, cache.from_numpy(q))
        # a wrong dtype (int32 array) is refused
        for cache in (p.ref, p.dut):
            with pytest.raises(InvalidArgumentError):
                cache.attention(0, cache.from_numpy(q.astype(np.int32)), cache.from_numpy(k),
                                cache.from_numpy(k))
        # the forward still works after every refusal
        for layer in range(c.num_layers):
            p.attend(layer)
        for cache in (p.ref, p.dut):
            with pytest.raises(ForwardStateError):       # a layer twice in one forward
                cache.attention(0, cache.from_numpy(q), cache.from_numpy(k), cache.from_numpy(k))
        p.end()
        p.decode([0, 1, 2], steps=1)

    def test_forward_state(self, busy):
        p = busy
        c = p.config
        q = np.zeros((1, c.num_qo_heads, c.head_dim))
        k = np.zeros((1, c.num_kv_heads, c.head_dim))
        for cache in (p.ref, p.dut):
            with pytest.raises(ForwardStateError):
                cache.attention(0, cache.from_numpy(q), cache.from_numpy(k), cache.from_numpy(k))
            with pytest.raises(ForwardStateError):
                cache.end_forward()
            with pytest.raises(ForwardStateError):
                cache.query_positions()
        p.begin([1], [1])
        for method, args in [("add_sequence", (5,)), ("remove_sequence", (0,)),
                             ("fork_sequence", (0, 5)), ("popn", (0, 1)), ("get_kv", (0,)),
                             ("begin_forward", ([2], [1]))]:
            p.expect_error(ForwardStateError, method, *args)
        for layer in range(c.num_layers):
            p.attend(layer)
        p.end()
        p.decode([0, 1], steps=1)

    def test_tree_inputs(self, make_pair):
        p = make_pair(needs=("tree_attention",))
        p.add(0, 1)
        p.forward([0, 1], [4, 4])
        p.expect_error(InvalidArgumentError, "begin_forward", [0], [3], [-1, 1, 0])   # not < own index
        p.expect_error(InvalidArgumentError, "begin_forward", [0], [2], [-1, -2])
        p.expect_error(InvalidArgumentError, "begin_forward", [0], [2], [-1])          # wrong length
        p.forward([0, 1], [2, 1], tree=[-1, 0, -1])
        p.expect_error(ForwardStateError, "begin_forward", [0], [1])                   # uncommitted
        p.expect_error(ForwardStateError, "fork_sequence", 0, 5)
        p.expect_error(ForwardStateError, "popn", 0, 1)
        p.expect_error(InvalidArgumentError, "commit_accepted_token_tree_nodes", [0, 1], [2, 0])
        p.expect_error(InvalidArgumentError, "commit_accepted_token_tree_nodes", [0, 0], [1, 1])
        p.expect_error(InvalidArgumentError, "commit_accepted_token_tree_nodes", [0], [1, 0])
        p.expect_error(SequenceNotFoundError, "commit_accepted_token_tree_nodes", [0, 7], [1, 0])
        p.commit([0, 1], [1, 0])
        p.decode([0, 1], steps=1)

    def test_sliding_window_inputs(self, make_pair):
        p = make_pair(support_sliding_window=True)
        p.add(0)
        p.prefill(0, 5)
        p.expect_error(InvalidArgumentError, "enable_sliding_window", 0, 4, 4)
        p.expect_error(InvalidArgumentError, "enable_sliding_window", 0, 0, 0)
        p.expect_error(InvalidArgumentError, "enable_sliding_window", 0, 4, -1)
        p.expect_error(SequenceNotFoundError, "enable_sliding_window", 3, 4, 1)
        p.enable_sliding_window(0, 8, 2)
        p.expect_error(InvalidArgumentError, "enable_sliding_window", 0, 8, 2)
        p.decode([0], steps=5)

    def test_window_over_shared_prefix(self, make_pair):
        """Pages shared with another sequence cannot slide out: the sinks must cover a shared
        prefix, and a windowed sequence forks only within its sinks."""
        p = make_pair(support_sliding_window=True)
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, 2 * ps)
        p.fork(0, 1)
        p.expect_error(InvalidArgumentError, "enable_sliding_window", 1, 2 * ps, 1)
        p.expect_error(InvalidArgumentError, "enable_sliding_window", 0, 4 * ps, 2 * ps - 1)
        p.enable_sliding_window(0, 4 * ps, 2 * ps)
        p.add(2)
        p.prefill(2, 5)
        p.enable_sliding_window(2, 8, 2)
        p.expect_error(InvalidArgumentError, "fork_sequence", 2, 3, 3)
        p.decode([0, 1, 2], steps=2)


class TestAtomicity(Conformance):
    """A call that raises leaves the cache as it was: a batch that does not fit reserves no
    page (``CacheFullError``), a failed tree commit, an aborted forward (``abort_forward`` or an
    exception inside ``with cache.forward``) after any number of layers, and ``end_forward``
    before every layer ran. Lengths, free pages and the stored KV are compared bit for bit."""

    def test_cache_full_reserves_nothing(self, make_pair):
        """A forward that does not fit raises CacheFullError and reserves no page, even though
        the first sequences of the batch would have fit."""
        p = make_pair(max_total_tokens=64, page_size=16)
        ps = p.config.page_size
        p.add(0, 1, 2)
        p.forward([0, 1], [ps + 1, 3])
        free = p.ref.num_available_pages
        p.expect_error(CacheFullError, "begin_forward", [0, 1, 2], [1, ps, (free + 1) * ps])
        p.expect_error(CacheFullError, "begin_forward", [2], [(free + 1) * ps])
        p.forward([2, 0], [ps, 1])

    def test_cache_full_fork_and_decode(self, make_pair):
        """With every page in use, a mid-page fork and a decode that needs a page both raise
        CacheFullError and change nothing."""
        p = make_pair(max_total_tokens=32, page_size=16)    # 3 pages of 16
        p.add(0)
        p.prefill(0, 40)
        assert p.ref.num_available_pages == 0
        p.expect_error(CacheFullError, "fork_sequence", 0, 1, 40)
        p.decode([0], steps=8)
        p.expect_error(CacheFullError, "begin_forward", [0], [1])
        p.fork(0, 1, 32)                                     # page-aligned: shares, copies nothing
        p.popn(0, 16)
        p.decode([0], steps=1)
        p.remove(1)
        p.decode([0], steps=1)

    def test_failed_commit_changes_nothing(self, make_pair):
        p = make_pair(needs=("tree_attention",))
        p.add(0, 1)
        p.forward([0, 1], [3, 3])
        p.forward([0, 1], [3, 2], tree=[-1, 0, 1, -1, 0])
        p.expect_error(InvalidArgumentError, "commit_accepted_token_tree_nodes", [0, 1], [2, 5])
        p.commit([0, 1], [2, 1])
        p.decode([0, 1], steps=1)

    def test_work_continues_after_errors(self, make_pair):
        p = make_pair()
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, ps + 2)
        p.expect_error(InvalidArgumentError, "popn", 0, ps + 3)
        p.expect_error(SequenceExistsError, "fork_sequence", 0, 0)
        p.fork(0, 1, ps + 1)
        p.decode([0, 1], steps=2)
        p.clear()
        p.add(0)
        p.prefill(0, 3)

    @pytest.mark.parametrize("how", ["abort", "raise"])
    def test_aborted_forward_changes_nothing(self, make_pair, how):
        """abort_forward after some layers (or none, or all), or an exception inside
        ``with cache.forward``: the cache is exactly as before begin_forward (lengths, free pages,
        get_kv bit for bit), and later forwards, decode steps included, run as if it never
        happened."""
        p = make_pair()
        ps, layers = p.config.page_size, p.config.num_layers
        p.add(0, 1)
        p.aborted([0], [ps + 2], how=how)
        p.forward([0, 1], [ps + 3, 2])
        p.decode([0, 1], steps=2)
        p.aborted([0, 1], [1, 1], how=how)
        p.decode([0, 1], steps=1)
        p.aborted([1, 0], [ps + 1, 3], layers=layers, how=how)
        p.fork(0, 2, ps)
        p.aborted([2, 0, 1], [2, 1, ps], layers=0, how=how)
        p.decode([0, 1, 2], steps=ps + 1)

    def test_aborted_tree_forward_keeps_earlier_tree_tokens(self, make_pair):
        p = make_pair(needs=("tree_attention",))
        p.add(0, 1)
        p.forward([0, 1], [5, 3])
        p.forward([0, 1], [2, 1], tree=[-1, 0, -1])
        p.aborted([0, 1], [2, 2], tree=[1, 0, 0, 1], how="raise")
        p.aborted([0], [3], tree=[-1, 2, 3], layers=p.config.num_layers)
        p.forward([0, 1], [1, 2], tree=[1, 0, 0])
        p.commit([0, 1], [2, 2])
        p.decode([0, 1], steps=1)

    def test_aborted_sliding_forward_changes_nothing(self, make_pair):
        """Sliding windows free the pages that slide out: an aborted forward must leave the
        rows it slid out intact (the window keeps them again)."""
        p = make_pair(support_sliding_window=True)
        ps = p.config.page_size
        p.add(0, 1)
        p.enable_sliding_window(0, ps + 2, 1)
        p.forward([0, 1], [ps + 1, 2])
        for step in range(ps + 2):
            p.aborted([0, 1], [1, 1], layers=step % 2, how="raise" if step % 3 else "abort")
            p.decode([0, 1], steps=1)
        p.aborted([1, 0], [3, 2 * ps + 1])
        p.decode([1, 0], steps=2)

    def test_end_forward_too_early(self, make_pair):
        """end_forward before every layer ran raises ForwardStateError naming the missing
        layers; the forward stays open to finish, or to abort."""
        p = make_pair()
        layers = p.config.num_layers
        p.add(0)
        p.prefill(0, 5)
        p.begin([0], [2])
        p.attend(layers - 1)
        err = p.expect_error(ForwardStateError, "end_forward")
        assert str(list(range(layers - 1))) in str(err), str(err)
        for layer in range(layers - 1):
            p.attend(layer)
        p.end()
        before = p.raw_snapshot(p.dut)["lengths"]
        p.begin([0], [3])
        p.attend(0)
        p.expect_error(ForwardStateError, "end_forward")
        p.abort()
        assert p.raw_snapshot(p.dut)["lengths"] == before
        p.decode([0], steps=2)


class TestCapabilities(Conformance):
    """A cache built with a feature the backend does not declare in its ``Capabilities``
    (a dtype, a head_dim, sliding windows, inline RoPE, token trees) is refused with
    ``UnsupportedFeatureError`` naming the capability, instead of running with wrong results."""

    def test_undeclared_features_are_refused(self, kvcache_backend, kvcache_device,
                                             kvcache_backend_class):
        """A cache that asks for an undeclared capability raises UnsupportedFeatureError naming it."""
        from .harness import make_config
        caps = kvcache_backend_class.capabilities
        wanted: list[tuple[str, dict]] = []
        for dtype in ("float16", "bfloat16", "float32"):
            if dtype not in caps.dtypes:
                wanted.append(("dtypes", dict(dtype=dtype)))
            elif dtype not in caps.kv_dtypes:      # pages are stored in the compute dtype
                wanted.append(("kv_dtypes", dict(dtype=dtype)))
        for hd in (64, 128, 256):
            if hd not in caps.head_dims:
                wanted.append(("head_dims", dict(head_dim=hd, dtype=caps.dtypes[0])))
        if not caps.sliding_window:
            wanted.append(("sliding_window", dict(support_sliding_window=True, dtype=caps.dtypes[0])))
        if not caps.inline_rope:
            wanted.append(("inline_rope", dict(rope_mode="inline", dtype=caps.dtypes[0])))
        for capability, kw in wanted:
            with pytest.raises(UnsupportedFeatureError, match=capability):
                kvcache.PagedKVCache(make_config(**kw), backend=kvcache_backend, device=kvcache_device)

    def test_tree_needs_capability(self, kvcache_backend, kvcache_device, kvcache_backend_class):
        from .harness import make_config
        caps = kvcache_backend_class.capabilities
        if caps.tree_attention:
            return
        cache = kvcache.PagedKVCache(make_config(dtype=caps.dtypes[0], head_dim=caps.head_dims[0]),
                                     backend=kvcache_backend, device=kvcache_device)
        cache.add_sequence(0)
        with pytest.raises(UnsupportedFeatureError, match="tree_attention"):
            cache.begin_forward([0], [2], [-1, 0])
        assert cache.sequence_length(0) == 0


class TestBackendContract(Conformance):
    """The backend class's own contract, which the core relies on rather than checks:
    discovery (``name``, ``availability`` always giving a reason, ``capabilities``,
    ``devices``, ``platform``, listed by ``kvcache.list_backends``), array conversion
    (``from_numpy`` / ``to_numpy`` / ``is_native`` / ``dtype_name``), pages of the declared
    ``page_shape`` and kv dtype, and ``append_kv`` writing into ``cache.pages`` in place."""

    def test_discovery(self, kvcache_backend, kvcache_device, kvcache_backend_class):
        cls = kvcache_backend_class
        assert cls.name == kvcache_backend
        ok, reason = cls.availability(kvcache_device)
        assert ok is True and isinstance(reason, str) and reason
        assert isinstance(cls.capabilities, kvcache.Capabilities)
        assert isinstance(cls.devices(), list) and isinstance(cls.platform(), dict)
        names = [row["name"] for row in kvcache.list_backends(kvcache_device)]
        assert kvcache_backend in names
        ok, reason = cls.availability("no-such-device-xyz")
        assert isinstance(reason, str) and reason, "availability() must always give a reason"

    def test_arrays(self, make_pair):
        p = make_pair()
        b, c = p.dut.backend, p.config
        x = np.linspace(-2, 2, 2 * c.num_kv_heads * c.head_dim).reshape(2, c.num_kv_heads, c.head_dim)
        arr = p.dut.from_numpy(x)
        assert b.is_native(arr) and b.dtype_name(arr) == c.dtype
        back = kvcache.to_numpy(arr)
        assert back.dtype == np.float32, f"kvcache.to_numpy gave {back.dtype}, expected float32"
        np.testing.assert_array_equal(back, kvcache.to_numpy(p.ref.from_numpy(x)))
        idx = p.dut.from_numpy(np.arange(5, dtype=np.int32))
        assert b.dtype_name(idx) == "int32"
        np.testing.assert_array_equal(kvcache.to_numpy(idx), np.arange(5))
        assert not b.is_native(object())

    def test_page_layout(self, make_pair):
        """Pages have the layout the backend declares (``page_shape``) in the config's kv dtype."""
        p = make_pair()
        b, c = p.dut.backend, p.config
        assert len(p.dut.pages) == c.num_layers
        for pages in p.dut.pages:
            assert b.shape_of(pages) == b.page_shape(c.num_pages)
            assert b.dtype_name(pages) == c.kv_dtype

    def test_append_kv_writes_pages_in_place(self, make_pair):
        """The suite's page poisoning goes through append_kv; it must land in cache.pages
        (read back with gather_kv), or the suite could not see reads of unwritten slots."""
        p = make_pair()
        if p.poison_value is None:
            return
        b, pt = p.dut.backend, p.dut.state.pt
        slots = np.arange(0, pt.num_pages * p.config.page_size, 7, dtype=np.int32)
        k, v = b.gather_kv(p.dut.pages, b.aux_to_device(slots))
        k = kvcache.to_numpy(k)
        assert k.shape == (p.config.num_layers, len(slots), p.config.num_kv_heads, p.config.head_dim)
        assert np.isnan(k).all() or not np.isnan(p.poison_value), \
            "append_kv did not write into the page arrays held by the cache (cache.pages)"
