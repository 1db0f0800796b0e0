"""The Engine with a cache too small for its requests together (issue 28): a request that fits
alone finishes, in a bounded number of forwards, with the tokens it gets alone in a big cache; one
that cannot fit even alone is refused before anything runs; preemption takes the youngest
request first; identical prompts and a prompt that is a prefix of another share their prefix;
seed and stop_token_ids are checked up front."""

from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import make_model

import kvcache
from kvcache.integrations.transformers import Engine


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", seed=3)


_ALONE: dict = {}


def alone(model, prompt, new: int) -> list:
    """Greedy tokens of ``prompt`` run alone in a big cache (memoised per prompt: the first
    ``new`` of 16)."""
    assert new <= 16
    key = (id(model), tuple(prompt))
    if key not in _ALONE:
        engine = Engine(model, backend="reference", max_total_tokens=2048, offload=False)
        _ALONE[key] = engine.generate([prompt], max_new_tokens=16, ignore_eos=True)[0][0]
        assert engine.stats.preemptions == 0
    return _ALONE[key][:new]


class Hang(Exception):
    """More forwards than the bound: the scheduler is not making progress."""


def guard(engine, bound: int) -> None:
    """Make ``engine``'s forward raise ``Hang`` past ``bound`` forwards."""
    forward = engine.adapter.forward

    def counted(*args):
        if engine.stats.forwards >= bound:
            raise Hang(f"{engine.stats.forwards} forwards, {engine.stats.preemptions} "
                       f"preemptions and still running")
        return forward(*args)

    engine.adapter.forward = counted


def forward_bound(prompts, new: int, n: int) -> int:
    """A bound on a generate call's forwards: every forward advances the oldest unfinished
    sequence by a token and that one is never preempted, so it is at most the tokens of every
    sequence the call can make (a prompt's, its n samples', its prefix sequences'), and a step
    launched ahead and dropped per sample that stops on a stop token."""
    return sum((n + 1) * (len(p) + new) + 2 * len(p) + n for p in prompts)


def tokens(seed: int, length: int) -> list:
    return np.random.default_rng(seed).integers(1, 512, length).tolist()


# ------------------------------------------------------------------ defect 1: small cache
@pytest.mark.parametrize("n,offload", [(2, False), (3, False), (3, True)])
def test_requests_that_fit_alone_finish_in_a_small_cache(llama, n, offload):
    # issue 28: a 64-token cache, prompts of 40 and 17 tokens, n=2: the scheduler preempted the
    # sequence it was trying to run, over and over (thousands of forwards)
    prompts = [tokens(0, 40), tokens(1, 17)]
    engine = Engine(llama, backend="reference", max_total_tokens=64, page_size=8, offload=offload)
    guard(engine, forward_bound(prompts, 12, n))
    out = engine.generate(prompts, max_new_tokens=12, n=n)
    assert out == [[alone(llama, p, 12)] * n for p in prompts]
    assert engine.cache.is_empty


def test_a_request_that_exactly_fills_the_cache_runs(llama):
    # a sequence holds its prompt and all new tokens but the last (never written): 40 + 25 - 1
    # = 64 tokens, the whole cache (8 pages of 8); with a second request and n=2 beside it
    prompts = [tokens(2, 40), tokens(3, 17)]
    engine = Engine(llama, backend="reference", max_total_tokens=64, page_size=8)
    guard(engine, forward_bound(prompts, 16, 2))
    assert engine.generate(prompts, max_new_tokens=16, n=2) == [
        [alone(llama, p, 16)] * 2 for p in prompts]
    out = engine.generate(prompts[:1], max_new_tokens=25)
    assert len(out[0][0]) == 25 and out[0][0][:16] == alone(llama, prompts[0], 16)
    assert engine.cache.is_empty


def test_a_request_that_cannot_fit_alone_is_refused_up_front(llama):
    engine = Engine(llama, backend="reference", max_total_tokens=64, page_size=8)
    prompts = [tokens(4, 17), tokens(5, 40)]
    # 40 + 26 - 1 = 65 tokens: 9 pages of 8, the cache has 8
    with pytest.raises(kvcache.InvalidArgumentError,
                       match=r"prompt 1: 40 tokens \+ max_tokens=26 .*9 pages of 8.*\(8 pages: "
                             r"its 9 pages, .* less the 1 kept spare; max_total_tokens=64\)"):
        engine.generate(prompts, max_new_tokens=26, n=2)
    assert engine.stats.forwards == 0 and engine.cache.is_empty


