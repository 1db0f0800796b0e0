"""A continuous-batching generator over a ``PagedKVCache``, neutral to the model library.

The scheduler owns requests, samples and sequences; a ``ModelAdapter`` owns the model (one
forward over the packed batch, returning the logits of the tokens that need them). The
transformers integration and the mlx-lm integration each provide an adapter and reuse
``Engine`` unchanged.

Scheduling, per step (one forward):

* every sequence holds ``tokens`` (what it must have in the cache) and ``cached`` (what it has);
  its pending tokens ``tokens[cached:]`` are one token for a decoding sample and a chunk of the
  prompt for a prefill;
* decodes first, oldest first; then prefills oldest first, chunked to the forward's token budget
  (``prefill_chunk_size``) and admitted only while the free pages cover them;
* prompts with a common prefix (at least one page long) get a *prefix sequence* that is
  prefilled once; each prompt forks from it (the pages are shared). Prefixes nest;
* ``n > 1`` samples: the prompt's sequence is prefilled once, then each sample forks from it;
* the oldest unfinished sequence (the *head*) is in every forward and is never preempted: when
  the free pages do not cover a token of it, the youngest other sequences in the cache are
  preempted until they do (the prefix it is about to fork from last: without it, it starts from
  scratch). So every forward advances the oldest request, and every request that fits the cache
  alone (its prompt plus ``max_new_tokens - 1`` tokens; others are refused up front) finishes;
* a forward that does not fit (``CacheFullError``) preempts the youngest sequence in the cache
  other than the head (removed, its pages freed) and is retried; the preempted sequence is
  recomputed later from its tokens (re-forking from its prefix when that is still in the
  cache). With a host tier (``offload``) a preempted prompt or sample is parked in host memory
  instead (``kvcache.HostTier``) and restored when it is scheduled again, re-sharing its prefix
  when that is still in the cache: nothing is recomputed unless the tier is full.

Sampling is in float64, where the logits are (``ModelAdapter.greedy`` / ``sample``): greedy
(``temperature == 0``) is the first argmax; otherwise
each sample draws from ``softmax(logits / temperature)`` with its own generator seeded by
``(seed, prompt index, sample index)``, so the result does not depend on batching or preemption.
The log-probability reported for a token is ``log_softmax(logits)`` at that token (the model's
distribution, before temperature).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import math
import sys
from collections.abc import Iterable
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from ..cache import PagedKVCache
from ..config import CacheConfig
from ..errors import CacheFullError, InvalidArgumentError, KVCacheError, UnsupportedFeatureError
from ..transfer import HostTier
from .sampling import SamplingParams, draw_rows

__all__ = ["Engine", "EngineStats", "ModelAdapter", "PendingPicks"]


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

    def check_request(self, cache: PagedKVCache, index: int, length: int) -> None:
        """Raise ``UnsupportedFeatureError`` if a request of ``length`` tokens (prompt plus new
        tokens), prompt number ``index``, needs a feature the backend lacks: by default, a
        sliding window (``windows``) it outgrows on a backend without ``window_left``."""
        if not self.windows or cache.capabilities.window_left:
            return
        layer, window = min(self.windows.items(), key=lambda kv: kv[1])
        if length > window:
            raise UnsupportedFeatureError(
                f"prompt {index}: {length} tokens (prompt + max_new_tokens) outgrow the "
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

    def step_graphs(self, cache: PagedKVCache):
        """A runner of whole decode steps (model and cache) captured per batch bucket on
        ``cache`` (built with ``static_decode=True``): an object with ``run(tokens, positions,
        logit_rows)`` returning the logits of ``logit_rows`` as ``forward`` does, and
        ``captures`` / ``replays`` counters. Only called when ``graphs_by_default`` is not None."""
        raise NotImplementedError

    def session(self, cache: PagedKVCache):
        """A context manager around one ``generate`` call on ``cache`` (e.g. switching the
        model's attention to the cache and back)."""
        return contextlib.nullcontext()

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

    def sample(self, logits, rows: np.ndarray, uniforms: np.ndarray,
               temperature: float) -> tuple[np.ndarray, np.ndarray]:
        """Draws from logits ``(B, vocab_size)`` at ``temperature`` > 0: draw ``d`` takes row
        ``rows[d]`` (``(D,)`` int64; a row may be drawn from several times, one per parallel
        sample) and the uniform number ``uniforms[d]`` in [0, 1) (``(D,)`` float64): its token is
        the first whose cumulative tempered probability exceeds ``uniforms[d]`` (inverse-CDF
        sampling). Returns the tokens ``(D,)`` int64 and their log-probabilities under the
        untempered distribution ``(D,)`` float64. An adapter on an accelerator draws there and
        moves ``2 * D`` numbers to the host."""
        table = self.to_numpy(logits)[np.asarray(rows, np.int64)]
        top = table.max(axis=-1, keepdims=True)
        logz = _log_sum_exp(table)
        cdf = np.cumsum(np.exp((table - top) / temperature), axis=-1)
        goal = np.asarray(uniforms, np.float64) * cdf[:, -1]
        tokens = np.minimum((cdf <= goal[:, None]).sum(axis=-1), table.shape[1] - 1)
        return tokens.astype(np.int64), table[np.arange(len(table)), tokens] - logz

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


@dataclasses.dataclass
class EngineStats:
    """Counters over the engine's life (``generate`` adds to them)."""

    forwards: int = 0
    """Model forwards run (one per scheduler step that ran)."""
    prefill_tokens: int = 0
    """Tokens run as prompt chunks (including recomputation after preemption)."""
    decode_tokens: int = 0
    """Tokens run as one-token decode steps."""
    forks: int = 0
    """Sequences started by forking (shared prefix or parallel sample)."""
    shared_prefix_tokens: int = 0
    """Prompt tokens not computed because a fork shared them."""
    preemptions: int = 0
    """Sequences removed to make room (recomputed later, or parked in the host tier)."""
    recomputed_tokens: int = 0
    """Tokens computed again after preemption."""
    offloaded_tokens: int = 0
    """Tokens parked in the host tier by preemptions."""
    recompute_tokens_saved: int = 0
    """Tokens restored from the host tier instead of being computed again."""
    graph_forwards: int = 0
    """Forwards run through a captured whole-step graph (decode steps; captures included)."""
    graph_captures: int = 0
    """Whole-step graphs captured (one per batch bucket, again if the cache's buffers moved)."""
    overlapped_forwards: int = 0
    """Greedy steps launched before the host had the previous step's picks (decode runs, and
    pipelined steps with prompt chunks)."""

    @property
    def forward_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclasses.dataclass(eq=False)
class _Seq:
    sid: int
    kind: str                          # "prefix" | "prompt" | "sample"
    tokens: list
    order: tuple                       # smaller is older; the youngest is preempted first
    parent: Optional["_Seq"] = None    # sequence it forks from when admitted
    origin: Optional["_Seq"] = None    # the sequence it shares a prefix with (re-fork after preemption)
    fork_pos: int = 0
    cached: int = 0
    parked: int = 0                    # tokens held in the host tier (0: none)
    live: bool = False                 # holds a sequence in the cache
    retired: bool = False              # done (removed for good): dependants start from scratch
    waiting: int = 0                   # dependants not yet forked from it
    request: int = -1
    sample: int = -1
    computed: int = 0                  # tokens ever run for it (recompute accounting)

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.cached

    def go_on_as_sample(self) -> None:
        """A prompt's sequence with one sample (``n == 1``) goes on as that sample."""
        self.kind, self.sample = "sample", 0
        self.order = (self.request, 2, 0)


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
        return self._result()


class _Pick(NamedTuple):
    """One sample's pick at one step: the token and its log-probability."""

    token: int
    logprob: float


@dataclasses.dataclass(eq=False)
class _Sample:
    rng: np.random.Generator
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    done: bool = False
    planned: int = 0                   # picks launched for it (pipelined steps: some in flight)
    max_new: int = 0                   # its own max_tokens (SamplingParams); 0: generate's
    stops: Optional[frozenset] = None  # its own stop ids (SamplingParams); None: generate's
    params: Optional[SamplingParams] = None
    seed: int = 0                      # its draws' seed (SamplingParams)


_SLOT = -1
"""A token id in ``_Seq.tokens`` that stands for a pick still on its way (pipelined steps)."""


class _Inflight(NamedTuple):
    """A pipelined step whose picks the host has not read yet."""

    wants: list            # the sequences taking its picks: row k is wants[k]
    picks: PendingPicks
    slots: dict            # id(seq) -> (index of its _SLOT token, row): the sequences that go on


class Engine:
    """Continuous-batching generation on one ``PagedKVCache`` for one model adapter.

    ``backend``/``device``: as ``PagedKVCache`` (device None: the adapter's default, the
    model's device). ``dtype``: cache dtype (None: the model's). ``page_size``,
    ``max_batch_size`` (sequences in one forward), ``max_total_tokens`` (token capacity; None:
    ``512 * max_batch_size``), ``prefill_chunk_size`` (tokens in one forward; None:
    ``min(8192, max_total_tokens)``: a forward that admits prompts ends with the host reading
    its picks before the next is planned, so fewer, larger prefill steps keep the device busier;
    measured in docs/performance.md). The cache is ``self.cache``; counters are ``self.stats``.

    ``graphs``: whole-step decode graphs. A pure decode step (one token per sequence already in
    the cache) runs the model and the cache through a graph captured once per batch bucket and
    replayed afterwards; prefill and mixed steps run eagerly. None (default): on where the
    backend declares ``static_decode`` and the adapter says the device gains from it (a GPU);
    True: on (``UnsupportedFeatureError`` when the backend or the adapter cannot; on a CPU the
    capture is a stand-in that re-runs the step); False: off. ``graph_batch_sizes``: the buckets
    (None: powers of two up to ``max_batch_size``; see ``CacheConfig.static_decode_batch_sizes``).
    ``self.graphs`` tells whether graphs are on; ``self.decode_graphs`` is the adapter's runner
    (``captures`` / ``replays`` counters), None when off.

    ``offload``: what a preemption does with the sequence it evicts. True: park it in a host
    tier (``self.host_tier``, a ``kvcache.HostTier`` of ``offload_tokens`` tokens, None:
    ``max_total_tokens``) and restore it when it runs again; False: drop it and recompute it
    later; None (default): on when the cache lives on an accelerator (its device is not the
    host CPU), where host memory is a second, larger tier and a copy is far cheaper than the
    forwards it saves; off on a CPU cache, where the tier would only take more of the same RAM
    than ``max_total_tokens`` allows. ``stats.offloaded_tokens`` and
    ``stats.recompute_tokens_saved`` count what it did.

    ``overlap`` (default True): in greedy generation the host stays one step ahead of the
    device: step N+1 is planned and launched with step N's picked tokens where they are (on the
    device) before the host waits for them, so the device does not idle while the host
    schedules, plans and launches (``stats.overlapped_forwards``). Runs of pure decode steps over
    a fixed set of sequences do it step after step; with one sample per prompt, steps with
    prompt chunks and the ends of those runs are pipelined too: the sequences that will take
    step N's picks get a placeholder token that the next step reads from the picks on the
    device (``ModelAdapter.step_tokens``), and a sample that step N stops on a stop token drops
    the step already launched for it. The tokens are the same as with ``overlap=False``.
    """

    def __init__(self, adapter: ModelAdapter, backend: str = "auto", device: Optional[str] = None,
                 dtype: Optional[str] = None, page_size: int = 16,
                 max_total_tokens: Optional[int] = None, max_batch_size: int = 64,
                 prefill_chunk_size: Optional[int] = None, graphs: Optional[bool] = None,
                 graph_batch_sizes: Optional[Sequence[int]] = None,
                 offload: Optional[bool] = None, offload_tokens: Optional[int] = None,
                 overlap: bool = True):
        if not isinstance(overlap, bool):
            raise InvalidArgumentError(f"overlap={overlap!r} must be True or False")
        if graphs is not None and not isinstance(graphs, bool):
            raise InvalidArgumentError(f"graphs={graphs!r} must be None, True or False")
        if offload is not None and not isinstance(offload, bool):
            raise InvalidArgumentError(f"offload={offload!r} must be None, True or False")
        if max_total_tokens is None:
            max_total_tokens = 512 * int(max_batch_size)
        if prefill_chunk_size is None:
            prefill_chunk_size = min(8192, int(max_total_tokens))
        self.adapter = adapter
        config = adapter.cache_config(dtype=dtype, page_size=page_size,
                                      max_total_tokens=max_total_tokens,
                                      max_batch_size=max_batch_size,
                                      prefill_chunk_size=prefill_chunk_size)
        device = device if device is not None else adapter.default_device()
        self.graphs = self._want_graphs(graphs, backend, device)
        if self.graphs:
            config = dataclasses.replace(config, static_decode=True,
                                         static_decode_batch_sizes=tuple(graph_batch_sizes or ()))
        self.cache = PagedKVCache(config, backend=backend, device=device)
        adapter.check(self.cache)
        self.decode_graphs = adapter.step_graphs(self.cache) if self.graphs else None
        self.config = config
        if offload is None:     # (payloads hold one head dim: no host tier for head_dim_v)
            offload = (not str(self.cache.backend.device or "cpu").startswith("cpu")
                       and config.head_dim_v == config.head_dim)
        self.host_tier: Optional[HostTier] = (
            HostTier(self.cache, config.max_total_tokens if offload_tokens is None else offload_tokens)
            if offload else None)
        """Where preempted sequences are parked (None: offload is off, they are recomputed)."""
        self.overlap = overlap
        """Greedy steady decode with the host one step ahead (``_decode_overlapped``)."""
        self._logprobs = True            # the running generate returns log-probabilities
        self.stats = EngineStats()
        self.progress: Optional[bool] = None           # None: a bar on a TTY only; True / False force it
        self._next_sid = 0
        self._head: Optional[_Seq] = None   # the oldest unfinished sequence: never preempted

    def _want_graphs(self, graphs: Optional[bool], backend: str, device: Optional[str]) -> bool:
        if graphs is False:
            return False
        from ..plugins import resolve_backend
        cls = resolve_backend(backend, device)
        fits = self.adapter.graphs_by_default(device)
        if graphs is None:
            return bool(fits) and cls.capabilities.static_decode
        if fits is None:
            raise UnsupportedFeatureError(
                f"graphs=True: the {self.adapter.family or type(self.adapter).__name__} adapter "
                f"cannot capture its model's decode steps; pass graphs=False")
        if not cls.capabilities.static_decode:
            raise UnsupportedFeatureError(
                f"graphs=True: backend {cls.name!r} does not declare 'static_decode' "
                f"(static-shape decode steps a graph can replay); pass graphs=False")
        return True

    # ------------------------------------------------------------------ public
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, n: int = 1,
                 temperature: float = 0.0, seed: int = 0,
                 stop_token_ids: Optional[Sequence[int]] = None, return_logprobs: bool = False,
                 ignore_eos: bool = False, sampling_params=None):
        """Generate ``max_new_tokens`` tokens (fewer when a stop token is produced; it is kept)
        for each of ``n`` samples of each prompt.

        A sample stops at a token of ``stop_token_ids`` and, unless ``ignore_eos``, at one of
        the model's end-of-sequence ids (``adapter.eos_token_ids()``: its config and generation
        config), as the library's own generation does; the stop token is the sample's last.

        ``prompts``: token id lists (each non-empty). Returns ``out[i][j]``: the new token ids of
        sample ``j`` of prompt ``i``; with ``return_logprobs`` the pair ``(out, logprobs)``,
        ``logprobs[i][j][t]`` the model's log-probability of token ``out[i][j][t]``. Greedy when
        ``temperature == 0``; otherwise sampling, reproducible for a given ``seed`` (>= 0).

        Every request that fits the cache alone finishes, however many share it (see
        ``_schedule``): one sequence of it holds its prompt and ``max_new_tokens - 1`` tokens.
        One that does not fit even alone, or a bad argument, raises ``InvalidArgumentError``
        (naming the prompt or the value) before anything runs.

        ``sampling_params``: a ``SamplingParams`` for every prompt, or a list of them (one per
        prompt), instead of ``max_new_tokens``, ``n``, ``temperature``, ``seed``,
        ``stop_token_ids`` and ``ignore_eos`` (which must then keep their defaults): each
        request is filtered (top-k, top-p, min-p) and drawn on the logits' device with its own
        seed (``kvcache.integrations.sampling``). Logprobs come back (the pair) when
        ``return_logprobs`` or any request's ``logprobs`` is set.
        """
        if sampling_params is not None:
            return self._generate_params(prompts, sampling_params, return_logprobs, dict(
                max_new_tokens=(max_new_tokens, 32), n=(n, 1), temperature=(temperature, 0.0),
                seed=(seed, 0), stop_token_ids=(stop_token_ids, None), ignore_eos=(ignore_eos, False)))
        prompts, max_new, n, temperature, stops, seed = self._check_args(
            prompts, max_new_tokens, n, temperature, stop_token_ids, seed)
        if not isinstance(ignore_eos, bool):
            raise InvalidArgumentError(f"ignore_eos={ignore_eos!r} must be True or False")
        if not ignore_eos:
            stops |= {int(t) for t in self.adapter.eos_token_ids()}
        return self._generate(prompts, max_new, n, temperature, seed, stops, return_logprobs)

    def _generate_params(self, prompts, sampling_params, return_logprobs, others):
        """``generate`` with ``SamplingParams`` (one, or a list with one per prompt)."""
        changed = [k for k, (value, default) in others.items()
                   if value is not default and value != default]
        if changed:
            raise InvalidArgumentError(
                f"generate takes sampling_params or {', '.join(changed)}, not both: put them in "
                f"the SamplingParams")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidArgumentError(
                f"prompts must be a list of token id lists, got {type(prompts).__name__}")
        params = sampling_params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if isinstance(params, (str, bytes)) or not isinstance(params, Sequence) \
                or len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
            raise InvalidArgumentError(
                f"sampling_params must be a SamplingParams or a list of {len(prompts)} of them "
                f"(one per prompt), got {sampling_params!r:.80}")
        prompts = self._check_args(prompts, [p.max_tokens for p in params], 1, 0.0, None, 0)[0]
        eos = frozenset(int(t) for t in self.adapter.eos_token_ids())
        requests = [(p, frozenset(p.stop_token_ids or ()) | (frozenset() if p.ignore_eos else eos))
                    for p in params]
        greedy = all(p.greedy for p in params)
        logprobs = bool(return_logprobs) or any(p.logprobs is not None for p in params)
        return self._generate(prompts, max(p.max_tokens for p in params), max(p.n for p in params),
                              0.0 if greedy else 1.0, 0, set(), logprobs, requests)

    def _generate(self, prompts, max_new, n, temperature, seed, stops, return_logprobs,
                  params=None):
        if not self.cache.is_empty:
            raise InvalidArgumentError(
                f"generate needs an empty cache, but it holds {self.cache.num_sequences} sequences "
                f"(another generate did not finish?); call engine.cache.clear()")
        self._logprobs = bool(return_logprobs)
        try:
            with self.adapter.session(self.cache):
                out = self._run(prompts, max_new, n, temperature, seed, stops, params)
        except BaseException:
            self.cache.clear()
            raise
        finally:
            if self.host_tier is not None:
                self.host_tier.clear()
        tokens = [[s.tokens for s in req] for req in out]
        if return_logprobs:
            return tokens, [[s.logprobs for s in req] for req in out]
        return tokens

    # ------------------------------------------------------------------ checks
    def _check_args(self, prompts, max_new_tokens, n, temperature, stop_token_ids, seed):
        def whole(value, name, low):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise InvalidArgumentError(f"{name}={value!r} must be an integer >= {low}")
            return int(value)

        per = max_new_tokens if isinstance(max_new_tokens, list) else None   # one per prompt
        max_new = whole(max(per) if per else max_new_tokens, "max_new_tokens", 1)
        n = whole(n, "n", 1)
        seed = whole(seed, "seed", 0)               # numpy's generators take no negative seed
        try:
            temperature = float(temperature)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"temperature={temperature!r} must be a number >= 0") from None
        if not math.isfinite(temperature) or temperature < 0:
            raise InvalidArgumentError(f"temperature={temperature!r} must be a finite number >= 0")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidArgumentError(
                f"prompts must be a list of token id lists, got {type(prompts).__name__}")
        vocab = int(self.adapter.vocab_size)
        cfg, out = self.config, []
        pages = self.cache.num_total_pages - 1
        for i, p in enumerate(prompts):
            try:
                arr = np.asarray(p)
            except Exception:
                arr = np.asarray([None])
            if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
                raise InvalidArgumentError(
                    f"prompt {i} must be a non-empty list of integer token ids, got {p!r:.80}")
            bad = (arr < 0) | (arr >= vocab)
            if bad.any():
                k = int(np.argmax(bad))
                raise InvalidArgumentError(
                    f"prompt {i}: token {int(arr[k])} at index {k} is outside the model's "
                    f"vocabulary [0, {vocab})")
            limit = per[i] if per else max_new
            length = arr.size + limit
            # what one sequence of the request holds at most: its prompt and every new token
            # but the last (never run). The scheduler can always shrink to that one sequence
            # (preempting the rest, prefixes included), so this is all a request must fit
            need = -(-(length - 1) // cfg.page_size)
            if need > pages:
                raise InvalidArgumentError(
                    f"prompt {i}: {arr.size} tokens + max_new_tokens={limit} hold up to "
                    f"{length - 1} tokens in the cache, {need} pages of {cfg.page_size}, more "
                    f"than the cache holds even for this request alone ({pages} pages, "
                    f"max_total_tokens={cfg.max_total_tokens}); raise max_total_tokens or lower "
                    f"max_new_tokens")
            self.adapter.check_request(self.cache, i, length)
            out.append([int(t) for t in arr])
        if stop_token_ids is None:
            stop_token_ids = ()
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Iterable):
            raise InvalidArgumentError(
                f"stop_token_ids={stop_token_ids!r:.80} must be a sequence of integer token ids")
        stops = set()
        for t in stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise InvalidArgumentError(f"stop_token_ids must hold integer ids, got {t!r:.80}")
            stops.add(int(t))
        return out, max_new, n, temperature, stops, seed

    # ------------------------------------------------------------------ scheduler
    def _new_seq(self, **kw) -> _Seq:
        seq = _Seq(sid=self._next_sid, **kw)
        self._next_sid += 1
        return seq

    def _plan_prefixes(self, prompts) -> list:
        """A prefix sequence for each group of prompts sharing at least a page; returns, per
        prompt, the prefix sequence it forks from (or None)."""
        minimum = self.config.page_size
        parents: list = [None] * len(prompts)
        arrays = [np.asarray(p) for p in prompts]

        def common(idx, start):
            first = arrays[idx[0]]
            length = len(first)
            for i in idx[1:]:
                other = arrays[i]
                m = min(length, len(other))
                diff = np.nonzero(first[start:m] != other[start:m])[0]
                length = start + int(diff[0]) if diff.size else m
            return length

        def build(idx, depth, parent):
            # every prompt of idx shares its first `depth` tokens (held by `parent`, if any)
            groups: dict = {}
            for i in idx:
                if len(arrays[i]) > depth:
                    groups.setdefault(int(arrays[i][depth]), []).append(i)
                else:
                    parents[i] = parent
            for members in groups.values():
                if len(members) == 1:
                    parents[members[0]] = parent
                    continue
                length = common(members, depth)
                node = parent
                if length >= minimum and (parent is None or length > len(parent.tokens)):
                    node = self._new_seq(kind="prefix", tokens=list(prompts[members[0]][:length]),
                                         order=(min(members), 0, length), origin=parent)
                    self._attach(node, parent)
                    self._prefixes.append(node)
                build(members, length, node)

        build(list(range(len(prompts))), 0, None)
        return parents

    def _run(self, prompts, max_new, n, temperature, seed, stops, params=None):
        cache, stats = self.cache, self.stats
        self._prefixes: list = []
        parents = self._plan_prefixes(prompts)
        if params is None:
            samples = [[_Sample(np.random.default_rng([seed, i, j])) for j in range(n)]
                       for i in range(len(prompts))]
        else:                           # per request: (SamplingParams, its stop ids)
            samples = [[_Sample(np.random.default_rng(0), max_new=p.max_tokens, stops=st,
                                params=p, seed=p.sample_seed(j)) for j in range(p.n)]
                       for p, st in params]
        seqs: list = list(self._prefixes)
        for i, p in enumerate(prompts):
            seq = self._new_seq(kind="prompt", tokens=list(p), order=(i, 1, 0), request=i)
            seq.origin = parents[i]
            self._attach(seq, parents[i])
            seqs.append(seq)
        self._seqs = seqs
        total = sum(smp.max_new or max_new for req in samples for smp in req)
        produced = 0
        bar = _Progress(total, self.progress)
        if temperature == 0.0:
            def pick(wants, logits):
                tokens, logprobs = self.adapter.greedy(logits, self._logprobs)
                return [_Pick(int(t), float(lp)) for t, lp in zip(tokens, logprobs)]
        else:
            def pick(wants, logits):
                return self._sample(wants, logits, samples, temperature)
        # greedy steps with prompt chunks are pipelined: step N+1 is planned and launched
        # before the host reads step N's picks (see _expect / _settle)
        pipelined = self.overlap and temperature == 0.0 and n == 1
        inflight: Optional[_Inflight] = None
        try:
            while True:
                batch = self._schedule()
                if batch is None:
                    if inflight is None:
                        break
                    produced += self._settle(inflight, samples, max_new, stops)   # the last picks
                    inflight = None
                    bar.update(produced)
                    continue
                if self.overlap and temperature == 0.0 and self._steady(batch):
                    ran = self._decode_overlapped(batch, samples, max_new, stops, inflight,
                                                  hand_over=pipelined)
                    if ran is not None:
                        made, inflight = ran            # the run read the step before
                        produced += made
                        bar.update(produced)
                        continue
                    # no room for the step: the ordinary path preempts to make some
                if pipelined:
                    launched = self._step(batch, None, inflight)
                    if launched is None:
                        continue                        # preempted: plan again
                    if inflight is not None:
                        self.stats.overlapped_forwards += 1
                    after = self._expect(*launched, samples, max_new)
                    if inflight is not None:
                        produced += self._settle(inflight, samples, max_new, stops)
                    inflight = after
                    bar.update(produced)
                    continue
                ran = self._step(batch, pick)
                if ran is None:
                    continue                            # preempted: plan again
                for seq, row in ran:
                    produced += self._consume(seq, row, samples, max_new, n, stops)
                bar.update(produced)
        finally:
            bar.close()
        return samples

    def _steady(self, batch) -> bool:
        """Whether ``batch`` is a steady decode step: every sequence in it decodes one token,
        and no other work waits that a later step could take in (the batch is full, or nothing
        else is pending)."""
        if any(not (s.live and s.kind == "sample" and s.pending == 1 and n == 1) for s, n in batch):
            return False
        if len(batch) == self.config.max_batch_size:
            return True
        inside = {id(s) for s, _ in batch}
        return not any(not s.retired and s.pending > 0 and id(s) not in inside for s in self._seqs)

    def _decode_overlapped(self, batch, samples, max_new: int, stops,
                           before: Optional[_Inflight] = None,
                           hand_over: bool = False) -> Optional[tuple]:
        """Greedy decode steps of a fixed set of sequences with the host one step ahead: step
        N+1 is planned and launched, its token ids taken from step N's picks where they are (on
        the device), before the host waits for step N's picks. Runs while every sequence goes
        on (no sample reaches ``max_new_tokens`` with the step in flight, none hits a stop
        token, the cache has room). A sample that stopped on a stop token had one more step
        queued: that step's pick is dropped for it (its sequence was removed) and kept for the
        others, then the loop ends. ``before``: a pipelined step still in flight whose picks
        some of ``seqs`` take as their first token; they are read (``_settle``) once the first
        step is launched. Returns None when the first step does not fit in the cache (nothing
        ran), else ``(tokens produced, last)``: with ``hand_over`` the last step's picks are
        booked (``_expect``), not read, and ``last`` is that step, for the next one to be
        launched before they are read; without, ``last`` is None."""
        seqs = [s for s, _ in batch]
        smps = [samples[s.request][s.sample] for s in seqs]
        tokens = self._input_tokens([s.tokens[-1] for s in seqs], before,
                                    [(s, s.cached, 1) for s in seqs])
        inflight = self._launch(seqs, tokens)
        if inflight is None:
            return None
        produced = 0
        if before is not None:
            self.stats.overlapped_forwards += 1
            produced = self._settle(before, samples, max_new, stops)
        while True:
            # launch the next step unless a sample ends with the one in flight (its length) or
            # ended on a stop token in the one consumed last
            go_on = (not any(m.done for m in smps)
                     and all(len(m.tokens) + 1 < (m.max_new or max_new) for m in smps))
            nxt = self._launch(seqs, inflight.tokens) if go_on else None
            if nxt is not None:
                self.stats.overlapped_forwards += 1
            elif hand_over:
                return produced, self._expect(seqs, inflight, samples, max_new)
            tokens, logprobs = inflight.result()
            for k, seq in enumerate(seqs):     # a stopped sample takes no more tokens
                produced += self._consume(seq, _Pick(int(tokens[k]), float(logprobs[k])),
                                          samples, max_new, 1, stops)
            if nxt is None:
                return produced, None
            inflight = nxt

    def _launch(self, seqs: list, tokens) -> Optional[PendingPicks]:
        """Run one decode step of ``seqs`` (one token each: ``tokens``, host or device) and
        start its greedy picks; None when the cache has no room for it (nothing changed)."""
        cache, stats = self.cache, self.stats
        ids = [s.sid for s in seqs]
        positions = np.asarray([s.cached for s in seqs], np.int64)
        rows = np.arange(len(seqs), dtype=np.int64)
        try:
            with cache.forward(ids, [1] * len(ids)):
                if self.decode_graphs is not None and cache.static_bucket is not None:
                    before = self.decode_graphs.captures
                    logits = self.decode_graphs.run(tokens, positions, rows)
                    stats.graph_forwards += 1
                    stats.graph_captures += self.decode_graphs.captures - before
                else:
                    logits = self.adapter.forward(cache, tokens, positions, rows)
        except CacheFullError:
            return None
        stats.forwards += 1
        stats.decode_tokens += len(seqs)
        for seq in seqs:
            seq.cached += 1
            seq.computed = max(seq.computed, seq.cached)
        return self.adapter.greedy_async(logits, self._logprobs)

    def _attach(self, seq: _Seq, parent: Optional[_Seq]) -> None:
        """Make ``seq`` fork from ``parent`` (a prefix sequence, or the nearest one of its
        origins still in use) when admitted; from nothing when none is."""
        while parent is not None and parent.retired:
            parent = parent.origin
        if parent is not None:
            seq.parent = parent
            seq.fork_pos = min(len(parent.tokens), len(seq.tokens) - 1)
            parent.waiting += 1
        else:
            seq.parent, seq.fork_pos = None, 0

    def _ready(self, seq: _Seq) -> bool:
        p = seq.parent
        return p is None or p.retired or (p.live and p.cached >= seq.fork_pos)

    def _schedule(self):
        """The next forward: a list of (seq, chunk length), or None when all work is done.

        The oldest unfinished sequence (the *head*, ``self._head``) is always in it: when the
        free pages do not cover a token of it, other sequences are preempted for it (the
        youngest first, the prefix it forks from last) and the plan is made again; the head
        itself is never preempted (``_preempt(keep=head)`` here and in ``_step``). So every
        forward advances the head, and a request that fits the cache alone finishes."""
        while True:
            work = [s for s in self._seqs if not s.retired and s.pending > 0]
            if not work:
                return None
            is_decode = [s.live and s.kind == "sample" and s.pending == 1 for s in work]
            decodes = sorted((s for s, d in zip(work, is_decode) if d), key=lambda s: s.order)
            rest = sorted((s for s, d in zip(work, is_decode) if not d), key=lambda s: s.order)
            head = min(decodes[:1] + rest[:1], key=lambda s: s.order)
            while not self._ready(head):           # (a parent is older: this ends at once)
                assert head.parent is not None
                head = head.parent
            alone = not any(s.live and s is not head for s in self._seqs)
            batch = self._plan(decodes, rest, head, force=alone)
            if batch is not None:
                self._head = head
                return batch
            self._preempt("no room for the oldest unfinished sequence", keep=head)

    def _room(self, s: _Seq, free: int, budget: int) -> tuple:
        """``(start, tokens, pages)``: where ``s``'s next chunk starts, how many of its pending
        tokens (at most ``budget``) fit in ``free`` free pages (a restore, or the partial page a
        fork copies, taken first), and the pages that chunk takes."""
        ps = self.config.page_size
        restore = self._restore_pages(s)
        if restore is not None:                               # parked: restored, then run on
            start, taken = s.parked, restore
        elif s.live:
            start, taken = s.cached, 0
        elif self._shares(s):
            start = s.fork_pos
            taken = 1 if start % ps else 0                    # the fork copies a partial page
        else:
            start, taken = 0, 0
        want = min(len(s.tokens) - start, budget)
        have = free - taken
        # room left in its last page (own: a partial page is never shared), then whole pages
        if have < 0 and taken:
            fits = 0                                          # no page for the restore / copy
        else:
            fits = max(have, 0) * ps + (-start) % ps
        chunk = min(want, fits)
        return start, chunk, taken + -(-(start + chunk) // ps) - -(-start // ps)

    def _plan(self, decodes: list, rest: list, head: _Seq, force: bool):
        """One forward's (seq, chunk) list with ``head`` in it, or None when the free pages do
        not cover a token of ``head`` (``force``: nothing else can be preempted; it is planned
        anyway and the forward decides). ``decodes`` (live samples with one token to run) and
        ``rest`` (the other pending work), each oldest first. Decodes first; then prompt chunks
        oldest first, admitted while the free pages cover them."""
        cfg, cache = self.config, self.cache
        budget, free = cfg.prefill_chunk_size, cache.num_available_pages
        ps = cfg.page_size
        head_decodes = bool(decodes) and decodes[0] is head
        # the head's slot and a token of the budget are kept for it; its pages come first
        slots = min(cfg.max_batch_size, budget) - (0 if head_decodes else 1)
        if not head_decodes:
            assert rest and rest[0] is head
            own = budget - min(len(decodes), slots)
            start, chunk, pages = self._room(head, free, own)
            if chunk <= 0:
                if not force:
                    return None
                chunk, pages = min(len(head.tokens) - start, own), 0     # try anyway
            free -= pages
        batch = []
        for s in decodes[:slots]:
            batch.append((s, 1))
            budget -= 1
            free -= 1 if s.cached % ps == 0 else 0
        if not head_decodes:
            batch.append((head, chunk))
            budget -= chunk
            rest = rest[1:]
        reserve = len(decodes)              # a page per running decode for the steps to come
        for s in rest:
            if len(batch) == cfg.max_batch_size or budget == 0:
                break
            if not s.live and free <= reserve:
                continue                                      # no page to admit it with
            if not self._ready(s):
                continue
            _, chunk, pages = self._room(s, free - (0 if s.live else reserve), budget)
            if chunk <= 0:
                continue                                      # wait for pages to free up
            batch.append((s, chunk))
            budget -= chunk
            free -= pages
        return batch

    def _shares(self, seq: _Seq) -> bool:
        """Whether ``seq`` starts by forking from its parent (still in use)."""
        return seq.parent is not None and not seq.parent.retired

    def _restore_pages(self, seq: _Seq) -> Optional[int]:
        """Pages that restoring a parked ``seq`` takes, or None when it is not restored (not
        parked, or its parent now holds more of its tokens than the tier does)."""
        if not seq.parked or seq.live or (self._shares(seq) and seq.fork_pos > seq.parked):
            return None
        ps = self.config.page_size
        base = seq.fork_pos - seq.fork_pos % ps if self._shares(seq) else 0
        return -(-(seq.parked - base) // ps)

    def _admit(self, seq: _Seq) -> None:
        cache, stats = self.cache, self.stats
        parent = seq.parent
        restore = self._restore_pages(seq) is not None
        if restore:
            assert self.host_tier is not None
            if self._shares(seq):
                assert parent is not None
                saved = self.host_tier.restore(seq.sid, parent_id=parent.sid, fork_pos=seq.fork_pos)
                stats.forks += 1
                stats.shared_prefix_tokens += seq.fork_pos
            else:
                saved = self.host_tier.restore(seq.sid)
            seq.cached = seq.parked
            stats.recompute_tokens_saved += saved
        elif parent is not None and not parent.retired:
            cache.fork_sequence(parent.sid, seq.sid, seq.fork_pos)
            seq.cached = seq.fork_pos
            stats.forks += 1
            stats.shared_prefix_tokens += seq.fork_pos
        else:
            cache.add_sequence(seq.sid)
            seq.cached = 0
        if seq.parked and not restore:              # the parent holds more: fork instead
            assert self.host_tier is not None
            self.host_tier.drop(seq.sid)
        seq.parked = 0
        seq.live = True
        if parent is not None:
            parent.waiting -= 1
            seq.parent = None
            self._maybe_retire(parent)

    def _maybe_retire(self, seq: _Seq) -> None:
        """A prefix sequence that nobody waits on any more leaves the cache."""
        if seq.kind == "prefix" and seq.waiting == 0 and seq.pending == 0 and not seq.retired:
            self._retire(seq)

    def _retire(self, seq: _Seq) -> None:
        """``seq`` is done for good: it leaves the cache if it is there."""
        if seq.live:
            self.cache.remove_sequence(seq.sid)
        seq.live, seq.retired = False, True

    def _preempt(self, why: str, keep: Optional[_Seq] = None) -> None:
        """Remove the youngest sequence in the cache (other than ``keep``, the oldest
        unfinished sequence, which waits for room) to free its pages; it is parked in the host
        tier (when on, and it has room) and restored later, or else recomputed later. The
        prefix ``keep`` is still to fork from goes last (dropping it makes ``keep`` start from
        scratch, which a request that fits alone always can)."""
        live = [s for s in self._seqs if s.live and s is not keep]
        if not live:
            raise CacheFullError(
                f"the cache ({self.cache.num_total_pages} pages of {self.config.page_size} "
                f"tokens, max_total_tokens={self.config.max_total_tokens}) cannot hold the next "
                f"forward even alone: {why}")
        source = keep.parent if keep is not None and not keep.live else None
        victim = max(live, key=lambda s: (s is not source, s.order))
        self.stats.preemptions += 1
        if self.host_tier is not None and victim.kind != "prefix" and victim.cached:
            try:
                self.host_tier.offload(victim.sid)
            except CacheFullError:
                pass                                    # the tier is full: recompute it
            else:
                victim.live, victim.parked, victim.cached = False, victim.cached, 0
                self.stats.offloaded_tokens += victim.parked
                self._attach(victim, victim.origin)     # restored onto its prefix if in use
                return
        self.cache.remove_sequence(victim.sid)
        victim.live, victim.cached = False, 0
        if victim.kind == "prefix":
            # sharing is an optimisation: a preempted prefix is dropped for good, and the
            # sequences that would have forked from it start from its own prefix (or nothing)
            victim.retired = True
            for s in self._seqs:
                if s.parent is victim and not s.live:
                    victim.waiting -= 1
                    self._attach(s, victim.origin)
            return
        # the victim re-forks from its prefix if that is still in use
        self._attach(victim, victim.origin)

    def _step(self, batch, pick, inflight: Optional[_Inflight] = None):
        """Admit, run one forward; returns [(seq, its picks)] of the sequences that produced
        logits (``pick(seqs, logits)``: one entry per sequence, see ``_consume``), or None when
        the forward did not fit (a sequence was preempted). ``pick`` None (pipelined): returns
        ``(seqs, their PendingPicks or None)`` without waiting for them; tokens that stand for
        the picks of ``inflight`` (the step before, still on their way) are taken from them
        where they are (``ModelAdapter.step_tokens``)."""
        cache, stats = self.cache, self.stats
        try:
            for seq, _ in batch:
                if not seq.live:
                    self._admit(seq)
        except CacheFullError as exc:
            self._preempt(str(exc), keep=self._head)
            return None
        ids, lens, toks, rows, wants, spans = [], [], [], [], [], []
        pos: list[int] = []
        offset = 0
        for seq, chunk in batch:
            chunk = min(chunk, seq.pending)
            ids.append(seq.sid)
            lens.append(chunk)
            toks.extend(seq.tokens[seq.cached:seq.cached + chunk])
            pos.extend(range(seq.cached, seq.cached + chunk))
            spans.append((seq, seq.cached, chunk))
            offset += chunk
            if seq.cached + chunk == len(seq.tokens) and seq.kind != "prefix":
                rows.append(offset - 1)
                wants.append(seq)
        tokens = self._input_tokens(toks, inflight, spans)
        try:
            with cache.forward(ids, lens):
                args = (tokens, np.asarray(pos, np.int64), np.asarray(rows, np.int64))
                if self.decode_graphs is not None and cache.static_bucket is not None:
                    before = self.decode_graphs.captures
                    logits = self.decode_graphs.run(*args)        # a pure decode step: its bucket's graph
                    stats.graph_forwards += 1
                    stats.graph_captures += self.decode_graphs.captures - before
                else:
                    logits = self.adapter.forward(cache, *args)
        except CacheFullError as exc:
            self._preempt(str(exc), keep=self._head)
            return None
        stats.forwards += 1
        for (seq, _), chunk in zip(batch, lens):
            if seq.kind == "sample" and chunk == 1 and seq.computed == seq.cached:
                stats.decode_tokens += 1
            else:
                stats.prefill_tokens += chunk
            stats.recomputed_tokens += max(0, min(chunk, seq.computed - seq.cached))
            seq.cached += chunk
            seq.computed = max(seq.computed, seq.cached)
            if seq.kind == "prefix":
                self._maybe_retire(seq)
        if pick is None:
            return wants, (self.adapter.greedy_async(logits, self._logprobs) if wants else None)
        if not wants:
            return []
        return list(zip(wants, pick(wants, logits)))

    def _input_tokens(self, toks: list, inflight: Optional[_Inflight], spans: list):
        """A step's input token ids as ``forward`` takes them: ``toks`` (host ids, ``_SLOT``
        where a pick of ``inflight`` is still on its way), ``spans`` the (sequence, first token,
        count) of each sequence's tokens in ``toks``, in order."""
        tokens = np.asarray(toks, np.int64)
        dst, src, offset = [], [], 0
        for seq, start, count in spans:
            slot = None if inflight is None else inflight.slots.get(id(seq))
            if slot is not None and start <= slot[0] < start + count:
                dst.append(offset + slot[0] - start)
                src.append(slot[1])
            offset += count
        assert len(dst) == int(np.count_nonzero(tokens == _SLOT)), \
            "a pick still on its way has no source in the step before"
        if not dst:
            return tokens
        assert inflight is not None
        return self.adapter.step_tokens(tokens, inflight.picks, np.asarray(dst, np.int64),
                                        np.asarray(src, np.int64))

    def _expect(self, wants: list, picks: Optional[PendingPicks], samples,
                max_new: int) -> Optional[_Inflight]:
        """Book a pipelined step's picks before the host has them (greedy, one sample per
        prompt): a prompt's sequence goes on as its sample; a sample that this pick brings to
        ``max_new`` leaves the cache now (the forward in flight still writes its pages: the
        cache keeps them until that forward is done); every other one gets a ``_SLOT`` token,
        its next step's input, filled by ``_settle``."""
        if not wants:
            return None
        assert picks is not None
        slots = {}
        for k, seq in enumerate(wants):
            if seq.kind == "prompt":
                seq.go_on_as_sample()
            smp = samples[seq.request][seq.sample]
            smp.planned += 1
            if smp.done or smp.planned >= (smp.max_new or max_new):
                self._retire(seq)
            else:
                seq.tokens.append(_SLOT)
                slots[id(seq)] = (len(seq.tokens) - 1, k)
        return _Inflight(wants, picks, slots)

    def _settle(self, inflight: _Inflight, samples, max_new: int, stops) -> int:
        """Read a pipelined step's picks: each sample takes its token (none once it has
        stopped), ``_SLOT`` tokens get their ids, and a sample that stopped on a stop token
        leaves the cache (a step already launched for it is dropped for it). Returns the
        tokens produced."""
        tokens, logprobs = inflight.picks.result()
        made = 0
        for k, seq in enumerate(inflight.wants):
            smp = samples[seq.request][seq.sample]
            made += self._draw(smp, _Pick(int(tokens[k]), float(logprobs[k])), max_new, stops)
            slot = inflight.slots.get(id(seq))
            if slot is None:
                continue
            if smp.done:
                self._retire(seq)
            else:
                seq.tokens[slot[0]] = int(tokens[k])
        return made

    def _sample(self, wants, logits, samples, temperature: float) -> list:
        """One draw per live sample of each sequence in ``wants`` (row ``k`` of ``logits``: the
        ``n`` samples of a prompt, or a sample's own), all in one ``adapter.sample`` call; each
        sample's uniform number comes from its own seeded generator, in the order the samples
        are consumed. Per sequence: a list of ``_Pick`` (None for a finished sample) for a
        prompt, one ``_Pick`` for a sample."""
        groups = [samples[s.request] if s.kind == "prompt" else [samples[s.request][s.sample]]
                  for s in wants]
        rows, uniforms, drawing = [], [], []
        for k, group in enumerate(groups):
            for smp in group:
                if not smp.done:
                    rows.append(k)
                    if smp.params is None:
                        uniforms.append(smp.rng.random())
                    else:
                        drawing.append(smp)
        if drawing:                     # SamplingParams: drawn on the logits' device
            tokens, logprobs = draw_rows(
                logits, rows, [m.params for m in drawing], [m.seed for m in drawing],
                [len(m.tokens) for m in drawing], self.adapter.to_numpy)
        else:
            tokens, logprobs = self.adapter.sample(logits, np.asarray(rows, np.int64),
                                                   np.asarray(uniforms, np.float64), temperature)
        out, d = [], 0
        for seq, group in zip(wants, groups):
            picks: list = []
            for smp in group:
                if smp.done:
                    picks.append(None)
                else:
                    picks.append(_Pick(int(tokens[d]), float(logprobs[d])))
                    d += 1
            out.append(picks if seq.kind == "prompt" else picks[0])
        return out

    def _consume(self, seq, pick, samples, max_new, n, stops) -> int:
        """Take a sequence's picks (a ``_Pick``, the same for each of a prompt's samples, or a
        list of them, one per sample); returns the number of tokens produced."""
        i = seq.request
        if seq.kind == "prompt":
            made = 0
            for j, smp in enumerate(samples[i]):
                made += self._draw(smp, pick[j] if isinstance(pick, list) else pick, max_new, stops)
            if len(samples[i]) == 1:
                seq.go_on_as_sample()
                self._after(seq, samples[i][0])
                return made
            # the prompt's sequence becomes the samples' shared prefix: each sample forks from it
            seq.kind = "prefix"
            for j, smp in enumerate(samples[i]):
                if smp.done:
                    continue
                child = self._new_seq(kind="sample", tokens=seq.tokens + [smp.tokens[-1]],
                                      order=(i, 2, j), request=i, sample=j, origin=seq,
                                      computed=len(seq.tokens))
                self._attach(child, seq)
                self._seqs.append(child)
            self._maybe_retire(seq)
            return made
        smp = samples[i][seq.sample]
        made = self._draw(smp, pick, max_new, stops)
        self._after(seq, smp)
        return made

    def _after(self, seq, smp) -> None:
        if smp.done:
            self._retire(seq)
        else:
            seq.tokens.append(smp.tokens[-1])

    @staticmethod
    def _draw(smp: _Sample, pick: Optional[_Pick], max_new: int, stops) -> int:
        if smp.done or pick is None:
            return 0
        smp.tokens.append(pick.token)
        smp.logprobs.append(pick.logprob)
        smp.planned = max(smp.planned, len(smp.tokens))
        if len(smp.tokens) >= (smp.max_new or max_new) or pick.token in (
                stops if smp.stops is None else smp.stops):
            smp.done = True
        return 1


class _Progress:
    """A progress bar on stderr over new tokens, shown on a TTY only (``force`` True/False
    overrides); uses rich when installed, nothing otherwise."""

    def __init__(self, total: int, force: Optional[bool]):
        self.bar = None
        show = sys.stderr.isatty() if force is None else force
        if not show:
            return
        try:
            from rich.progress import Progress
        except ImportError:
            return
        self.bar = Progress(transient=True)
        self.task = self.bar.add_task("kvcache generate", total=total)
        self.bar.start()

    def update(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
