"""The replica threads: shared, started on first need, robust to failures and interrupts."""

from __future__ import annotations

import contextvars
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from helpers import cpus, finishes

import fdp
from fdp import _pool, _replica


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


@pytest.mark.usefixtures("on_workers")
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
    _pool._WORKERS[key].start()
    _pool._WORKERS[key].wait_ready()
    monkeypatch.setattr(_pool, "_workers_for", lambda devices: [_pool._WORKERS[key]])
    with pytest.raises(RuntimeError, match="could not start") as info:
        _pool.run_replicas([device, device], [lambda: 0, lambda: 1], caller="test")
    assert "no such device" in str(info.value.__cause__)
    _pool._WORKERS[key].tasks.put(None)


def test_a_worker_thread_that_fails_to_start_leaves_no_worker_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    # The process at its thread limit: the call fails, and once threads can start again the
    # next call works. A worker left registered without a thread would take the next call's
    # replica 1, and replica 0 would wait for it in the psum forever.
    monkeypatch.setattr(_pool, "_WORKERS", {})  # this test's own workers, stopped below
    start = _pool._Worker.start

    def refuse(self: _pool._Worker) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_pool._Worker, "start", refuse)
    f = fdp.pmap(lambda x: fdp.psum(x, "i"), axis_name="i", devices=cpus(2))
    with pytest.raises(RuntimeError, match="can't start new thread"):
        finishes(lambda: f(torch.ones(2)))
    monkeypatch.setattr(_pool._Worker, "start", start)
    try:
        torch.testing.assert_close(finishes(lambda: f(torch.ones(2))), torch.full((2,), 2.0))
    finally:
        for worker in _pool._WORKERS.values():
            worker.tasks.put(None)


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


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise AttributeError("no name")


class _UnprintableRuntimeError(RuntimeError):  # RuntimeErrors' messages are read for a hint
    def __str__(self) -> str:
        raise AttributeError("no name")


@pytest.mark.parametrize("kind", [_Unprintable, _UnprintableRuntimeError])
@pytest.mark.parametrize("axis_name", [None, "i"])
def test_an_exception_whose_str_fails_is_still_the_one_raised(axis_name: str | None, kind: type) -> None:
    # The notes about the other replicas' failures must not replace the failure reported.
    def f(x):
        if axis_name is not None:
            fdp.psum(x, axis_name)
        raise kind()

    with pytest.raises(kind) as info:
        fdp.pmap(f, devices=cpus(2), axis_name=axis_name)(torch.zeros(2))
    assert info.value.__notes__[1].endswith(f"also failed with the same {kind.__name__}")


class _FrozenNotes(Exception):
    __notes__ = ("set by the class",)  # not a list: add_note refuses it


class _NoNotes(Exception):
    def add_note(self, note: str) -> None:
        raise RuntimeError("this exception takes no notes")


class _OddNotes(Exception):
    def __init__(self) -> None:
        super().__init__("odd notes")
        self.__notes__ = [42]  # a note need not be a string (the traceback prints its repr)


@pytest.mark.parametrize("kind", [_FrozenNotes, _NoNotes, _OddNotes])
@pytest.mark.parametrize(("n", "axis_name"), [(1, None), (1, "i"), (2, None), (2, "i")])
def test_an_exception_that_refuses_notes_is_still_the_one_raised(
    n: int, axis_name: str | None, kind: type
) -> None:
    # Adding the notes must not replace the failure reported with a TypeError of its own.
    def f(x):
        if axis_name is not None:
            fdp.psum(x, axis_name)
        raise kind()

    with pytest.raises(kind):
        fdp.pmap(f, devices=cpus(n), axis_name=axis_name)(torch.zeros(n))
    if axis_name is None:
        with pytest.raises(kind):
            fdp.parallel_apply(f, [torch.zeros(1)] * n, devices=cpus(n))


