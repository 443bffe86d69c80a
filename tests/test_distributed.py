"""fdp.distributed: 2 ranks with gloo on loopback, each run bounded by a timeout.

Marked ``distributed`` (each spawn costs seconds): ``pytest -m "not distributed"`` skips them
in a quick local run; CI runs them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import enum
import gc
import json
import math
import re
import subprocess
import sys
import textwrap
import threading
import types
import weakref
from pathlib import Path
from typing import Any

import distributed_workers
import numpy as np
import optree
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import finishes
from torch import nn

import fdp
from fdp import _distributed

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]


def spawn(
    worker, tmp_path: Path, world: int = 2, timeout: float = 120.0
) -> tuple[list[dict], list[int | None]]:
    """Runs ``worker(rank, world, folder)`` in ``world`` processes; kills them after ``timeout``."""
    context = mp.start_processes(
        worker, args=(world, str(tmp_path)), nprocs=world, join=False, start_method="spawn"
    )
    import time

    deadline = time.monotonic() + timeout
    for process in context.processes:
        process.join(max(0.1, deadline - time.monotonic()))
    alive = [p for p in context.processes if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{len(alive)} rank(s) still running after {timeout} s: a hang"
    results = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return results, [p.exitcode for p in context.processes]


def test_collectives_span_every_replica_of_every_process(tmp_path: Path) -> None:
    results, codes = spawn(distributed_workers.collectives, tmp_path)
    assert codes == [0, 0], results
    rank0, rank1 = results
    assert rank0["shard"] == [1.0, 2.0, 3.0, 4.0] and rank1["shard"] == [5.0, 6.0, 7.0, 8.0]
    assert rank0["index_size"] == [[0, 4], [1, 4]] and rank1["index_size"] == [[2, 4], [3, 4]]
    for r in results:
        assert r["psum"] == [36.0, 36.0]
        assert r["pmean"] == [4.5, 4.5]
        assert r["pmax"] == [8.0, 8.0]
        assert r["all_gather"] == [[3.0, 7.0, 11.0, 15.0]] * 2
        assert r["psum_large"] == [36.0 * 2999] * 2
        assert r["all_gather_large"] == [[3.0, 7.0, 11.0, 15.0]] * 2
        assert r["pmean_float16"] == [40000.0] * 2
    # Each replica's 2 rows of x * 301.7 in float16, summed over the 4 replicas in float32 and
    # rounded once, as torch.sum rounds the same values (each step rounded: 6032, not 6036).
    halves = (torch.arange(1.0, 9.0) * 301.7).to(torch.float16).reshape(4, 2)
    expected_sum = [[v] for v in halves.sum(0).tolist()] * 2  # 2 local replicas, 2 rows each
    assert all(r["psum_float16"] == expected_sum for r in results), [r["psum_float16"] for r in results]
    # Each rank's backward() differentiates the sum of every rank's output (psum's transpose sums
    # all cotangents) with respect to its own inputs: 2 ranks x its own rows' 2 * 2 * x^2.
    assert rank0["outer_grad"] == pytest.approx(2 * 2 * 2 * sum(v * v for v in range(1, 5)))
    assert rank1["outer_grad"] == pytest.approx(2 * 2 * 2 * sum(v * v for v in range(5, 9)))
    assert rank0["ppermute"] == [[7.0], [1.0]] and rank1["ppermute"] == [[3.0], [5.0]]
    x = torch.arange(1.0, 9.0)[:, None]
    whole = torch.nn.functional.batch_norm(torch.cat([x, x.square()], 1), None, None, training=True)
    torch.testing.assert_close(torch.tensor(rank0["sync_batch_norm"] + rank1["sync_batch_norm"]), whole)
    assert rank0["inner_grad"] == [4 * 2 * v for v in (1.0, 2, 3, 4)]  # psum's transpose: 4 replicas
    assert all(r["inner_grad_fdp"] == r["inner_grad"] for r in results)  # fdp.grad: the same
    # all_gather of the replicas' sums 3, 7, 11, 15 (times w), weighed by c = 1..4: every rank's
    # backward sums both ranks' cotangents (2 c), each rank's w takes its own replicas' share.
    assert rank0["all_gather_outer_grad"] == pytest.approx(2 * (1 * 3 + 2 * 7))
    assert rank1["all_gather_outer_grad"] == pytest.approx(2 * (3 * 11 + 4 * 15))
    # Inside, the transpose (psum_scatter) hands replica r the 4 replicas' cotangent c_r per row.
    assert rank0["all_gather_inner_grad"] == [4.0, 4.0, 8.0, 8.0]
    assert rank1["all_gather_inner_grad"] == [12.0, 12.0, 16.0, 16.0]
    assert all(r["all_gather_inner_grad_fdp"] == r["all_gather_inner_grad"] for r in results)
    # psum_scatter of s_j * [1, 2, 3, 4] (s_j = 3, 7, 11, 15: replica j's sum): replica r gets
    # 36 * (r + 1); inside torch.func.grad, with loss_r = c_r times that, every row's gradient is
    # sum_r (r + 1) c_r = 30 (the transpose, all_gather, spans the processes).
    assert rank0["psum_scatter"] == [36.0, 72.0] and rank1["psum_scatter"] == [108.0, 144.0]
    assert rank0["psum_scatter_inner_grad"] == [30.0] * 4 and rank1["psum_scatter_inner_grad"] == [30.0] * 4
    # all_to_all of 10 s_j + [0, 1, 2, 3]: replica r gets entry r of every replica's, in order.
    assert rank0["all_to_all"] == [[30.0, 70.0, 110.0, 150.0], [31.0, 71.0, 111.0, 151.0]]
    assert rank1["all_to_all"] == [[32.0, 72.0, 112.0, 152.0], [33.0, 73.0, 113.0, 153.0]]
    # Replica r's loss sums c_i s_i (r + 1) over i: the rows of replica j get sum_r (r + 1) c_j.
    assert rank0["all_to_all_inner_grad"] == [10.0, 10.0, 20.0, 20.0]
    assert rank1["all_to_all_inner_grad"] == [30.0, 30.0, 40.0, 40.0]
    # The same past what travels with the check (a reduce_scatter and an all_to_all of their own).
    assert rank0["psum_scatter_large"] == [36.0, 72.0] and rank1["psum_scatter_large"] == [108.0, 144.0]
    assert (
        rank0["all_to_all_large"] == rank0["all_to_all"] and rank1["all_to_all_large"] == rank1["all_to_all"]
    )
    sums = torch.tensor([3.0, 7.0, 11.0, 15.0])  # the replicas' x.sum()
    halves = (sums[:, None] * 301.7 * torch.arange(1.0, 5.0)).half().float().sum(0).half()
    assert rank0["psum_scatter_float16"] == [halves[0].item(), halves[1].item()], rank0
    assert rank1["psum_scatter_float16"] == [halves[2].item(), halves[3].item()], rank1
    # big's row r (r + 1) against each replica's x.sum() / 4: the replicas whose value is greater.
    counts = [int(((r + 1) > sums / 4).sum()) for r in range(4)]
    assert rank0["psum_scatter_bool"] == counts[:2], rank0
    assert rank1["psum_scatter_bool"] == counts[2:], rank1
    assert rank0["psum_scatter_complex"] == [[36.0, 72.0], [72.0, 144.0]], rank0
    assert rank1["psum_scatter_complex"] == [[108.0, 216.0], [144.0, 288.0]], rank1
    # Each rank differentiates every rank's sum_r c_r * sum(out_r): its own replicas' sums s_i
    # times sum_r c_r (r + 1) * 3000 = 30 * 3000, for both collectives.
    for name in ("psum_scatter", "all_to_all"):
        assert rank0[f"{name}_large_outer_grad"] == pytest.approx((3 + 7) * 30 * 3000), name
        assert rank1[f"{name}_large_outer_grad"] == pytest.approx((11 + 15) * 30 * 3000), name
    assert all(r["psum_scatter_large_inner_grad"] == [30.0 * 3000] * 4 for r in results)
    assert rank0["all_to_all_large_inner_grad"] == [30000.0, 30000.0, 60000.0, 60000.0]
    assert rank1["all_to_all_large_inner_grad"] == [90000.0, 90000.0, 120000.0, 120000.0]
    expected = []
    for r in range(4):
        with fdp.rng_scope(fdp.fold_in(fdp.fold_in(11, 1), r)):
            expected.append(torch.rand(1, 3)[0].tolist())
    torch.testing.assert_close(torch.tensor(rank0["draws"] + rank1["draws"]), torch.tensor(expected))
    for r, (first, second) in zip(results, [(0, 1), (2, 3)]):
        assert f"replica {first} passed float32[1] but replica {second} passed float32[2]" in r["mismatch"]


def test_numerically_identical_to_ddp(tmp_path: Path) -> None:
    results, codes = spawn(distributed_workers.ddp_parity, tmp_path)
    assert codes == [0, 0], results
    assert all(r["max_diff"] <= 1e-6 for r in results), results


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_shutdown_frees_the_group_even_after_torch_dynamo_is_imported(tmp_path: Path) -> None:
    # Otherwise gloo's threads run until the interpreter exits, and the group is torn down
    # there: the likely cause of a rare abort of a finished rank ("terminate called without an
    # active exception"). See _distributed._import_group_defaults.
    results, codes = spawn(distributed_workers.group_freed_at_shutdown, tmp_path)
    assert codes == [0, 0], results
    assert all(r["running"] > 0 and r["after_shutdown"] == 0 for r in results), results


def test_shutdown_frees_the_group_that_failed_collectives_left_in_cycles(tmp_path: Path) -> None:
    results, codes = spawn(distributed_workers.group_freed_after_failed_collectives, tmp_path)
    assert codes == [0, 0], results
    assert all(r["running"] > 0 and r["after_shutdown"] == 0 for r in results), results


def test_a_failing_rank_makes_the_others_fail_fast_naming_it(tmp_path: Path) -> None:
    results, codes = spawn(distributed_workers.failing_rank, tmp_path)
    assert codes[1] != 0 and results[1]["error"] == "ValueError"
    rank0 = results[0]
    assert rank0["error"] == "RankFailed", rank0
    assert "rank 1 failed" in rank0["message"] and "rank 1 broke before the psum" in rank0["message"]
    assert rank0["seconds"] < 30  # well within the process group's 60 s timeout


@pytest.mark.cuda
def test_cross_process_collectives_follow_the_replicas_cuda_stream(tmp_path: Path) -> None:
    # The process-group call is issued from fdp's communicator thread, which must use the
    # replica's stream: its own default stream would leave the kernels on both sides unordered.
    results, codes = spawn(distributed_workers.cuda_side_stream, tmp_path)
    assert codes == [0, 0], results
    assert all(r["max_error"] < 1e-4 for r in results), results


def run_train(*command: str) -> str:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_train_example_under_torchrun_matches_one_process(tmp_path: Path) -> None:
    # Two CPU replicas either way, also on a GPU machine (where NCCL wants a GPU per process).
    common = ("--steps", "30", "--batch-size", "48", "--eval-every", "15")
    single = run_train(
        sys.executable,
        "examples/train.py",
        *common,
        "--devices",
        "cpu,cpu",
        "--checkpoint",
        str(tmp_path / "a.pt"),
    )
    launched = run_train(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "examples/train.py",
        *common,
        "--devices",
        "cpu",
        "--checkpoint",
        str(tmp_path / "b.pt"),
    )
    numbers = [[float(v) for v in re.findall(r"=(-?\d+\.\d+)", line)] for line in (single, launched)]
    assert single.split()[1] == launched.split()[1] == "step=30"
    for a, b in zip(*numbers):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5), (single, launched)


def test_default_backend_on_a_cuda_machine_serves_cpu_tensors_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # NCCL alone would leave CPU tensors (CPU replicas, the example's metrics) without a backend
    # on a GPU machine. CUDA and NCCL are faked here: the group is never made.
    chosen: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **_: chosen.append(backend))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # initialize wraps it
    fdp.distributed.initialize(rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        state = _distributed._state()
        assert chosen == ["cpu:gloo,cuda:nccl"]
        # gloo's work is polled for failed ranks; NCCL's is left to its watchdog.
        assert _distributed._polls(state, torch.device("cpu"))
        assert not _distributed._polls(state, torch.device("cuda", 0))
    finally:
        fdp.distributed.shutdown()


def test_a_rank_that_dies_makes_the_others_fail_at_once_naming_it(tmp_path: Path) -> None:
    # gloo reports the closed connection at once; waiting again would report it again, at once,
    # in a loop that spins a core until the timeout (30 s here), then blames a hang.
    results, codes = spawn(distributed_workers.dying_rank, tmp_path)
    assert codes[1] == 3
    rank0 = results[0]
    assert rank0["error"] == "RankFailed", rank0
    assert "lost its connection to rank 1" in rank0["message"], rank0
    assert rank0["seconds"] < 10 and rank0["cpu_seconds"] < 5, rank0


def test_a_rank_interrupted_in_a_collective_exits_cleanly(tmp_path: Path) -> None:
    # Its communicator, still waiting in the psum, took the GIL while the interpreter shut down
    # and the process aborted ("terminate called without an active exception", exit code -6).
    results, codes = spawn(distributed_workers.interrupted_in_a_collective, tmp_path)
    assert codes == [0, 0], results
    assert results[0] == {"first": [2.0, 2.0], "interrupted": True}, results
    assert results[1]["late"]["error"] == "RankFailed", results
    assert "rank 0 failed" in results[1]["late"]["message"], results


def test_the_communicator_keeps_nothing_of_a_finished_call() -> None:
    """The communicator thread waits for its next task holding nothing of the last one: not
    the tensors its work closed over, nor what it returned, nor a failure's traceback."""
    communicator = _distributed._Communicator()
    try:
        refs: list[weakref.ref[torch.Tensor]] = []

        def issue(fail: bool) -> None:
            sent = torch.ones(1000)
            refs.append(weakref.ref(sent))

            def work() -> torch.Tensor:
                received = sent * 2
                refs.append(weakref.ref(received))
                if fail:
                    raise ValueError("the collective failed")
                return received

            with contextlib.suppress(ValueError):
                communicator.call(work)

        issue(fail=False)
        issue(fail=True)
        gc.collect()
        assert [r() for r in refs] == [None] * 4
    finally:
        communicator.close(timeout=2.0)


