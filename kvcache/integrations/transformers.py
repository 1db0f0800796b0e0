"""Hugging Face transformers models on a ``PagedKVCache`` (extra ``kvcache[transformers]``).

Two ways in:

* your own loop: ``register()`` adds an attention implementation named ``"kvcache"``; after
  ``model.set_attn_implementation("kvcache")`` a forward run inside ``cache.forward(seq_ids,
  lengths)`` with the batch packed into one row (``input_ids`` of shape (1, T), per-token
  ``position_ids`` (1, T)), ``use_cache=False`` and ``kvcache=cache`` sends each decoder layer's
  attention to ``cache.attention(layer_idx, q, k, v)``. Build the cache with
  ``cache_config(model)`` (``rope_mode="none"``: the model applies its own RoPE);
* ``Engine(model, ...)``: continuous-batching generation (see ``kvcache.integrations.engine``);
  ``Engine(model, tp=N)`` on N tensor-parallel ranks (see ``kvcache.integrations.tp``).

RoPE: by default the model keeps its own rotary embedding, so the cache must not rotate: a
cache whose ``rope_mode`` is not ``"none"`` is refused by the attention function (it would rotate
q and k a second time). The cache's fused RoPE append is opt-in (``Engine(model, rope="cache")``,
or ``cache_config(model, rope="cache")`` with ``fused_rope(model, cache)`` in your own loop): it
is allowed only when ``model_rotary(model)`` proves the model's rotary is the standard
rotate-half one with static inverse frequencies and no output scaling; the cache then rotates
with the model's own ``inv_freq`` (and partial rotary dim), and the model's rotary embedding
returns cos=1, sin=0 for the duration so its layers hand over unrotated q and k. Sliding-window layers (Mistral, Qwen2 with ``use_sliding_window``, Phi-3 with a
``sliding_window``) see the previous ``sliding_window`` positions including their own, as
transformers defines it; that is ``window_left = sliding_window - 1`` in the cache's terms and
needs the backend capability ``window_left`` once a sequence outgrows the window.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import weakref
from typing import Optional

import numpy as np

from . import MissingExtraError, require
from .engine import Engine as _Engine
from .engine import ModelAdapter, PendingPicks
from ..arrays import to_numpy
from ..config import CacheConfig
from ..errors import InvalidArgumentError, UnsupportedFeatureError

MIN_VERSION = (5, 17)
torch = require("torch", "transformers")
transformers = require("transformers", "transformers", "5.17")


def _version(text: str) -> tuple:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


if _version(transformers.__version__) < MIN_VERSION:
    raise MissingExtraError(
        f"kvcache.integrations.transformers needs transformers >= "
        f"{'.'.join(map(str, MIN_VERSION))}, found {transformers.__version__}; install it with: "
        f"pip install -U 'kvcache[transformers]'")

__all__ = ["ATTN_IMPLEMENTATION", "Engine", "FAMILIES", "ROPE_CHOICES", "TransformersAdapter",
           "attention", "cache_config", "fused_rope", "model_rotary", "register",
           "sliding_windows"]

ATTN_IMPLEMENTATION = "kvcache"
"""The name ``register()`` gives the attention implementation."""

FAMILIES = {
    "llama": "grouped-query attention",
    "qwen2": "q/k/v projection bias (inside the model); sliding-window layers when "
             "use_sliding_window=True need the backend capability 'window_left'",
    "mistral": "sliding-window attention: sequences longer than config.sliding_window need "
               "the backend capability 'window_left'",
    "phi3": "head_dim 96 (the backend's head_dims); a config.sliding_window needs "
            "'window_left' for longer sequences",
    "gemma": "head_dim 256 with one KV head (the backend's head_dims)",
}
"""Model families (``config.model_type``) the Engine runs, and what each needs of a backend."""

ROPE_CHOICES = ("model", "cache")
"""Who rotates q and k: ``"model"`` (its own rotary embedding; cache ``rope_mode="none"``) or
``"cache"`` (the cache's fused RoPE append with the model's frequencies; ``rope_mode="normal"``)."""

# rope types whose inverse frequencies are fixed at construction (dynamic NTK and longrope
# change them with the sequence length, which a fixed cache table cannot follow)
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# attention module -> the cache whose fused RoPE rotates for it (inside fused_rope only)
_FUSED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# attention arguments whose meaning the cache does not implement
_REFUSED = ("softcap", "s_aux", "sinks", "attention_chunk_size", "position_bias")


# ---------------------------------------------------------------------- model description
def _head_dim(config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def sliding_windows(config) -> dict:
    """``{layer index: sliding_window}`` for the model's sliding-window layers (empty: none).
    Layers listed in ``config.layer_types`` as ``"sliding_attention"`` use the window; without
    ``layer_types`` a set ``config.sliding_window`` applies to every layer (Mistral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return {}
    types = getattr(config, "layer_types", None)
    layers = range(config.num_hidden_layers)
    if types is not None:
        return {i: int(window) for i in layers if types[i] == "sliding_attention"}
    return {i: int(window) for i in layers}


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    if dtype not in _DTYPES:
        raise UnsupportedFeatureError(f"the cache stores float32, float16 or bfloat16, not {dtype}")
    return _DTYPES[dtype]


def _rotary_module(model):
    found = [m for m in model.modules()
             if hasattr(m, "inv_freq") and hasattr(m, "attention_scaling")]
    if len(found) != 1:
        raise UnsupportedFeatureError(
            f"rope='cache' needs the model's one rotary embedding module (with inv_freq and "
            f"attention_scaling); {type(model).__name__} has {len(found)}")
    return found[0]


def _check_rope(rope: str) -> str:
    if rope not in ROPE_CHOICES:
        raise InvalidArgumentError(f"rope={rope!r} is not one of {ROPE_CHOICES}")
    return rope


def model_rotary(model) -> tuple:
    """``(inv_freq, rotary_dim)`` of the model's rotary embedding, once proven standard:
    ``inv_freq`` (R/2,) float64 (R: the rotated dims), ``rotary_dim`` R when R < head_dim
    (partial rotary, e.g. Phi-3's ``partial_rotary_factor``), else 0.

    Standard means: a supported family (its layers rotate q and k with transformers'
    rotate-half ``apply_rotary_pos_emb`` before attention), a rope type whose frequencies are
    fixed (``default``, ``linear``, ``llama3``, ``yarn``), ``attention_scaling == 1`` (YaRN's
    attention factor scales cos/sin, which the cache does not) and cos/sin that equal
    ``cos/sin(position * inv_freq)`` repeated over both halves at probe positions. Raises
    ``UnsupportedFeatureError`` naming what fails."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in FAMILIES:
        raise UnsupportedFeatureError(
            f"rope='cache': model family {family!r} is not one whose rotary the integration "
            f"knows; supported: {', '.join(sorted(FAMILIES))}")
    emb = _rotary_module(model)
    rope_type = getattr(emb, "rope_type", None)
    if not isinstance(rope_type, str) or rope_type not in _STATIC_ROPE_TYPES:
        raise UnsupportedFeatureError(
            f"rope='cache': the {family} model's rope type {rope_type!r} is not one with fixed "
            f"inverse frequencies {_STATIC_ROPE_TYPES} (dynamic and longrope frequencies change "
            f"with the sequence length); use rope='model'")
    scaling = float(emb.attention_scaling)
    if scaling != 1.0:
        raise UnsupportedFeatureError(
            f"rope='cache': the {family} model's rotary ({rope_type}) scales cos and sin by "
            f"attention_scaling={scaling} (e.g. YaRN's attention factor), which the cache's RoPE "
            f"does not; use rope='model'")
    inv_freq = emb.inv_freq.detach().to("cpu", torch.float64)
    original = getattr(emb, "original_inv_freq", None)
    if original is not None and not torch.equal(inv_freq, original.detach().to("cpu", torch.float64)):
        raise UnsupportedFeatureError(
            f"rope='cache': the {family} model's inv_freq differs from the one it was built "
            f"with (updated for a sequence length); use rope='model'")
    head_dim = _head_dim(model.config)
    rot = 2 * inv_freq.numel()
    if rot > head_dim:
        raise UnsupportedFeatureError(
            f"rope='cache': the {family} model rotates {rot} dims, more than head_dim {head_dim}")
    # probe: cos/sin must be the standard table of these frequencies, unscaled
    device = emb.inv_freq.device
    pos = torch.tensor([[0, 1, 2, 17, 255, 4095]], device=device)
    with torch.no_grad():
        cos, sin = emb(torch.zeros(1, device=device, dtype=torch.float32), pos)
    angles = pos[0, :, None].double().cpu() * emb.inv_freq.detach().to("cpu", torch.float32).double()
    angles = torch.cat([angles, angles], -1)
    got = (cos[0].double().cpu(), sin[0].double().cpu())
    want = (angles.cos(), angles.sin())
    if any(g.shape != w.shape or not torch.allclose(g, w, rtol=0, atol=2e-3) for g, w in zip(got, want)):
        raise UnsupportedFeatureError(
            f"rope='cache': the {family} model's rotary embedding {type(emb).__name__} does not "
            f"return the standard rotate-half cos/sin of its inv_freq; use rope='model'")
    return inv_freq.numpy(), (rot if rot < head_dim else 0)


def _unrotated(module, args, output):
    """Forward hook: the rotary embedding returns cos=1, sin=0 (its layers rotate nothing)."""
    cos, sin = output
    return torch.ones_like(cos), torch.zeros_like(sin)


# True in the thread (and context) running inside fused_rope: the family's
# apply_rotary_pos_emb, wrapped by _skip_rotation, hands q and k back as they are
_ROTATION_SKIPPED = contextvars.ContextVar("kvcache_rotation_skipped", default=False)


_WRAPPED: "weakref.WeakSet" = weakref.WeakSet()     # the wrappers _skip_rotation installed


def _rotation_skipped() -> bool:
    return _ROTATION_SKIPPED.get()


def _skip_rotation(layers) -> None:
    """Wrap the ``apply_rotary_pos_emb`` of the modules that define ``layers``' classes (once;
    idempotent) so that it returns q and k unchanged while ``_ROTATION_SKIPPED`` is set. With
    cos=1 and sin=0 (``_unrotated``) its rotation is the identity anyway, but costs five
    elementwise kernels per layer for each of q and k (``q * cos + rotate_half(q) * sin``).
    Outside fused_rope, and in other threads, the wrapped function is transformers' own."""
    for module in {sys.modules.get(type(m).__module__) for m in layers}:
        original = getattr(module, "apply_rotary_pos_emb", None)
        if not callable(original) or original in _WRAPPED:
            continue

        def apply(q, k, *args, _original=original, **kwargs):
            if _rotation_skipped():
                return q, k
            return _original(q, k, *args, **kwargs)

        functools.update_wrapper(apply, original)
        _WRAPPED.add(apply)
        setattr(module, "apply_rotary_pos_emb", apply)


