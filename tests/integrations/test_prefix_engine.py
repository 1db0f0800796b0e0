"""The Engine's automatic prefix cache on a real model (a transformers Llama, reference backend):
a warm prefix gives the cold run's logits bit for bit (the docs' condition: the cold prompt's
first chunk ends at the page boundary), later calls and turns of a conversation find their
earlier pages (``stats.prefix_hit_tokens``), and the tokens are transformers' own greedy
``generate``'s and the engine's with the cache off."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import hf_greedy, make_model
from engine_cases import logit_rows

from kvcache.integrations import SamplingParams
from kvcache.integrations.transformers import Engine

PAGE = 16


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", seed=5)


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_a_warm_prefix_gives_the_cold_runs_logits_bit_for_bit(llama):
    rng = np.random.default_rng(3)
    vocab = llama.config.vocab_size
    system = rng.integers(1, vocab, 2 * PAGE).tolist()
    question, other = rng.integers(1, vocab, 7).tolist(), rng.integers(1, vocab, 9).tolist()
    # cold: nothing cached, the prompt's first chunk is the two pages of the system prompt
    cold = Engine(llama, backend="reference", page_size=PAGE, max_total_tokens=1024,
                  prefill_chunk_size=2 * PAGE, overlap=False)
    cold_rows = logit_rows(cold)
    want = cold.generate([system + question], greedy(6))
    assert cold.stats.prefix_hit_tokens == 0
    # warm: another request left the system prompt's pages; this one starts from them
    warm = Engine(llama, backend="reference", page_size=PAGE, max_total_tokens=1024,
                  prefill_chunk_size=2 * PAGE, overlap=False)
    warm.generate([system + other], greedy(3))
    warm_rows = logit_rows(warm)
    got = warm.generate([system + question], greedy(6))
    assert warm.stats.prefix_hit_tokens == 2 * PAGE
    assert got == want
    assert len(warm_rows) == len(cold_rows) == 6
    for step, (a, b) in enumerate(zip(cold_rows, warm_rows)):
        assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"


@pytest.mark.parametrize("overlap", [True, False])
def test_turns_of_a_conversation_reuse_the_last_turn_and_match_transformers(llama, overlap):
    rng = np.random.default_rng(11)
    vocab = llama.config.vocab_size
    engine = Engine(llama, backend="reference", page_size=PAGE, max_total_tokens=2048,
                    overlap=overlap)
    off = Engine(llama, backend="reference", page_size=PAGE, max_total_tokens=2048,
                 overlap=overlap, prefix_cache=False)
    convs = [rng.integers(1, vocab, n).tolist() for n in (37, 50)]
    hits_before = 0
    for turn in range(3):
        out = engine.generate(convs, greedy(9))
        assert out == off.generate(convs, greedy(9))
        for prompt, (answer,) in zip(convs, out):
            assert answer == hf_greedy(llama, prompt, 9)
        # the ideal: whole pages of the last turn's prompt and answer (its last token was
        # never fed to the model), at most len - 1 of this turn's prompt
        if turn:
            ideal = sum(min(len(p) + len(a) - 1, len(n) - 1) // PAGE * PAGE
                        for p, (a,), n in zip(last, last_out, convs))
            assert engine.stats.prefix_hit_tokens - hits_before == ideal
        hits_before = engine.stats.prefix_hit_tokens
        last, last_out = convs, out
        convs = [p + a + rng.integers(1, vocab, 5).tolist() for p, (a,) in zip(convs, out)]
    assert off.stats.prefix_hit_tokens == 0
    assert 0 < engine.stats.prefix_hit_rate < 1


def test_requests_arriving_one_per_step_share_a_system_prompt(llama):
    """Online: each request arrives after the one before was prefilled; all but the first
    start from the system prompt's pages (the cache off recomputes them every time)."""
    rng = np.random.default_rng(5)
    vocab = llama.config.vocab_size
    system = rng.integers(1, vocab, 3 * PAGE + 5).tolist()
    prompts = [system + rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(2, 9, 6)]
    got = {}
    for on in (True, False):
        engine = Engine(llama, backend="reference", page_size=PAGE, max_total_tokens=2048,
                        prefix_cache=on)
        out: dict = {}
        pending = list(prompts)
        while pending or engine.has_unfinished():
            if pending:
                rid = engine.add_request(pending.pop(0), greedy(4))
                out[rid] = []
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        got[on] = [out[r] for r in sorted(out)]
        assert engine.stats.prefix_hit_tokens == (5 * 3 * PAGE if on else 0)
        assert engine.cache.num_available_pages == engine.cache.num_total_pages
    assert got[True] == got[False]