def test_process_group_calls_after_the_exit_stopped_the_communicator_run_in_place() -> None:
    # (From an atexit hook registered before fdp's, which runs after it.) Queued for a thread
    # that has left, they would wait forever.
    communicator = _distributed._Communicator()
    assert communicator.call(threading.current_thread) is communicator._thread
    communicator.exiting = True
    communicator.close(timeout=2.0)
    assert not communicator._thread.is_alive()
    caller, ran_in = finishes(
        lambda: (threading.current_thread(), communicator.call(threading.current_thread)), 5.0
    )
    assert ran_in is caller


def test_a_process_forked_from_a_rank_is_not_in_its_group(tmp_path: Path) -> None:
    # A child forked after initialize() (os.fork; a DataLoader or multiprocessing worker started
    # with "fork") has none of the threads of the communicator or of gloo. Its pmapped calls with
    # an axis name queued for the communicator and waited forever; an uncaught exception there
    # (sys.excepthook) or its shutdown() wrote to the store as its parent's rank, failing the other
    # ranks' calls naming that rank; and shutdown() hung in destroying the group.
    script = textwrap.dedent(
        """
        import json, os, sys, time, torch, fdp
        import torch.distributed as dist
        store = dist.FileStore(sys.argv[1], 1)
        fdp.distributed.initialize(backend="gloo", rank=0, world_size=1, store=store)
        psum = fdp.pmap(lambda x: fdp.psum(x, "i"), axis_name="i", devices=["cpu", "cpu"])
        assert psum(torch.ones(2)).tolist() == [2.0, 2.0]
        pid = os.fork()
        if pid == 0:
            result = {"initialized": fdp.distributed.is_initialized(), "rank": fdp.distributed.rank()}
            try:
                psum(torch.ones(2))
            except RuntimeError as error:
                result["call"] = str(error)
            try:
                raise ValueError("the child's own failure")
            except ValueError as error:
                sys.excepthook(type(error), error, error.__traceback__)  # as if uncaught
            joins = []
            for _ in range(2):  # (its parent's group, before and after the child's shutdown())
                try:
                    fdp.distributed.initialize(backend="gloo")
                except RuntimeError as error:
                    joins.append(str(error))
                fdp.distributed.shutdown()
            result["joins"] = joins
            result["after_shutdown"] = psum(torch.ones(2)).tolist()  # this process's replicas alone
            with open(sys.argv[2], "w") as file:
                json.dump(result, file)
            os._exit(0)  # (torch aborts a forked child that destroys gloo's group at exit)
        deadline = time.monotonic() + 60
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                sys.exit("the child hung")
            time.sleep(0.05)
        keys = ["fdp/session_0/fdp/failure/0/0", "fdp/session_0/fdp/left/0/0"]  # (its first session)
        print("recorded", store.check(keys[:1]), store.check(keys[1:]))
        print("parent", fdp.distributed.is_initialized(), psum(torch.ones(2)).tolist())
        fdp.distributed.shutdown()
        """
    )
    report = tmp_path / "child.json"
    command = [sys.executable, "-c", script, str(tmp_path / "store"), str(report)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    child = json.loads(report.read_text())
    assert child["initialized"] is False and child["rank"] == 0, child
    assert "this process was forked from rank 0 after fdp.distributed.initialize()" in child["call"], child
    assert len(child["joins"]) == 2, child
    assert all("fdp.distributed.initialize: this process was forked" in j for j in child["joins"]), child
    assert child["after_shutdown"] == [2.0, 2.0], child
    assert "recorded False False" in result.stdout, result.stdout
    assert "parent True [2.0, 2.0]" in result.stdout, result.stdout


def test_initialize_in_a_process_forked_from_a_member_of_the_users_group_is_refused(tmp_path: Path) -> None:
    # The group was the user's (torch.distributed.init_process_group), not fdp's: the child's
    # initialize() took it as an existing group to use, its parent's.
    script = textwrap.dedent(
        """
        import os, sys, torch, fdp
        import torch.distributed as dist
        dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
        pid = os.fork()
        if pid == 0:
            try:
                fdp.distributed.initialize()
                print("joined", flush=True)
            except RuntimeError as error:
                print("refused:", error, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        dist.destroy_process_group()
        """
    )
    command = [sys.executable, "-c", script, str(tmp_path / "store")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "refused: fdp.distributed.initialize: this process was forked" in result.stdout, result.stdout


def test_a_failure_every_rank_recovered_from_does_not_fail_later_calls(tmp_path: Path) -> None:
    results, codes = spawn(distributed_workers.recovered_failure, tmp_path)
    assert codes == [0, 0], results
    assert all(r == {"psum": [4.0]} for r in results), results


def test_initialize_again_after_shutdown_joins_a_new_group(tmp_path: Path) -> None:
    # torch names each new default group as it named the last ("0/"): on the same store, gloo's
    # rendezvous found the last session's addresses and failed to connect ("Connect timeout",
    # "Connection refused"), or hung.
    results, codes = spawn(distributed_workers.sessions, tmp_path, timeout=60.0)
    assert codes == [0, 0], results
    assert all(r["sessions"] == [[3.0]] * 3 for r in results), results


def test_a_call_that_failed_on_some_ranks_only_after_its_last_collective_fails_the_next_everywhere(
    tmp_path: Path,
) -> None:
    # Rank 0's call returned (a training step's new state), rank 1's failed after the psum and it
    # went on: the ranks went on out of step, silently, where one process fails the whole call.
    results, codes = spawn(distributed_workers.failed_on_one_rank_after_the_last_collective, tmp_path)
    assert codes == [0, 0], results
    rank0, rank1 = results
    assert rank0["1"] == [4.0] * 4 and rank1["1"].startswith("RuntimeError: out of memory in the update")
    assert rank0["3"] == [12.0] * 4 and rank1["3"].startswith("ValueError: fdp.pmap("), rank1
    for r in results:
        for failed, then in (("1", "2"), ("3", "4")):
            assert r[then].startswith(
                f"RankFailed: fdp.distributed: pmapped call #{failed} "
                "(fdp.pmap(failed_on_one_rank_after_the_last_collective.<locals>.step)) failed on "
                "rank 1 but returned on rank 0: the ranks are out of step"
            ), r[then]
            assert f"at the start of pmapped call #{then} (fdp.pmap(" in r[then], r[then]
        assert "Rank 1 failed with RuntimeError: out of memory in the update" in r["2"], r["2"]
        assert "Rank 1 failed with ValueError: fdp.pmap(" in r["4"], r["4"]
        assert r["5"] == [20.0] * 4, r  # every rank failed call #4: in step again
    assert rank0["2"] == rank1["2"] and rank0["4"] == rank1["4"], results  # the same error everywhere


def test_a_pmapped_call_from_another_thread_while_one_spans_the_processes_is_refused(tmp_path: Path) -> None:
    # Each rank ordered its threads' calls as they happened to run, and combined one thread's
    # collectives with another's: silently wrong results (1001 for a psum of 1 and of 1000).
    results, codes = spawn(distributed_workers.threads_at_once, tmp_path)
    assert codes == [0, 0], results
    for r in results:
        assert r["main"] == [2.0] and r["afterwards"] == [10.0], r
        assert r["meanwhile"]["error"] == "RuntimeError", r
        assert (
            "under fdp.distributed, pmapped calls with an axis name span the processes and must be "
            "made one at a time, in the same order on every rank, but this call started in thread "
            "'evaluation' while pmapped call #1 (fdp.pmap(threads_at_once.<locals>.slow)) runs in "
            "thread 'MainThread'" in r["meanwhile"]["message"]
        ), r


def test_check_unmapped_outputs_compares_the_replicas_of_every_process(tmp_path: Path) -> None:
    # Only this process's replicas were compared: with one replica per process, nothing, and
    # processes whose replicas returned different values (each training a model of its own)
    # passed the check.
    results, codes = spawn(distributed_workers.checked_unmapped_outputs, tmp_path)
    assert codes == [0, 0], results
    for r in results:
        for replicas in ("1", "2"):
            assert r[replicas]["same"] == 4.0 / int(replicas), r
            differ = r[replicas]["differ"]
            assert differ["error"] == "ValueError", r
            assert (
                "out_axes is None for output['w'], but the processes' replicas disagree: those of "
                "rank 0 returned one value, those of rank 1 another (float32[3] on rank " in differ["message"]
            ), r


def test_a_failure_of_an_earlier_torchrun_attempt_does_not_fail_the_next(tmp_path: Path) -> None:
    results, codes = spawn(distributed_workers.restarted_attempts, tmp_path)
    assert codes == [0, 0], results
    assert results[0]["0"].startswith("RankFailed: fdp.distributed: rank 1 failed"), results
    assert results[1]["0"].startswith("ValueError: attempt 0"), results
    assert all(r["1"] == [4.0] for r in results), results


def test_processes_that_call_different_collectives_fail_alike_naming_them(tmp_path: Path) -> None:
    # As replicas of one process do: a ValueError naming the collectives, on every rank, at
    # once; not a wrong result, a hang until the timeout, or an abort in gloo.
    results, codes = spawn(distributed_workers.mismatched_collectives, tmp_path)
    assert codes == [0, 0], results
    for r in results:
        for case in (
            "op",
            "mean",
            "shape",
            "dtype",
            "large",
            "skipped",
            "transposed",
            "swapped",
            "keys",
            "gathered",
            "dtypes",
            "scattered",
            "scattered_shapes",
            "exchanged",
            "permuted",
            "permuted_shapes",
        ):
            assert r[case].get("error") == "ValueError", (case, r[case])
            assert r[case]["seconds"] < 10, (case, r[case])
        # Layouts that differ where the packed buffers agree in size name the leaf or the structure.
        assert "to fdp.psum at x (an all_reduce (sum), pmapped call #" in r["transposed"]["message"], r
        assert "float32[2,3] on rank 0, float32[3,2] on rank 1" in r["transposed"]["message"], r
        assert "at x['a']" in r["swapped"]["message"], r["swapped"]
        assert "float32[2] on rank 0, float32[3] on rank 1" in r["swapped"]["message"], r["swapped"]
        assert "trees of different structure to fdp.psum" in r["keys"]["message"], r["keys"]
        assert (
            "rank 0 passed PyTreeSpec({'a': *}); rank 1 passed PyTreeSpec({'b': *})" in r["keys"]["message"]
        )
        assert "to fdp.all_gather at x" in r["gathered"]["message"], r["gathered"]
        assert "at x['b']" in r["dtypes"]["message"], r["dtypes"]
        assert "float64[1] on rank 0, float32[1] on rank 1" in r["dtypes"]["message"], r["dtypes"]
        assert "Cast to one dtype" in r["dtypes"]["message"], r["dtypes"]
        assert r["order"] == {"returned": [330.0, 330.0], "seconds": r["order"]["seconds"]}, r["order"]
        # psum_scatter's options are compared, and its leaves named with the shapes passed.
        assert "rank 0 called fdp.psum_scatter(dim=0, tiled=False)" in r["scattered"]["message"], r
        # A reduce_scatter and an all_to_all of their own between the processes, not an
        # all_reduce or an all_gather of every buffer.
        assert "(a reduce_scatter (sum) of float32[4, 4];" in r["scattered"]["message"], r
        # ppermute sends each process only its rows: the perms and the rows' shapes are compared
        # (mismatched row counts abort gloo).
        assert (
            "rank 1 called fdp.ppermute(perm=[(2, 0)]) (an all_to_all of rows of float32[1];"
            in (r["permuted"]["message"])
        ), r["permuted"]
        assert "at x (an all_to_all, pmapped call #" in r["permuted_shapes"]["message"], r["permuted_shapes"]
        assert "float32[2] on rank 0, float32[3] on rank 1" in r["permuted_shapes"]["message"], r
        assert (
            "rank 1 called fdp.all_to_all(split_dim=1, concat_dim=0, tiled=False) (an all_to_all of"
            in r["exchanged"]["message"]
        ), r["exchanged"]
        assert "rank 1 called fdp.psum_scatter(dim=1, tiled=False)" in r["scattered"]["message"], r
        assert "float32[4,4] on rank 0, float32[4,8] on rank 1" in r["scattered_shapes"]["message"], r
        assert r["quantized"]["error"] == "TypeError", r["quantized"]
        assert (
            "fdp.all_gather across processes takes no quantized tensors, but x['q'] is quint8[2]"
            in (r["quantized"]["message"])
        ), r["quantized"]
    for r in results:
        assert "rank 0 called fdp.psum" in r["op"]["message"], r["op"]
        assert "rank 1 called fdp.pmax" in r["op"]["message"], r["op"]
        assert "rank 1 called fdp.pmean" in r["mean"]["message"], r["mean"]
        assert "float32[3] on rank 0, float32[4] on rank 1" in r["shape"]["message"], r["shape"]
        assert "float32[2] on rank 0, float64[2] on rank 1" in r["dtype"]["message"], r["dtype"]
        # The advice fits the mismatch: shapes (uneven batches) fold away in a reduction,
        # a dtype mismatch is not the batches' doing.
        assert "uneven batches between processes, reduce" in r["shape"]["message"], r["shape"]
        assert "Cast to one dtype" in r["dtype"]["message"], r["dtype"]
        assert "uneven" not in r["dtype"]["message"], r["dtype"]
        assert "float32[5000] on rank 0, float32[5001] on rank 1" in r["large"]["message"], r["large"]
    for r in results:
        assert r["functions"].get("error") == "ValueError", r["functions"]
        assert (
            "the processes started calls of different pmapped functions as pmapped call #"
            in r["functions"]["message"]
        ), r["functions"]
        assert (
            "rank 0 fdp.pmap(mismatched_collectives.<locals>.evaluate); "
            "rank 1 fdp.pmap(mismatched_collectives.<locals>.train)." in r["functions"]["message"]
        ), r["functions"]
    skipped = results[1]["skipped"]["message"]
    assert "rank 0 called fdp.psum" in skipped and "rank 1 started pmapped call" in skipped, skipped
    assert "(fdp.pmap(mismatched_collectives.<locals>.<lambda>))" in skipped, skipped


def test_broadcast_gives_every_process_one_process_values(tmp_path: Path) -> None:
    # DDP's parameter sync at construction (jax's broadcast_one_to_all), for state built apart.
    results, codes = spawn(distributed_workers.broadcast_state, tmp_path)
    assert codes == [0, 0], results
    own = [r["own"] for r in results]
    assert own[0]["state['params']['0.weight']"] != own[1]["state['params']['0.weight']"]
    for r in results:
        for src in (0, 1):
            got = dict(r[f"from{src}"])
            assert got.pop("shared") is False, (
                "a result shares memory with the given state or with another result"
            )
            # Bit for bit (float() of bfloat16/int64/bool is exact), the dtypes and requires_grad
            # kept; Python numbers of their own types, src's; other leaves each rank's own.
            expected = {path: value for path, value in own[src].items() if path != "state['name']"}
            assert {path: value for path, value in got.items() if path != "state['name']"} == expected
            assert got["state['name']"] == r["own"]["state['name']"]  # each rank's own
            assert [type(got[f"state['{k}']"]) for k in ("step", "lr", "nesterov")] == [int, float, bool]
        assert r["from0"]["state['params']['0.weight']"][2] is True
        # A run stopped after 2 steps resumes bit for bit from rank 0's checkpoint, loaded on
        # every rank or broadcast from rank 0, the optimizer's step count (an int) included.
        assert r["resume"]["everywhere"] == {"steps": 2, "exact": True}, r["resume"]
        assert r["resume"]["broadcast"] == {"steps": 2, "exact": True}, r["resume"]
        assert r["from0"]["state['half']"][0] == "torch.bfloat16"
        assert r["from0"]["state['buffers']['1.num_batches_tracked']"][0] == "torch.int64"
        assert r["transposed"]["error"] == "ValueError", r["transposed"]
        assert (
            "to fdp.distributed.broadcast at tree['w'] (a broadcast from rank 0, before any pmapped call)"
            in r["transposed"]["message"]
        )
        assert "float32[2,3] on rank 0, float32[3,2] on rank 1" in r["transposed"]["message"]
        assert r["huge"]["error"] == "ValueError", r["huge"]
        assert "tree['n'] = 1180591620717411303424 does not fit in an int64" in r["huge"]["message"]
        assert r["keys"]["error"] == "ValueError" and "trees of different structure" in r["keys"]["message"]
        assert r["untensored"]["error"] == "ValueError", r["untensored"]
        assert "trees of different structure" in r["untensored"]["message"]
        assert r["devices"]["error"] == "ValueError", r["devices"]
        assert (
            "tensors on different kinds of device: cpu on rank 0, meta on rank 1" in r["devices"]["message"]
        )
        assert r["parameter"] == ["Parameter", True, [0.0, 0.0], "Parameter", False], r["parameter"]
        assert r["autocast"] == ["torch.float16", [1.5, 1.5, 1.5]], r["autocast"]
        assert r["src"]["error"] == "ValueError", r["src"]
        assert "src must be a rank, an int from 0 to 1, got 2" in r["src"]["message"]
        assert r["placed"]["error"] == "TypeError", r["placed"]
        assert "tree['w'] is a PerReplica" in r["placed"]["message"]
        assert all(
            r[case]["seconds"] < 10 for case in ("transposed", "keys", "untensored", "src", "placed")
        ), r
        assert r["after"] == [1.0]


def test_broadcast_without_initialize_returns_the_tree() -> None:
    tree = {"w": torch.ones(2), "step": 3}
    assert fdp.distributed.broadcast(tree) is tree
    with pytest.raises(
        ValueError, match=r"^fdp.distributed.broadcast: src must be a rank, an int from 0 to 0, got 1$"
    ):
        fdp.distributed.broadcast(tree, src=1)
    # Not an int is a TypeError (it was a ValueError), as initialize's rank is.
    for bad, got in (("0", "str: '0'"), (0.0, "float: 0.0"), (False, "bool: False")):
        with pytest.raises(
            TypeError,
            match=rf"^fdp.distributed.broadcast: src must be a rank, an int from 0 to 0, got {got}$",
        ):
            fdp.distributed.broadcast(tree, src=bad)  # type: ignore[arg-type]


def _signature_in_a_fresh_process(tree: object) -> str:
    """layout_of's signature as a process that never saw another tree computes it."""
    _distributed._SIGNATURES.clear()
    leaves, treespec = fdp._tree.flatten(tree)
    return _distributed.layout_of(tree, treespec, leaves).signature


def test_processes_with_the_same_tree_compute_the_same_layout_signature() -> None:
    # A false mismatch would stop training: whatever one process met before, and however its
    # classes or keys print, the same tree gives the same signature.
    t = torch.zeros(2)
    # Equal dict keys (1, 1.0, True) make equal treespecs, which the cache keeps one signature
    # for: a process that met {1.0: t} first must agree with one that met {1: t} only.
    one = _signature_in_a_fresh_process({1: t})
    _distributed._SIGNATURES.clear()
    for key in (1.0, True, 1):
        leaves, treespec = fdp._tree.flatten({key: t})
        assert _distributed.layout_of({key: t}, treespec, leaves).signature == one, key
    Name = enum.StrEnum("Name", {"W": "w"})
    w = _signature_in_a_fresh_process({"w": t})
    assert _signature_in_a_fresh_process({Name.W: t}) == w

    # A class of the script's is __main__'s in a process started as the script (torchrun, or
    # the parent of mp.Process children) and __mp_main__'s in a spawned child.
    def made_in(module: str) -> type:
        cls = dataclasses.make_dataclass("State", [("w", torch.Tensor)])
        cls.__module__ = module
        return cls

    signatures = {_signature_in_a_fresh_process(made_in(m)(t)) for m in ("__main__", "__mp_main__")}
    assert len(signatures) == 1

    # A custom node whose path entries print with their address.
    class Entry:
        pass

    class Box:
        def __init__(self, v: torch.Tensor) -> None:
            self.v = v

    optree.register_pytree_node(
        Box, lambda b: ((b.v,), None, (Entry(),)), lambda _, c: Box(c[0]), namespace=fdp._tree.NAMESPACE
    )
    try:
        assert _signature_in_a_fresh_process(Box(t)) == _signature_in_a_fresh_process(Box(t))
    finally:
        optree.unregister_pytree_node(Box, namespace=fdp._tree.NAMESPACE)

    # Trees that differ still differ.
    assert _signature_in_a_fresh_process({"a": t}) != _signature_in_a_fresh_process({"b": t})
    assert _signature_in_a_fresh_process({1: t}) != _signature_in_a_fresh_process({2: t})
    assert _signature_in_a_fresh_process([t]) != _signature_in_a_fresh_process((t,))


def test_trees_that_differ_and_cannot_be_spelled_out_fail_every_rank_at_once(tmp_path: Path) -> None:
    # Spelling a tree out for the message failed on one rank (a dict key whose repr fails): it
    # raised and went on to its next collective while the other waited in the exchange of the
    # spelled-out trees, which gloo then aborted (SIGABRT).
    results, codes = spawn(distributed_workers.unprintable_layout, tmp_path)
    assert codes == [0, 0], results
    for r in results:
        assert r["psum"]["error"] == "ValueError", r
        assert "trees of different structure to fdp.psum" in r["psum"]["message"]
        assert "a tree that cannot be spelled out (RuntimeError: no repr)" in results[0]["psum"]["message"]
        assert r["psum"]["seconds"] < 10, r
        assert r["after"] == [1.0]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_initialize_joins_a_process_group_made_beforehand(tmp_path: Path) -> None:
    # Made with env://, whose store rank 0 hosts on MASTER_PORT: initialize must not host
    # another there (EADDRINUSE), but use the group's.
    (tmp_path / "port").write_text(str(free_port()))
    results, codes = spawn(distributed_workers.existing_group, tmp_path)
    assert codes == [0, 0], results
    # Before initialize, a call's axis spans its own process: a script from DDP that forgets
    # initialize trained a model per process, silently. It is warned, once.
    for r, result in enumerate(results):
        before = result.pop("before")
        assert before["psum"] == [[r + 1.0]] * 2, before
        assert len(before["warnings"]) == 1, before
        assert before["warnings"][0].startswith(
            "fdp.pmap(existing_group.<locals>.<lambda>): a torch.distributed process group of 2 "
            "processes exists, but fdp.distributed.initialize() was not called in this process, so "
            "the axis 'i' spans this process's replicas only"
        ), before
    assert results == [{"psum": [3.0], "rank": r, "world": 2} for r in range(2)], results


def test_pmax_and_pmin_gradients_through_the_call_split_ties_over_every_process(tmp_path: Path) -> None:
    # 3 of the 4 replicas (2 per rank) tie; the 4 outputs' cotangents (1 each) go to the tied
    # replicas in equal parts, 4/3 each, as in one process with 4 replicas.
    results, codes = spawn(distributed_workers.tied_extremes, tmp_path)
    assert codes == [0, 0], results
    for name in ("pmax", "pmin"):
        assert results[0][name] == pytest.approx([4 / 3, 4 / 3]), results
        assert results[1][name] == pytest.approx([4 / 3, 0.0]), results


def test_collectives_span_processes_with_unequal_replica_counts(
    tmp_path: Path,
) -> None:
    # 3 replicas (2 on rank 0, 1 on rank 1) with sums 1, 2, 3: replica r gets (r + 1) * 6.
    # (A reduce_scatter cuts equal blocks only: here the whole sum is all-reduced.)
    results, codes = spawn(distributed_workers.unequal_replica_counts, tmp_path)
    assert codes == [0, 0], results
    assert results[0]["psum_scatter"] == [6.0, 12.0] and results[1]["psum_scatter"] == [18.0]
    assert results[0]["psum_scatter_large"] == [[6.0], [12.0]], results[0]
    assert results[1]["psum_scatter_large"] == [[18.0]], results[1]
    x = torch.arange(1.0, 4.0)[:, None]
    whole = torch.nn.functional.batch_norm(torch.cat([x, x.square()], 1), None, None, training=True)
    torch.testing.assert_close(
        torch.tensor(results[0]["sync_batch_norm"] + results[1]["sync_batch_norm"]), whole
    )
    # A ring over the 3: replica r gets replica r - 1's value.
    assert results[0]["ppermute"] == [[3.0], [1.0]] and results[1]["ppermute"] == [[2.0]], results
    # Only replica 0 sends (to replica 2, on rank 1): rank 0's w gets 3 (replica 2's weight)
    # times 2 entries of x_0 = 1; rank 1's w gets 0 (it sends nothing). Inside, d/dx_0 = 2 * 3.
    assert results[0]["ppermute_outer_grad"] == 6.0 and results[1]["ppermute_outer_grad"] == 0.0, results
    assert results[0]["ppermute_inner_grad"] == [[6.0], [0.0]] and results[1]["ppermute_inner_grad"] == [
        [0.0]
    ]
    # Replicas 0 and 1 (both on rank 0) swap, with no all_to_all anywhere: d/dw on rank 0 is
    # 2 entries x (1 * x_1 + 2 * x_0); rank 1's replica gets zeros, and w nothing (but a 0).
    # Inside: x_0 goes to replica 1 (weight 2), x_1 to replica 0 (weight 1), times 2.
    assert results[0]["ppermute_local"] == [[2.0], [1.0]] and results[1]["ppermute_local"] == [[0.0]], results
    assert results[0]["ppermute_local_outer_grad"] == 8.0, results[0]
    assert results[1]["ppermute_local_outer_grad"] == 0.0, results[1]
    assert results[0]["ppermute_local_inner_grad"] == [[4.0], [2.0]], results[0]
    assert results[1]["ppermute_local_inner_grad"] == [[0.0]], results[1]
    assert results[0]["ppermute_local_all_to_alls"] == results[1]["ppermute_local_all_to_alls"] == 0, results
    for suffix, size in (("", 1), ("_large", 3000)):
        # Every replica gets the 3 values; rank 1's padding row is dropped.
        assert results[0][f"all_gather{suffix}"] == [[1.0, 2.0, 3.0]] * 2, results[0]
        assert results[1][f"all_gather{suffix}"] == [[1.0, 2.0, 3.0]], results[1]
        # Rows 1..6 of rank 0's output and 1..3 of rank 1's weigh x_j's row j by
        # (j + 1) + (j + 4) + (j + 1): rank 0's w gets 1 * 6 + 2 * 9, rank 1's 3 * 12, each
        # times the size.
        assert results[0][f"all_gather_outer_grad{suffix}"] == 24.0 * size, results[0]
        assert results[1][f"all_gather_outer_grad{suffix}"] == 36.0 * size, results[1]
        # Replica r's row weighs r + 1: d/dx_j = sum_r (r + 1) * (r + 1) * size = 14 * size.
        assert results[0][f"psum_scatter_inner_grad{suffix}"] == [[14.0 * size]] * 2, results[0]
        assert results[1][f"psum_scatter_inner_grad{suffix}"] == [[14.0 * size]], results[1]
        # all_to_all: replica r's rows 10 s_i + r of every replica i (s_i = i + 1).
        assert results[0][f"all_to_all{suffix}"] == [[10.0, 20.0, 30.0], [11.0, 21.0, 31.0]], results[0]
        assert results[1][f"all_to_all{suffix}"] == [[12.0, 22.0, 32.0]], results[1]
        # out_r[i] = s_i w (r + 1), weighed by i + 1: each rank's w gets its own s_i (i + 1)
        # times sum_r (r + 1) = 6, times the size; inside, d/dx_i = (i + 1) * 6 * size.
        assert results[0][f"all_to_all_outer_grad{suffix}"] == (1 * 1 + 2 * 2) * 6.0 * size, results[0]
        assert results[1][f"all_to_all_outer_grad{suffix}"] == 3 * 3 * 6.0 * size, results[1]
        assert results[0][f"all_to_all_inner_grad{suffix}"] == [[6.0 * size], [12.0 * size]], results[0]
        assert results[1][f"all_to_all_inner_grad{suffix}"] == [[18.0 * size]], results[1]
    # Values of dtypes that gloo carries none of, as one process's replicas exchange them: moved
    # as bytes, int16 reduced as int32 (they failed with gloo's "Invalid scalar type", naming no
    # collective, past the 8 KiB that travel with the check, and at any size in all_to_all and
    # ppermute).
    # A contrastive loss and ZeRO-style Adam steps, as one device computes them.
    for r in results:
        assert len(r["programs"]) == 4 and all(d < 1e-12 for d in r["programs"].values()), r["programs"]
    for r in results:
        assert len(r["dtypes_gloo_lacks"]) == 2 * (6 + 3 + 3) + 2, r["dtypes_gloo_lacks"]
        assert all(ok is True for ok in r["dtypes_gloo_lacks"].values()), r["dtypes_gloo_lacks"]


def test_exchanges_of_leaves_without_elements_span_processes(tmp_path: Path) -> None:
    # Shapes with a 0 in them: the rows of every process joined by reshape(-1, 0) raised
    # "cannot reshape tensor of 0 elements" (all_gather, and psum_scatter's backward).
    results, codes = spawn(distributed_workers.empty_exchanges, tmp_path)
    assert codes == [0, 0], results
    # Each rank's 2 replicas' results, joined along dim 0 (as 4 replicas in one process give
    # twice as many rows); the gradient of the unmapped w of shape [4, 0], and inside, of w
    # in each replica.
    outputs = {"all_gather": [8, 4, 0], "psum_scatter": [0], "all_to_all": [8, 0], "ppermute": [8, 0]}
    for r in results:
        for name, out in outputs.items():
            assert r[f"{name}_outer"] == {"shapes": [out, [4, 0]]}, (name, r[f"{name}_outer"])
            assert r[f"{name}_inner"] == {"shapes": [[8, 0]]}, (name, r[f"{name}_inner"])


def test_pmax_and_pmin_propagate_nan_from_any_process_at_every_size(tmp_path: Path) -> None:
    # As torch.maximum and the replicas of one process do; gloo's own MAX/MIN keep whichever
    # operand comes first where one is NaN.
    results, codes = spawn(distributed_workers.nan_extremes, tmp_path)
    assert codes == [0, 0], results
    nan = float("nan")
    for r in results:
        for size in (4, 4000):
            assert _same(r[f"pmax_{size}"], [[2.0, nan, nan, 2.0]] * 2), (size, r)
            assert _same(r[f"pmin_{size}"], [[1.0, nan, nan, 1.0]] * 2), (size, r)


def _same(a: list, b: list) -> bool:
    return torch.equal(torch.tensor(a).isnan(), torch.tensor(b).isnan()) and torch.equal(
        torch.tensor(a).nan_to_num(), torch.tensor(b).nan_to_num()
    )


def test_shard_batch_refuses_chunks_that_a_process_would_cut_otherwise(tmp_path: Path) -> None:
    results, codes = spawn(distributed_workers.chunked_shares, tmp_path)
    assert codes == [0, 0], results
    for r in results:
        # 10 rows over 8 replicas are 5 chunks of 2: process 1 holds 2 rows, which its own
        # pmapped call would cut into 2 chunks of 1.
        assert "split='chunk'" in r["ten_rows"] and "[1, 1]" in r["ten_rows"], r
    # 30 rows over 8 replicas: 7 chunks of 4 and one of 2, as in one process.
    assert results[0]["thirty_rows"] == [[4, i, 8] for i in range(4)], results
    assert results[1]["thirty_rows"] == [[4, 4, 8], [4, 5, 8], [4, 6, 8], [2, 7, 8]], results


def test_a_call_that_fails_before_its_exchange_of_replica_counts_tells_the_others(tmp_path: Path) -> None:
    results, codes = spawn(distributed_workers.empty_shares, tmp_path)
    assert codes == [0, 0], results
    for r in results:
        assert "got an empty batch" in r["everywhere"], r
        assert r["after"] == [4.0], r  # the failure every rank had is not news later
    assert results[1]["one_row"]["error"] == "ValueError", results
    assert results[0]["one_row"]["error"] == "RankFailed", results
    assert "rank 1 failed" in results[0]["one_row"]["message"], results
    assert "got an empty batch" in results[0]["one_row"]["message"], results
    assert results[0]["seconds"] < 4, results  # not the 30 s timeout
    # A failure in the argument checks, before the scatter, on rank 1 alone: the same.
    assert results[1]["arguments"]["error"] == "ValueError", results
    assert results[0]["arguments"]["error"] == "RankFailed", results
    assert "static_argnums" in results[0]["arguments"]["message"], results
    assert results[0]["arguments_seconds"] < 4, results


def test_a_rank_whose_replicas_all_weigh_0_in_pmean_takes_part_in_the_backward(tmp_path: Path) -> None:
    # Rank 0's replicas all weigh 0: its mean was a tensor of zeros made apart from the graph,
    # so its backward() failed ("does not require grad") while rank 1 waited for it in the
    # backward's all_reduce.
    results, codes = spawn(distributed_workers.weight_0_on_one_rank, tmp_path, timeout=60.0)
    assert codes == [0, 0], results
    g = torch.Generator().manual_seed(0)
    logits, targets = (
        torch.randn(8, 5, dtype=torch.float64, generator=g),
        torch.randint(0, 5, (8,), generator=g),
    )
    targets[:4] = -100
    z = logits.clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(z, targets, ignore_index=-100)
    expected.backward()
    for rank, r in enumerate(results):
        assert r["backward"]["error"] is None, r
        assert r["value"] == pytest.approx(expected.item()), r
        # Each rank's backward differentiates the sum of both ranks' outputs (pmean's transpose
        # sums the cotangents): twice the whole batch's loss's gradient, for its own rows.
        grad = 2 * z.grad[4 * rank : 4 * rank + 4]
        torch.testing.assert_close(torch.tensor(r["grad"], dtype=torch.float64), grad)


def test_an_empty_share_under_data_parallel_takes_part_in_the_call(tmp_path: Path) -> None:
    # Rank 0's empty share ran outside any replica, with no exchange of replica counts: it
    # returned, and rank 1 waited for it (here: until rank 0 shut down).
    results, codes = spawn(distributed_workers.empty_share_under_data_parallel, tmp_path, timeout=60.0)
    assert codes == [0, 0], results
    for r in results:
        assert r["call"]["error"] is None and r["after"]["error"] is None, r
        # One replica on each rank: the layer normalizes over rank 1's two rows (momentum 0.1).
        assert r["running_mean"] == pytest.approx([0.15, 0.25, 0.35]), r


def test_nccl_without_gpus_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match=r"backend='nccl'.*GPU"):
        fdp.distributed.initialize(backend="nccl", rank=0, world_size=1, store=dist.HashStore())
    assert not fdp.distributed.is_initialized()


def test_a_bad_environment_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=r"RANK.*'zero'"):
        fdp.distributed.initialize(backend="gloo")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29x")
    with pytest.raises(ValueError, match=r"MASTER_PORT.*'29x'"):
        fdp.distributed.initialize(backend="gloo")
    assert not fdp.distributed.is_initialized()


