"""The scheduler and the engine core with a fake runner: no torch, no model (see fake.py)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from kvcache import Window
from kvcache.errors import CacheFullError, InvalidArgumentError
from kvcache.integrations.sampling import SamplingParams

from fake import expected, make_core, next_token, run_all, run_program


def prompts_sharing(rng, count, shared=10, vocab=97):
    head = [rng.randrange(vocab) for _ in range(shared)]
    return [head + [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))] for _ in range(count)]


@pytest.mark.parametrize("pipelined", [True, False])
def test_greedy_requests_equal_the_judge_and_share_their_prefix(pipelined):
    rng = random.Random(1)
    core, runner, cache = make_core(pipelined=pipelined, prefix_cache=True)
    prompts = prompts_sharing(rng, 5)
    params = SamplingParams(max_tokens=9, temperature=0.0)
    ids = [core.add_request(p, params) for p in prompts]
    got = run_all(core)
    for rid, p in zip(ids, prompts):
        assert got[(rid, 0)] == (expected(p, params), "length")
    # the first computes the shared 10 tokens, the others wait and take its 2 whole pages
    assert core.stats.prefix_hit_tokens >= 4 * 8 and core.stats.forks == 0
    assert (core.stats.overlapped_forwards > 0) == pipelined
    assert cache.is_empty and cache.num_available_pages == cache.num_total_pages
    assert runner.sessions == 1


def test_requests_added_while_others_decode_equal_the_judge():
    rng = random.Random(2)
    core, _, _ = make_core()
    params = SamplingParams(max_tokens=12, temperature=0.0)
    first = [rng.choices(range(97), k=rng.randrange(3, 20)) for _ in range(3)]
    later = [rng.choices(range(97), k=rng.randrange(3, 20)) for _ in range(3)]
    ids = [core.add_request(p, params) for p in first]
    got: dict = {}
    steps = 0
    while core.has_unfinished():
        for out in core.step():
            key = (out.request_id, out.index)
            got[key] = got.get(key, []) + out.new_token_ids
        steps += 1
        if steps in (3, 5, 9):
            ids.append(core.add_request(later[(steps > 3) + (steps > 5)], params))
    for rid, p in zip(ids, first + later):
        assert got[(rid, 0)] == expected(p, params)


def test_abort_returns_every_page_in_the_same_step_and_is_reported():
    core, runner, cache = make_core(max_total_tokens=512)
    base = cache.num_available_pages
    a = core.add_request(list(range(30)), SamplingParams(max_tokens=40, temperature=0.0))
    b = core.add_request(list(range(5, 40)), SamplingParams(max_tokens=40, temperature=0.0))
    for _ in range(4):
        core.step()
    held = base - cache.num_available_pages
    assert held > 0
    core.abort(a)
    only_b = base - cache.num_available_pages
    assert 0 < only_b < held
    core.abort(b)
    assert cache.num_available_pages == base and cache.is_empty
    outs = core.step()
    assert sorted((o.request_id, o.finished, o.finish_reason) for o in outs) == \
        [(a, True, "abort"), (b, True, "abort")]
    assert not core.has_unfinished()
    core.abort(a)                           # finished: ignored
    core.abort(12345)                       # unknown: ignored
    with pytest.raises(InvalidArgumentError, match="request_id='x'"):
        core.abort("x")


def test_abort_of_a_request_waiting_on_a_shared_prefix():
    rng = random.Random(3)
    core, _, cache = make_core()
    prompts = prompts_sharing(rng, 3, shared=16)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    ids = [core.add_request(p, params) for p in prompts]
    core.abort(ids[1])                      # before anything ran: it forks from nothing
    got = run_all(core)
    assert got[(ids[1], 0)] == ([], "abort")
    for i in (0, 2):
        assert got[(ids[i], 0)] == (expected(prompts[i], params), "length")
    assert cache.is_empty


def test_stop_tokens_and_eos_end_a_sample_with_their_reason():
    prompt = [5, 6, 7, 8]
    full = expected(prompt, SamplingParams(temperature=0.0, max_tokens=10))
    stop = full[3]
    core, _, _ = make_core(eos=(stop,))
    a = core.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10))
    b = core.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    c = core.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                stop_token_ids=[full[1]]))
    got = run_all(core)
    cut = full.index(stop) + 1
    assert got[(a, 0)] == (full[:cut], "stop")
    assert got[(b, 0)] == (full, "length")
    assert got[(c, 0)] == (full[:full.index(full[1]) + 1], "stop")


def test_n_seeded_samples_fork_from_the_prompt_and_do_not_depend_on_the_batch():
    core, _, _ = make_core()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(max_tokens=7, temperature=1.0, n=3, seed=11)
    other = SamplingParams(max_tokens=5, temperature=0.5, seed=4)
    rid = core.add_request(prompt, params)
    rid2 = core.add_request([2, 7, 1, 8], other)
    got = run_all(core)
    for j in range(3):
        assert got[(rid, j)] == (expected(prompt, params, j), "length")
    assert got[(rid2, 0)][0] == expected([2, 7, 1, 8], other)
    assert len({tuple(got[(rid, j)][0]) for j in range(3)}) > 1
    assert core.stats.forks >= 3


def random_program(seed: int) -> dict:
    rng = random.Random(seed)
    reqs = []
    for i in range(rng.randrange(2, 7)):
        if reqs and rng.random() < 0.4:             # extends or repeats an earlier prompt
            base = rng.choice(reqs)["prompt"]
            prompt = base[:rng.randrange(1, len(base) + 1)] + \
                rng.choices(range(97), k=rng.randrange(0, 6))
        else:
            prompt = rng.choices(range(97), k=rng.randrange(1, 30))
        sampled = rng.random() < 0.3
        params = SamplingParams(max_tokens=rng.randrange(1, 14), n=rng.choice([1, 1, 2]),
                                temperature=1.0 if sampled else 0.0, seed=rng.randrange(100))
        reqs.append(dict(prompt=prompt, params=params, at=rng.choice([0, 0, 1, 3, 6]),
                         abort=rng.choice([None] * 5 + [2, 5])))
    return dict(reqs=reqs, page_size=rng.choice([2, 4, 8]), pages=rng.randrange(6, 20),
                batch=rng.choice([2, 3, 8]), chunk=rng.choice([4, 16, 64]),
                pipelined=rng.random() < 0.7, tier=rng.random() < 0.4)


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["plain", "prefix-cache"])
@pytest.mark.parametrize("seed", range(40))
def test_random_programs_in_small_caches_equal_the_judge(seed, prefix_cache):
    """With the prefix cache on, a request starts from the pages of earlier ones (the fake
    model reads its history from the cache: a wrong cached page changes every later token)."""
    prog = random_program(seed)
    ps = prog["page_size"]
    core, _, cache = make_core(max_total_tokens=prog["pages"] * ps, page_size=ps,
                               max_batch_size=prog["batch"], prefill_chunk_size=prog["chunk"],
                               pipelined=prog["pipelined"], host_tier=prog["tier"],
                               prefix_cache=prefix_cache)
    run_program(core, cache, prog, max_steps=5000, settle=6)


@pytest.mark.parametrize("seed", range(16))
def test_random_programs_with_window_groups_equal_the_judge(seed):
    """A cache whose second layer is a window group (issue 56): the scheduler's page budget is
    the most constrained group's (``num_appendable_pages``), preemption, aborts and finishing
    give every group's pages back, and the tokens are the judge's (the fake model reads the
    full layer)."""
    prog = random_program(seed)
    ps = prog["page_size"]
    window = Window([0, 1, ps, 3 * ps - 1][seed % 4])
    core, _, cache = make_core(max_total_tokens=prog["pages"] * ps, page_size=ps,
                               max_batch_size=prog["batch"], prefill_chunk_size=prog["chunk"],
                               pipelined=prog["pipelined"], layer_kinds={1: window})
    run_program(core, cache, prog, max_steps=5000, settle=6)
    assert cache.num_available_pages_by_group == cache.num_total_pages_by_group


def test_a_request_bigger_than_the_cache_fails_the_step_with_cache_full():
    # the engine refuses it up front (tests/integrations); the bare core's safety net is
    # CacheFullError from the step, and the core is left empty
    core, _, cache = make_core(max_total_tokens=16, page_size=4)
    core.add_request(list(range(40)), SamplingParams(max_tokens=2, temperature=0.0))
    with pytest.raises(CacheFullError):
        run_all(core)
    assert cache.is_empty and not core.has_unfinished()


def test_the_serving_core_imports_no_array_or_model_library():
    # torch blocked; and no module of kvcache.serving holds numpy (the package root does)
    code = ("import sys; sys.modules['torch'] = None; "
            "import kvcache.serving, kvcache.integrations.sampling; "
            "mods = [m for n, m in sys.modules.items() if n.startswith('kvcache.serving')]; "
            "assert len(mods) >= 5 and not any(getattr(v, '__name__', '') == 'numpy' "
            "for m in mods for v in vars(m).values()); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
    assert next_token([1, 2]) == next_token([1, 2]) != next_token([2, 1])


def test_disaggregated_prefill_holds_the_prompt_and_decode_adopts_it():
    # rank 0: prefill with hold_kv (one token), export; rank 1: import under new_seq_id, adopt
    prefill, _, cache0 = make_core()
    decode, runner1, cache1 = make_core(max_total_tokens=512)
    prompts = [[7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0], [7, 3, 9, 1, 4, 4, 8, 2, 11, 12], [5, 5]]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    rest = SamplingParams(max_tokens=8, temperature=0.0)
    rids = [prefill.add_request(p, one, hold_kv=True) for p in prompts]
    got = {}
    while prefill.has_unfinished():
        for out in prefill.step():
            assert out.finished and out.finish_reason == "length" and out.seq_id is not None
            got[out.request_id] = (out.new_token_ids[0], out.seq_id)
    assert cache0.num_sequences == 3                    # held: the prompts' KV stays
    adopted = []
    for rid, p in zip(rids, prompts):
        first, sid = got[rid]
        assert cache0.sequence_length(sid) == len(p)
        payload = cache0.export_sequence(sid)
        assert prefill.release(rid) and not prefill.release(rid)
        new = decode.new_seq_id()
        cache1.import_sequence(new, payload)
        adopted.append((decode.add_request(p + [first], rest, kv_seq_id=new), p, first))
    assert cache0.is_empty
    out = run_all(decode)
    for rid, p, first in adopted:
        assert [first] + out[(rid, 0)][0] == expected(p, SamplingParams(max_tokens=9, temperature=0.0))
    # the adopted prompts were not prefilled again: one token each before decoding
    assert decode.stats.prefill_tokens == 3 and cache1.is_empty


def test_hold_kv_and_kv_seq_id_are_checked_before_anything_is_queued():
    core, _, cache = make_core()
    with pytest.raises(InvalidArgumentError, match="hold_kv=True needs max_tokens=1 and n=1"):
        core.add_request([1, 2], SamplingParams(max_tokens=2, temperature=0.0), hold_kv=True)
    import numpy as np
    cache.add_sequence(500)
    with cache.forward([500], [3]):
        x = np.zeros((3, 1, 4), np.float32)
        cache.attention(0, x, x, x)
    with pytest.raises(InvalidArgumentError, match=r"kv_seq_id=500 holds 3 tokens; the prompt \(3"):
        core.add_request([1, 2, 3], SamplingParams(temperature=0.0), kv_seq_id=500)
    from kvcache.errors import SequenceNotFoundError
    with pytest.raises(SequenceNotFoundError):
        core.add_request([1, 2], SamplingParams(temperature=0.0), kv_seq_id=501)
    rid = core.add_request([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=2), kv_seq_id=500)
    with pytest.raises(InvalidArgumentError, match="already belongs to a request"):
        core.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0.0), kv_seq_id=500)
    assert list(core.scheduler.requests) == [rid]


def test_logprobs_k_reports_the_k_likeliest_per_token_beside_pipelined_requests():
    """``logprobs=k`` gives each new token its ``k`` likeliest alternatives (the runner's
    ``alternatives``); requests without it stay pipelined and all tokens equal the judge."""
    core, _, _ = make_core(pipelined=True)
    top = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    plain = SamplingParams(max_tokens=6, temperature=0.0)
    a = core.add_request([5, 6, 7], top)
    b = core.add_request([8, 9], plain)
    got = {a: ([], []), b: ([], [])}
    while core.has_unfinished():
        for out in core.step():
            got[out.request_id][0].extend(out.new_token_ids)
            if out.request_id == a:
                assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.new_token_ids)
                got[a][1].extend(out.top_logprobs)
            else:
                assert out.top_logprobs is None
    assert got[a][0] == expected([5, 6, 7], top) and got[b][0] == expected([8, 9], plain)
    assert len(got[a][1]) == 6
    for token, alts in zip(got[a][0], got[a][1]):
        assert [i for i, _ in alts] == [(token + i) % 97 for i in range(3)]
        assert [lp for _, lp in alts] == [0.0, -1.0, -2.0]


def test_a_waiting_sequence_converts_its_known_tokens_once_per_length():
    from kvcache.serving.sequences import Seq, Sequences
    seq = Seq(sid=0, kind="prompt", tokens=[5, 6, 7], order=(0, 1, 0))
    first = Sequences.known_ids(seq)
    assert list(first) == [5, 6, 7] and Sequences.known_ids(seq) is first
    seq.tokens.append(8)
    assert list(Sequences.known_ids(seq)) == [5, 6, 7, 8]
    seq.tokens[-1] = 9                                       # same length, other last token
    assert list(Sequences.known_ids(seq)) == [5, 6, 7, 9]


def test_a_pick_on_its_way_is_a_count_not_a_token():
    """``AsyncScheduler``'s placeholder (``Seq.ahead``: a pipelined pick still on its way) is
    counted in what the sequence holds, never written into its tokens: the ids the prefix cache
    is asked with end before it, and hold the pick once it came (appended by the settle)."""
    from kvcache.serving.sequences import Seq, Sequences
    seq = Seq(sid=0, kind="sample", tokens=[5, 6, 7], order=(0, 2, 0), cached=3)
    assert list(Sequences.known_ids(seq)) == [5, 6, 7] and seq.pending == 0
    seq.ahead = 1                                            # launched: its pick is on its way
    assert seq.length == 4 and seq.pending == 1
    assert list(Sequences.known_ids(seq)) == [5, 6, 7]
    seq.tokens.append(8)                                     # the pick came
    seq.ahead = 0
    assert list(Sequences.known_ids(seq)) == [5, 6, 7, 8] and seq.pending == 1
    first = Sequences.known_ids(seq)
    assert Sequences.known_ids(seq) is first


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_step_is_schedule_then_update(pipelined):
    """The core calls the scheduler twice a step, ``schedule()`` then ``update(plan, output)``
    (a forward that does not fit: ``update(plan, CacheFullError)``, then ``schedule()`` again);
    pipelined, no placeholder ever enters a sequence's tokens."""
    from kvcache.serving import AsyncScheduler, StepOutput
    core, runner, _ = make_core(max_total_tokens=96, page_size=4, pipelined=pipelined)
    sched = core.scheduler
    assert isinstance(sched, AsyncScheduler) == pipelined
    calls: list = []
    schedule, update = sched.schedule, sched.update

    def spy_schedule():
        calls.append("schedule")
        return schedule()

    def spy_update(plan, output):
        calls.append("update" if isinstance(output, StepOutput) else type(output).__name__)
        assert all(t >= 0 for s in sched.seqs.by_sid.values() for t in s.tokens)
        return update(plan, output)

    sched.schedule, sched.update = spy_schedule, spy_update
    forward, failed = runner.forward, []

    def full_once(plan, picks=None):          # the third forward does not fit, once
        if len(runner.forwards) == 2 and not failed:
            failed.append(plan)
            raise CacheFullError("no room (test)")
        return forward(plan, picks)

    runner.forward = full_once
    rng = random.Random(5)
    prompts = prompts_sharing(rng, 4)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    ids = [core.add_request(p, params) for p in prompts]
    got: dict = {}
    while core.has_unfinished():
        before = len(calls)
        for out in core.step():
            got[out.request_id] = got.get(out.request_id, []) + out.new_token_ids
        step = calls[before:]
        assert step in (["schedule", "update"],
                        ["schedule", "CacheFullError", "schedule", "update"]), step
    assert failed and calls.count("CacheFullError") == 1
    for rid, p in zip(ids, prompts):
        assert got[rid] == expected(p, params)
