"""Issue 55 probe 2: aten._scaled_dot_product_cudnn_attention (what SDPA runs on Hopper) with
the lse, GQA (Hkv 8 < Hq 32) and strided views of (T, H, D) rows, one sequence; timed."""
import torch
import torch.nn.functional as F

from cudnn_probe55 import timed     # tools/ on sys.path: run as python3 tools/cudnn_probe55b.py

HQ, HKV, D = 32, 8, 128
dev, dt = "cuda", torch.bfloat16
print(torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema)


for nq, nk, causal in ((8192, 8192, True), (8192, 8192, False), (512, 8704, False), (2048, 2048, True)):
    q = torch.randn(nq, HQ, D, device=dev, dtype=dt)
    k = torch.randn(nk, HKV, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))      # (1, H, T, D) views
    want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=True)
    s = (q.float().transpose(0, 1) @ k.float().repeat_interleave(4, 1).permute(1, 2, 0)) * D ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(nq, nk, device=dev, dtype=torch.bool).triu(1), float("-inf"))
    lse_want = torch.logsumexp(s, -1)       # (H, nq)
    for name, kk, vv in (("gqa", ks, vs), ("repeated", ks.repeat_interleave(4, 1), vs.repeat_interleave(4, 1))):
        try:
            fn = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
                qs, kk, vv, None, True, 0.0, causal, False, scale=D ** -0.5)
            out = fn()
            lse = out[1]
            err = (out[0].float() - want.float()).abs().max().item()
            lerr = (lse.reshape(HQ, nq).float() - lse_want).abs().max().item()
            print(f"nq={nq} nk={nk} causal={causal} {name}: {timed(fn):8.1f} us, o diff {err:.3g}, "
                  f"lse {tuple(lse.shape)} {lse.stride()} diff {lerr:.3g}; sdpa {timed(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=True)):8.1f} us", flush=True)
        except Exception as exc:
            print(f"nq={nq} nk={nk} {name}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
