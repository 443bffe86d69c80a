"""Which replica the current thread is running, and what the replicas of one call share.

While a replica runs, its thread holds a :class:`ReplicaContext`: the axis name, its index among
the replicas that run, their number, its device, and the :class:`CallGroup` that the replicas of
one call share. Collectives meet in the group's :meth:`CallGroup.exchange`; nested dispatch onto
the pool is refused with the context.

The exchange never waits forever: a replica that raised aborts the group (the others get
:class:`ReplicaAborted`), and a replica that returned without reaching an exchange that others
wait in makes that exchange fail for them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

__all__ = [
    "CallGroup",
    "ReplicaContext",
    "ReplicaAborted",
    "Turnstile",
    "current",
    "entered",
    "swap_current",
]


class ReplicaAborted(RuntimeError):
    """Raised in a replica that was waiting on others when another replica failed.

    The caller never sees it in place of the original error: the pool re-raises the failing
    replica's own exception.
    """


class _Pending:
    __slots__ = ()


_PENDING = _Pending()


class _Round:
    """One exchange: what every replica brought, and the combined result."""

    __slots__ = ("what", "payloads", "arrived", "result", "error", "taken")

    def __init__(self, size: int, what: Hashable) -> None:
        self.what = what
        self.payloads: list[Any] = [_PENDING] * size
        self.arrived = 0
        self.result: Any = _PENDING
        self.error: tuple[type[BaseException], str, BaseException | None] | None = None
        self.taken = 0


class CallGroup:
    """State shared by the replicas of one call (slotted: one is built per call)."""

    __slots__ = (
        "size",
        "devices",
        "lock",
        "cond",
        "failed",
        "failed_index",
        "finished",
        "done",
        "distributed",
        "offset",
        "global_size",
        "counts",
        "_rounds",
        "_next",
        "before_wait",
        "turnstile",
        "__weakref__",  # fdp.distributed notes the call that spans the processes now
    )

    def __init__(self, size: int, devices: Sequence[torch.device]) -> None:
        self.size = size
        self.devices = tuple(devices)
        self.lock = threading.Lock()  # never re-entered: a plain lock is cheaper
        # Replicas wait for each other on the condition; a lone replica never waits, and its
        # calls (up to a millisecond each) are spared building one.
        self.cond = threading.Condition(self.lock) if size > 1 else None
        self.failed: BaseException | None = None
        self.failed_index: int | None = None
        self.finished = [False] * size
        self.done = False  # every replica has returned: the call is over
        # Across processes (fdp.distributed): this process's first global replica index, the
        # global replica count, and every process's count.
        self.distributed = False
        self.offset = 0
        self.global_size = size
        self.counts: list[int] = [size]
        self._rounds: dict[int, _Round] = {}
        self._next = [0] * size
        # Set while the other replicas have not been handed to their workers (the pool runs
        # small replicas inline): the first replica to enter an exchange hands them over.
        self.before_wait: Callable[[], None] | None = None
        # Set when the replicas must take turns outside collectives (see Turnstile).
        self.turnstile: Turnstile | None = None

    def exchanges(self, index: int) -> int:
        """How many exchanges replica ``index`` has entered so far."""
        return self._next[index]

    def abort(self, index: int, error: BaseException) -> None:
        """Records the first failure and releases the replicas waiting in an exchange."""
        with self.lock:
            if self.failed is None:
                self.failed = error
                self.failed_index = index
            self._notify()

    def forget_failure(self) -> None:
        """Drops the failure and the exchanges left unfinished, once every replica has returned
        from a call that failed: the failure's traceback holds the frames that hold this group
        (see ``_pool.run_replicas``)."""
        with self.lock:
            self.failed = None
            self._rounds.clear()

    def finish(self, index: int) -> None:
        """Replica ``index`` has returned (or raised)."""
        with self.lock:
            self.finished[index] = True
            if self._rounds:  # only replicas inside an exchange wait on the condition
                self._notify()

    def _notify(self) -> None:
        """Wakes the replicas waiting in an exchange (the lock is held)."""
        if self.cond is not None:
            self.cond.notify_all()

    def exchange(
        self,
        index: int,
        what: Hashable,
        payload: Any,
        combine: Callable[[list[Any]], list[Any]],
    ) -> tuple[Any, int]:
        """Meets the other replicas: returns ``combine(payloads)[index]`` and the round's number.

        Every replica must call ``exchange`` the same number of times with the same ``what``
        (the collective and its options), in the same order, as in any SPMD program. The last
        replica to arrive runs ``combine`` once for all of them. The round number identifies
        the exchange, e.g. so that backward exchanges can name the forward one they transpose.
        """
        hand_over = self.before_wait
        if hand_over is not None:
            self.before_wait = None
            hand_over()
        # Waiting for the others needs them to run: give up the turn, and take it back only
        # when returning normally (an error leaves without it, so nothing waits on the way out).
        turnstile = self.turnstile
        if turnstile is not None:
            turnstile.leave(index)
        with self.lock:
            number = self._next[index]
            self._next[index] += 1
            round_ = self._rounds.get(number)
            if round_ is None:
                round_ = self._rounds[number] = _Round(self.size, what)
            elif round_.what != what and round_.error is None:
                first = next(r for r, p in enumerate(round_.payloads) if p is not _PENDING)
                # One collective with different options (ppermute's perm, pmean's weight): the
                # options say which, where the names alone would read as the same call twice.
                options = _describe(round_.what) == _describe(what)
                # One in a backward where the other has gone on to a forward collective (a
                # psum of its gradients): that one's backward never reached the collective.
                skipped = [r for r, w in ((first, round_.what), (index, what)) if not _is_backward(w)]
                why = (
                    _skipped_backward(skipped[0])
                    if len(skipped) == 1 and (_is_backward(round_.what) or _is_backward(what))
                    else ""
                )
                round_.error = (
                    ValueError,
                    f"the replicas called different collectives at the same point: "
                    f"{_describe(round_.what, options)} (replica {first}) and "
                    f"{_describe(what, options)} (replica {index}). Every "
                    "replica must call the same collectives, with the same options, in the same "
                    f"order (and differentiate through them in the same order).{why}",
                    None,
                )
                self._notify()
            round_.payloads[index] = payload
            round_.arrived += 1
            last = round_.arrived == self.size
            if not last:
                self._wait(round_, index)
        if last and round_.error is None:
            # A failure of combine is kept in the round alone, in no local variable: its
            # traceback holds this frame (see below).
            try:
                result: Any = combine(round_.payloads)
            except Exception as err:  # noqa: BLE001 - reported to every replica
                with self.lock:
                    round_.error = (type(err), error_text(err), err)
                    self._notify()
            else:
                with self.lock:
                    round_.result = result
                    self._notify()
        with self.lock:
            round_.taken += 1
            failed = round_.error
            if round_.taken == self.size:
                del self._rounds[number]
                # Every replica has read it. The original failure's traceback holds the frame
                # of the replica that combined, whose round held it: a cycle that only the
                # garbage collector frees, and with it every replica's payload.
                round_.error = round_.payloads = None  # type: ignore[assignment]
        if failed is not None:
            try:
                raise _fresh(*failed)
            finally:
                failed = None  # (likewise: this frame is in the traceback of what it raises)
        if turnstile is not None:
            turnstile.enter(index, self)
        return round_.result[index], number

    def _wait(self, round_: _Round, index: int) -> None:
        while round_.result is _PENDING and round_.error is None:
            if self.failed is not None:
                raise ReplicaAborted(
                    f"replica {index} was waiting in {_describe(round_.what)} when replica "
                    f"{self.failed_index} failed"
                )
            gone = [
                j
                for j in range(self.size)
                if self.finished[j] and round_.payloads[j] is _PENDING and self.failed is None
            ]
            if gone:
                what = round_.what
                why = (
                    _skipped_backward(gone[0])
                    if _is_backward(what)
                    else (
                        " Every replica must call the same collectives in the same order (no "
                        "collective behind a condition that differs between replicas)."
                    )
                )
                round_.error = (
                    RuntimeError,
                    f"replica {gone[0]} returned without calling {_describe(what)}, which the "
                    f"other replicas are waiting in.{why}",
                    None,
                )
                self._notify()
                return
            assert self.cond is not None  # only a group of several replicas waits
            self.cond.wait()


def error_text(error: BaseException) -> str:
    """``str(error)``, or what Python's traceback printer shows when that fails: a note about
    one failure must not replace the failure being reported with its own."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - any failure of a user's __str__
        return "<exception str() failed>"