@contextlib.contextmanager
def fused_rope(model, cache):
    """Let ``cache``'s fused RoPE append rotate q and k for ``model`` for the duration.

    ``cache``: built with ``cache_config(model, rope="cache")`` (``rope_mode="normal"``, the
    model's ``inv_freq`` and rotary dim). Checks that the model's rotary is standard
    (``model_rotary``) and that the cache rotates with exactly its frequencies, then makes the
    model's rotary embedding return cos=1, sin=0 (a forward hook, removed on exit), skips the
    layers' ``apply_rotary_pos_emb`` (the identity at cos=1, sin=0: ``_skip_rotation``) and
    lets the ``"kvcache"`` attention of the model's layers accept this cache. Raises
    ``UnsupportedFeatureError`` (a rotary the cache cannot reproduce) or
    ``InvalidArgumentError`` (a cache whose RoPE differs from the model's)."""
    inv_freq, rot = model_rotary(model)
    cfg = cache.config
    spec_rot = cfg.rope_rotary_dim if cfg.rope_rotary_dim != cfg.head_dim else 0
    same = (cfg.effective_rope_mode == "normal" and cfg.rope_scale == 1.0 and spec_rot == rot
            and len(cfg.rope_inv_freq) == len(inv_freq)
            and np.array_equal(np.asarray(cfg.rope_inv_freq, np.float64), inv_freq))
    if not same:
        raise InvalidArgumentError(
            f"fused_rope: the cache (rope_mode={cfg.rope_mode!r}, rope_scale={cfg.rope_scale}, "
            f"rope_rotary_dim={cfg.rope_rotary_dim}, {len(cfg.rope_inv_freq)} rope_inv_freq "
            f"values) does not rotate exactly as the model ({len(inv_freq)} inverse "
            f"frequencies, rotary dim {rot or 'all'}); build it with "
            f"cache_config(model, rope='cache')")
    layers = [m for m in model.modules() if getattr(m, "layer_idx", None) is not None]
    if any(m in _FUSED for m in layers):
        raise InvalidArgumentError("fused_rope: the model is already inside a fused_rope block")
    handle = _rotary_module(model).register_forward_hook(_unrotated)
    _skip_rotation(layers)
    token = _ROTATION_SKIPPED.set(True)
    try:
        for m in layers:
            _FUSED[m] = cache
        yield
    finally:
        _ROTATION_SKIPPED.reset(token)
        handle.remove()
        for m in layers:
            _FUSED.pop(m, None)


