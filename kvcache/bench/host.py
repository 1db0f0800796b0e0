"""``kvcache bench --host``: the host time of ``begin_forward`` and the aux upload, on decode
batches of 1..1024 sequences (``host_bench``) and on batches that change every step
(``changing_bench``), reference backend; ``numpy_call_us`` calibrates the table."""

from __future__ import annotations

import platform
import time

import numpy as np

from ..cache import PagedKVCache
from ..config import CacheConfig

BATCHES = (1, 16, 64, 256, 1024)
ROUNDS = 5


def _decode_cache(batch: int, pages_each: tuple, page_size: int, shared_prefix_pages: int, seed: int,
                  steps: int):
    """A reference-backend cache (no KV math is timed) holding ``batch`` sequences of 8..64 pages,
    optionally all forked from one shared prefix."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(pages_each[0] * page_size, pages_each[1] * page_size, size=batch)
    total = int(lengths.sum()) + shared_prefix_pages * page_size + batch * (steps + 2 * page_size)
    cfg = CacheConfig(num_layers=1, num_qo_heads=1, num_kv_heads=1, head_dim=2, page_size=page_size,
                      max_batch_size=max(batch, 1), max_total_tokens=total,
                      prefill_chunk_size=max(total, 1), dtype="float32", rope_mode="none")
    cache = PagedKVCache(cfg, backend="reference")
    state = cache.state
    if shared_prefix_pages:
        state.add_sequence(-1)
        _grow(cache, -1, shared_prefix_pages * page_size)
    for i in range(batch):
        if shared_prefix_pages:
            state.fork_sequence(-1, i)
        else:
            state.add_sequence(i)
        _grow(cache, i, int(lengths[i]))
    return cache


def _grow(cache, seq_id, n):
    """Append n tokens through the planner only (no kernels): this measures index work alone."""
    chunk = cache.config.prefill_chunk_size
    while n > 0:
        step = min(n, chunk)
        cache.planner.begin([seq_id], [step])
        n -= step


def numpy_call_us(n: int = 3000) -> float:
    """Median cost of one small numpy call (``x + 1`` on 256 int32) on this machine right now:
    begin_forward is a fixed number of such calls, so this calibrates the table."""
    x = np.arange(256, dtype=np.int32)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            x + 1
        times.append((time.perf_counter() - t0) / n * 1e6)
    return float(np.median(times))


def host_bench(repeat: int = 200, page_size: int = 16) -> list[dict]:
    rows = []
    for shared in (0, 8):
        for batch in BATCHES:
            steps = repeat if batch <= 256 else max(repeat // 4, 20)
            cache = _decode_cache(batch, (8, 64), page_size, shared, seed=batch, steps=steps + 5)
            ids = list(range(batch))
            ones = [1] * batch
            planner, upload = cache.planner, cache.aux_manager.upload
            for _ in range(5):
                upload(planner.begin(ids, ones))
            # ROUNDS rounds of steps / ROUNDS calls each; the best round's median is the
            # machine's cost without neighbours' noise (as timeit's min), the overall median
            # what a loaded machine sees
            times_plan, times_total, rounds = [], [], []
            per_round = max(steps // ROUNDS, 1)
            for _ in range(ROUNDS):
                this = []
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    plan = planner.begin(ids, ones)
                    t1 = time.perf_counter()
                    upload(plan)
                    t2 = time.perf_counter()
                    times_plan.append(t1 - t0)
                    times_total.append(t2 - t0)
                    this.append(t1 - t0)
                rounds.append(float(np.median(this)) * 1e6)
            med_plan = float(np.median(times_plan)) * 1e6
            med_total = float(np.median(times_total)) * 1e6
            rows.append({"batch": batch, "shared_prefix_pages": shared,
                         "depths": len(plan.depths), "begin_forward_us": med_plan,
                         "best_round_us": min(rounds),
                         "with_plain_aux_us": med_total, "us_per_seq": min(rounds) / batch,
                         "pages": int(sum(d.num_pages for d in plan.depths))})
    return rows


def print_host(rows, call_us: float) -> None:
    print(f"begin_forward host overhead (decode, 8..64 pages per sequence, page 16), "
          f"{platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"numpy {np.__version__}; one small numpy call costs {call_us:.2f} us here now")
    print("  begin_fwd: median of every call; best round: lowest median of 5 rounds (noise-free "
          "cost); +aux copy: median with the plain aux upload; us/seq from the best round")
    print(f"{'batch':>6} {'shared':>7} {'depths':>6} {'pages':>7} {'begin_fwd us':>13} "
          f"{'best round us':>14} {'in numpy calls':>15} {'+aux copy us':>13} {'us/seq':>8}")
    for r in rows:
        print(f"{r['batch']:>6} {r['shared_prefix_pages']:>7} {r['depths']:>6} {r['pages']:>7} "
              f"{r['begin_forward_us']:>13.1f} {r['best_round_us']:>14.1f} "
              f"{r['best_round_us'] / call_us:>15.0f} "
              f"{r['with_plain_aux_us']:>13.1f} {r['us_per_seq']:>8.3f}")


CHANGING_BATCHES = (16, 64, 256)
CHANGING_TARGET_US = {64: 150.0, 256: 300.0}
"""``begin_forward`` targets of the changing-batch cases (no target at other batch sizes)."""
CHANGING_CASES = ("join_leave", "join_leave_shared", "mixed_shared")
"""``join_leave``: each step one sequence leaves and a new one joins with a 64-token prefill
(mixed prefill + decode, no shared prefix); ``join_leave_shared``: the same, every sequence
forked from an 8-page shared prefix; ``mixed_shared``: the same membership every step, one
sequence (in turn) appends a 16-token chunk, the rest decode, under the shared prefix."""


def changing_bench(repeat: int = 200, page_size: int = 16, cases=CHANGING_CASES,
                   batches=CHANGING_BATCHES) -> list[dict]:
    """The general planner path on batches that change every step: for each case and batch
    size, ``begin_forward``'s median, best round and the ratio of the best round to the target
    (reference backend; the membership changes happen outside the timed call)."""
    rows = []
    for case in cases:
        shared = 0 if case == "join_leave" else 8
        for batch in batches:
            steps = repeat
            prefill = 64 if case.startswith("join") else 16
            per_round = max(steps // ROUNDS, 1)
            calls = (ROUNDS + 1) * per_round
            # room for every call's tokens (each sequence's share of them)
            cache = _decode_cache(batch, (8, 64), page_size, shared, seed=batch,
                                  steps=calls + -(-calls * prefill // batch) + page_size)
            state, planner = cache.state, cache.planner
            ids = list(range(batch))
            next_id = batch
            times, rounds = [], []
            for r in range(ROUNDS + 1):            # round 0 warms up
                this = []
                for k in range(per_round):
                    lengths = [1] * batch
                    if case.startswith("join"):
                        state.remove_sequence(ids.pop(0))
                        if shared:
                            state.fork_sequence(-1, next_id)
                        else:
                            state.add_sequence(next_id)
                        ids.append(next_id)
                        next_id += 1
                        lengths[-1] = prefill
                    else:
                        lengths[(r * per_round + k) % batch] = prefill
                    t0 = time.perf_counter()
                    plan = planner.begin(ids, lengths)
                    this.append(time.perf_counter() - t0)
                if r:
                    times.extend(this)
                    rounds.append(float(np.median(this)) * 1e6)
            target = CHANGING_TARGET_US.get(batch)
            best = min(rounds)
            rows.append({"case": case, "batch": batch, "shared_prefix_pages": shared,
                         "depths": len(plan.depths),
                         "begin_forward_us": float(np.median(times)) * 1e6,
                         "best_round_us": best, "target_us": target,
                         "ratio": None if target is None else best / target})
    return rows


def print_changing(rows) -> None:
    print("begin_forward on changing batches (general planner path; reference backend)")
    print("  ratio: best round / target (<= 1 meets it); targets: "
          + ", ".join(f"B={b}: {t:.0f} us" for b, t in CHANGING_TARGET_US.items()))
    print(f"{'case':>18} {'batch':>6} {'depths':>6} {'begin_fwd us':>13} {'best round us':>14} "
          f"{'target us':>10} {'ratio':>7}")
    for r in rows:
        target = "-" if r["target_us"] is None else f"{r['target_us']:.0f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{r['case']:>18} {r['batch']:>6} {r['depths']:>6} {r['begin_forward_us']:>13.1f} "
              f"{r['best_round_us']:>14.1f} {target:>10} {ratio:>7}")