def _fresh(kind: type[BaseException], message: str, cause: BaseException | None) -> BaseException:
    """A new exception per replica (each raises it from its own thread), chained to the original."""
    try:
        error = kind(message)
    except Exception:  # noqa: BLE001 - a type that needs other arguments: share the original
        assert cause is not None
        return cause
    error.__cause__ = cause
    return error


def _is_backward(what: Hashable) -> bool:
    """Whether a collective's key is a backward's (it ends with the forward exchange's number)."""
    return isinstance(what, tuple) and bool(what) and isinstance(what[-1], int)


def _skipped_backward(replica: int) -> str:
    """Why replica ``replica`` did not run the backward of a collective that it called in the
    forward pass, which the others wait in (a sentence, led by a space)."""
    return (
        f" Replica {replica} called the forward collective, but there that collective lies on no "
        "path from the differentiated arguments to the differentiated value (what it passed "
        "does not depend on them, or the value does not depend on its result: a loss replaced "
        "by a constant behind a condition that differs between replicas, say), so its backward "
        "never runs there. Compute the value alike on every replica (multiply by a mask of 0 "
        "rather than replace it by a constant)."
    )


def _describe(what: Hashable, options: bool = False) -> str:
    """The collective a key names; a backward's key ends with the forward exchange's number.
    With ``options``, the options a key holds between the two, as text (``perm=[(0, 1)]``)."""
    if isinstance(what, tuple) and what:
        name = str(what[0])
        if options and len(what) > 2 and all(isinstance(o, str) for o in what[1:-1]):
            shown = ", ".join(o for o in what[1:-1] if o)
            name = f"{name}({shown})"
        if isinstance(what[-1], int):
            return f"{name} (the backward of collective #{what[-1]})"
        return name
    return str(what)


