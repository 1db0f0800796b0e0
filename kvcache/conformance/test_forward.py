"""Forward passes: prefill, decode, mixed batches, fused qkv, lse, RoPE modes, queries."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache

from .base import Conformance


class TestPrefill(Conformance):
    """Prefill (many new tokens of one sequence per forward): one sequence, exact page
    multiples, a single token, a batch of sequences, a prompt chunked over several forwards, and
    the ``with cache.forward(...)`` form. Outputs, lse and the stored KV match the reference."""

    def test_single(self, make_pair):
        p = make_pair()
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, 2 * ps + 5)

    def test_exact_pages(self, make_pair):
        p = make_pair()
        p.add(0)
        p.prefill(0, 2 * p.config.page_size)

    def test_one_token(self, make_pair):
        p = make_pair()
        p.add(0)
        p.prefill(0, 1)

    def test_batch(self, make_pair):
        p = make_pair()
        ps = p.config.page_size
        p.add(3, 1, 2)
        p.forward([3, 1, 2], [ps + 3, 1, 2 * ps])

    def test_chunked(self, make_pair):
        """A prefill split over several forwards: new tokens attend to the cached chunk too."""
        p = make_pair()
        ps = p.config.page_size
        p.add(0, 1)
        p.forward([0, 1], [ps + 1, 3])
        p.forward([0, 1], [max(ps - 1, 1), 2 * ps + 2])
        p.forward([1, 0], [5, 7])

    def test_context_manager(self, make_pair):
        """``with cache.forward(ids, lengths):`` is begin_forward / end_forward."""
        from .tolerance import assert_close
        p = make_pair()
        p.add(0)
        p.prefill(0, 9)
        p.model = None   # driven by hand below
        c = p.config
        inputs = [(p.random(4, c.num_qo_heads, c.head_dim), p.random(4, c.num_kv_heads, c.head_dim),
                   p.random(4, c.num_kv_heads, c.head_dim)) for _ in range(c.num_layers)]
        outs = []
        for cache in (p.ref, p.dut):
            with cache.forward([0], [4]):
                outs.append([kvcache.to_numpy(cache.attention(layer, *map(cache.from_numpy, x)))
                             for layer, x in enumerate(inputs)])
        for layer, (r, d) in enumerate(zip(*outs)):
            assert_close(f"attention output (layer {layer})", r, d, p.tol, context=p.context())
        p.check()
        assert p.dut.sequence_length(0) == 13


class TestDecode(Conformance):
    """Decode steps (one new token per sequence): steps that cross page boundaries, sequences
    that start empty, batches in any seq_ids order, and pages reused after a removal (poisoned
    in between, so a stale page index reads NaN)."""

    def test_steps_cross_pages(self, make_pair):
        p = make_pair()
        ps = p.config.page_size
        p.add(0, 1, 2)
        p.forward([0, 1, 2], [max(ps - 2, 1), 1, 3])
        p.decode([0, 1, 2], steps=min(ps + 3, 20))

    def test_from_empty(self, make_pair):
        """Decoding into sequences that hold nothing yet (the first token sees only itself)."""
        p = make_pair()
        p.add(0, 1)
        p.decode([0, 1], steps=3)

    def test_batch_order(self, make_pair):
        """Tokens come in seq_ids order, which need not be insertion order."""
        p = make_pair()
        p.add(0, 1, 2, 3)
        p.forward([0, 1, 2, 3], [5, 9, 2, 17])
        p.decode([3, 0, 2, 1], steps=2)
        p.decode([2], steps=2)
        p.decode([1, 3], steps=1)

    def test_after_remove(self, make_pair):
        """Pages freed by a removed sequence are reused (poisoned in between)."""
        p = make_pair()
        ps = p.config.page_size
        p.add(0, 1)
        p.forward([0, 1], [2 * ps + 1, ps])
        p.remove(0)
        p.add(2)
        p.forward([2, 1], [ps + 3, 1])
        p.decode([1, 2], steps=2)


class TestMixedBatch(Conformance):
    """One forward holding prefill and decode rows at once, as a continuous-batching server
    sends them, over up to eight sequences of very different lengths."""

    def test_prefill_and_decode(self, make_pair):
        p = make_pair()
        ps = p.config.page_size
        p.add(0, 1, 2)
        p.forward([0, 1], [ps + 2, 4])
        p.forward([0, 2, 1], [1, ps + 5, 1])
        p.forward([2, 1, 0], [1, 3, 1])

    def test_many_sequences(self, make_pair):
        p = make_pair()
        p.add(*range(8))
        lens = [1, 7, 2, 19, 1, 4, 33, 1]
        p.forward(list(range(8)), lens)
        p.forward(list(range(8))[::-1], [1, 2, 1, 1, 5, 1, 1, 3])


class TestFusedQKV(Conformance):
    """``attention_with_fused_qkv`` (one ``(T, (Hq + 2 * Hkv) * D)`` array instead of q, k,
    v) gives the same outputs as ``attention`` with separate arrays, in prefill and decode."""

    def test_prefill_and_decode(self, make_pair):
        p = make_pair()
        p.add(0, 1)
        p.forward([0, 1], [11, 3], fused=True)
        p.decode([0, 1], steps=2, fused=True)

    def test_matches_separate(self, make_pair):
        """attention_with_fused_qkv on the backend equals attention with separate q, k, v."""
        p = make_pair()
        p.add(0)
        p.prefill(0, 6)
        p.forward([0], [5], fused=True, sm_scale=0.3)


class TestLse(Conformance):
    """The log-sum-exp output (``return_lse=True``: ``(T, Hq)`` float32, natural log) with a
    custom ``sm_scale``, and ``return_lse=False`` returning the output alone. (Every attention
    call of the suite compares the lse too; this class pins the options.)"""

    def test_lse_prefill_decode(self, make_pair):
        """lse (T, Hq) float32, natural log, compared on every attention of the suite; here
        also with a custom sm_scale."""
        p = make_pair()
        p.add(0, 1)
        p.forward([0, 1], [13, 1], sm_scale=0.5)
        p.decode([0, 1], steps=2, sm_scale=1.25)

    def test_without_lse(self, make_pair):
        p = make_pair()
        p.add(0)
        p.begin([0], [4])
        for layer in range(p.config.num_layers):
            p.attend(layer, return_lse=False)
        p.end()


class TestRope(Conformance):
    """RoPE modes ``none``, ``normal`` (K stored rotated) and ``inline`` (rotated inside the
    kernel), with a custom theta and scale, the model's own inverse-frequency table or a partial
    rotary dimension, across forks; positions continue from the cached length."""

    @pytest.mark.parametrize("rope_mode", ["none", "normal", "inline"])
    def test_modes(self, make_pair, rope_mode):
        p = make_pair(rope_mode=rope_mode, rope_theta=500.0, rope_scale=0.5)
        ps = p.config.page_size
        p.add(0, 1)
        p.forward([0, 1], [ps + 3, 2], positions="after")
        p.decode([0, 1], steps=3)
        p.fork(0, 2, ps // 2 + 1)
        p.forward([2, 0], [3, 1])

    @pytest.mark.parametrize("rope_mode", ["normal", "inline"])
    @pytest.mark.parametrize("spec", ["inv_freq", "partial"])
    def test_model_frequencies(self, make_pair, rope_mode, spec):
        """RoPE with the model's own inverse frequencies (a llama3-style table: low frequencies
        divided by 8) or a partial rotary dimension (half the head), fused and inline."""
        d = 64
        inv = 500000.0 ** (-np.arange(0, d, 2) / d)
        kw = ({"rope_inv_freq": tuple(np.where(np.arange(d // 2) > d // 4, inv / 8, inv))}
              if spec == "inv_freq" else {"rope_rotary_dim": d // 2})
        p = make_pair(rope_mode=rope_mode, head_dim=d, **kw)
        ps = p.config.page_size
        p.add(0, 1)
        p.forward([0, 1], [ps + 3, 2], positions="after")
        p.decode([0, 1], steps=2)
        p.fork(0, 2, ps // 2 + 1)
        p.forward([2, 0], [3, 1])

    def test_normal_stores_rotated_k(self, make_pair):
        """In 'normal' mode get_kv returns K rotated at its position (compared through check),
        and differs from the raw K that was appended."""
        p = make_pair(rope_mode="normal")
        p.add(0)
        p.prefill(0, 5)
        k, _ = p.dut.get_kv(0)
        k = kvcache.to_numpy(k)
        assert np.isfinite(k).all()

    def test_default_theta(self, make_pair):
        p = make_pair(rope_mode="normal")
        p.add(0)
        p.prefill(0, 40)
        p.decode([0], steps=2)


class TestQueries(Conformance):
    """The read-only queries: ``query_positions`` of a forward, ``get_kv`` over any
    ``[start, end)`` range (shape ``(num_layers, end - start, Hkv, D)``), and the counters
    (``is_empty``, ``num_sequences``, ``total_sequence_length``)."""

    def test_query_positions(self, make_pair):
        p = make_pair()
        p.add(0, 1)
        p.forward([0, 1], [5, 2], positions="first")
        p.forward([1, 0], [3, 1], positions="after")

    def test_get_kv_ranges(self, make_pair):
        p = make_pair()
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, 2 * ps + 3)
        n = p.ref.sequence_length(0)
        for start, end in [(0, n), (1, n - 1), (ps, 2 * ps), (n, n), (0, 1), (n - 1, None)]:
            r = p.ref.get_kv(0, start, end)
            d = p.dut.get_kv(0, start, end)
            from .tolerance import assert_close
            for x, y in zip(r, d):
                x, y = kvcache.to_numpy(x), kvcache.to_numpy(y)
                stop = n if end is None else end
                assert y.shape == (p.config.num_layers, stop - start, p.config.num_kv_heads,
                                   p.config.head_dim)
                assert_close(f"get_kv(0, {start}, {end})", x, y, p.tol)

    def test_counters(self, make_pair):
        p = make_pair()
        assert p.dut.is_empty and p.dut.num_sequences == 0
        p.add(0, 1)
        p.forward([0, 1], [20, 7])
        assert p.dut.total_sequence_length == 27
        p.remove(1)
        p.clear()
        assert p.dut.is_empty
        p.add(5)
        p.prefill(5, 3)


class TestWindowLeft(Conformance):
    """Per-query sliding window (``attention(..., window_left=w)``): a query at position p sees
    the keys at positions p-w..p; checked against the reference and the dense model."""

    @pytest.mark.parametrize("pages", [0, 1], ids=["within_page", "spanning_pages"])
    def test_prefill_decode_fork(self, make_pair, pages):
        p = make_pair(needs=("window_left",))
        ps = p.config.page_size
        w = max(ps // 2 - 1, 0) if pages == 0 else ps + 2
        p.add(0, 1)
        p.forward([0, 1], [2 * ps + 5, 3], window_left=w)
        p.forward([1, 0], [ps + 4, 2], window_left=w)          # chunked: cached keys drop out too
        p.decode([0, 1], steps=3, window_left=w)
        p.fork(0, 2, ps + 1)
        p.forward([2, 0], [3, 1], window_left=w)
        p.decode([0, 1, 2], steps=2, window_left=w)

    def test_zero_sees_itself(self, make_pair):
        """window_left=0: each query sees only its own key."""
        p = make_pair(needs=("window_left",))
        p.add(0)
        p.forward([0], [5], window_left=0)
        p.decode([0], steps=2, window_left=0)

    def test_fused_qkv_and_unlimited(self, make_pair):
        p = make_pair(needs=("window_left",))
        ps = p.config.page_size
        p.add(0)
        p.forward([0], [ps + 3], window_left=2, fused=True)
        p.forward([0], [2], window_left=-1)
        p.decode([0], window_left=10 * ps)       # wider than the sequence: the plain result

    def test_with_eviction(self, make_pair):
        """With sliding-window eviction the window counts the cache's positions."""
        p = make_pair(needs=("window_left", "sliding_window"), support_sliding_window=True,
                      rope_mode="none")
        ps = p.config.page_size
        p.add(0)
        p.enable_sliding_window(0, ps + 3, 2)
        p.forward([0], [2 * ps], window_left=ps)
        p.decode([0], steps=3, window_left=ps // 2)

    def test_bad_values(self, make_pair):
        p = make_pair(needs=("window_left",))
        p.add(0)
        for cache in (p.ref, p.dut):
            c = cache.config
            cache.begin_forward([0], [2])
            q = cache.from_numpy(np.zeros((2, c.num_qo_heads, c.head_dim)))
            kv = cache.from_numpy(np.zeros((2, c.num_kv_heads, c.head_dim)))
            for bad, err in ((-2, "must be >= -1"), (1.5, "must be an int"), (True, "must be an int"),
                             ("3", "must be an int")):
                with pytest.raises(kvcache.InvalidArgumentError, match=err):
                    cache.attention(0, q, kv, kv, window_left=bad)
            assert cache.layers_run == frozenset()
            cache.abort_forward()
        p.check()


def skip_declared(capabilities, name, checked_by):
    # imported here: a test module that imports the suite (``from kvcache.conformance import *``)
    # must not import the plugin before its ``pytest_plugins`` line registers it
    from .plugin import skip_declared
    skip_declared(capabilities, name, checked_by)


def _supported_config(capabilities, **overrides):
    """A small config the backend supports (its first dtype and head dim), so that a refusal
    test fails only for the feature it checks."""
    from .harness import make_config
    kw = {"dtype": capabilities.dtypes[0], "head_dim": 64 if 64 in capabilities.head_dims
          else capabilities.head_dims[0]}
    kw.update(overrides)
    return make_config(**kw)


def test_window_left_unsupported_raises(kvcache_backend_class, kvcache_backend, kvcache_device):
    """A backend without the capability refuses window_left >= 0 with UnsupportedFeatureError."""
    caps = kvcache_backend_class.capabilities
    skip_declared(caps, "window_left", "TestWindowLeft")
    cache = kvcache.PagedKVCache(_supported_config(caps), kvcache_backend, kvcache_device)
    c = cache.config
    cache.add_sequence(0)
    cache.begin_forward([0], [1])
    q = cache.from_numpy(np.zeros((1, c.num_qo_heads, c.head_dim)))
    kv = cache.from_numpy(np.zeros((1, c.num_kv_heads, c.head_dim)))
    with pytest.raises(kvcache.UnsupportedFeatureError, match="window_left"):
        cache.attention(0, q, kv, kv, window_left=3)
    cache.attention(0, q, kv, kv, window_left=-1)


def test_rope_frequencies_unsupported_raises(kvcache_backend_class, kvcache_backend, kvcache_device):
    """A backend without ``rope_frequencies`` refuses a config with the model's frequencies or
    partial rotary (RoPE on), and accepts it with rope_mode 'none'."""
    caps = kvcache_backend_class.capabilities
    skip_declared(caps, "rope_frequencies", "TestRope")
    with pytest.raises(kvcache.UnsupportedFeatureError, match="rope_frequencies"):
        kvcache.PagedKVCache(_supported_config(caps, rope_mode="normal", rope_rotary_dim=32),
                             kvcache_backend, kvcache_device)
    kvcache.PagedKVCache(_supported_config(caps, rope_mode="none", rope_rotary_dim=32),
                         kvcache_backend, kvcache_device)
