"""Batch invariance (``CacheConfig(batch_invariant=True)``, capability ``batch_invariant``): one
sequence's tokens get the same attention output and lse, bit for bit, however they reach the
cache. Every token's q, k and v are drawn from its (content, position, layer) alone, so a
sequence holding the same content computes the same inputs in every run; the runs differ only
in what the cache does around them:

* alone, its prompt in one forward, then decode steps;
* beside other sequences, its prompt in seven chunks of uneven sizes, decoding in a batch;
* its prompt's whole pages found in the prefix cache (another sequence computed them);
* forked from a parent inside a page, the parent running beside it with other content;
* decoding beside two forks of itself (a shared prefix, which a batch-variant cache reads once).

Every output is read after all forwards of a run (the device runs ahead meanwhile).
"""

from __future__ import annotations

import numpy as np

import kvcache

from .base import Conformance

TARGET = 0        # the content of the sequence whose tokens are compared


def _rows(config, content: int, start: int, n: int, layer: int) -> tuple:
    """q (n, Hq, D), k (n, Hkv, D), v (n, Hkv, Dv) float32 of tokens ``start..start+n`` of
    ``content`` at ``layer``: a function of (content, position, layer) alone."""
    c = config
    out: tuple = ([], [], [])
    for pos in range(start, start + n):
        rng = np.random.default_rng((content, pos, layer))
        for i, (h, d) in enumerate(((c.num_qo_heads, c.head_dim), (c.num_kv_heads, c.head_dim),
                                    (c.num_kv_heads, c.head_dim_v))):
            out[i].append(rng.standard_normal((h, d)).astype(np.float32))
    return tuple(np.stack(x) for x in out)


def _tokens(content: int, n: int) -> list:
    """The token ids of ``content``'s first ``n`` positions (the prefix cache's key)."""
    return [content * 10_000 + p for p in range(n)]


class _Run:
    """Forwards on one cache; the target's outputs per (position, layer), read at the end."""

    def __init__(self, cache):
        self.cache = cache
        self.pending: list = []       # (positions, rows, layer, o, lse) still on the device

    def add(self, sid: int, content: int, length: int = 0) -> int:
        """Add ``sid`` holding ``content`` (its tokens told to the prefix cache); returns the
        cached prefix it starts from."""
        return self.cache.add_sequence(sid, tokens=_tokens(content, max(length, 1)))

    def forward(self, items: list) -> None:
        """``items``: (sid, content, start, n) per sequence of one forward."""
        cache, c = self.cache, self.cache.config
        with cache.forward([s for s, _, _, _ in items], [n for _, _, _, n in items]):
            for layer in range(c.num_layers):
                parts = [_rows(c, content, start, n, layer) for _, content, start, n in items]
                q, k, v = (cache.from_numpy(np.concatenate([p[i] for p in parts]))
                           for i in range(3))
                o, lse = cache.attention(layer, q, k, v, return_lse=True)
                row = 0
                for _, content, start, n in items:
                    if content == TARGET:
                        self.pending.append((range(start, start + n), range(row, row + n),
                                             layer, o, lse))
                    row += n

    def outputs(self) -> dict:
        """{(position, layer): (o bytes, lse bytes)} of the target's tokens."""
        out = {}
        for positions, rows, layer, o, lse in self.pending:
            o_np, lse_np = kvcache.to_numpy(o), kvcache.to_numpy(lse)
            for pos, r in zip(positions, rows):
                out[(pos, layer)] = (o_np[r].tobytes(), lse_np[r].tobytes())
        return out


