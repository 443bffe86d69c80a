"""The caller's grad mode, inference mode, autocast (dtype too), saved-tensor hooks, intra-op
thread count and rarer autograd switches reach every replica."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch
from helpers import cpus

import fdp

# What reaches the workers' threads: the caller must not run the replicas inline.
pytestmark = pytest.mark.usefixtures("on_workers")


def observe(devices: list[str]):
    """A pmapped function that records each replica's view of the thread-local state."""
    seen: list[dict[str, object]] = []
    lock = threading.Lock()

    def f(x):
        state = {
            "thread": threading.current_thread().name,
            "grad": torch.is_grad_enabled(),
            "inference": torch.is_inference_mode_enabled(),
            "cpu_autocast": torch.is_autocast_enabled("cpu"),
            "cpu_dtype": torch.get_autocast_dtype("cpu"),
            "cache": torch.is_autocast_cache_enabled(),
            "matmul_dtype": (x @ x.T).dtype,
        }
        with lock:
            seen.append(state)
        return x

    return fdp.pmap(f, devices=devices), seen


def test_workers_are_persistent_and_replica_0_runs_in_the_caller() -> None:
    f, seen = observe(cpus(3))
    f(torch.ones(3, 2))
    first = {s["thread"] for s in seen}
    seen.clear()
    f(torch.ones(3, 2))
    assert {s["thread"] for s in seen} == first
    assert threading.current_thread().name in first
    assert len(first) == 3


def test_single_replica_runs_in_the_calling_thread() -> None:
    f, seen = observe(cpus(1))
    f(torch.ones(2, 2))
    assert [s["thread"] for s in seen] == [threading.current_thread().name]


def test_no_new_threads_per_call(devices: list[str]) -> None:
    f, _ = observe(devices)
    f(torch.ones(8, 2))
    count = threading.active_count()
    for _ in range(20):
        f(torch.ones(8, 2))
    assert threading.active_count() == count


@pytest.mark.parametrize("grad", [True, False])
def test_grad_mode(grad: bool) -> None:
    f, seen = observe(cpus(3))
    with torch.set_grad_enabled(grad):
        f(torch.ones(3, 2))
    assert [s["grad"] for s in seen] == [grad] * 3


