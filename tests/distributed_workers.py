"""Rank bodies for tests/test_distributed.py (module level, so that spawned processes import them)."""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import gc
import json
import math
import os
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fdp
from fdp import optim


def start(rank: int, world: int, folder: str, timeout: float = 30.0) -> None:
    # A rank that aborts (SIGABRT in C++ code) prints every thread's Python stack to the test's
    # captured stderr: the one clue to which thread was where.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(folder) / "store"), world)
    fdp.distributed.initialize(backend="gloo", rank=rank, world_size=world, store=store, timeout=timeout)


def report(folder: str, rank: int, result: dict) -> None:
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(result))


def timed_outcome(call: Callable[[], object]) -> dict:
    """How ``call()`` ended (``error``: None, or the exception's type name beside its
    ``message``) and the ``seconds`` it took."""
    began = time.monotonic()
    try:
        call()
        result: dict = {"error": None}
    except Exception as error:  # noqa: BLE001
        result = {"error": type(error).__name__, "message": str(error)}
    return result | {"seconds": time.monotonic() - began}


def collectives(rank: int, world: int, folder: str) -> None:
    """2 ranks x 2 CPU replicas: every collective spans the 4 replicas."""
    start(rank, world, folder)
    try:
        x = torch.arange(8.0).reshape(8, 1) + 1  # the same global batch on every rank
        shard = fdp.distributed.shard_batch(x, local_replicas=2)
        f = lambda g: fdp.pmap(g, axis_name="i", devices=["cpu", "cpu"], split="balanced")  # noqa: E731
        # A function of the shard and a weight w (replicated), whose gradient flows outside.
        with_weight = lambda g: fdp.pmap(  # noqa: E731
            g, axis_name="i", in_axes=(0, None), devices=["cpu", "cpu"], split="balanced", out_axes=None
        )
        out = {
            "shard": shard.flatten().tolist(),
            "index_size": f(lambda x: torch.tensor([[fdp.axis_index("i"), fdp.axis_size("i")]]))(
                shard
            ).tolist(),
            "psum": f(lambda x: fdp.psum(x.sum(), "i"))(shard).tolist(),
            "pmean": f(lambda x: fdp.pmean(x.mean(), "i", weight=x.shape[0]))(shard).tolist(),
            "pmax": f(lambda x: fdp.pmax(x.max(), "i"))(shard).tolist(),
            "all_gather": f(lambda x: fdp.all_gather(x.sum(), "i")[None])(shard).tolist(),
            "ppermute": f(lambda x: fdp.ppermute(x[:1], "i", [(j, (j + 1) % 4) for j in range(4)]))(
                shard
            ).tolist(),
            # Past the 8 KiB that travel with the check: a process-group call of their own.
            "psum_large": f(lambda x: fdp.psum(x.sum() * torch.arange(3000.0), "i")[-1:])(shard).tolist(),
            "all_gather_large": f(lambda x: fdp.all_gather(x.sum() * torch.ones(3000), "i")[:, -1][None])(
                shard
            ).tolist(),
        }
        # float16 over the processes: a mean whose sum (4 x 40000) is past float16's range, and a
        # sum of 4 replicas rounded once, as torch.sum rounds it, not at each replica and rank.
        out["pmean_float16"] = f(lambda x: fdp.pmean(torch.full((1,), 40000.0, dtype=torch.float16), "i"))(
            shard
        ).tolist()
        out["psum_float16"] = f(lambda x: fdp.psum((x * 301.7).to(torch.float16), "i"))(shard).tolist()
        # Batch norm over the 4 replicas of both processes: the whole batch's statistics.
        norm = fdp.SyncBatchNorm(2, axis_name="i", track_running_stats=False)
        out["sync_batch_norm"] = f(lambda x: norm(torch.cat([x, x.square()], 1)))(shard).tolist()
        # Outer backward through a collective: the full batch's gradient.
        w = torch.tensor(2.0, requires_grad=True)
        total = with_weight(lambda x, w: fdp.psum((x * w).square().sum(), "i"))(shard, w)
        total.backward()
        out["outer_grad"] = float(w.grad)
        # torch.func.grad inside the replicas: psum's transpose spans the processes too.
        inner = f(lambda x: torch.func.grad(lambda x: fdp.psum(x.square().sum(), "i"))(x))(shard)
        out["inner_grad"] = inner.flatten().tolist()
        # fdp.grad (autograd, with the collectives in their differentiable form) alike.
        inner = f(lambda x: fdp.grad(lambda x: fdp.psum(x.square().sum(), "i"))(x))(shard)
        out["inner_grad_fdp"] = inner.flatten().tolist()
        # The same for all_gather: outer backward, and its transpose (psum_scatter) inside.
        c = torch.arange(1.0, 5.0)
        w = torch.tensor(2.0, requires_grad=True)
        gathered = with_weight(lambda x, w: fdp.all_gather((x * w).sum(), "i"))(shard, w)
        (gathered * c).sum().backward()
        out["all_gather_outer_grad"] = float(w.grad)
        inner = f(lambda x: torch.func.grad(lambda x: (fdp.all_gather(x.sum(), "i") * c).sum())(x))(shard)
        out["all_gather_inner_grad"] = inner.flatten().tolist()
        inner = f(lambda x: fdp.grad(lambda x: (fdp.all_gather(x.sum(), "i") * c).sum())(x))(shard)
        out["all_gather_inner_grad_fdp"] = inner.flatten().tolist()
        # psum_scatter and all_to_all over the 4 replicas, and their transposes inside.
        a = torch.arange(1.0, 5.0)
        out["psum_scatter"] = f(lambda x: fdp.psum_scatter(x.sum() * a, "i"))(shard).tolist()
        out["all_to_all"] = f(lambda x: fdp.all_to_all(x.sum() * 10 + a - 1, "i", 0, 0)[None])(shard).tolist()
        inner = f(
            lambda x: torch.func.grad(lambda x: fdp.psum_scatter(x.sum() * a, "i") * c[fdp.axis_index("i")])(
                x
            )
        )(shard)
        out["psum_scatter_inner_grad"] = inner.flatten().tolist()
        inner = f(lambda x: torch.func.grad(lambda x: (fdp.all_to_all(x.sum() * a, "i", 0, 0) * c).sum())(x))(
            shard
        )
        out["all_to_all_inner_grad"] = inner.flatten().tolist()
        # Past what travels with the check: a reduce_scatter and an all_to_all between the
        # processes, forward, through the whole call (outer) and inside the replicas.
        big = a[:, None] * torch.ones(4, 3000)
        out["psum_scatter_large"] = f(lambda x: fdp.psum_scatter(x.sum() * big, "i")[-1:])(shard).tolist()
        out["all_to_all_large"] = f(lambda x: fdp.all_to_all(x.sum() * 10 + big - 1, "i", 0, 0)[:, -1][None])(
            shard
        ).tolist()
        # float16 summed in float32 and rounded once; booleans counted as int64; complex numbers.
        out["psum_scatter_float16"] = f(lambda x: fdp.psum_scatter((x.sum() * 301.7 * big).half(), "i")[-1:])(
            shard
        ).tolist()
        out["psum_scatter_bool"] = f(lambda x: fdp.psum_scatter(big > x.sum() / 4, "i")[-1:])(shard).tolist()
        out["psum_scatter_complex"] = f(
            lambda x: torch.view_as_real(fdp.psum_scatter(x.sum() * (1 + 2j) * big.cfloat(), "i")[-1:])
        )(shard).tolist()
        per_row = lambda g: fdp.pmap(g, axis_name="i", in_axes=(0, None), devices=["cpu", "cpu"])  # noqa: E731
        for name, collective in (
            ("psum_scatter", lambda y: fdp.psum_scatter(y, "i")),
            ("all_to_all", lambda y: fdp.all_to_all(y, "i", 0, 0)),
        ):
            w = torch.tensor(2.0, requires_grad=True)
            mine = per_row(lambda x, w, c=collective: c((x * w).sum() * big)[None])(shard, w)
            weights = torch.tensor([[1.0], [2.0]]) + 2 * rank  # c_r of the rank's replicas
            (mine.flatten(1).sum(1) * weights.flatten()).sum().backward()
            out[f"{name}_large_outer_grad"] = float(w.grad)
        inner = f(
            lambda x: torch.func.grad(
                lambda x: (fdp.psum_scatter(x.sum() * big, "i") * c[fdp.axis_index("i")]).sum()
            )(x)
        )(shard)
        out["psum_scatter_large_inner_grad"] = inner.flatten().tolist()
        inner = f(
            lambda x: torch.func.grad(
                lambda x: (fdp.all_to_all(x.sum() * big, "i", 0, 0) * c[:, None]).sum()
            )(x)
        )(shard)
        out["all_to_all_large_inner_grad"] = inner.flatten().tolist()
        # A call inside rng_scope: replica r of the scope's k-th call draws in
        # fold_in(fold_in(seed, k), r), r its global index, so no two of the 4 replicas alike.
        with fdp.rng_scope(11):
            f(lambda x: x)(shard)  # call 0
            out["draws"] = f(lambda x: torch.rand(1, 3))(shard).tolist()  # call 1
        # Last (every rank fails it alike): a local mismatch names the replicas as axis_index does.
        try:
            f(lambda x: fdp.psum(torch.ones(1 + fdp.axis_index("i") % 2), "i"))(shard)
        except ValueError as error:
            out["mismatch"] = str(error)
        report(folder, rank, out)
    finally:
        fdp.distributed.shutdown()


