"""SamplingParams and the batched sampler (kvcache.integrations.sampling): the filtered
distribution equals transformers' logits processors', draws are seeded per request and follow
that distribution, bad fields are typed errors; and Engine.generate(sampling_params=...)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.generation.logits_process import (  # noqa: E402
    LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper)

from conftest import make_model  # noqa: E402  (the integrations conftest, bound at import)
from kvcache.errors import InvalidArgumentError  # noqa: E402
from kvcache.integrations import SamplingParams  # noqa: E402
from kvcache.integrations.sampling import filter_logits, sample  # noqa: E402


def hf_filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' processors for ``p``, in the order and on the conditions of
    ``GenerationMixin._get_logits_processor``, on one row (1, vocab)."""
    procs = LogitsProcessorList()
    if p.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k > 0:
        procs.append(TopKLogitsWarper(top_k=p.top_k))
    if p.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=p.top_p))
    if p.min_p > 0:
        procs.append(MinPLogitsWarper(min_p=p.min_p))
    return procs(torch.zeros((1, 1), dtype=torch.long), row.clone())


def random_case(rng: np.random.Generator, vocab: int):
    kind = rng.integers(4)
    if kind == 0:
        logits = rng.normal(0, rng.choice([0.5, 2.0, 8.0]), vocab)
    elif kind == 1:                          # many ties (top-k and top-p boundaries on ties)
        logits = rng.integers(-3, 3, vocab).astype(np.float64)
    elif kind == 2:                          # a few distinct values, some -inf
        logits = rng.choice([-1.0, 0.0, 0.5, 2.0], vocab)
        logits[rng.random(vocab) < 0.2] = -np.inf
        logits[rng.integers(vocab)] = 1.0
    else:                                    # one dominant token
        logits = rng.normal(0, 1, vocab)
        logits[rng.integers(vocab)] += 12.0
    top_p = float(rng.choice([1.0, 1e-7, 0.01, 0.3, 0.5, 0.9, 0.999, 1 - 1e-7, rng.random()]))
    top_k = int(rng.choice([0, -1, 1, 2, 3, 5, vocab - 1, vocab, vocab + 5]))
    min_p = float(rng.choice([0.0, 0.0, 0.05, 0.3, 1.0, rng.random()]))
    temperature = float(rng.choice([1.0, 0.3, 0.7, 1.5, 5.0]))
    params = SamplingParams(temperature=temperature, top_p=max(top_p, 1e-9), top_k=top_k,
                            min_p=min_p)
    return logits, params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_filtered_distribution_equals_transformers_processors(dtype):
    rng = np.random.default_rng(0)
    for vocab in (7, 50, 257):
        cases = [random_case(rng, vocab) for _ in range(120)]
        logits = torch.tensor(np.stack([c[0] for c in cases]), dtype=dtype)
        params = [c[1] for c in cases]
        ours = filter_logits(logits, params)           # all rows in one call, mixed settings
        assert ours.dtype == dtype
        for b, p in enumerate(params):
            want = hf_filter(logits[b:b + 1], p)[0]
            assert torch.equal(torch.isinf(ours[b]), torch.isinf(want)), (vocab, b, p)
            got_p, want_p = ours[b].softmax(-1), want.softmax(-1)
            assert float((got_p - want_p).abs().max()) <= 1e-6, (vocab, b, p)


def test_filter_boundaries_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1]]))
    keep = lambda **kw: (~torch.isinf(filter_logits(logits, [SamplingParams(**kw)])[0])).tolist()  # noqa: E731
    assert keep(top_k=2) == [True, True, True, False]          # the tie with the 2nd is kept
    assert keep(top_k=1) == [True, False, False, False]
    assert keep(top_p=1e-9) == [True, False, False, False]     # the top token always stays
    assert keep(top_p=1.0) == [True] * 4
    assert keep(min_p=0.39) == [True, True, True, False]       # 0.2 >= 0.39 * 0.5 stays
    assert keep(min_p=1.0) == [True, False, False, False]