def test_inference_mode() -> None:
    f, seen = observe(cpus(3))
    with torch.inference_mode():
        out = f(torch.ones(3, 2))
    assert all(s["inference"] and not s["grad"] for s in seen)
    assert out.is_inference()
    seen.clear()
    f(torch.ones(3, 2))
    assert not any(s["inference"] for s in seen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_dtype_reaches_every_replica(dtype: torch.dtype) -> None:
    # nn.DataParallel carries only the enabled flag: a bfloat16 region runs in float16.
    f, seen = observe(cpus(3))
    with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
        f(torch.ones(3, 2))
    assert [(s["cpu_autocast"], s["cpu_dtype"], s["matmul_dtype"], s["cache"]) for s in seen] == [
        (True, dtype, dtype, False)
    ] * 3
    seen.clear()
    f(torch.ones(3, 2))
    assert not any(s["cpu_autocast"] for s in seen)
    assert all(s["matmul_dtype"] == torch.float32 for s in seen)


@pytest.mark.parametrize("axis_name", [None, "i"])
def test_an_autocast_dtype_set_while_autocast_is_off_reaches_every_replica(axis_name: str | None) -> None:
    # Autocast's dtypes are thread-local: set in the caller, an autocast entered without a
    # dtype inside the mapped function ran float16 in replica 0 and bfloat16 in the others.
    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu"):
            return x @ x.T

    mapped = fdp.pmap(f, axis_name=axis_name, devices=cpus(3), out_axes=fdp.PER_REPLICA)
    torch.set_autocast_dtype("cpu", torch.float16)
    try:
        out = mapped(torch.ones(3, 2))
    finally:
        torch.set_autocast_dtype("cpu", torch.bfloat16)
    assert [out[r].dtype for r in range(3)] == [torch.float16] * 3
    # Taken back in the workers: the next call's replicas have the caller's dtype again.
    out = mapped(torch.ones(3, 2))
    assert [out[r].dtype for r in range(3)] == [torch.bfloat16] * 3


@pytest.mark.parametrize("axis_name", [None, "i"])
def test_autocast_results_are_one_devices(axis_name: str | None) -> None:
    """Values, not only dtypes: an autocast entered around the call, one entered inside the
    mapped function, and an autocast(enabled=False) region nested in either give every replica
    the results of the same computation on one device."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(6, 8)

    def outside(p, x):  # run under the caller's autocast
        h = fdp.functional_call(model, p, (x,))
        with torch.autocast("cpu", enabled=False):
            return h, h @ torch.ones(4, 2, dtype=h.dtype), x @ p["0.weight"].T

    def inside(p, x):
        with torch.autocast("cpu", dtype=torch.float16):
            return outside(p, x)

    for fn, dtype in ((outside, torch.bfloat16), (inside, torch.float16)):
        mapped = fdp.pmap(fn, in_axes=(None, 0), devices=cpus(3), axis_name=axis_name)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = mapped(params, x)
            shards = [fn(params, s) for s in x.chunk(3)]
        expected = [torch.cat(parts) for parts in zip(*shards)]
        assert [t.dtype for t in got] == [dtype, dtype, torch.float32]
        for g, e in zip(got, expected):
            assert torch.equal(g, e)


def test_saved_tensor_hooks_apply_in_replicas() -> None:
    packed: list[str] = []
    lock = threading.Lock()

    def pack(t):
        with lock:
            packed.append(threading.current_thread().name)
        return t

    x = torch.ones(4, 2, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fdp.pmap(lambda x: (x * x).sum(), devices=cpus(2))(x)
    out.sum().backward()
    assert len(set(packed)) == 2
    torch.testing.assert_close(x.grad, 2 * x.detach())


def test_checkpointing_around_a_call_with_collectives() -> None:
    """torch.utils.checkpoint's hooks match saved tensors by the order they are saved in, which
    replicas running side by side did not keep: they now take turns in index order between
    collectives (gradients were silently wrong where the shapes of the mixed-up tensors agree)."""
    from torch.utils.checkpoint import checkpoint

    f = fdp.pmap(
        lambda x: torch.sin(x) * fdp.pmean(torch.sin(x).sum(0, keepdim=True), "i"),
        axis_name="i",
        devices=cpus(3),
    )
    for _ in range(3):
        x = torch.randn(6, 512, requires_grad=True)
        checkpoint(f, x, use_reentrant=False).square().sum().backward()
        expected = x.detach().clone().requires_grad_()
        f(expected).square().sum().backward()
        torch.testing.assert_close(x.grad, expected.grad)


def test_state_does_not_leak_into_the_next_call() -> None:
    f, seen = observe(cpus(2))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        f(torch.ones(2, 2))
    seen.clear()
    f(torch.ones(2, 2))
    assert all(s["grad"] and not s["cpu_autocast"] for s in seen)


def test_set_num_threads_after_the_workers_started_reaches_them() -> None:
    """torch.set_num_threads holds per thread once a thread has run: the workers, started by an
    earlier call, must follow the caller's later setting (docs advise 1 per CPU replica)."""
    f = fdp.pmap(lambda x: torch.full((1,), float(torch.get_num_threads())), devices=cpus(3))
    before = torch.get_num_threads()
    try:
        for threads in (2, 1, 3, 1):
            torch.set_num_threads(threads)
            assert f(torch.zeros(3)).tolist() == [threads] * 3
    finally:
        torch.set_num_threads(before)


SCALE: contextvars.ContextVar[float] = contextvars.ContextVar("SCALE", default=1.0)


def scaled(x: torch.Tensor) -> torch.Tensor:
    value = x * SCALE.get()
    SCALE.set(-1.0)  # reaches no other replica, and no later call's replicas but 0
    return value


@pytest.mark.parametrize("n", [2, 3])
def test_contextvars_reach_every_replica(n: int) -> None:
    """A ContextVar set before the call reads the same on every replica, whichever thread runs
    it; what a replica sets stays with it (replica 0 runs in the caller's own context, as a
    plain call would)."""
    f = fdp.pmap(scaled, devices=cpus(n))
    token = SCALE.set(10.0)
    try:
        for _ in range(2):
            SCALE.set(10.0)
            assert f(torch.ones(n)).tolist() == [10.0] * n
        assert SCALE.get() == -1.0  # replica 0's setting, in the caller's context
    finally:
        SCALE.reset(token)


def rare_switches() -> tuple[object, ...]:
    C = torch._C
    return (
        C._is_fwd_grad_enabled(),
        C._autograd._saved_tensors_hooks_get_disabled_error_message(),
        C._is_multithreading_enabled(),
        C._is_view_replay_enabled(),
        C._is_torch_function_enabled(),
        C._is_torch_function_all_disabled(),
    )


RARE_SWITCHES = {
    "forward AD off": lambda: torch.autograd.forward_ad._set_fwd_grad_enabled(False),
    "saved-tensor hooks disabled": lambda: torch.autograd.graph.disable_saved_tensors_hooks("not here"),
    "autograd multithreading off": lambda: torch.autograd.set_multithreading_enabled(False),
    "view replay": lambda: torch.autograd._force_original_view_tracking(True),
    "torch function off for subclasses": torch._C.DisableTorchFunctionSubclass,
    "torch function off": torch._C.DisableTorchFunction,
}


@pytest.mark.parametrize("switch", list(RARE_SWITCHES))
def test_rare_autograd_and_torch_function_switches_reach_every_replica(switch: str) -> None:
    """What torch carries into its own autograd threads (at::ThreadLocalState) beyond grad mode:
    forward-AD enabled, saved-tensor hooks disabled, autograd multithreading, view replay and
    disabled __torch_function__ held only in the caller's thread (replica 0)."""
    seen: list[tuple[str, tuple[object, ...]]] = []
    lock = threading.Lock()

    def f(x):
        with lock:
            seen.append((threading.current_thread().name, rare_switches()))
        return x

    g = fdp.pmap(f, devices=cpus(3))
    with RARE_SWITCHES[switch]():
        caller = rare_switches()
        g(torch.ones(3, 2))
    assert len({name for name, _ in seen}) == 3
    assert [s for _, s in seen] == [caller] * 3
    seen.clear()
    g(torch.ones(3, 2))  # and nothing stays set on the workers
    assert [s for _, s in seen] == [rare_switches()] * 3


def test_disabled_saved_tensor_hooks_refuse_hooks_on_every_replica() -> None:
    """A library that must not meet saved-tensor hooks (torch.utils.checkpoint, save_on_cpu)
    inside the mapped function is refused on every replica, not only on replica 0."""
    refused: list[int] = []
    lock = threading.Lock()

    def f(x):
        try:
            with torch.autograd.graph.save_on_cpu():
                pass
        except RuntimeError as error:
            assert "no hooks in here" in str(error)
            with lock:
                refused.append(fdp.axis_index("i"))
        return fdp.psum(x, "i")

    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in here"):
        fdp.pmap(f, axis_name="i", devices=cpus(3))(torch.ones(3, 2))
    assert sorted(refused) == [0, 1, 2]


def leave_autocast() -> None:
    torch.autocast("cpu", dtype=torch.float16).__enter__()


def leave_hooks() -> None:
    torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t).__enter__()


