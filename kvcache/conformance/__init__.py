"""kvcache conformance suite: prove a backend against the reference backend.

Run it:

    kvcache conformance --backend NAME [--device DEV] [-k EXPR] [--full] [--xfail FILE]
    pytest -p kvcache.conformance.plugin --pyargs kvcache.conformance --kvcache-backend NAME
    KVCACHE_CONFORMANCE_BACKEND=NAME pytest --pyargs kvcache.conformance

or from a plugin's own tests (the plugin author's ten lines, see docs/plugin-guide.md):

    import pytest
    from kvcache.conformance import *            # noqa: F401,F403  every test of the suite

    pytest_plugins = ["kvcache.conformance.plugin"]

    @pytest.fixture(scope="session")
    def kvcache_backend():
        return "mybackend"

The ``--kvcache-*`` options come with the suite's plugin (``-p kvcache.conformance.plugin``);
kvcache registers nothing with pytest on install, so unrelated pytest runs never see the suite.

The tests are importable from here (the classes ``TestPrefill``, ``TestFork``, ... and the
module-level tests such as ``test_window_left_unsupported_raises``: ``__all__`` is exactly what
``kvcache conformance`` runs); the fixtures live in ``kvcache.conformance.plugin``. So are the
test building blocks, the one set that the suite, kvcache's backend tests and a plugin author's
own tests share:

``CachePair``, ``RunAhead``   the twin driver: a backend and the reference in lockstep (harness)
``make_config``              a small ``CacheConfig`` for tests (harness)
``DenseModel``, ``dense_attention``  the cache without pages, the oracle of the core (model)
``TOLERANCES``, ``Tolerance``, ``assert_close``, ``Mismatch``  the one tolerance table (tolerance)
``random_tree``, ``random_parents``, ``tree_mask``  random token trees as ``TreeMask`` (trees)
"""

from __future__ import annotations

# Everything the suite runs: its test classes and its module-level tests. ``kvcache conformance``
# collects the modules; a plugin author's ``from kvcache.conformance import *`` collects these
# names, and tests/conformance/test_exports.py checks that the two runs are the same.
_TESTS = {
    "test_forward": ("TestPrefill", "TestDecode", "TestMixedBatch", "TestFusedQKV", "TestLse",
                     "TestRope", "TestQueries", "TestWindowLeft",
                     "test_window_left_unsupported_raises",
                     "test_rope_frequencies_unsupported_raises"),
    "test_semantics": ("TestLogitSoftcap", "TestAttentionSinks", "TestMixedWindowLayers",
                       "TestHeadDimV", "TestHeadDims", "TestOwnAttention"),
    "test_sequences": ("TestFork", "TestPopn", "TestSlidingWindow", "TestTokenTree"),
    "test_matrix": ("TestMatrix",),
    "test_errors": ("TestBadInput", "TestAtomicity", "TestCapabilities", "TestBackendContract"),
    "test_payloads": ("TestPayloadImport",),
    "test_graph": ("TestGraphMode", "TestStaticMixedSteps"),
    "test_run_ahead": ("TestRunAhead",),
    "test_numerics": ("TestMaskedNonFinite",),
    "test_prefix": ("TestPrefixCache",),
    "test_quantized": ("TestQuantizedKV",),
    "test_invariance": ("TestBatchInvariance",),
    "test_groups": ("TestWindowGroups",),
    "test_states": ("TestStateSlots",),
}
_HELPERS = {
    "harness": ("CachePair", "RunAhead", "make_config"),
    "model": ("DenseModel", "dense_attention"),
    "tolerance": ("TOLERANCES", "Tolerance", "assert_close", "Mismatch", "round_to"),
    "trees": ("random_tree", "random_parents", "tree_mask"),
}
_WHERE = {name: module for table in (_TESTS, _HELPERS)
          for module, names in table.items() for name in names}

# ``from kvcache.conformance import *`` brings in the tests only (pytest collects them)
__all__ = sorted(name for names in _TESTS.values() for name in names)

PLUGIN = "kvcache.conformance.plugin"


def __getattr__(name):   # lazy: importing kvcache.conformance does not import pytest
    if name in _WHERE:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