class Turnstile:
    """Lets one replica at a time run between collectives, in any order or in index order.

    For calls in which a compiled function is likely to be compiled (see
    :class:`fdp._compile.Turns`): dynamo checks its cache before it takes its compile lock, so
    replicas that enter a frame together would each compile it (N compilations, and past
    ``torch._dynamo.config.recompile_limit`` a fallback to eager with warnings). Taking turns,
    the first replica compiles each frame and the others find it compiled. A replica holds its
    turn while it runs its function and gives it up inside every collective, so replicas still
    meet there; a failed call releases everyone.

    ``ordered``: the turns go 0, 1, ..., n - 1, 0, ... (between two collectives, every replica
    runs its piece in index order), so that everything the replicas do reaches shared state in
    the same order on every run: :func:`torch.utils.checkpoint` matches the tensors a
    recomputation saves to the forward's by the order in which they were saved.
    """

    __slots__ = ("_cond", "_held", "_busy", "_ordered", "_next")

    def __init__(self, size: int, *, ordered: bool = False) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._held = [False] * size
        self._busy = False
        self._ordered = ordered
        self._next = 0  # whose turn it is (ordered)

    def enter(self, index: int, group: CallGroup) -> None:
        """Waits for replica ``index``'s turn; raises :class:`ReplicaAborted` if the call fails."""
        with self._cond:
            # Polled: a replica that failed while holding the turn (an interrupt) must not leave
            # the others waiting forever.
            while (self._busy or (self._ordered and self._next != index)) and group.failed is None:
                self._cond.wait(0.05)
            if group.failed is not None:  # nothing more to run in a call that failed
                raise ReplicaAborted(
                    f"replica {index} was waiting for its turn when replica {group.failed_index} failed"
                )
            self._busy = self._held[index] = True

    def leave(self, index: int) -> None:
        """Ends replica ``index``'s turn, if it has one."""
        with self._cond:
            if self._held[index]:
                self._held[index] = self._busy = False
                self._next = (index + 1) % len(self._held)
                self._cond.notify_all()


class ReplicaContext:
    """Which replica a thread runs (a slotted class: one is built per replica per call)."""

    __slots__ = ("axis_name", "index", "size", "device", "group")

    def __init__(
        self, axis_name: Hashable | None, index: int, size: int, device: torch.device, group: CallGroup
    ) -> None:
        self.axis_name = axis_name
        self.index = index
        self.size = size
        self.device = device
        self.group = group

    @property
    def global_index(self) -> int:
        """The replica's index along its axis, across processes (what ``fdp.axis_index`` gives)."""
        return self.group.offset + self.index


class _Local(threading.local):
    context: ReplicaContext | None = None


_LOCAL = _Local()


def current() -> ReplicaContext | None:
    """The replica running in this thread, or None outside mapped functions."""
    return _LOCAL.context


def swap_current(context: ReplicaContext | None) -> ReplicaContext | None:
    """Makes ``context`` the current replica's, and returns the one it replaces."""
    previous = _LOCAL.context
    _LOCAL.context = context
    return previous


class entered:
    """Makes ``context`` the current replica's for the block (a class: this is on every call's path)."""

    __slots__ = ("_context", "_previous")

    def __init__(self, context: ReplicaContext) -> None:
        self._context = context

    def __enter__(self) -> None:
        self._previous = _LOCAL.context
        _LOCAL.context = self._context

    def __exit__(self, *exc: object) -> None:
        _LOCAL.context = self._previous
