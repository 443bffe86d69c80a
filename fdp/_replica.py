"""Which replica the current thread is running, if any.

While a replica runs, its thread holds a :class:`ReplicaContext`: the axis name, its index among
the replicas that run, their number, its device, and the :class:`CallGroup` that the replicas of
one call share. Collectives read it; nested dispatch onto the pool is refused with it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["CallGroup", "ReplicaContext", "ReplicaAborted", "current", "entered"]


class ReplicaAborted(RuntimeError):
    """Raised in a replica that was waiting on others when another replica failed.

    The caller never sees it in place of the original error: the pool re-raises the failing
    replica's own exception.
    """


class CallGroup:
    """State shared by the replicas of one call."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.failed: BaseException | None = None
        self.failed_index: int | None = None

    def abort(self, index: int, error: BaseException) -> None:
        """Records the first failure; replicas waiting on each other are released."""
        with self.lock:
            if self.failed is None:
                self.failed = error
                self.failed_index = index


@dataclass(frozen=True)
class ReplicaContext:
    axis_name: Hashable | None
    index: int
    size: int
    device: torch.device
    group: CallGroup


class _Local(threading.local):
    context: ReplicaContext | None = None


_LOCAL = _Local()


def current() -> ReplicaContext | None:
    """The replica running in this thread, or None outside mapped functions."""
    return _LOCAL.context


@contextlib.contextmanager
def entered(context: ReplicaContext) -> Iterator[None]:
    previous = _LOCAL.context
    _LOCAL.context = context
    try:
        yield
    finally:
        _LOCAL.context = previous
