"""The Engine's features over a transformers model: parallel samples forked from one prefill,
reproducible sampling with log-probabilities that match the model's own forward, preemption,
stop tokens, bad input; the user-loop attention path; the RoPE-mode guard; the missing extra."""

from __future__ import annotations

import importlib
import sys
import warnings

import numpy as np
import pytest

from conftest import backend_or_skip, hf_greedy, hf_logits, make_model, make_prompts, torch

import kvcache
from kvcache.integrations import MissingExtraError
from kvcache.integrations import transformers as kvt
from kvcache.integrations.engine import PendingPicks
from kvcache.integrations.transformers import Engine


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", seed=3)


def test_parallel_samples_prefill_once_and_match_teacher_forcing(llama):
    prompt = make_prompts(seed=11)[3]                     # 128 tokens
    n, new = 4, 24
    engine = Engine(llama, backend="reference", max_total_tokens=4096, prefill_chunk_size=256)
    calls = []
    forward = engine.adapter.forward

    def count(cache, tokens, positions, rows):
        calls.append(len(tokens))
        return forward(cache, tokens, positions, rows)

    engine.adapter.forward = count
    out, logprobs = engine.generate([prompt], max_new_tokens=new, n=n, temperature=1.0, seed=5,
                                    return_logprobs=True)
    # the prompt ran once (one forward of 128 tokens), then every step decodes the n samples
    assert calls[0] == len(prompt) and sum(calls) == len(prompt) + n * (new - 1)
    assert engine.stats.prefill_tokens == len(prompt)
    assert engine.stats.decode_tokens == n * (new - 1)
    assert engine.stats.forks == n and engine.stats.shared_prefix_tokens == n * len(prompt)
    samples = out[0]
    assert len(samples) == n and all(len(s) == new for s in samples)
    assert len({tuple(s) for s in samples}) == n, "the samples should differ"
    # the same seed gives the same samples (a fresh engine), another seed other samples
    again = Engine(llama, backend="reference", max_total_tokens=4096).generate(
        [prompt], max_new_tokens=new, n=n, temperature=1.0, seed=5)
    assert again[0] == samples
    other = engine.generate([prompt], max_new_tokens=new, n=n, temperature=1.0, seed=6)
    assert other[0] != samples
    # every sampled sequence re-scored by transformers' own forward (teacher forcing)
    for s, lp in zip(samples, logprobs[0]):
        logits = hf_logits(llama, prompt + s)[len(prompt) - 1:-1]
        top = logits.max(-1, keepdims=True)
        logz = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[:, 0]
        want = logits[np.arange(new), s] - logz
        np.testing.assert_allclose(lp, want, rtol=1e-4, atol=1e-4)


def test_greedy_samples_are_identical_and_match_transformers(llama):
    prompt = make_prompts(seed=12)[2]
    out = Engine(llama, backend="reference").generate([prompt], max_new_tokens=12, n=3)
    want = hf_greedy(llama, prompt, 12)
    assert out[0] == [want] * 3


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_greedy_steps_pick_on_the_device_not_from_host_rows(llama, backend, monkeypatch):
    # a greedy step moves (token, log-probability) pairs, never the (B, vocab) logit rows; the
    # picks and their log-probabilities are those of transformers' own forward
    backend, device = backend_or_skip(backend, monkeypatch, llama.config.head_dim)
    prompts = make_prompts(seed=14)[:3]
    engine = Engine(llama, backend=backend, device=device, max_total_tokens=4096)

    def no_rows(logits):
        raise AssertionError("a greedy step copied its logit rows to the host")

    engine.adapter.to_numpy = no_rows
    out, logprobs = engine.generate(prompts, max_new_tokens=10, return_logprobs=True)
    for prompt, (got,), (lp,) in zip(prompts, out, logprobs):
        assert got == hf_greedy(llama, prompt, 10)
        logits = hf_logits(llama, prompt + got)[len(prompt) - 1:-1]
        top = logits.max(-1, keepdims=True)
        logz = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[:, 0]
        np.testing.assert_allclose(lp, logits[np.arange(10), got] - logz, rtol=1e-4, atol=1e-4)


