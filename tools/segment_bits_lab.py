"""Batch-invariant key segments on a GPU, bit for bit under several tile shapes (issue 54): the
conformance runs of one sequence (``check_invariance``) on a prompt of several 32-key segments,
per dtype and page size, with small tiles (decode rows = prefill rows) and the shipped ones, the
decode steps' segments split over programs and folded in one; one line per case, PASS or the first differing token.

    python tools/segment_bits_lab.py [--device cuda]
"""

from __future__ import annotations

import argparse


def main() -> None:
    import kvcache
    from kvcache.conformance.test_invariance import _Run, check_invariance
    from kvcache_cuda.tuning import AttnTiles
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", default="float32,float16,bfloat16")
    p.add_argument("--n", type=int, default=62)
    p.add_argument("--only", default="", help="the tile sets whose name holds this")
    a = p.parse_args()
    tilesets = {     # name: (tiles over the shipped ones, decode rows, split)
        "pre32x16/dec32 split": ({64: {"prefill": AttnTiles(32, 16, 4, 1)}}, 32, True),
        "pre32x16/dec32 in-prog": ({64: {"prefill": AttnTiles(32, 16, 4, 1)}}, 32, False),
        "shipped split": (None, None, True),
        "shipped in-prog": (None, None, False),
    }
    for dtype in a.dtypes.split(","):
        for ps in (16, 1):
            for name, (tiles, rows, split) in tilesets.items():
                if a.only not in name:
                    continue
                cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2,
                                          head_dim=64, page_size=ps, dtype=dtype,
                                          max_total_tokens=1024, max_batch_size=8,
                                          batch_invariant=True, prefix_cache=True,
                                          rope_mode="none")

                def fresh():
                    cache = kvcache.PagedKVCache(cfg, backend="cuda", device=a.device)
                    cache.backend.impl = "triton"
                    t = cache.backend.tuning.with_(
                        invariant_segment_keys=32,
                        invariant_split_programs=0 if split else 1)
                    if tiles is not None:
                        big = dict(t.by_head_dim)
                        big.update(tiles)
                        t = t.with_(by_head_dim=big, float32_by_head_dim=big,
                                    invariant_decode_rows=rows)
                    cache.backend.tuning = t
                    return _Run(cache)
                try:
                    check_invariance(cfg, fresh, n=a.n)
                    verdict = "PASS"
                except AssertionError as exc:
                    verdict = f"FAIL {exc}"
                print(f"{dtype:9} ps={ps:2} {name:24} {verdict}", flush=True)


if __name__ == "__main__":
    main()
