"""Dispatch overhead: a pmapped function against the direct call, on 1, 2 and 4 CPU replicas.

    python benchmarks/dispatch.py [--rounds 15] [--compile] [--json dispatch.json]

Three inputs: one tensor into a trivial function; nested dicts of 100 and of 1000 tensors. For
the nested inputs, the reference is the bare per-leaf work any implementation must do on 2
replicas: ``chunk`` every leaf and ``cat`` the pieces back (on one thread, with no function);
a stricter one cuts with ``split_with_sizes`` as fdp does, the sizes known beforehand.
For the one tensor, two more rows: 2 replicas with the caller never running replicas itself
(every replica but the first handed to a worker thread, the cost of the hand-offs), and the
start and join of one thread, which ``nn.DataParallel`` pays per extra replica per call.

Last, a training step of about 1 ms (forward and ``torch.autograd.grad`` of a small MLP) called
directly and pmapped on one CPU replica; the same model's functional training step (with
an SGD update) called directly on plain state and pmapped on one replica with resident state,
as a training loop runs it, without and with a ``pmean`` of the gradients (also donated,
``donate=True``); and its module
training step (forward, ``backward()``, ``torch.optim.SGD``) on the plain module and through
``fdp.DataParallel`` on one CPU device. ``nn.DataParallel`` has no row of its own: without CUDA
(or with one device) it calls the module directly, which is the plain row.

Then a host-bound step: a tiny transformer whose kernels take microseconds, so that its step is
the host's Python and dispatch, as on a GPU that outpaces its host (see :func:`host_bound_rows`).
With ``--compile``, also its compiled steps: the plain step on ``torch.compile(model)`` and the
resident step with ``pmap(compile=True)``.

Before the timing, every variant must compute what the direct call does: the whole input back,
the same gradients, and after 3 training steps the same parameters (``_harness.same_parameters``).
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import optree
import torch
from _harness import Parameters, arguments, interleaved, same_parameters, table, write_json

import fdp
from fdp import _pool, optim


def nested(leaves: int) -> dict[str, Any]:
    return {f"group{g}": {f"leaf{k}": torch.randn(8, 4) for k in range(10)} for g in range(leaves // 10)}


def bare_chunk_cat(tree: dict[str, Any]) -> dict[str, Any]:
    pieces = {g: {k: t.chunk(2) for k, t in d.items()} for g, d in tree.items()}
    return {g: {k: torch.cat(p) for k, p in d.items()} for g, d in pieces.items()}


def bare_split_cat(tree: dict[str, Any]) -> dict[str, Any]:
    """As :func:`bare_chunk_cat`, with the cheaper cut fdp itself makes (``split_with_sizes``,
    the sizes known beforehand): the stricter reference."""
    pieces = {g: {k: t.split_with_sizes([4, 4]) for k, t in d.items()} for g, d in tree.items()}
    return {g: {k: torch.cat(p) for k, p in d.items()} for g, d in pieces.items()}


def same_tree(result: Any, expected: Any) -> None:
    assert optree.tree_structure(result) == optree.tree_structure(expected)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(result), optree.tree_leaves(expected)))


def checked(variants: dict[str, Any], read: dict[str, Any], initial: Parameters) -> dict[str, Any]:
    """``variants`` after 3 steps of each, once every variant's parameters match the direct
    call's (``_harness.same_parameters``): none is timed doing less work."""
    for fn in variants.values():
        for _ in range(3):
            fn()
    same_parameters({name: fn() for name, fn in read.items()}, baseline="direct", initial=initial)
    return variants


def on_workers(mapped: Any, value: Any) -> Any:
    """A call in which every replica but the first runs on its worker thread."""
    _pool.INLINE_REPLICAS = False
    try:
        return mapped(value)
    finally:
        _pool.INLINE_REPLICAS = True


def thread_start_join(fn: Any, value: Any) -> None:
    thread = threading.Thread(target=fn, args=(value,))
    thread.start()
    thread.join()


def small_mlp() -> torch.nn.Module:
    """MLP 320-320-320-10: forward and gradients of a batch of 64 take about 1 ms."""
    width = 320
    return torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


