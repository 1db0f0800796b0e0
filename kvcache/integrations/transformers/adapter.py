"""The engine's side of the transformers integration: ``cache_config`` for a model and
``TransformersAdapter``, the model as the engine's ``ModelAdapter`` (re-exported by the package)."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Optional

import numpy as np

from ...backend import Capabilities
from ...config import CacheConfig
from ...errors import UnsupportedFeatureError
from .. import require
from ..engine import ModelAdapter, PendingPicks
from ..sampling_torch import token_logprobs
from .interface import ATTN_IMPLEMENTATION, register
from .model import (_dtype_name, _model_needs, attention_layers, eos_token_ids, head_dims,
                    layer_kinds, refuse_hybrid, sliding_windows)
from .rope import _check_rope, fused_rope, model_rotary
from .states import (map_cache_layers, num_cache_layers, route_state_layers, serving,
                     state_kinds)

torch = require("torch", "transformers")

COMPILE_BACKEND = "inductor"
"""``torch.compile``'s backend for ``compile_step`` (the tests' CPU runs use "aot_eager": the
same tracing through the cache's op, no kernels generated)."""
COMPILE_MODE: Optional[str] = None
"""``torch.compile``'s ``mode`` for ``compile_step`` (None: the default; tools try e.g.
"max-autotune-no-cudagraphs", which also tunes the GEMMs, at a longer compile)."""


def cache_config(model, *, dtype=None, page_size: int = 16, max_total_tokens: int = 65536,
                 max_batch_size: int = 64, prefill_chunk_size: int = 2048,
                 rope: str = "model", window_groups: bool = False,
                 max_state_slots: int = 0) -> CacheConfig:
    """A ``CacheConfig`` for a transformers causal LM: layers, query/KV heads and head_dim from
    ``model.config``, ``dtype`` (None: the model's parameter dtype) and the given sizes.
    ``rope``: ``"model"`` gives ``rope_mode="none"`` (the model rotates q and k itself);
    ``"cache"`` gives ``rope_mode="normal"`` with the model's ``inv_freq`` and partial rotary
    dim (``model_rotary``; raises ``UnsupportedFeatureError`` when they cannot be proven
    standard); run the model inside ``fused_rope(model, cache)`` then. A model that keeps
    state the cache does not hold beside its attention (a hybrid: Mamba mixers, linear
    attention, position biases) raises ``UnsupportedFeatureError`` naming the layers and the
    reason (``refuse_hybrid``). The short convolutions of LFM2, the Mamba-2 mixers of Bamba,
    Granite-4.0-H, Nemotron-H and Falcon-H1 and Qwen3-Next's gated DeltaNet
    (``STATE_FAMILIES``) are state layers: they always get their ``State`` kinds
    (``state_kinds(model)``), in ``max_state_slots`` slots (0: ``max_batch_size``, the
    sequences the cache holds at once), and the model's state modules are routed to the cache
    (``route_state_layers``). Blocks
    that hold nothing (Nemotron-H's MLP and MoE blocks) get no cache layer, a layer with a
    mixer beside its attention (Falcon-H1) two (``states.cache_layers``; ``num_layers``
    counts them).
    ``window_groups``: the model's sliding-window layers get ``layer_kinds``
    (``layer_kinds(model)``: each keeps only the pages its window still sees; raises
    ``UnsupportedFeatureError`` when the model's windowing is not understood); False: every
    layer keeps every page."""
    refuse_hybrid(model)
    states = state_kinds(model)
    if states:
        _no_fused_rope_with_states(model, rope, states)
        route_state_layers(model)
    map_cache_layers(model)
    config = model.config
    heads = int(config.num_attention_heads)
    head_dim, head_dim_v = head_dims(config)
    mode, inv_freq, rot = "none", (), 0
    if _check_rope(rope) == "cache":
        freqs, rot = model_rotary(model)
        mode, inv_freq = "normal", tuple(freqs.tolist())
    return CacheConfig(
        num_layers=num_cache_layers(model), num_qo_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=head_dim, head_dim_v=head_dim_v, page_size=page_size,
        max_batch_size=max_batch_size,
        max_total_tokens=max_total_tokens, prefill_chunk_size=prefill_chunk_size,
        dtype=_dtype_name(dtype if dtype is not None else model.dtype),
        rope_mode=mode, rope_theta=float(getattr(config, "rope_theta", None) or 10000.0),
        rope_inv_freq=inv_freq, rope_rotary_dim=rot, max_state_slots=max_state_slots,
        layer_kinds={**(layer_kinds(model) if window_groups else {}), **states})


def _no_fused_rope_with_states(model, rope: str, states: dict) -> None:
    # the cache's fused RoPE has not been tried beside state layers: the model's own rotary has
    if rope == "cache":
        raise UnsupportedFeatureError(
            f"rope='cache' with the {model.config.model_type} model's state layers "
            f"{sorted(states)} (recurrent state): not tried yet; pass rope='model'")