def test_greedy_picks_without_logprobs_skip_them_and_keep_the_tokens(llama):
    # generate without return_logprobs asks for no log-sum-exp: the picks come from the
    # logits' own dtype (bf16 here), the first of equal maxima as with float rows
    from kvcache.integrations.engine import ModelAdapter
    adapter = Engine(llama, backend="reference").adapter
    rows = torch.tensor([[0.5, 3.0, 3.0, -1.0], [2.0, 1.0, 2.0, 2.0], [-4.0, -3.5, -3.5, -9.0]],
                        dtype=torch.bfloat16)
    rows[1, 1] = 2.015625                               # one bf16 step above 2.0: the maximum
    for greedy in (adapter.greedy, lambda x, lp: ModelAdapter.greedy(adapter, x, lp),
                   lambda x, lp: adapter.greedy_async(x, lp).result()):
        tokens, lps = greedy(rows, False)
        assert tokens.tolist() == [1, 1, 1] and np.isnan(lps).all()
        tokens, lps = greedy(rows, True)
        assert tokens.tolist() == [1, 1, 1] and np.isfinite(lps).all()
    calls = []
    engine = Engine(llama, backend="reference", max_total_tokens=4096)
    for name in ("greedy", "greedy_async"):
        real = getattr(engine.adapter, name)
        setattr(engine.adapter, name, lambda x, lp=True, real=real: calls.append(lp) or real(x, lp))
    prompts = make_prompts(seed=14)[:2]
    out = engine.generate(prompts, max_new_tokens=6)
    assert calls and not any(calls)
    calls.clear()
    out2, lps = engine.generate(prompts, max_new_tokens=6, return_logprobs=True)
    assert out2 == out and calls and all(calls)
    assert all(np.isfinite(x).all() for req in lps for x in req)


def test_sampled_steps_move_draws_not_rows(llama):
    # temperature > 0: one draw per step for every sample (a prompt's n samples from one row),
    # on the logits' device; the (B, vocab) rows never reach the host
    prompt = make_prompts(seed=16)[2]
    engine = Engine(llama, backend="reference", max_total_tokens=4096)

    def no_rows(logits):
        raise AssertionError("a sampled step copied its logit rows to the host")

    engine.adapter.to_numpy = no_rows
    out, logprobs = engine.generate([prompt], max_new_tokens=8, n=3, temperature=0.7, seed=2,
                                    return_logprobs=True)
    assert len({tuple(x) for x in out[0]}) > 1
    for s, lp in zip(out[0], logprobs[0]):
        logits = hf_logits(llama, prompt + s)[len(prompt) - 1:-1]
        top = logits.max(-1, keepdims=True)
        logz = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[:, 0]
        np.testing.assert_allclose(lp, logits[np.arange(8), s] - logz, rtol=1e-4, atol=1e-4)


def test_preemption_recomputes_and_keeps_the_tokens(llama):
    prompts = make_prompts(seed=13)[:6]
    new = 40
    want = [hf_greedy(llama, p, new) for p in prompts]
    # 40 pages of 16 tokens: not enough for the six requests together
    engine = Engine(llama, backend="reference", max_total_tokens=640, prefill_chunk_size=64,
                    max_batch_size=8)
    out = engine.generate(prompts, max_new_tokens=new)
    assert engine.stats.preemptions > 0 and engine.stats.recomputed_tokens > 0
    assert [o[0] for o in out] == want
    assert engine.cache.is_empty


def test_stop_tokens_end_a_sample(llama):
    prompt = make_prompts(seed=14)[0]
    want = hf_greedy(llama, prompt, 20)
    stop = want[5]
    cut = want[:want.index(stop) + 1]
    engine = Engine(llama, backend="reference")
    assert engine.generate([prompt], max_new_tokens=20, stop_token_ids=[stop])[0][0] == cut


@pytest.mark.parametrize("backend,graphs", [("reference", False), ("cuda", False), ("cuda", True)])
def test_overlapped_decode_gives_the_same_tokens(llama, backend, graphs, monkeypatch):
    # the host one step ahead (step N+1 launched from step N's picks before they reach the host)
    # changes no token: against the same engine without overlap and transformers' generate,
    # with stop tokens ending some samples mid-run (their queued step's pick is dropped)
    backend, device = backend_or_skip(backend, monkeypatch, llama.config.head_dim)
    prompts = make_prompts(seed=15)[:5]
    want = [hf_greedy(llama, p, 16) for p in prompts]
    stops = [want[0][4], want[3][9]]
    kw = dict(backend=backend, device=device, max_batch_size=8, max_total_tokens=4096,
              graphs=graphs)
    on = Engine(llama, **kw)
    off = Engine(llama, overlap=False, **kw)
    got, lp_on = on.generate(prompts, max_new_tokens=16, stop_token_ids=stops, return_logprobs=True)
    ref, lp_off = off.generate(prompts, max_new_tokens=16, stop_token_ids=stops, return_logprobs=True)
    assert got == ref
    for (g,), w in zip(got, want):             # each stops at its first stop token, if any
        cut = next((i + 1 for i, t in enumerate(w) if t in stops), len(w))
        assert g == w[:cut]
    assert any(len(g) < 16 for (g,) in got)    # some sample did stop early
    np.testing.assert_allclose(np.concatenate([x for (x,) in lp_on]),
                               np.concatenate([x for (x,) in lp_off]), rtol=1e-5, atol=1e-5)
    assert on.stats.overlapped_forwards > 0 and off.stats.overlapped_forwards == 0
    assert on.cache.num_sequences == 0 and on.cache.num_available_pages == off.cache.num_available_pages
    if graphs:
        assert on.stats.graph_forwards > 0


