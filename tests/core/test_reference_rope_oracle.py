"""The conformance oracle's RoPE is its own (issue 28, item 10): ``kvcache.conformance.model``
imported ``rotate`` from the reference backend, so a sign error in the reference RoPE was copied
by the oracle that judges it, and ``tests/core`` passed. Now the dense model rotates from the
configuration as the spec states it, and the reference backend is checked against it here (RoPE
"normal" and "inline", scaled positions, partial rotary, the model's own frequencies)."""

import ast
from pathlib import Path

import numpy as np
import pytest

import kvcache.conformance.model as model
from kvcache.conformance.harness import CachePair, make_config


def test_the_oracle_imports_nothing_of_the_reference_backend():
    tree = ast.parse(Path(model.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if "reference" in n], names


def test_the_oracle_rope_is_the_spec_formula():
    cfg = make_config(head_dim=4, rope_mode="normal", rope_theta=100.0, rope_scale=0.5)
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]])
    p = 3.0
    a0, a1 = p * 0.5 * 1.0, p * 0.5 * 100.0 ** (-2 / 4)      # angle_i = p * scale * theta^(-2i/D)
    want = [1 * np.cos(a0) - 3 * np.sin(a0), 2 * np.cos(a1) - 4 * np.sin(a1),
            3 * np.cos(a0) + 1 * np.sin(a0), 4 * np.cos(a1) + 2 * np.sin(a1)]
    np.testing.assert_allclose(model.rope(x, [p], cfg)[0, 0], want, rtol=1e-15)
    np.testing.assert_array_equal(model.rope(x, [0], cfg), x)          # position 0: unchanged
    # partial rotary: dims from R on pass through; the model's own frequencies replace theta's
    part = make_config(head_dim=8, rope_mode="normal", rope_rotary_dim=4, rope_inv_freq=(0.5, 2.0))
    y = np.arange(8.0).reshape(1, 1, 8)
    got = model.rope(y, [1.0], part)[0, 0]
    np.testing.assert_array_equal(got[4:], y[0, 0, 4:])
    np.testing.assert_allclose(got[0], 0 * np.cos(0.5) - 2 * np.sin(0.5), rtol=1e-15)
    np.testing.assert_allclose(got[3], 3 * np.cos(2.0) + 1 * np.sin(2.0), rtol=1e-15)


CONFIGS = {
    "normal": dict(rope_mode="normal"),
    "inline": dict(rope_mode="inline"),
    "scaled": dict(rope_mode="normal", rope_scale=0.25, rope_theta=500.0),
    "partial": dict(rope_mode="normal", rope_rotary_dim=8),
    "inv_freq": dict(rope_mode="inline", rope_inv_freq=tuple(0.9 ** np.arange(8))),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_the_reference_backend_rotates_as_the_oracle(name):
    cfg = make_config(head_dim=16, page_size=4, num_layers=1, max_total_tokens=128, gqa=2,
                      **CONFIGS[name])
    pair = CachePair(cfg, "reference", seed=3)      # ref vs the dense model on every call
    pair.add(0, 1)
    pair.forward([0, 1], [7, 5])
    pair.fork(0, 2, 5)
    pair.decode([0, 1, 2], steps=2)
    pair.forward([2, 0], [3, 1])
    pair.check()