def ddp_parity(rank: int, world: int, folder: str) -> None:
    """20 SGD steps: DDP and fdp (one replica per rank) on the same model, data and global batch."""
    start(rank, world, folder)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        opt = optim.sgd(0.1, momentum=0.9)
        params = {k: v.detach() for k, v in model.named_parameters()}
        state = fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, ["cpu"])

        @fdp.pmap(axis_name="b", devices=["cpu"], out_axes=fdp.PER_REPLICA)
        def step(state, x, y):
            grads = torch.func.grad(lambda p: F.cross_entropy(fdp.functional_call(model, p, (x,)), y))(
                state["params"]
            )
            grads = fdp.pmean(grads, "b", weight=x.shape[0])
            updates, opt_state = opt.update(grads, state["opt"], state["params"])
            return {"params": optim.apply_updates(state["params"], updates), "opt": opt_state}

        g = torch.Generator().manual_seed(1)
        for _ in range(20):
            x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
            xs, ys = fdp.distributed.shard_batch((x, y))
            ddp_opt.zero_grad()
            F.cross_entropy(ddp(xs), ys).backward()
            ddp_opt.step()
            state = step(state, xs, ys)
        ours = fdp.unreplicate(state)["params"]
        theirs = dict(ddp.module.named_parameters())
        report(folder, rank, {"max_diff": max(float((ours[k] - theirs[k]).abs().max()) for k in ours)})
    finally:
        fdp.distributed.shutdown()


def failing_rank(rank: int, world: int, folder: str) -> None:
    """Rank 1 raises before a psum that rank 0 is already waiting in."""
    start(rank, world, folder, timeout=60.0)

    def f(x):
        if fdp.distributed.rank() == 1:
            raise ValueError("rank 1 broke before the psum")
        return fdp.psum(x, "i")

    import time

    began = time.monotonic()
    try:
        fdp.pmap(f, axis_name="i", devices=["cpu"])(torch.ones(2))
    except BaseException as error:  # noqa: BLE001
        report(
            folder,
            rank,
            {
                "error": type(error).__name__,
                "message": str(error),
                "seconds": time.monotonic() - began,
                "trace": traceback.format_exc(),
            },
        )
        if rank == 1:
            raise
    finally:
        fdp.distributed.shutdown()


def cuda_side_stream(rank: int, world: int, folder: str) -> None:
    """2 ranks x 1 replica on cuda:0 (gloo takes CUDA tensors and lets them share a GPU), the
    caller on a side stream: rank r queues 1 + 2r long products before the psum."""
    start(rank, world, folder)
    try:

        def heavy(x: torch.Tensor, times: int) -> torch.Tensor:
            for _ in range(times):
                x = torch.tanh(x @ x / 64)
            return x

        inputs = [
            torch.randn(1, 4096, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(r))
            for r in range(world)
        ]
        f = fdp.pmap(
            lambda x: fdp.psum(heavy(x, 1 + 2 * fdp.axis_index("i")), "i") * 2,
            axis_name="i",
            devices=["cuda:0"],
        )
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            out = f(inputs[rank])
        torch.cuda.current_stream().wait_stream(side)
        expected = sum(heavy(x, 1 + 2 * r) for r, x in enumerate(inputs)) * 2
        report(folder, rank, {"max_error": float((out - expected).abs().max())})
    finally:
        fdp.distributed.shutdown()


