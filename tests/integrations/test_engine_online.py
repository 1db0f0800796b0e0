"""The Engine's online API on a real model (transformers, reference backend): requests added
while others decode, aborted mid-run and streamed (sync and asyncio) get the tokens ``generate``
gives the same prompts; an abort returns its pages at once; the cache is sized from device
memory; the progress display moves."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from conftest import hf_greedy, make_model
from engine_cases import make_prompts

import kvcache
from kvcache.integrations import SamplingParams
from kvcache.integrations.transformers import Engine
from kvcache.serving.progress import Progress


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", seed=5)


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llama):
    """What ``generate`` gives each prompt (greedy, 12 tokens; a sampled request too)."""
    prompts = make_prompts(seed=31)[:6]
    engine = Engine(llama, backend="reference", max_total_tokens=4096)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, n=2, seed=7, ignore_eos=True)
    out = engine.generate(prompts, [greedy(12)] * 5 + [sampled])
    return prompts, out, sampled


@pytest.mark.parametrize("overlap", [True, False])
def test_requests_added_while_others_decode_and_aborted_get_generates_tokens(llama, reference, overlap):
    prompts, want, sampled = reference
    engine = Engine(llama, backend="reference", max_total_tokens=4096, overlap=overlap)
    base = engine.cache.num_available_pages
    params = [greedy(12)] * 5 + [sampled]
    ids = {engine.add_request(prompts[0], params[0]): 0, engine.add_request(prompts[1], params[1]): 1}
    victim = engine.add_request(prompts[2], greedy(40))
    got: dict = {}
    reasons: dict = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            if out.finished:
                reasons[(out.request_id, out.index)] = out.finish_reason
        steps += 1
        if steps in (2, 4, 6, 7):            # arrivals while the first ones decode
            i = {2: 3, 4: 4, 6: 5, 7: 2}[steps]
            ids[engine.add_request(prompts[i], params[i])] = i
        if steps == 5:
            held = engine.cache.num_available_pages
            engine.abort(victim)
            assert engine.cache.num_available_pages > held      # its pages came back at once
    assert engine.cache.num_available_pages == base and engine.cache.is_empty
    for rid, i in ids.items():
        for j in range(params[i].n):
            assert got[(rid, j)] == want[i][j], (i, j)
            assert reasons[(rid, j)] == "length"
    assert reasons[(victim, 0)] == "abort" and len(got.get((victim, 0), [])) < 40
    assert engine.stats.forwards > 0 and (engine.stats.overlapped_forwards > 0) == overlap


def test_abort_alone_returns_to_the_baseline_in_the_same_step(llama):
    engine = Engine(llama, backend="reference", max_total_tokens=1024)
    base = engine.cache.num_available_pages
    rids = [engine.add_request(p, greedy(30)) for p in make_prompts(seed=32)[:3]]
    for _ in range(3):
        engine.step()
    assert engine.cache.num_available_pages < base
    for rid in rids:
        engine.abort(rid)
    assert engine.cache.num_available_pages == base
    outs = engine.step()
    assert {(o.request_id, o.finish_reason) for o in outs} == {(r, "abort") for r in rids}
    assert not engine.has_unfinished()


def test_stream_yields_as_it_goes_and_adds_up_to_generate(llama, reference):
    prompts, want, sampled = reference
    engine = Engine(llama, backend="reference", max_total_tokens=4096)
    got: dict = {}
    chunks = 0
    for out in engine.stream(prompts, [greedy(12)] * 5 + [sampled]):
        got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        chunks += 1
    assert chunks >= 12                         # token by token, not at the end
    assert [[got[(i, j)] for j in range(len(want[i]))] for i in range(len(prompts))] == want


def test_astream_serves_concurrent_coroutines_and_cancel_aborts(llama, reference):
    prompts, want, _ = reference
    engine = Engine(llama, backend="reference", max_total_tokens=4096)

    async def one(i):
        tokens = []
        async for out in engine.astream(prompts[i], greedy(12)):
            tokens.extend(out.new_token_ids)
        return tokens

    async def cancelled():
        async for out in engine.astream(prompts[0], greedy(40)):
            if out.new_token_ids:
                break                           # leaving the iteration aborts the request

    async def main():
        results = await asyncio.gather(*(one(i) for i in range(4)), cancelled())
        return results[:4]

    got = asyncio.run(main())
    assert got == [want[i][0] for i in range(4)]
    assert not engine.has_unfinished() and engine.cache.is_empty


def test_max_total_tokens_none_sizes_the_cache_from_device_memory(llama, monkeypatch):
    engine = Engine(llama, backend="reference", max_batch_size=8)
    assert engine.sizing == "default" and engine.config.max_total_tokens == 512 * 8
    from kvcache.integrations.transformers import TransformersAdapter
    gib = 2 ** 30
    monkeypatch.setattr(TransformersAdapter, "device_memory", lambda self, device: (6 * gib, 8 * gib))
    ran = []
    monkeypatch.setattr(TransformersAdapter, "peak_memory",
                        lambda self, device, run: ran.append(run()) or gib)
    engine = Engine(llama, backend="reference", max_batch_size=8, prefill_chunk_size=256,
                    memory_fraction=0.9, page_size=16)
    per_token = engine.config.token_kv_bytes
    # the engine's share is a fraction of what is free when it starts, less a largest step
    want = int((0.9 * 6 * gib - gib) // per_token) // 16 * 16
    assert ran and engine.config.max_total_tokens == want and "0.9 of 6.0 GiB free" in engine.sizing
    monkeypatch.setattr(TransformersAdapter, "device_memory", lambda self, device: (gib, 8 * gib))
    with pytest.raises(kvcache.InvalidArgumentError, match="memory_fraction=0.9: 1.00 GiB free"):
        Engine(llama, backend="reference", max_batch_size=8, prefill_chunk_size=256)
    for bad in (0, 1.5, "0.9", True):
        with pytest.raises(kvcache.InvalidArgumentError, match="memory_fraction"):
            Engine(llama, backend="reference", memory_fraction=bad)


def test_a_second_engine_sizes_itself_from_what_the_first_left(llama, monkeypatch):
    # the tp CLI's case on two GPUs: a first engine holds most of the device, a second one (on
    # the same device, in the same process) still gets a share of the rest (the old rule, a
    # fraction of the *total* less what is used, left it nothing: "no room for a cache")
    from kvcache.integrations.transformers import TransformersAdapter
    gib = 2 ** 30
    monkeypatch.setattr(TransformersAdapter, "device_memory",
                        lambda self, device: (4 * gib, 80 * gib))
    monkeypatch.setattr(TransformersAdapter, "peak_memory", lambda self, device, run: gib // 2)
    engine = Engine(llama, backend="reference", max_batch_size=8, prefill_chunk_size=256)
    want = int((0.9 * 4 * gib - gib // 2) // engine.config.token_kv_bytes) // 16 * 16
    assert engine.config.max_total_tokens == want > 0
    engine.generate([[1, 2, 3]], max_new_tokens=2)


def test_no_room_names_the_engines_and_processes_that_hold_the_memory(llama, monkeypatch):
    from kvcache.integrations.transformers import TransformersAdapter
    first = Engine(llama, backend="reference", max_total_tokens=4096)
    second = Engine(llama, backend="reference", max_total_tokens=2048)
    gib = 2 ** 30
    held = first.config.kv_bytes + second.config.kv_bytes
    free = 16 * first.config.token_kv_bytes          # one page: less than the two it needs
    monkeypatch.setattr(TransformersAdapter, "device_memory",
                        lambda self, device: (free, 80 * gib))
    monkeypatch.setattr(TransformersAdapter, "process_memory",
                        lambda self, device: held + 3 * gib)
    monkeypatch.setattr(TransformersAdapter, "peak_memory", lambda self, device, run: 0)
    with pytest.raises(kvcache.InvalidArgumentError) as err:
        Engine(llama, backend="reference", max_batch_size=8, prefill_chunk_size=256)
    text = str(err.value)
    for e in (first, second):
        assert f"engine {e.number} (llama, {e.config.max_total_tokens} tokens): " \
               f"{e.config.kv_bytes / gib:.2f} GiB of KV pages" in text
    assert "this process's other tensors (the model among them) 3.00 GiB" in text
    assert f"other processes and memory outside the allocator (CUDA context, NCCL) " \
           f"{(80 * gib - free - held - 3 * gib) / gib:.2f} GiB" in text
    number = second.number
    del second, e                    # a dropped engine is no longer named
    with pytest.raises(kvcache.InvalidArgumentError) as err:
        Engine(llama, backend="reference", max_batch_size=8, prefill_chunk_size=256)
    assert f"engine {number} " not in str(err.value) and f"engine {first.number} " in str(err.value)


def test_the_progress_display_moves_with_tokens_requests_and_pages(llama):
    engine = Engine(llama, backend="reference", max_total_tokens=1024)
    bar = Progress(24, True, engine)
    seen = []
    for p in make_prompts(seed=33)[:2]:
        engine.add_request(p, greedy(12))
    while engine.has_unfinished():
        bar._last = 0.0                         # (refreshes are rate-limited)
        bar.update(engine.step())
        task = bar.bar.tasks[0]
        seen.append((task.completed, task.fields["info"]))
    bar.close()
    assert seen[-1][0] == 24 and len({c for c, _ in seen}) > 3
    assert all("tok/s" in info and "running" in info and "pages" in info for _, info in seen)
    assert any("pages 0/" not in info for _, info in seen)


def test_logprobs_k_gives_the_k_likeliest_tokens_of_the_models_distribution(llama, reference):
    """``SamplingParams(logprobs=k)``: each new token carries the model's ``k`` likeliest next
    tokens with their log-probabilities (the model's own forward on the full text is the judge)."""
    import torch
    prompts, want, _ = reference
    engine = Engine(llama, backend="reference", max_total_tokens=4096)
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=5, temperature=0.0,
                                                        ignore_eos=True, logprobs=3))
    tokens, lps, tops = [], [], []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            lps += out.logprobs
            tops += out.top_logprobs
    assert tokens == want[0][0][:5] and len(tops) == 5
    with torch.no_grad():
        logits = llama(torch.tensor([list(prompts[0]) + tokens[:-1]])).logits[0].float()
    ref = logits.log_softmax(-1)[len(prompts[0]) - 1:]
    for t, (token, lp, alts) in enumerate(zip(tokens, lps, tops)):
        ids = [i for i, _ in alts]
        assert len(alts) == 3 and ids[0] == token and alts[0][1] == pytest.approx(lp, abs=1e-6)
        assert ids == ref[t].topk(3).indices.tolist()
        assert [v for _, v in alts] == pytest.approx(ref[t][ids].tolist(), abs=1e-3)


