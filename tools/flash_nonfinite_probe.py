"""Issue 55 probe: which NaN / inf inputs cuDNN's attention (``flash.aten_attend`` on several
sequences of one shape) already turns into a non-finite row the way our kernels do, and so which
of the library path's checks (``flag_nonfinite`` over q and k, the finite-V copy) a call could
drop; then what each check costs at the bench's B=8 L=2048 prefill.

Part 1: for q, k and v, a NaN / +inf / -inf planted at a sequence's first, middle and last row
(one head, one channel); the library's raw result (no checks) against the Triton kernels' (the
backend with the library off): per (row, head), "non-finite" = o or lse not finite. A mismatch
is a row one of them marks and the other does not, or a finite row whose values differ by more
than bf16 rounding. Part 2: ``kvcache_cuda.bench --only prefill`` as shipped, then with the q
check skipped (a stand-in for a path that drops it): the time it would save.

python3 tools/flash_nonfinite_probe.py [--skip-bench]
"""
import sys

import torch

from kvcache_cuda import flash
from kvcache_cuda.backend import CudaBackend
from kvcache_cuda.bench_kit import HKV, HQ, D, bench_backend

N, L = 4, 256


def rows_bad(o, lse):
    """(T, Hq) bool: a row's output or lse is not finite."""
    return ~torch.isfinite(o.float()).all(-1) | ~torch.isfinite(lse.float())


def main():
    torch.manual_seed(0)
    dev = "cuda"
    ours = bench_backend(CudaBackend, "bfloat16", dev)
    ours.flash = None                                   # the Triton kernels only
    scale = D ** -0.5
    qo = torch.arange(0, N * L + 1, L, device=dev, dtype=torch.int32)
    base = [torch.randn((N * L, h, D), device=dev).to(torch.bfloat16) for h in (HQ, HKV, HKV)]
    print(f"# part 1: NaN / inf planted, {N} sequences x {L} rows, Hq {HQ} Hkv {HKV} D {D}")
    total_mismatch = {}
    for which, t in (("q", 0), ("k", 1), ("v", 2)):
        for val in (float("nan"), float("inf"), float("-inf")):
            for where, row in (("first", L), ("middle", L + L // 2), ("last", 2 * L - 1)):
                x = [b.clone() for b in base]
                x[t][row, 1, 3] = val
                o_l, lse_l = flash.aten_attend(x[0], x[1], x[2], qo, qo, L, L, True, scale, -1,
                                               uniform=True)
                lse_l = lse_l.t()
                o_t, lse_t = ours.ragged_attention(x[0], x[1], x[2], qo, scale, num_seqs=N,
                                                   max_len=L)
                bl, bt = rows_bad(o_l, lse_l), rows_bad(o_t, lse_t)
                differ = (bl != bt)
                both_ok = ~bl & ~bt
                diff = (o_l.float() - o_t.float()).abs().amax(-1)
                err = torch.where(both_ok, diff, torch.zeros_like(diff)).amax().item()
                key = f"{which} {val}"
                total_mismatch[key] = total_mismatch.get(key, 0) + int(differ.sum())
                print(f"{which} {str(val):>5} at {where:<6} row: library marks {int(bl.sum()):5d}, "
                      f"ours {int(bt.sum()):5d}, differ {int(differ.sum()):5d}; "
                      f"max |o| diff on rows both finite {err:.3g}", flush=True)
    print("# part 1 summary (rows marked differently, summed over positions):")
    for key, n in total_mismatch.items():
        print(f"  {key:<10} {n}")
    if "--skip-bench" in sys.argv:
        return
    from kvcache_cuda import bench
    print("\n# part 2: the prefill bench as shipped")
    bench.run_benchmarks(["--only", "prefill"])
    real = flash.flag_nonfinite

    def skip_q(x, f):
        if x.shape[1] != HQ:
            real(x, f)
    flash.flag_nonfinite = skip_q
    print("\n# part 2: the prefill bench with the q check skipped")
    bench.run_benchmarks(["--only", "prefill"])
    flash.flag_nonfinite = real


if __name__ == "__main__":
    main()
