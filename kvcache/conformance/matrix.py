"""The conformance suite's matrices: the full one (``--full``) and the quick one run by
default, and which of the suite's collected tests the quick one keeps (``in_quick_matrix``).
Plain data and pytest items; the plugin (``kvcache.conformance.plugin``) deselects with it."""

from __future__ import annotations

import itertools

import pytest

DTYPES = ("float32", "float16", "bfloat16")
GQA = (1, 4, 8)
HEAD_DIMS = (64, 80, 96, 128, 256)
PAGE_SIZES = (1, 16, 32)

# The full matrix (``--kvcache-full``): every operation test on every (dtype, page_size) variant,
# the shape matrix over the whole cross product, every parametrization of every test.
FULL_VARIANTS = list(itertools.product(DTYPES, PAGE_SIZES))
FULL_SHAPES = list(itertools.product(DTYPES, GQA, HEAD_DIMS, PAGE_SIZES))

# The quick matrix (the default), a sample of the full one chosen so that a GPU backend, whose
# kernels compile once per (dtype, page size, head_dim, feature), finishes in minutes:
# * every test function runs, on QUICK_VARIANTS[0] (float16, the dtype backends serve in and
#   nearly all declare; page size 16: page boundaries and odd lengths inside multi-page
#   sequences; GQA ratio 4);
# * the QUICK_EDGES tests (page boundaries, forks and popn across pages, a tree over pages,
#   windows, non-finite keys) also run on QUICK_VARIANTS[1] (float32, the tightest tolerance;
#   page size 1: every token its own page);
# * a test's own parametrizations (RoPE mode, KV format, head dims, ...) run each value at
#   least once, not their cross product (QUICK_VALUES narrows a few to the telling values);
# * the shape matrix runs QUICK_SHAPES, a Latin square covering every value of every axis
#   (dtype, GQA 1/4/8, every head dim, every page size).
# A quick run's node ids are those of the full run (the same tests, fewer of them), so
# expected-failure patterns and ``-k`` expressions mean the same in both; ``-k`` selects within
# the quick matrix unless ``--kvcache-full`` is given.
QUICK_VARIANTS = [("float16", 16), ("float32", 1)]
DEFAULT_VARIANT = ("float32", 16)   # the ``variant`` fixture outside the suite's parametrization
QUICK_EDGES = frozenset({
    "TestPrefill::test_batch", "TestPrefill::test_chunked", "TestDecode::test_steps_cross_pages",
    "TestMixedBatch::test_many_sequences", "TestFork::test_at_page_boundary",
    "TestFork::test_mid_page", "TestPopn::test_across_pages",
    "TestTokenTree::test_tree_crossing_pages", "TestSlidingWindow::test_windows_next_to_forks",
    "TestWindowLeft::test_prefill_decode_fork", "TestMaskedNonFinite::test_later_tokens_of_a_prefill",
    "TestMaskedNonFinite::test_token_tree_siblings", "TestMaskedNonFinite::test_evicted_window_token",
    "TestWindowGroups::test_queued_forwards", "TestStateSlots::test_queued_lifecycle",
})
# {Class::test: {argname: values}}: the quick matrix runs only these values of that parameter
QUICK_VALUES = {
    "TestHeadDims::test_prefill_decode": {"head_dim": (24, 200)},   # < 32 odd, > 128 padded
}
# (dtype, gqa, head_dim, page_size); the quick rows form a Latin square over the four axes.
QUICK_SHAPES = [("float32", 1, 64, 1), ("float16", 4, 128, 16), ("bfloat16", 8, 256, 32),
                ("bfloat16", 4, 64, 16), ("float32", 4, 80, 16), ("float16", 8, 96, 1)]


def _axes(item) -> list:
    """The test function's own ``@pytest.mark.parametrize`` axes: [(argnames, values)]."""
    out = []
    for mark in getattr(getattr(item, "function", None), "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = mark.args[0] if mark.args else mark.kwargs["argnames"]
        values = mark.args[1] if len(mark.args) > 1 else mark.kwargs["argvalues"]
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",") if n.strip()]
        values = [_param_value(v) for v in values]
        out.append((tuple(names), values))
    return out


_PARAM = type(pytest.param(None))


def _param_value(v):
    if isinstance(v, _PARAM):           # pytest.param(value, ...)
        return v.values[0] if len(v.values) == 1 else v.values
    return v


_COMBOS: dict = {}


def _quick_combos(item, axes, base: str) -> frozenset:
    """Index tuples (one per axis) that the quick matrix runs: each allowed value of each axis
    at least once, chosen greedily (the combination covering most values not yet run first)."""
    key = (base, getattr(item, "function", None))
    if key not in _COMBOS:
        narrow = QUICK_VALUES.get(base, {})
        allowed = []
        for names, values in axes:
            keep = narrow.get(names[0]) if len(names) == 1 else None
            allowed.append([i for i, v in enumerate(values) if keep is None or v in keep]
                           or list(range(len(values))))
        todo = {(a, i) for a, idx in enumerate(allowed) for i in idx}
        chosen = []
        candidates = list(itertools.product(*allowed))
        while todo:
            best = max(candidates, key=lambda c: sum((a, i) in todo for a, i in enumerate(c)))
            chosen.append(best)
            todo -= set(enumerate(best))
        _COMBOS[key] = frozenset(chosen or [()])
    return _COMBOS[key]


def in_quick_matrix(item, base: str) -> bool:
    """Whether the quick matrix runs this test of the suite (see QUICK_VARIANTS), ``base``
    its ``Class::test`` name."""
    spec = getattr(item, "callspec", None)
    if spec is None:
        return True
    params = spec.params
    if "shape" in params and tuple(params["shape"]) not in QUICK_SHAPES:
        return False
    if "variant" in params:
        variants = QUICK_VARIANTS if base in QUICK_EDGES else QUICK_VARIANTS[:1]
        if tuple(params["variant"]) not in variants:
            return False
    axes = [(names, values) for names, values in _axes(item) if all(n in params for n in names)]
    if not axes:
        return True
    combo = tuple(_position(values, params[names[0]] if len(names) == 1
                            else tuple(params[n] for n in names)) for names, values in axes)
    return combo in _quick_combos(item, axes, base)


def _position(values, value) -> int:
    """The index of ``value`` in a parametrize list (-1: not there, e.g. a plugin's own list)."""
    for i, v in enumerate(values):
        try:
            if v is value or bool(v == value):
                return i
        except Exception:           # values that do not compare (arrays)
            pass
    return -1