def cache_config(model, *, dtype=None, page_size: int = 16, max_total_tokens: int = 65536,
                 max_batch_size: int = 64, prefill_chunk_size: int = 2048,
                 rope: str = "model") -> CacheConfig:
    """A ``CacheConfig`` for a transformers causal LM: layers, query/KV heads and head_dim from
    ``model.config``, ``dtype`` (None: the model's parameter dtype) and the given sizes.
    ``rope``: ``"model"`` gives ``rope_mode="none"`` (the model rotates q and k itself);
    ``"cache"`` gives ``rope_mode="normal"`` with the model's ``inv_freq`` and partial rotary
    dim (``model_rotary``; raises ``UnsupportedFeatureError`` when they cannot be proven
    standard); run the model inside ``fused_rope(model, cache)`` then."""
    config = model.config
    heads = int(config.num_attention_heads)
    mode, inv_freq, rot = "none", (), 0
    if _check_rope(rope) == "cache":
        freqs, rot = model_rotary(model)
        mode, inv_freq = "normal", tuple(freqs.tolist())
    return CacheConfig(
        num_layers=int(config.num_hidden_layers), num_qo_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=_head_dim(config), page_size=page_size, max_batch_size=max_batch_size,
        max_total_tokens=max_total_tokens, prefill_chunk_size=prefill_chunk_size,
        dtype=_dtype_name(dtype if dtype is not None else model.dtype),
        rope_mode=mode, rope_theta=float(getattr(config, "rope_theta", None) or 10000.0),
        rope_inv_freq=inv_freq, rope_rotary_dim=rot)