# ------------------------------------------------------------------ preemption order
def test_preemption_takes_the_youngest_request_first(llama):
    """Three requests that fit alone but not together (offload off: a preempted request is
    removed from the cache): the first preempted is the youngest (request 2), and the oldest
    (request 0) is never preempted."""
    prompts = [tokens(10 + i, 30) for i in range(3)]
    new = 16
    engine = Engine(llama, backend="reference", max_total_tokens=112, page_size=8, offload=False)
    cache = engine.cache
    first: dict = {}                 # sequence id -> the request whose prompt it started with
    removed: list = []               # (request, tokens held) of each removal
    forward, remove = cache.forward, cache.remove_sequence
    run = engine.adapter.forward

    def seen(cache_, toks, positions, rows):
        # the forward's sequences are those of the cache.forward call around it
        offset = 0
        for sid, length in zip(opened[0], opened[1]):
            if int(positions[offset]) == 0:
                first.setdefault(sid, next(i for i, p in enumerate(prompts)
                                           if p[0] == int(toks[offset])))
            offset += length
        return run(cache_, toks, positions, rows)

    opened: list = [[], []]

    def spy_forward(ids, lens, *a, **k):
        opened[0], opened[1] = list(ids), list(lens)
        return forward(ids, lens, *a, **k)

    def spy_remove(sid):
        removed.append((first[sid], cache.sequence_length(sid)))
        return remove(sid)

    cache.forward, cache.remove_sequence = spy_forward, spy_remove
    engine.adapter.forward = seen
    out = engine.generate(prompts, max_new_tokens=new)
    assert out == [[alone(llama, p, new)] for p in prompts]
    preempted = [req for req, held in removed if held < len(prompts[req]) + new - 1]
    assert engine.stats.preemptions == len(preempted) > 0
    assert preempted[0] == 2, removed
    assert 0 not in preempted, removed


# ------------------------------------------------------------------ prefix sharing
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_identical_prompts_and_a_prefix_prompt_share_their_prefix(llama, prefix_cache):
    # a 40-token prompt twice and its first 20 tokens, pages of 16: with the prefix cache the
    # first computes its 40 tokens, the others wait for it and start from its whole pages (the
    # second from 32 tokens, computing 8; the third from 16, computing 4); without it each
    # computes its own. No fork (prompts share through the prefix cache), no preemption
    a = tokens(20, 40)
    prompts = [a, a, a[:20]]
    engine = Engine(llama, backend="reference", max_total_tokens=1024, prefix_cache=prefix_cache)
    assert engine.cache.config.page_size == 16
    out = engine.generate(prompts, max_new_tokens=8)
    assert out == [[alone(llama, p, 8)] for p in prompts]
    s = engine.stats
    first = 40 + 8 + 4 if prefix_cache else 100
    assert (s.prefill_tokens, s.preemptions, s.forks) == (first, 0, 0)
    assert s.prefix_hit_tokens == (32 + 16 if prefix_cache else 0)
    engine.generate([a, a], max_new_tokens=8)
    # a later call: without the prefix cache every token is computed again (40 + 40); with it,
    # both find the two whole pages cached and compute the last 8 each (neither waits: the
    # older has nothing more of a whole page to compute for the younger)
    assert (s.prefill_tokens - first, s.preemptions) == ((16 if prefix_cache else 80), 0)
    assert s.prefix_hit_tokens == (48 + 64 if prefix_cache else 0)


