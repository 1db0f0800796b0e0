"""The scheduler's batch invariant (issue 51, item 6): no forward runs more than
``max_batch_size`` sequences (nor more than ``prefill_chunk_size`` tokens, nor a sequence twice),
built by hand in the state the outside pass named (a prefill head beside ``max_batch_size``
decodes) and checked on every forward of random programs with preemption (small caches, with
and without the host tier), ``n > 1`` samples, aborts and the prefix cache; the tokens equal the
judge's throughout."""

from __future__ import annotations

import pytest
from fake import expected, make_core, run_all, run_program

from kvcache.integrations.sampling import SamplingParams

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


def checked(core, runner):
    """Wrap ``runner.forward``: every plan is checked against the invariant before it runs;
    returns the list of plans seen."""
    cfg = core.scheduler.config
    plans = []
    forward = runner.forward

    def run(plan, picks=None):
        assert len(plan.seq_ids) <= cfg.max_batch_size, \
            f"{len(plan.seq_ids)} sequences in one forward, max_batch_size={cfg.max_batch_size}"
        assert len(set(plan.seq_ids)) == len(plan.seq_ids), "a sequence twice in one forward"
        assert sum(plan.lens) <= cfg.prefill_chunk_size and all(n > 0 for n in plan.lens)
        plans.append(plan)
        return forward(plan, picks)

    runner.forward = run
    return plans


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_prefill_head_beside_max_batch_size_decodes_runs_at_most_max_batch_size(pipelined):
    """The state no program had reached: the oldest unfinished sequence (the head, always in
    the forward) still prefills while ``max_batch_size`` younger samples decode. The forward
    takes the head and ``max_batch_size - 1`` of the decodes; the others wait a step."""
    batch = 3
    core, runner, _ = make_core(max_total_tokens=512, page_size=4, max_batch_size=batch,
                                prefill_chunk_size=64, pipelined=pipelined)
    sched = core.scheduler
    many = SamplingParams(max_tokens=12, n=2, temperature=1.0, seed=4)
    one = SamplingParams(max_tokens=12)
    a = core.add_request([5, 6, 7, 8, 9], many)
    b = core.add_request([1, 2, 3], one)
    for _ in range(3):
        core.step()
    decodes = [s for s in sched.seqs.by_sid.values()
               if s.live and s.kind == "sample" and s.pending == 1]
    assert len(decodes) == batch                    # a's two samples and b's
    x_prompt = list(range(20, 50))
    x = core.add_request(x_prompt, one)
    sched.requests[x].order = -1                    # older than every decode: the head
    plans = checked(core, runner)
    got = run_all(core)
    first = plans[0]                # the head's whole prompt (only x's is 30 tokens) and
    assert first.lens[-1] == len(x_prompt)          # max_batch_size - 1 decodes
    assert len(first.seq_ids) == batch and first.lens[:-1] == [1] * (batch - 1)
    assert got[(x, 0)] == (expected(x_prompt, one), "length")
    assert got[(b, 0)][0][-3:] == expected([1, 2, 3], one)[-3:]
    for j in range(2):
        assert got[(a, j)][0][-3:] == expected([5, 6, 7, 8, 9], many, j)[-3:]


@st.composite
def programs(draw):
    """A request program: prompts (some sharing a prefix), n in 1..3, greedy or seeded,
    arrival steps and aborts, in a cache small enough to preempt."""
    reqs = []
    for _ in range(draw(st.integers(2, 7))):
        if reqs and draw(st.booleans()):
            base = draw(st.sampled_from(reqs))["prompt"]
            prompt = base[:draw(st.integers(1, len(base)))] + \
                draw(st.lists(st.integers(0, 96), max_size=5))
        else:
            prompt = draw(st.lists(st.integers(0, 96), min_size=1, max_size=28))
        params = SamplingParams(max_tokens=draw(st.integers(1, 12)), n=draw(st.integers(1, 3)),
                                temperature=draw(st.sampled_from([0.0, 1.0])),
                                seed=draw(st.integers(0, 99)))
        reqs.append(dict(prompt=prompt, params=params, at=draw(st.integers(0, 8)),
                         abort=draw(st.sampled_from([None, None, None, 1, 4]))))
    return dict(reqs=reqs, page_size=draw(st.sampled_from([2, 4])),
                pages=draw(st.integers(6, 18)), batch=draw(st.integers(1, 4)),
                chunk=draw(st.sampled_from([4, 8, 16, 64])), pipelined=draw(st.booleans()),
                tier=draw(st.booleans()), prefix_cache=draw(st.booleans()))


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(programs())
def test_no_forward_of_a_random_program_exceeds_max_batch_size(prog):
    ps = prog["page_size"]
    chunk = max(prog["chunk"], prog["batch"])
    core, runner, cache = make_core(max_total_tokens=prog["pages"] * ps, page_size=ps,
                                    max_batch_size=prog["batch"], prefill_chunk_size=chunk,
                                    pipelined=prog["pipelined"], host_tier=prog["tier"],
                                    prefix_cache=prog["prefix_cache"])
    plans = checked(core, runner)
    run_program(core, cache, prog, max_steps=3000, settle=8)
    assert plans
