"""What the cuda backend's kernel benchmarks measure with, shared with the tuner (``tune.py``)
and the tools' sweeps: the head shape (``HQ``, ``HKV``, ``D``, page ``PS``), ``Timer`` (the
median of graph replays and of eager calls, L2 flushed before each), ``copy_bandwidth`` (what
the floor divides by), a bare backend at that shape (``bench_backend``), its pages with one
``DepthAux`` (``paged_setup``), and the contiguous SDPA the kernels are held against (``sdpa``)."""

from __future__ import annotations

import statistics

import numpy as np

HQ, HKV, D, PS = 32, 8, 128, 16
FLUSH_BYTES = 256 << 20          # > L2 of any current GPU (H100: 50 MB)
COPY_BYTES = 1 << 30


class Timer:
    def __init__(self, torch, device, iters, warmup):
        self.torch, self.device, self.iters, self.warmup = torch, device, iters, warmup
        self.flush_buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)

    def _median(self, run):
        torch = self.torch
        times = []
        for _ in range(self.iters):
            self.flush_buf.zero_()                         # evict L2 (not timed)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    def measure(self, fn):
        """(graph-replay median us, eager median us) of ``fn``."""
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        eager = self._median(fn)
        graph_us = float("nan")
        try:
            from .graph_core import record_graph, warm_up
            warm_up(fn, self.device, 1)                    # warm the allocator on a side stream
            g, _ = record_graph(fn, self.device)
            for _ in range(self.warmup):
                g.replay()
            graph_us = self._median(g.replay)
        except Exception as exc:  # capture can fail for reasons outside the kernel (report it)
            print(f"    (graph capture failed: {type(exc).__name__}: {exc}; eager time only)")
        return graph_us, eager


def copy_bandwidth(torch, timer, device):
    """Device-to-device copy bandwidth in bytes/s (read + write), COPY_BYTES buffers."""
    n = COPY_BYTES
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    us, _ = timer.measure(lambda: dst.copy_(src))
    del src, dst
    return 2 * n / (us * 1e-6)


def bench_backend(backend_cls, dtype: str, device: str, kv_dtype: str = "auto"):
    """A bare backend at the benchmarks' head shape (Hq/Hkv/D/page of this module), its pages
    made by ``paged_setup``: the kernels' benchmarks and the tools' sweeps use it."""
    import kvcache
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                              page_size=PS, dtype=dtype, max_total_tokens=PS,
                              rope_mode="normal", max_batch_size=256, kv_dtype=kv_dtype)
    return backend_cls(cfg, device)


def paged_setup(torch, backend, batch, kv_len, nq, rng, device):
    """Pages in a random permutation and one DepthAux with ``batch`` entries of ``kv_len`` keys
    and ``nq`` queries each."""
    from kvcache.backend import DepthAux
    pages_per = -(-kv_len // PS)
    total = batch * pages_per
    pages = torch.randn((total + 1, 2, HKV, PS, D), device=device).to(backend.dtype)
    perm = torch.from_numpy(rng.permutation(total + 1)[:total].astype(np.int32)).to(device)
    i32 = lambda a: torch.as_tensor(np.asarray(a, np.int32), device=device)
    ar = np.arange(batch + 1)
    depth = DepthAux(
        qo_indptr=i32(ar * nq), page_indptr=i32(ar * pages_per), page_indices=perm,
        last_page_len=i32(np.full(batch, (kv_len - 1) % PS + 1)), kv_len=i32(np.full(batch, kv_len)),
        sink_size=i32(np.zeros(batch)), window_offset=i32(np.zeros(batch)),
        k_rope_offset=i32(np.zeros(batch)), num_entries=batch, use_decode=nq == 1,
        max_kv_len=kv_len, max_qo_len=nq, covers_rows=True, uniform=nq > 1 and kv_len > 0)
    q = torch.randn((batch * nq, HQ, D), device=device).to(backend.dtype)
    return pages, depth, q


class prefill_path:
    """``with prefill_path(backend, "triton" | "flash" | "auto"):`` the backend's prefill calls
    run the Triton kernels, torch's attention kernels wherever they can compute them
    (``kvcache_cuda.flash``), or the dispatch of its tuning table; ``ok`` is False where the
    library is not there ("flash" asked)."""

    def __init__(self, backend, path: str):
        self.backend, self.path, self.saved = backend, path, backend.flash
        self.ok = path != "flash" or backend.flash is not None

    def __enter__(self):
        from .flash import FlashPrefill
        if self.path == "triton":
            self.backend.flash = None
        elif self.path == "flash" and self.ok:
            self.backend.flash = FlashPrefill(force="on")
        return self

    def __exit__(self, *exc):
        self.backend.flash = self.saved


def sdpa(torch, q, k, v, causal=False):
    """Contiguous-KV SDPA (flash where available); q (B, Hq, n, D), k/v (B, Hkv, L, D)."""
    F = torch.nn.functional
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except Exception:
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                              v.repeat_interleave(g, 1), is_causal=causal)
