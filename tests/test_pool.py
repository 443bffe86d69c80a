"""The replica threads: shared, started on first need, robust to failures and interrupts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from helpers import cpus

import fdp
from fdp import _pool


def test_workers_start_only_for_replicas_that_run() -> None:
    many = cpus(200)
    before = threading.active_count()
    fdp.pmap(lambda x: x, devices=many)(torch.zeros(3))  # three replicas: two workers at most
    assert threading.active_count() - before <= 2


def test_workers_are_shared_between_functions_and_device_lists() -> None:
    fdp.pmap(lambda x: x, devices=cpus(4))(torch.zeros(4))
    count = threading.active_count()
    fdp.pmap(lambda x: x + 1, devices=cpus(3))(torch.zeros(3))
    fdp.pmap(lambda x: x + 2, devices=cpus(2))(torch.zeros(2))
    for _ in range(5):
        fdp.parallel_apply(torch.neg, [torch.ones(1)] * 4)
    assert threading.active_count() == count


def test_worker_that_cannot_start_fails_its_replicas_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Broken(_pool._Worker):
        def run(self) -> None:
            self.init_error = RuntimeError("no such device")
            self._ready.set()
            while (task := self.tasks.get()) is not None:
                task()

    device = torch.device("cpu")
    key = (device, 99)
    monkeypatch.setitem(_pool._WORKERS, key, Broken(device, 99))
    _pool._WORKERS[key].start_and_wait()
    monkeypatch.setattr(_pool, "_workers_for", lambda devices: [_pool._WORKERS[key]])
    with pytest.raises(RuntimeError, match="could not start") as info:
        _pool.run_replicas([device, device], [lambda: 0, lambda: 1], caller="test")
    assert "no such device" in str(info.value.__cause__)
    _pool._WORKERS[key].tasks.put(None)


def test_same_exception_object_from_several_replicas() -> None:
    shared = ValueError("shared")

    def f(x):
        raise shared

    for _ in range(2):  # notes do not pile up when the object is raised again
        with pytest.raises(ValueError) as info:
            fdp.pmap(f, devices=cpus(3))(torch.zeros(3))
        assert info.value.__notes__ == [
            "fdp.pmap(test_same_exception_object_from_several_replicas.<locals>.f): raised by "
            "replica 0 of 3 (device cpu), and the same object by replica(s) [1, 2]"
        ]


def test_interrupt_while_waiting_keeps_the_other_replicas_errors() -> None:
    # A real KeyboardInterrupt in the waiting caller, in a child process so that a stray signal
    # cannot reach the test runner.
    script = textwrap.dedent(
        """
        import _thread, threading, time, torch, fdp

        def f(x):
            if x[0] > 0:                 # replica 1, on a worker
                _thread.interrupt_main()  # the caller is waiting for this replica
                time.sleep(0.2)
                raise ValueError("worker failed too")
            return x

        try:
            fdp.pmap(f, devices=["cpu", "cpu"])(torch.arange(2.0))
        except KeyboardInterrupt as interrupt:
            print("notes:", getattr(interrupt, "__notes__", []))
        out = fdp.pmap(lambda x: x + 1, devices=["cpu", "cpu"])(torch.zeros(2))
        print("next call:", out.tolist(), "threads:", threading.active_count())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # The interrupt lands either in replica 0 (run by the caller) or in the wait that follows;
    # either way the worker's own failure is reported with it.
    assert "replica 1 (device cpu)" in result.stdout
    assert "ValueError: worker failed too" in result.stdout
    assert "next call: [1.0, 1.0]" in result.stdout