def test_a_dropped_engine_frees_its_cache_at_once(llama):
    # no reference cycle holds the cache: `del engine` gives its pages back without waiting for
    # the garbage collector (the next engine's sizing, or a model loaded next, sees them free)
    import gc
    import weakref
    collecting = gc.isenabled()
    gc.disable()
    try:
        engine = Engine(llama, backend="reference", max_total_tokens=512)
        shared = list(range(1, 40))
        engine.generate([shared, shared + [7]], max_new_tokens=3, n=2)   # a prefix, forks
        cache = weakref.ref(engine.cache)
        del engine
        assert cache() is None
    finally:
        if collecting:
            gc.enable()


def _modes():
    torch = pytest.importorskip("torch")
    return torch.is_inference_mode_enabled(), torch.is_grad_enabled()


@pytest.mark.parametrize("rope", ["model", "cache"])
def test_two_engines_over_one_model_stepped_in_turn(llama, rope):
    """Issue 51 item 3: two engines over one model, stepped alternately (the first one ending
    first, while the second still runs), both give transformers' own greedy tokens; the
    thread's autograd mode is the caller's after every step, a failed step included (the model
    session is entered per step, the model's attention switch counted per model), and the
    model gets its attention implementation back once both are done. ``rope="cache"``: each
    step inside its own engine's ``fused_rope``."""
    import torch

    prompts = make_prompts(seed=41)[:4]
    want = [hf_greedy(llama, p, 10) for p in prompts]
    attn = llama.config._attn_implementation
    a = Engine(llama, backend="reference", max_total_tokens=2048, rope=rope)
    b = Engine(llama, backend="reference", max_total_tokens=2048, rope=rope)
    got: dict = {}

    def step(engine):
        for out in engine.step():
            got.setdefault((engine is a, out.request_id), []).extend(out.new_token_ids)

    ids_a = [a.add_request(p, greedy(6)) for p in prompts[:3]]
    step(a)                                     # a's session is open: b starts beside it
    assert _modes() == (False, True)
    ids_b = [b.add_request(p, greedy(10)) for p in prompts[1:]]
    turns = 0
    while a.has_unfinished() or b.has_unfinished():
        for engine in (a, b):
            if engine.has_unfinished():
                if turns % 3 == 2:              # the caller's own mode is kept, too
                    with torch.no_grad():
                        step(engine)
                        assert _modes() == (False, False)
                else:
                    step(engine)
                assert _modes() == (False, True), f"turn {turns}: the thread's mode changed"
        turns += 1
    for rid, p in zip(ids_a, prompts[:3]):
        assert got[(True, rid)] == want[prompts.index(p)][:6]
    for rid, p in zip(ids_b, prompts[1:]):
        assert got[(False, rid)] == want[prompts.index(p)]
    assert llama.config._attn_implementation == attn
    # a step that raises mid-run restores the mode too, and the other engine goes on
    ids_a = [a.add_request(p, greedy(4)) for p in prompts[:2]]
    ids_b = [b.add_request(p, greedy(4)) for p in prompts[2:]]
    step(a)
    forward = b.adapter.forward

    def broken(*args):
        raise RuntimeError("a model error")

    b.adapter.forward = broken
    with pytest.raises(RuntimeError, match="a model error"):
        step(b)
    assert _modes() == (False, True) and not b.has_unfinished() and b.cache.is_empty
    b.adapter.forward = forward
    while a.has_unfinished():
        step(a)
        assert _modes() == (False, True)
    for rid, p in zip(ids_a, prompts[:2]):
        assert got[(True, rid)] == want[prompts.index(p)][:4]
    assert llama.config._attn_implementation == attn
    assert b.generate(prompts[2:], max_new_tokens=4) == [[w[:4]] for w in want[2:]]


