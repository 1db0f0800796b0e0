"""The replay check: a sample of requests scored again, one sample at a time, without the engine.

Each checked sample is replayed *teacher-forced*: its prompt and the tokens it generated (but the
last) go through the model in one plain forward on a fresh sequence, no scheduler, no batch, no
shared prefix, no preemption, and that forward's logits at every generated position are compared
with what the run reported. The run asks every request for the log-probability of each token it
picked (``SamplingParams(logprobs=True)``), so for each new token:

* **logits close**: the run's log-probability of the token and the replay's differ by at most
  the dtype's tolerance (``TOLERANCES``: float32 1e-3, float16 5e-2, bfloat16 0.25 in nats);
* **token equal** (greedy requests): the token is the replay's argmax, unless the replay's two
  best logits are within twice that tolerance of each other (a near-tie that the dtype's rounding
  may flip; counted and reported as such, never silently).

For the toy model the replay runs on a fresh cache of the **reference** backend with the same
shape and dtype, computing in float64 (``replay_toy``); for a real model it is the model's own
forward in transformers (``kvcache.demo.real``). On the reference backend in float32 the run and
the replay differ only by float32 rounding of the attention outputs (the largest difference is
about 1e-7 nats): the tokens are identical. The bfloat16 tolerance was measured on an H100: the
small random Llama's log-probabilities differ from transformers' own bf16 forward by up to 0.13
nats, the toy model's from the reference by up to 0.02.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np

TOLERANCES = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 2.5e-1}
"""Largest difference of a token's log-probability (nats) between the run and the replay."""


@dataclasses.dataclass
class CheckResult:
    dtype: str
    against: str                     # what the replay ran on, for the report
    requests: int = 0
    samples: int = 0
    tokens: int = 0
    near_ties: int = 0
    max_err: float = 0.0
    failed: int = 0                  # samples that failed (the first few are in ``failures``)
    failures: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failed == 0

    @property
    def tolerance(self) -> float:
        return TOLERANCES.get(self.dtype, TOLERANCES["bfloat16"])

    def text(self) -> str:
        status = "PASSED" if self.ok else f"FAILED ({self.failed} samples differ)"
        ties = f", {self.near_ties} near-ties accepted" if self.near_ties else ""
        return (f"{status}: {self.requests} requests ({self.samples} samples, {self.tokens:,} "
                f"tokens) replayed alone on {self.against}; greedy tokens identical{ties}, "
                f"log-probabilities within {self.tolerance:g} (max |diff| {self.max_err:.2g})")

    def compare(self, what: str, tokens: list, logprobs: list, logits: np.ndarray,
                greedy: bool, max_failures: int = 5) -> bool:
        """Compare one sample's run (``tokens``, their ``logprobs``) with the replay's
        ``logits`` (one row per token, float64). Records a failure; returns whether it passed."""
        tol = self.tolerance
        self.samples += 1
        self.tokens += len(tokens)
        logits = np.asarray(logits, np.float64)
        top = logits.max(axis=-1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
        for t, tok in enumerate(tokens):
            want = float(logits[t, tok] - lse[t])
            got = float(logprobs[t]) if t < len(logprobs) else float("nan")
            err = abs(got - want)
            if np.isfinite(err):
                self.max_err = max(self.max_err, err)
            problem = None
            if not err <= tol:
                problem = (f"log-probability {got:.6g} in the run, {want:.6g} in the replay "
                           f"(|diff| {err:.3g} > {tol:g})")
            elif greedy:
                best = int(np.argmax(logits[t]))
                if best != tok:
                    gap = float(logits[t, best] - logits[t, tok])
                    if gap <= 2 * tol:
                        self.near_ties += 1
                    else:
                        problem = (f"token {tok} in the run, the replay's argmax is {best} "
                                   f"(logit gap {gap:.3g} > {2 * tol:g})")
            if problem is not None:
                self.failed += 1
                if len(self.failures) < max_failures:
                    self.failures.append(f"{what}: new token {t}: {problem}")
                return False
        return True


def judge_greedy(tokens: list, logits: np.ndarray, dtype: str) -> tuple:
    """Greedy ``tokens`` judged by a teacher-forced re-score (``logits``: one row per token,
    the reference's logits at the position that picked it): ``(near_ties, problem)``, where
    each token must be the row's argmax, or within twice the dtype's tolerance
    (``TOLERANCES``) of it: a near-tie the dtype's rounding may flip (counted). ``problem``
    names the first token that is neither (None: all pass)."""
    tol = TOLERANCES.get(dtype, TOLERANCES["bfloat16"])
    logits = np.asarray(logits, np.float64)
    ties = 0
    for t, tok in enumerate(tokens):
        best = int(np.argmax(logits[t]))
        if best == tok:
            continue
        gap = float(logits[t, best] - logits[t, tok])
        if gap > 2 * tol:
            return ties, (f"new token {t} is {tok}, the re-score's argmax is {best} (logit gap "
                          f"{gap:.3g} > {2 * tol:g})")
        ties += 1
    return ties, None


def teacher_forced_logits(model, prompt: list, tokens: list) -> np.ndarray:
    """A transformers causal LM's own logits (float64, host) at the positions that picked
    ``tokens`` after ``prompt``: one plain forward of ``prompt + tokens[:-1]`` (the model's
    attention, no cache, no batch)."""
    import torch
    device = next(model.parameters()).device
    with torch.inference_mode():
        ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=device)
        return model(ids).logits[0, len(prompt) - 1:].double().cpu().numpy()


