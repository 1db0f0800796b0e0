"""Prompts that share a prefix share it through the prefix cache (issue 52 item 3): a younger
prompt waits while an older one computes the shared pages, then starts from them. Aborting the
older prompt half prefilled lets the younger ones go on from what is cached; aborting every one
leaves nothing in the cache. Fake runner on the reference backend (fake.py)."""

from __future__ import annotations

import pytest

from kvcache.integrations.sampling import SamplingParams

from fake import expected, make_core, run_all

PARAMS = SamplingParams(max_tokens=5, temperature=0.0)


def _prompts(core) -> list:
    return sorted((s for s in core.scheduler.seqs.by_sid.values() if s.kind == "prompt"),
                  key=lambda s: s.order)


def _half_prefilled(core):
    """Step until the oldest prompt is in the cache with some of its tokens still pending;
    returns it."""
    for _ in range(4):
        core.step()
        half = [s for s in _prompts(core) if s.live and 0 < s.cached < len(s.tokens)]
        if half:
            return half[0]
    raise AssertionError("no half-prefilled prompt: the setup no longer builds one")


def _empty_and_idle(core, cache, base) -> None:
    outs = core.step()                              # reports the aborts
    assert outs and all(o.finish_reason == "abort" for o in outs)
    assert not core.has_unfinished()
    assert cache.is_empty and cache.num_sequences == 0
    assert cache.num_available_pages == base
    assert core.scheduler.num_running == 0 and core.scheduler.seqs.by_sid == {}


SHARED = list(range(1, 25))                         # 6 pages of 4: prefilled 8 tokens a step


def _three(prefix_cache, pipelined=True):
    core, _, cache = make_core(page_size=4, prefill_chunk_size=8, pipelined=pipelined,
                               prefix_cache=prefix_cache)
    prompts = [SHARED + [40 + i, 50 + i] for i in range(3)]
    return core, cache, cache.num_available_pages, prompts, [core.add_request(p, PARAMS)
                                                             for p in prompts]


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["plain", "prefix-cache"])
@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "sync"])
def test_aborting_every_request_on_a_half_prefilled_shared_prompt_empties_the_cache(
        pipelined, prefix_cache):
    core, cache, base, _, ids = _three(prefix_cache, pipelined)
    oldest = _half_prefilled(core)
    others = [s for s in _prompts(core) if s is not oldest]
    if prefix_cache:      # the younger ones wait for the oldest to compute the shared pages
        assert others and not any(s.live for s in others)
    for rid in ids:
        core.abort(rid)
    _empty_and_idle(core, cache, base)
    # the next requests run from an empty cache (the fake model reads its history back from
    # the cache: a stale page would change their tokens)
    again = [SHARED + [60], list(range(30, 41))]
    new = [core.add_request(p, PARAMS) for p in again]
    got = run_all(core)
    for rid, p in zip(new, again):
        assert got[(rid, 0)] == (expected(p, PARAMS), "length")
    assert cache.num_sequences == 0 and cache.num_available_pages == base
    assert not core.has_unfinished()


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "sync"])
def test_aborting_the_prompt_the_others_wait_on_lets_them_go_on(pipelined):
    # the oldest is aborted half prefilled: its full pages computed so far stay cached, the
    # two younger prompts start from them and get the judge's tokens
    core, cache, base, prompts, ids = _three(True, pipelined)
    oldest = _half_prefilled(core)
    done = oldest.cached - oldest.cached % 4
    core.abort(ids[0])
    got = run_all(core)
    for rid, p in zip(ids[1:], prompts[1:]):
        assert got[(rid, 0)] == (expected(p, PARAMS), "length")
    s = core.stats
    assert s.prefix_hit_tokens >= done > 0          # the aborted prompt's pages were used
    assert cache.num_sequences == 0 and cache.num_available_pages == base


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "sync"])
def test_nested_shared_prefixes_are_computed_once(pipelined):
    # an outer prefix shared by three prompts, an inner one (longer) by two of them: the
    # oldest computes the inner one, the others start from the prefix cache (the second the
    # inner prefix, the third the outer), in whole pages, the last token left to compute
    core, _, cache = make_core(page_size=4, prefill_chunk_size=64, pipelined=pipelined,
                               prefix_cache=True)
    outer = list(range(1, 17))
    inner = outer + list(range(70, 82))
    prompts = [inner + [90], inner + [91], outer + [92, 93]]
    ids = [core.add_request(p, PARAMS) for p in prompts]
    got = run_all(core)
    for rid, p in zip(ids, prompts):
        assert got[(rid, 0)] == (expected(p, PARAMS), "length")
    s = core.stats
    assert s.prefix_hit_tokens == len(inner) + len(outer)
    assert s.prefill_tokens == len(prompts[0]) + 1 + 2
    assert s.forks == 0


def test_a_prompt_that_shares_less_than_a_page_does_not_wait():
    core, _, cache = make_core(page_size=4, prefill_chunk_size=64, prefix_cache=True)
    ids = [core.add_request([1, 2, 3, 9 + i, 5, 6], PARAMS) for i in range(2)]
    core.step()
    assert all(s.live for s in _prompts(core))      # both in the first forward
    got = run_all(core)
    assert {rid for rid, _ in got} == set(ids) and core.stats.prefix_hit_tokens == 0


def test_n_samples_still_fork_from_their_prompt():
    # the fork stays for n > 1: the prompt becomes the samples' prefix, each forks from it
    core, _, cache = make_core(page_size=4, prefix_cache=True)
    params = SamplingParams(max_tokens=4, temperature=0.8, n=3, seed=5)
    prompt = list(range(1, 11))
    rid = core.add_request(prompt, params)
    got = run_all(core)
    for j in range(3):
        assert got[(rid, j)] == (expected(prompt, params, j), "length")
    assert core.stats.forks == 3 and core.stats.shared_prefix_tokens == 3 * len(prompt)
    assert core.stats.prefill_tokens == len(prompt)