def test_greedy_rows_take_the_first_argmax_and_logprobs_are_the_models():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 2.0, 2.0]])
    tokens, lps = sample(logits, [SamplingParams(temperature=0), SamplingParams(temperature=0)])
    assert tokens.tolist() == [1, 2]
    want = logits.log_softmax(-1)[[0, 1], [1, 2]]
    torch.testing.assert_close(lps, want)


def test_draws_are_reproducible_per_seed_and_independent_of_the_batch():
    rng = np.random.default_rng(1)
    vocab = 64
    mine = torch.tensor(rng.normal(0, 1.5, vocab), dtype=torch.float32)[None]
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=7)
    alone = [int(sample(mine, [p], [p.seed], [t])[0][0]) for t in range(40)]
    assert alone == [int(sample(mine, [p], [7], [t])[0][0]) for t in range(40)]
    assert len(set(alone)) > 5
    others = torch.tensor(rng.normal(0, 1.5, (7, vocab)), dtype=torch.float32)
    for t in range(40):
        for where in (0, 3, 7):           # another batch composition, another place in it
            rows = torch.cat([others[:where], mine, others[where:]])
            ps = [SamplingParams(temperature=float(rng.choice([0.0, 0.5, 2.0])),
                                 top_p=float(rng.choice([0.3, 1.0]))) for _ in range(7)]
            ps.insert(where, p)
            seeds = list(rng.integers(0, 2 ** 63, 8))
            steps = list(rng.integers(0, 1000, 8))
            seeds[where], steps[where] = 7, t
            assert int(sample(rows, ps, seeds, steps)[0][where]) == alone[t]
    other_seed = [int(sample(mine, [p], [8], [t])[0][0]) for t in range(40)]
    assert other_seed != alone
    # per-row generators: the same seed gives the same draws, wherever the row is
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    a = sample(torch.cat([mine, others[:2]]), [p] * 3, generators=[g(5), g(6), g(7)])[0]
    b = sample(torch.cat([others[:2], mine]), [p] * 3, generators=[g(6), g(7), g(5)])[0]
    assert int(a[0]) == int(b[2])


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    support = probs > 0
    if (counts[~support] > 0).any():
        return math.inf, int(support.sum()) - 1
    n = counts.sum()
    expect = probs[support] * n
    return float(((counts[support] - expect) ** 2 / expect).sum()), int(support.sum()) - 1


def _bound(df: int) -> float:
    """A chi-square quantile far in the tail (about 1e-6, Wilson-Hilferty), so the seeded test
    is no coin toss."""
    z = 4.75
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3 if df > 0 else 0.0


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.6, top_k=5),
                                dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.15),
                                dict(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05)])
def test_empirical_frequencies_match_the_filtered_distribution(kw):
    rng = np.random.default_rng(2)
    vocab, draws = 12, 40000
    logits = torch.tensor(rng.normal(0, 1.2, vocab), dtype=torch.float32)[None]
    p = SamplingParams(seed=11, **kw)
    want = hf_filter(logits, p)[0].softmax(-1).double().numpy()
    rows = logits.expand(draws, vocab)
    half = draws // 2                      # many seeds at step 0, one seed over many steps
    seeds = list(range(half)) + [11] * half
    steps = [0] * half + list(range(half))
    tokens = sample(rows, [p] * draws, seeds, steps)[0].numpy()
    counts = np.bincount(tokens, minlength=vocab)
    stat, df = _chi2(counts, want)
    assert stat < _bound(df), (stat, df, counts, want)
    # the test has teeth: the distribution a wrong filter gives is refused
    wrong = [logits[0].softmax(-1).double().numpy()]                        # no filter at all
    wrong.append(hf_filter(logits, SamplingParams(**{**kw, "temperature": 1.1 * p.temperature}))
                 [0].softmax(-1).double().numpy())                          # another temperature
    if p.top_k > 0:
        wrong.append(hf_filter(logits, SamplingParams(**{**kw, "top_k": p.top_k + 1}))
                     [0].softmax(-1).double().numpy())                      # k off by one
    for w in wrong:
        if np.abs(w - want).max() > 1e-3:      # (no filter is no change at temperature 1)
            assert _chi2(counts, w)[0] > _bound(df)


