"""What today's models mean by attention: soft-capped logits, learned sinks, sliding and full
layers in one forward, value head dims other than the query/key one, and every head dim that
is a multiple of 8 up to 256. Each class is gated on its capability."""

from __future__ import annotations

import numpy as np
import pytest

from kvcache import Capabilities

from .base import Conformance


def _sinks(p, scale=2.0):
    """Per-head sink logits large enough to take a visible share of every row's softmax."""
    return p.rng.standard_normal(p.config.num_qo_heads) * scale + 1.0


class TestLogitSoftcap(Conformance):
    """``attention(..., logit_softcap=c)``: scores become ``c * tanh(s / c)`` (gemma2, grok)."""

    @pytest.mark.parametrize("cap", [1.0, 30.0])
    def test_prefill_decode_fork(self, make_pair, cap):
        p = make_pair(needs=("logit_softcap",))
        ps = p.config.page_size
        p.add(0, 1)
        # a large sm_scale so that a cap of 30 still bends scores of random q/k
        p.forward([0, 1], [2 * ps + 5, 3], logit_softcap=cap, sm_scale=2.0)
        p.forward([1, 0], [ps + 4, 2], logit_softcap=cap, sm_scale=2.0)
        p.decode([0, 1], steps=3, logit_softcap=cap, sm_scale=2.0)
        p.fork(0, 2, ps + 1)
        p.forward([2, 0], [3, 1], logit_softcap=cap, sm_scale=2.0)
        p.decode([0, 1, 2], steps=2, logit_softcap=cap, sm_scale=2.0)

    def test_with_window_and_fused_qkv(self, make_pair):
        p = make_pair(needs=("logit_softcap", "window_left"))
        ps = p.config.page_size
        p.add(0)
        p.forward([0], [ps + 3], logit_softcap=5.0, window_left=4, fused=True)
        p.decode([0], steps=2, logit_softcap=5.0, window_left=4, fused=True)

    def test_softcap_changes_the_output(self, make_pair):
        """A cap that bends the scores gives another output than none (the keyword is not
        ignored): the dense model computes both."""
        from kvcache.conformance.model import dense_attention
        p = make_pair(needs=("logit_softcap",))
        p.add(0)
        p.begin([0], [6])
        q, k, v = p.layer_inputs(0)
        visible = np.tril(np.ones((6, 6), bool))
        capped, _ = dense_attention(q, k, v, visible, 3.0, p.config.group_size, softcap=0.5)
        plain, _ = dense_attention(q, k, v, visible, 3.0, p.config.group_size)
        assert not np.allclose(capped, plain, atol=1e-3)
        o, _ = p.attend(0, inputs=(q, k, v), sm_scale=3.0, logit_softcap=0.5)
        assert np.allclose(o, capped, atol=0.05), "the backend's output is not the capped one"
        for layer in range(1, p.config.num_layers):
            p.attend(layer, sm_scale=3.0, logit_softcap=0.5)
        p.end()


class TestAttentionSinks(Conformance):
    """``attention(..., sinks=s)``: one logit per query head joins the softmax denominator with
    no value (gpt-oss); the lse includes it; it counts once however many partial passes (ragged,
    shared-prefix depths, split-K) the backend makes."""

    def test_prefill_decode_fork(self, make_pair):
        p = make_pair(needs=("attention_sinks",))
        ps = p.config.page_size
        sinks = {layer: _sinks(p) for layer in range(p.config.num_layers)}
        p.add(0, 1)
        p.forward([0, 1], [2 * ps + 5, 3], sinks=sinks.get)
        p.forward([1, 0], [ps + 4, 2], sinks=sinks.get)          # chunked: cached + new keys
        p.decode([0, 1], steps=3, sinks=sinks.get)
        p.fork(0, 2, ps + 1)                                      # a shared prefix: two depths
        p.forward([2, 0], [3, 1], sinks=sinks.get)
        p.decode([0, 1, 2], steps=2, sinks=sinks.get)

    def test_long_decode(self, make_pair):
        """Long histories (a split-K decode on GPU backends) with sinks."""
        p = make_pair(needs=("attention_sinks",), max_total_tokens=2048, prefill_chunk_size=1024)
        p.add(0, 1)
        p.forward([0, 1], [700, 40])
        p.decode([0, 1], steps=2, sinks=lambda layer: _sinks(p))

    def test_with_window_softcap_and_zero_window(self, make_pair):
        """With window_left=0 a query sees only itself: the sink's share is exact."""
        p = make_pair(needs=("attention_sinks", "window_left", "logit_softcap"))
        ps = p.config.page_size
        p.add(0)
        p.forward([0], [ps + 2], sinks=_sinks(p), window_left=0)
        p.decode([0], steps=2, sinks=_sinks(p), window_left=3, logit_softcap=4.0)

    def test_large_sink_takes_the_mass(self, make_pair):
        """A sink far above every score leaves o near 0 and lse near the sink."""
        p = make_pair(needs=("attention_sinks",))
        p.add(0)
        p.begin([0], [5])
        big = np.full(p.config.num_qo_heads, 40.0)
        o, lse = p.attend(0, sinks=big)
        assert np.abs(o).max() < 1e-3
        assert np.allclose(lse, 40.0, atol=1e-3)
        for layer in range(1, p.config.num_layers):
            p.attend(layer, sinks=big)
        p.end()


