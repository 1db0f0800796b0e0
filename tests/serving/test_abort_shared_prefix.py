"""Aborting every request that shares a prefix still being prefilled (issue 51, item 2): the
prefix sequence leaves the cache with them (nothing will fork from it), holds no page, the
core has nothing unfinished, and the next requests run on an empty cache. Fake runner on the
reference backend (fake.py)."""

from __future__ import annotations

import pytest

from kvcache.integrations.sampling import SamplingParams

from fake import expected, make_core, run_all

PARAMS = SamplingParams(max_tokens=5, temperature=0.0)


def _prefixes(core) -> list:
    return [s for s in core.scheduler.seqs.by_sid.values() if s.kind == "prefix"]


def _half_prefilled(core) -> list:
    """Step until a shared prefix is in the cache with some of its tokens still pending."""
    for _ in range(4):
        core.step()
        half = [s for s in _prefixes(core) if s.live and 0 < s.cached < len(s.tokens)]
        if half:
            return half
    raise AssertionError("no half-prefilled prefix: the setup no longer builds one")


def _empty_and_idle(core, cache, base) -> None:
    outs = core.step()                              # reports the aborts
    assert outs and all(o.finish_reason == "abort" for o in outs)
    assert not core.has_unfinished()
    assert cache.is_empty and cache.num_sequences == 0
    assert cache.num_available_pages == base
    assert _prefixes(core) == [] and core.scheduler.num_running == 0


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["plain", "prefix-cache"])
@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "sync"])
def test_aborting_every_request_on_a_half_prefilled_prefix_retires_it(pipelined, prefix_cache):
    core, _, cache = make_core(page_size=4, prefill_chunk_size=8, pipelined=pipelined,
                               prefix_cache=prefix_cache)
    base = cache.num_available_pages
    shared = list(range(1, 25))                     # 6 pages: prefilled 8 tokens a step
    prompts = [shared + [40 + i, 50 + i] for i in range(3)]
    ids = [core.add_request(p, PARAMS) for p in prompts]
    _half_prefilled(core)
    for rid in ids:
        core.abort(rid)
    _empty_and_idle(core, cache, base)
    # the next requests run from an empty cache (the fake model reads its history back from
    # the cache: a stale prefix or page would change their tokens)
    again = [shared + [60], list(range(30, 41))]
    new = [core.add_request(p, PARAMS) for p in again]
    got = run_all(core)
    for rid, p in zip(new, again):
        assert got[(rid, 0)] == (expected(p, PARAMS), "length")
    assert cache.is_empty and cache.num_available_pages == base and not core.has_unfinished()


def _nested():
    """An outer prefix shared by three prompts, an inner one (longer) by two of them, all
    added: ``(core, cache, base pages, outer, prompts, request ids)``."""
    core, _, cache = make_core(page_size=4, prefill_chunk_size=8)
    base = cache.num_available_pages
    outer = list(range(1, 17))
    inner = outer + list(range(70, 82))
    prompts = [inner + [90], inner + [91], outer + [92, 93]]
    ids = [core.add_request(p, PARAMS) for p in prompts]
    return core, cache, base, outer, prompts, ids


def test_aborting_every_request_retires_nested_prefixes_still_waiting_on_each_other():
    # an outer prefix shared by three prompts, an inner one (longer) by two of them: the inner
    # waits to fork from the outer, which is half prefilled when every request is aborted
    core, cache, base, _, prompts, ids = _nested()
    _half_prefilled(core)
    assert len(_prefixes(core)) == 2
    for rid in ids:
        core.abort(rid)
    _empty_and_idle(core, cache, base)
    rid = core.add_request(prompts[0], PARAMS)
    assert run_all(core)[(rid, 0)] == (expected(prompts[0], PARAMS), "length")
    assert cache.is_empty and cache.num_available_pages == base


def test_aborting_the_requests_of_an_inner_prefix_keeps_the_outer_for_the_rest():
    # the inner prefix (two requests) is retired with them; the outer one, half prefilled,
    # stays for the third request, which forks from it and gets the judge's tokens; then
    # nothing is left in the cache
    core, cache, base, outer, prompts, ids = _nested()
    (half,) = _half_prefilled(core)
    assert half.tokens == outer
    core.abort(ids[0])
    core.abort(ids[1])
    assert [s.tokens for s in _prefixes(core)] == [outer]
    got = run_all(core)
    assert got[(ids[2], 0)] == (expected(prompts[2], PARAMS), "length")
    assert core.stats.forks == 1
    assert cache.is_empty and cache.num_available_pages == base and _prefixes(core) == []