def gloo_threads() -> int:
    """How many of this process's threads are gloo's (Linux: named in /proc)."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        # A thread may end while we look (gloo's do, after shutdown): then it counts for nothing.
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            count += "gloo" in (task / "comm").read_text()
    return count


def group_freed_at_shutdown(rank: int, world: int, folder: str) -> None:
    """torch.func.grad after initialize (it imports torch._dynamo, and that imports modules
    whose default arguments would capture the group): shutdown must still free the group."""
    start(rank, world, folder)
    try:
        running = gloo_threads()
        grad = fdp.pmap(
            lambda x: torch.func.grad(lambda x: fdp.psum(x.square().sum(), "i"))(x), axis_name="i"
        )
        grad(torch.ones(2))
    finally:
        fdp.distributed.shutdown()
    # Freed by shutdown, not at interpreter exit: allowed a moment (gloo's threads end on their
    # own after the group is destroyed; a full CI run once saw one still there right after
    # shutdown returned).
    # A group pinned for good, the bug this guards against, keeps its threads past it.
    deadline = time.monotonic() + 5
    while gloo_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    report(folder, rank, {"running": running, "after_shutdown": gloo_threads()})


def group_freed_after_failed_collectives(rank: int, world: int, folder: str) -> None:
    """Collectives that failed on every rank (each ValueError's traceback holds frames that
    hold fdp's state, a cycle only the garbage collector frees), then shutdown: the group must
    be freed by shutdown all the same, not by a collection at interpreter exit, where a gloo
    thread that drops the last reference to a finished collective takes the GIL of an
    interpreter that is shutting down, and the process aborts."""
    start(rank, world, folder)
    gc.disable()  # no collection by chance: the cycles stay, as they may at exit
    try:
        running = gloo_threads()
        for shape in ((1 + rank,), (3000 + rank,)):
            with contextlib.suppress(ValueError):
                fdp.pmap(lambda x, shape=shape: fdp.psum(torch.ones(shape), "i"), axis_name="i")(
                    torch.ones(2)
                )
    finally:
        fdp.distributed.shutdown()
    deadline = time.monotonic() + 5  # (gloo's threads end on their own once the group is destroyed)
    while gloo_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    report(folder, rank, {"running": running, "after_shutdown": gloo_threads()})
    gc.enable()


def dying_rank(rank: int, world: int, folder: str) -> None:
    """Rank 1 dies without a word (os._exit) while rank 0 waits for it in a psum: gloo reports the
    closed connection at once, and rank 0 must fail at once too, not spin until the timeout."""
    start(rank, world, folder, timeout=30.0)

    def f(x):
        if fdp.distributed.rank() == 1:
            time.sleep(1)
            os._exit(3)
        return fdp.psum(x, "i")

    began, cpu = time.monotonic(), time.process_time()
    try:
        fdp.pmap(f, axis_name="i", devices=["cpu"])(torch.ones(2))
        result = {"error": None}
    except BaseException as error:  # noqa: BLE001
        result = {"error": type(error).__name__, "message": str(error)}
    result |= {"seconds": time.monotonic() - began, "cpu_seconds": time.process_time() - cpu}
    report(folder, rank, result)
    fdp.distributed.shutdown()


def interrupted_in_a_collective(rank: int, world: int, folder: str) -> None:
    """Rank 0 is interrupted (SIGINT) while it waits for rank 1 in a psum, and exits without
    fdp.distributed.shutdown(); rank 1 comes late. Rank 0's communicator, still waiting in the
    psum, must stop before the interpreter shuts down, not abort the process at exit."""
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.default_int_handler)
    start(rank, world, folder, timeout=30.0)
    f = fdp.pmap(lambda x: fdp.psum(x, "i"), axis_name="i", devices=["cpu"])
    result: dict = {"first": f(torch.ones(2)).tolist()}
    if rank == 1:
        time.sleep(4)  # past the 2 s that rank 0's exit waits for its communicator
        result["late"] = timed_outcome(lambda: f(torch.ones(2)))
    else:
        main = threading.main_thread().ident
        threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT)).start()
        try:
            f(torch.ones(2))
            result["interrupted"] = False
        except KeyboardInterrupt:
            result["interrupted"] = True
    report(folder, rank, result)
    if rank == 1:
        fdp.distributed.shutdown()


def recovered_failure(rank: int, world: int, folder: str) -> None:
    """Every rank catches a failed call and goes on; in the next call rank 1 is slower, and rank 0
    waits for it in a psum: the failure every rank left behind must not fail it."""
    start(rank, world, folder)
    try:

        def bad(x):
            raise ValueError("skip this batch")

        with contextlib.suppress(ValueError):
            fdp.pmap(bad, axis_name="i", devices=["cpu"])(torch.ones(2))

        def good(x):
            if fdp.distributed.rank() == 1:
                time.sleep(2)
            return fdp.psum(x.sum(), "i")[None]

        try:
            result = {"psum": fdp.pmap(good, axis_name="i", devices=["cpu"])(torch.ones(2)).tolist()}
        except Exception as error:  # noqa: BLE001
            result = {"error": type(error).__name__, "message": str(error)}
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()


def sessions(rank: int, world: int, folder: str) -> None:
    """initialize() again after shutdown(), twice, on one store that outlives the sessions (as
    torchrun's agent's does): each session's group must find its own peers' addresses there."""
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(folder) / "store"), world)
    psum = fdp.pmap(lambda x: fdp.psum(x, "i"), axis_name="i", devices=["cpu"])
    result = []
    for _ in range(3):
        try:
            fdp.distributed.initialize(backend="gloo", rank=rank, world_size=world, store=store, timeout=20.0)
            result.append(psum(torch.ones(1) * (rank + 1)).tolist())
        except Exception as error:  # noqa: BLE001
            result.append(f"{type(error).__name__}: {error}")
            break
        finally:
            fdp.distributed.shutdown()
    report(folder, rank, {"sessions": result})


def failed_on_one_rank_after_the_last_collective(rank: int, world: int, folder: str) -> None:
    """Rank 1's call fails after the call's psum, once in a replica (an out-of-memory error in
    the update, say) and once in joining its replicas' outputs; it catches the failure and goes
    on (skipping the batch), while rank 0's call returned: the next call must fail on both."""
    start(rank, world, folder, timeout=20.0)
    result: dict = {}

    def step(x):
        total = fdp.psum(x, "i")
        if fdp.distributed.rank() == 1 and float(x[0]) == 1.0:
            raise RuntimeError("out of memory in the update")
        if fdp.distributed.rank() == 1 and float(x[0]) == 3.0 and fdp.axis_index("i") == 2:
            return total[None]  # beside the other replica's [2]: cannot be concatenated
        return total

    f = fdp.pmap(step, axis_name="i", devices=["cpu", "cpu"])
    try:
        for call in range(1, 6):
            try:
                result[str(call)] = f(torch.full((4,), float(call))).tolist()
            except Exception as error:  # noqa: BLE001 - skip the batch, as a training loop may
                result[str(call)] = f"{type(error).__name__}: {error}"
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()


def threads_at_once(rank: int, world: int, folder: str) -> None:
    """A second thread starts a pmapped call while the main thread's spans the processes: it is
    refused (each rank would order the threads' calls as they happen to run, and combine one
    thread's collectives with another's). One made after the main thread's call has returned
    runs."""
    import threading

    start(rank, world, folder, timeout=20.0)
    entered, released = threading.Event(), threading.Event()
    result: dict = {}
    psum = fdp.pmap(lambda x: fdp.psum(x, "i"), axis_name="i", devices=["cpu"])

    def slow(x):
        entered.set()
        released.wait(20)
        return fdp.psum(x, "i")

    def meanwhile():
        entered.wait(20)
        try:
            result["meanwhile"] = timed_outcome(lambda: psum(torch.ones(1)))
        finally:
            released.set()

    def afterwards():
        result["afterwards"] = psum(torch.ones(1) * 5).tolist()

    try:
        thread = threading.Thread(target=meanwhile, name="evaluation")
        thread.start()
        result["main"] = fdp.pmap(slow, axis_name="i", devices=["cpu"])(torch.ones(1)).tolist()
        thread.join()
        thread = threading.Thread(target=afterwards)
        thread.start()
        thread.join()
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()


def checked_unmapped_outputs(rank: int, world: int, folder: str) -> None:
    """check_unmapped_outputs=True where the processes' replicas return different values with
    out_axes None (processes that started from different parameters, say): one replica per
    process, and two."""
    start(rank, world, folder, timeout=20.0)
    result: dict = {}
    try:
        for devices in (["cpu"], ["cpu", "cpu"]):
            f = fdp.pmap(
                lambda x, w: {"loss": fdp.pmean(x.sum(), "i"), "w": w * 1},
                axis_name="i",
                in_axes=(0, None),
                out_axes={"loss": None, "w": None},
                devices=devices,
                check_unmapped_outputs=True,
            )
            # Equal as one process compares them: NaNs alike, -0.0 and 0.0.
            same = f(torch.ones(4), torch.tensor([1.0, (0.0, -0.0)[rank], math.nan]))["loss"].tolist()
            differ = timed_outcome(lambda f=f: f(torch.ones(4), torch.tensor([1.0, 2.0, float(rank)])))
            result[str(len(devices))] = {"same": same, "differ": differ}
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()


def restarted_attempts(rank: int, world: int, folder: str) -> None:
    """Two torchrun attempts on one store (torchrun's agent keeps its store across restarts):
    rank 1 fails in attempt 0; in attempt 1 it is only slower, and must not be taken as failed."""
    torch.set_num_threads(1)
    base = dist.FileStore(str(Path(folder) / "store"), world)
    result = {}
    for attempt in (0, 1):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
        group_store = dist.PrefixStore(f"attempt{attempt}", base)
        dist.init_process_group("gloo", store=group_store, rank=rank, world_size=world)
        fdp.distributed.initialize(rank=rank, world_size=world, store=base, timeout=30.0)

        def step(x, attempt=attempt):
            if fdp.distributed.rank() == 1:
                if attempt == 0:
                    raise ValueError("attempt 0: rank 1 hits a bad batch")
                time.sleep(2)
            return fdp.psum(x.sum(), "i")[None]

        try:
            result[str(attempt)] = fdp.pmap(step, axis_name="i", devices=["cpu"])(torch.ones(2)).tolist()
        except Exception as error:  # noqa: BLE001
            result[str(attempt)] = f"{type(error).__name__}: {error}"
        finally:
            fdp.distributed.shutdown()
            dist.destroy_process_group()
    report(folder, rank, result)


def mismatched_collectives(rank: int, world: int, folder: str) -> None:
    """The ranks disagree on a collective: its kind, shape or dtype; last, rank 1 skips a psum and
    starts its next call while rank 0 is in that psum."""
    start(rank, world, folder, timeout=20.0)
    r = rank
    with warnings.catch_warnings():  # torch deprecates quantized tensors
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)

    # Calls of different functions whose collectives agree (an evaluation made on rank 0 alone,
    # while rank 1 trains): their psums were combined, silently.
    def evaluate(x):
        return fdp.psum(x, "i")

    def train(x):
        return fdp.psum(x, "i")

    cases = {
        "op": lambda x: fdp.psum(x, "i") if r == 0 else fdp.pmax(x, "i"),
        "mean": lambda x: fdp.psum(x, "i") if r == 0 else fdp.pmean(x, "i"),
        "shape": lambda x: fdp.psum(torch.ones(3 + r), "i"),
        "dtype": lambda x: fdp.psum(torch.ones(2, dtype=(torch.float32, torch.float64)[r]), "i"),
        "large": lambda x: fdp.psum(torch.ones(5000 + r), "i"),  # past what travels with the check
        # Trees whose packed buffers agree in size: only their layouts tell them apart.
        "transposed": lambda x: fdp.psum(torch.ones(2 + r, 3 - r), "i"),
        "swapped": lambda x: fdp.psum({"a": torch.ones(2 + r), "b": torch.ones(3 - r)}, "i"),
        "keys": lambda x: fdp.psum({("a", "b")[r]: torch.ones(4)}, "i"),
        "gathered": lambda x: fdp.all_gather(torch.ones(2 + r, 3 - r), "i"),
        # Alike in shape: each replica's rows on one process, its columns on the other.
        "exchanged": lambda x: fdp.all_to_all(torch.ones(4, 4), "i", r, 0),
        # Each process sends rows of its own count: the rows' shapes and the perm are compared.
        "permuted": lambda x: fdp.ppermute(x, "i", [[(0, 2)], [(2, 0)]][r]),
        "permuted_shapes": lambda x: fdp.ppermute(torch.ones(2 + r), "i", [(0, 2), (3, 1)]),
        # One process packs two buffers (float32, float64), the other one.
        "dtypes": lambda x: fdp.pmean({"a": x, "b": x.to((torch.float64, torch.float32)[r])}, "i"),
        # Alike when packed: a square leaf's rows on one process, its columns on the other.
        "scattered": lambda x: fdp.psum_scatter(torch.ones(4, 4), "i", dim=r),
        # Packed as [4, 1, 4] and [4, 2, 4]: named as passed.
        "scattered_shapes": lambda x: fdp.psum_scatter(torch.ones(4, 4 + 4 * r), "i", dim=1, tiled=True),
        # Alike, in another insertion order: not a mismatch (optree sorts dict keys).
        "order": lambda x: fdp.psum(dict([("a", x), ("b", x * 10)][:: 1 - 2 * r]), "i")["b"],
        # torch.distributed sends no quantized tensors: refused alike by every rank, by name.
        "quantized": lambda x: fdp.all_gather({"q": quantized}, "i"),
        "functions": (evaluate, train)[r],
        "skipped": lambda x: fdp.psum(x, "i") if r == 0 else x,
    }
    result = {}
    try:
        for case, body in cases.items():
            f = fdp.pmap(body, axis_name="i", devices=["cpu", "cpu"])
            began = time.monotonic()
            try:
                out = f(torch.tensor([1.0, 10.0]) * (r + 1))
                if case == "skipped" and r == 1:
                    out = f(torch.ones(2))  # its next call, while rank 0 is still in the psum
                result[case] = {"returned": out.tolist()}
            except Exception as error:  # noqa: BLE001
                result[case] = {"error": type(error).__name__, "message": str(error)}
            result[case]["seconds"] = time.monotonic() - began
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()


