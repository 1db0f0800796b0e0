"""Compile every Triton kernel for real GPU targets without a GPU (run as a script, in its own
process: it replaces Triton's active driver).

A fake driver reports an sm_90 (H100) target; each launch the backend makes is turned into a
compile-only ``warmup`` run, which goes through the full NVIDIA pipeline (TTIR -> TTGIR -> LLVM ->
PTX -> cubin with the bundled ptxas). The interpreter proves the indexing; this proves the same
source also compiles, for every flag combination the backend uses (tree, inline RoPE, split-K,
fp32 'ieee' dots, head dims 64/128/256, group sizes 1/3/4).

Usage: python tests/cuda/triton_compile_check.py [sm ...]     (default: 90)
       python tests/cuda/triton_compile_check.py --uniform [sm ...]   (only the paged prefill
       kernel with ``warp_uniform_scalars``: its inline PTX, in CI)
Prints one line per compiled kernel and "COMPILED n" at the end; exit 0 when all compiled.
"""

import dataclasses
import os
import sys
import time
from pathlib import Path

os.environ["KVCACHE_CUDA_CPU"] = "1"
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class CompileOnlyDriver:
    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


COMPILED = []
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    t = time.time()
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    COMPILED.append(self.fn.__name__)
    print(f"  compiled {self.fn.__name__:<24} {time.time() - t:5.2f}s", flush=True)
    return kernel


def matrix():
    import cuda_cases as cc
    from cuda_cases import Entry
    from kvcache.backend import RopeSpec
    rope = RopeSpec()
    rng = np.random.default_rng(0)
    # (dtype, head_dim, hq, hkv, tree, rope): every flag appears at least once
    for dtype, d, hq, hkv, tree, inline in [("bfloat16", 128, 32, 8, False, False),
                                            ("float32", 64, 6, 2, True, False),
                                            ("float16", 64, 8, 2, False, True),
                                            ("bfloat16", 256, 4, 4, False, False)]:
        print(f"{dtype} D={d} Hq={hq} Hkv={hkv} tree={tree} inline_rope={inline}")
        cfg = cc.config(hq=hq, hkv=hkv, d=d, ps=16, dtype=dtype)
        ref, mine = cc.pair(cfg, "triton")
        spec = rope if inline else None
        entries = [Entry(1, 40, tree=5 if tree else 0), Entry(1, 70)]
        case = cc.paged_case(rng, ref, mine, entries, use_decode=True)
        for splits in (1, 2):
            mine.tuning = mine.tuning.with_(force_splits=splits)
            mine.paged_attention(case.q, case.pages, case.depth, 0.1, rope=spec,
                                 q_positions=case.q_positions)
        case.depth = dataclasses.replace(case.depth, use_decode=False)
        mine.paged_attention(case.q, case.pages, case.depth, 0.1, rope=spec,
                             q_positions=case.q_positions)
        mine.tuning = mine.tuning.with_(warp_uniform_scalars=True)
        mine.paged_attention(case.q, case.pages, case.depth, 0.1, rope=spec,
                             q_positions=case.q_positions)
        mine.tuning = mine.tuning.with_(warp_uniform_scalars=False)
        c = cc.ragged_case(rng, ref, mine, [5, 9], tree=tree)
        t = cc.TreeMask(cc.ints(mine, c["tree"][0]), cc.ints(mine, c["tree"][1])) if tree else None
        mine.ragged_attention(c["q"], c["k"], c["v"], cc.ints(mine, c["qo"]), 0.1, num_seqs=2,
                              max_len=9, tree=t, rope=spec, q_positions=cc.ints(mine, c["qpos"]),
                              k_rope_offset=cc.ints(mine, c["krope"]))
        if d == 128 or dtype == "float32":
            slots = cc.ints(mine, np.arange(14))
            mine.rope(c["q"], slots, rope)
            mine.append_kv(case.pages, c["k"], c["v"], slots)
            mine.append_kv(case.pages, c["k"], c["v"], slots, slots, rope)
            mine.rope_append(case.pages, c["q"], c["k"], c["v"], slots, slots, rope)
            o, lse = mine.ragged_attention(c["q"], c["k"], c["v"], cc.ints(mine, c["qo"]), 0.1,
                                           num_seqs=2, max_len=9)
            mine.merge_attention(o, lse, o, lse)
            mine.copy_page_prefix([case.pages], 0, 1, 5)
            mine.compact_kv([case.pages], slots[:3], slots[3:6])
            mine.gather_kv([case.pages], slots)
    fp8_matrix(rope, rng)