# ---------------------------------------------------------------------- the model's attention
_ROUTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""model -> [open sessions, the attention implementation it had before the first]."""
_ROUTED_LOCK = threading.Lock()


@contextlib.contextmanager
def _routed(model):
    """``model`` runs the "kvcache" attention for the duration; nested and interleaved uses
    (several engines over one model) are counted, and the last to leave restores the
    implementation the model had before the first. Raises ``UnsupportedFeatureError`` when the
    model cannot switch (its layers do not call transformers' attention interface)."""
    register()
    with _ROUTED_LOCK:
        entry = _ROUTED.get(model)
        if entry is not None:
            entry[0] += 1
        else:
            before = model.config._attn_implementation
            if before != ATTN_IMPLEMENTATION:
                _switch(model, before)
            _ROUTED[model] = [1, before]
    try:
        yield
    finally:
        with _ROUTED_LOCK:
            entry = _ROUTED[model]
            entry[0] -= 1
            if entry[0] == 0:
                del _ROUTED[model]
                if entry[1] != ATTN_IMPLEMENTATION:
                    model.set_attn_implementation(entry[1])


def _switch(model, before) -> None:
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    except (ValueError, NotImplementedError) as exc:
        raise UnsupportedFeatureError(
            f"{type(model).__name__} cannot switch to a custom attention implementation "
            f"({exc}); its attention cannot reach the cache") from None
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(before)
        raise UnsupportedFeatureError(
            f"{type(model).__name__} kept its attention implementation {before!r} when asked "
            f"for {ATTN_IMPLEMENTATION!r} (its layers do not call transformers' attention "
            f"interface): its attention cannot reach the cache")


# ---------------------------------------------------------------------- engine adapter
class TransformersAdapter(ModelAdapter):
    """A transformers decoder-only causal LM as the engine's model: any family whose decoder
    layers call transformers' attention interface (checked: ``attention_layers``; refused with
    the reason otherwise) and keep no other state from token to token (a hybrid's Mamba mixer,
    linear attention or position bias: refused, ``refuse_hybrid``) than the short
    convolutions of LFM2, the Mamba-2 mixers of Bamba, Granite-4.0-H, Nemotron-H and
    Falcon-H1 and Qwen3-Next's gated DeltaNet, which run on the cache's state slots
    (``state_layers``)."""

    def __init__(self, model, rope: str = "model"):
        config = getattr(model, "config", None)
        family = getattr(config, "model_type", None)
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise UnsupportedFeatureError(f"{type(model).__name__} has no language-model head: the "
                                          f"Engine needs a *ForCausalLM model")
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedFeatureError(
                f"{type(model).__name__} is an encoder-decoder model; the Engine runs decoder-only "
                f"causal LMs")
        refuse_hybrid(model)             # state beside attention (Mamba, linear attention ...)
        attention_layers(model)          # refuses a model whose layers the cache cannot serve
        self.states = state_kinds(model)
        """``{layer: State}``: the model's state layers (LFM2's short convolutions, Bamba-family
        Mamba-2 mixers)."""
        if self.states:
            _no_fused_rope_with_states(model, rope, self.states)
            route_state_layers(model)
        map_cache_layers(model)
        self.model = model
        self.family = str(family or type(model).__name__)
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

    def layer_kinds(self) -> dict:
        return layer_kinds(self.model)

    def state_layers(self) -> dict:
        return dict(self.states)

    def default_device(self) -> Optional[str]:
        return str(self.device)

    def eos_token_ids(self) -> tuple:
        return eos_token_ids(self.model)

    def check(self, cache) -> None:
        for need, cap in _model_needs(self.model):
            if not getattr(cache.capabilities, cap, False):
                raise UnsupportedFeatureError(
                    f"the {self.family} model needs {need}, and backend {cache.backend.name!r} "
                    f"does not support it: {Capabilities.reason(cap)}")
        dtype = _dtype_name(self.model.dtype)
        if cache.config.dtype != dtype and cache.backend.is_native(torch.zeros(1, device=self.device)):
            raise UnsupportedFeatureError(
                f"the model computes in {dtype} but the cache stores {cache.config.dtype}; the "
                f"{cache.backend.name!r} backend takes the model's tensors as they are, so the "
                f"dtypes must match (pass dtype=None)")

    @contextlib.contextmanager
    def session(self, cache):
        """The model runs the "kvcache" attention while any engine over it has work: the first
        session over the model switches it, the last one to close restores what it had
        (``_routed``: counted per model, so two engines over one model, opened and closed in any
        order, never switch it back under each other). Inference mode and ``rope="cache"``'s
        ``fused_rope`` are per step (``step_context``)."""
        with _routed(self.model):
            yield

    def batch_invariant_ops(self):
        """``BatchInvariantMode``: the model's matmuls and row reductions with a summation order
        that does not depend on the batch (``kvcache.integrations.torch_invariant``): fixed
        row blocks on the CPU, Triton kernels on an NVIDIA GPU. Refused
        (``UnsupportedFeatureError``) on other devices (ROCm included: the kernels are not
        proven there), for a float64 model on a GPU, and without Triton."""
        where = f"deterministic=True with a model on {self.device}"
        if self.device.type != "cpu":
            if self.device.type != "cuda" or torch.version.hip:
                raise UnsupportedFeatureError(
                    f"{where}: the model's batch-invariant ops are proven on the CPU and on "
                    f"NVIDIA GPUs only (docs/determinism.md); pass deterministic=False")
            if self.model.dtype == torch.float64:
                raise UnsupportedFeatureError(
                    f"{where} in float64: the GPU kernels take float16, bfloat16 and float32; "
                    f"pass deterministic=False or another dtype")
            import importlib.util
            if importlib.util.find_spec("triton") is None:
                raise UnsupportedFeatureError(
                    f"{where}: the GPU kernels need Triton (pip install triton)")
        from ..torch_invariant import BatchInvariantMode
        return BatchInvariantMode()

    @contextlib.contextmanager
    def step_context(self, cache):
        """One step under ``torch.inference_mode()`` (with ``rope="cache"`` inside
        ``fused_rope(model, cache)``), left before the step returns or raises: between steps
        the thread's autograd mode is the caller's, and another engine's steps over the same
        model find it as they left it."""
        rotary = fused_rope(self.model, cache) if self.rope == "cache" else contextlib.nullcontext()
        with torch.inference_mode(), rotary:
            yield

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
        with serving(cache) if self.states else contextlib.nullcontext():
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                             logits_to_keep=keep, kvcache=cache)
        ran = cache.layers_run
        if len(ran) + len(self.states) != cache.config.num_layers:
            missing = sorted(set(range(cache.config.num_layers)) - ran - set(self.states))
            raise UnsupportedFeatureError(
                f"layers {missing} of the {self.family} model ({type(self.model).__name__}) did "
                f"not call transformers' attention interface: their attention cannot reach the "
                f"cache, so the model cannot run on it")
        return out.logits[0] if len(logit_rows) else None

    def graphs_by_default(self, device) -> Optional[bool]:
        """Whole-step graphs pay on a GPU (the model's device); on a CPU they save nothing."""
        return torch.device(device if device is not None else self.device).type != "cpu"

    def step_graphs(self, cache, compiled: bool = False):
        """Steps captured per bucket: the model's whole forward (embedding, layers with the
        cache's attention, LM head) over fixed input buffers (token ids and positions of the
        bucket's rows, the logit rows); see ``kvcache.integrations.torch_graphs``. ``compiled``: the
        step goes through ``torch.compile`` (one graph for every bucket: dynamic batch), the
        cache's attention an opaque op in it (``kvcache::attention``), so the model's
        elementwise work between the GEMMs fuses; the capture records the compiled kernels."""
        from ..torch_graphs import StepGraphs
        from .interface import expose
        model = self.model

        def step(inputs):
            out = model(input_ids=inputs[0].unsqueeze(0), position_ids=inputs[1].unsqueeze(0),
                        use_cache=False, logits_to_keep=inputs[2], kvcache=cache)
            return out.logits[0]

        if compiled:
            expose(cache)
            step = torch.compile(step, dynamic=True, backend=COMPILE_BACKEND, mode=COMPILE_MODE)
        return StepGraphs(cache, step, self.device)

    def compiles(self, device) -> Optional[str]:
        dev = torch.device(device if device is not None else self.device)
        if dev.type != "cuda":
            return f"torch.compile of the step runs on CUDA devices only, not {dev.type!r}"
        from torch.utils._triton import has_triton
        if not has_triton():
            return "torch.compile needs Triton for this GPU, and it is not available"
        return None

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
        rows = logits.detach()
        tokens = rows.argmax(dim=-1)
        return tokens, torch.stack([tokens.to(torch.float64),
                                    token_logprobs(rows, tokens).to(torch.float64)])

    def greedy(self, logits, logprobs: bool = True) -> tuple[np.ndarray, np.ndarray]:
        picked = self._greedy_picks(logits, logprobs)[1].cpu().numpy()
        return picked[0].astype(np.int64), picked[1]

    def device_memory(self, device):
        dev = torch.device(device if device is not None else self.device)
        if dev.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(dev)
        # blocks the caching allocator keeps after tensors died (a dropped engine's pages) are
        # this process's to reuse
        return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev), total

    def process_memory(self, device):
        dev = torch.device(device if device is not None else self.device)
        return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None

    def peak_memory(self, device, run) -> int:
        dev = torch.device(device if device is not None else self.device)
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        run()
        torch.cuda.synchronize(dev)
        return max(0, torch.cuda.max_memory_allocated(dev) - before)

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
