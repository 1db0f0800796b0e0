"""``TransferHandle``: a transfer in flight, what ``send_sequence`` and ``recv_sequence``
return."""

from __future__ import annotations

from typing import Callable, Optional

from ..errors import ForwardStateError


class TransferHandle:
    """A transfer in flight (from ``send_sequence`` / ``recv_sequence``).

    ``wait()`` blocks until this side's messages are done and returns the sequence ids; on the
    receiving side it then writes the KV into the reserved pages and makes the sequences
    appear in the cache (not before). ``is_completed()`` says, without blocking, whether the
    messages are done (a receiver's sequences still appear only at ``wait()``). Keep the
    handle until ``wait()``: a receiver's pages stay reserved until then (``cancel()`` gives
    them back after the data arrived)."""

    def __init__(self, works: list, buffers: list, seq_ids: list, what: str,
                 finish: Optional[Callable[[Callable], None]] = None,
                 cancel: Optional[Callable[[], None]] = None):
        self._works = works
        self._buffers = buffers          # the tensors the works read or write: alive until done
        self.seq_ids = seq_ids
        self.what = what
        self._finish, self._cancel = finish, cancel
        self._received = False
        self._streaming = False          # a sender's: the forward it watches is still open
        self._waited: set = set()
        self._done = False
        self._error: Optional[BaseException] = None

    def __repr__(self) -> str:
        state = "done" if self._done else "failed" if self._error else "in flight"
        return f"TransferHandle({self.what}, {state})"

    def is_completed(self) -> bool:
        """Whether every message of this transfer has completed (never blocks)."""
        return self._done or self._received or (
            not self._streaming and all(w.is_completed() for w in self._works))

    def _arrive(self) -> None:
        if not self._received:
            self._wait_for(self._works)
            self._received = True

    def _wait_for(self, works) -> None:
        for w in works:
            if id(w) not in self._waited:       # (a gloo work waited twice never returns)
                w.wait()
                self._waited.add(id(w))

    def wait(self) -> list:
        """Wait for the transfer; returns the sequence ids. On the receiver the sequences
        appear now. Under NCCL the waits are in the device's stream order, not the host's: the
        receiver queues each message's rows into its pages behind that message's arrival and
        returns without blocking, and whatever the cache queues after it (a forward over the
        sequences, an export) runs after the rows are written; under gloo it blocks. A
        ForwardStateError (a forward is open) leaves the handle to wait on again after
        ``end_forward``; another error gives the reserved pages back and is raised again by
        every later ``wait()``."""
        if self._done:
            return list(self.seq_ids)
        if self._error is not None:
            raise self._error
        if self._streaming:
            raise ForwardStateError(
                f"{self.what}: the forward that writes its KV is still open; wait after "
                f"end_forward (or abort_forward)")
        if self._finish is None:
            self._arrive()
        else:
            try:
                # the receiver waits for each message before it writes that message's rows
                self._finish(self._wait_for)
                self._received = True
            except ForwardStateError:
                raise
            except BaseException as exc:
                self._error = exc
                self._arrive()              # every posted receive consumed first
                if self._cancel is not None:
                    self._cancel()
                self._buffers = []
                raise
        self._done = True
        self._buffers = []
        return list(self.seq_ids)

    def cancel(self) -> None:
        """A receiver that will not take the sequences: wait for the data (the sender's
        messages must be consumed), then give the reserved pages back."""
        if self._done:
            return
        self._arrive()
        if self._cancel is not None:
            self._cancel()
        self._error = ForwardStateError(f"{self.what} was cancelled")
        self._buffers = []
