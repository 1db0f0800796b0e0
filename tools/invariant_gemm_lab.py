"""The batch-invariant GEMM (``kvcache.integrations.invariant_triton.matmul``) against torch's
``linear`` (cuBLAS) on the serving bench's Llama-3-8B layer shapes, per row count, for tile
variants; then (``--breakdown``) where a deterministic decode step's GPU time goes.

    python tools/invariant_gemm_lab.py [--rows 1,64,512,2048] [--variants all|current]
        [--breakdown] [--equal] [--wide] [--rounds 3] [--bench VARIANT]

Each variant is a (BLOCK_M, BLOCK_N, BLOCK_K, KSTEPS, warps, stages) row of ``CONFIG`` for
bfloat16 and a split threshold; every variant is itself batch-invariant (fixed for all shapes),
so any may become the table's row. Times: graph-free, L2 flushed, median of 20."""

from __future__ import annotations

import argparse

import torch

from kvcache.integrations import invariant_triton as it

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096),
          "down": (4096, 14336), "lm head": (128256, 4096)}
VARIANTS = {
    "current": None,
    "current, no WIDE tiles": None,         # CONFIG's tiles at every row count (before WIDE)
    "64x128x64 k8 w4 s4 split<264": ((64, 128, 64, 8, 4, 4), 264),
    "64x64x64 k8 w4 s4": ((64, 64, 64, 8, 4, 4), 264),
    "64x128x64 k4 w4 s4": ((64, 128, 64, 4, 4, 4), 264),
    "128x128x64 k8 w8 s3": ((128, 128, 64, 8, 8, 3), 264),
    "64x256x64 k8 w8 s3": ((64, 256, 64, 8, 8, 3), 264),
    "128x64x64 k8 w4 s4": ((128, 64, 64, 8, 4, 4), 264),
    "64x128x64 k8 w4 s4 split<528": ((64, 128, 64, 8, 4, 4), 528),
    "128x256x64 k8 w8 s3": ((128, 256, 64, 8, 8, 3), 264),
    "128x128x64 k8 w4 s3": ((128, 128, 64, 8, 4, 3), 264),
    "64x64x64 k8 w4 s4 split<528": ((64, 64, 64, 8, 4, 4), 528),
    # 1,024-column chunks: half the split-K partials (other bits than 512's, as invariant)
    "64x128x64 k16 w4 s4": ((64, 128, 64, 16, 4, 4), 264),
    "64x64x64 k16 w4 s4": ((64, 64, 64, 16, 4, 4), 264),
    "64x128x64 k16 w4 s4 split<132": ((64, 128, 64, 16, 4, 4), 132),
    "64x128x64 k8 w4 s4 split<132": ((64, 128, 64, 8, 4, 4), 132),
}


WIDE_VARIANTS = {
    # WIDE's row candidates (prompt chunks): the chunk (64-column steps, 8 a chunk) kept
    "wide 128x128 w8 s3": (128, 128, 64, 8, 8, 3),
    "wide 128x256 w8 s3": (128, 256, 64, 8, 8, 3),
    "wide 256x128 w8 s3": (256, 128, 64, 8, 8, 3),
    "wide 128x128 w4 s4": (128, 128, 64, 8, 4, 4),
    "wide 128x256 w8 s4": (128, 256, 64, 8, 8, 4),
    "wide 128x128 w8 s4": (128, 128, 64, 8, 8, 4),
}


