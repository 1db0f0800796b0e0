"""What the engine needs from a model library: ``ModelAdapter`` (one instance wraps one model).

The transformers and the mlx-lm integrations each provide one; the engine's runner calls it.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Callable, Optional

import numpy as np

from ..cache import PagedKVCache
from ..config import CacheConfig
from ..errors import UnsupportedFeatureError

__all__ = ["ModelAdapter", "PendingPicks"]


def _log_sum_exp(table: np.ndarray) -> np.ndarray:
    """log(sum(exp(row))) of each row of ``table`` (B, V), shifted by the row's maximum."""
    top = table.max(axis=-1, keepdims=True)
    return top[:, 0] + np.log(np.exp(table - top).sum(axis=-1))


class ModelAdapter(abc.ABC):
    """What the engine needs from a model library (one instance wraps one model)."""

    family: str = ""
    """The model family (e.g. ``"llama"``), for messages."""
    vocab_size: int = 0
    """Logits per token; prompt token ids must lie in ``[0, vocab_size)``."""
    windows: dict = {}
    """{layer: sliding window in positions} of the model's windowed layers (none: empty)."""

    @abc.abstractmethod
    def cache_config(self, *, dtype: Optional[str], page_size: int, max_total_tokens: int,
                     max_batch_size: int, prefill_chunk_size: int) -> CacheConfig:
        """The cache configuration for this model: layers, heads and head_dim from the model's
        config, ``rope_mode="none"`` when the model rotates q/k itself, ``dtype`` (None: the
        model's own dtype) and the given sizes."""

    def layer_kinds(self) -> dict:
        """``{layer: kvcache.Window(w)}``: the model's sliding-window layers as
        ``CacheConfig.layer_kinds`` takes them (a library's ``sliding_window=W``, which counts
        the query itself, is ``Window(W - 1)``); empty: none. The engine builds window groups
        from it (``EngineConfig.window_groups``). Raises ``UnsupportedFeatureError`` naming the
        layer where the model's windowing is not understood (the engine then keeps every page,
        or refuses ``window_groups=True``)."""
        return {}

    def state_layers(self) -> dict:
        """``{layer: kvcache.State(...)}``: the model's recurrent-state layers (e.g. LFM2's short
        convolutions) as ``CacheConfig.layer_kinds`` takes them; empty: none. The engine always
        builds them (the model cannot run without them, whatever ``window_groups`` says) and
        turns off, or refuses by name, what does not compose with state layers
        (``Engine.state_layers_off``). The adapter's ``forward`` reads and writes them with
        ``cache.get_state`` / ``cache.set_state``."""
        return {}

    def default_device(self) -> Optional[str]:
        """The device the cache is created on when the engine is given none (the model's)."""
        return None

    def eos_token_ids(self) -> tuple:
        """The model's end-of-sequence token ids (where its library's own generation stops;
        from the model's config and generation config); () when it names none."""
        return ()

    def check(self, cache: PagedKVCache) -> None:
        """Raise ``UnsupportedFeatureError`` if the cache's backend lacks what the model needs
        (called once, right after the cache is created)."""

    def check_request(self, cache: PagedKVCache, what: str, length: int) -> None:
        """Raise ``UnsupportedFeatureError`` if a request of ``length`` tokens (prompt plus new
        tokens), named ``what`` in messages (e.g. ``"prompt 3"``), needs a feature the backend
        lacks: by default, a sliding window (``windows``) it outgrows on a backend without
        ``window_left``."""
        if not self.windows or cache.capabilities.window_left:
            return
        layer, window = min(self.windows.items(), key=lambda kv: kv[1])
        if length > window:
            raise UnsupportedFeatureError(
                f"{what}: {length} tokens (prompt + max_new_tokens) outgrow the "
                f"{self.family} model's sliding_window={window} (layer {layer}), and backend "
                f"{cache.backend.name!r} does not support per-query sliding-window attention "
                f"(capability 'window_left' not declared)")

    @abc.abstractmethod
    def forward(self, cache: PagedKVCache, tokens: np.ndarray, positions: np.ndarray,
                logit_rows: np.ndarray):
        """Run the model over one packed batch inside the cache's open forward.

        ``tokens`` (T,) int64: the new tokens of every sequence of the forward, in its order;
        ``positions`` (T,) int64: each token's position in its sequence; ``logit_rows`` (B,)
        int64: the rows of ``tokens`` whose next-token logits are wanted (B may be 0).
        Returns the logits ``(B, vocab_size)`` as any array ``to_numpy`` accepts.
        """

    def graphs_by_default(self, device: Optional[str]) -> Optional[bool]:
        """Whether whole-step decode graphs suit the model on ``device`` (the cache's device):
        None when the adapter cannot capture its model's steps, True where a replay saves host
        time (a GPU), False where it saves nothing (a CPU: ``graphs=True`` runs the stand-in)."""
        return None

    def step_graphs(self, cache: PagedKVCache, compiled: bool = False):
        """A runner of whole steps (model and cache) captured per bucket on ``cache`` (built
        with ``static_decode=True``: decode steps per batch bucket; with ``static_mixed`` also
        mixed steps per token bucket): an object with ``run(tokens, positions, logit_rows)``
        returning the logits of ``logit_rows`` as ``forward`` does, and
        ``captures`` / ``replays`` counters. ``compiled``: the step's model code compiled
        (only when ``compiles`` says it can be). Only called when ``graphs_by_default`` is not
        None."""
        raise NotImplementedError

    def compiles(self, device: Optional[str]) -> Optional[str]:
        """None when the captured decode step's model code can be compiled on ``device``
        (``torch.compile``: norms, activations and residuals fused around the cache's
        attention), else why not."""
        return f"the {self.family or type(self).__name__} adapter does not compile its model"

    def session(self, cache: PagedKVCache):
        """A context manager held while the engine on ``cache`` has work (from its first step
        to its last: one ``generate`` call, or a run of online ``step`` calls), e.g. switching
        the model's attention to the cache and back. Another engine over the same model may
        hold its own session at the same time, opened and closed in any order: what it changes
        on the model must be shared (counted per model), not saved and restored per session."""
        return contextlib.nullcontext()

    def batch_invariant_ops(self):
        """A context manager under which the model's own ops give each row the same bits
        whatever the other rows (``Engine(deterministic=True)`` enters it around the model's
        code and the picks of every step), or None where the adapter has none (such an engine
        is then refused)."""
        return None

    def step_context(self, cache: PagedKVCache):
        """A context manager around each engine step on ``cache`` (its forward and its picks),
        left before the step returns or raises: per-thread state the model needs while it runs
        (e.g. torch's inference mode), so the caller's thread is as it was between steps, and
        engines stepped in turn never leave their state to each other."""
        return contextlib.nullcontext()

    def device_memory(self, device: Optional[str]) -> Optional[tuple]:
        """``(free bytes, total bytes)`` of the accelerator ``device`` (the cache's), or None
        where there is none to ask (a CPU, unified memory): the engine then takes a default
        ``max_total_tokens``. Free is what this process can still allocate there: the device's
        free memory and what this process's allocator holds unused."""
        return None

    def process_memory(self, device: Optional[str]) -> Optional[int]:
        """Bytes of ``device`` memory this process's tensors hold now (None: unknown), for the
        sizing error's account of who holds the memory."""
        return None

    def peak_memory(self, device: Optional[str], run: Callable[[], object]) -> int:
        """Bytes of device memory that ``run()`` takes at its peak beyond what was in use before
        (the engine profiles one largest step with it). Only called when ``device_memory`` is
        not None."""
        raise NotImplementedError

    def to_numpy(self, logits) -> np.ndarray:
        """Logits as a host float64 array."""
        from ..arrays import to_numpy
        return np.asarray(to_numpy(logits), np.float64)

    def greedy(self, logits, logprobs: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Greedy picks of logits ``(B, vocab_size)``: the argmax of each row (the first of
        equal maxima) as ``(B,)`` int64 and its log-probability (the logit minus the row's
        log-sum-exp) as ``(B,)`` float64, or NaN where ``logprobs`` is false (nobody asked: the
        log-sum-exp is the larger part of a pick's device time). An adapter on an accelerator
        computes them there, so a step moves ``2 * B`` numbers to the host instead of
        ``B * vocab_size``."""
        rows = self.to_numpy(logits)
        tokens = rows.argmax(axis=-1)
        if not logprobs:
            return tokens.astype(np.int64), np.full(len(rows), np.nan)
        return tokens.astype(np.int64), rows[np.arange(len(rows)), tokens] - _log_sum_exp(rows)

    def step_tokens(self, tokens: np.ndarray, picks: "PendingPicks", dst: np.ndarray,
                    src: np.ndarray):
        """The input token ids of a forward planned before the previous step's picks reached
        the host: ``tokens`` (T,) int64, where the entries at ``dst`` ((K,) int64) stand for
        the picks at rows ``src`` ((K,) int64) of ``picks`` (that step's ``greedy_async``).
        Returns them as ``forward`` takes them. An adapter on an accelerator gathers the picks
        there; this default waits for them on the host."""
        out = np.array(tokens, np.int64)
        out[dst] = picks.result()[0][src]
        return out

    def greedy_async(self, logits, logprobs: bool = True) -> "PendingPicks":
        """``greedy`` without waiting for the device: the picks stay where the logits are (the
        next step's token ids, fed to ``forward`` as they are) while their copy to the host is
        under way. Default: computed at once (``greedy``)."""
        tokens, lps = self.greedy(logits, logprobs)
        return PendingPicks(tokens, lambda: (tokens, lps))


class PendingPicks:
    """A greedy step's picks on their way to the host (``ModelAdapter.greedy_async``).

    ``tokens``: the picked token ids ``(B,)`` as the adapter's ``forward`` takes them (on the
    device for a torch model), valid as the next step's input before the host has them;
    ``result()``: waits for the host copy and returns ``(tokens (B,) int64, logprobs (B,)
    float64)`` as numpy arrays."""

    def __init__(self, tokens, result: Callable[[], tuple]):
        self.tokens = tokens
        self._result = result

    def result(self) -> tuple:
        """Wait until the picks reach the host (on a GPU: that step's copy only, not the work
        queued behind it), then return ``(tokens, logprobs)``: ``(B,)`` int64 and ``(B,)``
        float64 numpy arrays, the log-probabilities NaN where the step did not ask for them.
        Callable more than once."""
        return self._result()