def test_an_engine_config_builds_the_engine_its_keywords_build(llama, reference):
    """``Engine(model, config=EngineConfig(...))`` is ``Engine(model, **its fields)``; keywords
    beside it replace its fields; a bad option (keyword or field) is a typed error naming it,
    raised before anything is built; an unknown keyword a TypeError, as a signature's."""
    from kvcache.serving import AsyncScheduler, EngineConfig, Scheduler
    prompts, out, sampled = reference
    cfg = EngineConfig(backend="reference", max_total_tokens=4096, overlap=False)
    engine = Engine(llama, config=cfg)
    assert engine.engine_config is cfg and type(engine.scheduler) is Scheduler
    assert engine.generate(prompts, [greedy(12)] * 5 + [sampled]) == out
    ahead = Engine(llama, config=cfg, overlap=True, page_size=32)
    assert type(ahead.scheduler) is AsyncScheduler and ahead.config.page_size == 32
    assert ahead.engine_config == dataclasses.replace(cfg, overlap=True, page_size=32)
    with pytest.raises(kvcache.InvalidArgumentError, match="max_batch_size=0"):
        Engine(llama, config=cfg, max_batch_size=0)
    with pytest.raises(kvcache.InvalidArgumentError, match="config="):
        Engine(llama, config={"backend": "reference"})
    with pytest.raises(TypeError, match="pagesize"):
        Engine(llama, backend="reference", pagesize=16)
