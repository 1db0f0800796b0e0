"""Two refusals a newcomer meets first (issue 53 item 6): ``Engine(model, backend="cuda")`` with the
model on the CPU says how to run it (the model on a GPU, or the reference backend), not how to
turn on the backend's CPU test mode; a request too large for the cache counts pages as the cache
reports them ("1 page", and the spare page that ``num_total_pages`` counts)."""

from __future__ import annotations

import re

import pytest

from conftest import make_model

import kvcache
from kvcache.integrations.transformers import Engine


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", seed=5)


def test_cuda_backend_with_a_cpu_model_says_move_it_or_use_reference(llama, monkeypatch):
    if "cuda" not in {r["name"] for r in kvcache.list_backends()}:
        pytest.skip("the cuda plugin is not installed")
    monkeypatch.delenv("KVCACHE_CUDA_CPU", raising=False)
    with pytest.raises(kvcache.BackendNotAvailableError) as err:
        Engine(llama, backend="cuda")
    first = str(err.value).splitlines()[0]
    assert first.startswith("backend 'cuda' is not available: device 'cpu' is the CPU"), first
    assert "model.to('cuda')" in first and "backend='reference'" in first, first
    assert "only a test mode" not in first, first
    # the test mode is still named, last, for the backend's own developers
    assert first.index("backend='reference'") < first.index("KVCACHE_CUDA_CPU=1"), first


def test_a_request_too_large_counts_pages_as_the_cache_does(llama):
    engine = Engine(llama, backend="reference", page_size=16, max_total_tokens=16, offload=False)
    cache = engine.cache
    assert (cache.num_total_pages, cache.num_available_pages) == (2, 2)    # 1 + the spare
    with pytest.raises(kvcache.InvalidArgumentError) as err:
        engine.generate([[1] * 10], max_new_tokens=10)
    message = str(err.value)
    assert "1 pages" not in message, message
    m = re.search(r"2 pages of 16, more than the cache holds even for this request alone "
                  r"\(1 page: its (\d+) pages, cache.num_total_pages, less the 1 kept spare; "
                  r"max_total_tokens=16\); raise max_total_tokens \(to (\d+), say\)", message)
    assert m and int(m[1]) == cache.num_total_pages, message
    # the suggestion fits, and the largest request the message allows runs
    bigger = Engine(llama, backend="reference", page_size=16, max_total_tokens=int(m[2]),
                    offload=False)
    assert len(bigger.generate([[1] * 10], max_new_tokens=10, ignore_eos=True)[0][0]) == 10
    assert len(engine.generate([[1] * 10], max_new_tokens=7, ignore_eos=True)[0][0]) == 7
