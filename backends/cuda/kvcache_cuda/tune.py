"""Sweep the attention kernels' tiles and the split-K rule on this GPU and write its
architecture's entry of the tuning table (``tuning_table.json``, read by ``for_arch``).

    python -m kvcache_cuda.tune [--write] [--table PATH] [--iters N] [--dtype bfloat16]

At the kernel bench's head shape (Hq 32, Hkv 8, D 128, page 16), each candidate is timed the
bench's way (one call captured in a CUDA graph and replayed, L2 flushed, median), on several
cases at once, and the best candidate is the one with the lowest geometric mean of its time
over the case's best time (so no case is given up for another):

1. decode tiles (``bench.DECODE_TILES``) over B=1 L=4096, B=16 L=4096, B=64 L=4096,
   B=1 L=32768;
2. with the best decode tiles, the split-K rule (``split_programs_per_sm`` x ``split_min_keys``)
   over the same cases;
3. prefill tiles (``bench.PREFILL_TILES``) over paged prefill B=1 L=4096 and B=8 L=1024;
4. ragged tiles (the same candidates) over causal ragged prefill B=1 L=4096 and B=8 L=1024
   (the "ragged" entry: the ragged kernel's own tiles for 16-bit caches);
5. where the kernels are compiled for an NVIDIA GPU (inline PTX reaches them), the flag
   ``warp_uniform_scalars`` off and on over the paged prefill cases, with the chosen prefill
   tiles (on ROCm the flag cannot apply, and the entry leaves it out);
6. where torch's attention kernels run (``kvcache_cuda.flash``), the Triton prefill against them
   over growing calls (``FLASH_RAGGED_ROWS``: one sequence of that many rows;
   ``FLASH_PAGED_ROWS``: that many queries over 4096 paged keys, the gather included): the
   thresholds ``flash_ragged_min_rows`` / ``flash_paged_min_rows`` are the smallest size from
   which the library is faster at that size and every larger one (left out where it never is).
   Then several sequences of one shape, paged and ragged, both must win: ``FLASH_BATCH_ROWS``
   rows in all split into sequences of each of ``FLASH_BATCH_LENS`` rows gives
   ``flash_batch_min_len``; sequences of that length, ``FLASH_BATCH_TOTALS`` rows in all,
   ``flash_batch_min_rows``.
   ``--only flash`` runs this step alone and keeps the rest of the architecture's entry.

Prints every candidate's times and the chosen entry; ``--write`` stores it under this GPU's
``device_arch`` (``"sm_90"``, ``"gfx942"``), keeping the other architectures' entries. The
candidates run from the backend's base table (``TUNING``), not from an entry already there.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
from pathlib import Path

import numpy as np

from . import bench, bench_kit, triton_kernels
from .tuning import AttnTiles, TABLE_PATH, device_arch, read_table, write_entry

DECODE_CASES = [(1, 4096), (16, 4096), (64, 4096), (1, 32768)]
PREFILL_CASES = [("paged", 1, 4096), ("paged", 8, 1024), ("ragged", 1, 4096),
                 ("ragged", 8, 1024)]
SPLIT_RULES = [(pps, keys) for pps in (1, 2, 4) for keys in (64, 128, 256, 512)]
FLASH_RAGGED_ROWS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
FLASH_PAGED_ROWS = (16, 64, 256, 1024, 4096)
FLASH_BATCH_LENS = (32, 64, 128, 256, 512, 1024)
FLASH_BATCH_ROWS = 8192
FLASH_BATCH_TOTALS = (1024, 2048, 4096, 8192, 16384)
FLASH_PAGED_KEYS = 4096


def best_of(timings: dict) -> tuple:
    """``(candidate, score)`` with the lowest geometric mean of time / the case's best time;
    ``timings``: candidate -> list of times per case (None: the candidate failed there)."""
    ok = {c: t for c, t in timings.items() if t and all(x is not None for x in t)}
    if not ok:
        raise RuntimeError("no candidate ran on every case")
    cases = len(next(iter(ok.values())))
    floor = [min(t[i] for t in ok.values()) for i in range(cases)]
    scores = {c: math.exp(sum(math.log(t[i] / floor[i]) for i in range(cases)) / cases)
              for c, t in ok.items()}
    best = min(scores, key=lambda c: scores[c])
    return best, scores[best]


def _time_all(label, candidates, apply, runs, timer):
    """Time every candidate (``apply(candidate)`` sets the backend's table) on every run."""
    out = {}
    for cand in candidates:
        apply(cand)
        times = []
        for run in runs:
            try:
                times.append(timer.measure(run)[0])
            except Exception as exc:            # e.g. out of shared memory for big tiles
                print(f"  {label} {cand}: failed ({type(exc).__name__})", flush=True)
                times.append(None)
                break
        out[cand] = times
        shown = " ".join("  fail" if t is None else f"{t:8.1f}" for t in times)
        print(f"  {label} {cand}: {shown} us", flush=True)
    return out


def sweep(torch, backend, timer, rng, device) -> dict:
    """Run the sweeps; returns the table entry (tiles as lists, the rule's numbers, the flags
    that could be timed here)."""
    base = backend.tuning
    scale = bench_kit.D ** -0.5
    d = str(bench_kit.D)

    def with_tiles(tuning, kind, tiles):
        table = dict(tuning.by_head_dim)
        table[bench_kit.D] = dict(table.get(bench_kit.D, {}), **{kind: AttnTiles(*tiles)})
        return tuning.with_(by_head_dim=table)

    setups = [bench_kit.paged_setup(torch, backend, b, n, 1, rng, device) for b, n in DECODE_CASES]
    decode_runs = [functools.partial(backend.paged_attention, q, pages, depth, scale)
                   for pages, depth, q in setups]
    print(f"# decode tiles over {DECODE_CASES} (B, L)", flush=True)
    tiles = _time_all("decode", bench.DECODE_TILES,
                      lambda t: setattr(backend, "tuning", with_tiles(base, "decode", t)),
                      decode_runs, timer)
    decode, dscore = best_of(tiles)
    tuned = with_tiles(base, "decode", decode)
    print(f"# split-K rule (split_programs_per_sm, split_min_keys), decode tiles {decode}",
          flush=True)
    rules = _time_all("splits", SPLIT_RULES, lambda r: setattr(backend, "tuning", tuned.with_(
        split_programs_per_sm=r[0], split_min_keys=r[1])), decode_runs, timer)
    rule, rscore = best_of(rules)
    del setups, decode_runs
    torch.cuda.empty_cache()

    runs: list = []
    for kind, b, n in PREFILL_CASES:
        if kind == "paged":
            pages, depth, q = bench_kit.paged_setup(torch, backend, b, n, n, rng, device)
            runs.append(functools.partial(backend.paged_attention, q, pages, depth, scale))
        else:
            q = torch.randn((b * n, bench_kit.HQ, bench_kit.D), device=device).to(backend.dtype)
            k = torch.randn((b * n, bench_kit.HKV, bench_kit.D), device=device).to(backend.dtype)
            v = torch.randn_like(k)
            qo = torch.arange(0, b * n + 1, n, device=device, dtype=torch.int32)
            runs.append(functools.partial(backend.ragged_attention, q, k, v, qo, scale,
                                          num_seqs=b, max_len=n))
    chosen, measured = {}, {}
    for kind, name in (("paged", "prefill"), ("ragged", "ragged")):
        cases = [c for c in PREFILL_CASES if c[0] == kind]
        print(f"# {name} tiles over {cases}", flush=True)
        ptiles = _time_all(name, bench.PREFILL_TILES,
                           lambda t, name=name: setattr(backend, "tuning",
                                                        with_tiles(base, name, t)),
                           [r for c, r in zip(PREFILL_CASES, runs) if c[0] == kind], timer)
        chosen[name], score = best_of(ptiles)
        measured[f"{name}_score"] = round(score, 3)
        measured[f"{name}_us"] = dict(zip(map(str, cases),
                                          [round(x, 1) for x in ptiles[chosen[name]]]))
    flags = {}
    if triton_kernels._inline_ptx():
        paged = [(c, r) for c, r in zip(PREFILL_CASES, runs) if c[0] == "paged"]
        with_pre = with_tiles(base, "prefill", chosen["prefill"])
        print(f"# warp_uniform_scalars over {[c for c, _ in paged]}, prefill tiles "
              f"{chosen['prefill']}", flush=True)
        timed = _time_all("warp_uniform_scalars", (False, True), lambda on: setattr(
            backend, "tuning", with_pre.with_(warp_uniform_scalars=on)), [r for _, r in paged],
            timer)
        flags["warp_uniform_scalars"] = best_of(timed)[0]
        measured["uniform_us"] = {str(on): [round(x, 1) for x in t] for on, t in timed.items()}
    backend.tuning = base
    entry = {"by_head_dim": {d: {"decode": list(decode), "prefill": list(chosen["prefill"]),
                                 "ragged": list(chosen["ragged"])}},
             "split_programs_per_sm": rule[0], "split_min_keys": rule[1], **flags,
             "measured": {"decode_score": round(dscore, 3), "split_score": round(rscore, 3),
                          "decode_us": dict(zip(map(str, DECODE_CASES),
                                                [round(x, 1) for x in rules[rule]])),
                          **measured}}
    return entry


def crossover(sizes, triton_us, flash_us):
    """The smallest size from which ``flash_us`` beats ``triton_us`` there and at every larger
    size (None: at no size)."""
    best = None
    for size, t, f in reversed(list(zip(sizes, triton_us, flash_us))):
        if f is None or t is None or f >= t:
            break
        best = size
    return best


def flash_sweep(torch, backend, timer, rng, device) -> dict:
    """Step 6: the entry's library thresholds and what they came from ({} where the
    library does not run here)."""
    from .bench_kit import prefill_path
    if backend.flash is None:
        print(f"# torch's attention kernels: not here ({backend.flash_problem})", flush=True)
        return {}
    scale = bench_kit.D ** -0.5
    entry: dict = {}
    measured: dict = {}
    for kind, sizes in (("ragged", FLASH_RAGGED_ROWS), ("paged", FLASH_PAGED_ROWS)):
        times: dict = {"triton": [], "flash": []}
        for n in sizes:
            if kind == "ragged":
                q = torch.randn((n, bench_kit.HQ, bench_kit.D), device=device).to(backend.dtype)
                k = torch.randn((n, bench_kit.HKV, bench_kit.D), device=device).to(backend.dtype)
                v = torch.randn_like(k)
                qo = torch.tensor([0, n], device=device, dtype=torch.int32)
                run = functools.partial(backend.ragged_attention, q, k, v, qo, scale, num_seqs=1,
                                        max_len=n)
            else:
                pages, depth, q = bench_kit.paged_setup(torch, backend, 1, FLASH_PAGED_KEYS, n,
                                                        rng, device)
                run = functools.partial(backend.paged_attention, q, pages, depth, scale)
            for path in ("triton", "flash"):
                with prefill_path(backend, path):
                    try:
                        times[path].append(round(timer.measure(run)[0], 1))
                    except Exception as exc:
                        print(f"  {kind} {n} {path}: failed ({type(exc).__name__}: {exc})")
                        times[path].append(None)
            print(f"  flash {kind} rows {n}: triton {times['triton'][-1]} us, flash "
                  f"{times['flash'][-1]} us", flush=True)
        at = crossover(sizes, times["triton"], times["flash"])
        if at is not None:
            entry[f"flash_{kind}_min_rows"] = at
        measured[f"flash_{kind}_us"] = {"rows": list(sizes), **times}
    lens = [n for n in FLASH_BATCH_LENS if n <= FLASH_BATCH_ROWS // 2]
    at_len = _batch_crossover(torch, backend, timer, rng, device, lens,
                              [(FLASH_BATCH_ROWS // n, n) for n in lens], "len", measured)
    if at_len is not None:
        totals = [t for t in FLASH_BATCH_TOTALS if t >= 2 * at_len]
        at_rows = _batch_crossover(torch, backend, timer, rng, device, totals,
                                   [(t // at_len, at_len) for t in totals], "rows", measured)
        if at_rows is not None:
            entry["flash_batch_min_len"], entry["flash_batch_min_rows"] = at_len, at_rows
    entry["measured"] = measured
    return entry


def _batch_crossover(torch, backend, timer, rng, device, sizes, shapes, what, measured):
    """The crossover over ``sizes`` of calls of ``shapes`` ((sequences, length) each): paged
    (length queries over as many keys an entry, a ``uniform`` depth) and ragged (causal), the
    larger of the two (None where either never wins)."""
    from .bench_kit import prefill_path
    scale = bench_kit.D ** -0.5
    found = []
    for kind in ("paged", "ragged"):
        times: dict = {"triton": [], "flash": []}
        for batch, n in shapes:
            pages, depth, q = bench_kit.paged_setup(torch, backend, batch, n, n, rng, device)
            if kind == "ragged":
                k = torch.randn((batch * n, bench_kit.HKV, bench_kit.D), device=device).to(
                    backend.dtype)
                v = torch.randn_like(k)
                qo = torch.arange(0, batch * n + 1, n, device=device, dtype=torch.int32)
                run = functools.partial(backend.ragged_attention, q, k, v, qo, scale,
                                        num_seqs=batch, max_len=n)
            else:
                run = functools.partial(backend.paged_attention, q, pages, depth, scale)
            for path in ("triton", "flash"):
                with prefill_path(backend, path):
                    times[path].append(round(timer.measure(run)[0], 1))
            print(f"  flash batch {kind} {batch} x {n}: triton {times['triton'][-1]} us, flash "
                  f"{times['flash'][-1]} us", flush=True)
        measured[f"flash_batch_{kind}_{what}_us"] = {
            "shapes": [list(s) for s in shapes], **times}
        found.append(crossover(sizes, times["triton"], times["flash"]))
    return None if None in found else max(found)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcache_cuda.tune", description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="store the entry in the table")
    p.add_argument("--table", default=str(TABLE_PATH), help="the table file (default: the package's)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--only", choices=("all", "flash"), default="all",
                   help="flash: step 6 alone, merged into the architecture's entry")
    args = p.parse_args(argv)
    import torch
    from .backend import CudaBackend
    cls = CudaBackend
    if getattr(torch.version, "hip", None):     # ROCm: its own base table
        from kvcache_rocm.backend import RocmBackend
        cls = RocmBackend
    device = torch.device(args.device)
    backend = bench_kit.bench_backend(cls, args.dtype, str(device))
    backend.tuning = cls.TUNING                 # candidates from the base table
    arch = device_arch(torch, device)
    if arch is None:
        p.error(f"--device {args.device!r} is not a GPU: the sweep times GPU kernels")
    name = torch.cuda.get_device_name(device)
    print(f"# {name} ({arch}), {args.dtype}, Hq{bench_kit.HQ}/Hkv{bench_kit.HKV}/D{bench_kit.D} "
          f"page {bench_kit.PS}", flush=True)
    timer = bench_kit.Timer(torch, device, args.iters, 3)
    rng = np.random.default_rng(0)
    today = datetime.date.today().isoformat()
    if args.only == "flash":
        entry = dict(read_table(Path(args.table)).get(arch, {}))
        found = flash_sweep(torch, backend, timer, rng, device)
        for key in ("flash_ragged_min_rows", "flash_paged_min_rows", "flash_batch_min_len",
                    "flash_batch_min_rows"):
            entry.pop(key, None)
        entry.update({k: v for k, v in found.items() if k != "measured"})
        entry["measured"] = dict(entry.get("measured", {}), **found.get("measured", {}))
        entry["source"] = (f"{entry.get('source', '')}; --only flash on {name}, {args.dtype}, "
                           f"{today}").lstrip("; ")
    else:
        entry = sweep(torch, backend, timer, rng, device)
        found = flash_sweep(torch, backend, timer, rng, device)
        entry.update({k: v for k, v in found.items() if k != "measured"})
        entry["measured"].update(found.get("measured", {}))
        entry["source"] = (f"python -m kvcache_cuda.tune --write on {name}, {args.dtype}, "
                           f"{today}")
    print(f"# entry for {arch}: {entry}")
    if args.write:
        write_entry(arch, entry, Path(args.table))
        print(f"# written to {args.table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
