"""Fault injection: every failure ends within a bound with the original error, leaves no worker
thread blocked, and the next call works."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import collect_when_workers_rest, cpus, finishes

import fdp
from fdp import _pool

BOUND = 20.0  # seconds: far above what any of these takes, far below a hang


class Injected(Exception):
    pass


def within_bound(call: Callable[[], Any]) -> Any:
    return finishes(call, BOUND)


def assert_workers_idle() -> None:
    deadline = time.monotonic() + 5
    while not _pool.idle():
        assert time.monotonic() < deadline, "a worker thread is still busy or blocked"
        time.sleep(0.01)


def injected_at(where: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A replica body that fails on replica 2 of 4, before, inside or after a collective."""

    def body(x: torch.Tensor) -> torch.Tensor:
        me = fdp.axis_index("i")
        if where == "before" and me == 2:
            raise Injected("before the collective")
        y = fdp.psum({"x": x, "bad": "not a tensor"} if where == "inside" and me == 2 else {"x": x}, "i")["x"]
        if where == "after" and me == 2:
            raise Injected("after the collective")
        if where == "after-second" and me == 2:
            raise Injected("between two collectives")
        return fdp.pmean(y, "i")

    return body


@pytest.mark.parametrize(
    ("where", "error", "match"),
    [
        ("before", Injected, "before the collective"),
        ("inside", TypeError, r"fdp.psum takes trees of tensors \(and numbers\), but x\['bad'\]"),
        ("after", Injected, "after the collective"),
        ("after-second", Injected, "between two collectives"),
    ],
)
def test_failure_around_a_collective(where: str, error: type, match: str) -> None:
    f = fdp.pmap(injected_at(where), axis_name="i", devices=cpus(4))
    with pytest.raises(error, match=match) as info:
        within_bound(lambda: f(torch.ones(4)))
    assert any("raised by replica 2 of 4" in note for note in info.value.__notes__)
    assert_workers_idle()
    ok = fdp.pmap(lambda x: fdp.pmean(x, "i"), axis_name="i", devices=cpus(4))
    torch.testing.assert_close(within_bound(lambda: ok(torch.arange(4.0))), torch.full((4,), 1.5))


def test_failure_in_a_backward_collective() -> None:
    def body(x: torch.Tensor) -> torch.Tensor:
        def loss(x: torch.Tensor) -> torch.Tensor:
            y = fdp.psum(x, "i")
            if fdp.axis_index("i") == 1:
                return (y * torch.ones(3)).sum()  # shape error in the forward of replica 1
            return y.sum()

        return torch.func.grad(loss)(x)

    with pytest.raises(RuntimeError, match="size of tensor"):
        within_bound(lambda: fdp.pmap(body, axis_name="i", devices=cpus(2))(torch.ones(2, 2)))
    assert_workers_idle()


def test_slow_replica_with_collectives() -> None:
    def body(x: torch.Tensor) -> torch.Tensor:
        if fdp.axis_index("i") == 1:
            time.sleep(0.5)
        return fdp.psum(x, "i")

    out = within_bound(lambda: fdp.pmap(body, axis_name="i", devices=cpus(3))(torch.ones(3)))
    torch.testing.assert_close(out, torch.full((3,), 3.0))
    assert_workers_idle()


def test_keyboard_interrupt_raised_in_a_replica_waiting_others() -> None:
    def body(x: torch.Tensor) -> torch.Tensor:
        if fdp.axis_index("i") == 1:
            raise KeyboardInterrupt
        return fdp.psum(x, "i")  # replica 0 waits here for replica 1

    with pytest.raises(KeyboardInterrupt):
        within_bound(lambda: fdp.pmap(body, axis_name="i", devices=cpus(2))(torch.ones(2)))
    assert_workers_idle()


