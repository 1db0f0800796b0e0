"""The mlx-lm Engine over int8 / int4 pages (issue 32; the metal backend on MLX's CPU device),
judged by mlx-lm's own generation: ``generate_step`` with a cache that stores each new K/V row
through the same format (``kvcache.kv_quant``, numpy: independent of the backend's code) and
returns them for the model's own attention. The Engine's greedy tokens must equal it, token for
token, per format and model family; and for int8 they also equal mlx-lm's own quantized cache
(``kv_bits=8``)."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_lm_cases import greedy_sampler, make_model, make_prompts, metal_cpu_or_skip, mlx_greedy

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from kvcache import kv_quant as kq  # noqa: E402
from kvcache.integrations.mlx_lm import Engine  # noqa: E402

NEW = 16
GROUP = 64


class StoredThroughFormat(KVCache):
    """mlx-lm's KV cache, except that every new K/V row is stored as ``fmt`` reads it back
    (the rule of ``kvcache.kv_quant``, once per row, as it is first written)."""

    def __init__(self, fmt: str):
        super().__init__()
        self.fmt = fmt

    def _stored(self, x):
        rows = np.asarray(x.astype(mx.float32))[0].transpose(1, 0, 2)       # (T, H, D)
        back = kq.roundtrip(rows, self.fmt, "float32", GROUP)
        return mx.array(back.transpose(1, 0, 2)[None]).astype(x.dtype)

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(self._stored(keys), self._stored(values))


def judged(model, prompt, fmt):
    cache = [StoredThroughFormat(fmt) for _ in model.layers]
    steps = generate_step(mx.array(prompt), model, max_tokens=NEW, sampler=greedy_sampler,
                          prompt_cache=cache)
    return [int(token) for token, _ in steps]


@pytest.fixture(scope="module")
def llama():
    model = make_model("llama", seed=3)
    metal_cpu_or_skip(64)
    return model


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(seed=11)[:4]          # 5, 300, 37 and 128 tokens


def _engine(model, fmt, **kw):
    return Engine(model, backend="metal", device="cpu", max_total_tokens=4096, kv_dtype=fmt,
                  prefix_cache=False, **kw)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_engine_tokens_equal_mlx_lm_generation_over_the_same_format(llama, prompts, fmt):
    engine = _engine(llama, fmt)
    assert engine.cache.config.kv_dtype == fmt
    out = engine.generate(prompts, max_new_tokens=NEW)          # one batch, read at the end
    for i, p in enumerate(prompts):
        assert out[i][0] == judged(llama, p, fmt), f"prompt {i} ({len(p)} tokens)"


def test_int4_moves_greedy_tokens_so_the_judge_has_teeth(llama, prompts):
    """int4 changes tokens of this random model against plain generation (the format is
    really applied), and the Engine follows the format's tokens, not the plain ones."""
    moved = [i for i, p in enumerate(prompts) if judged(llama, p, "int4") != mlx_greedy(llama, p, NEW)]
    assert moved, "int4 should move a greedy token of some prompt"
    out = _engine(llama, "int4").generate([prompts[i] for i in moved], max_new_tokens=NEW)
    for j, i in enumerate(moved):
        assert out[j][0] != mlx_greedy(llama, prompts[i], NEW)


def test_int8_equals_mlx_lm_own_quantized_cache(llama, prompts):
    """mlx-lm's own QuantizedKVCache (``kv_bits=8``, from the first token) gives the Engine's
    tokens. (int4 is not compared this way: mlx-lm attends over a prompt chunk's K/V before it
    quantizes them, while every kvcache kernel reads K/V as stored; with int4 that moves
    tokens.)"""
    out = _engine(llama, "int8").generate(prompts, max_new_tokens=NEW)
    for i, p in enumerate(prompts):
        steps = generate_step(mx.array(p), llama, max_tokens=NEW, sampler=greedy_sampler,
                              kv_bits=8, kv_group_size=GROUP, quantized_kv_start=0)
        assert out[i][0] == [int(t) for t, _ in steps], f"prompt {i}"


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_other_families_over_int8_pages(family, prompts):
    """A family with its own attention over the cache's K/V (gemma2: soft-capping computed by
    the model) and one through the cache's kernels (qwen3)."""
    model = make_model(family, seed=5, head_dim=GROUP)        # groups of 64 along the head dim
    metal_cpu_or_skip(GROUP)
    out = _engine(model, "int8").generate(prompts[2:], max_new_tokens=NEW)
    for j, p in enumerate(prompts[2:]):
        assert out[j][0] == judged(model, p, "int8"), f"{family} prompt {j}"


def test_int4_pages_are_parked_and_restored_exactly(llama, prompts):
    """A tight Engine parks preempted sequences in the host tier as packed int4 rows and
    restores them: every request's tokens equal a roomy Engine's."""
    short = [p[:40] for p in prompts]
    want = [r[0] for r in _engine(llama, "int4").generate(short, max_new_tokens=NEW)]
    tight = Engine(llama, backend="metal", device="cpu", max_total_tokens=128, page_size=16,
                   kv_dtype="int4", prefix_cache=False, offload=True)
    got = [r[0] for r in tight.generate(short, max_new_tokens=NEW)]
    assert tight.stats.offloaded_tokens > 0
    assert got == want
