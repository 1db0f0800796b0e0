"""The cache's own RoPE (rope_mode 'normal' and 'inline') reproduces a transformers model's
rotary exactly when given the model's inverse frequencies (``rope_inv_freq``) and partial
rotary dimension (``rope_rotary_dim``): llama3-scaled Llama and partial-rotary Phi. Reference:
a cache with rope_mode 'none' fed q/k that the model's own rotary code rotated."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvcache  # noqa: E402

from conftest import BACKENDS, backend_or_skip  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def llama3_rotary():
    """(inv_freq, rotary_dim, rotate(q, k, positions)) of a llama3-scaled Llama."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    cfg = LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    emb = LlamaRotaryEmbedding(cfg)
    assert emb.attention_scaling == 1.0

    def rotate(q, k, pos):        # q/k (T, H, D) -> rotated as LlamaAttention does
        cos, sin = emb(q, pos[None])
        qr, kr = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return qr[0].transpose(0, 1), kr[0].transpose(0, 1)
    return emb.inv_freq.double().numpy(), 0, rotate


def phi_partial_rotary():
    """The same for Phi with partial_rotary_factor 0.5 (the first 32 of 64 dims rotate)."""
    from transformers import PhiConfig
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding, apply_rotary_pos_emb
    cfg = PhiConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                    num_key_value_heads=KV_HEADS, partial_rotary_factor=0.5)
    emb = PhiRotaryEmbedding(cfg)
    rot = int(HEAD_DIM * 0.5)

    def rotate(q, k, pos):        # PhiAttention's split: rotate q[..., :rot], keep the rest
        cos, sin = emb(q, pos[None])
        qr, kr = apply_rotary_pos_emb(q[..., :rot].transpose(0, 1)[None],
                                      k[..., :rot].transpose(0, 1)[None], cos, sin)
        return (torch.cat([qr[0].transpose(0, 1), q[..., rot:]], -1),
                torch.cat([kr[0].transpose(0, 1), k[..., rot:]], -1))
    return emb.inv_freq.double().numpy(), rot, rotate


@pytest.mark.parametrize("rope_mode", ["normal", "inline"])
@pytest.mark.parametrize("model", ["llama3", "phi_partial"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_rope_equals_the_models_rotary(backend, model, rope_mode, monkeypatch):
    name, device = backend_or_skip(backend, monkeypatch, HEAD_DIM)
    inv_freq, rot, rotate = {"llama3": llama3_rotary, "phi_partial": phi_partial_rotary}[model]()
    # llama3 scaling leaves the high frequencies and divides the low ones: a real table
    assert model != "llama3" or not np.allclose(inv_freq, 500000.0 ** (-np.arange(0, 64, 2) / 64))

    def make(mode, **rope):
        cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=HEADS, num_kv_heads=KV_HEADS,
                                  head_dim=HEAD_DIM, page_size=16, max_total_tokens=1024,
                                  max_batch_size=4, prefill_chunk_size=512, dtype="float32",
                                  rope_mode=mode, **rope)
        cache = kvcache.PagedKVCache(cfg, backend=name, device=device)
        cache.add_sequence(0)
        return cache

    ours = make(rope_mode, rope_inv_freq=inv_freq, rope_rotary_dim=rot)
    theirs = make("none")
    rng = np.random.default_rng(3)
    start = 0
    for n in (300, 1, 1, 7):          # prefill past the llama3 original context, then decode
        q = rng.standard_normal((n, HEADS, HEAD_DIM)).astype(np.float32)
        k, v = (rng.standard_normal((n, KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
        pos = torch.arange(start, start + n)
        qr, kr = rotate(torch.from_numpy(q), torch.from_numpy(k), pos)
        outs = []
        for cache, inputs in ((ours, (q, k, v)), (theirs, (qr.numpy(), kr.numpy(), v))):
            with cache.forward([0], [n]):
                outs.append(kvcache.to_numpy(cache.attention(0, *map(cache.from_numpy, inputs))))
        np.testing.assert_allclose(outs[0], outs[1], rtol=2e-4, atol=2e-5,
                                   err_msg=f"{model} {rope_mode} forward of {n} at {start}")
        start += n
    if rope_mode == "normal":          # the stored K is the model's rotated K
        k_ours = kvcache.to_numpy(ours.get_kv(0)[0])
        k_theirs = kvcache.to_numpy(theirs.get_kv(0)[0])
        np.testing.assert_allclose(k_ours, k_theirs, rtol=2e-4, atol=2e-5)