def broadcast_state(rank: int, world: int, folder: str) -> None:
    """Every rank builds its state from a seed of its own; fdp.distributed.broadcast gives every
    rank one rank's (a float32 buffer past what travels with the check, and small bfloat16,
    int64 and bool ones that travel in it); then trees that differ, and bad arguments."""
    start(rank, world, folder)
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    state = {
        "params": dict(model.named_parameters()),
        "buffers": dict(model.named_buffers()),  # num_batches_tracked: int64
        "big": torch.randn(3000),
        "half": torch.randn(5).bfloat16(),
        "flag": torch.tensor(rank == 0),
        "step": rank,  # Python numbers: sent as 0-dim tensors, returned as numbers of their type
        "lr": 0.5 + rank,
        "nesterov": rank == 1,
        "name": f"rank {rank}",  # not a number: each rank keeps its own
    }

    def values(tree: object) -> dict:
        paths, leaves, _ = fdp._tree.flatten_with_paths(tree, "state")
        return {
            path: [str(leaf.dtype), leaf.float().tolist(), leaf.requires_grad]
            if isinstance(leaf, torch.Tensor)
            else leaf
            for path, leaf in zip(paths, leaves)
        }

    result: dict = {"own": values(state)}
    try:
        for src in (0, 1):
            out = fdp.distributed.broadcast(state, src=src)
            # Memory of its own: none of the given leaves', and none another result's.
            mine = {
                t.untyped_storage().data_ptr()
                for t in fdp._tree.flatten(state)[0]
                if isinstance(t, torch.Tensor)
            }
            got = [
                t.untyped_storage().data_ptr()
                for t in fdp._tree.flatten(out)[0]
                if isinstance(t, torch.Tensor)
            ]
            shared = any(p in mine for p in got) or len(set(got)) < len(got)
            result[f"from{src}"] = values(out) | {"shared": shared}
        result["transposed"] = timed_outcome(
            lambda: fdp.distributed.broadcast({"w": torch.ones(2 + rank, 3 - rank)})
        )
        result["huge"] = timed_outcome(lambda: fdp.distributed.broadcast({"n": 2**70}))
        result["keys"] = timed_outcome(lambda: fdp.distributed.broadcast({("a", "b")[rank]: torch.ones(4)}))
        # (A CUDA tensor on one rank would go to NCCL where the CPU one goes to gloo: a hang.)
        result["devices"] = timed_outcome(
            lambda: fdp.distributed.broadcast({"w": torch.ones(2, device=("cpu", "meta")[rank])})
        )
        weight = nn.Parameter(torch.full((2,), float(rank)))
        kept = fdp.distributed.broadcast(
            {"w": weight, "frozen": nn.Parameter(torch.ones(1), requires_grad=False)}
        )
        result["parameter"] = [type(kept["w"]).__name__, kept["w"].requires_grad, kept["w"].tolist()]
        result["parameter"] += [type(kept["frozen"]).__name__, kept["frozen"].requires_grad]
        # A tree without tensors on one rank only: that rank compares its tree too, not
        # returning while the other waits for it.
        result["untensored"] = timed_outcome(
            lambda: fdp.distributed.broadcast({"step": 1} | ({"w": torch.ones(2)} if rank else {}))
        )
        result["src"] = timed_outcome(lambda: fdp.distributed.broadcast(state, src=2))
        placed = fdp.device_put_replicated({"w": torch.ones(2)}, ["cpu", "cpu"])
        result["placed"] = timed_outcome(lambda: fdp.distributed.broadcast(placed))
        # Under an autocast of the other half dtype, which torch.cat's cast policy refuses.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = fdp.distributed.broadcast({"h": torch.full((3,), rank + 0.5, dtype=torch.float16)}, src=1)
        result["autocast"] = [str(half["h"].dtype), half["h"].tolist()]
        # The group still works after the refusals.
        result["after"] = fdp.distributed.broadcast(torch.tensor([float(rank)]), src=1).tolist()
        result["resume"] = resumed_training(rank, folder)
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()


