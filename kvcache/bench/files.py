"""``kvcache bench --files``: saving and loading one sequence's KV file
(``PagedKVCache.save_sequences`` / ``load_sequences``, hashing and every check included) against
a plain write and read of the same bytes to and from the same directory, in one run.

The sequence: Llama-3-8B's KV shape (32 layers, 8 KV heads, head dim 128, bfloat16: 128 KiB a
token), as many tokens as ``--files-mib`` asks. The plain write is one ``write`` of a host
buffer of the file's size over the plain file (truncated in place); the plain read one
``read`` of that file. The ratio's target is judged against that write. The same write is
also timed as a save makes its file (``replace_s``: to a new file beside the old, then
renamed over it), which needs as much page cache again while the old file is there, where
the write in place reuses the pages its truncation just freed: on a VM whose free memory the
host takes back, the new pages cost more than the write (docs/kv-files.md, Speed). Neither syncs to the
device, so both measure what the page cache and the filesystem give this process (the rate a
user's save and load see), and the ratios say what the format costs on top. The loads go into
one destination cache whose pages have held a sequence before (a serving cache's have): the
first load into the new cache, which also pays the first touch of its pages, is timed apart
(``first_load_s``) and is not in the ratio."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

TARGET = 0.8
"""Save and load at least this fraction of the plain write and read."""


def add_arguments(p) -> None:
    g = p.add_argument_group("--files (KV files)")
    g.add_argument("--files", action="store_true",
                   help="save and load one sequence's KV file against a plain write and read "
                        "of the same bytes (target >= 0.8 each)")
    g.add_argument("--files-mib", type=int, default=1024, metavar="MIB",
                   help="the sequence's K+V size in MiB (default 1024)")
    g.add_argument("--files-dir", default=None, metavar="DIR",
                   help="where the files go (default: the system's temporary directory)")


def run(mib: int, directory, backend: str = "reference", device=None, repeat: int = 3) -> dict:
    """The bench's result (JSON-ready)."""
    import kvcache
    layers, heads, dim = 32, 8, 128
    per_token = 2 * layers * heads * dim * 2
    tokens = max(1, mib * 2**20 // per_token)
    ps = 16
    cfg = kvcache.CacheConfig(num_layers=layers, num_qo_heads=heads, num_kv_heads=heads,
                              head_dim=dim, page_size=ps, dtype="bfloat16", rope_mode="none",
                              max_total_tokens=-(-tokens // ps) * ps + ps,
                              prefill_chunk_size=tokens, max_batch_size=1)
    src = kvcache.PagedKVCache(cfg, backend=backend, device=device)
    rng = np.random.default_rng(0)
    src.add_sequence(0)
    rows = rng.standard_normal((tokens, heads, dim)).astype(np.float32) * 0.5
    with src.forward([0], [tokens]):
        for layer in range(layers):
            kv = src.from_numpy(np.roll(rows, layer, axis=0))
            src.append_kv(layer, kv, kv)
    path = os.path.join(directory, "kvcache-bench.kv")
    plain = os.path.join(directory, "kvcache-bench.raw")
    save, load, write, read, replace = [], [], [], [], []
    buf = None
    ids = [list(range(tokens))]
    # the destination: a cache whose pages have held K/V before, as a serving cache's have;
    # the first load into a new cache also pays for the first touch of its pages (a page
    # fault each, most of that load's time on the development VM): timed apart, not in the
    # ratio
    dst = kvcache.PagedKVCache(cfg, backend=backend, device=device)
    try:
        src.save_sequences(path, [0], tokens=ids)
        t0 = time.perf_counter()
        (sid,) = dst.load_sequences(path)
        first = time.perf_counter() - t0
        dst.remove_sequence(sid)
        for _ in range(repeat):
            t0 = time.perf_counter()
            src.save_sequences(path, [0], tokens=ids)
            save.append(time.perf_counter() - t0)
            size = os.path.getsize(path)
            if buf is None or len(buf) != size:
                buf = np.ones(size, np.uint8)           # the plain write's bytes, made once
            t0 = time.perf_counter()
            with open(plain, "wb") as f:
                f.write(buf.data)
            write.append(time.perf_counter() - t0)
            t0 = time.perf_counter()                    # as a save does: beside, renamed
            with open(plain + ".new", "wb") as f:
                f.write(buf.data)
            os.replace(plain + ".new", plain)
            replace.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            (sid,) = dst.load_sequences(path)
            load.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with open(plain, "rb") as f:
                f.read()
            read.append(time.perf_counter() - t0)
            same = dst.sequence_length(sid) == tokens
            dst.remove_sequence(sid)
    finally:
        for name in (path, plain, plain + ".new"):
            if os.path.exists(name):
                os.remove(name)
    gib = size / 2**30
    res = {"bytes": size, "tokens": tokens, "backend": getattr(src, "backend").name, "loaded": same,
           "save_s": statistics.median(save), "write_s": statistics.median(write), "load_s": statistics.median(load),
           "read_s": statistics.median(read), "first_load_s": first,
           "replace_s": statistics.median(replace)}
    res["save_over_write"] = res["write_s"] / res["save_s"]
    res["save_over_replace"] = res["replace_s"] / res["save_s"]
    res["load_over_read"] = res["read_s"] / res["load_s"]
    res["rates_gib_s"] = {k: gib / res[f"{k}_s"] for k in ("save", "write", "replace", "load", "read")}
    return res


def print_result(res: dict) -> None:
    r = res["rates_gib_s"]
    print(f"kvcache bench --files: one sequence of {res['tokens']} tokens, {res['bytes'] / 2**20:.1f}"
          f" MiB on disk, backend {res['backend']} (median of the runs)")
    print(f"  save_sequences {res['save_s'] * 1e3:9.1f} ms  {r['save']:6.2f} GiB/s   plain write "
          f"{res['write_s'] * 1e3:9.1f} ms  {r['write']:6.2f} GiB/s   ratio "
          f"{res['save_over_write']:.2f} (target >= {TARGET}) "
          f"{'met' if res['save_over_write'] >= TARGET else 'MISSED'}")
    print(f"  (the plain write again, to a new file renamed over the old as save_sequences "
          f"does: {res['replace_s'] * 1e3:.1f} ms, {r['replace']:.2f} GiB/s; save's ratio to "
          f"it {res['save_over_replace']:.2f})")
    print(f"  load_sequences {res['load_s'] * 1e3:9.1f} ms  {r['load']:6.2f} GiB/s   plain read  "
          f"{res['read_s'] * 1e3:9.1f} ms  {r['read']:6.2f} GiB/s   ratio "
          f"{res['load_over_read']:.2f} (target >= {TARGET}) "
          f"{'met' if res['load_over_read'] >= TARGET else 'MISSED'}")
    print(f"  (every page's hash checked on load; loaded length right: {res['loaded']}; the "
          f"first load, into a new cache: {res['first_load_s'] * 1e3:.1f} ms)")


def main(args) -> int:
    import json
    directory = args.files_dir or tempfile.gettempdir()
    res = run(args.files_mib, directory, backend=args.backend or "reference", device=args.device)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_result(res)
    return 0
