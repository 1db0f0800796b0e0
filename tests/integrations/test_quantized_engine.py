"""``Engine(kv_dtype=...)`` (issue 32) judged by transformers' own generation: ``model.generate``
with an attention function that stores each new K/V row through the same format
(``kvcache.kv_quant``) and then attends as transformers' eager attention does. The engine's
greedy tokens must equal it, token for token, per format; and with the format off they equal
plain generation (the quantization is real: some token differs across formats)."""

import numpy as np
import pytest
import torch
import transformers
from conftest import backend_or_skip, hf_greedy, make_model
from transformers.models.llama.modeling_llama import eager_attention_forward

from kvcache import kv_quant as kq
from kvcache.config import KV_FORMATS
from kvcache.integrations.transformers import Engine

NEW = 12


class QuantizedJudge:
    """A transformers attention function whose K/V pass through ``fmt`` once, as they are
    first written (per layer; fp8 scales from each layer's first call, the prompt)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.stored: dict = {}
        self.scales: dict = {}

    def __call__(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        layer = module.layer_idx
        held = self.stored.setdefault(layer, [[], []])
        have = sum(x.shape[0] for x in held[0])
        out = []
        for i, x in enumerate((key, value)):
            new = x[0, :, have:].transpose(0, 1).double().numpy().astype(np.float32)  # (T, H, D)
            scale = None
            if self.fmt == "float8_e4m3":
                scale = self.scales.setdefault((layer, i), kq.calibrate_fp8(new))
            held[i].append(kq.roundtrip(new, self.fmt, "float32", 64, scale))
            rows = np.concatenate(held[i])
            out.append(torch.from_numpy(rows).transpose(0, 1)[None].to(x.dtype))
        if attention_mask is None:      # a registered name may get no mask: causal here
            tq, tk = query.shape[2], out[0].shape[2]
            allowed = torch.arange(tk)[None, :] <= torch.arange(tk - tq, tk)[:, None]
            attention_mask = torch.zeros(tq, tk, dtype=query.dtype).masked_fill(
                ~allowed, float("-inf"))[None, None]
        return eager_attention_forward(module, query, out[0], out[1], attention_mask,
                                       scaling=scaling, dropout=dropout, **kw)


def judged(model, prompt, fmt):
    name = f"kvcache_test_quantized_{fmt}"
    transformers.AttentionInterface.register(name, QuantizedJudge(fmt))
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        return hf_greedy(model, prompt, NEW)
    finally:
        model.set_attn_implementation(before)


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", seed=11)


def prompt_of(n=40, seed=0):
    return np.random.default_rng(seed).integers(1, 200, n).tolist()


@pytest.mark.parametrize("backend,fmt", [("reference", f) for f in KV_FORMATS]
                         + [("cuda", "float8_e4m3")])
def test_engine_tokens_equal_transformers_generation_over_the_same_format(llama, backend, fmt,
                                                                          monkeypatch):
    prompt = prompt_of()
    want = judged(llama, prompt, fmt)
    name, device = backend_or_skip(backend, monkeypatch, llama.config.head_dim)
    engine = Engine(llama, backend=name, device=device, max_total_tokens=512, kv_dtype=fmt,
                    prefix_cache=False)
    got = engine.generate([prompt], max_new_tokens=NEW)[0][0]
    assert got == want
    assert engine.cache.config.kv_dtype == fmt
    if fmt == "float8_e4m3":            # calibrated from the prompt, as the judge did
        assert engine.cache.kv_scales(0) is not None


def test_the_formats_change_tokens_and_auto_is_plain_generation(llama):
    prompt = prompt_of(seed=1)
    plain = hf_greedy(llama, prompt, NEW)
    engine = Engine(llama, backend="reference", max_total_tokens=512)
    assert engine.generate([prompt], max_new_tokens=NEW)[0][0] == plain
    assert engine.cache.config.kv_dtype == "float32"
    # int4 is coarse enough to move a greedy token of this random model: the judge sees it
    assert judged(llama, prompt, "int4") != plain


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_affine_pages_are_offloaded_and_restored_exactly(llama, fmt):
    """int8 / int4 pages move through the host tier as packed rows: an Engine too small for
    its batch parks preempted sequences and restores them, and every request's greedy tokens
    equal those of an Engine with room for all."""
    prompts = [prompt_of(n=40, seed=s) for s in range(4)]
    roomy = Engine(llama, backend="reference", max_total_tokens=1024, kv_dtype=fmt,
                   prefix_cache=False, offload=False)
    want = [r[0] for r in roomy.generate(prompts, max_new_tokens=NEW)]
    tight = Engine(llama, backend="reference", max_total_tokens=128, kv_dtype=fmt,
                   prefix_cache=False, offload=True)
    got = [r[0] for r in tight.generate(prompts, max_new_tokens=NEW)]
    assert tight.host_tier is not None
    assert tight.stats.offloaded_tokens > 0 and tight.stats.recompute_tokens_saved > 0
    assert got == want


def test_fp8_pages_are_offloaded_and_restored_exactly(llama):
    """fp8 pages move through the host tier (their payload carries the scales): an Engine too
    small for its batch parks preempted sequences and restores them, and every request's
    greedy tokens equal those of an Engine with room for all."""
    prompts = [prompt_of(n=40, seed=s) for s in range(4)]
    roomy = Engine(llama, backend="reference", max_total_tokens=1024, kv_dtype="float8_e4m3",
                   prefix_cache=False, offload=False)
    for layer in range(llama.config.num_hidden_layers):       # one set of scales for both
        roomy.cache.set_kv_scales(layer, 0.05, 0.05)
    want = [r[0] for r in roomy.generate(prompts, max_new_tokens=NEW)]
    tight = Engine(llama, backend="reference", max_total_tokens=128, kv_dtype="float8_e4m3",
                   prefix_cache=False, offload=True)
    for layer in range(llama.config.num_hidden_layers):
        tight.cache.set_kv_scales(layer, 0.05, 0.05)
    got = [r[0] for r in tight.generate(prompts, max_new_tokens=NEW)]
    assert tight.host_tier is not None
    assert tight.stats.offloaded_tokens > 0 and tight.stats.recompute_tokens_saved > 0
    assert got == want