# ------------------------------------------------------------------ argument checks
@pytest.mark.parametrize("kwargs,match", [
    (dict(seed=-1), r"seed=-1 must be an integer >= 0"),
    (dict(seed=1.5), r"seed=1.5 must be an integer >= 0"),
    (dict(stop_token_ids=5), r"stop_token_ids=5 must be a sequence of integer token ids"),
    (dict(stop_token_ids="ab"), r"stop_token_ids='ab' must be a sequence of integer token ids"),
    (dict(stop_token_ids=[1, None]), r"stop_token_ids must hold integer ids, got None"),
])
def test_seed_and_stop_token_ids_are_checked_up_front(llama, kwargs, match):
    engine = Engine(llama, backend="reference", max_total_tokens=256)
    with pytest.raises(kvcache.InvalidArgumentError, match=match):
        engine.generate([[1, 2, 3]], max_new_tokens=2, temperature=1.0, **kwargs)
    assert engine.stats.forwards == 0 and engine.cache.is_empty


# ------------------------------------------------------------------ randomised
def random_case(seed: int) -> dict:
    """Tiny caches, 2 to 4 requests (some identical, some a prefix or an extension of another),
    prompts near the longest that fits, n up to 3, the host tier on or off, chunked prefill,
    small batches, a stop token now and then; in about one case of seven a request that cannot
    fit even alone."""
    rng = random.Random(seed)
    ps = rng.choice([2, 4, 8, 16])
    total = rng.randint(2, 80 // ps) * ps + rng.choice([0, 0, -1])      # sometimes not whole pages
    capacity = -(-total // ps) * ps
    new = rng.randint(1, min(12, capacity))
    room = capacity - new + 1                           # the longest prompt that fits alone
    count = rng.randint(2, 4)
    too_big = rng.randrange(count) if rng.random() < 0.15 else -1
    prompts: list = []
    for i in range(count):
        if i == too_big:
            length = rng.randint(room + 1, room + 8)
        else:
            length = rng.randint(max(1, room * 2 // 3), room)
        if prompts and i != too_big and rng.random() < 0.5:
            other = rng.choice(prompts)
            kind = rng.choice(["same", "prefix", "longer"])
            if kind == "same":
                prompt = list(other)
            elif kind == "prefix":
                prompt = other[:rng.randint(1, len(other))]
            else:
                prompt = (other + tokens(rng.randrange(10**6), length))[:max(length, len(other))]
        else:
            prompt = tokens(rng.randrange(10**6), length)
        prompts.append(prompt)
    engine = dict(page_size=ps, max_total_tokens=total, offload=rng.random() < 0.4,
                  max_batch_size=rng.choice([1, 2, 3, 8]), overlap=rng.random() < 0.7,
                  prefill_chunk_size=rng.choice([None, None, ps, 3 * ps, 5]))
    return dict(engine=engine, prompts=prompts, new=new, n=rng.choice([1, 2, 2, 3, 3]),
                stop=rng.random() < 0.3, pick=rng.randrange(16))


def check_case(model, seed: int) -> None:
    case = random_case(seed)
    prompts, new, n = case["prompts"], case["new"], case["n"]
    engine = Engine(model, backend="reference", **case["engine"])
    ps, pages = engine.config.page_size, engine.cache.num_total_pages - 1
    too_big = [i for i, p in enumerate(prompts) if -(-(len(p) + new - 1) // ps) > pages]
    if too_big:
        with pytest.raises(kvcache.InvalidArgumentError,
                           match=rf"prompt {too_big[0]}: .*max_total_tokens="):
            engine.generate(prompts, max_new_tokens=new, n=n)
        assert engine.stats.forwards == 0 and engine.cache.is_empty
        return
    want = [alone(model, p, new) for p in prompts]
    stops = []
    if case["stop"]:                    # a token one of the requests makes: it stops there
        stops = [alone(model, prompts[0], 16)[case["pick"]]]
        want = [w[:w.index(stops[0]) + 1] if stops[0] in w else w for w in want]
    guard(engine, forward_bound(prompts, new, n))
    out = engine.generate(prompts, max_new_tokens=new, n=n, stop_token_ids=stops)
    assert out == [[w] * n for w in want], case
    assert engine.cache.is_empty


@pytest.mark.parametrize("seed", range(24))
def test_random_small_caches_finish_or_refuse_up_front(llama, seed):
    check_case(llama, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(24, 400))
def test_random_small_caches_finish_or_refuse_up_front_more(llama, seed):
    check_case(llama, seed)