def against_direct(label: str, variants: dict[str, Any], rounds: int) -> list[dict[str, Any]]:
    # Many short rounds: the difference sought (tens of microseconds on a millisecond) is smaller
    # than this machine's drift over a few seconds, and short rounds pair the variants closely.
    times = interleaved(variants, calls=5, rounds=20 * rounds)
    return [
        {
            "input": label,
            "variant": name,
            "us_per_call": seconds * 1e6,
            "over_direct_us": (seconds - times["direct"]) * 1e6,
            "ratio_to_direct": seconds / times["direct"],
        }
        for name, seconds in times.items()
    ]


def training_step_rows(rounds: int) -> list[dict[str, Any]]:
    """A ~1 ms step (forward + gradients), direct and on 1 replica."""
    model = small_mlp()
    params = list(model.parameters())
    x = torch.randn(64, 320)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(model(x).square().mean(), params)

    mapped = fdp.pmap(step, devices=["cpu"], out_axes=None)
    for got, expected in zip(mapped(x), step(x)):
        torch.testing.assert_close(got, expected)
    return against_direct("~1 ms step", {"direct": lambda: step(x), "1 replicas": lambda: mapped(x)}, rounds)


def resident_step_rows(rounds: int) -> list[dict[str, Any]]:
    """A ~1 ms functional training step (forward, gradients, SGD update of a parameter dict)
    called directly on plain state, and pmapped on 1 replica with resident state: the
    one-replica path of a training loop (the GPU target's). Pmapped also with a ``pmean`` of
    the gradients, which a direct call has no counterpart of: on one replica it hands back a
    private copy of them (one pass over the gradients' memory), or with ``donate=True`` the
    gradients themselves."""
    model = small_mlp()
    opt = optim.sgd(0.01)
    x = torch.randn(64, 320)

    def update(state: dict[str, Any], x: torch.Tensor, mean: Any = None) -> dict[str, Any]:
        leaves = {k: v.detach().requires_grad_() for k, v in state["params"].items()}
        loss = fdp.functional_call(model, leaves, (x,)).square().mean()
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        if mean is not None:
            grads = mean(grads)
        params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
        return {"params": params, "opt": opt_state}

    def pmeaned(state: dict[str, Any], x: torch.Tensor) -> dict[str, Any]:
        return update(state, x, lambda g: fdp.pmean(g, "b", weight=x.shape[0]))

    def donated(state: dict[str, Any], x: torch.Tensor) -> dict[str, Any]:
        return update(state, x, lambda g: fdp.pmean(g, "b", weight=x.shape[0], donate=True))

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    boxes = {"plain": {"params": params, "opt": opt.init(params)}}

    def direct() -> None:
        boxes["plain"] = update(boxes["plain"], x)

    def resident(fn: Any, name: str, **options: Any) -> Any:
        mapped = fdp.pmap(fn, devices=["cpu"], out_axes=fdp.PER_REPLICA, **options)
        boxes[name] = fdp.device_put_replicated(boxes["plain"], ["cpu"])

        def run() -> None:
            boxes[name] = mapped(boxes[name], x)

        return run

    variants = {
        "direct": direct,
        "1 replicas": resident(update, "resident"),
        "1 replicas, pmean": resident(pmeaned, "pmean", axis_name="b"),
        "1 replicas, pmean donated": resident(donated, "donated", axis_name="b"),
    }
    read = {
        "direct": lambda: [boxes["plain"]["params"]],
        "1 replicas": lambda: [{k: v[0] for k, v in boxes["resident"]["params"].items()}],
        "1 replicas, pmean": lambda: [{k: v[0] for k, v in boxes["pmean"]["params"].items()}],
        "1 replicas, pmean donated": lambda: [{k: v[0] for k, v in boxes["donated"]["params"].items()}],
    }
    return against_direct("~1 ms resident step", checked(variants, read, params), rounds)


