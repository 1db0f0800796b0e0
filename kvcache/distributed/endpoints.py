"""What both ends of a transfer share: torch with its process group initialized, the sequence
ids argument, where the cache's arrays and a transfer's messages live, and the two sums of a
data message (the tail carries the sender's, the receiver checks them).
"""

from __future__ import annotations

import sys

import numpy as np

from ..errors import ForwardStateError, UnsupportedFeatureError


def _torch():
    """(torch, torch.distributed), initialized; typed errors otherwise."""
    torch = sys.modules.get("torch")        # imported already: no import machinery a call
    if torch is None or not hasattr(torch, "distributed"):
        from ..integrations import require
        torch = require("torch", "distributed", "2.4")
    dist = torch.distributed
    if not dist.is_available():
        raise UnsupportedFeatureError(
            f"torch {torch.__version__} was built without torch.distributed")
    if not dist.is_initialized():
        raise ForwardStateError(
            "kvcache.distributed needs a process group: call "
            "torch.distributed.init_process_group first (gloo on CPUs, nccl on GPUs)")
    return torch, dist


def _ids(value, name: str) -> list:
    from ..core.validate import is_int, seq_id_list
    return [int(value)] if is_int(value) else seq_id_list(value, name)


def _arrays(cache, torch):
    """('torch' | 'numpy', the device of the cache's arrays), read off its pages (no device
    work: a probe array uploaded from the host would wait for every forward queued);
    UnsupportedFeatureError for other array types."""
    probe = cache.pages[0]
    if isinstance(probe, torch.Tensor):
        return "torch", probe.device
    if isinstance(probe, np.ndarray):
        return "numpy", torch.device("cpu")
    raise UnsupportedFeatureError(
        f"kvcache.distributed moves torch tensors or numpy arrays; backend "
        f"{cache.backend.name!r} keeps {type(probe).__module__}.{type(probe).__name__}: send "
        f"cache.export_sequence(...).to_numpy() payloads yourself and import_sequence them")


def _transport(torch, dist, group, device):
    """Where the messages' tensors live: the cache's GPU under NCCL, else the host."""
    name = str(dist.get_backend(group)).lower()
    if device.type != "cpu" and "nccl" in name:
        return device
    return torch.device("cpu")


def _sums(torch, message, backend=None):
    """``Backend.checksum`` of ``message`` (a flat uint8 tensor), computed where it lives: on a
    GPU by ``backend`` (the cache's), on the host by ``checksum_words`` (as a tensor)."""
    if message.device.type == "cpu":
        from ..backend import checksum_words
        return torch.from_numpy(checksum_words(message.numpy()))
    return backend.checksum(message)