def fp8_matrix(rope, rng):
    """fp8 e4m3 pages (QUANT kernels): decode (one split and several), prefill, ragged, the
    stores, gather and compaction, plain and with inline RoPE, bfloat16 and float16."""
    import cuda_cases as cc
    from cuda_cases import Entry
    for dtype, inline in [("bfloat16", False), ("float16", True)]:
        print(f"{dtype} fp8 pages D=128 Hq=32 Hkv=8 inline_rope={inline}")
        cfg = cc.config(hq=32, hkv=8, d=128, ps=16, dtype=dtype, kv_dtype="float8_e4m3")
        ref, mine = cc.pair(cfg, "triton")
        spec = rope if inline else None
        scale = mine.from_numpy(np.full((2, 8), 0.01, np.float32), "float32")
        pages = mine.allocate_pages(12)[0]
        case = cc.paged_case(rng, ref, mine, [Entry(1, 40, tree=5), Entry(1, 70)], use_decode=True)
        for splits in (1, 2):
            mine.tuning = mine.tuning.with_(force_splits=splits)
            mine.paged_attention(case.q, pages, case.depth, 0.1, rope=spec,
                                 q_positions=case.q_positions, kv_scale=scale)
        case.depth = dataclasses.replace(case.depth, use_decode=False)
        mine.paged_attention(case.q, pages, case.depth, 0.1, rope=spec,
                             q_positions=case.q_positions, kv_scale=scale)
        c = cc.ragged_case(rng, ref, mine, [5, 9])
        mine.ragged_attention(c["q"], c["k"], c["v"], cc.ints(mine, c["qo"]), 0.1, num_seqs=2,
                              max_len=9, rope=spec, q_positions=cc.ints(mine, c["qpos"]),
                              k_rope_offset=cc.ints(mine, c["krope"]), kv_scale=scale)
        slots = cc.ints(mine, np.arange(14))
        mine.append_kv(pages, c["k"], c["v"], slots, kv_scale=scale)
        mine.rope_append(pages, c["q"], c["k"], c["v"], slots, slots, rope, kv_scale=scale)
        mine.compact_kv([pages], slots[:3], slots[3:6])
        mine.gather_kv([pages], slots, kv_scale=[scale])


def uniform_only():
    """The paged prefill kernel with ``warp_uniform_scalars`` (inline PTX the interpreter
    cannot run), small: bfloat16, D 64, a plain and a sliding-window entry."""
    import cuda_cases as cc
    from cuda_cases import Entry
    cfg = cc.config(hq=8, hkv=2, d=64, ps=16, dtype="bfloat16")
    _, mine = cc.pair(cfg, "triton")
    mine.tuning = mine.tuning.with_(warp_uniform_scalars=True)
    case = cc.paged_case(np.random.default_rng(0), cc.ReferenceBackend(cfg), mine,
                         [Entry(20, 40), Entry(5, 70, sink=4, gap=21)])
    mine.paged_attention(case.q, case.pages, case.depth, 0.1)


def main():
    args = sys.argv[1:]
    only_uniform = "--uniform" in args
    sms = [int(s) for s in args if s != "--uniform"] or [90]
    JITFunction.run = _compile_only
    total = 0
    for sm in sms:
        print(f"== target sm_{sm}")
        driver.set_active(CompileOnlyDriver(GPUTarget("cuda", sm, 32)))
        COMPILED.clear()
        uniform_only() if only_uniform else matrix()
        total += len(COMPILED)
    print(f"COMPILED {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
