"""Issue 55 probe: soft-capped prefill in the kernels torch ships. cuDNN's attention (what SDPA
runs on Hopper) has no soft-cap; FlexAttention (``torch.nn.attention.flex_attention``, compiled
by Inductor into a Triton kernel) takes it as a ``score_mod``. On the bench's prefill shapes
(Hq 32, Hkv 8, D 128, bf16, contiguous head-major K/V): SDPA plain, Flex plain and Flex with a
soft-cap of 30, each checked against a float32 reference on the first 256 queries and timed
(CUDA events, median of 20, warm L2: the same for all), beside what our backend's own calls
take (``python3 -m kvcache_cuda.bench --only features`` after it, same machine).

python3 tools/flex_softcap_probe.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from cudnn_probe55 import timed     # tools/ on sys.path: run as python3 tools/flex_softcap_probe.py

HQ, HKV, D, CAP = 32, 8, 128, 30.0
dev, dt = "cuda", torch.bfloat16


def reference(q, k, v, causal, cap):
    """float32 attention of the first 256 queries (soft-capped where ``cap``)."""
    n = 256
    qs = q[:, :, :n].float()
    ks = k.float().repeat_interleave(HQ // HKV, 1)
    vs = v.float().repeat_interleave(HQ // HKV, 1)
    s = qs @ ks.transpose(-1, -2) * D ** -0.5
    if cap:
        s = cap * torch.tanh(s / cap)
    if causal:
        keys = torch.arange(k.shape[2], device=dev)
        s = s.masked_fill(keys[None, :] > torch.arange(n, device=dev)[:, None], float("-inf"))
    return torch.softmax(s, -1) @ vs


def main():
    flex = torch.compile(flex_attention, dynamic=False)

    def softcap(score, b, h, qi, ki):
        return CAP * torch.tanh(score / CAP)

    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; soft-cap {CAP}")
    print(f"{'case':<22} {'sdpa us':>9} {'flex us':>9} {'flex+cap us':>12} {'cap/sdpa':>9} "
          f"{'cap/flex':>9} {'err flex':>9} {'err cap':>9}")
    for batch, n, causal in ((1, 8192, True), (8, 2048, True), (1, 8192, False),
                             (8, 2048, False)):
        torch.manual_seed(0)
        q = torch.randn(batch, HQ, n, D, device=dev, dtype=dt)
        k = torch.randn(batch, HKV, n, D, device=dev, dtype=dt)
        v = torch.randn_like(k)
        mask = (create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, device=dev)
                if causal else None)
        sdpa = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            enable_gqa=True))
        plain = lambda: flex(q, k, v, block_mask=mask, enable_gqa=True)  # noqa: E731
        capped = lambda: flex(q, k, v, score_mod=softcap, block_mask=mask,  # noqa: E731
                              enable_gqa=True)
        err_p = (plain()[:, :, :256].float() - reference(q, k, v, causal, 0)).abs().max().item()
        err_c = (capped()[:, :, :256].float() - reference(q, k, v, causal, CAP)).abs().max().item()
        t_plain, t_cap = timed(plain), timed(capped)
        name = f"B={batch} L={n} {'causal' if causal else 'full'}"
        print(f"{name:<22} {sdpa:9.1f} {t_plain:9.1f} {t_cap:12.1f} {t_cap / sdpa:9.2f} "
              f"{t_cap / t_plain:9.2f} {err_p:9.2g} {err_c:9.2g}", flush=True)


if __name__ == "__main__":
    main()