def rescore_greedy(model, prompt: list, tokens: list, dtype: str) -> tuple:
    """``judge_greedy`` of ``tokens`` against ``model``'s ``teacher_forced_logits``."""
    return judge_greedy(tokens, teacher_forced_logits(model, prompt, tokens), dtype)


def greedy_generate(model, prompt: list, new_tokens: int) -> list:
    """A transformers causal LM's own greedy ``generate`` of exactly ``new_tokens`` tokens after
    ``prompt`` (on the model's device; the new tokens only)."""
    import torch
    device = next(model.parameters()).device
    with torch.no_grad():
        return model.generate(torch.tensor([list(prompt)], device=device), do_sample=False,
                              max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens)[0, len(prompt):].tolist()


@dataclasses.dataclass
class GreedyCheck:
    """``check_greedy``'s counts over the requests."""
    requests: int = 0
    same: int = 0                    # token-identical to transformers' generate
    parted: int = 0                  # other tokens, every one passing the re-score
    ties: int = 0                    # the near-tie tokens of those
    failed: int = 0                  # other tokens, failing (strict: any difference)
    own_failed: int = 0              # control: transformers' own tokens failing the re-score
    own_failed_of_failed: int = 0    # control: of the ``failed`` requests

    def parted_text(self) -> str:
        """``", N parted at near-ties only (M tokens, teacher-forced re-score)"``; "" if none."""
        return (f", {self.parted} parted at near-ties only ({self.ties} tokens, teacher-forced "
                f"re-score)" if self.parted else "")


def check_greedy(model, prompts: list, outs: list, new_tokens: int, dtype: str,
                 strict: bool = False, control: bool = False, say=print) -> GreedyCheck:
    """The Engine's greedy tokens against transformers' own ``generate`` on ``model``: each
    request of ``prompts`` whose tokens ``outs`` (``new_tokens`` each, the Engine's) differ
    from ``greedy_generate``'s is judged by ``rescore_greedy`` at ``dtype``'s margin (a
    near-tie the dtype's rounding may flip passes, counted in ``parted`` and ``ties``), or with
    ``strict`` (float32 on the PyTorch path: the same summation order) fails outright.
    ``control``: transformers' own tokens are judged by the same re-score too (how often the
    judge fails the library itself: ``own_failed``, ``own_failed_of_failed``), and each
    failure names that verdict. ``say``: where each failure is reported, one line each.
    Returns the counts (``GreedyCheck``)."""
    res = GreedyCheck()
    for prompt, got in zip(prompts, outs):
        res.requests += 1
        want = greedy_generate(model, prompt, new_tokens)
        own = rescore_greedy(model, prompt, want, dtype)[1] if control else None
        res.own_failed += own is not None
        if got == want:
            res.same += 1
            continue
        if strict:
            say(f"  {dtype}: a request's tokens differ from generate's: {got} vs {want}")
            res.failed += 1
            continue
        n, problem = rescore_greedy(model, prompt, got, dtype)
        if problem is not None:
            say(f"  {dtype}: a request's tokens fail the re-score: {problem}"
                + (f"; transformers' own generate on it: {own or 'passes'}" if control else ""))
            res.failed += 1
            res.own_failed_of_failed += own is not None
        else:
            res.parted += 1
            res.ties += n
    return res


