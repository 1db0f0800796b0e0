"""Registers and spills of the prefill kernels per tile, for sm_90, without a GPU.

Compiles the shipped paged prefill and ragged kernels (bfloat16, Hq 32, Hkv 8, D 128, page 16:
the kernel bench's shape) the way tests/cuda/triton_compile_check.py does (a compile-only
driver reporting an sm_90 target), then runs Triton's bundled ptxas with ``-v`` on each PTX and
prints its register count, spill stores and the kernel's shared memory. A kernel at 255
registers with spill stores loses time in its loop (issue 33: the edge loop and the epilogue's
row vectors held registers through the key loops).

    python tools/kernel_regs.py [--uniform] [R,N,W,S ...]
        (tiles: rows, keys, warps, stages; default: the shipped table, then 128,64,4,3;
        --uniform: the paged prefill kernel again with ``warp_uniform_scalars`` flipped from
        the table's: the shipped sm_90 entry has it on, so this adds the build without it)

Beside them, each key loop's size in SASS instructions (cuobjdump on the cubin: a loop is a
backward branch's span; the span counts code its forward branches may skip). A loop longer than
the stripped loop's 710 at (128, 128, 8, 3) spends the difference every key tile.
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["KVCACHE_CUDA_CPU"] = "1"
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "cuda"))

import numpy as np  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import triton_compile_check as tcc  # noqa: E402

KERNELS = ("_paged_prefill_kernel", "_ragged_kernel")
COMPILED = []
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    if self.fn.__name__ in KERNELS:
        name = self.fn.__name__ + (" (uniform)" if kwargs.get("UNIFORM") else "")
        COMPILED.append((name, tuple(kwargs.get(k) for k in (
            "BLOCK_R", "BLOCK_N", "num_warps", "num_stages")), kernel))
    return kernel


def _bundled(tool: str, data: bytes, suffix: str, before: list, after: list = ()):
    """Triton's bundled NVIDIA ``tool`` run on ``data`` written to a temporary ``suffix`` file
    (its path between the ``before`` and ``after`` arguments); the finished process."""
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    with tempfile.NamedTemporaryFile("wb", suffix=suffix, delete=False) as fh:
        fh.write(data)
    try:
        return subprocess.run([str(path), *before, fh.name, *after], capture_output=True,
                              text=True, check=True)
    finally:
        os.unlink(fh.name)


def loop_sizes(cubin: bytes) -> list:
    """SASS instructions in each loop of ``cubin`` (a backward branch to its target), in order."""
    sass = _bundled("cuobjdump", cubin, ".cubin", ["-sass"]).stdout
    code = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in code:
        m = re.search(r"BRA\s.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            loops.append(sum(1 for a, _ in code if start <= a <= addr))
    return loops


def ptxas_report(ptx: str) -> tuple:
    """(registers, spill store bytes) that ptxas -v reports for ``ptx`` on sm_90a."""
    out = _bundled("ptxas", ptx.encode(), ".ptx", ["-arch=sm_90a", "-v"],
                   ["-o", os.devnull]).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else 0


def main() -> int:
    import cuda_cases as cc
    from cuda_cases import Entry
    from kvcache_cuda.tuning import AttnTiles, for_arch, read_table
    JITFunction.run = _compile_only
    driver.set_active(tcc.CompileOnlyDriver(GPUTarget("cuda", 90, 32)))
    cfg = cc.config(hq=32, hkv=8, d=128, ps=16, dtype="bfloat16")
    ref, mine = cc.pair(cfg, "triton")
    rng = np.random.default_rng(0)
    case = cc.paged_case(rng, ref, mine, [Entry(256, 512), Entry(256, 512)])
    ragged = cc.ragged_case(rng, ref, mine, [300, 200])
    shipped = for_arch(mine.tuning, "sm_90", read_table())
    args = [a for a in sys.argv[1:] if a != "--uniform"]
    candidates = [None] + [tuple(int(x) for x in t.split(",")) for t in args] \
        if args else [None, (128, 64, 4, 3)]
    for tiles in candidates:
        if tiles is None:
            mine.tuning = shipped
        else:
            table = dict(shipped.by_head_dim)
            table[128] = dict(table.get(128, {}), prefill=AttnTiles(*tiles),
                              ragged=AttnTiles(*tiles))
            mine.tuning = shipped.with_(by_head_dim=table)
        mine.paged_attention(case.q, case.pages, case.depth, 0.1)
        if "--uniform" in sys.argv:
            tuned, mine.tuning = mine.tuning, mine.tuning.with_(
                warp_uniform_scalars=not mine.tuning.warp_uniform_scalars)
            mine.paged_attention(case.q, case.pages, case.depth, 0.1)
            mine.tuning = tuned
        mine.ragged_attention(ragged["q"], ragged["k"], ragged["v"], cc.ints(mine, ragged["qo"]),
                              0.1, num_seqs=2, max_len=300)
    print(f"{'kernel':34} {'tiles (rows, keys, warps, stages)':34} {'registers':>9} "
          f"{'spill stores':>12} {'shared memory':>13}  loops (SASS instructions)")
    for name, tiles, kernel in COMPILED:
        regs, spills = ptxas_report(kernel.asm["ptx"])
        loops = ", ".join(map(str, loop_sizes(kernel.asm["cubin"])))
        print(f"{name:34} {str(tiles):34} {regs:>9} {spills:>10} B {kernel.metadata.shared:>11} B"
              f"  {loops}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