def check_invariance(config, fresh, n: int = 0, steps: int = 3) -> None:
    """The class's runs of one sequence (the module's docstring) on caches made by ``fresh()``
    (a ``_Run`` of a new batch-invariant cache with ``config``, its prefix cache on): its
    prompt of ``n`` tokens (0: three pages and a part, at least 24) and ``steps`` decode steps;
    raises AssertionError naming the first token whose output or lse differs from its run
    alone. A backend's own tests call it with longer prompts (its kernels' splits)."""
    ps = config.page_size
    n = n or max(3 * ps + 5, 24)        # the prompt: three pages and a part, or more

    # alone: the prompt in one forward, then decode steps
    alone = fresh()
    alone.add(1, TARGET, n)
    alone.forward([(1, TARGET, 0, n)])
    for i in range(steps):
        alone.forward([(1, TARGET, n + i, 1)])
    want = alone.outputs()
    assert len(want) == (n + steps) * config.num_layers

    runs = {}
    # beside others, in seven uneven chunks, then decoding in a batch
    run = fresh()
    run.add(1, TARGET, n)
    run.add(2, 1, 2 * ps + 1)
    run.add(3, 2, 7)
    sizes = [1, 4, max(1, ps - 3), 2, ps + 1, 6]
    sizes.append(n - sum(sizes))
    assert sizes[-1] > 0
    done, other = 0, {2: [1, 0, 2 * ps + 1], 3: [2, 0, 7]}     # content, at, prompt
    for size in sizes + [1] * steps:
        items = [(1, TARGET, done, size)]
        for sid, (content, at, prompt) in other.items():
            take = min(prompt - at, 5) if at < prompt else 1       # prefill, then decode
            items.append((sid, content, at, take))
            other[sid][1] = at + take
        run.forward(items[1:2] + items[:1] + items[2:])     # the target not always first
        done += size
    runs["batched and chunked"] = run

    # the prompt's whole pages from the prefix cache: another sequence computed them
    run = fresh()
    run.add(5, TARGET, n)
    run.forward([(5, TARGET, 0, n)])
    run.cache.remove_sequence(5)
    run.pending.clear()
    cached = run.add(1, TARGET, n)
    assert cached >= ps, f"expected a prefix-cache hit, got {cached} cached tokens"
    run.forward([(1, TARGET, cached, n - cached)])
    for i in range(steps):
        run.forward([(1, TARGET, n + i, 1)])
    runs["from the prefix cache"] = run

    # forked from a parent inside a page; the parent goes on with other content beside it
    run = fresh()
    cut = ps + 3
    run.add(6, TARGET, cut)
    run.forward([(6, TARGET, 0, cut)])
    run.cache.fork_sequence(6, 1)
    run.pending.clear()
    run.forward([(6, 9, cut, 4), (1, TARGET, cut, n - cut)])
    for i in range(steps):
        run.forward([(1, TARGET, n + i, 1), (6, 9, cut + 4 + i, 1)])
    runs["forked inside a page"] = run

    # decoding beside two forks of itself (a shared prefix of three pages)
    run = fresh()
    run.add(1, TARGET, n)
    run.forward([(1, TARGET, 0, n)])
    for sid in (7, 8):
        run.cache.fork_sequence(1, sid)
    for i in range(steps):
        run.forward([(7, 7, n + i, 1), (1, TARGET, n + i, 1), (8, 8, n + i, 1)])
    runs["decoding beside its forks"] = run

    for what, run in runs.items():
        got = run.outputs()
        assert got, what
        for key, bits in sorted(got.items()):
            if bits != want[key]:
                pos, layer = key
                o_got = np.frombuffer(bits[0], dtype=np.uint8)
                raise AssertionError(
                    f"{what}: the token at position {pos}, layer {layer}, differs from the "
                    f"same token computed alone ({int((o_got != np.frombuffer(want[key][0], np.uint8)).sum())} "
                    f"output bytes differ; lse equal: {bits[1] == want[key][1]})")


class TestBatchInvariance(Conformance):
    """A sequence's tokens: the same bits alone, batched, chunked, from the prefix cache, forked
    and decoding beside its forks."""

    def _cache(self, make_pair, kvcache_device):
        p = make_pair(needs=("batch_invariant",), batch_invariant=True, prefix_cache=True,
                      num_layers=2, max_total_tokens=1024, max_batch_size=8)
        config, name = p.config, p.dut.backend.name

        def fresh():
            return _Run(kvcache.PagedKVCache(config, backend=name, device=kvcache_device))
        return config, fresh

    def test_a_tokens_bits_do_not_depend_on_the_forward_around_it(self, make_pair,
                                                                   kvcache_device):
        config, fresh = self._cache(make_pair, kvcache_device)
        check_invariance(config, fresh)
    def test_token_trees_are_refused(self, make_pair, kvcache_device):
        config, fresh = self._cache(make_pair, kvcache_device)
        run = fresh()
        run.add(1, TARGET, 4)
        try:
            with run.cache.forward([1], [3], [-1, 0, 0]):
                pass
        except kvcache.UnsupportedFeatureError as exc:
            assert "batch_invariant" in str(exc)
        else:
            raise AssertionError("a token tree in a batch-invariant cache was not refused")
        assert run.cache.sequence_length(1) == 0          # nothing of the refused forward