def data_parallel_rows(rounds: int) -> list[dict[str, Any]]:
    """The MLP's module training step, plain and through ``fdp.DataParallel`` on one CPU."""
    model = small_mlp()
    x, y = torch.randn(64, 320), torch.randint(0, 10, (64,))

    def module_step(module: torch.nn.Module) -> Any:
        opt = torch.optim.SGD(module.parameters(), lr=0.01)

        def run() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(module(x), y).backward()
            opt.step()

        return run

    plain = copy.deepcopy(model)
    wrapped = fdp.DataParallel(copy.deepcopy(model), device_ids=["cpu"])
    variants = {"direct": module_step(plain), "fdp.DataParallel (1 cpu)": module_step(wrapped)}
    read = {
        "direct": lambda: [dict(plain.named_parameters())],
        "fdp.DataParallel (1 cpu)": lambda: [dict(wrapped.module.named_parameters())],
    }
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    return against_direct("~1 ms module step", checked(variants, read, initial), rounds)


def tiny_transformer() -> torch.nn.Module:
    """A 4-layer transformer encoder of width 16 (45 modules, 50 tensors) and a linear head: its
    kernels take microseconds, so its training step is the host's Python and dispatch, as a
    transformer's step is on a GPU that outpaces its host (see ``gpu.py``)."""
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    return torch.nn.Sequential(encoder, torch.nn.Flatten(), torch.nn.Linear(4 * 16, 10))