def test_interrupt_while_waiting_keeps_the_other_replicas_errors() -> None:
    # A real KeyboardInterrupt in the waiting caller, in a child process so that a stray signal
    # cannot reach the test runner.
    script = textwrap.dedent(
        """
        import _thread, signal, threading, time, torch, fdp

        # interrupt_main does nothing where SIGINT was ignored at start (a background job of a
        # non-interactive shell): Python's handler is put back first.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        fdp._pool.INLINE_REPLICAS = False  # replica 1 runs on its worker

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


# --- small replicas run inline ----------------------------------------------------------------


def _thread_names(devices: list[str], calls: int = 3):
    names: list[list[str]] = []

    def f(x):
        names[-1].append(threading.current_thread().name)
        return x

    mapped = fdp.pmap(f, devices=devices)
    for _ in range(calls):
        names.append([])
        torch.testing.assert_close(mapped(torch.arange(6.0)), torch.arange(6.0))
    return names


def test_small_replicas_run_in_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)  # any replica is "small"
    names = _thread_names(cpus(3))
    assert names[-1] == [threading.current_thread().name] * 3


def test_inline_running_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)
    monkeypatch.setattr(_pool, "INLINE_REPLICAS", False)
    names = _thread_names(cpus(3))
    assert len(set(names[-1])) == 3


def test_large_replicas_still_run_in_parallel() -> None:
    # Replicas that wait for one another can only finish if they run at the same time.
    together = threading.Barrier(3, timeout=30)

    def f(x):
        together.wait()
        return x + 1

    mapped = fdp.pmap(f, devices=cpus(3))
    for _ in range(3):
        torch.testing.assert_close(mapped(torch.zeros(3)), torch.ones(3))


def test_inline_replicas_hand_over_at_their_first_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)
    threads: set[str] = set()

    def f(x):
        threads.add(threading.current_thread().name)
        return fdp.psum(x, "i") + fdp.axis_index("i")

    mapped = fdp.pmap(f, axis_name="i", devices=cpus(4))
    for _ in range(4):
        threads.clear()
        torch.testing.assert_close(mapped(torch.ones(4)), torch.tensor([4.0, 5.0, 6.0, 7.0]))
    assert len(threads) == 4  # the collective needs them all at once


def test_collective_skipped_by_replica_0_fails_instead_of_hanging_inline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)

    def f(x):
        return x if fdp.axis_index("i") == 0 else fdp.psum(x, "i")

    mapped = fdp.pmap(lambda x: x, axis_name="i", devices=cpus(3))
    mapped(torch.ones(3))  # records a small replica time
    mapped.fn = f
    with pytest.raises(RuntimeError, match="replica 0 returned without calling fdp.psum"):
        mapped(torch.ones(3))


def test_inline_replicas_get_the_callers_state_even_if_replica_0_changed_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)
    seen: list[bool] = []

    def f(x):
        seen.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)  # not restored: must not leak into the next replica
        return x

    mapped = fdp.pmap(f, devices=cpus(3))
    for _ in range(2):
        seen.clear()
        mapped(torch.ones(3))
        torch.set_grad_enabled(True)
        assert seen == [True, True, True]


_SCALE: contextvars.ContextVar[float] = contextvars.ContextVar("_SCALE", default=1.0)


@pytest.mark.parametrize("axis_name", [None, "i"])
def test_inline_replicas_get_the_callers_contextvars_even_if_replica_0_changed_them(
    monkeypatch: pytest.MonkeyPatch, axis_name: str | None
) -> None:
    # Without an axis name, the caller runs them one after another from the start; with one,
    # it runs them when replica 0 returns without meeting them in a collective.
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)
    names: list[str] = []

    def f(x):
        names.append(threading.current_thread().name)
        value = x * _SCALE.get()
        _SCALE.set(-1.0)  # must not reach the next replica
        return value

    mapped = fdp.pmap(f, devices=cpus(3), axis_name=axis_name)
    token = _SCALE.set(10.0)
    try:
        for _ in range(3):
            _SCALE.set(10.0)
            names.clear()
            assert mapped(torch.ones(3)).tolist() == [10.0] * 3
        assert names == [threading.current_thread().name] * 3  # all three ran inline
    finally:
        _SCALE.reset(token)


def test_failing_inline_replica_reports_like_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)
    fail = [False]

    def f(x):
        if fail[0] and fdp.axis_index("i") == 1:
            raise KeyError("replica 1")
        return x

    mapped = fdp.pmap(f, axis_name="i", devices=cpus(3))
    mapped(torch.ones(3))
    fail[0] = True
    with pytest.raises(KeyError) as info:
        mapped(torch.ones(3))
    assert info.value.__notes__ == [f"{mapped._caller}: raised by replica 1 of 3 (device cpu)"]
    fail[0] = False
    torch.testing.assert_close(mapped(torch.ones(3)), torch.ones(3))


def test_inline_replicas_without_an_axis_name_fail_like_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    # No collective can join replicas without an axis name: the caller runs them one after
    # another, each as its own replica, and stops at the first failure.
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)
    ran: list[int] = []
    fail = [False]

    def f(x):
        index = int(x)  # the input says which replica this is
        ran.append(index)
        if fail[0] and index == 1:
            raise KeyError("replica 1")
        return x

    mapped = fdp.pmap(f, devices=cpus(3))
    mapped(torch.arange(3.0))
    ran.clear()
    fail[0] = True
    before = mapped._timing.seconds
    with pytest.raises(KeyError) as info:
        mapped(torch.arange(3.0))
    assert info.value.__notes__ == [f"{mapped._caller}: raised by replica 1 of 3 (device cpu)"]
    assert ran == [0, 1]
    assert mapped._timing.seconds != before  # replica 0, run by the caller, is timed too
    fail[0] = False
    torch.testing.assert_close(mapped(torch.arange(3.0)), torch.arange(3.0))


def test_inline_replicas_without_an_axis_name_know_which_replica_they_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)
    inner = fdp.pmap(lambda x: x, devices=cpus(2))
    nest = [False]

    def f(x):
        if nest[0] and int(x) == 2:
            inner(x)
        return x

    mapped = fdp.pmap(f, devices=cpus(3))
    mapped(torch.arange(3.0))
    nest[0] = True
    with pytest.raises(RuntimeError, match=r"already running as replica 2 of 3 \(device cpu\)"):
        mapped(torch.arange(3.0))


def test_no_inline_running_under_a_function_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker does not see the caller's modes; which thread runs a replica must not matter.
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)
    modes: list[int] = []

    def f(x):
        modes.append(torch._C._len_torch_function_stack())
        return x

    class Passthrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    mapped = fdp.pmap(f, devices=cpus(2))
    x = torch.ones(2)
    mapped(x)
    with Passthrough():
        for _ in range(3):
            modes.clear()
            mapped(x)
            assert sorted(modes) == [0, 1]  # replica 0 (caller's thread) sees it, replica 1 not


def test_replica_times_and_wake_up_estimate_are_recorded() -> None:
    mapped = fdp.pmap(lambda x: x, devices=cpus(2))
    assert mapped._timing.seconds is None
    mapped(torch.ones(2))
    assert mapped._timing.seconds is not None and mapped._timing.seconds > 0
    assert _pool._wake_seconds > 0


def test_workers_are_stopped_at_exit_and_restart_if_needed() -> None:
    # A worker still waking up for a replica the caller ran itself could otherwise drop the last
    # reference to a tensor during interpreter shutdown, inside C++ code that then aborts.
    script = textwrap.dedent(
        """
        import atexit, torch, fdp
        from fdp import _pool
        step = fdp.pmap(lambda x: x + 1, devices=["cpu"] * 4, split="balanced")
        step(torch.zeros(4))
        workers = list(_pool._WORKERS.values())
        assert len(workers) == 3
        _pool._stop_workers()
        assert not any(w.is_alive() for w in workers) and not _pool._WORKERS
        assert step(torch.zeros(4)).tolist() == [1.0] * 4  # e.g. from a later atexit hook
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr


def test_processes_forked_after_calls_make_calls_of_their_own() -> None:
    # DataLoader workers (forked) whose dataset calls a pmapped function: the workers of the
    # parent's pool are not in the child, which starts its own. A worker forked by a replica (a
    # DataLoader iterated in the mapped function) runs no replica of the parent's call: its
    # calls were refused as nested, and a collective there would have waited forever for
    # replicas that are not in the process.
    script = textwrap.dedent(
        """
        import torch, fdp
        from torch.utils.data import DataLoader, Dataset
        from fdp import _pool
        _pool.INLINE_REPLICAS = False
        total = fdp.pmap(lambda x: fdp.psum(x, "j"), axis_name="j", devices=["cpu", "cpu"])
        class Sums(Dataset):
            def __len__(self):
                return 2
            def __getitem__(self, i):
                return total(torch.full((2,), float(i))).tolist()
        def load():
            loader = DataLoader(Sums(), batch_size=None, num_workers=1, multiprocessing_context="fork")
            return [item for item in loader]
        print("caller", load())
        def body(x):
            if fdp.axis_index("i") == 1:
                print("replica", load())
            return fdp.psum(x, "i")
        print("call", fdp.pmap(body, axis_name="i", devices=["cpu", "cpu"])(torch.ones(2)).tolist())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "caller [[0.0, 0.0], [2.0, 2.0]]",
        "replica [[0.0, 0.0], [2.0, 2.0]]",
        "call [2.0, 2.0]",
    ], result.stdout + result.stderr


def test_a_process_forked_while_another_thread_holds_fdps_locks_can_call() -> None:
    # Fork copies only the forking thread: a module-level lock another thread held then (a
    # replica checking out a skeleton, a new dataclass being registered) stayed held in the
    # child for good, and the child's first such call waited forever.
    script = textwrap.dedent(
        """
        import dataclasses, os, threading, time, torch, fdp
        from fdp import _functional_call, _tree
        held, release = threading.Event(), threading.Event()
        def hold():
            with _functional_call._FREE_LOCK, _tree._REGISTRY_LOCK:
                held.set()
                release.wait()
        threading.Thread(target=hold, daemon=True).start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            @dataclasses.dataclass
            class Batch:
                x: torch.Tensor
            doubled = fdp.pmap(lambda b: b.x * 2, devices=["cpu", "cpu"])(Batch(torch.ones(2, 1)))
            m = torch.nn.Linear(1, 1)
            fdp.functional_call(m, dict(m.named_parameters()), (torch.ones(1, 1),))
            os._exit(0 if doubled.tolist() == [[2.0], [2.0]] else 1)
        release.set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("child", os.waitstatus_to_exitcode(status))
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            print("child hung")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "child 0\n", result.stdout + result.stderr


def test_a_call_after_optree_cleared_its_registry_at_exit_says_so() -> None:
    # optree empties its registry in an atexit hook of its own, registered when fdp imports it:
    # a hook registered before `import fdp` runs after it, and every tree is then one leaf. The
    # call failed with "found no tensor to map: every tensor argument has axis None", about
    # arguments that were fine. (A hook registered after optree's import runs before its clear.)
    script = textwrap.dedent(
        """
        import atexit, torch
        def late():
            import fdp
            try:
                fdp.pmap(lambda x: x + 1, devices=["cpu"] * 2)(torch.zeros(2))
                print("ran")
            except RuntimeError as error:
                print(error)
        atexit.register(late)
        import fdp
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "fdp was called after optree cleared its registry of container types at interpreter exit "
        "(tuples, lists and dicts would be single leaves): from an atexit hook registered before "
        "fdp (and optree) were imported, which runs after optree's own. Register the hook after "
        "`import fdp`, or import optree before registering it."
    ], result.stdout + result.stderr
    early = script.replace("import atexit, torch", "import atexit, optree, torch")
    result = subprocess.run([sys.executable, "-c", early], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.splitlines() == ["ran"], result.stdout + result.stderr


def test_failed_hand_over_at_a_collective_fails_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)
    retried: list[str] = []

    def f(x):
        try:
            return fdp.psum(x, "i")
        except RuntimeError as error:
            retried.append(str(error))
            return fdp.psum(x, "i")  # retried: must fail too, not wait for replicas never queued

    mapped = fdp.pmap(lambda x: x, axis_name="i", devices=cpus(2))
    mapped(torch.ones(2))
    mapped.fn = f

    def no_threads(devices):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_pool, "_workers_for", no_threads)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        finishes(lambda: mapped(torch.ones(2)))
    assert retried == ["can't start new thread"]


class _PutInterrupted:
    """A worker's queue whose next put of a task raises KeyboardInterrupt instead: Ctrl-C
    landing in the caller between two replicas' puts."""

    def __init__(self, tasks) -> None:
        self.tasks = tasks
        self.armed = True

    def put(self, task) -> None:
        if self.armed and task is not None:
            self.armed = False
            raise KeyboardInterrupt("between two puts")
        self.tasks.put(task)

    def get(self):
        return self.tasks.get()

    def empty(self) -> bool:
        return self.tasks.empty()


def test_an_interrupt_between_the_hand_overs_puts_does_not_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    # Small replicas are handed over at replica 0's first collective. An interrupt that landed
    # after replica 1 was queued but before replica 2 was left the caller waiting, forever, for
    # a replica that no worker would ever run (until a second Ctrl-C).
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)
    mapped = fdp.pmap(lambda x: fdp.psum(x, "i"), axis_name="i", devices=cpus(3))
    mapped(torch.ones(3))  # starts the workers, and times the replicas: small from now on
    worker = _pool._WORKERS[(torch.device("cpu"), 1)]  # replica 2's
    monkeypatch.setattr(worker, "tasks", _PutInterrupted(worker.tasks))
    with pytest.raises(KeyboardInterrupt, match="between two puts"):
        finishes(lambda: mapped(torch.ones(3)), 10)
    torch.testing.assert_close(finishes(lambda: mapped(torch.ones(3))), torch.full((3,), 3.0))


def test_wake_up_samples_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    # Time queued behind other calls is not a wake-up: each sample counts at most the cap.
    monkeypatch.setattr(_pool, "_wake_seconds", 0.0)
    monkeypatch.setattr(_pool, "_MAX_WAKE_SECONDS", 1e-12)
    monkeypatch.setattr(_pool, "INLINE_REPLICAS", False)
    mapped = fdp.pmap(lambda x: x, devices=cpus(3))
    for _ in range(5):
        mapped(torch.ones(3))
    assert 0.0 < _pool._wake_seconds <= 1e-12


def test_caller_runs_no_more_replicas_once_the_call_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)
    ran: list[int] = []
    fail = [False]

    def f(x):
        index = fdp.axis_index("i")
        ran.append(index)
        if fail[0] and index == 0:
            raise KeyError("replica 0")
        return x

    mapped = fdp.pmap(f, axis_name="i", devices=cpus(3))
    mapped(torch.ones(3))
    ran.clear()
    fail[0] = True
    with pytest.raises(KeyError):
        mapped(torch.ones(3))
    assert ran == [0]  # inline: the others were never handed over, and are not run


# --- taking turns (a compiled function's first run) ---------------------------------------------


def _replicas_in_turns(n: int, body) -> list:
    """Runs ``body(i)`` as replica i of n on the CPU with ``take_turns``, in a bounded time."""
    replicas = [lambda i=i: body(i) for i in range(n)]
    devices = [torch.device("cpu")] * n
    return finishes(lambda: _pool.run_replicas(devices, replicas, axis_name="i", caller="t", take_turns=True))


def test_replicas_taking_turns_never_overlap_between_collectives() -> None:
    running: list[int] = []
    overlaps: list[list[int]] = []
    lock = threading.Lock()

    def segment(i: int) -> None:
        with lock:
            running.append(i)
            if len(running) > 1:
                overlaps.append(list(running))
        time.sleep(0.01)  # long enough for another replica to start, were it let in
        with lock:
            running.remove(i)

    def body(i: int) -> torch.Tensor:
        segment(i)
        total = fdp.psum(torch.tensor(float(i)), "i")  # the replicas meet: they must all be let in
        segment(i)
        total = fdp.psum(total, "i")
        segment(i)
        return total

    assert torch.stack(_replicas_in_turns(4, body)).tolist() == [24.0] * 4  # (0+1+2+3) * 4
    assert overlaps == []


def test_without_turns_the_same_replicas_do_overlap() -> None:
    # The oracle for the test above: the segments are long enough to overlap when free to.
    running: list[int] = []
    most = [0]
    lock = threading.Lock()

    def body(i: int) -> int:
        with lock:
            running.append(i)
            most[0] = max(most[0], len(running))
        time.sleep(0.05)
        with lock:
            running.remove(i)
        return i

    replicas = [lambda i=i: body(i) for i in range(3)]
    devices = [torch.device("cpu")] * 3
    assert finishes(lambda: _pool.run_replicas(devices, replicas, caller="t")) == [0, 1, 2]
    assert most[0] > 1


def test_a_replica_failing_in_its_turn_releases_the_others() -> None:
    def body(i: int) -> torch.Tensor:
        if i == 2:
            raise ValueError("replica 2 failed")
        return fdp.psum(torch.ones(()), "i")

    with pytest.raises(ValueError, match="replica 2 failed"):
        _replicas_in_turns(3, body)


def test_a_turn_lost_by_a_failed_replica_aborts_the_waiting_ones() -> None:
    # A replica interrupted right after taking its turn could never give it back: the others
    # must not wait for it forever once the call has failed.
    from fdp import _replica

    for ordered in (False, True):
        group = _replica.CallGroup(2, (torch.device("cpu"),) * 2)
        turnstile = _replica.Turnstile(2, ordered=ordered)
        turnstile.enter(0, group)  # taken, and never to be given back
        group.abort(0, KeyboardInterrupt())
        with pytest.raises(_replica.ReplicaAborted, match="waiting for its turn when replica 0 failed"):
            finishes(lambda turnstile=turnstile, group=group: turnstile.enter(1, group))


def test_ordered_turns_go_in_index_order() -> None:
    from fdp import _replica

    group = _replica.CallGroup(3, (torch.device("cpu"),) * 3)
    turnstile = _replica.Turnstile(3, ordered=True)
    order: list[int] = []

    def turns(i: int) -> None:
        for _ in range(2):  # two pieces each, as around one collective
            turnstile.enter(i, group)
            order.append(i)
            time.sleep(0.002)
            turnstile.leave(i)

    threads = [threading.Thread(target=turns, args=(i,), daemon=True) for i in (2, 1, 0)]  # started backwards
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == [0, 1, 2, 0, 1, 2]


def test_a_replica_failing_in_its_turn_is_the_last_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from fdp import _replica

    ran: list[int] = []
    abort = _replica.CallGroup.abort

    def slow_abort(self: _replica.CallGroup, index: int, error: BaseException) -> None:
        # A wide window before the failure is recorded: a turn passed on before it would let
        # the next replica run (and perhaps compile) its part of a call that is over.
        time.sleep(0.05)
        abort(self, index, error)

    monkeypatch.setattr(_replica.CallGroup, "abort", slow_abort)

    def body(i: int) -> None:
        ran.append(i)
        raise ValueError(f"replica {i} failed")

    with pytest.raises(ValueError, match="failed"):
        _replicas_in_turns(4, body)
    assert len(ran) == 1, ran  # the call had failed before the turn passed on


@pytest.mark.parametrize("timing", ["inline", "stealing"])
def test_turns_with_the_caller_running_replicas(timing: str) -> None:
    # Small replicas run inline (handed over at the first collective); without a collective,
    # the caller takes back replicas no worker has started. Turns hold in both.
    recent = _pool.Timing()
    recent.record(1e-7 if timing == "inline" else 1.0)
    running: list[int] = []
    overlaps: list[list[int]] = []
    lock = threading.Lock()

    def body(i: int) -> torch.Tensor:
        with lock:
            running.append(i)
            if len(running) > 1:
                overlaps.append(list(running))
        time.sleep(0.005)
        with lock:
            running.remove(i)
        x = torch.tensor(float(i))
        return fdp.psum(x, "i") if timing == "inline" else x

    replicas = [lambda i=i: body(i) for i in range(3)]
    devices = [torch.device("cpu")] * 3
    results = finishes(
        lambda: _pool.run_replicas(
            devices, replicas, axis_name="i", caller="t", timing=recent, take_turns=True
        )
    )
    expected = [3.0] * 3 if timing == "inline" else [0.0, 1.0, 2.0]
    assert torch.stack(results).tolist() == expected
    assert overlaps == []


def test_math_kernels_are_resolved_before_replicas_run_side_by_side() -> None:
    # MKL picks a vector math function's kernel on its first call, and first calls racing in
    # threads can get a low-accuracy kernel (pytorch/pytorch#188792): the first worker calls
    # each such function once, while no replica runs. In a child process: a fresh MKL.
    script = textwrap.dedent(
        """
        import threading, torch, fdp
        fdp._pool.INLINE_REPLICAS = False
        events = []
        tanh = torch.tanh
        def recording_tanh(x, *args, **kwargs):
            events.append(("tanh", threading.current_thread().name, x.numel(), x.dtype))
            return tanh(x, *args, **kwargs)
        torch.tanh = recording_tanh
        def body(x):
            events.append(("replica", threading.current_thread().name))
            return x
        fdp.pmap(body, devices=["cpu"])(torch.ones(2))
        print("one replica:", fdp._pool._math_kernels_resolved)
        fdp.pmap(body, devices=["cpu"] * 3)(torch.ones(3))
        print("first replica event:", [e[0] for e in events[1:]].index("replica"))
        print(events[1:3])
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "one replica: False"  # one replica, no thread beside it: nothing to do
    assert lines[1] == "first replica event: 2"  # float and double tanh first, then replicas
    assert lines[2] == (
        "[('tanh', 'fdp-worker-cpu-1', 1, torch.float32), ('tanh', 'fdp-worker-cpu-1', 1, torch.float64)]"
    )


# --- one replica ---------------------------------------------------------------------------------


def test_a_lone_replica_runs_as_replica_0_of_1_and_leaves_no_context_behind() -> None:
    seen = []

    def f(x):
        context = _replica.current()
        seen.append((context.index, context.size, context.device, context.axis_name))
        if x.sum() < 0:
            raise ValueError("negative")
        return x

    lone = fdp.pmap(f, devices=["cpu"])
    named = fdp.pmap(
        lambda x: fdp.psum(x, "i") * fdp.axis_size("i") + fdp.axis_index("i"), axis_name="i", devices=["cpu"]
    )
    lone(torch.ones(2))
    with pytest.raises(ValueError, match="negative") as info:
        lone(-torch.ones(2))
    assert any(
        note.endswith("<locals>.f): raised by replica 0 of 1 (device cpu)") for note in info.value.__notes__
    )
    assert seen == [(0, 1, torch.device("cpu"), None)] * 2
    assert _replica.current() is None
    torch.testing.assert_close(named(torch.ones(2)), torch.ones(2))
    assert _replica.current() is None
    with pytest.raises(NameError, match="unbound axis name: i .*given no axis_name"):
        fdp.pmap(lambda x: fdp.psum(x, "i"), devices=["cpu"])(torch.ones(2))
    with pytest.raises(RuntimeError, match="already running as replica 0 of 1 .*nested pmap"):
        fdp.pmap(lambda x: lone(x), devices=["cpu"])(torch.ones(2))


def test_a_lone_replica_under_rng_scope_gets_replica_0s_stream() -> None:
    draw = fdp.pmap(lambda x: x + torch.rand(x.shape), devices=["cpu"])
    two = fdp.pmap(lambda x: x + torch.rand(x.shape), devices=cpus(2))
    with fdp.rng_scope(7):
        a = draw(torch.zeros(3))
    with fdp.rng_scope(7):
        b = draw(torch.zeros(3))
    with fdp.rng_scope(7):
        c = two(torch.zeros(6))
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c[:3])
