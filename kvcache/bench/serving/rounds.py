"""``kvcache bench --serving --runs N``: each system's timed measurement N times, the systems
interleaved round by round (a, d, a, d, ...) so that a drift of the machine hits every side
alike, and the medians the targets are judged on (one run's ratio moved 10-28% run to run on
the GPU).

``interleave`` drives the systems' rounds; ``combine`` makes one row of a system's rounds (the
medians, the per-round values under ``runs``); ``put_rows`` puts them in a result; ``put_ratio`` a
ratio of two systems as the median of its per-round values; ``runs_note`` says so in a report.
"""

from __future__ import annotations

import statistics
from typing import Callable


def _reraise(key: str, exc: Exception) -> None:
    raise exc


def interleave(systems: dict, runs: int,
               failed: Callable[[str, Exception], None] = _reraise) -> dict:
    """Round by round, the next result of each of ``systems`` (key: a callable starting that
    system's iterator of rounds, which frees the system when closed): round r of every system
    before round r + 1 of any; each system closed after its last round (with ``runs`` 1, before
    the next one starts: one system in memory at a time). A system whose round raises is closed
    and left out, and ``failed(key, exc)`` decides (by default it re-raises). Returns key: the
    list of its ``runs`` results, for the systems that did not fail."""
    results: dict = {key: [] for key in systems}
    live: dict = {}
    try:
        for r in range(runs):
            for key in [k for k in systems if k in results]:
                if key not in live:
                    live[key] = systems[key]()
                try:
                    results[key].append(next(live[key]))
                except Exception as exc:        # failed() decides: re-raise or leave out
                    live.pop(key).close()
                    del results[key]
                    failed(key, exc)
                    continue
                if r == runs - 1:
                    live.pop(key).close()
    finally:
        for rounds in live.values():
            rounds.close()
    return results


def combine(rows: list, fields: tuple) -> dict:
    """One row for a system's rounds ``rows``: the first round's, with each of ``fields`` (a
    number, or a dict of numbers) the median over the rounds, and ``runs``: each field's
    per-round values. One round: its row as it is."""
    if len(rows) == 1:
        return rows[0]
    row = dict(rows[0])
    row["runs"] = {f: [r[f] for r in rows] for f in fields}
    for f, values in row["runs"].items():
        row[f] = ({k: statistics.median(v[k] for v in values) for k in values[0]}
                  if isinstance(values[0], dict) else statistics.median(values))
    return row


def put_rows(result: dict, done: dict, fields: tuple) -> None:
    """``result["systems"][key]``: ``combine``'s row (over ``fields``) of each system's rounds in
    ``done`` (``interleave``'s, each round a (row, tokens) pair); ``result["runs"]``: their
    count, where over one (a result without it is one run's)."""
    for key, measured in done.items():
        result["systems"][key] = combine([row for row, _ in measured], fields)
    runs = max(map(len, done.values()), default=1)
    if runs > 1:
        result["runs"] = runs


def per_round(row: dict, field: str) -> list:
    """``field``'s value in each round of a ``combine`` row (one round: its one value)."""
    return row["runs"][field] if "runs" in row else [row[field]]


def put_ratio(result: dict, name: str, nums: list, dens: list) -> None:
    """``result["ratios"][name]``: the median of the per-round ratios ``nums[i] / dens[i]`` (the
    ratio of one round: ``--runs 1``), the rounds' list in ``result["ratio_runs"][name]`` where
    there are several (a median of ratios: each round's two sides ran side by side)."""
    ratios = [n / d for n, d in zip(nums, dens)]
    result["ratios"][name] = statistics.median(ratios)
    if len(ratios) > 1:
        result.setdefault("ratio_runs", {})[name] = ratios


def runs_note(res: dict) -> str:
    """``"median of N runs"`` where ``res`` (a result) was measured with ``--runs N`` > 1, else
    the empty string."""
    n = res.get("runs", 1)
    return f"median of {n} runs" if n > 1 else ""
