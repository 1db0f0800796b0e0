"""What the mlx-lm hybrid-family tests share (LFM2, Granite-4.0-H / Nemotron-H, Qwen3-Next):
the test bodies that need mlx (``hybrid_cases`` stays neutral to the model library): the
model's own call with ``layer_caches`` in a loop of one's own, a chunked prompt's logits
against mlx-lm's forward over the whole prompt, and a state read as zeros at every forward.
Imports at module top level only (in a whole run `conftest` is another dir's later)."""

from __future__ import annotations

import numpy as np

from mlx_lm_cases import metal_cpu_or_skip, mlx_logits, mx
from hybrid_cases import NEW, PAGE

import kvcache  # noqa: E402
from kvcache.integrations.mlx_lm import MlxLmAdapter, cache_config, layer_caches  # noqa: E402
from kvcache.integrations.mlx_lm import states as states_module  # noqa: E402


def assert_layer_caches_loop_greedy(model, prompts, want, pair):
    """The model's own call with ``layer_caches`` (no adapter): the prompts at indices ``pair``
    prefilled in one forward, then decoded together, equal to ``want``'s tokens."""
    metal_cpu_or_skip(cache_config(model).head_dim)
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=256, max_batch_size=2)
    cache = kvcache.PagedKVCache(cfg, backend="metal", device="cpu")
    seqs = [prompts[i] for i in pair]
    toks = [list(p) for p in seqs]
    for s in (0, 1):
        cache.add_sequence(s)
    feed = [list(p) for p in seqs]
    for _ in range(NEW):
        flat = mx.array(np.concatenate(feed).astype(np.int32))
        with cache.forward([0, 1], [len(f) for f in feed]):
            logits = model(flat[:, None], cache=layer_caches(model, cache))
        ends = np.cumsum([len(f) for f in feed]) - 1
        picks = [int(mx.argmax(logits[int(e), -1])) for e in ends]
        feed = [[t] for t in picks]
        for s, t in enumerate(picks):
            toks[s].append(t)
    assert [t[len(p):] for t, p in zip(toks, seqs)] == [want[i] for i in pair]


def assert_odd_chunks_equal_one_forward(model, prompt):
    """``prompt`` through the adapter in chunks of 1, 8, 1, 5, 8, 3 and 11 tokens: every
    position's logits are those of mlx-lm's forward over the whole prompt, within float32
    rounding."""
    metal_cpu_or_skip(cache_config(model).head_dim)
    adapter = MlxLmAdapter(model)
    cache = kvcache.PagedKVCache(cache_config(model, page_size=PAGE, max_total_tokens=128,
                                              max_batch_size=1), backend="metal", device="cpu")
    cache.add_sequence(0)
    rows, at = [], 0
    with adapter.session(cache):
        for n in (1, 8, 1, 5, 8, 3, 11):
            with adapter.step_context(cache), cache.forward([0], [n]):
                logits = adapter.forward(cache, np.asarray(prompt[at:at + n], np.int64),
                                         np.arange(at, at + n, dtype=np.int64),
                                         np.arange(n, dtype=np.int64))
            rows.append(adapter.to_numpy(logits))
            at += n
    assert at == len(prompt)
    got, want = np.concatenate(rows), mlx_logits(model, prompt)
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()


def read_state_as_zeros(monkeypatch, zeroed):
    """From here on, the state named ``zeroed`` is read as zeros at every forward."""
    original = states_module._states

    def zeros(forward, layer, name, shape, dtype):
        got = original(forward, layer, name, shape, dtype)
        return mx.zeros_like(got) if name == zeroed else got
    monkeypatch.setattr(states_module, "_states", zeros)


def randomize_weights(model, conv: str = "conv1d.weight"):
    """``model`` with random weights from mlx's current random state: matrices drawn with
    variance 1 / fan-in and every 1-D parameter moved off its initial value (weights named
    with ``conv`` kept), so that the greedy tokens vary."""
    from mlx.utils import tree_flatten
    updates = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim == 1:
            updates.append((name, p + 0.3 * mx.random.normal(p.shape)))
        elif conv not in name:
            updates.append((name, mx.random.normal(p.shape) / np.sqrt(p.shape[-1])))
    model.load_weights(updates, strict=False)
    mx.eval(model.parameters())
    return model
