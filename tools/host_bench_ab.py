"""A/B the host bench (``kvcache bench --host``) of two source trees in one run: alternate
rounds in fresh processes, each tree first on its PYTHONPATH, and report each row's median
``begin_forward_us`` (and its best round) over the rounds of each tree.

    python tools/host_bench_ab.py OLD_TREE NEW_TREE [--rounds 3] [--changing | --prefix]

``--changing``: the changing-batch rows (``changing_bench``) instead, both trees timed by the
NEW tree's bench code (an older tree may not have it) over their own ``kvcache`` package.
``--prefix``: the prefix cache's rows (``prefix_bench``: the first ask, again, add+remove), timed
by the NEW tree's bench code the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

CHILD = "import json, kvcache.bench as b; print(json.dumps(b.host_bench()))"
CHANGING = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("kvcache.bench.ab", sys.argv[1])
b = importlib.util.module_from_spec(spec)
spec.loader.exec_module(b)
print(json.dumps(getattr(b, sys.argv[2])()))
"""


def run(tree: str, bench_file: str = None, bench: str = "changing_bench") -> list:
    env = dict(os.environ, PYTHONPATH=tree)
    argv = ["-c", CHILD] if bench_file is None else ["-c", CHANGING, bench_file, bench]
    out = subprocess.run([sys.executable, *argv], env=env, check=True, text=True,
                         capture_output=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--changing", action="store_true")
    what.add_argument("--prefix", action="store_true")
    args = parser.parse_args()
    bench_file = (os.path.abspath(os.path.join(args.new, "kvcache", "bench", "host.py"))
                  if args.changing
                  else os.path.abspath(os.path.join(args.new, "kvcache", "bench", "host_prefix.py"))
                  if args.prefix else None)
    bench = "prefix_bench" if args.prefix else "changing_bench"
    results = {args.old: [], args.new: []}
    for _ in range(args.rounds):
        for tree in (args.old, args.new):
            results[tree].append(run(tree, bench_file, bench))
    if args.prefix:
        print_prefix_ab(results[args.old], results[args.new])
        return
    rows = results[args.old][0]
    print(f"{'case':>18} {'batch':>6} {'shared':>6} {'old us':>8} {'new us':>8} {'new/old':>8} "
          f"{'old best':>9} {'new best':>9}")
    ratios = []
    for i, row in enumerate(rows):
        old = float(np.median([r[i]["begin_forward_us"] for r in results[args.old]]))
        new = float(np.median([r[i]["begin_forward_us"] for r in results[args.new]]))
        old_best = min(r[i]["best_round_us"] for r in results[args.old])
        new_best = min(r[i]["best_round_us"] for r in results[args.new])
        ratios.append(new / old)
        print(f"{row.get('case', 'decode'):>18} {row['batch']:>6} "
              f"{row['shared_prefix_pages']:>6} {old:>8.1f} {new:>8.1f} "
              f"{new / old:>8.3f} {old_best:>9.1f} {new_best:>9.1f}")
    print(f"median new/old over rows: {float(np.median(ratios)):.3f}")


def print_prefix_ab(old: list, new: list) -> None:
    """Each prefix row's medians over the rounds of each tree, old -> new, with the best
    round's in brackets; us per call."""
    cols = (("match_us", "first ask"), ("match_again_us", "again"), ("add_remove_us", "add+remove"))
    print(f"{'prompt':>7} {'given as':>12} {'matched':>8} " + " ".join(f"{c[1]:>24}" for c in cols))
    for i, row in enumerate(old[0]):
        cells = []
        for key, _ in cols:
            o, n = ([r[i][key] for r in rounds] for rounds in (old, new))
            cells.append(f"{np.median(o):.1f} -> {np.median(n):.1f} "
                         f"[{min(o):.1f} -> {min(n):.1f}]")
        print(f"{row['prompt_tokens']:>7} {row['tokens_as']:>12} {row['matched']:>8} "
              + " ".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
