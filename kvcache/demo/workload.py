"""The demo's workload: requests arriving over time, drawn from one seed (a run is reproducible).

The same workload runs on the synthetic toy model and on a real architecture; only the
vocabulary and the sizes differ. Requests arrive in *groups* (one client sending a few requests at
once) as a Poisson process in engine steps: a group's requests that open with a system prompt
open with the same one, so they share its pages in the engine (through its prefix cache: a
younger request waits while an older one computes the system prompt, then starts from it). Kinds of request:

* *shared system prompt*: one of two system prompts (or a few-shot prefix nested in the first)
  and a short question;
* *parallel samples*: ``n`` samples of one prompt (sampled with temperature 0.8 where torch is
  installed; the samples fork after one prefill);
* *long prompt*: ``long_prompt / 2`` to ``long_prompt`` tokens (prefilled in chunks; one
  request);
* *burst of long generations*: a group of requests arriving together, each a system prompt and a
  document of ``long_prompt / 8`` to ``/ 4`` tokens, with 4 samples of 3-4 times ``max_output``
  tokens: their growth fills the cache and forces preemptions;
* *plain*: a short prompt.

The first requests are forced to cover every kind, so any run of ``5 + burst`` or more requests
exercises all of them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

FEATURES = {
    # kind: the feature name the report counts
    "prefix": "shared system prompt",
    "parallel": "parallel samples",
    "long": "long prompt (chunked)",
    "burst": "burst of long generations",
}


@dataclasses.dataclass
class Request:
    rid: int
    arrival: int                 # engine step at which it is added
    prompt: list                 # token ids (system prompt included)
    max_tokens: int              # new tokens per sample
    n: int = 1                   # samples
    sampled: bool = False        # drawn with temperature > 0 (else greedy)
    prefix: Optional[str] = None
    features: tuple = ()

    @property
    def kinds(self) -> tuple:
        return self.features or ("plain",)


@dataclasses.dataclass
class Workload:
    requests: list
    prefixes: dict               # name -> its tokens (a nested prefix includes its parent's)
    vocab: int

    def features(self) -> dict:
        """{feature name: requests with it}, every feature named (0 when none has it)."""
        out = {name: 0 for name in FEATURES.values()}
        for r in self.requests:
            for f in r.features:
                out[f] += 1
        return out

    @property
    def last_arrival(self) -> int:
        return max((r.arrival for r in self.requests), default=0)


def _log_uniform(rng, lo: float, hi: float) -> int:
    lo, hi = max(lo, 1.0), max(hi, lo + 1.0)
    return int(round(np.exp(rng.uniform(np.log(lo), np.log(hi)))))


def make_workload(num_requests: int, seed: int, vocab: int, *, long_prompt: int = 3000,
                  max_output: int = 40, samples: int = 3, arrival_rate: float = 1.0,
                  burst: Optional[int] = None) -> Workload:
    """``num_requests`` requests (see the module docstring) with token ids in ``[1, vocab)``.

    Sizes follow ``long_prompt``: system prompts of a twelfth to an eighth and a thirtieth to a
    sixteenth of it (a few-shot part of a twentieth to a tenth nested in the first), questions
    up to a quarter of it (a 24th after a system prompt). Outputs are 4 to ``max_output`` tokens; parallel requests ask for
    ``samples`` samples. Groups of 1-3 requests arrive as a Poisson process with
    ``arrival_rate`` requests per engine step on average; the burst (``burst`` requests, default
    4, or 2 below 16 requests) arrives at 40% of the arrivals."""
    rng = np.random.default_rng([seed, 0xDE31])
    L = max(int(long_prompt), 16)
    if burst is None:
        burst = 4 if num_requests >= 16 else 2

    def tokens(n) -> list:
        return rng.integers(1, vocab, max(int(n), 1)).tolist()

    sys_a = tokens(rng.integers(L // 12, L // 8 + 1))
    sys_b = tokens(rng.integers(L // 30, L // 16 + 1))
    prefixes = {"sys-a": sys_a, "sys-b": sys_b,
                "sys-a+fewshot": sys_a + tokens(rng.integers(L // 20, L // 10 + 1))}
    forced = ["prefix", "nested+parallel", "parallel", "long", "plain"]
    rng.shuffle(forced)
    kinds = forced + ["burst"] * burst
    while len(kinds) < num_requests:
        kinds.append(str(rng.choice(["plain", "prefix", "parallel", "prefix+parallel"],
                                    p=[.25, .5, .13, .12])))
    kinds = kinds[:num_requests]
    # arrival steps: groups of 1-3 as a Poisson process; the burst together at 40%
    burst_at = int(0.4 * num_requests / arrival_rate)
    arrivals: list = []
    t = 0.0
    while len(arrivals) < num_requests:
        size = int(rng.integers(1, 4))
        arrivals += [int(t)] * size
        t += rng.exponential(size / arrival_rate)
    requests = []
    group_prefix: dict = {}
    for rid, (kind, at) in enumerate(zip(kinds, arrivals)):
        if kind == "burst":
            at = burst_at
        prefix, features, n, sampled = None, [], 1, False
        out = int(rng.integers(4, max_output + 1)) if max_output >= 4 else max_output
        if "prefix" in kind or "nested" in kind or kind == "burst":
            prefix = "sys-a+fewshot" if "nested" in kind else group_prefix.setdefault(
                (at, kind == "burst"), str(rng.choice(["sys-a", "sys-b", "sys-a+fewshot"])))
            features.append(FEATURES["prefix"])
            question = tokens(_log_uniform(rng, 2, L / 24) if kind != "burst"
                              else rng.integers(L // 8, L // 4 + 1))     # a document to read
        elif kind == "long":
            question = tokens(rng.integers(L // 2, L + 1))
            features.append(FEATURES["long"])
        else:
            question = tokens(_log_uniform(rng, 4, L / 4))
        if "parallel" in kind:
            n, sampled = samples, True
            features.append(FEATURES["parallel"])
        if kind == "burst":
            n, sampled = 4, True
            out = int(rng.integers(3 * max_output, 4 * max_output + 1))
            features.append(FEATURES["burst"])
        prompt = (prefixes[prefix] if prefix else []) + question
        requests.append(Request(rid, at, prompt, max(out, 1), n, sampled, prefix,
                                tuple(features)))
    requests.sort(key=lambda r: (r.arrival, r.rid))
    return Workload(requests, prefixes, vocab)
