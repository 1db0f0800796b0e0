"""What the transformers and the mlx-lm integration tests share: the prompt workload and the
first-step logits of an engine (neutral to the model library)."""

from __future__ import annotations

import numpy as np

VOCAB = 512
NEW_TOKENS = 64
# (lengths 5..300; prompt 7 shares the first 120 tokens of prompt 1: a shared prefix)
LENGTHS = [5, 300, 37, 128, 64, 211, 9]


def make_prompts(seed: int = 1) -> list:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in LENGTHS]
    prompts.append(prompts[1][:120] + rng.integers(1, VOCAB, 30).tolist())
    return prompts


def logit_rows(engine) -> list:
    """Spy on ``engine``'s forwards, eager (its adapter's) and captured (its step graphs'): the
    list every logits row they return is appended to, in order, as host arrays (a graph's
    logits are a view its next replay overwrites: copied at once)."""
    rows: list = []

    def wrap(run):
        def spy(*args):
            out = run(*args)
            if len(args[-1]):                   # the rows asked for: the last argument
                rows.extend(np.array(engine.adapter.to_numpy(out)))
            return out
        return spy

    engine.adapter.forward = wrap(engine.adapter.forward)
    if engine.decode_graphs is not None:
        engine.decode_graphs.run = wrap(engine.decode_graphs.run)
    return rows


def assert_warm_prefix_equals_cold(make, system: list, question: list, other: list,
                                   hit: int, expect: list | None = None) -> tuple:
    """docs/prefix-caching.md's condition (the cold prompt's first chunk ends at the page
    boundary the warm one starts from): ``system + question`` through a fresh Engine
    (``make()``; overlap off), and through another after ``system + other`` hit the cache
    there (``hit`` tokens): the same 6 greedy tokens (``expect``'s, when given: ``generate``'s
    output), every logits row equal to the cold run's bit for bit. Returns ``(cold, warm)``,
    the two Engines."""
    cold = make()
    cold_rows = logit_rows(cold)
    want = cold.generate([system + question], max_new_tokens=6)
    assert cold.stats.prefix_hit_tokens == 0
    assert expect is None or want == expect
    warm = make()
    warm.generate([system + other], max_new_tokens=3)
    warm_rows = logit_rows(warm)
    got = warm.generate([system + question], max_new_tokens=6)
    assert warm.stats.prefix_hit_tokens == hit
    assert got == want
    assert len(warm_rows) == len(cold_rows) == 6
    for step, (a, b) in enumerate(zip(cold_rows, warm_rows)):
        assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"
    return cold, warm


def first_step_logits(engine, prompts) -> list:
    """Each prompt's first-step logits through ``engine`` (one prompt per generate, the logits
    row seen by wrapping the adapter's forward); the adapter is restored afterwards."""
    rows: list = []
    forward = engine.adapter.forward

    def spy(cache, tokens, positions, want):
        out = forward(cache, tokens, positions, want)
        if len(want):
            rows.append(engine.adapter.to_numpy(out))
        return out

    engine.adapter.forward = spy
    result = []
    try:
        for p in prompts:               # one prompt per call: the row is that prompt's
            rows.clear()
            engine.generate([p], max_new_tokens=1)
            assert len(rows) == 1 and rows[0].shape[0] == 1
            result.append(rows[0][0])
    finally:
        engine.adapter.forward = forward
    return result


WAYS = ("beside seven others, in 7-token chunks", "beside 64 random others",
        "from a prefix-cache hit", "preempted and recomputed", "preempted through the host tier",
        "the host not running ahead")
"""``served_every_way``'s conditions, in its order."""