BAD = [("max_tokens", 0), ("max_tokens", 2.0), ("max_tokens", True), ("temperature", -0.1),
       ("temperature", math.inf), ("temperature", math.nan), ("temperature", "hot"),
       ("top_p", 0.0), ("top_p", 1.5), ("top_p", None), ("top_k", -2), ("top_k", 1.5),
       ("min_p", -0.01), ("min_p", 1.01), ("seed", -1), ("seed", 2 ** 63), ("seed", 1.0),
       ("n", 0), ("n", "2"), ("n", 1025), ("n", 10 ** 6), ("stop_token_ids", [1, -2]), ("stop_token_ids", "ab"),
       ("stop_token_ids", [1.0]), ("ignore_eos", 1), ("logprobs", -1), ("logprobs", 0.5)]


@pytest.mark.parametrize("field,value", BAD)
def test_each_bad_field_is_a_typed_error_naming_it(field, value):
    with pytest.raises(InvalidArgumentError) as err:
        SamplingParams(**{field: value})
    msg = str(err.value)
    assert f"SamplingParams.{field}=" in msg and "must be" in msg
    assert repr(value)[:20] in msg


def test_n_is_bounded_by_max_n_and_the_error_names_the_value_and_the_limit(engine):
    """Issue 51 item 6: ``n=10**6`` was accepted and held the engine's lock for 12 s (10**9:
    hours, ~100 GB) making its samples. ``MAX_N`` (1024) samples at most: the error names the
    value and the limit, and nothing is queued."""
    import time

    from kvcache.integrations.sampling import MAX_N
    assert SamplingParams(n=MAX_N).n == MAX_N
    for n in (MAX_N + 1, 10 ** 6, 10 ** 9):
        with pytest.raises(InvalidArgumentError, match=rf"SamplingParams.n={n} .*\[1, {MAX_N}\]"):
            SamplingParams(n=n)
    start = time.perf_counter()
    with pytest.raises(InvalidArgumentError, match=rf"n={10 ** 9} .*{MAX_N}"):
        engine.generate([[1, 2, 3]], n=10 ** 9, max_new_tokens=2)
    assert time.perf_counter() - start < 1.0
    assert not engine.has_unfinished() and engine.cache.is_empty


@pytest.mark.parametrize("temperature", [1e-310, 1e-46, 1e-39, 1e-30, 9.9e-6])
def test_a_temperature_below_the_epsilon_is_greedy(temperature):
    """Issue 51 item 6: a valid tiny temperature (1e-310; <= 1e-38 once cast to float32) gave a
    NaN distribution that always drew the last token id. Below ``GREEDY_TEMPERATURE`` (1e-5,
    vLLM's epsilon) a request is greedy: the first argmax on every path (torch in float32 and
    float64, numpy), with the model's log-probabilities."""
    from kvcache.integrations.sampling import GREEDY_TEMPERATURE, sample_numpy
    p = SamplingParams(temperature=temperature, top_p=0.9, seed=5)
    assert p.greedy and p.temperature == 0.0
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen, dtype=torch.float64) * 4
    want = logits.argmax(-1)
    for dtype in (torch.float32, torch.float64):
        tokens, lps = sample(logits.to(dtype), [p] * 6, steps=list(range(6)))
        assert torch.equal(tokens, want) and torch.isfinite(lps).all()
    tokens, lps = sample_numpy(logits.numpy(), [p] * 6)
    np.testing.assert_array_equal(tokens, want.numpy())
    assert np.isfinite(lps).all()
    # the epsilon itself is a temperature: a finite distribution (its mode, at these gaps)
    q = SamplingParams(temperature=GREEDY_TEMPERATURE, seed=5)
    assert not q.greedy and q.temperature == GREEDY_TEMPERATURE
    scores = filter_logits(logits.float(), [q] * 6)
    assert not torch.isnan(scores).any() and torch.isfinite(scores.max(-1).values).all()
    assert torch.equal(sample(logits.float(), [q] * 6)[0], want)


