"""Cache configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import InvalidArgumentError

DTYPES = ("float16", "bfloat16", "float32")
ROPE_MODES = ("none", "normal", "inline")


@dataclass(frozen=True)
class CacheConfig:
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    max_batch_size: int = 128
    max_total_tokens: int = 65536
    prefill_chunk_size: int = 4096
    dtype: str = "bfloat16"
    rope_mode: str = "normal"
    rope_theta: float = 10000.0
    rope_scale: float = 1.0
    support_sliding_window: bool = False
    cuda_graph: bool = False
    """Fixed-address aux buffers and batch-bucketed grids so decode can be captured in a CUDA graph."""
    cuda_graph_batch_sizes: tuple = ()
    """Batch buckets a graph-mode decode is padded to (default: powers of two up to and
    including max_batch_size)."""

    def __post_init__(self):
        for name in ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
                     "max_batch_size", "max_total_tokens", "prefill_chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"CacheConfig.{name} must be a positive int, got {value!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"CacheConfig.num_qo_heads={self.num_qo_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise InvalidArgumentError(f"CacheConfig.head_dim={self.head_dim} must be even (RoPE halves)")
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(f"CacheConfig.dtype={self.dtype!r} is not one of {DTYPES}")
        if self.rope_mode not in ROPE_MODES:
            raise InvalidArgumentError(f"CacheConfig.rope_mode={self.rope_mode!r} is not one of {ROPE_MODES}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise InvalidArgumentError(f"CacheConfig.rope_theta={self.rope_theta!r} must be positive")
        if not math.isfinite(self.rope_scale):
            raise InvalidArgumentError(f"CacheConfig.rope_scale={self.rope_scale!r} must be finite")

        sizes = self.cuda_graph_batch_sizes
        if not isinstance(sizes, tuple) or any(
                isinstance(b, bool) or not isinstance(b, int) for b in sizes) or list(sizes) != sorted(set(sizes)) \
                or (sizes and not 1 <= sizes[0] <= sizes[-1] <= self.max_batch_size):
            raise InvalidArgumentError(
                f"CacheConfig.cuda_graph_batch_sizes={sizes!r} must be a strictly increasing tuple "
                f"of ints in [1, max_batch_size={self.max_batch_size}]")

    @property
    def graph_buckets(self) -> tuple:
        """The batch sizes a graph-mode decode batch is padded to; the last one is the largest
        batch a graph-mode decode step takes."""
        if self.cuda_graph_batch_sizes:
            return self.cuda_graph_batch_sizes
        sizes, b = [], 1
        while b < self.max_batch_size:
            sizes.append(b)
            b *= 2
        return tuple(sizes) + (self.max_batch_size,)

    def graph_bucket(self, batch: int) -> int:
        """The bucket a decode batch of ``batch`` sequences is padded to in graph mode."""
        for size in self.graph_buckets:
            if batch <= size:
                return size
        raise InvalidArgumentError(
            f"a graph-mode decode batch of {batch} sequences exceeds the largest bucket "
            f"{self.graph_buckets[-1]} (cuda_graph_batch_sizes={self.graph_buckets})")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def num_pages(self) -> int:
        """Pages per layer: capacity plus one spare, and with sliding window one spare page per
        sequence of a batch (a window's forward takes its new pages before its slide frees any)."""
        pages = -(-self.max_total_tokens // self.page_size) + 1
        if self.support_sliding_window:
            pages += self.max_batch_size
        return pages

    @property
    def effective_rope_mode(self) -> str:
        """Sliding windows re-position kept tokens, so RoPE must be applied inside attention."""
        if self.support_sliding_window and self.rope_mode == "normal":
            return "inline"
        return self.rope_mode