def choose(workload, k: int, seed: int) -> list:
    """Up to ``k`` requests to check (0: all): one of each feature first, then random ones."""
    reqs = workload.requests
    if k <= 0 or k >= len(reqs):
        return sorted(r.rid for r in reqs)
    rng = np.random.default_rng([seed, 0xC4EC])
    chosen: list = []
    for feature in sorted({f for r in reqs for f in r.kinds}):
        have = [r.rid for r in reqs if feature in r.kinds and r.rid not in chosen]
        if have and len(chosen) < k:
            chosen.append(int(rng.choice(have)))
    rest = [r.rid for r in reqs if r.rid not in chosen]
    rng.shuffle(rest)
    return sorted(chosen + rest[:max(k - len(chosen), 0)])


def replay(result: CheckResult, workload, served, rids: list, logits) -> CheckResult:
    """Score every sample of the requests ``rids`` again into ``result``: ``logits(prompt,
    tokens)`` gives the judge's logits at the sample's positions (one teacher-forced pass)."""
    t0 = time.perf_counter()
    by_rid = {r.rid: r for r in workload.requests}
    for rid in rids:
        req, tr = by_rid[rid], served.traces[rid]
        result.requests += 1
        for j, (toks, lps) in enumerate(zip(tr.tokens, tr.logprobs)):
            if not toks:
                continue
            what = f"request {rid} ({', '.join(req.kinds)}) sample {j}"
            result.compare(what, toks, lps, logits(req.prompt, toks), greedy=not req.sampled)
    result.seconds = time.perf_counter() - t0
    return result


def replay_toy(adapter, workload, served, rids: list, dtype: str,
               page_size: int = 16) -> CheckResult:
    """Replay the requests ``rids`` of a toy-model run on fresh reference-backend caches."""
    import kvcache
    return replay(CheckResult(dtype, "the reference backend"), workload, served, rids,
                  lambda prompt, toks: _toy_logits(kvcache, adapter, prompt + toks[:-1],
                                                   len(prompt), dtype, page_size))


def _toy_logits(kvcache, adapter, tokens: list, prompt_len: int, dtype: str,
                page_size: int) -> np.ndarray:
    """The toy model's logits at positions ``prompt_len - 1 ..`` of ``tokens``: one forward of
    the whole list on a fresh reference cache."""
    n = len(tokens)
    config = adapter.cache_config(dtype=dtype, page_size=page_size,
                                  max_total_tokens=n + page_size, max_batch_size=1,
                                  prefill_chunk_size=n)
    cache = kvcache.PagedKVCache(config, backend="reference")
    cache.add_sequence(0)
    rows = np.arange(prompt_len - 1, n, dtype=np.int64)
    tamper, adapter.tamper = adapter.tamper, None      # the replay is the model itself
    try:
        with cache.forward([0], [n]):
            return adapter.forward(cache, np.asarray(tokens, np.int64),
                                   np.arange(n, dtype=np.int64), rows)
    finally:
        adapter.tamper = tamper


def check_summary(result: Optional[CheckResult]) -> Optional[dict]:
    if result is None:
        return None
    return {"ok": result.ok, "against": result.against, "requests": result.requests,
            "samples": result.samples, "tokens": result.tokens, "near_ties": result.near_ties,
            "max_err": result.max_err, "tolerance": result.tolerance, "seconds": result.seconds,
            "failed_samples": result.failed, "failures": list(result.failures)}