def resumed_training(rank: int, folder: str) -> dict:
    """5 steps of a resident training (2 local replicas per rank, AdamW with a schedule, dropout,
    BatchNorm statistics averaged), and the same stopped after 2: rank 0 saves ``fdp.unreplicate(state)``,
    then a fresh step and state resume from it, loaded on every rank, or on rank 0 alone and
    broadcast (docs/distributed.md, "Starting from the same state"). Whether each resumed run
    ends bit for bit where the uninterrupted one does, and the step counts each rank resumes
    with."""
    devices = ["cpu", "cpu"]

    def build() -> tuple[Callable[..., object], dict]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 3))
        opt = optim.adamw(lambda step: 1e-2 * min(1.0, (step + 1) / 3))

        @fdp.pmap(axis_name="batch", devices=devices, in_axes=(0, 0, 0, None), out_axes=fdp.PER_REPLICA)
        def step(state, x, y, seed):
            params = {k: v.detach().requires_grad_() for k, v in state["params"].items()}
            with fdp.rng_scope(fdp.replica_seed(seed, "batch")):
                logits, buffers = fdp.stateful_call(model, params, state["buffers"], (x,))
            grads = dict(zip(params, torch.autograd.grad(F.cross_entropy(logits, y), list(params.values()))))
            statistics = {k: v for k, v in buffers.items() if v.is_floating_point()}
            grads, statistics = fdp.pmean((grads, statistics), "batch", weight=x.shape[0])
            params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
            return {"params": params, "opt": opt_state, "buffers": {**buffers, **statistics}}

        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = {k: v.detach() for k, v in model.named_buffers()}
        return step, {"params": params, "buffers": buffers, "opt": opt.init(params)}

    def run(step: Callable[..., object], state: object, start: int, stop: int) -> object:
        for k in range(start, stop):
            g = torch.Generator().manual_seed(k)
            batch = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
            x, y = fdp.distributed.shard_batch(batch, local_replicas=len(devices))
            state = step(state, x, y, fdp.fold_in(0, k))
        return state

    def leaves(state: object) -> list:
        copies = [fdp.unreplicate(state, r) for r in range(len(devices))]
        return [v.tolist() if isinstance(v, torch.Tensor) else v for v in optree.tree_leaves(copies)]

    step, initial = build()
    expected = leaves(run(step, fdp.device_put_replicated(initial, devices), 0, 5))
    step, initial = build()
    state = run(step, fdp.device_put_replicated(initial, devices), 0, 2)
    path = Path(folder) / "resume.pt"
    if fdp.distributed.is_main_process():
        torch.save(fdp.unreplicate(state), path)
    dist.barrier()  # the file is whole before any rank reads it
    del step, initial, state
    result = {}
    for way in ("everywhere", "broadcast"):
        step, fresh = build()
        if way == "everywhere":
            loaded = torch.load(path, weights_only=True)
        else:  # the step count, a Python int, comes from rank 0 too
            loaded = fdp.distributed.broadcast(torch.load(path, weights_only=True) if rank == 0 else fresh)
        resumed = run(step, fdp.device_put_replicated(loaded, devices), 2, 5)
        result[way] = {"steps": loaded["opt"].step, "exact": leaves(resumed) == expected}
    return result


def existing_group(rank: int, world: int, folder: str) -> None:
    """A process group made with env:// before fdp.distributed.initialize (mp.spawn, srun, ...)."""
    import torch.distributed.nn.functional  # noqa: F401 - before the group (docs/distributed.md)

    torch.set_num_threads(1)
    port = (Path(folder) / "port").read_text()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo")
    psum = fdp.pmap(lambda x: fdp.psum(x, "i"), axis_name="i", devices=["cpu"])
    try:
        # Before initialize: this process's replicas alone, with a warning, once.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            alone = [psum(torch.ones(1) * (rank + 1)).tolist() for _ in range(2)]
        fdp.distributed.initialize(timeout=20.0)
        out = psum(torch.ones(1) * (rank + 1))
        result = {"psum": out.tolist(), "rank": fdp.distributed.rank(), "world": fdp.distributed.world_size()}
        result["before"] = {"psum": alone, "warnings": [str(w.message) for w in caught]}
    except Exception as error:  # noqa: BLE001
        result = {"error": type(error).__name__, "message": str(error)}
    report(folder, rank, result)
    fdp.distributed.shutdown()
    dist.destroy_process_group()


def tied_extremes(rank: int, world: int, folder: str) -> None:
    """2 ranks x 2 replicas, backward() through pmax/pmin where 3 of the 4 replicas tie."""
    start(rank, world, folder)
    try:
        result = {}
        for name, collective, values in (
            ("pmax", fdp.pmax, [5.0, 5.0, 5.0, 1.0]),
            ("pmin", fdp.pmin, [1.0, 1.0, 1.0, 5.0]),
        ):
            x = torch.tensor(values[2 * rank : 2 * rank + 2], requires_grad=True)
            f = fdp.pmap(
                lambda x, collective=collective: collective(x.sum(), "i")[None],
                axis_name="i",
                devices=["cpu", "cpu"],
            )
            f(x).sum().backward()
            result[name] = x.grad.tolist()
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()