def served_every_way(serve, target: list, others: list, ways=WAYS) -> dict:
    """The deterministic engines' conditions (issue 54): ``serve(prompts, **engine options)``
    (the target first; returns (its results, the engine's stats)) run beside seven others in
    7-token chunks, beside 64 random short prompts, from a prefix-cache hit, preempted and
    recomputed, preempted through the host tier, and with the host not running ahead (``ways``:
    those of ``WAYS`` to run, all by default). Checks that each condition happened and returns
    {condition: results}."""
    assert ways and set(ways) <= set(WAYS), ways
    rng = np.random.default_rng(64)
    crowd = [rng.integers(1, VOCAB, int(n)).tolist() for n in rng.integers(4, 40, 64)]
    how = {
        "beside seven others, in 7-token chunks": lambda: serve([target] + others,
                                                                prefill_chunk_size=7),
        "beside 64 random others": lambda: serve([target] + crowd, max_batch_size=66,
                                                 max_total_tokens=8192),
        "from a prefix-cache hit": lambda: serve([target], warm=[target[:100] + [5, 6]]),
        "preempted and recomputed": lambda: serve([target] + others, max_total_tokens=448,
                                                  offload=False),
        "preempted through the host tier": lambda: serve([target] + others, max_total_tokens=448,
                                                         offload=True),
        "the host not running ahead": lambda: serve([target] + others, overlap=False),
    }
    runs = {what: how[what]() for what in WAYS if what in ways}
    if "from a prefix-cache hit" in runs:
        assert runs["from a prefix-cache hit"][1].prefix_hit_tokens >= 96
    if "preempted and recomputed" in runs:
        assert runs["preempted and recomputed"][1].recomputed_tokens > 0
    if "preempted through the host tier" in runs:
        assert runs["preempted through the host tier"][1].recompute_tokens_saved > 0
    return {what: got for what, (got, _) in runs.items()}


def prefilled_elsewhere(engine_cls, model, target: list, **opts) -> tuple:
    """The disaggregated path within one process: one deterministic engine prefills ``target``
    and picks its first token, keeping the KV (``hold_kv``); another engine imports that KV
    (``export_sequence`` / ``import_sequence``, what ``send_sequence`` moves between processes)
    and decodes the rest (``kv_seq_id``). Returns the greedy (tokens, logprobs)."""
    from kvcache.integrations import SamplingParams
    first = SamplingParams(max_tokens=1, logprobs=True, ignore_eos=True)
    rest = SamplingParams(max_tokens=TARGET_NEW - 1, logprobs=True, ignore_eos=True)
    prefill = engine_cls(model, deterministic=True, **opts)
    rid = prefill.add_request(target, first, hold_kv=True)
    outs = []
    while prefill.has_unfinished():
        outs += [o for o in prefill.step() if o.request_id == rid]
    token, lp = outs[-1].new_token_ids[0], outs[-1].logprobs[0]
    payload = prefill.cache.export_sequence(outs[-1].seq_id)
    decode = engine_cls(model, deterministic=True, **opts)
    sid = decode.new_seq_id()
    decode.cache.import_sequence(sid, payload)
    rid = decode.add_request(target + [token], rest, kv_seq_id=sid)
    tokens, lps = [token], [lp]
    while decode.has_unfinished():
        for o in decode.step():
            if o.request_id == rid:
                tokens += o.new_token_ids
                lps += o.logprobs
    return tokens, lps


def assert_same_bits(runs: dict, want: tuple) -> None:
    """Every run's (greedy tokens, greedy logprobs, sampled tokens, sampled logprobs) equal
    ``want``'s, bit for bit."""
    for what, got in runs.items():
        for name, a, b in zip(("greedy tokens", "greedy logprobs", "sampled tokens",
                               "sampled logprobs"), got, want):
            assert a == b, f"{what}: {name} differ from the request served alone"


TARGET_NEW = 12
"""New tokens of ``serve_target``'s target requests."""


def serve_target(engine_cls, model, prompts: list, *, deterministic=True, warm=None, **opts):
    """One greedy and one sampled request of ``prompts[0]`` beside ``prompts[1:]`` on a new
    ``engine_cls(model, deterministic=..., **opts)``, after ``warm`` prompts were served (the
    prefix cache keeps their pages): the target's (greedy tokens, greedy logprobs, sampled
    tokens, sampled logprobs) and the engine's stats."""
    from kvcache.integrations import SamplingParams
    engine = engine_cls(model, deterministic=deterministic, **opts)
    if warm:
        engine.generate(warm, max_new_tokens=2)
    new = TARGET_NEW
    params = [SamplingParams(max_tokens=new, logprobs=True, ignore_eos=True),
              SamplingParams(max_tokens=new, logprobs=True, ignore_eos=True, temperature=0.9,
                             top_p=0.95, seed=11)]
    params += [SamplingParams(max_tokens=new + 6, ignore_eos=True)] * (len(prompts) - 1)
    tokens, lps = engine.generate([prompts[0], prompts[0]] + list(prompts[1:]), params)
    return (tokens[0][0], lps[0][0], tokens[1][0], lps[1][0]), engine.stats