def wide_table(rows: list, rounds: int) -> None:
    """Each ``WIDE_VARIANTS`` row as ``WIDE``'s (forced wide) against torch ``linear``, and
    its bits against ``CONFIG``'s tiles."""
    from kvcache_cuda.bench_kit import Timer
    timer = Timer(torch, torch.device("cuda"), 20, 0)
    timer.iters = 20
    ws = {k: torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) / 64
          for k, (n, kk) in SHAPES.items()}
    xs = {(m, k): torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
          for m in rows for k, w in ws.items()}
    ref = {key: torch.nn.functional.linear(x, ws[key[1]]) for key, x in xs.items()}
    torch_us = {key: timer._median(lambda: torch.nn.functional.linear(x, ws[key[1]]))
                for key, x in xs.items()}
    base = dict(it.WIDE)
    times: dict = {}
    for rnd in range(rounds + 1):
        for name, cfg in WIDE_VARIANTS.items():
            it.WIDE[torch.bfloat16] = cfg
            for key, x in xs.items():
                w = ws[key[1]]
                if rnd == 0:
                    got = it.matmul(x, w.T, wide=True, split=False)
                    same = torch.equal(got, it.matmul(x, w.T, wide=False, split=False))
                    times[name, key] = [same, float((got.float() - ref[key].float()).abs().max())]
                    continue
                times[name, key].append(timer._median(
                    lambda: it.matmul(x, w.T, wide=True, split=False)))
    it.WIDE.clear()
    it.WIDE.update(base)
    print(f"# wide tiles / torch linear (median of {rounds} rounds); 'bits' against CONFIG's")
    for name in WIDE_VARIANTS:
        line, same = [], True
        for key in xs:
            eq, err, *ts = times[name, key]
            same = same and eq
            us = sorted(ts)[len(ts) // 2]
            line.append(f"{key[1]}@{key[0]} {us / torch_us[key]:.2f}")
        print(f"{name:<22} bits {'same' if same else 'DIFFER'} | " + "; ".join(line))


def equal_bits() -> None:
    """Do tile shapes, warps and stages change a bit when BLOCK_K and KSTEPS stay? Each
    variant's product of the same inputs against the first's, split and unsplit."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for (n, k) in ((4096, 4096), (1024, 4096), (4096, 14336), (130, 600)):
        x = torch.randn(300, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) / 64).to(torch.bfloat16)
        b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        base = it.CONFIG[torch.bfloat16]
        want = None
        out = []
        for name, v in VARIANTS.items():
            if v is None or v[0][2:4] != (64, 8):
                continue
            it.CONFIG[torch.bfloat16] = v[0]
            for split in (False, True):
                got = it.matmul(x, w.T, b, split=split)
                if want is None:
                    want = got
                out.append(f"{name}{' split' if split else ''}: "
                           f"{'equal' if torch.equal(got, want) else 'DIFFER'}")
        it.CONFIG[torch.bfloat16] = base
        print(f"# bits, ({n}, {k}) M=300: " + "; ".join(out))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,64,512,2048")
    p.add_argument("--variants", default="all")
    p.add_argument("--breakdown", action="store_true")
    p.add_argument("--equal", action="store_true", help="only the bit comparison of variants")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bench", default=None, metavar="VARIANT",
                   help="then the serving bench's (a) and (d) in this process with that variant "
                        "('best': the lowest summed time at 64 rows)")
    p.add_argument("--wide", action="store_true", help="only the WIDE_VARIANTS table")
    a = p.parse_args()
    if a.wide:
        wide_table([int(r) for r in a.rows.split(",")], a.rounds)
        return
    if a.equal:
        equal_bits()
        return
    from kvcache_cuda.bench_kit import Timer
    timer = Timer(torch, torch.device("cuda"), 20, 0)
    timer.iters = 20
    rows = [int(r) for r in a.rows.split(",")]
    ws = {k: torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) / 64
          for k, (n, kk) in SHAPES.items()}
    base = (it.CONFIG[torch.bfloat16], it._SPLIT_BELOW)
    wide = dict(it.WIDE)
    torch_us = {}
    for m in rows:
        for k, w in ws.items():
            x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
            torch_us[m, k] = timer._median(lambda: torch.nn.functional.linear(x, w))
    names = list(VARIANTS) if a.variants == "all" else a.variants.split(";")
    inputs = {(m, k): torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
              for m in rows for k, w in ws.items()}
    times: dict = {}
    for rnd in range(a.rounds + 1):             # round 0 compiles and warms every variant
        for name in names:
            cfg, below = VARIANTS[name] or base
            it.CONFIG[torch.bfloat16], it._SPLIT_BELOW = cfg, below
            it.WIDE.clear()
            if name == "current":
                it.WIDE.update(wide)
            for (m, k), x in inputs.items():
                w = ws[k]
                if rnd == 0:
                    got = it.matmul(x, w.T)
                    err = (got.float() - torch.nn.functional.linear(x, w).float()).abs().max()
                    times[name, m, k] = [float(err)]
                    continue
                times[name, m, k].append(timer._median(lambda: it.matmul(x, w.T)))
    print(f"# invariant matmul / torch linear (time ratio, median of {a.rounds} interleaved "
          f"rounds; torch us in brackets), bfloat16")
    decode_ratio = {}
    for name in names:
        line, total_t, total_i = [], 0.0, 0.0
        for m in rows:
            for k in ws:
                err, *ts = times[name, m, k]
                us = sorted(ts)[len(ts) // 2]
                line.append(f"{k}@{m} {us / torch_us[m, k]:.2f} ({torch_us[m, k]:.0f})"
                            + (f" ERR {err:.3g}" if err > 0.07 else ""))
                if m == 64:
                    total_t += torch_us[m, k]
                    total_i += us
        decode_ratio[name] = total_i / max(total_t, 1e-9)
        print(f"{name:<32} decode M=64 all shapes {decode_ratio[name]:.2f}x | "
              + "; ".join(line))
    if a.bench:
        if a.bench == "best":               # the lowest summed time at 64 rows
            a.bench = min(decode_ratio, key=decode_ratio.get)
        cfg, below = VARIANTS[a.bench] or base
        it.CONFIG[torch.bfloat16], it._SPLIT_BELOW = cfg, below
        it.WIDE.clear()
        if a.bench == "current":
            it.WIDE.update(wide)
        print(f"# kvcache bench --serving --deterministic with {a.bench}", flush=True)
        from kvcache.cli import main as cli
        cli(["bench", "--serving", "--model", "llama", "--skip", "b,c", "--deterministic"])
    it.CONFIG[torch.bfloat16], it._SPLIT_BELOW = base
    it.WIDE.clear()
    it.WIDE.update(wide)
    if a.breakdown:
        import subprocess
        import sys
        subprocess.run([sys.executable, "tools/decode_step_breakdown.py", "--deterministic",
                        "--rope", "cache"], check=False)


if __name__ == "__main__":
    main()