def unequal_replica_counts(rank: int, world: int, folder: str) -> None:
    """Rank 0 runs 2 replicas, rank 1 one: psum_scatter over the 3 (small, and past what
    travels with the check), ppermute (values, and gradients through the call and inside
    replicas where only one process receives), all_gather (values, gradients through the call,
    and as psum_scatter's transpose inside replicas), and all_to_all (values and gradients)."""
    start(rank, world, folder)
    try:
        devices = ["cpu"] * (2 - rank)
        f = lambda g: fdp.pmap(g, axis_name="i", devices=devices)  # noqa: E731
        x = torch.arange(1.0, 4.0)[:, None][[slice(0, 2), slice(2, 3)][rank]]  # replica j holds j + 1
        rows = torch.arange(1.0, 4.0)[:, None]  # row r: r + 1 (also source i's weight i + 1)
        result: dict = {
            "psum_scatter": f(lambda x: fdp.psum_scatter(x.sum() * rows, "i"))(x).tolist(),
            "psum_scatter_large": f(
                lambda x: fdp.psum_scatter(x.sum() * rows * torch.ones(3, 3000), "i")[:1][None]
            )(x).tolist(),
            "ppermute": f(lambda x: fdp.ppermute(x, "i", [(0, 1), (1, 2), (2, 0)]))(x).tolist(),
        }
        # Batch norm over the 3 replicas' rows: the statistics of the whole batch (an all_gather
        # of the replicas' counts and sums, rank 1's part padded).
        norm = fdp.SyncBatchNorm(2, axis_name="i", track_running_stats=False)
        result["sync_batch_norm"] = f(lambda x: norm(torch.cat([x, x.square()], 1)))(x).tolist()
        # Replica 0 (rank 0) sends to replica 2 (rank 1), and no one else sends: rank 0 gets
        # zeros (then changed in place) and no values, yet its backward sends rank 1's cotangent
        # back to replica 0, d/dw sum_r (r + 1) * out_r = 2 x_0 (r = 2 + 1).
        w = torch.tensor(1.0, requires_grad=True)
        per_row = lambda g: fdp.pmap(g, axis_name="i", in_axes=(0, None), devices=devices)  # noqa: E731
        out = per_row(lambda x, w: fdp.ppermute(x * w * torch.ones(2), "i", [(0, 2)]).add_(1))(x, w)
        (out * (rows[:2] if rank == 0 else rows[2:])).sum().backward()
        result["ppermute_outer_grad"] = None if w.grad is None else float(w.grad)
        result["ppermute_inner_grad"] = f(
            lambda x: torch.func.grad(
                lambda x: (fdp.ppermute(x * 2, "i", [(0, 2)]) * (fdp.axis_index("i") + 1)).sum()
            )(x)
        )(x).tolist()
        # A perm whose pairs stay within rank 0: no all_to_all at all, forward or backward (the
        # processes only check that they are all at the ppermute); rank 1's replica gets zeros.
        sent = []
        all_to_all_single = torch.distributed.all_to_all_single
        torch.distributed.all_to_all_single = lambda *a, **k: sent.append(1) or all_to_all_single(*a, **k)
        try:
            local = [(0, 1), (1, 0)]
            result["ppermute_local"] = f(lambda x: fdp.ppermute(x, "i", local))(x).tolist()
            w = torch.tensor(1.0, requires_grad=True)
            out = per_row(lambda x, w: fdp.ppermute(x * w * torch.ones(2), "i", local).add_(1))(x, w)
            (out * (rows[:2] if rank == 0 else rows[2:])).sum().backward()
            result["ppermute_local_outer_grad"] = None if w.grad is None else float(w.grad)
            result["ppermute_local_inner_grad"] = f(
                lambda x: torch.func.grad(
                    lambda x: (fdp.ppermute(x * 2, "i", local) * (fdp.axis_index("i") + 1)).sum()
                )(x)
            )(x).tolist()
        finally:
            torch.distributed.all_to_all_single = all_to_all_single
        result["ppermute_local_all_to_alls"] = len(sent)
        # all_gather (rank 1 pads its part to rank 0's 2 rows), also as psum_scatter's
        # transpose inside the replicas: small, and past what travels with the check.
        for size in (1, 3000):
            suffix = "" if size == 1 else "_large"
            result[f"all_gather{suffix}"] = f(
                lambda x, size=size: fdp.all_gather(x.sum() * torch.ones(size), "i")[:, -1][None]
            )(x).tolist()
            w = torch.tensor(1.0, requires_grad=True)
            out = per_row(lambda x, w, size=size: fdp.all_gather(x * w * torch.ones(size), "i").sum(-1))(x, w)
            (out.flatten() * torch.arange(1.0, out.numel() + 1)).sum().backward()  # x_0, x_1, x_2, ...
            result[f"all_gather_outer_grad{suffix}"] = None if w.grad is None else float(w.grad)
            result[f"psum_scatter_inner_grad{suffix}"] = f(
                lambda x, size=size: torch.func.grad(
                    lambda x: (
                        fdp.psum_scatter(x.sum() * rows * torch.ones(size), "i") * (fdp.axis_index("i") + 1)
                    ).sum()
                )(x)
            )(x).tolist()
            # all_to_all: replica r gets row r of every replica's, in order (rank 0 sends rank 1
            # 2 rows and gets 2 x 1 back).
            result[f"all_to_all{suffix}"] = f(
                lambda x, size=size: fdp.all_to_all(
                    x.sum() * 10 + rows - 1 + torch.zeros(3, size), "i", 0, 0
                )[:, -1][None]
            )(x).tolist()
            w = torch.tensor(1.0, requires_grad=True)
            out = per_row(
                lambda x, w, size=size: fdp.all_to_all(x.sum() * w * rows * torch.ones(size), "i", 0, 0)[None]
            )(x, w)
            (out * rows).sum().backward()
            result[f"all_to_all_outer_grad{suffix}"] = float(w.grad)
            result[f"all_to_all_inner_grad{suffix}"] = f(
                lambda x, size=size: torch.func.grad(
                    lambda x: (fdp.all_to_all(x.sum() * rows * torch.ones(size), "i", 0, 0) * rows).sum()
                )(x)
            )(x).tolist()
        result["dtypes_gloo_lacks"] = dtypes_gloo_lacks(rank)
        result["programs"] = programs_against_one_device(rank, devices)
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()