class TestMixedWindowLayers(Conformance):
    """Sliding and full layers in one forward (gemma2/3, gpt-oss, ``layer_types``): each layer
    passes its own ``window_left``; a full layer still reads every page after the sliding one
    has stopped looking at them."""

    def test_alternating_layers(self, make_pair):
        p = make_pair(needs=("window_left",), num_layers=4)
        ps = p.config.page_size
        w = ps // 2 + 1

        def window(layer):
            return w if layer % 2 == 0 else -1

        p.add(0, 1)
        p.forward([0, 1], [3 * ps + 2, 5], window_left=window)
        p.decode([0, 1], steps=3, window_left=window)
        p.fork(0, 2, 2 * ps)
        p.forward([2, 1], [ps + 1, 2 * ps], window_left=window)
        p.decode([0, 1, 2], steps=2, window_left=window)

    def test_with_sinks_and_softcap(self, make_pair):
        """gpt-oss (sinks, alternate windows) and gemma2 (softcap, alternate windows) in one."""
        p = make_pair(needs=("window_left", "attention_sinks", "logit_softcap"), num_layers=4)
        ps = p.config.page_size
        sinks = {layer: _sinks(p) for layer in range(4)}
        p.add(0)
        p.forward([0], [2 * ps + 3], window_left=lambda l: 5 if l % 2 else -1, sinks=sinks.get,
                  logit_softcap=lambda l: 20.0 if l < 2 else None)
        p.decode([0], steps=3, window_left=lambda l: 5 if l % 2 else -1, sinks=sinks.get,
                 logit_softcap=lambda l: 20.0 if l < 2 else None)


class TestHeadDimV(Conformance):
    """``CacheConfig(head_dim_v=...)``: values and outputs with another head dim than q/k (MLA
    in expanded form: DeepSeek's 192 / 128). get_kv returns V with its own head dim."""

    @pytest.mark.parametrize("dims", [(192, 128), (64, 128), (40, 24)], ids=["192_128", "64_128", "40_24"])
    def test_prefill_decode_fork_popn(self, make_pair, dims):
        d, dv = dims
        p = make_pair(needs=("head_dims_v",), head_dim=d, head_dim_v=dv)
        if dv not in p.dut.capabilities.head_dims_v:     # make_pair skips these first
            pytest.skip(Capabilities.reason("head_dims_v") + f" [{dv}]")
        ps = p.config.page_size
        p.add(0, 1)
        p.forward([0, 1], [2 * ps + 5, 3])
        p.decode([0, 1], steps=2)
        p.fork(0, 2, ps + 1)
        p.forward([2, 0], [3, 1])
        p.popn(0, 2)
        p.decode([0, 1, 2], steps=2)

    def test_with_rope_and_sinks(self, make_pair):
        p = make_pair(needs=("head_dims_v",), head_dim=48, head_dim_v=32, rope_mode="normal")
        p.add(0)
        sinks = _sinks(p) if p.dut.capabilities.attention_sinks else None
        p.forward([0], [p.config.page_size + 3], sinks=sinks)
        p.decode([0], steps=2, sinks=sinks)

    def test_fused_qkv_refused(self, make_pair):
        from kvcache import InvalidArgumentError
        p = make_pair(needs=("head_dims_v",), head_dim=48, head_dim_v=32)
        p.add(0)
        p.begin([0], [2])
        c = p.config
        qkv = p.dut.from_numpy(np.zeros((2, c.num_qo_heads + 2 * c.num_kv_heads, c.head_dim)))
        with pytest.raises(InvalidArgumentError, match="head_dim_v"):
            p.dut.attention_with_fused_qkv(0, qkv)
        p.abort()