def test_real_interrupt_during_a_long_call_in_a_child_process() -> None:
    # A real SIGINT to the caller's thread while replica 0 (run by the caller) waits in a
    # collective for replica 1. Replica 1 sends it itself, before it reaches the collective, so
    # the call is certainly under way when it lands: the caller must raise KeyboardInterrupt
    # (not finish normally, not hang), release replica 1, and the process must be able to call
    # again.
    script = textwrap.dedent(
        """
        import signal, threading, time, torch, fdp
        # Python raises KeyboardInterrupt only where it installed its handler, which it does not
        # when SIGINT was ignored at start (a background job of a non-interactive shell).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        main = threading.main_thread().ident
        def body(x):
            if fdp.axis_index("i") == 1:
                signal.pthread_kill(main, signal.SIGINT)
                time.sleep(0.5)
            return fdp.psum(x, "i")
        try:
            fdp.pmap(body, axis_name="i", devices=["cpu", "cpu"])(torch.ones(2))
            print("no interrupt")
        except KeyboardInterrupt:
            print("interrupted")
        out = fdp.pmap(lambda x: fdp.psum(x, "i"), axis_name="i", devices=["cpu", "cpu"])(torch.ones(2))
        from fdp import _pool
        time.sleep(0.2)
        print("next", out.tolist(), "idle", _pool.idle())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "interrupted" in result.stdout.splitlines(), result.stdout
    assert "next [2.0, 2.0] idle True" in result.stdout


# A program whose replica 1 blocks in user code until ``release`` is set, and whose main thread
# gets the signal named SIGNAL twice, 0.5 s apart, once replica 1 has started; the tests below
# define SIGNAL first, and the body and the call after it.
_BLOCKED_REPLICA = textwrap.dedent(
    """
    import signal, sys, threading, time, torch, fdp
    from fdp import _pool
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    _pool.INLINE_REPLICAS = False
    main, started, release = threading.main_thread().ident, threading.Event(), threading.Event()
    def block():  # in replica 1: blocks until released, and says so
        if fdp.axis_index("i") != 1:
            return False
        started.set()
        release.wait()
        return True
    def interrupt():
        started.wait()
        for _ in range(2):
            time.sleep(0.5)
            signal.pthread_kill(main, getattr(signal, SIGNAL))
    threading.Thread(target=interrupt, daemon=True).start()
    """
)


@pytest.mark.parametrize(
    ("collective", "signal_name"), [(True, "SIGINT"), (False, "SIGINT"), (True, "SIGTERM")]
)
def test_escaping_a_blocked_replica_leaves_later_calls_working(collective: bool, signal_name: str) -> None:
    # Replica 1 blocks in user code (a deadlock of its own). The first SIGINT lands in replica 0,
    # waiting for it in the psum, or in the caller, waiting for it to return; either way the
    # caller then waits for it, and the second SIGINT makes it stop waiting (in the psum case it
    # took a third). The next call with a collective must not queue behind the blocked replica
    # on its worker: it used to wait forever, silently. A SIGTERM handler that calls sys.exit
    # (torchrun stops workers with SIGTERM) interrupts alike: it took a third signal.
    script = (
        f"COLLECTIVE = {collective}\nSIGNAL = '{signal_name}'\n"
        + _BLOCKED_REPLICA
        + textwrap.dedent(
            """
            def body(x):
                block()
                return fdp.psum(x, "i") if COLLECTIVE else x
            try:
                fdp.pmap(body, axis_name="i", devices=["cpu", "cpu"])(torch.ones(2))
            except (KeyboardInterrupt, SystemExit) as interrupted:
                print("notes:", getattr(interrupted, "__notes__", []))
            g = fdp.pmap(lambda x: fdp.psum(x, "j"), axis_name="j", devices=["cpu", "cpu"])
            out = []
            call = threading.Thread(target=lambda: out.append(g(torch.ones(2)).tolist()), daemon=True)
            call.start()
            call.join(20)
            print("next", out, "idle", _pool.idle())
            release.set()
            """
        )
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "stopped waiting for replica 1 (device cpu), which had not returned" in result.stdout, (
        result.stdout
    )
    assert "next [[2.0, 2.0]] idle True" in result.stdout, result.stdout


@pytest.mark.parametrize("released", [True, False])
def test_a_replica_given_up_on_does_not_abort_the_exit(released: bool) -> None:
    # The caller stops waiting for replica 1 (two SIGINTs, as above), which the program then
    # releases as it exits: its worker, retired from the pool, runs torch code while the
    # interpreter shuts down. A daemon thread that takes the GIL then is killed inside C++ code
    # and the process aborts ("terminate called without an active exception"), so the exit
    # waits for it; and, for 2 s at most, for one never released.
    script = (
        f"RELEASED = {released}\nSIGNAL = 'SIGINT'\n"
        + _BLOCKED_REPLICA
        + textwrap.dedent(
            """
            def body(x):
                if block():
                    deadline = time.monotonic() + 0.5
                    while time.monotonic() < deadline:
                        torch.ones(100).add_(1)
                return fdp.psum(x, "i")
            try:
                fdp.pmap(body, axis_name="i", devices=["cpu", "cpu"])(torch.ones(2))
            except KeyboardInterrupt as interrupted:
                notes = str(getattr(interrupted, "__notes__", []))
                print("gave up:", "stopped waiting for replica 1" in notes)
            if RELEASED:
                release.set()
            """
        )
    )
    # (A replica blocked for good holds the exit 2 s, not until the timeout.)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "gave up: True" in result.stdout, result.stdout
    assert "terminate" not in result.stderr, result.stderr


def test_many_failures_in_a_row_leave_nothing_behind() -> None:
    f = fdp.pmap(injected_at("before"), axis_name="i", devices=cpus(4))
    threads = threading.active_count()
    for _ in range(50):
        with pytest.raises(Injected):
            f(torch.ones(4))
    assert threading.active_count() == threads
    assert_workers_idle()


@pytest.mark.parametrize(
    ("n", "axis_name", "where"),
    [(1, "i", "replica"), (2, None, "replica"), (2, "i", "replica"), (3, "i", "replica")]
    + [(2, "i", "combine"), (3, "i", "combine")],
)
def test_a_failed_calls_tensors_go_with_its_error(n: int, axis_name: str | None, where: str) -> None:
    # The failure's traceback holds the call's frames; those held it back (lists of errors, the
    # call group, a collective's round): a cycle that kept every replica's tensors until the
    # garbage collector ran, long after the caller let the error go. A retry after running out
    # of memory would find the memory still taken.
    made: list[weakref.ref[torch.Tensor]] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        made.append(weakref.ref(h))
        if where == "combine":  # shapes that differ between the replicas: psum's combine fails
            return fdp.psum(h[: fdp.axis_index("i") + 1], "i")
        if h.shape[0] == 1:  # the last replica (with axis None, run in the caller's thread too)
            raise Injected("boom")
        return h

    f = fdp.pmap(body, axis_name=axis_name, devices=cpus(n))
    batch = 2 * n if where == "combine" else 2 * n - 1  # 2 rows a replica (the last 1, to fail)
    for _ in range(3):  # the first calls time the replicas (the next may run them inline)
        with pytest.raises((Injected, ValueError)):
            f(torch.randn(batch, 3))
    collect_when_workers_rest()
    made.clear()
    gc.disable()
    try:
        with pytest.raises((Injected, ValueError)):
            f(torch.randn(batch, 3))
        assert_workers_idle()
        assert made and [ref() for ref in made] == [None] * len(made)
    finally:
        gc.enable()
