"""``EngineConfig`` (issue 52 item 4): an engine's options checked in one place, each bad value a
typed error naming the option; and ``SamplingParams``, now beside the scheduler, importable from
every path it was."""

from __future__ import annotations

import dataclasses

import pytest

from kvcache.errors import InvalidArgumentError
from kvcache.serving import EngineConfig


def test_the_defaults_are_the_engine_keywords_defaults():
    cfg = EngineConfig()
    assert (cfg.backend, cfg.page_size, cfg.max_batch_size, cfg.max_total_tokens,
            cfg.prefill_chunk_size, cfg.overlap, cfg.memory_fraction, cfg.prefix_cache,
            cfg.kv_dtype, cfg.compile_step, cfg.graphs, cfg.mixed_graphs) == \
        ("auto", 16, 64, None, None, True, 0.9, True, "auto", False, None, None)


@pytest.mark.parametrize("option,value,says", [
    ("page_size", 0, "page_size=0 must be an integer >= 1"),
    ("page_size", "16", "page_size='16'"),
    ("max_batch_size", True, "max_batch_size=True"),
    ("max_total_tokens", 1.5, "max_total_tokens=1.5 must be None or an integer >= 1"),
    ("prefill_chunk_size", -4, "prefill_chunk_size=-4"),
    ("offload_tokens", -1, "offload_tokens=-1 must be None or an integer >= 0"),
    ("graphs", "yes", "graphs='yes' must be None, True or False"),
    ("offload", 1, "offload=1 must be None, True or False"),
    ("compile_step", "on", "compile_step='on'"),
    ("mixed_graphs", 0, "mixed_graphs=0"),
    ("overlap", None, "overlap=None must be True or False"),
    ("prefix_cache", "no", "prefix_cache='no'"),
    ("memory_fraction", 0, "memory_fraction=0 must be a number in \\(0, 1\\]"),
    ("memory_fraction", True, "memory_fraction=True"),
    ("kv_dtype", None, "kv_dtype=None"),
    ("graph_batch_sizes", "8", "graph_batch_sizes='8'"),
    ("graph_batch_sizes", [4, 0], "graph_batch_sizes=\\(4, 0\\) must hold integers >= 1"),
])
def test_a_bad_option_is_a_typed_error_naming_it(option, value, says):
    with pytest.raises(InvalidArgumentError, match=says):
        EngineConfig(**{option: value})
    with pytest.raises(InvalidArgumentError, match=says):
        dataclasses.replace(EngineConfig(), **{option: value})          # checked again


def test_of_merges_keywords_over_a_config():
    base = EngineConfig(page_size=32, overlap=False, graph_batch_sizes=[1, 2, 4])
    assert base.graph_batch_sizes == (1, 2, 4)
    assert EngineConfig.of(base) is base
    assert EngineConfig.of(None, page_size=8) == EngineConfig(page_size=8)
    merged = EngineConfig.of(base, max_batch_size=8)
    assert (merged.page_size, merged.overlap, merged.max_batch_size) == (32, False, 8)
    with pytest.raises(TypeError, match="unknown Engine option.*'pagesize'"):
        EngineConfig.of(None, pagesize=8)
    with pytest.raises(InvalidArgumentError, match="config=.* must be an EngineConfig"):
        EngineConfig.of({"page_size": 8})                              # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.page_size = 8                                              # type: ignore[misc]


def test_sampling_params_is_one_class_on_every_import_path():
    import kvcache.integrations as integrations
    import kvcache.integrations.engine as engine
    import kvcache.integrations.sampling as sampling
    from kvcache.serving import SamplingParams
    from kvcache.serving.sampling_params import GREEDY_TEMPERATURE, MAX_N
    assert integrations.SamplingParams is engine.SamplingParams is sampling.SamplingParams \
        is SamplingParams
    assert (sampling.MAX_N, sampling.GREEDY_TEMPERATURE) == (MAX_N, GREEDY_TEMPERATURE)
    assert engine.EngineConfig is EngineConfig
