"""Running caches over several processes with torch.distributed (NCCL between GPUs, gloo on
CPUs).

* ``send_sequence`` / ``recv_sequence`` (``kvcache.distributed.transfer``): move sequences'
  KV from one process's cache into another's (disaggregated prefill and decode), batched and
  asynchronous (a ``TransferHandle`` to wait on).
* ``kvcache.distributed.tp``: process-group set-up (``init``, ``spawn``) and the lockstep check
  that keeps tensor-parallel ranks' host planning identical.

torch is imported when a function runs, not here: without it they raise
``kvcache.integrations.MissingExtraError`` naming the ``kvcache[distributed]`` extra.
"""

from .transfer import TransferHandle, recv_sequence, send_sequence

__all__ = ["TransferHandle", "recv_sequence", "send_sequence"]