def programs_against_one_device(rank: int, devices: list[str]) -> dict:
    """Two programs of tests/test_collectives.py over 2 + 1 replicas, 7 rows (3 + 2 on rank 0,
    2 on rank 1): a contrastive loss (all_gather of padded embeddings, labels offset by
    axis_index) and ZeRO-style Adam steps (psum_scatter, PerReplica state, all_gather). For
    each, the largest difference from one device's computation."""
    torch.manual_seed(0)
    double = {"dtype": torch.float64}
    mine = [slice(0, 5), slice(5, 7)][rank]
    f = lambda g, **options: fdp.pmap(g, axis_name="i", devices=devices, split="balanced", **options)  # noqa: E731
    differences: dict = {}

    def largest(actual: object, expected: object) -> float:
        return max(
            float((a - e).abs().max())
            for a, e in zip(optree.tree_leaves(actual), optree.tree_leaves(expected))
        )

    # The contrastive loss: its value, and the inputs' gradients through the call and inside.
    params = {"image": torch.randn(5, 4, **double), "text": torch.randn(3, 4, **double)}
    image, text = torch.randn(7, 5, **double), torch.randn(7, 3, **double)

    def embed(params: dict, image: torch.Tensor, text: torch.Tensor) -> list[torch.Tensor]:
        return [F.normalize(image @ params["image"], dim=-1), F.normalize(text @ params["text"], dim=-1)]

    def replica_loss(params: dict, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        zi, zt = embed(params, image, text)
        sizes = fdp.all_gather(torch.tensor(len(image)), "i")
        most, first = int(sizes.max()), int(sizes[: fdp.axis_index("i")].sum())
        real = torch.cat([torch.arange(most) < size for size in sizes])
        every_zi, every_zt = (
            z[real]
            for z in fdp.all_gather([F.pad(z, (0, 0, 0, most - len(z))) for z in (zi, zt)], "i", tiled=True)
        )
        labels = torch.arange(len(image)) + first
        total = F.cross_entropy(zi @ every_zt.T * 10, labels, reduction="sum")
        total = total + F.cross_entropy(zt @ every_zi.T * 10, labels, reduction="sum")
        return total / 2 / fdp.psum(len(image), "i")

    whole = [t.clone().requires_grad_() for t in (image, text)]
    zi, zt = embed(params, *whole)
    logits, labels = zi @ zt.T * 10, torch.arange(7)
    expected = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    expected_grads = [g[mine] for g in torch.autograd.grad(expected, whole)]
    shard = [t[mine].clone().requires_grad_() for t in (image, text)]
    loss = f(lambda p, i, t: fdp.psum(replica_loss(p, i, t), "i"), in_axes=(None, 0, 0), out_axes=None)(
        params, *shard
    )
    differences["contrastive_loss"] = float((loss - expected).abs())
    loss.backward()  # every rank's output is the whole loss: each rank's inputs get twice theirs
    differences["contrastive_outer"] = largest([t.grad / 2 for t in shard], expected_grads)
    inside = lambda p, i, t: torch.func.grad(replica_loss, argnums=(1, 2))(p, i, t)  # noqa: E731
    differences["contrastive_inside"] = largest(
        f(inside, in_axes=(None, 0, 0))(params, image[mine], text[mine]), expected_grads
    )

    # ZeRO-style Adam: 3 steps, each replica keeping Adam's state for its third of each leaf.
    params = {"w": torch.randn(6, 3, **double), "b": torch.randn(6, **double)}
    batches = [(torch.randn(7, 3, **double), torch.randn(7, 6, **double)) for _ in range(3)]
    opt = optim.adam(0.01)

    def step(state: dict, x: torch.Tensor, y: torch.Tensor) -> dict:
        summed = lambda p: F.mse_loss(torch.tanh(x @ p["w"].T + p["b"]), y, reduction="sum")  # noqa: E731
        grads = torch.func.grad(summed)(state["params"])
        total = fdp.psum(y.numel(), "i")
        piece_grads = fdp.psum_scatter({k: g / total for k, g in grads.items()}, "i", tiled=True)
        i = fdp.axis_index("i")
        pieces = {k: p.chunk(3)[i] for k, p in state["params"].items()}
        pieces, opt_state = opt.apply_gradients(piece_grads, state["opt"], pieces)
        return {"params": fdp.all_gather(pieces, "i", tiled=True), "opt": opt_state}

    state = fdp.device_put_replicated(
        {"params": params, "opt": opt.init({k: p.chunk(3)[0] for k, p in params.items()})}, devices
    )
    for x, y in batches:
        state = f(step, out_axes=fdp.PER_REPLICA)(state, x[mine], y[mine])
    expected = {k: p.clone().requires_grad_() for k, p in params.items()}
    torch_opt = torch.optim.Adam(expected.values(), lr=0.01)
    for x, y in batches:
        torch_opt.zero_grad()
        F.mse_loss(torch.tanh(x @ expected["w"].T + expected["b"]), y).backward()
        torch_opt.step()
    differences["zero_adam"] = max(
        largest(fdp.unreplicate(state, r)["params"], expected) for r in range(len(devices))
    )
    return differences


def dtypes_gloo_lacks(rank: int) -> dict:
    """Collectives of int16, uint16 and float8 values past the 8 KiB that travel with the
    check (gloo carries none of these dtypes), with 2 + 1 replicas and 2 + 2: for each call,
    whether every local replica's result has the bits of one process's, or the error."""
    outcomes: dict = {}
    for counts in ([2, 1], [2, 2]):
        n, first, local = sum(counts), sum(counts[:rank]), counts[rank]
        ring = [(j, (j + 1) % n) for j in range(n)]
        moves: dict[str, tuple[Callable, Callable]] = {  # the collective, and replica j's result
            "all_gather": (lambda v: fdp.all_gather(v, "i", tiled=True), lambda x, j: torch.cat(list(x))),
            "all_to_all": (
                lambda v: fdp.all_to_all(v, "i", 0, 1, tiled=True),
                lambda x, j: torch.cat(list(x[:, 2 * j : 2 * j + 2]), 1),
            ),
            "ppermute": (lambda v, ring=ring: fdp.ppermute(v, "i", ring), lambda x, j: x[j - 1]),
        }
        sums: dict[str, tuple[Callable, Callable]] = {  # (int16 only: no CPU arithmetic for the others)
            "psum": (lambda v: fdp.psum(v, "i"), lambda x, j: x.sum(0, dtype=x.dtype)),
            "psum_scatter": (
                lambda v: fdp.psum_scatter(v, "i", tiled=True),
                lambda x, j: x.sum(0, dtype=x.dtype)[2 * j : 2 * j + 2],
            ),
            "pmax": (lambda v: fdp.pmax(v, "i"), lambda x, j: x.amax(0)),
        }
        for dtype in (torch.int16, torch.uint16, torch.float8_e4m3fn):
            x = (torch.arange(n * 2 * n * 1100).reshape(n, 2 * n, 1100) % 100).to(dtype)  # replica j's: x[j]
            for name, (collective, expected) in (moves | sums if dtype == torch.int16 else moves).items():
                key = f"{name} {str(dtype).removeprefix('torch.')} {counts}"
                try:
                    out = fdp.pmap(
                        lambda v, c=collective: c(v[0])[None], axis_name="i", devices=["cpu"] * local
                    )(x[first : first + local])
                    outcomes[key] = all(
                        torch.equal(out[r].view(torch.uint8), expected(x, first + r).view(torch.uint8))
                        for r in range(local)
                    )
                except Exception as error:  # noqa: BLE001
                    outcomes[key] = f"{type(error).__name__}: {error}"
    # broadcast sends a buffer per dtype in one process-group call too
    for dtype in (torch.int16, torch.uint16):
        tree = {"b": torch.full((5000,), rank + 1).to(dtype)}
        try:
            outcomes[f"broadcast {str(dtype).removeprefix('torch.')}"] = torch.equal(
                fdp.distributed.broadcast(tree)["b"], torch.ones(5000).to(dtype)
            )
        except Exception as error:  # noqa: BLE001
            outcomes[f"broadcast {str(dtype).removeprefix('torch.')}"] = f"{type(error).__name__}: {error}"
    return outcomes


def empty_exchanges(rank: int, world: int, folder: str) -> None:
    """2 ranks x 2 CPU replicas: all_gather, psum_scatter, all_to_all and ppermute of leaves
    with no elements, through the whole call (outer) and inside the replicas: the shapes of
    the results and the gradients, or the error."""
    start(rank, world, folder)
    try:
        x = torch.arange(1.0, 3.0)[:, None] + 2 * rank
        per_row = lambda g: fdp.pmap(g, axis_name="i", in_axes=(0, None), devices=["cpu", "cpu"])  # noqa: E731

        def shapes(call: Callable[[], list[list[int]]]) -> dict:
            try:
                return {"shapes": call()}
            except Exception as error:  # noqa: BLE001
                return {"error": type(error).__name__, "message": str(error)}

        result: dict = {}
        for name, collective in (
            ("all_gather", lambda y: fdp.all_gather(y, "i")),
            ("psum_scatter", lambda y: fdp.psum_scatter(y, "i")),
            ("all_to_all", lambda y: fdp.all_to_all(y, "i", 0, 0)),
            ("ppermute", lambda y: fdp.ppermute(y, "i", [(0, 2), (3, 1)])),
        ):

            def outer(collective: Callable = collective) -> list[list[int]]:
                w = torch.ones(4, 0, requires_grad=True)
                out = per_row(lambda x, w: collective(x.sum() * w))(x, w)
                out.sum().backward()
                assert w.grad is not None
                return [list(out.shape), list(w.grad.shape)]

            def inner(collective: Callable = collective) -> list[list[int]]:
                grad = lambda x, w: torch.func.grad(lambda w: collective(x.sum() * w).sum())(w)  # noqa: E731
                return [list(per_row(grad)(x, torch.ones(4, 0)).shape)]

            result[f"{name}_outer"] = shapes(outer)
            result[f"{name}_inner"] = shapes(inner)
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()


def nan_extremes(rank: int, world: int, folder: str) -> None:
    """pmax/pmin where one element is NaN on one rank only, small (travels with the check) and
    past 8 KiB (a process-group all_reduce): NaN wins in both, as in one process."""
    start(rank, world, folder)
    try:
        result = {}
        for size in (4, 4000):
            for name, collective in (("pmax", fdp.pmax), ("pmin", fdp.pmin)):
                x = torch.ones(2, size) * (rank + 1)
                if rank == 1:
                    x[0, 1] = float("nan")  # replica 0 of rank 1
                if rank == 0:
                    x[1, 2] = float("nan")  # replica 1 of rank 0
                out = fdp.pmap(lambda x, c=collective: c(x, "i"), axis_name="i", devices=["cpu", "cpu"])(x)
                result[f"{name}_{size}"] = out[:, :4].tolist()
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()


def chunked_shares(rank: int, world: int, folder: str) -> None:
    """shard_batch with split="chunk": refused where a process's pmapped call would cut its share
    otherwise than one process cuts the whole batch, the rows of one process otherwise."""
    start(rank, world, folder)
    try:
        result: dict = {}
        try:
            fdp.distributed.shard_batch(torch.arange(10.0), local_replicas=4, split="chunk")
            result["ten_rows"] = "accepted"
        except ValueError as error:
            result["ten_rows"] = str(error)
        share = fdp.distributed.shard_batch(torch.arange(30.0), local_replicas=4, split="chunk")
        f = fdp.pmap(
            lambda x: torch.tensor([[len(x), fdp.axis_index("i"), fdp.axis_size("i")]]),
            axis_name="i",
            devices=["cpu"] * 4,
            split="chunk",
        )
        result["thirty_rows"] = f(share).tolist()
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()


def empty_shares(rank: int, world: int, folder: str) -> None:
    """Calls that fail before their exchange of replica counts: on every rank (an empty batch
    everywhere: the ranks go on), then on rank 1 only (its share of a 1-row batch is empty)."""
    start(rank, world, folder, timeout=30.0)
    psum = fdp.pmap(lambda x: fdp.psum(x.sum(), "i")[None], axis_name="i", devices=["cpu"])

    def slow_on_rank_1(x):
        if fdp.distributed.rank() == 1:
            time.sleep(2)
        return fdp.psum(x.sum(), "i")[None]

    result: dict = {}
    try:
        try:
            psum(torch.ones(0))
        except ValueError as error:
            result["everywhere"] = str(error)
        try:
            result["after"] = fdp.pmap(slow_on_rank_1, axis_name="i", devices=["cpu"])(torch.ones(2)).tolist()
        except Exception as error:  # noqa: BLE001
            result["after"] = f"{type(error).__name__}: {error}"
        began = time.monotonic()
        try:
            psum(fdp.distributed.shard_batch(torch.ones(1)))
        except Exception as error:  # noqa: BLE001
            result["one_row"] = {"error": type(error).__name__, "message": str(error)}
        result["seconds"] = time.monotonic() - began
        # Rank 1 fails before its scatter, in the call's argument checks (a static argument
        # passed by keyword): rank 0, waiting in the exchange of replica counts, learns at once.
        scaled = fdp.pmap(
            lambda x, k: fdp.psum(x.sum() * k, "i")[None], axis_name="i", devices=["cpu"], static_argnums=1
        )
        # Rank 1 starts once rank 0 is done with the call before (each rank keeps one failure
        # record: a newer one would stand in for the one rank 0 must read there).
        done = Path(folder) / "rank0_one_row_done"
        if rank == 0:
            done.touch()
        else:
            while not done.exists():
                time.sleep(0.01)
        began = time.monotonic()
        try:
            if rank == 1:
                scaled(torch.ones(2), k=2.0)
            else:
                scaled(torch.ones(2), 2.0)
        except Exception as error:  # noqa: BLE001
            result["arguments"] = {"error": type(error).__name__, "message": str(error)}
        result["arguments_seconds"] = time.monotonic() - began
        report(folder, rank, result)
        if rank == 1:
            time.sleep(5)  # alive and connected: rank 0 must learn of the failure from its record
    finally:
        fdp.distributed.shutdown()


def weight_0_on_one_rank(rank: int, world: int, folder: str) -> None:
    """A token-weighted pmean of a loss whose shards on rank 0 count no token (each NaN),
    differentiated through the whole call."""
    start(rank, world, folder)
    result: dict = {}
    try:
        g = torch.Generator().manual_seed(0)
        logits, targets = (
            torch.randn(8, 5, dtype=torch.float64, generator=g),
            torch.randint(0, 5, (8,), generator=g),
        )
        targets[:4] = -100  # rank 0's 4 rows
        z, t = fdp.distributed.shard_batch((logits, targets), local_replicas=2)
        z.requires_grad_()
        mean_loss = fdp.pmap(
            lambda z, t: fdp.pmean(F.cross_entropy(z, t, ignore_index=-100), "i", weight=(t != -100).sum()),
            axis_name="i",
            devices=["cpu", "cpu"],
            split="balanced",
            out_axes=None,
        )
        loss = mean_loss(z, t)
        result["value"] = loss.item()
        result["backward"] = timed_outcome(loss.backward)
        result["grad"] = None if z.grad is None else z.grad.tolist()
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()


def empty_share_under_data_parallel(rank: int, world: int, folder: str) -> None:
    """fdp.DataParallel with an axis name (a SyncBatchNorm) whose share on rank 0 is empty."""
    start(rank, world, folder)
    result: dict = {}
    try:
        model = fdp.DataParallel(
            fdp.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3), axis_name="b"),
            device_ids=["cpu"],
            axis_name="b",
        )
        x = torch.arange(6.0).reshape(2, 3) if rank == 1 else torch.zeros(0, 3)
        result["call"] = timed_outcome(lambda: model(x))
        result["running_mean"] = model.module.running_mean.tolist()
        result["after"] = timed_outcome(lambda: model(torch.ones(2, 3)))  # the ranks go on together
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()


