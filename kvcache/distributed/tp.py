"""Tensor-parallel ranks over torch.distributed: process start-up and the lockstep check.

Under tensor parallelism every rank runs the same scheduler over its own cache (a slice of the
KV heads), so every rank must plan exactly the same forwards: the same sequences, chunk lengths,
forks, preemptions and page tables, and the same input tokens. Nothing but the model's collectives
ties the ranks together, so a rank that plans differently would silently attend over the wrong
pages, or hang in a collective the others never reach. ``PlanCheck`` makes the difference loud:
each step every rank hashes its plan into one int64 (``plan_digest``), the ranks exchange the
digests over a host (gloo) group, and any difference raises ``PlanMismatchError`` on every rank
at the same step, naming the step and the ranks.

Start-up: ``init()`` initialises the default process group from torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``) or from arguments;
``spawn(fn, nprocs)`` runs ``fn`` on ``nprocs`` local processes with gloo (tests, CPU demos).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import multiprocessing
import os
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..core.plan import ForwardPlan, walk
from ..errors import InvalidArgumentError, KVCacheError, UnsupportedFeatureError

try:
    import torch
    import torch.distributed as dist
except ImportError:                                     # pragma: no cover - torch is optional
    from ..integrations import MissingExtraError, install_hint
    raise MissingExtraError(
        "kvcache.distributed needs torch with torch.distributed; install the kvcache[distributed] "
        f"extra: {install_hint('distributed')}") from None

__all__ = ["END", "ABORT", "PlanCheck", "PlanMismatchError", "host_group", "init",
           "local_heads", "plan_digest", "spawn"]


class PlanMismatchError(KVCacheError):
    """Tensor-parallel ranks planned different forwards (or one left ``generate`` early): the
    message names the step and which ranks hold which digest. Raised on every rank at once."""


def _constant(name: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little", signed=True)


END = _constant(b"kvcache.distributed.tp: generate finished")
"""The digest a rank sends when its ``generate`` finished (the others still in a step differ)."""
ABORT = _constant(b"kvcache.distributed.tp: generate raised")
"""The digest a rank sends when its ``generate`` left with an error of its own."""
_SPECIAL = {END: "finished generate", ABORT: "left generate with an error"}


# ---------------------------------------------------------------------- start-up
def init(backend: Optional[str] = None, *, rank: Optional[int] = None,
         world_size: Optional[int] = None, master_addr: Optional[str] = None,
         master_port: Optional[int] = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise torch.distributed's default process group (nothing if it already is) and
    return ``(rank, world_size)``.

    ``backend``: ``"gloo"``, ``"nccl"``, ... (None: NCCL when CUDA is available, else gloo).
    ``rank`` / ``world_size`` / ``master_addr`` / ``master_port``: None takes torchrun's
    ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` (default 127.0.0.1) / ``MASTER_PORT``.
    With NCCL the process uses GPU ``LOCAL_RANK`` (default: ``rank``) and a gloo group over the
    same ranks is created at once for host-side checks (``host_group``). ``timeout_s``: how long
    a collective waits for the other ranks before it fails."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env = os.environ

    def need(value, name):
        if value is None:
            if name not in env:
                raise InvalidArgumentError(
                    f"init: {name.lower()} was not given and ${name} is not set (launch with "
                    f"torchrun, or pass rank=, world_size=, master_port=)")
            value = env[name]
        return int(value)

    rank, world_size = need(rank, "RANK"), need(world_size, "WORLD_SIZE")
    port = need(master_port, "MASTER_PORT")
    addr = master_addr or env.get("MASTER_ADDR", "127.0.0.1")
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"init: rank={rank} is not in [0, world_size={world_size})")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(env.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=float(timeout_s)))
    if backend != "gloo":
        host_group(None)
    return rank, world_size


_HOST_GROUPS: dict = {}


def host_group(group=None):
    """A gloo process group over the ranks of ``group`` (None: the default group) for host-side
    exchanges that must not touch the device (a CPU tensor on an NCCL group would need one).
    ``group`` itself when it is gloo; otherwise one is created on first use, which, like every
    ``new_group``, every rank of the world must call in the same order."""
    backend = str(dist.get_backend(group))
    if backend == "gloo":
        return group
    key = None if group is None else tuple(dist.get_process_group_ranks(group))
    if key not in _HOST_GROUPS:
        ranks = None if key is None else list(key)
        _HOST_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _HOST_GROUPS[key]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned(fn, rank, nprocs, port, backend, args, results, env, timeout_s):
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        init(backend, rank=rank, world_size=nprocs, master_addr="127.0.0.1", master_port=port,
             timeout_s=timeout_s)
        results.put((rank, True, fn(rank, nprocs, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nprocs: int = 2, args: Sequence = (), *,
          backend: str = "gloo", timeout_s: float = 300.0,
          env: Optional[dict] = None) -> list:
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` fresh local processes that form a process
    group (``backend``, a free port on 127.0.0.1) and return their results in rank order.

    ``fn`` must be importable by name (a module-level function) and its results picklable;
    ``env``: variables set in every process before it starts. Raises ``RuntimeError`` with the
    traceback of each rank that failed, or naming the ranks that did not finish within
    ``timeout_s`` seconds (those processes are terminated)."""
    nprocs = int(nprocs)
    if nprocs < 1:
        raise InvalidArgumentError(f"spawn: nprocs={nprocs} must be >= 1")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    # a collective waits at most the whole run: a rank that failed then frees the others
    procs = [ctx.Process(target=_spawned, daemon=True,
                         args=(fn, rank, nprocs, port, backend, tuple(args), results,
                               dict(env or {}), timeout_s))
             for rank in range(nprocs)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < nprocs:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue_module.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break                       # every process exited, some without a result
                continue
            got[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    failed = [f"rank {r} failed:\n{value}" for r, (ok, value) in sorted(got.items()) if not ok]
    missing = [r for r in range(nprocs) if r not in got]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        failed.append(f"ranks {missing} gave no result within {timeout_s:.0f} s "
                      f"(exit codes {codes})")
    if failed:
        raise RuntimeError("spawn: " + "\n".join(failed))
    return [got[r][1] for r in range(nprocs)]


# ---------------------------------------------------------------------- heads
def local_heads(num_qo_heads: int, num_kv_heads: int, tp: int, what: str = "the model") -> tuple[int, int]:
    """``(num_qo_heads // tp, num_kv_heads // tp)``: the query and KV heads one rank holds.
    Raises ``UnsupportedFeatureError`` naming the numbers (and ``what`` is split, e.g. the
    model's name) when ``tp`` divides either not (replicating KV heads over ranks is not
    supported), ``InvalidArgumentError`` for ``tp < 1``."""
    tp = int(tp)
    if tp < 1:
        raise InvalidArgumentError(f"tp={tp} must be >= 1")
    bad = [f"{name}={n}" for name, n in (("num_kv_heads", num_kv_heads),
                                         ("num_qo_heads", num_qo_heads)) if n % tp]
    if bad:
        fits = [d for d in range(1, num_kv_heads + 1)
                if num_kv_heads % d == 0 and num_qo_heads % d == 0]
        raise UnsupportedFeatureError(
            f"tp={tp} does not divide {' and '.join(bad)} of {what} (num_qo_heads="
            f"{num_qo_heads}, num_kv_heads={num_kv_heads}): each rank holds num_kv_heads / tp "
            f"KV heads, and replicating KV heads over ranks is not supported; use tp in {fits}")
    return num_qo_heads // tp, num_kv_heads // tp


# ---------------------------------------------------------------------- the lockstep check
def plan_digest(plan: ForwardPlan, *extra: np.ndarray) -> int:
    """A 64-bit digest (signed int) of an open forward's plan as ``cache.open_plan`` gives it:
    its sequence ids, append lengths and every index array (token positions, append slots,
    page tables per depth, tree masks), plus the ``extra`` host arrays (e.g. the step's input
    token ids). Equal plans give equal digests; any differing array or value differs."""
    h = hashlib.blake2b(digest_size=8)

    def feed(array) -> None:
        a = np.ascontiguousarray(array)
        h.update(a.size.to_bytes(8, "little"))
        h.update(a.data)

    feed(np.asarray(plan.seq_ids, np.int64))
    feed(np.asarray(plan.append_lengths, np.int64))
    for d, name, array in walk(plan):
        if name == "page_indices" and d is not None:
            array = array[:plan.depths[d].num_pages]      # a static plan's list may be longer
        h.update(name.encode())
        feed(array)
    for a in extra:
        feed(a)
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclasses.dataclass
class PlanCheck:
    """Compares one int64 per rank over a host (gloo) process group.

    ``group``: the tensor-parallel group (None: the default group); the exchange runs on
    ``host_group(group)``. ``exchange(what, digest)`` all-gathers the digests of every rank and
    raises ``PlanMismatchError`` (on every rank, since all see the same digests) naming ``what``
    (e.g. "step 3") and the ranks holding each value. After a mismatch ``failed`` is True, so
    callers skip further exchanges that the other ranks will not join. The buffers are
    allocated once."""

    group: Any = None
    failed: bool = False

    def __post_init__(self):
        self.host = host_group(self.group)
        self.size = dist.get_world_size(self.host)
        self.rank = dist.get_rank(self.host)
        self._mine = torch.zeros(1, dtype=torch.int64)
        self._all = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]

    def exchange(self, what: str, digest: int, detail: Optional[Callable[[], str]] = None) -> None:
        """All-gather ``digest`` and raise ``PlanMismatchError`` unless every rank sent the
        same. ``detail``: called only on a mismatch, this rank's description of what it hashed
        (added to the message)."""
        self._mine[0] = int(digest)
        dist.all_gather(self._all, self._mine, group=self.host)
        values = [int(t[0]) for t in self._all]
        if all(v == values[0] for v in values):
            return
        self.failed = True
        groups: dict = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        parts = []
        for v, ranks in groups.items():
            label = _SPECIAL.get(v, f"digest {v & (2**64 - 1):#018x}")
            parts.append(f"ranks {ranks}: {label}")
        raise PlanMismatchError(
            f"{what}: the tensor-parallel ranks disagree ({'; '.join(parts)}); "
            f"every rank must build the same engine and call generate with the same arguments"
            + (f" (rank {self.rank} {detail()})" if detail is not None else ""))
