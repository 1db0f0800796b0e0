"""kvcache: a paged KV cache for LLM inference with one API across CUDA, ROCm and Metal."""

from .arrays import to_numpy
from .backend import Backend, Capabilities, DepthAux, RopeSpec, TreeMask
from .cache import PagedKVCache
from .config import CacheConfig, State, Window
from .errors import (BackendNotAvailableError, CacheFullError, ForwardStateError,
                     InvalidArgumentError, KVCacheError, SequenceExistsError,
                     SequenceNotFoundError, UnsupportedFeatureError)
from .hookspecs import hookimpl
from .plugins import available_backends, list_backends
from .host_tier import HostTier
from .transfer import SequencePayload

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendNotAvailableError", "CacheConfig", "CacheFullError", "Capabilities",
    "DepthAux", "ForwardStateError", "HostTier", "InvalidArgumentError", "KVCacheError",
    "PagedKVCache", "RopeSpec", "SequenceExistsError", "SequenceNotFoundError",
    "SequencePayload", "State", "TreeMask", "UnsupportedFeatureError", "Window",
    "available_backends", "hookimpl", "list_backends", "to_numpy",
]
