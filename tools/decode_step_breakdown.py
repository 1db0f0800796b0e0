"""Where one decode step of the serving bench's (a) goes on the GPU, and what the decode kernel's
tiles and split factor do at that step's shape.

    python tools/decode_step_breakdown.py [--batch 64] [--prompt 576] [--layers 8] [--sweep]
        [--rope model|cache] [--compile-step] [--deterministic]

Part 1: the ``Engine`` (graphs on) generates ``--batch`` prompts of ``--prompt`` tokens to 8 and
to 40 new tokens under torch.profiler; per kernel name, (time in the longer run - time in the
shorter) / 32 is that kernel's share of one decode step. Kernels are grouped (GEMM, attention,
the rest) and the GEMMs' achieved rate is the weight bytes over their time.

Part 2 (``--sweep``): the decode kernel alone at (batch, prompt + 24 keys), B=64 Hq32/Hkv8/D128
bf16, for each tile table and split factor (graph replay, L2 flushed, median).
"""

from __future__ import annotations

import argparse
import collections

import numpy as np
import torch

from kvcache.bench.serving import build_model
from kvcache.integrations.transformers import Engine


def category(name: str) -> str:
    n = name.lower()
    if "_matmul_kernel" in n or "_sum_chunks" in n:
        return "GEMM (invariant Triton)"
    if "_row_" in n:
        return "row reductions (invariant Triton)"
    if "paged_decode" in n or "rope_append" in n or "_ragged" in n or "paged_prefill" in n:
        return "kvcache attention"
    if any(t in n for t in ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "cublas", "splitk")):
        return "GEMM (cuBLAS)"
    if "memcpy" in n or "memset" in n:
        return "copies/memsets"
    return "other (model elementwise, norms, sampling)"


def kernel_times(prof) -> dict:
    out = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            out[e.name] += e.time_range.end - e.time_range.start
    return out


def breakdown(a) -> None:
    from torch.profiler import ProfilerActivity, profile
    if a.compile_mode:
        from kvcache.integrations.transformers import adapter
        adapter.COMPILE_MODE = a.compile_mode
    net = build_model("llama", a.layers, False, "cuda", "bfloat16", 0)
    eng = Engine(net, backend="cuda", device="cuda", max_batch_size=a.batch,
                 max_total_tokens=a.batch * (a.prompt + 72), rope=a.rope,
                 compile_step=a.compile_step, deterministic=a.deterministic)
    eng.progress = False
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, net.config.vocab_size, a.prompt).tolist() for _ in range(a.batch)]
    eng.generate(prompts, max_new_tokens=8)
    runs = {}
    for n in (8, 40):
        eng.generate(prompts, max_new_tokens=n)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            eng.generate(prompts, max_new_tokens=n)
            torch.cuda.synchronize()
        runs[n] = kernel_times(p)
    steps = 32
    st = eng.stats
    print(f"# engine: {st.forwards} forwards, {st.graph_forwards} replayed from graphs, "
          f"{st.graph_fallback_forwards} fell back to eager, {st.graph_captures} captures")
    per = {k: (runs[40][k] - runs[8].get(k, 0)) / steps for k in runs[40]}
    total = sum(per.values())
    cats = collections.Counter()
    for k, us in per.items():
        cats[category(k)] += us
    weights = sum(p.numel() * p.element_size() for n_, p in net.named_parameters()
                  if "embed_tokens" not in n_)
    if net.config.tie_word_embeddings:
        weights += net.model.embed_tokens.weight.numel() * 2
    print(f"# one decode step, B={a.batch}, prompt {a.prompt}, {a.layers} layers, graphs "
          f"{eng.graphs}, rope={a.rope}: GPU kernel time {total:.1f} us")
    for c, us in cats.most_common():
        print(f"  {c:<45} {us:9.1f} us  {100 * us / total:5.1f}%")
    g = cats["GEMM (cuBLAS)"] + cats["GEMM (invariant Triton)"]
    print(f"  GEMM weight bytes {weights / 1e9:.3f} GB -> {weights / (g * 1e-6) / 1e12:.2f} TB/s")
    print("# top kernels per step (us, count per step)")
    counts = collections.Counter()
    for k in per:
        counts[k] = per[k]
    for k, us in counts.most_common(30):
        print(f"  {us:8.1f}  {k[:110]}")
    # reference: the same GEMMs alone (no model around them), weights of one layer x 8
    h, kv, inter = net.config.hidden_size, net.config.num_key_value_heads * 128, net.config.intermediate_size
    x = torch.randn(a.batch, h, device="cuda", dtype=torch.bfloat16)
    xi = torch.randn(a.batch, inter, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(o, i, device="cuda", dtype=torch.bfloat16) for o, i in
          ((h + 2 * kv, h), (h, h), (2 * inter, h), (h, inter))]
    lm = torch.randn(net.config.vocab_size, h, device="cuda", dtype=torch.bfloat16)
    from kvcache_cuda.bench_kit import Timer
    timer = Timer(torch, torch.device("cuda"), 20, 0)      # L2 flushed before each timed call

    def timed(fn, iters=20):
        timer.iters = iters
        return timer._median(fn)

    for w in ws + [lm]:
        inp = xi if w.shape[1] == inter else x
        us = timed(lambda: torch.nn.functional.linear(inp, w))
        print(f"  bare linear M={a.batch} {tuple(w.shape)}: {us:7.1f} us, "
              f"{w.numel() * 2 / (us * 1e-6) / 1e12:.2f} TB/s")
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src), 10)
    print(f"  d2d copy 1 GiB: {2 * (1 << 30) / (us * 1e-6) / 1e12:.2f} TB/s (read+write)")