def test_an_engine_request_below_the_epsilon_is_greedy(engine):
    from engine_cases import make_prompts
    prompts = make_prompts(seed=21)[:2]
    greedy = engine.generate(prompts, max_new_tokens=6)
    tiny = engine.generate(prompts, sampling_params=SamplingParams(temperature=1e-300,
                                                                   max_tokens=6, seed=1))
    assert tiny == greedy


def test_good_fields_are_kept_and_normalised():
    p = SamplingParams(max_tokens=4, temperature=0, top_k=-1, top_p=1, min_p=0, seed=0, n=2,
                       stop_token_ids=[3, 4], ignore_eos=True, logprobs=0)
    assert p.greedy and p.stop_token_ids == (3, 4) and isinstance(p.top_p, float)
    assert p.sample_seed(1) == 1 and hash(p) == hash(SamplingParams(**vars(p)))


# ------------------------------------------------------------------ Engine.generate
@pytest.fixture(scope="module")
def engine():
    from kvcache.integrations.transformers import Engine
    # the prefix cache off: the calls below repeat prompts, and a warm prompt equals a cold one
    # bit for bit only under docs/prefix-caching.md's conditions (aligned prefill chunks)
    return Engine(make_model("llama", seed=3), backend="reference", max_total_tokens=4096,
                  prefix_cache=False)


def test_engine_greedy_sampling_params_equal_the_old_greedy_call(engine):
    from engine_cases import make_prompts
    prompts = make_prompts(seed=21)[:4]
    old = engine.generate(prompts, max_new_tokens=10, n=2, return_logprobs=True)
    new = engine.generate(prompts, sampling_params=SamplingParams(temperature=0, max_tokens=10,
                                                                  n=2, logprobs=0))
    assert new[0] == old[0]
    np.testing.assert_allclose(np.array(new[1], float), np.array(old[1], float))
    # per request: top_k=1 at temperature 1 is greedy; other requests sample alongside
    mixed = [SamplingParams(temperature=1.0, top_k=1, max_tokens=10, seed=i) for i in range(4)]
    mixed[1] = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=9)
    out = engine.generate(prompts, sampling_params=mixed)
    for i in (0, 2, 3):
        assert out[i] == [old[0][i][0]]
    assert len(out[1]) == 3 and all(len(s) == 6 for s in out[1])
    again = engine.generate(prompts[1:2], sampling_params=[mixed[1]])
    assert again[0] == out[1]                   # seeded: the same alone as in the batch
    stop = old[0][0][0][3]
    cut = engine.generate(prompts[:1], sampling_params=SamplingParams(
        temperature=0, max_tokens=10, stop_token_ids=[stop]))
    assert cut[0][0] == old[0][0][0][:old[0][0][0].index(stop) + 1]


def test_engine_refuses_sampling_params_mixed_with_the_old_keywords(engine):
    with pytest.raises(InvalidArgumentError, match="temperature"):
        engine.generate([[1, 2]], temperature=0.5, sampling_params=SamplingParams())
    with pytest.raises(InvalidArgumentError, match="one per prompt"):
        engine.generate([[1, 2]], sampling_params=[SamplingParams()] * 2)
    assert engine.cache.is_empty


