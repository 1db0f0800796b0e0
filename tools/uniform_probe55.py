"""Issue 55 probe: prefill of several sequences of one shape (``DepthAux.uniform`` / ragged rows
``num_seqs * max_len``) through cuDNN's batched attention on views of the rows, against our
Triton kernels, over a sweep of (sequences, length), paged (n queries over n paged keys, as the
bench's rows) and ragged (causal); each flash result checked against Triton's. The bench's Timer
(L2 flushed, median of graph replays). Prints one line per case: Triton us, flash us, ratio."""
import sys

import numpy as np
import torch

from kvcache_cuda.bench_kit import (HKV, HQ, D, Timer, bench_backend, paged_setup,
                                    prefill_path)


def main():
    from kvcache_cuda.backend import CudaBackend
    backend = bench_backend(CudaBackend, "bfloat16", "cuda")
    timer = Timer(torch, "cuda", 20, 3)
    rng = np.random.default_rng(0)
    scale = D ** -0.5
    cases = [(2, 4096), (4, 2048), (8, 2048), (16, 1024), (8, 512), (32, 256), (64, 128),
             (64, 64), (128, 32), (256, 16), (16, 128), (4, 256)]
    if len(sys.argv) > 1:
        cases = [tuple(int(x) for x in c.split("x")) for c in sys.argv[1:]]
    print(f"{'kind':7} {'B':>4} {'L':>5} {'triton us':>10} {'flash us':>10} {'ratio':>6} max|diff|")
    for batch, n in cases:
        pages, depth, q = paged_setup(torch, backend, batch, n, n, rng, "cuda")
        assert depth.uniform
        k = torch.randn((batch * n, HKV, D), device="cuda").to(backend.dtype)
        v = torch.randn_like(k)
        qo = torch.arange(0, batch * n + 1, n, device="cuda", dtype=torch.int32)
        for kind, fn in (("paged", lambda: backend.paged_attention(q, pages, depth, scale)),
                         ("ragged", lambda: backend.ragged_attention(
                             q, k, v, qo, scale, num_seqs=batch, max_len=n))):
            out = {}
            for path in ("triton", "flash"):
                with prefill_path(backend, path) as p:
                    calls = backend.flash.calls if backend.flash is not None else 0
                    o = fn()[0].float()
                    used = backend.flash is not None and backend.flash.calls > calls
                    assert used == (path == "flash"), (path, used)
                    out[path] = (timer.measure(fn)[0], o)
            diff = (out["triton"][1] - out["flash"][1]).abs().max().item()
            t, f = out["triton"][0], out["flash"][0]
            print(f"{kind:7} {batch:>4} {n:>5} {t:>10.1f} {f:>10.1f} {f / t:>6.2f} {diff:.3g}",
                  flush=True)
        del pages, k, v, q
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