def failure_in_finally(rank: int, world: int, folder: str) -> None:
    """Rank 1 raises between calls inside ``try: ... finally: fdp.distributed.shutdown()`` (the
    usual shape of a DDP script), while rank 0 waits for it in a psum: shutdown runs before
    sys.excepthook would, and must tell rank 0 what rank 1 raised."""
    start(rank, world, folder, timeout=20.0)
    psum = fdp.pmap(lambda x: fdp.psum(x, "i"), axis_name="i", devices=["cpu"])
    try:
        psum(torch.ones(2))
        if rank == 1:
            raise RuntimeError("rank 1's data loader broke")
        report(folder, rank, timed_outcome(lambda: psum(torch.ones(2))))
    finally:
        fdp.distributed.shutdown()


def leaving_early(rank: int, world: int, folder: str) -> None:
    """Rank 1 calls fdp.distributed.shutdown() after one pmapped call and stays (a group made
    beforehand, which shutdown leaves to its owner), while rank 0 makes a second call (an
    evaluation on rank 0 alone, say): rank 0 must learn that rank 1 left, not wait for it until
    the timeout."""
    import torch.distributed.nn.functional  # noqa: F401 - before the group (docs/distributed.md)

    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(folder) / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    done = Path(folder) / "rank0_done"
    try:
        fdp.distributed.initialize(timeout=20.0)
        psum = fdp.pmap(lambda x: fdp.psum(x, "i"), axis_name="i", devices=["cpu"])
        psum(torch.ones(2))
        if rank == 1:
            fdp.distributed.shutdown()
            deadline = time.monotonic() + 60
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            return
        report(folder, rank, timed_outcome(lambda: psum(torch.ones(2))))
        done.touch()
    finally:
        fdp.distributed.shutdown()
        dist.destroy_process_group()


class Unprintable:
    """A dict key whose repr fails."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def unprintable_layout(rank: int, world: int, folder: str) -> None:
    """The ranks pass trees that differ, one of which cannot be spelled out: every rank still
    raises at once (the follow-up exchange that spells the trees out is taken by every rank)."""
    start(rank, world, folder, timeout=20.0)
    try:
        key = Unprintable() if rank == 0 else "a"
        f = fdp.pmap(lambda x: fdp.psum({key: x}, "i")[key], axis_name="i", devices=["cpu", "cpu"])
        result = {"psum": timed_outcome(lambda: f(torch.ones(2)))}
        result["after"] = fdp.distributed.broadcast(torch.tensor([float(rank)]), src=1).tolist()
        report(folder, rank, result)
    finally:
        fdp.distributed.shutdown()