# ------------------------------------------------------------------ without torch (MLX, numpy)
def test_defaults_are_the_specs():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.n) == \
        (32, 0.0, 1.0, 0, 0.0, None, 1)
    assert (p.stop_token_ids, p.ignore_eos, p.logprobs) == ((), False, False) and p.greedy
    assert SamplingParams(logprobs=True).logprobs is True
    assert SamplingParams(logprobs=3).logprobs == 3 and SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()  # type: ignore[arg-type]


def _splitmix_reference(seed: int, step: int) -> float:
    """splitmix64 on Python integers, written from its definition (a third implementation)."""
    m = (1 << 64) - 1

    def mix(z):
        z = (z + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)
    return (mix((mix(seed % 2 ** 63) + (step & (m >> 1))) & m) >> 11) * 2.0 ** -53


def test_numpy_uniforms_equal_the_torch_ones_bit_for_bit():
    from kvcache.integrations.sampling import uniforms, uniforms_numpy
    rng = np.random.default_rng(5)
    seeds = [0, 1, 2 ** 63 - 1, 2 ** 62, 12345] + rng.integers(0, 2 ** 63, 2000).tolist()
    steps = [0, 2 ** 63 - 1, 1, 2 ** 62 + 3, 0] + rng.integers(0, 2 ** 40, 2000).tolist()
    got = uniforms_numpy(seeds, steps)
    want = uniforms(torch.tensor(seeds), torch.tensor(steps)).numpy()
    assert got.dtype == np.float64 and want.dtype == np.float64
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))
    assert got.tolist() == [_splitmix_reference(s, t) for s, t in zip(seeds, steps)]
    assert ((got >= 0) & (got < 1)).all() and abs(got.mean() - 0.5) < 0.03
    assert len(set(got.tolist())) == len(got)          # (a constant would pass the rest)
    # sample's reductions: seeds mod 2**63, the steps' low 63 bits
    np.testing.assert_array_equal(uniforms_numpy([2 ** 63 + 9, 4], [1, 2 ** 64 + 7]),
                                  uniforms_numpy([9, 4], [1, 7]))


GRID: list[dict[str, Any]] = [dict(temperature=t, top_k=k, top_p=p, min_p=m)
                               for t in (0.0, 0.25, 1.0, 1.8) for k in (0, 1, 4, 40)
                               for p in (1.0, 0.9, 0.4, 0.02) for m in (0.0, 0.05, 0.4)]


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_numpy_sampler_equals_torch_sampler_on_a_grid_of_settings(scale):
    from kvcache.integrations.sampling import draw_rows, sample_numpy
    rng = np.random.default_rng(int(scale))
    vocab = 301
    params = [SamplingParams(**kw) for kw in GRID for _ in range(3)]      # 576 rows
    logits = rng.standard_normal((len(params), vocab)) * scale
    seeds = rng.integers(0, 2 ** 63, len(params)).tolist()
    steps = rng.integers(0, 10 ** 6, len(params)).tolist()
    want_t, want_lp = sample(torch.from_numpy(logits), params, seeds, steps)
    got_t, got_lp = sample_numpy(logits, params, seeds, steps)
    assert got_t.dtype == np.int64 and got_lp.dtype == np.float64
    np.testing.assert_array_equal(got_t, want_t.numpy())
    np.testing.assert_allclose(got_lp, want_lp.numpy(), rtol=0, atol=1e-9)
    # the draws are draws: most sampled rows at temperature >= 1 without a tight filter leave
    # the argmax, and other steps give other tokens
    loose = [b for b, p in enumerate(params) if p.temperature >= 1 and p.top_k in (0, 40)
             and p.top_p >= 0.9 and p.min_p <= 0.05]
    assert np.mean(got_t[loose] != logits[loose].argmax(-1)) > 0.5
    other = sample_numpy(logits, params, seeds, [t + 1 for t in steps])[0]
    assert (other[loose] != got_t[loose]).mean() > 0.5
    # draw_rows: a permutation of the rows, numpy logits through to_numpy, torch on the device
    rows = rng.permutation(len(params)).tolist()
    ps, ss, ts = [params[r] for r in rows], [seeds[r] for r in rows], [steps[r] for r in rows]
    got = draw_rows(logits.tolist(), rows, ps, ss, ts, to_numpy=np.asarray)
    want = draw_rows(torch.from_numpy(logits), rows, ps, ss, ts)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[0], want_t.numpy()[rows])
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-9)