class TestHeadDims(Conformance):
    """Every head dim that is a multiple of 8 up to 256 (kernels pad inside)."""

    @pytest.mark.parametrize("head_dim", [8, 24, 72, 112, 136, 200])
    def test_prefill_decode(self, make_pair, head_dim):
        p = make_pair(head_dim=head_dim, rope_mode="normal")
        ps = p.config.page_size
        p.add(0, 1)
        p.forward([0, 1], [ps + 5, 2])
        p.decode([0, 1], steps=2)


class TestOwnAttention(Conformance):
    """``append_kv`` and ``get_kv(seq_id, layer=...)`` inside a forward: a model that computes
    attention itself (mlx-lm's gemma2 soft-capping by hand, MLA over a latent) stores its new
    K/V without attending and reads each sequence's history of one layer."""

    def _append(self, p, layer, k, v):
        for cache in (p.ref, p.dut):
            cache.append_kv(layer, cache.from_numpy(k), cache.from_numpy(v))

    def _read(self, p, sid, layer, end=None):
        from ..arrays import to_numpy
        from .tolerance import assert_close
        (kr, vr), (kd, vd) = p.both("get_kv", sid, 0, end, layer=layer)
        assert_close(f"get_kv({sid}, layer={layer}) K", to_numpy(kr), to_numpy(kd), p.tol,
                     context=p.context())
        assert_close(f"get_kv({sid}, layer={layer}) V", to_numpy(vr), to_numpy(vd), p.tol,
                     context=p.context())
        return to_numpy(kd), to_numpy(vd)

    @pytest.mark.parametrize("dims", [None, (48, 32)], ids=["same", "48_32"])
    def test_history_then_new_tokens(self, make_pair, dims):
        from kvcache import ForwardStateError
        kw = {} if dims is None else dict(needs=("head_dims_v",), head_dim=dims[0],
                                          head_dim_v=dims[1])
        p = make_pair(**kw)
        c, ps = p.config, p.config.page_size
        p.add(0, 1)
        p.forward([0, 1], [ps + 3, 2])          # history written by attention
        p.begin([0, 1], [3, ps + 1])
        for layer in range(c.num_layers):
            # the history is there before the layer writes; the new tokens are not yet
            self._read(p, 0, layer, ps + 3)
            p.expect_error(ForwardStateError, "get_kv", 1, 0, 3, layer=layer)
            _, k, v = p.layer_inputs(layer)
            self._append(p, layer, k, v)
            kd, vd = self._read(p, 1, layer)
            assert kd.shape == (ps + 3, c.num_kv_heads, c.head_dim)
            assert vd.shape == (ps + 3, c.num_kv_heads, c.head_dim_v)
            # the new rows are the appended ones, as stored
            np.testing.assert_allclose(vd[2:], v[3:], **_stored(c))
            p.expect_error(ForwardStateError, "append_kv", layer, *self._native(p, k, v))
        p.end()
        assert p.dut.sequence_length(1) == ps + 3

    def test_outside_a_forward_and_bad_layers(self, make_pair):
        from kvcache import ForwardStateError, InvalidArgumentError
        p = make_pair()
        p.add(0)
        p.forward([0], [5])
        self._read(p, 0, 1 % p.config.num_layers, 4)
        p.expect_error(InvalidArgumentError, "get_kv", 0, layer=p.config.num_layers)
        zeros = np.zeros((1, p.config.num_kv_heads, p.config.head_dim))
        p.expect_error(ForwardStateError, "append_kv", 0, *self._native(p, zeros, zeros))
        p.begin([0], [1])
        p.expect_error(ForwardStateError, "get_kv", 0)       # all layers: not in a forward
        p.expect_error(InvalidArgumentError, "append_kv", 0,
                       *self._native(p, zeros[:, :, :4], zeros))
        p.abort()

    @staticmethod
    def _native(p, k, v):
        return p.dut.from_numpy(k), p.dut.from_numpy(v)


def _stored(config) -> dict:
    """Tolerances of a value stored in the cache dtype."""
    return {"float32": dict(rtol=1e-6, atol=1e-6)}.get(config.dtype, dict(rtol=1e-2, atol=1e-2))