# ---------------------------------------------------------------------- attention function
def _to_cache(cache, x):
    """(T, H, D) torch tensor -> the cache backend's native array in the cache dtype."""
    if cache.backend.is_native(x):
        return x.contiguous()
    return cache.from_numpy(x.detach().to("cpu", torch.float32).numpy())


def _window_unsupported(cache, layer: int, window: int) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        f"backend {cache.backend.name!r} does not support per-query sliding-window attention "
        f"(capability 'window_left' not declared): layer {layer} of the model attends to the "
        f"previous sliding_window={window} positions only, and this forward has queries past "
        f"that window")


def attention(module, query, key, value, attention_mask, scaling: Optional[float] = None,
              dropout: float = 0.0, sliding_window: Optional[int] = None, **kwargs):
    """The ``"kvcache"`` attention implementation (transformers' attention-function signature).

    ``query`` (1, num_qo_heads, T, head_dim), ``key``/``value`` (1, num_kv_heads, T, head_dim):
    the T new tokens of the open forward of ``kwargs["kvcache"]``, already rotated by the model
    (unrotated inside ``fused_rope(model, cache)``, where the cache rotates them).
    Returns ``(output (1, T, num_qo_heads, head_dim) in query's dtype, None)``.
    """
    cache = kwargs.get("kvcache")
    if cache is None:
        raise InvalidArgumentError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} needs the cache: call the model "
            f"with kvcache=cache (and use_cache=False) inside `with cache.forward(seq_ids, "
            f"lengths):`, or switch back with model.set_attn_implementation('sdpa')")
    if cache.config.rope_mode != "none" and _FUSED.get(module) is not cache:
        raise InvalidArgumentError(
            f"the cache has rope_mode={cache.config.rope_mode!r}, but a transformers model "
            f"applies its own RoPE before attention: the cache would rotate q and k a second "
            f"time. Create the cache with rope_mode='none' (kvcache.integrations.transformers."
            f"cache_config(model) does), or let the cache rotate with cache_config(model, "
            f"rope='cache') and run the model inside fused_rope(model, cache)")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise InvalidArgumentError(f"{type(module).__name__} has no layer_idx: cannot tell which "
                                   f"cache layer its attention uses")
    if query.shape[0] != 1:
        raise InvalidArgumentError(
            f"the batch must be packed into one row (input_ids of shape (1, T)), got a batch "
            f"of {query.shape[0]} rows")
    for name in _REFUSED:
        if kwargs.get(name) is not None:
            raise UnsupportedFeatureError(
                f"layer {layer} passes {name}={kwargs[name]!r} to attention; the kvcache "
                f"attention does not implement {name}")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedFeatureError(f"layer {layer} asks for non-causal attention; the cache's "
                                      f"attention is causal")
    extra = {}
    if sliding_window is not None:
        if getattr(cache.capabilities, "window_left", False):
            extra["window_left"] = int(sliding_window) - 1
        else:
            # fine while no query is as far as the window from the start of its sequence
            positions = to_numpy(cache.query_positions())
            if positions.size and int(positions.max()) >= int(sliding_window):
                raise _window_unsupported(cache, layer, int(sliding_window))
    q = _to_cache(cache, query[0].transpose(0, 1))
    k = _to_cache(cache, key[0].transpose(0, 1))
    v = _to_cache(cache, value[0].transpose(0, 1))
    out = cache.attention(layer, q, k, v, sm_scale=scaling, **extra)
    if not isinstance(out, torch.Tensor):
        out = torch.from_numpy(np.ascontiguousarray(to_numpy(out)))
    return out.to(device=query.device, dtype=query.dtype).unsqueeze(0), None