def sweep(a) -> None:
    from kvcache_cuda import bench as B
    from kvcache_cuda.backend import CudaBackend
    from kvcache_cuda.tuning import AttnTiles
    dev = torch.device("cuda")
    be = B.bench_backend(CudaBackend, "bfloat16", "cuda")
    timer = B.Timer(torch, dev, 30, 5)
    rng = np.random.default_rng(0)
    base = be.tuning
    for L in (a.prompt + 24, 4096):
        pages, depth, q = B.paged_setup(torch, be, a.batch, L, 1, rng, dev)
        nbytes = pages.numel() * 2
        res = []
        for t in [base.tiles("decode", 128)] + [AttnTiles(*t) for t in B.DECODE_TILES]:
            for s in (1, 2, 3, 4):
                table = dict(base.by_head_dim)
                table[128] = dict(table.get(128, {}), decode=t)
                be.tuning = base.with_(by_head_dim=table, force_splits=s)
                try:
                    us, _ = timer.measure(lambda: be.paged_attention(q, pages, depth, B.D ** -0.5))
                except Exception as exc:
                    print(f"  {t} splits={s}: failed {type(exc).__name__}")
                    continue
                res.append((us, t, s))
        be.tuning = base
        res.sort(key=lambda r: r[0])
        cur = [r for r in res if r[1] == base.tiles("decode", 128) and r[2] == 1]
        print(f"# decode B={a.batch} L={L}: KV {nbytes / 1e6:.0f} MB; current tiles, 1 split: "
              f"{cur[0][0] if cur else float('nan'):.1f} us")
        for us, t, s in res[:8]:
            print(f"  {us:7.1f} us  {t}  splits={s}  {nbytes / (us * 1e-6) / 1e12:.2f} TB/s")
        del pages
        torch.cuda.empty_cache()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=576)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--rope", default="model", choices=("model", "cache"))
    p.add_argument("--no-breakdown", action="store_true")
    p.add_argument("--compile-step", action="store_true",
                   help="the Engine's compiled decode step (Engine(compile_step=True))")
    p.add_argument("--deterministic", action="store_true",
                   help="Engine(deterministic=True): the batch-invariant kernels")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode of the compiled step (e.g. max-autotune-no-cudagraphs)")
    a = p.parse_args()
    if not a.no_breakdown:
        breakdown(a)
    if a.sweep:
        sweep(a)