def leave_hooks_disabled() -> None:
    torch.autograd.graph.disable_saved_tensors_hooks("left").__enter__()


LEFT_SET = {
    "set_autocast_enabled": lambda: torch.set_autocast_enabled("cpu", True),
    "set_autocast_dtype": lambda: torch.set_autocast_dtype("cpu", torch.float16),
    "grad mode off": lambda: torch._C._set_grad_enabled(False),
    "autocast never left": leave_autocast,
    "forward AD off": lambda: torch._C._set_fwd_grad_enabled(False),
    "multithreading off": lambda: torch._C._set_multithreading_enabled(False),
    "saved_tensors_hooks never left": leave_hooks,
    "disable_saved_tensors_hooks never left": leave_hooks_disabled,
    "set_default_device": lambda: torch.set_default_device("meta"),
}


def worker_view() -> tuple[object, ...]:
    return (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.get_default_device(),
        torch._C._len_torch_function_stack(),
        torch._C._autograd._top_saved_tensors_default_hooks(False) is not None,
        *rare_switches(),
    )


def wait_for_idle_workers() -> None:
    from fdp import _pool

    while not _pool.idle():
        threading.Event().wait(0.001)


@pytest.mark.parametrize("leave", list(LEFT_SET))
def test_state_a_replica_leaves_set_does_not_reach_later_calls(leave: str) -> None:
    """A replica that sets thread-local state and never takes it back sets it in its worker's
    thread: the worker's next replicas, of any later call, ran with it, where the caller had
    none. (Replica 0 leaves it in the caller's thread, as a plain call would: the leaking call
    is made from a thread of its own here.)"""

    def leaks(x):
        if threading.current_thread() is not caller[0]:
            LEFT_SET[leave]()
        return x

    caller: list[threading.Thread] = []
    thread = threading.Thread(target=lambda: fdp.pmap(leaks, devices=cpus(3))(torch.ones(3, 2)))
    caller.append(thread)
    thread.start()
    thread.join()
    wait_for_idle_workers()  # a worker that cannot be made fresh again is replaced
    seen: list[tuple[object, ...]] = []
    lock = threading.Lock()

    def f(x):
        with lock:
            seen.append(worker_view())
        return x

    fdp.pmap(f, devices=cpus(3))(torch.ones(3, 2))
    assert seen == [worker_view()] * 3


