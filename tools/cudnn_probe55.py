"""Issue 55 probe: torch's library attention kernels on the bench's prefill shapes (Hq 32, Hkv 8,
D 128, bf16): SDPA as dispatched, SDPA forced to cuDNN / flash, varlen FlashAttention-2 and
varlen cuDNN (aten ops), each checked against SDPA's output and timed (CUDA events, median
of 20, L2 not flushed: same for all)."""
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 32, 8, 128
dev, dt = "cuda", torch.bfloat16


def timed(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def main():
    for batch, n, causal in ((1, 8192, True), (8, 2048, True), (1, 8192, False), (8, 2048, False)):
        q = torch.randn(batch * n, HQ, D, device=dev, dtype=dt)
        k = torch.randn(batch * n, HKV, D, device=dev, dtype=dt)
        v = torch.randn_like(k)
        cu = torch.arange(0, batch * n + 1, n, device=dev, dtype=torch.int32)
        qs = q.view(batch, n, HQ, D).transpose(1, 2)
        ks = k.view(batch, n, HKV, D).transpose(1, 2)
        vs = v.view(batch, n, HKV, D).transpose(1, 2)
        want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=True)
        want = want.transpose(1, 2).reshape(batch * n, HQ, D)
        rows = {}
        rows["sdpa"] = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=True)
        for name, be in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                         ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def f(be=be):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=True)
            rows[name] = f
        rows["fa2-varlen"] = lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, n, n, 0.0, causal, False, scale=D ** -0.5)[0]
        rows["cudnn-varlen"] = lambda: torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, n, n, True, 0.0, causal, False, scale=D ** -0.5)[0]
        kr = k.repeat_interleave(HQ // HKV, 1)
        vr = v.repeat_interleave(HQ // HKV, 1)
        rows["cudnn-varlen-rep"] = lambda: torch.ops.aten._cudnn_attention_forward(
            q, kr, vr, None, cu, cu, n, n, True, 0.0, causal, False, scale=D ** -0.5)[0]
        print(f"B={batch} L={n} causal={causal}")
        for name, fn in rows.items():
            try:
                out = fn()
                if out.dim() == 4:
                    out = out.transpose(1, 2).reshape(batch * n, HQ, D)
                err = (out.float() - want.float()).abs().max().item()
                print(f"  {name:<18} {timed(fn):9.1f} us  max|diff| {err:.3g}", flush=True)
            except Exception as exc:
                print(f"  {name:<18} failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        out = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, n, n, True, 0.0, causal,
                                                      False, scale=D ** -0.5) if True else None
        try:
            print("  cudnn lse shape", tuple(out[1].shape), "fa2 lse shape",
                  tuple(torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, n, n, 0.0, causal, False)[1].shape))
        except Exception as exc:
            print("  lse shapes:", exc)


if __name__ == "__main__":
    main()
