"""Issue 55: where a several-sequence prefill through cuDNN spends its time beyond the library
call: torch.profiler's CUDA kernels of 10 calls of the flash path (paged and ragged, B=8 L=2048,
the bench's shapes), next to SDPA on contiguous head-major K/V, as the bench times it."""
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from kvcache_cuda.bench_kit import HKV, D, bench_backend, paged_setup, prefill_path, sdpa


def show(name, fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    print(f"== {name} (us per call)")
    rows = sorted(((e.key, e.device_time_total / 10, e.count // 10) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    for key, us, n in rows[:8]:
        print(f"  {us:9.1f}  x{n}  {key[:110]}")
    print(f"  {sum(r[1] for r in rows):9.1f}  total")


def main():
    from kvcache_cuda.backend import CudaBackend
    backend = bench_backend(CudaBackend, "bfloat16", "cuda")
    rng = np.random.default_rng(0)
    batch, n = 8, 2048
    pages, depth, q = paged_setup(torch, backend, batch, n, n, rng, "cuda")
    k = torch.randn((batch * n, HKV, D), device="cuda").to(backend.dtype)
    v = torch.randn_like(k)
    qo = torch.arange(0, batch * n + 1, n, device="cuda", dtype=torch.int32)
    qs = q.view(batch, n, -1, D).transpose(1, 2)
    kc = torch.randn((batch, HKV, n, D), device="cuda", dtype=backend.dtype)
    vc = torch.randn_like(kc)
    with prefill_path(backend, "flash"):
        show("paged, flash path", lambda: backend.paged_attention(q, pages, depth, D ** -0.5))
        show("ragged, flash path", lambda: backend.ragged_attention(
            q, k, v, qo, D ** -0.5, num_seqs=batch, max_len=n))
    show("sdpa non-causal (the paged row's peer)", lambda: sdpa(torch, qs, kc, vc))
    show("sdpa causal (the ragged row's peer)", lambda: sdpa(torch, qs, kc, vc, causal=True))
    ks, vs = k.view(batch, n, HKV, D).transpose(1, 2), v.view(batch, n, HKV, D).transpose(1, 2)
    show("sdpa causal over token-major K/V views", lambda: sdpa(torch, qs, ks, vs, causal=True))


if __name__ == "__main__":
    main()
