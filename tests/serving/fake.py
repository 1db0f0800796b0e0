"""A fake model runner for the scheduler tests: no torch, no model.

Each token's K row holds ``(token id, position)`` (exact in float32); a sequence's next token is
a hash of its whole history *as the cache holds it* (read back with ``get_kv``), so a token fed
at the wrong position, a wrong fork point or a lost recompute changes every later token. The
judge (``expected``) applies the same hash to plain token lists, with no cache.
"""

from __future__ import annotations

import hashlib

import numpy as np

import kvcache
from kvcache.errors import InvalidArgumentError
from kvcache.integrations.sampling import SamplingParams
from kvcache.serving import AsyncScheduler, EngineCore, Scheduler

VOCAB = 97


def next_token(history, seed=None, step=0) -> int:
    """The model: greedy (seed None) or a seeded draw, from the whole token history."""
    key = repr((tuple(int(t) for t in history), seed, 0 if seed is None else step)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % VOCAB


def expected(prompt, params: SamplingParams, j: int = 0, eos=()) -> list:
    """What sample ``j`` of a request must produce: the judge, on plain lists."""
    stops = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos))
    out: list = []
    while len(out) < params.max_tokens:
        seed = None if params.temperature == 0 else params.sample_seed(j)
        t = next_token(list(prompt) + out, seed, len(out))
        out.append(t)
        if t in stops:
            break
    return out


class Picks:
    def __init__(self, tokens):
        self.tokens = list(tokens)

    def result(self):
        return np.asarray(self.tokens, np.int64), np.zeros(len(self.tokens))


class FakeRunner:
    """The runner protocol of ``kvcache.serving.core`` over a reference-backend cache."""

    def __init__(self, cache):
        self.cache = cache
        self.forwards = []                 # (seq_ids, lens) of every forward that ran
        self.sessions = 0

    def session(self):
        import contextlib

        @contextlib.contextmanager
        def held():
            self.sessions += 1
            yield
        return held()

    def forward(self, plan, picks=None):
        tokens = list(plan.tokens)
        for d, s in zip(plan.slot_dst, plan.slot_src):
            tokens[d] = picks.tokens[s]
        assert -1 not in tokens, "a placeholder token reached the model"
        c = self.cache.config
        k = np.zeros((len(tokens), c.num_kv_heads, c.head_dim), np.float32)
        k[:, :, 0] = np.asarray(tokens, np.float32)[:, None]
        k[:, :, 1] = np.asarray(plan.positions, np.float32)[:, None]
        q = np.zeros((len(tokens), c.num_qo_heads, c.head_dim), np.float32)
        rows = []
        with self.cache.forward(plan.seq_ids, plan.lens):
            for layer in range(c.num_layers):
                self.cache.attention(layer, q, k, k)
            ends = np.cumsum(plan.lens)
            for row in plan.logit_rows:
                i = int(np.searchsorted(ends, row, side="right"))
                length = int(plan.positions[row]) + 1
                got = self.cache.get_kv(plan.seq_ids[i], 0, length, layer=0)[0]
                hist = np.asarray(got)[:, 0, :2]
                assert (hist[:, 1] == np.arange(length)).all(), "positions out of order"
                rows.append([int(t) for t in hist[:, 0]])
        self.forwards.append((list(plan.seq_ids), list(plan.lens)))
        return rows

    def greedy_async(self, logits, logprobs):
        return Picks([next_token(h) for h in logits])

    def pick(self, logits, draws, logprobs):
        tokens = [next_token(logits[d.row], None if d.params.temperature == 0 else d.seed, d.step)
                  for d in draws]
        return np.asarray(tokens, np.int64), np.zeros(len(tokens))

    def alternatives(self, logits, rows, k):
        """The greedy pick first, then the next ids, with log-probabilities -0, -1, ..."""
        ids = [[(next_token(logits[r]) + i) % VOCAB for i in range(k)] for r in rows]
        return np.asarray(ids, np.int64).reshape(len(rows), k), -np.tile(np.arange(k, dtype=float), (len(rows), 1))


def make_core(max_total_tokens=256, page_size=4, max_batch_size=8, prefill_chunk_size=64,
              pipelined=True, host_tier=False, eos=(), prefix_cache=False, layer_kinds=()):
    """A serving core over a reference cache of one full layer (the one the fake model reads)
    and, with ``layer_kinds`` (e.g. ``{1: Window(3)}``), the windowed layers it gives."""
    layers = 1 + len(dict(layer_kinds))
    config = kvcache.CacheConfig(num_layers=layers, num_qo_heads=1, num_kv_heads=1, head_dim=4,
                                 page_size=page_size, max_total_tokens=max_total_tokens,
                                 max_batch_size=max_batch_size,
                                 prefill_chunk_size=prefill_chunk_size, rope_mode="none",
                                 dtype="float32", prefix_cache=prefix_cache,
                                 layer_kinds=layer_kinds)
    cache = kvcache.PagedKVCache(config, backend="reference")
    tier = kvcache.HostTier(cache) if host_tier else None
    runner = FakeRunner(cache)

    def admit(prompt, params):
        params = params or SamplingParams()
        if not prompt:
            raise InvalidArgumentError("empty prompt")
        stops = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos))
        return list(prompt), params, stops

    core = EngineCore((AsyncScheduler if pipelined else Scheduler)(cache, tier), runner, admit)
    return core, runner, cache


def run_all(core, max_steps=10_000) -> dict:
    """Step to the end; returns {(request_id, index): (tokens, finish_reason)}."""
    got: dict = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            return got
        for out in core.step():
            tokens, _ = got.get((out.request_id, out.index), ([], None))
            assert (out.request_id, out.index) not in got or got[(out.request_id, out.index)][1] is None, \
                "output after the sample finished"
            got[(out.request_id, out.index)] = (tokens + out.new_token_ids, out.finish_reason)
    raise AssertionError("the engine did not finish")


def run_program(core, cache, prog: dict, max_steps: int, settle: int) -> None:
    """Drive a random request program (``prog["reqs"]``: prompt, params, the step it arrives
    at, the steps after which it is aborted or None) to the end and judge it: every sample's
    tokens equal ``expected`` (an aborted one a prefix of them), and every page comes back.
    A request that could not fit alone is never added (the engine refuses it up front). The
    loop ends once nothing is unfinished after ``settle`` steps, or at ``max_steps``."""
    ps = cache.config.page_size
    base = cache.num_available_pages
    ids: dict = {}
    got: dict = {}
    for step in range(max_steps):
        for k, r in enumerate(prog["reqs"]):
            if r["at"] == step:
                need = -(-(len(r["prompt"]) + r["params"].max_tokens - 1) // ps)
                if need <= base:
                    ids[k] = core.add_request(r["prompt"], r["params"])
            if r["abort"] is not None and r["at"] + r["abort"] == step and k in ids:
                core.abort(ids[k])
        if not core.has_unfinished() and step > settle:
            break
        for out in core.step():
            key = (out.request_id, out.index)
            tokens, _ = got.get(key, ([], None))
            got[key] = (tokens + out.new_token_ids, out.finish_reason)
    assert not core.has_unfinished()
    for k, rid in ids.items():
        r = prog["reqs"][k]
        for j in range(r["params"].n):
            tokens, reason = got[(rid, j)]
            want = expected(r["prompt"], r["params"], j)
            if reason == "abort":
                assert tokens == want[:len(tokens)]
            else:
                assert (tokens, reason) == (want, "length"), (k, j)
    assert cache.is_empty and cache.num_available_pages == base