@pytest.mark.parametrize("backend,graphs", [("reference", False), ("cuda", False), ("cuda", True)])
def test_pipelined_prompt_steps_give_the_same_tokens(llama, backend, graphs, monkeypatch):
    # greedy steps with prompt chunks are launched before the host reads the step before's
    # picks; the tokens those picks stand for (a prompt's first sample, a decode joining a
    # step with prompt chunks) reach the next step where the picks are. Against the same
    # engine without overlap and transformers' generate: more prompts than batch slots
    # (requests join as others leave), small chunks, stop tokens, a request of one token
    backend, device = backend_or_skip(backend, monkeypatch, llama.config.head_dim)
    prompts = make_prompts(seed=16)[:7]
    new = 12
    want = [hf_greedy(llama, p, new) for p in prompts]
    stops = [want[1][3], want[4][7]]
    # the steps with prompt chunks run eagerly (the spy below sees them): with graphs on, their
    # captured form is judged in test_engine_mixed_graphs.py
    kw = dict(backend=backend, device=device, max_batch_size=3, max_total_tokens=4096,
              prefill_chunk_size=48, graphs=graphs, mixed_graphs=False)
    on = Engine(llama, **kw)
    off = Engine(llama, overlap=False, **kw)
    reads = []              # (forwards when made, when read, made by a step with prompt chunks)
    chunked = []
    forward, async_picks = on.adapter.forward, on.adapter.greedy_async

    def forward_spy(cache, tokens, positions, rows):
        chunked.append(len(tokens) > len(rows))          # more tokens than picks: prompt chunks
        return forward(cache, tokens, positions, rows)

    def picks_spy(logits, logprobs=True):
        pending = async_picks(logits, logprobs)
        made, with_chunks = on.stats.forwards, bool(chunked) and chunked[-1]

        def result():
            reads.append((made, on.stats.forwards, with_chunks))
            return pending.result()
        return PendingPicks(pending.tokens, result)

    on.adapter.forward, on.adapter.greedy_async = forward_spy, picks_spy
    got, lp_on = on.generate(prompts, max_new_tokens=new, stop_token_ids=stops, return_logprobs=True)
    ref, lp_off = off.generate(prompts, max_new_tokens=new, stop_token_ids=stops, return_logprobs=True)
    assert got == ref
    for (g,), w in zip(got, want):
        cut = next((i + 1 for i, t in enumerate(w) if t in stops), len(w))
        assert g == w[:cut]
    np.testing.assert_allclose(np.concatenate([x for (x,) in lp_on]),
                               np.concatenate([x for (x,) in lp_off]), rtol=1e-5, atol=1e-5)
    # every step's picks but the last step's were read after the next step had been launched,
    # steps with prompt chunks included
    late = [(made, read) for made, read, _ in reads if read <= made]
    assert late == [(on.stats.forwards, on.stats.forwards)], late
    assert sum(1 for made, read, c in reads if c and read > made) >= 8
    assert on.stats.overlapped_forwards == on.stats.forwards - 1
    assert off.stats.overlapped_forwards == 0
    assert on.stats.forwards >= off.stats.forwards            # a dropped step at most per stop
    assert on.cache.num_sequences == 0 and on.cache.num_available_pages == off.cache.num_available_pages
    one = on.generate([prompts[0], prompts[2]], max_new_tokens=1)
    assert [o[0] for o in one] == [want[0][:1], want[2][:1]]


def test_bad_input_is_refused_before_anything_runs(llama):
    engine = Engine(llama, backend="reference", max_total_tokens=256)
    with pytest.raises(kvcache.InvalidArgumentError, match="prompt 1.*token 9999"):
        engine.generate([[1, 2], [3, 9999]], max_new_tokens=2)
    with pytest.raises(kvcache.InvalidArgumentError, match="prompt 0 must be a non-empty"):
        engine.generate([[]])
    with pytest.raises(kvcache.InvalidArgumentError, match="max_total_tokens=256"):
        engine.generate([[1] * 250], max_new_tokens=20)
    with pytest.raises(kvcache.InvalidArgumentError, match="temperature"):
        engine.generate([[1]], temperature=-1)
    with pytest.raises(kvcache.InvalidArgumentError, match="n=0"):
        engine.generate([[1]], n=0)
    assert engine.cache.is_empty and engine.stats.forwards == 0