@pytest.mark.parametrize("leave", [name for name in LEFT_SET if name != "set_default_device"])
def test_a_worker_whose_replica_left_state_set_is_cleaned_not_replaced(
    leave: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """State that can be taken back is taken back in the worker's own thread: the next call's
    replicas run on the same workers (a worker is replaced only for a mode it cannot undo)."""
    from fdp import _pool

    monkeypatch.setattr(_pool, "INLINE_REPLICAS", False)  # replicas 1 and 2 on workers
    used: list[set[threading.Thread]] = [set(), set()]
    lock = threading.Lock()

    def run(call: int, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name.startswith("fdp-worker"):
            with lock:
                used[call].add(threading.current_thread())
            if call == 0:
                LEFT_SET[leave]()
        return x

    fdp.pmap(lambda x: run(0, x), devices=cpus(3))(torch.ones(3, 2))
    wait_for_idle_workers()
    fdp.pmap(lambda x: run(1, x), devices=cpus(3))(torch.ones(3, 2))
    assert len(used[0]) == 2
    assert used[1] == used[0]


def test_an_autocast_a_replica_never_left_does_not_keep_stale_casts() -> None:
    """An autocast entered and never left keeps its nesting level in the worker's thread, so
    the worker never cleared its cache of casts again: a later call under autocast used the
    weight's cast from before an update, silently."""
    w = torch.ones(2, 2, requires_grad=True)

    def leaks(x):
        if threading.current_thread() is not caller[0]:
            torch.autocast("cpu", dtype=torch.bfloat16).__enter__()
        return (x @ w).float()

    caller: list[threading.Thread] = []
    thread = threading.Thread(target=lambda: fdp.pmap(leaks, devices=cpus(3))(torch.ones(3, 2)))
    caller.append(thread)
    thread.start()
    thread.join()
    wait_for_idle_workers()
    g = fdp.pmap(lambda x: x @ w, devices=cpus(3))
    for scale in (2.0, 3.0):
        with torch.no_grad():
            w.fill_(scale)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = g(torch.ones(3, 2))
        assert out.float().tolist() == [[2 * scale] * 2] * 3, out.float().tolist()


def test_a_call_queued_behind_a_replica_that_leaves_a_mode_set_runs_without_it() -> None:
    """A worker left with a function mode (torch.set_default_device) is replaced, but a call
    already queued on it (from another thread, while the leaking replica ran) ran its replica
    in that worker's thread all the same, with the mode: its tensors made on the meta device."""
    started, release = threading.Event(), threading.Event()

    def leaks(x):
        if fdp.axis_index("i") == 1:
            started.set()
            release.wait(10)
            torch.set_default_device("meta")
        return x

    seen: list[torch.device] = []

    def f(x):
        if fdp.axis_index("j") == 1:
            seen.append(torch.empty(1).device)
        return x

    first = threading.Thread(target=lambda: fdp.pmap(leaks, axis_name="i", devices=cpus(2))(torch.ones(2)))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=lambda: fdp.pmap(f, axis_name="j", devices=cpus(2))(torch.ones(2)))
    second.start()  # its replica 1 is queued on the worker running the leaking replica
    for _ in range(10_000):
        if _queued_behind():
            break
        threading.Event().wait(0.001)
    release.set()
    first.join(10)
    second.join(10)
    assert not first.is_alive() and not second.is_alive()
    assert seen == [torch.device("cpu")]


def _queued_behind() -> bool:
    """Whether a replica waits in the queue of the worker of replica 1 on ``cpus(2)``."""
    from fdp import _pool

    worker = _pool._WORKERS.get((torch.device("cpu"), 1))
    return worker is not None and not worker.tasks.empty()


# What a replica may leave set in the caller's thread that a replica run there after it could
# see: all of LEFT_SET but a function mode (set_default_device), which is never run inline.
INLINE_LEFT_SET = {
    **{name: leave for name, leave in LEFT_SET.items() if name != "set_default_device"},
    "autocast cache off": lambda: torch.set_autocast_cache_enabled(False),
}


@pytest.mark.parametrize("outer", [None, torch.bfloat16], ids=["no_autocast", "bfloat16_autocast"])
@pytest.mark.parametrize("axis_name", [None, "i"])
@pytest.mark.parametrize("leave", list(INLINE_LEFT_SET))
def test_replicas_run_in_the_caller_start_with_its_state_not_the_last_replicas(
    leave: str, axis_name: str | None, outer: torch.dtype | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small replicas run one after another in the caller's thread, where the replica before
    may leave state set: each entered the caller's state again only where the caller had
    autocast, hooks or a rare switch of its own, so without them a replica computed in
    float16 (its matmul's dtype), saved its tensors through another replica's hooks or ran
    with forward AD off, where the same replica on a worker did not: the result depended on
    which thread ran it."""
    from fdp import _pool

    monkeypatch.setattr(_pool, "INLINE_REPLICAS", True)
    monkeypatch.setattr(_pool, "_wake_seconds", 1.0)  # any replica is "small": all run inline
    seen: dict[int, tuple[object, ...]] = {}

    def view() -> tuple[object, ...]:
        x = torch.ones(2, 2)
        return (
            threading.current_thread().name,
            *worker_view(),
            torch.is_autocast_cache_enabled(),
            torch.is_grad_enabled(),
            (x @ x).dtype,
        )

    def f(x):
        seen[int(x[0, 0])] = view()
        INLINE_LEFT_SET[leave]()
        return x

    mapped = fdp.pmap(f, devices=cpus(3), axis_name=axis_name)
    expected: list[tuple[object, ...]] = []

    def call() -> None:  # in a thread of its own: replica 0 leaves the state in the caller's
        with torch.autocast("cpu", dtype=outer or torch.bfloat16, enabled=outer is not None):
            expected.append(view())
            seen.clear()
            mapped(torch.arange(3.0)[:, None].expand(3, 2).contiguous())

    for _ in range(2):  # the first call times replica 0, the second runs all three inline
        thread = threading.Thread(target=call, name="caller")
        thread.start()
        thread.join()
    assert seen == {i: expected[-1] for i in range(3)}