def host_bound_rows(rounds: int, compile: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The tiny transformer's training step, where the host's work is all there is: the plain
    module step (forward, ``backward()``, ``torch.optim.SGD``), the GPU target's reference; the
    functional step (``torch.autograd.grad`` and ``fdp.optim.sgd``) called directly with
    ``torch.func.functional_call`` and with ``fdp.functional_call``; that step pmapped on one
    replica with resident state and its gradients donated to a ``pmean``; and the module step
    through ``fdp.DataParallel`` on one CPU. With ``compile`` (``torch.compile``'s options),
    also the compiled paths, as ``gpu.py --compile`` has them on a GPU: the plain step on
    ``torch.compile(model)``, and the resident ``torch.func`` step with ``pmap(compile=...)``."""
    torch.manual_seed(0)
    model = tiny_transformer()
    x, y = torch.randn(4, 4, 16), torch.randint(0, 10, (4,))
    opt = optim.sgd(0.01)
    loss_of = torch.nn.functional.cross_entropy

    def module_step(module: torch.nn.Module) -> Any:
        sgd = torch.optim.SGD(module.parameters(), lr=0.01)

        def run() -> None:
            sgd.zero_grad()
            loss_of(module(x), y).backward()
            sgd.step()

        return run

    def functional_step(call: Any, mean: bool = False) -> Any:
        def update(state: dict[str, Any], x: torch.Tensor) -> dict[str, Any]:
            leaves = {k: v.requires_grad_() for k, v in state["params"].items()}
            loss = loss_of(call(model, leaves, (x,)), y)
            grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
            if mean:
                grads = fdp.pmean(grads, "b", weight=x.shape[0], donate=True)
            params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
            return {"params": params, "opt": opt_state}

        return update

    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    plain, wrapped = copy.deepcopy(model), fdp.DataParallel(copy.deepcopy(model), device_ids=["cpu"])
    boxes = {}
    for name in ("torch.func", "fdp"):
        params = {k: v.clone() for k, v in initial.items()}
        boxes[name] = {"params": params, "opt": opt.init(params)}
    mapped = fdp.pmap(
        functional_step(fdp.functional_call, mean=True),
        devices=["cpu"],
        out_axes=fdp.PER_REPLICA,
        axis_name="b",
    )
    boxes["resident"] = fdp.device_put_replicated(boxes["fdp"], ["cpu"])
    steps = {
        "torch.func": functional_step(torch.func.functional_call),
        "fdp": functional_step(fdp.functional_call),
    }

    def direct(name: str) -> Any:
        def run() -> None:
            boxes[name] = steps[name](boxes[name], x)

        return run

    def resident() -> None:
        boxes["resident"] = mapped(boxes["resident"], x)

    variants = {
        "direct": module_step(plain),
        "torch.func.functional_call step": direct("torch.func"),
        "fdp.functional_call step": direct("fdp"),
        "1 replicas, resident, pmean donated": resident,
        "fdp.DataParallel (1 cpu)": module_step(wrapped),
    }
    read = {
        "direct": lambda: [dict(plain.named_parameters())],
        "torch.func.functional_call step": lambda: [boxes["torch.func"]["params"]],
        "fdp.functional_call step": lambda: [boxes["fdp"]["params"]],
        "1 replicas, resident, pmean donated": lambda: [
            {k: v[0] for k, v in boxes["resident"]["params"].items()}
        ],
        "fdp.DataParallel (1 cpu)": lambda: [dict(wrapped.module.named_parameters())],
    }
    if compile is not None:
        compiled_plain = copy.deepcopy(model)
        variants["direct, torch.compile"] = module_step(torch.compile(compiled_plain, **compile))
        read["direct, torch.compile"] = lambda: [dict(compiled_plain.named_parameters())]

        def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return loss_of(fdp.functional_call(model, params, (x,)), y)

        @fdp.pmap(devices=["cpu"], out_axes=fdp.PER_REPLICA, axis_name="b", compile=compile)
        def compiled_step(state: dict[str, Any], x: torch.Tensor) -> dict[str, Any]:
            grads = fdp.pmean(torch.func.grad(loss)(state["params"], x), "b", weight=x.shape[0], donate=True)
            params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
            return {"params": params, "opt": opt_state}

        params = {k: v.clone() for k, v in initial.items()}
        boxes["compiled"] = fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, ["cpu"])

        def compiled_resident() -> None:
            boxes["compiled"] = compiled_step(boxes["compiled"], x)

        name = "1 replicas, resident, torch.func, compiled, pmean donated"
        variants[name] = compiled_resident
        read[name] = lambda: [{k: v[0] for k, v in boxes["compiled"]["params"].items()}]
    return against_direct("host-bound step", checked(variants, read, initial), rounds)


def main() -> None:
    parser = arguments(__doc__, rounds=15)
    parser.add_argument(
        "--compile", action="store_true", help="add the compiled host-bound steps (inductor: a minute or two)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    identity = lambda x: x  # noqa: E731
    rows = []
    for label, value, calls in [
        ("1 tensor", torch.randn(64, 16), 400),
        ("100 leaves", nested(100), 60),
        ("1000 leaves", nested(1000), 8),
    ]:
        variants = {"direct": lambda v=value: identity(v)}
        for n in (1, 2, 4):
            mapped = fdp.pmap(identity, devices=["cpu"] * n)
            variants[f"{n} replicas"] = lambda v=value, m=mapped: m(v)
        if isinstance(value, dict):
            variants["bare chunk+cat (2)"] = lambda v=value: bare_chunk_cat(v)
            variants["bare split+cat (2)"] = lambda v=value: bare_split_cat(v)
        else:
            mapped = fdp.pmap(identity, devices=["cpu"] * 2)
            variants["2 replicas, on workers"] = lambda v=value, m=mapped: on_workers(m, v)
        for fn in variants.values():  # each gives the whole input back
            same_tree(fn(), value)
        if not isinstance(value, dict):
            variants["thread start+join"] = lambda v=value: thread_start_join(identity, v)
        times = interleaved(variants, calls=calls, rounds=args.rounds)
        for name, seconds in times.items():
            row = {"input": label, "variant": name, "us_per_call": seconds * 1e6}
            row["over_direct_us"] = (seconds - times["direct"]) * 1e6
            if "bare chunk+cat (2)" in times and name == "2 replicas":
                row["ratio_to_bare"] = seconds / times["bare chunk+cat (2)"]
                row["ratio_to_bare_split"] = seconds / times["bare split+cat (2)"]
            rows.append(row)
    rows += training_step_rows(args.rounds)
    rows += resident_step_rows(args.rounds)
    rows += data_parallel_rows(args.rounds)
    rows += host_bound_rows(args.rounds, {} if args.compile else None)
    print(
        table(
            rows,
            [
                "input",
                "variant",
                "us_per_call",
                "over_direct_us",
                "ratio_to_bare",
                "ratio_to_bare_split",
                "ratio_to_direct",
            ],
        )
    )
    write_json(args.json, {"benchmark": "dispatch", "rows": rows})


if __name__ == "__main__":
    main()