def register() -> str:
    """Register the ``"kvcache"`` attention implementation with transformers (idempotent); no
    mask function is registered, so the model builds no (T, T) attention mask for it.
    Returns the name to pass to ``model.set_attn_implementation``."""
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
    return ATTN_IMPLEMENTATION


# ---------------------------------------------------------------------- engine adapter
class TransformersAdapter(ModelAdapter):
    """A transformers causal LM (a supported family) as the engine's model."""

    def __init__(self, model, rope: str = "model"):
        config = getattr(model, "config", None)
        family = getattr(config, "model_type", None)
        if family not in FAMILIES:
            raise UnsupportedFeatureError(
                f"model family {family!r} ({type(model).__name__}) is not supported by the kvcache "
                f"Engine; supported: {', '.join(sorted(FAMILIES))}. A new family needs its attention "
                f"to reach the cache through transformers' attention interface with no feature the "
                f"cache lacks (see docs/integrations.md)")
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise UnsupportedFeatureError(f"{type(model).__name__} has no language-model head: the "
                                          f"Engine needs a *ForCausalLM model")
        self.model = model
        self.family = family
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.windows = sliding_windows(config)
        self.device = next(model.parameters()).device
        self.rope = _check_rope(rope)
        self._picks_ring: dict = {}      # batch size -> two pinned pick buffers and whose turn
        if rope == "cache":
            model_rotary(model)            # refuse a rotary the cache cannot reproduce, early

    def cache_config(self, *, dtype, page_size, max_total_tokens, max_batch_size,
                     prefill_chunk_size) -> CacheConfig:
        return cache_config(self.model, dtype=dtype, page_size=page_size,
                            max_total_tokens=max_total_tokens, max_batch_size=max_batch_size,
                            prefill_chunk_size=prefill_chunk_size, rope=self.rope)

    def default_device(self) -> Optional[str]:
        return str(self.device)

    def check(self, cache) -> None:
        dtype = _dtype_name(self.model.dtype)
        if cache.config.dtype != dtype and cache.backend.is_native(torch.zeros(1, device=self.device)):
            raise UnsupportedFeatureError(
                f"the model computes in {dtype} but the cache stores {cache.config.dtype}; the "
                f"{cache.backend.name!r} backend takes the model's tensors as they are, so the "
                f"dtypes must match (pass dtype=None)")

    @contextlib.contextmanager
    def session(self, cache):
        """The model runs the "kvcache" attention for the duration (restored afterwards); with
        ``rope="cache"`` inside ``fused_rope(model, cache)``."""
        register()
        before = self.model.config._attn_implementation
        if before != ATTN_IMPLEMENTATION:
            self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        rotary = fused_rope(self.model, cache) if self.rope == "cache" else contextlib.nullcontext()
        try:
            with torch.inference_mode(), rotary:
                yield
        finally:
            if before != ATTN_IMPLEMENTATION:
                self.model.set_attn_implementation(before)

    def _upload(self, array: np.ndarray):
        """A host array on the model's device without waiting for the device: a pageable copy
        synchronizes the stream, which would hold a step planned ahead (pipelined) until the
        one in flight is done; a pinned block (torch's pinned allocator keeps it until the copy
        has run) does not."""
        t = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def forward(self, cache, tokens, positions, logit_rows):
        # ``tokens`` may be the previous step's picks, already on the device (overlapped decode)
        ids = (tokens.to(self.device) if torch.is_tensor(tokens) else self._upload(tokens)).unsqueeze(0)
        pos = self._upload(positions).unsqueeze(0)
        keep = self._upload(logit_rows) if len(logit_rows) else 1
        out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep,
                         kvcache=cache)
        return out.logits[0] if len(logit_rows) else None

    def graphs_by_default(self, device) -> Optional[bool]:
        """Whole-step graphs pay on a GPU (the model's device); on a CPU they save nothing."""
        return torch.device(device if device is not None else self.device).type != "cpu"

    def step_graphs(self, cache):
        """Decode steps captured per bucket: the model's whole forward (embedding, layers with
        the cache's attention, LM head) over a fixed ``(3, bucket)`` input buffer (token ids,
        positions, logit rows); see ``kvcache.integrations.torch_graphs``."""
        from .torch_graphs import StepGraphs
        model = self.model

        def step(inputs):
            out = model(input_ids=inputs[0].unsqueeze(0), position_ids=inputs[1].unsqueeze(0),
                        use_cache=False, logits_to_keep=inputs[2], kvcache=cache)
            return out.logits[0]

        return StepGraphs(cache, step, self.device)

    def to_numpy(self, logits) -> np.ndarray:
        return logits.detach().to("cpu", torch.float64).numpy()

    @staticmethod
    def _greedy_picks(logits, logprobs: bool = True):
        """On the logits' device: the argmax tokens ``(B,)`` and a ``(2, B)`` float64 tensor of
        them and their log-probabilities, NaN unless ``logprobs`` (the one copy a step sends to
        the host)."""
        if not logprobs:
            # argmax in the logits' own dtype (widening is exact and keeps the order): the
            # float32 copy and log-sum-exp passes were 0.19 ms of a 3.4 ms B=64 decode step
            tokens = logits.detach().argmax(dim=-1)
            return tokens, torch.stack([tokens.to(torch.float64),
                                        torch.full_like(tokens, float("nan"), dtype=torch.float64)])
        rows = logits.detach().float()
        tokens = rows.argmax(dim=-1)
        lps = rows.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(rows, dim=-1)
        return tokens, torch.stack([tokens.to(torch.float64), lps.to(torch.float64)])

    def greedy(self, logits, logprobs: bool = True) -> tuple[np.ndarray, np.ndarray]:
        picked = self._greedy_picks(logits, logprobs)[1].cpu().numpy()
        return picked[0].astype(np.int64), picked[1]

    def sample(self, logits, rows, uniforms, temperature):
        # on the model's device, in float64 like the host default: one (2, D) copy back
        dev = logits.device
        table = logits.detach().double()[torch.from_numpy(np.asarray(rows, np.int64)).to(dev)]
        top = table.max(dim=-1, keepdim=True).values
        logz = top[:, 0] + torch.log(torch.exp(table - top).sum(dim=-1))
        cdf = torch.cumsum(torch.exp((table - top) / temperature), dim=-1)
        goal = torch.from_numpy(np.asarray(uniforms, np.float64)).to(dev) * cdf[:, -1]
        tokens = (cdf <= goal[:, None]).sum(dim=-1).clamp(max=table.shape[1] - 1)
        logprobs = table.gather(-1, tokens[:, None])[:, 0] - logz
        picked = torch.stack([tokens.double(), logprobs]).cpu().numpy()
        return picked[0].astype(np.int64), picked[1]

    def step_tokens(self, tokens, picks, dst, src):
        on = picks.tokens
        if not torch.is_tensor(on):
            return super().step_tokens(tokens, picks, dst, src)
        # the picks stay on their device: the ids are gathered there, in stream order
        out = self._upload(tokens)
        out[self._upload(dst)] = on[self._upload(src)].to(out.dtype)
        return out

    def greedy_async(self, logits, logprobs: bool = True) -> PendingPicks:
        tokens, picked = self._greedy_picks(logits, logprobs)
        if picked.device.type == "cpu":
            host = picked.numpy()
            return PendingPicks(tokens, lambda: (host[0].astype(np.int64), host[1]))
        # a pinned copy and an event: the host reads the picks when it needs them, the device
        # goes on with the next step meanwhile
        host_t = self._pinned_picks(picked.shape[1])
        host_t.copy_(picked, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def result():
            done.synchronize()
            out = host_t.numpy().copy()
            return out[0].astype(np.int64), out[1]
        return PendingPicks(tokens, result)

    def _pinned_picks(self, n: int):
        """One of two pinned (2, n) float64 host buffers, in turn: the overlapped decode has at
        most two steps' picks in flight, and reads a step's before the next-but-one is made."""
        slot = self._picks_ring.get(n)
        if slot is None:
            slot = self._picks_ring[n] = [
                [torch.empty((2, n), dtype=torch.float64, pin_memory=True) for _ in range(2)], 0]
        bufs, k = slot
        slot[1] = 1 - k
        return bufs[k]


def _tensor_parallel(model, tp, tp_group) -> bool:
    """Whether the Engine runs ``model`` on tensor-parallel ranks: asked for, or the model is
    already split (by transformers' ``tp_plan``, or by ``kvcache.integrations.tp.shard_model``,
    which needs torch.distributed initialised)."""
    size = getattr(model, "tp_size", None)
    if tp not in (None, 1) or tp_group is not None or (isinstance(size, int) and size > 1):
        return True
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from .tp import tp_layout
    return tp_layout(model) is not None


class Engine(_Engine):
    """Continuous-batching generation of a transformers causal LM on a ``PagedKVCache``.

    ``model``: a ``*ForCausalLM`` of a family in ``FAMILIES``. ``backend``: a backend name or
    ``"auto"``; ``device``: the cache's device (None: the model's); ``dtype``: the cache dtype
    (None: the model's); ``page_size``, ``max_total_tokens`` (None: ``512 * max_batch_size``),
    ``max_batch_size``, ``prefill_chunk_size`` (None: ``min(8192, max_total_tokens)``): as in
    ``CacheConfig``. ``rope``: who rotates q and k, ``"model"`` (default: the model's own
    rotary embedding, cache ``rope_mode="none"``) or ``"cache"`` (the cache's fused RoPE append
    with the model's inverse frequencies, ``rope_mode="normal"``; raises
    ``UnsupportedFeatureError`` unless ``model_rotary`` proves the rotary standard and the
    backend has ``rope_frequencies``). ``graphs`` (None: on for a GPU model on a backend
    declaring ``static_decode``; True / False force it) and ``graph_batch_sizes``: whole-step
    decode graphs, see ``kvcache.integrations.engine.Engine``. ``offload`` / ``offload_tokens``:
    the host tier preempted sequences are parked in (None: on for a GPU cache); ``overlap``
    (default True): greedy decode with the host one step ahead of the device; both as in
    ``kvcache.integrations.engine.Engine``. ``tp`` / ``tp_group``: tensor parallelism, one
    process per rank (``tp``: the number of ranks, None: 1 unless the model is already split;
    ``tp_group``: their torch.distributed group, None: the default group); the model is split
    over the ranks and each rank's cache holds its ``num_kv_heads / tp`` heads, see
    ``kvcache.integrations.tp``. See ``kvcache.integrations.engine.Engine.generate``.
    """

    def __init__(self, model, backend: str = "auto", device: Optional[str] = None,
                 dtype=None, page_size: int = 16, max_total_tokens: Optional[int] = None,
                 max_batch_size: int = 64, prefill_chunk_size: Optional[int] = None,
                 rope: str = "model", graphs: Optional[bool] = None,
                 graph_batch_sizes=None, offload: Optional[bool] = None,
                 offload_tokens: Optional[int] = None, overlap: bool = True,
                 tp: Optional[int] = None, tp_group=None):
        self.model = model
        adapter: ModelAdapter
        if _tensor_parallel(model, tp, tp_group):
            from .tp import TensorParallelAdapter
            adapter = TensorParallelAdapter(model, rope, tp=tp, group=tp_group)
        else:
            adapter = TransformersAdapter(model, rope)
        super().__init__(adapter, backend=backend, device=device, dtype=dtype,
                         page_size=page_size, max_total_tokens=max_total_tokens,
                         max_batch_size=max_batch_size, prefill_chunk_size=prefill_chunk_size,
                         graphs=graphs, graph_batch_sizes=graph_batch_sizes, offload=offload,
                         offload_tokens=offload_tokens, overlap=overlap)