def test_initialize_twice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Reachable by any script that initializes in a helper it calls twice; no test reached it.
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # initialize wraps it
    fdp.distributed.initialize(backend="gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.raises(
            RuntimeError, match=r"^fdp\.distributed\.initialize was already called in this process$"
        ):
            fdp.distributed.initialize(backend="gloo", rank=0, world_size=1, store=dist.HashStore())
        assert fdp.distributed.is_initialized()  # the first group stays
    finally:
        fdp.distributed.shutdown()
    assert not dist.is_initialized()


def test_broadcast_names_a_dataclass_it_cannot_rebuild(monkeypatch: pytest.MonkeyPatch) -> None:
    # The message named neither the call nor the key path.
    @dataclasses.dataclass
    class Late:
        x: torch.Tensor
        weight: object = dataclasses.field(init=False, default=None)

    late = Late(torch.zeros(2))
    late.weight = torch.ones(2)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # initialize wraps it
    fdp.distributed.initialize(backend="gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.raises(
            ValueError, match=r"^fdp\.distributed\.broadcast: tree\['s'\]: fdp cannot rebuild"
        ):
            fdp.distributed.broadcast({"s": late})
    finally:
        fdp.distributed.shutdown()


def test_a_group_destroyed_behind_fdps_back_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # initialize wraps it
    psum = fdp.pmap(lambda x: fdp.psum(x, "i"), axis_name="i", devices=["cpu"])
    fdp.distributed.initialize(backend="gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        assert psum(torch.ones(2)).tolist() == [1.0, 1.0]
        dist.destroy_process_group()
        assert not fdp.distributed.is_initialized()
        with pytest.raises(RuntimeError, match=r"no longer exists.*destroy_process_group"):
            psum(torch.ones(2))
        fdp.distributed.initialize(backend="gloo", rank=0, world_size=1, store=dist.HashStore())
        assert fdp.distributed.is_initialized() and psum(torch.ones(2)).tolist() == [1.0, 1.0]
    finally:
        fdp.distributed.shutdown()
    assert not dist.is_initialized()


def test_the_warning_for_a_group_never_joined_names_the_users_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # It named fdp's own line in _pool.py, which warnings filters and the user's search for the
    # call it is about cannot use (fdp's other warnings name the user's line).
    monkeypatch.setattr(_distributed, "WARNED_UNJOINED", False)
    monkeypatch.setattr(_distributed, "_SESSIONS", [0])
    monkeypatch.setattr(_distributed, "_DIST_AVAILABLE", True)
    monkeypatch.setattr(_distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(_distributed.dist, "get_world_size", lambda group=None: 2)
    psum = fdp.pmap(lambda x: fdp.psum(x, "i"), axis_name="i", devices=["cpu"])
    with pytest.warns(UserWarning, match="fdp.distributed.initialize\\(\\) was not called") as caught:
        psum(torch.ones(1))
    assert [w.filename for w in caught] == [__file__], [(w.filename, w.lineno) for w in caught]
    psum(torch.ones(1))  # (once)


def test_check_unmapped_outputs_digests_tensors_of_every_view_kind() -> None:
    # A conjugated complex output (x.conj(), a lazy view) failed the digest that
    # check_unmapped_outputs exchanges under fdp.distributed, with view_as_real's RuntimeError,
    # on every rank: the check in one process compares it as the values it holds.
    x = torch.tensor([1 + 2j, 3 - 1j])
    assert _distributed._digest(x.conj()) == _distributed._digest(x.conj().resolve_conj())
    assert _distributed._digest(x.conj()) != _distributed._digest(x)
    assert _distributed._digest(x.conj().imag) == _distributed._digest(-x.imag)  # (a negative view)
    assert _distributed._digest(torch.tensor([-0.0, math.nan])) == _distributed._digest(
        torch.tensor([0.0, -math.nan])
    )


def test_a_wait_that_finds_a_later_calls_failure_gives_its_work_one_more_slice() -> None:
    # Rank 1 finished the collective that rank 0 waits in, and failed in its next call (an
    # empty share, recorded before any exchange) before rank 0's slice of waiting saw the work
    # complete: rank 0 raised RankFailed in a call that every rank had finished. (A flake of
    # test_a_call_that_fails_before_its_exchange_of_replica_counts_tells_the_others on a busy
    # machine.)
    store = dist.HashStore()
    state = _distributed._State(
        rank=0,
        world_size=2,
        local_rank=0,
        backend="gloo",
        store=store,
        timeout=datetime.timedelta(seconds=30),
        communicator=types.SimpleNamespace(exiting=False),  # type: ignore[arg-type]
        owns_group=False,
        group=None,
        attempt=0,
        calls=2,
    )
    store.set(_distributed._failure_key(state, 1), "3\nValueError: got an empty batch")

    class Work:
        """Completes in the second slice of waiting."""

        waits = 0

        def wait(self, timeout: object = None) -> bool:
            self.waits += 1
            if self.waits < 2:
                raise RuntimeError("Timed out waiting for the work")
            return True

        def is_completed(self) -> bool:
            return self.waits >= 2

    work = Work()
    _distributed._wait(state, work, "fdp.psum (an all_reduce (sum))", torch.device("cpu"))
    assert work.waits == 2
    # A record of this call itself is news at once, as before.
    store.set(_distributed._failure_key(state, 1), "2\nValueError: broke")
    with pytest.raises(_distributed.RankFailed, match=r"rank 1 failed during fdp.psum .*broke"):
        _distributed._wait(state, Work(), "fdp.psum (an all_reduce (sum))", torch.device("cpu"))


def test_shard_batch_checks_its_arguments_in_one_process_too() -> None:
    # An unknown split was taken as "balanced", and tensors of different lengths were cut at the
    # same rows (some rows of the longer reaching no process), silently.
    x = torch.arange(6.0)
    with pytest.raises(
        ValueError,
        match=r"fdp.distributed.shard_batch split must be one of \('chunk', 'balanced'\), got 'bogus'",
    ):
        fdp.distributed.shard_batch(x, split="bogus")  # type: ignore[arg-type]
    for bad in (0, -1):
        with pytest.raises(
            ValueError,
            match=rf"^fdp.distributed.shard_batch: local_replicas must be a positive int, got {bad}$",
        ):
            fdp.distributed.shard_batch(x, local_replicas=bad)
    # Not an int is a TypeError (it was a ValueError), as DataParallel's dim is.
    for bad, got in ((1.5, "float: 1.5"), (True, "bool: True"), ("2", "str: '2'")):
        with pytest.raises(
            TypeError,
            match=rf"^fdp.distributed.shard_batch: local_replicas must be a positive int, got {got}$",
        ):
            fdp.distributed.shard_batch(x, local_replicas=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must share dim 0 .*got batch\['x'\]: 6, batch\['y'\]: 5"):
        fdp.distributed.shard_batch({"x": x, "y": torch.zeros(5)})
    # 0-dim tensors and other values go to every process as they are.
    batch = {"x": x, "scale": torch.tensor(2.0), "name": "b"}
    assert fdp.distributed.shard_batch(batch) is batch


def test_shard_batch_of_an_empty_batch_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    from fdp import _distributed

    monkeypatch.setattr(_distributed, "world_size", lambda: 2)
    monkeypatch.setattr(_distributed, "rank", lambda: 0)
    assert fdp.distributed.shard_batch(torch.arange(4.0)).tolist() == [0.0, 1.0]  # (the stand-in works)
    with pytest.raises(
        ValueError,
        match=r"fdp.distributed.shard_batch: the batch is empty \(dim 0 of batch\[0\] has size 0\)",
    ):
        fdp.distributed.shard_batch((torch.zeros(0, 3),))


class Encoding(collections.UserDict):  # a Hugging Face BatchEncoding, as a DataCollator returns it
    pass


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        (
            lambda: Encoding(input_ids=torch.ones(4, 3)),
            r"batch: a Encoding holding tensors, .* Pass a plain dict",
        ),
        (lambda: {"ids": np.ones((4, 3))}, r"batch\['ids'\]: a numpy.ndarray of shape \(4, 3\)"),
        (
            lambda: nn.utils.rnn.pack_sequence([torch.ones(4, 2)]),
            r"batch is a torch.nn.utils.rnn.PackedSequence, which fdp cannot split",
        ),
    ],
    ids=["UserDict", "numpy", "PackedSequence"],
)
def test_shard_batch_refuses_rows_that_fdp_does_not_split(
    monkeypatch: pytest.MonkeyPatch, batch: Any, match: str
) -> None:
    # A UserDict or NumPy array was returned whole to every process, each then training on the
    # whole batch; a PackedSequence of one sequence was cut field by field into half sequences.
    monkeypatch.setattr(_distributed, "world_size", lambda: 2)
    monkeypatch.setattr(_distributed, "rank", lambda: 0)
    with pytest.raises(TypeError, match=rf"^fdp.distributed.shard_batch: {match}.*leave it out of the batch"):
        fdp.distributed.shard_batch(batch())


def test_a_rank_failing_inside_try_finally_shutdown_still_tells_the_others(tmp_path: Path) -> None:
    # shutdown() in a finally block runs before sys.excepthook, which then found fdp shut down:
    # rank 0 saw only a lost connection, "probably died without recording a failure".
    results, codes = spawn(distributed_workers.failure_in_finally, tmp_path)
    assert codes[1] != 0
    rank0 = results[0]
    assert rank0["error"] == "RankFailed", rank0
    assert "rank 1 failed" in rank0["message"], rank0
    assert "RuntimeError: rank 1's data loader broke" in rank0["message"], rank0
    assert rank0["seconds"] < 10, rank0


def test_a_rank_that_shut_down_is_named_by_the_ranks_still_calling(tmp_path: Path) -> None:
    # A pmapped call on rank 0 alone (rank 1 has shut down, its group left as it was): rank 0
    # waited for rank 1 until the timeout, "another rank may be hung".
    results, codes = spawn(distributed_workers.leaving_early, tmp_path)
    assert codes == [0, 0], results
    rank0 = results[0]
    assert rank0["error"] == "RankFailed", rank0
    assert "rank 1 called fdp.distributed.shutdown() after 1 pmapped call" in rank0["message"], rank0
    assert "pmapped call #2" in rank0["message"] and "is_main_process()" in rank0["message"], rank0
    assert rank0["seconds"] < 10, rank0  # not the 20 s timeout


def test_shutdown_in_a_generator_closed_early_leaves_a_note_not_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A generator closed before its end (the consumer stopped iterating) runs its finally block
    # with GeneratorExit in flight: a clean exit, which shutdown recorded as this rank's failure.
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # initialize wraps it
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store = dist.HashStore()

    def session():
        fdp.distributed.initialize(backend="gloo", rank=0, world_size=1, store=store)
        try:
            yield
        finally:
            fdp.distributed.shutdown()

    steps = session()
    prefix = f"fdp/session_{_distributed._SESSIONS[0]}/"  # this process's next session's keys
    next(steps)
    steps.close()
    assert not fdp.distributed.is_initialized()
    assert not store.check([prefix + "fdp/failure/0/0"])
    assert store.check([prefix + "fdp/left/0/0"])
