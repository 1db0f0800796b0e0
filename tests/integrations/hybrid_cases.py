"""What the hybrid-model integration tests share (models with state layers: LFM2's short
convolutions through transformers and mlx-lm, Bamba / Granite-4.0-H's Mamba-2 mixers,
Qwen3-Next's gated DeltaNet): the small workload, the model built once per family with the
library's own greedy tokens, and the test bodies that are the same for every family (the
Engine's queued greedy requests, preemption and forks, prefix hits through state
checkpoints). Neutral to the model library, as ``engine_cases``: each test file passes its
own model factory, Engine and the library's greedy generation."""

from __future__ import annotations

import numpy as np

from kvcache.integrations import SamplingParams

PAGE = 4
NEW = 10
CHUNK = 8                       # prompts of 19 and 37 tokens span 3 and 5 chunks
LENGTHS = (1, 2, 5, 19, 37)
VOCAB = 128
ENGINE = dict(page_size=PAGE, max_total_tokens=512, prefill_chunk_size=CHUNK, max_batch_size=4)
"""The Engine options of the tests (each adds its backend and device)."""
SHARED = 22                     # the shared prefix: five pages, the hit its first 20 tokens


def prompts(seed: int = 7) -> list:
    """One random prompt of each of ``LENGTHS`` tokens (ids in ``[1, VOCAB)``)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, n).tolist() for n in LENGTHS]


def once_per_family(make, greedy):
    """``case(*family)``: ``(model, prompts(), the library's greedy tokens per prompt)``, built
    once per ``family`` (the arguments of ``make``, which builds the model; none: its
    default). ``greedy(model, prompt)``: the library's own ``NEW`` greedy tokens."""
    built: dict = {}

    def case(*family):
        if family not in built:
            model = make(*family)
            ps = prompts()
            built[family] = (model, ps, [greedy(model, p) for p in ps])
        return built[family]
    return case


def assert_engine_greedy(engine, prompts: list, want: list, label: str = "",
                         shared: int = 4) -> None:
    """Every prompt queued on ``engine`` at once (greedy, ``NEW`` tokens each) and stepped to the
    end: each request's tokens are ``want``'s (``label`` begins the message), ``shared``
    sequences were in the cache at once, some forward mixed prefill and decode tokens, and the
    cache ends empty with every state slot back."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=NEW)) for p in prompts]
    got: dict = {rid: [] for rid in ids}
    most, mixed = 0, 0
    while engine.has_unfinished():
        outs = engine.step()
        most = max(most, engine.cache.num_sequences)
        for out in outs:
            got[out.request_id].extend(out.new_token_ids)
        mixed += engine.stats.prefill_tokens > 0 and engine.stats.decode_tokens > 0
    for i, rid in enumerate(ids):
        assert got[rid] == want[i], f"{label}prompt {i} ({len(prompts[i])} tokens)"
    assert most == shared and mixed
    assert engine.cache.is_empty
    assert engine.cache.num_available_state_slots == engine.config.num_state_slots


def assert_preemption_and_forks(engine_of, greedy) -> None:
    """Four requests of 18 tokens in a cache of 48 tokens: the scheduler preempts (the state
    slot comes back, the preempted request recomputes from fresh states); then ``n = 3``
    samples of one prompt, one sequence per forward, fork at the prompt's end (the children's
    slots take copies of the states); the tokens are the library's. ``engine_of(**options)``:
    an Engine of the test's model, ``options`` over ``ENGINE``; ``greedy(prompt)``: the
    library's ``NEW`` greedy tokens."""
    engine = engine_of(max_total_tokens=48)
    prompts = [list(range(i, i + 18)) for i in range(1, 5)]
    out = engine.generate(prompts, max_new_tokens=NEW)
    assert engine.stats.preemptions > 0 and engine.stats.recomputed_tokens > 0
    for i, p in enumerate(prompts):
        assert out[i][0] == greedy(p), f"prompt {i}"
    small = engine_of(max_total_tokens=256, max_batch_size=1)
    three = small.generate([prompts[0][:11]], SamplingParams(max_tokens=NEW, n=3))
    assert three[0] == [greedy(prompts[0][:11])] * 3
    assert small.stats.forks >= 3 and small.cache.is_empty
    assert small.cache.num_available_state_slots == 2


def shared_prefix_prompts(seed: int = 5) -> list:
    """Four prompts behind one ``SHARED``-token prefix, with 5, 9, 2 and 13 tokens of their
    own."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, VOCAB, SHARED).tolist()
    return [shared + rng.integers(1, VOCAB, n).tolist() for n in (5, 9, 2, 13)]


def assert_prefix_hits(engine, prompts: list, want: list) -> None:
    """``shared_prefix_prompts`` through ``engine`` (prefix cache on, a state checkpoint at
    every page boundary): the first alone (no hit), then the others in one call, each starting
    from the 20 cached tokens (the boundary at 20 lies inside the first's prefill chunk 16..24:
    its state layers give that checkpoint) with no miss; the greedy tokens are ``want``'s and
    every state slot comes back."""
    assert engine.generate(prompts[:1], max_new_tokens=NEW) == [[want[0]]]
    assert engine.stats.prefix_hit_tokens == 0
    out = engine.generate(prompts[1:], max_new_tokens=NEW)
    assert [o[0] for o in out] == want[1:]
    assert engine.stats.prefix_hit_tokens == 3 * 20
    assert engine.stats.prefix_miss_tokens_by_reason == {}      # no miss
    assert engine.cache.num_available_state_slots == engine.config.num_state_slots