def test_families_outside_the_matrix_run_or_are_refused_with_the_reason():
    """No family list: GPT-2 (absolute positions, fused c_attn) runs and gives transformers'
    greedy tokens; Falcon, whose layers do not call the attention interface, is refused
    saying so, and the cache is left empty."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=64, bos_token_id=None, eos_token_id=None,
        initializer_range=0.2)).eval()
    prompt = [1, 5, 9, 3, 7, 2, 11]
    engine = Engine(gpt2, backend="reference", max_total_tokens=512)
    assert engine.generate([prompt], max_new_tokens=10)[0][0] == hf_greedy(gpt2, prompt, 10)
    falcon = transformers.FalconForCausalLM(transformers.FalconConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, vocab_size=64,
        eos_token_id=None, bos_token_id=None)).eval()
    engine = Engine(falcon, backend="reference", max_total_tokens=512)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="attention interface"):
        engine.generate([prompt], max_new_tokens=2)
    assert engine.cache.is_empty and falcon.config._attn_implementation != "kvcache"


def test_user_loop_with_the_registered_attention(llama):
    """The documented loop: register, set_attn_implementation, packed batch, cache.forward."""
    prompts = make_prompts(seed=15)[:3]
    name = kvt.register()
    assert name == "kvcache"
    llama.set_attn_implementation("kvcache")
    try:
        cache = kvcache.PagedKVCache(kvt.cache_config(llama, max_total_tokens=2048), backend="reference")
        for i in range(3):
            cache.add_sequence(i)
        lens = [len(p) for p in prompts]
        ids = torch.tensor([sum(prompts, [])])
        pos = torch.tensor([sum((list(range(n)) for n in lens), [])])
        last = torch.tensor(np.cumsum(lens) - 1)
        with cache.forward([0, 1, 2], lens), torch.no_grad():
            logits = llama(ids, position_ids=pos, use_cache=False, kvcache=cache,
                           logits_to_keep=last).logits[0]
        # one decode step for the three sequences
        nxt = logits.argmax(-1)
        with cache.forward([0, 1, 2], [1, 1, 1]), torch.no_grad():
            step = llama(nxt[None], position_ids=torch.tensor([lens]), use_cache=False,
                         kvcache=cache).logits[0]
        # without the cache, the attention says what it needs
        with pytest.raises(kvcache.InvalidArgumentError, match="kvcache=cache"):
            with torch.no_grad():
                llama(ids[:, :4])
    finally:
        llama.set_attn_implementation("sdpa")
    for i, p in enumerate(prompts):
        want = hf_logits(llama, p + [int(nxt[i])])
        np.testing.assert_allclose(logits[i].numpy(), want[-2], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(step[i].numpy(), want[-1], rtol=1e-4, atol=1e-4)


def test_a_rotating_cache_is_refused_not_rotated_twice(llama):
    """The model applies its own RoPE: a cache in rope_mode 'normal' would rotate again."""
    cfg = kvt.cache_config(llama)
    assert cfg.rope_mode == "none"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=8, rope_mode="none")
    with pytest.warns(FutureWarning, match="rope_mode"):
        implicit = kvcache.CacheConfig(num_layers=cfg.num_layers, num_qo_heads=cfg.num_qo_heads,
                                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                       dtype="float32")
    assert implicit.rope_mode == "normal"
    cache = kvcache.PagedKVCache(implicit, backend="reference")
    cache.add_sequence(0)
    kvt.register()
    llama.set_attn_implementation("kvcache")
    try:
        with pytest.raises(kvcache.InvalidArgumentError, match="second time"):
            with cache.forward([0], [4]), torch.no_grad():
                llama(torch.tensor([[1, 2, 3, 4]]), position_ids=torch.arange(4)[None],
                      use_cache=False, kvcache=cache)
    finally:
        llama.set_attn_implementation("sdpa")
    assert cache.sequence_length(0) == 0          # the forward was aborted, nothing stored
    # the Engine always builds its cache with rope_mode 'none'
    assert Engine(llama, backend="reference").cache.config.rope_mode == "none"


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)     # as if not installed
    monkeypatch.delitem(sys.modules, "kvcache.integrations.transformers")
    with pytest.raises(MissingExtraError, match=r"pip install .\.\[transformers\].") as err:
        importlib.import_module("kvcache.integrations.transformers")
    assert isinstance(err.value, ImportError) and isinstance(err.value, kvcache.KVCacheError)
