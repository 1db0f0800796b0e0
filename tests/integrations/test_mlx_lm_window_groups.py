"""Window groups through mlx-lm (issue 56, increment 2): a Gemma-3 model whose sliding layers
use mlx-lm's RotatingKVCache runs on the metal backend (MLX's CPU device) with those layers in
window groups, queued requests sharing batches in chunks, and returns exactly mlx-lm's own
greedy tokens while the windowed pages are freed."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_lm_cases import WINDOW, make_model, metal_cpu_or_skip, mlx_greedy

import kvcache  # noqa: E402
from kvcache.integrations.mlx_lm import Engine, cache_config, layer_kinds  # noqa: E402
from kvcache.integrations.mlx_lm import sliding_windows  # noqa: E402

PAGE = 4
NEW = 10


def test_gemma3_window_groups_equal_mlx_lm_and_free_pages():
    model = make_model("gemma3_text", seed=56, vocab=128, num_hidden_layers=3,
                       sliding_window_pattern=3)
    metal_cpu_or_skip(cache_config(model).head_dim)
    windows = sliding_windows(model)
    assert windows == {0: WINDOW, 1: WINDOW}                 # layer 2 is global
    kinds = layer_kinds(windows)
    assert kinds == {0: kvcache.Window(WINDOW - 1), 1: kvcache.Window(WINDOW - 1)}
    rng = np.random.default_rng(56)
    prompts = [rng.integers(1, 128, n).tolist() for n in (3, 26, 13, 35)]
    want = [mlx_greedy(model, p, NEW) for p in prompts]
    engine = Engine(model, backend="metal", device="cpu", page_size=PAGE, max_total_tokens=512,
                    prefill_chunk_size=16, max_batch_size=4, prefix_cache=False)
    assert dict(engine.config.layer_kinds) == kinds and engine.window_groups_off is None
    ids = [engine.add_request(p, kvcache.integrations.SamplingParams(max_tokens=NEW))
           for p in prompts]
    got: dict = {rid: [] for rid in ids}
    slid = 0
    w = WINDOW - 1
    while engine.has_unfinished():
        outs = engine.step()
        cache = engine.cache
        for sid in cache.sequence_ids:
            length = cache.sequence_length(sid)
            first, pages = cache.window_pages(sid)[f"window={w}"]
            assert first == max(0, length - w) // PAGE * PAGE
            assert pages <= -(-w // PAGE) + 1
            slid += first > 0
        for out in outs:
            got[out.request_id].extend(out.new_token_ids)
    assert [got[r] for r in ids] == want
    assert slid > 0 and engine.cache.is_empty