@pytest.mark.parametrize("u", [0.0, 1 - 2 ** -53, 1.0])   # (1: no uniform, the guard)
def test_the_draw_at_the_ends_of_the_unit_interval_takes_a_kept_token(monkeypatch, u):
    import kvcache.integrations.sampling as smp
    import kvcache.integrations.sampling_numpy as smp_numpy
    import kvcache.integrations.sampling_torch as smp_torch
    # patched where sample / sample_numpy look them up
    monkeypatch.setattr(smp_torch, "uniforms", lambda s, t, dtype=None: torch.full(
        s.shape, u, dtype=dtype or torch.float64, device=s.device))
    monkeypatch.setattr(smp_numpy, "uniforms_numpy", lambda s, t: np.full(len(s), u))
    logits = np.array([[-np.inf, -np.inf, 0.0, 1.0, -np.inf], [0.0, 5.0, 1.0, -1.0, 2.0]])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2)]
    want = [2, 1] if u == 0 else [3, 4]          # the first kept token, or the last
    assert smp.sample(torch.from_numpy(logits), params, [1, 2], [0, 0])[0].tolist() == want
    assert smp.sample_numpy(logits, params, [1, 2], [0, 0])[0].tolist() == want


def test_numpy_filter_equals_the_torch_filter():
    from kvcache.integrations.sampling import filter_numpy
    rng = np.random.default_rng(9)
    params = [SamplingParams(**kw) for kw in GRID]
    logits = rng.standard_normal((len(params), 257)) * 2
    got = filter_numpy(logits, params)
    want = filter_logits(torch.from_numpy(logits), params).numpy()
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
    assert 0 < np.isinf(got).mean() < 1
    # ties: up to 16 columns torch's CPU sort is stable, so the same tokens stay at the top-p
    # boundary; wider rows keep as many tied tokens (the same mass), maybe other ids among them
    for vocab in (9, 16, 64, 300):
        cases = [random_case(rng, vocab) for _ in range(200)]
        table = np.stack([c[0] for c in cases])
        ps = [c[1] for c in cases]
        got, want = filter_numpy(table, ps), filter_logits(torch.from_numpy(table), ps).numpy()
        if vocab <= 16:
            np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
        np.testing.assert_array_equal(np.isinf(got).sum(-1), np.isinf(want).sum(-1))
        scaled = table / np.array([[p.temperature] for p in ps])
        weight = np.exp(scaled - scaled.max(-1, keepdims=True))
        np.testing.assert_allclose(np.where(np.isinf(got), 0.0, weight).sum(-1),
                                   np.where(np.isinf(want), 0.0, weight).sum(-1), rtol=1e-12)


def test_greedy_rows_take_the_first_argmax_in_numpy_too():
    from kvcache.integrations.sampling import sample_numpy
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 2.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    params = [SamplingParams(temperature=0)] * 3
    for seeds in ([0, 0, 0], [1, 2, 3]):
        tokens, lps = sample_numpy(logits, params, seeds, [7, 8, 9])
        assert tokens.tolist() == [1, 2, 0]
        want = torch.from_numpy(logits).log_softmax(-1).numpy()[[0, 1, 2], [1, 2, 0]]
        np.testing.assert_allclose(lps, want, rtol=0, atol=1e-15)
    rng = np.random.default_rng(4)
    wide = rng.integers(-2, 3, (50, 100)).astype(np.float64)           # many tied maxima
    t, _ = sample(torch.from_numpy(wide), [SamplingParams()] * 50)
    np.testing.assert_array_equal(sample_numpy(wide, [SamplingParams()] * 50)[0], t.numpy())
    np.testing.assert_array_equal(t.numpy(), wide.argmax(-1))


def test_top_logprobs_numpy_and_torch():
    from kvcache.integrations.sampling import top_logprobs
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((12, 500)) * 3
    logits[0] = np.round(logits[0])                   # ties, some across the k-th
    logits[1, :] = 0.0
    logits[2, rng.random(500) < 0.5] = -np.inf
    lsm = torch.from_numpy(logits).log_softmax(-1).numpy()
    for k in (1, 5, 37, 499, 500, 800):
        ids, lps = top_logprobs(logits, k)
        tids, tlps = top_logprobs(torch.from_numpy(logits), k)
        want = np.argsort(-logits, axis=-1, kind="stable")[:, :min(k, 500)]   # ties by id
        assert ids.dtype == np.int64 and ids.shape == want.shape == lps.shape
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(tids, want)
        np.testing.assert_allclose(lps, np.take_along_axis(lsm, want, -1), rtol=0, atol=1e-12)
        np.testing.assert_allclose(tlps, lps, rtol=0, atol=1e-9)
    assert top_logprobs(logits, 3)[0][1].tolist() == [0, 1, 2]
    assert top_logprobs(logits, 0)[0].shape == (12, 0)
    f32 = top_logprobs(torch.from_numpy(logits[3:5]).float(), 4)      # float32 on the device
    np.testing.assert_array_equal(f32[0], want[3:5, :4])
    bad: Any
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="top_logprobs"):
            top_logprobs(logits, bad)


def _run_python(code: str) -> str:
    import subprocess
    import sys
    from pathlib import Path
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_draw_rows_runs_without_torch():
    import json
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 50))
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1), SamplingParams(),
              SamplingParams(temperature=0.7, top_k=5, min_p=0.1)]
    rows, seeds, steps = [2, 0, 4], [1, 0, 99], [0, 3, 17]
    code = ("import sys, json; sys.modules['torch'] = None\n"
            "import numpy as np\n"
            "from kvcache.integrations.sampling import SamplingParams, draw_rows, top_logprobs\n"
            f"x = np.array({logits.tolist()!r})\n"
            "p = [SamplingParams(temperature=1.0, top_p=0.9, seed=1), SamplingParams(),\n"
            "     SamplingParams(temperature=0.7, top_k=5, min_p=0.1)]\n"
            f"t, lp = draw_rows(x, {rows}, p, {seeds}, {steps}, np.asarray)\n"
            "ids, tl = top_logprobs(x, 3)\n"
            "assert t.dtype == np.int64 and lp.dtype == np.float64\n"
            "print(json.dumps([t.tolist(), lp.tolist(), ids.tolist(), tl.tolist()]))\n")
    t, lp, ids, tl = json.loads(_run_python(code))
    want_t, want_lp = sample(torch.from_numpy(logits[rows]), params, seeds, steps)
    assert t == want_t.tolist() and t[1] == int(logits[0].argmax())
    np.testing.assert_allclose(lp, want_lp.numpy(), rtol=0, atol=1e-9)
    assert ids == np.argsort(-logits, axis=-1)[:, :3].tolist()
    np.testing.assert_allclose(tl, torch.from_numpy(logits).log_softmax(-1).topk(3).values.numpy(),
                               rtol=0, atol=1e-12)


def test_numpy_logits_never_import_torch():
    code = ("import sys\n"
            "import numpy as np\n"
            "from kvcache.integrations.sampling import SamplingParams, draw_rows, top_logprobs\n"
            "x = np.random.default_rng(0).standard_normal((2, 20))\n"
            "draw_rows(x, [1, 0], [SamplingParams(temperature=1.0, seed=3)] * 2, [3, 4], [0, 0])\n"
            "top_logprobs(x, 2)\n"
            "print('torch' in sys.modules)\n")
    assert _run_python(code).strip() == "False"
