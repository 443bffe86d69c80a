"""fdp.pmap: decorator forms, devices, in_axes, split rules, nested inputs, out_axes, modules."""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import pytest
import torch
from helpers import collect_when_workers_rest, cpus, opaque
from torch import nn

import fdp


def shard_rows(devices: list[str], batch: int, **options: Any) -> list[int]:
    """The rows each replica saw, as a list in replica order."""
    seen = fdp.pmap(lambda x: torch.tensor(x.shape[0]), devices=devices, **options)
    return seen(torch.zeros(batch, 3)).tolist()


# --- decorator forms ---------------------------------------------------------------------------


def test_bare_decorator_keeps_name_and_doc() -> None:
    @fdp.pmap
    def double(x):
        """Doubles."""
        return 2 * x

    assert double.__name__ == "double"
    assert double.__doc__ == "Doubles."
    # The default devices: every GPU where there are GPUs, the output on the first.
    torch.testing.assert_close(double(torch.arange(4.0)).cpu(), 2 * torch.arange(4.0))


def test_decorator_with_options(devices: list[str]) -> None:
    @fdp.pmap(devices=devices, axis_name="batch")
    def double(x):
        return 2 * x

    x = torch.randn(10, 3)
    torch.testing.assert_close(double(x), 2 * x)


def test_method_decorator_binds_self() -> None:
    class Scaler:
        factor = 3.0

        @fdp.pmap(in_axes=(None, 0), devices=cpus(2))
        def scale(self, x):
            return self.factor * x

    torch.testing.assert_close(Scaler().scale(torch.ones(4)), torch.full((4,), 3.0))


@pytest.mark.parametrize("devices", [cpus(1), cpus(2)])
def test_a_method_whose_in_axes_leaves_out_the_instance_is_told_so(devices: list[str]) -> None:
    # in_axes describes every positional argument, the bound instance first (as in jax.pmap):
    # one entry per parameter after self was a bare prefix error, "(2 given)", with no word of
    # the instance.
    class Scaler:
        factor = 3.0

        @fdp.pmap(in_axes=({"x": 0},), devices=devices)
        def scale(self, batch):
            return self.factor * batch["x"]

    with pytest.raises(
        ValueError,
        match=re.escape(
            "fdp.pmap(test_a_method_whose_in_axes_leaves_out_the_instance_is_told_so.<locals>."
            "Scaler.scale) is a method: its instance is the first positional argument, which "
            "in_axes describes too, as in jax.pmap: in_axes=(None, {'x': 0}) gives every replica "
            "all of it"
        ),
    ):
        Scaler().scale({"x": torch.ones(4)})


def test_a_decorated_method_read_from_its_class_is_the_pmapped_function() -> None:
    class Scaler:
        factor = 3.0

        @fdp.pmap(in_axes=(None, 0), devices=cpus(2))
        def scale(self, x):
            return self.factor * x

    assert isinstance(Scaler.scale, fdp.Pmapped)  # not bound: the instance is passed by hand
    torch.testing.assert_close(Scaler.scale(Scaler(), torch.ones(4)), torch.full((4,), 3.0))


def test_classmethod_and_staticmethod_over_a_pmapped_function() -> None:
    # @classmethod over @fdp.pmap: the class is the first positional argument (bound by
    # Pmapped.__get__ under Python 3.11 and 3.12's classmethod, by classmethod itself since 3.13);
    # @staticmethod over it: nothing is bound, from the class or an instance.
    class Scaler:
        factor = 3.0

        @classmethod
        @fdp.pmap(in_axes=(None, 0), devices=cpus(2))
        def scale(cls, x):
            return cls.factor * x * torch.ones_like(x).sum()

        @staticmethod
        @fdp.pmap(devices=cpus(2))
        def double(x):
            return 2 * x * torch.ones_like(x).sum()

    class Bigger(Scaler):
        factor = 5.0

    x = torch.ones(4)
    # Every replica got 2 of the 4 rows (the sum), and the class it was read from.
    for read in (Scaler, Scaler()):
        torch.testing.assert_close(read.scale(x), torch.full((4,), 6.0))
        torch.testing.assert_close(read.double(x), torch.full((4,), 4.0))
    for read in (Bigger, Bigger()):
        torch.testing.assert_close(read.scale(x), torch.full((4,), 10.0))


def test_a_pmapped_module_kept_as_a_class_attribute_binds_no_instance() -> None:
    # As the module itself would be (nn.Module has no __get__): called as it is, from the class
    # or an instance. Bound like a function, it took the instance for its params.
    model = nn.Linear(3, 2)
    params = dict(model.named_parameters())

    class Trainer:
        net = fdp.pmap(model, devices=cpus(2))

    x = torch.randn(4, 3)
    for read in (Trainer, Trainer()):
        torch.testing.assert_close(read.net(params, x), model(x))


def test_not_callable_is_type_error() -> None:
    with pytest.raises(TypeError, match="fn must be callable"):
        fdp.pmap(3)  # type: ignore[call-overload]


def test_an_option_passed_positionally_says_the_options_are_keyword_only() -> None:
    # @fdp.pmap(0), for in_axes=0 (torch.vmap's in_dims is positional there): 0 lands in fn.
    with pytest.raises(TypeError) as info:
        fdp.pmap(0, devices=cpus(2))  # type: ignore[call-overload]
    message = str(info.value)
    assert message.startswith("fdp.pmap: fn must be callable, got int: 0. "), message
    assert "other than axis_name are keyword-only" in message and "@fdp.pmap(in_axes=0, ...)" in message


def test_the_axis_name_may_come_second_positionally_as_in_jax() -> None:
    # jax.pmap(fun, axis_name=None, *, in_axes=0, ...): pmap(f, "i") was "takes from 0 to 1
    # positional arguments but 2 were given" here.
    def center(x):
        return x - fdp.pmean(x.mean(), "i")

    x = torch.arange(6.0)
    expected = x - x.mean()
    spellings = {
        "positional": fdp.pmap(center, "i", devices=cpus(2)),
        "keyword": fdp.pmap(center, axis_name="i", devices=cpus(2)),
        "decorator": fdp.pmap(axis_name="i", devices=cpus(2))(center),
        # JAX's decorator with an axis name: @functools.partial(jax.pmap, axis_name="i").
        "partial": functools.partial(fdp.pmap, axis_name="i", devices=cpus(2))(center),
        "decorator, positional": fdp.pmap(None, "i", devices=cpus(2))(center),
    }
    for spelling, f in spellings.items():
        assert f.axis_name == "i", spelling
        torch.testing.assert_close(f(x), expected, msg=spelling)
    model = nn.Linear(2, 2)
    pm = fdp.pmap(model, "i", devices=cpus(2))
    assert pm.axis_name == "i"
    torch.testing.assert_close(pm(dict(model.named_parameters()), torch.ones(4, 2)), model(torch.ones(4, 2)))
    assert fdp.pmap(center).axis_name is None  # still optional


@pytest.mark.parametrize("spelling", ["call", "decorator", "partial"])
def test_an_axis_name_where_the_function_belongs_says_where_it_goes(spelling: str) -> None:
    # @fdp.pmap("i"), or partial(fdp.pmap, "i"): the name lands in fn, where "options are
    # keyword-only" (the old advice) would now be wrong.
    with pytest.raises(TypeError) as info:
        if spelling == "call":
            fdp.pmap("i")  # type: ignore[call-overload]
        elif spelling == "decorator":

            @fdp.pmap("i")  # type: ignore[call-overload, untyped-decorator]
            def f(x):
                return x
        else:
            functools.partial(fdp.pmap, "i")(lambda x: x)
    assert str(info.value) == (
        "fdp.pmap: fn must be callable, got str: 'i'. fdp.pmap takes the function first and the "
        "axis name second, as jax.pmap does: fdp.pmap(f, 'i'); as a decorator, "
        "@fdp.pmap(axis_name='i') (or @functools.partial(fdp.pmap, axis_name='i'))"
    )


@pytest.mark.parametrize(
    ("axis_name", "in_axes"),
    [((0, None), "(0, None)"), ([None, 0], "(None, 0)"), ((0, (None, 1)), "(0, (None, 1))")],
)
def test_in_axes_passed_where_the_axis_name_goes_is_refused(axis_name: Any, in_axes: str) -> None:
    # fdp.pmap(f, (0, None)), torch.vmap's habit (in_dims second): taken as a name, in_axes would
    # stay 0 and split the argument meant to go whole to every replica.
    with pytest.raises(TypeError) as info:
        fdp.pmap(lambda x, w: x @ w, axis_name, devices=cpus(2))
    assert str(info.value).startswith(
        f"fdp.pmap(test_in_axes_passed_where_the_axis_name_goes_is_refused.<locals>.<lambda>): "
        f"axis_name is {axis_name!r}, which reads as an in_axes specification: fdp.pmap's second "
        f"argument is the axis name, as jax.pmap's is (torch.vmap's is in_dims). Pass "
        f"in_axes={in_axes} by keyword"
    ), str(info.value)
    with pytest.raises(TypeError, match=r"^fdp.pmap: axis_name is "):  # the decorator form
        fdp.pmap(None, axis_name)
    # Names that are no such specification stay names (jax.pmap takes any hashable).
    for name in (0, ("layer", 1), ()):
        f = fdp.pmap(lambda x, name=name: x * 0 + fdp.axis_index(name), name, devices=cpus(2))
        assert f(torch.ones(2)).tolist() == [0.0, 1.0]


@pytest.mark.parametrize(
    ("option", "advice"),
    [
        ("static_broadcasted_argnums", "fdp.pmap's is static_argnums"),
        ("donate_argnums", "fdp.pmean(grads, 'i', donate=True)"),
        ("axis_size", "fdp.axis_size(axis_name)"),
        ("backend", "devices=['cuda:0', 'cuda:1']"),
        ("global_arg_shapes", "no shapes"),
        ("in_dims", "fdp.pmap's is in_axes"),
        ("out_dims", "fdp.pmap's is out_axes"),
        ("device_ids", "fdp.pmap's is devices"),
        ("dim", "in_axes and joins along out_axes"),
    ],
)
def test_another_librarys_option_says_what_fdp_pmap_takes(option: str, advice: str) -> None:
    # Python's "pmap() got an unexpected keyword argument" named the option, not fdp's spelling.
    for build in (lambda: fdp.pmap(torch.neg, **{option: 1}), lambda: fdp.pmap(**{option: 1})):
        with pytest.raises(
            TypeError, match=rf"^fdp.pmap got an unexpected keyword argument '{option}' \("
        ) as info:
            build()
        assert advice in str(info.value), str(info.value)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'typo'"):  # others: Python's error
        fdp.pmap(torch.neg, typo=1)  # type: ignore[call-overload]


# --- devices -----------------------------------------------------------------------------------


def test_default_devices_without_cuda_is_one_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: the default is every GPU")
    f = fdp.pmap(lambda x: x)
    assert f.devices == (torch.device("cpu"),)
    assert f.output_device == torch.device("cpu")


def test_device_spellings() -> None:
    f = fdp.pmap(lambda x: x, devices=["cpu", torch.device("cpu"), "cpu:0"])
    assert f.devices == (torch.device("cpu"),) * 3


@pytest.mark.parametrize(
    ("devices", "error", "match"),
    [
        (["gpu"], ValueError, r"devices\[0\] is not a device: 'gpu'"),
        (["cpu", "mps"], ValueError, r"devices\[1\]: fdp runs on cpu and cuda devices"),
        ([], ValueError, "at least one device"),
        ("cpu", TypeError, r"must be a sequence of devices, got 'cpu'; write \['cpu'\] for a single device$"),
        # jax.pmap's count of devices: an int names a GPU here, so both readings are spelled out.
        (
            2,
            TypeError,
            r"must be a sequence of devices, got 2; write \[2\] for the single device cuda:2, or a list "
            r"of one device per replica for 2 replicas, e.g. \['cpu', 'cpu'\]$",
        ),
        # The examples' --devices spellings (cpu,cpu and 'cpu*8') in code: ['cpu*2'] was the advice,
        # which is no device either.
        (
            "cpu*2",
            TypeError,
            r"got 'cpu\*2'; write \['cpu'\] \* 2 for the devices that 'cpu\*2' names on the examples' "
            r"command line$",
        ),
        (
            "cpu*2,cuda:1",
            TypeError,
            r"; write \['cpu', 'cpu', 'cuda:1'\] for the devices that 'cpu\*2,cuda:1'",
        ),
        ("cpu,cpu", TypeError, r"; write \['cpu', 'cpu'\] for the devices that 'cpu,cpu' names"),
        # Many, as a sum of lists: written out, 'cpu*10**11,cpu' was a list the error never built.
        ("cpu*16,cuda:1", TypeError, r"; write \['cpu'\] \* 16 \+ \['cuda:1'\] for the devices that"),
        (
            "gpu,gpu",
            TypeError,
            r"got 'gpu,gpu'; write a list of devices, one per replica, e.g. \['cpu', 'cpu'\] or "
            r"\['cuda:0', 'cuda:1'\]$",
        ),
        (
            ["cpu", "cpu*4"],
            ValueError,
            r"devices\[1\] is not a device: 'cpu\*4' \(.*\); a list names one device per replica: for "
            r"'cpu\*4', \['cpu'\] \* 4$",
        ),
        (["cpu*x"], ValueError, r"devices\[0\] is not a device: 'cpu\*x' \([^)]*\)$"),
        ([1.5], TypeError, r"devices\[0\] must be an int, str or torch.device, got float: 1\.5$"),
        # An int subclass, named as one: "got True" alone read as if True were refused as an int.
        ([True], TypeError, r"devices\[0\] must be an int, str or torch.device, got bool: True$"),
        ([-1], ValueError, "non-negative CUDA index"),
    ],
)
def test_bad_devices_fail_when_built(devices: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        fdp.pmap(lambda x: x, devices=devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
@pytest.mark.parametrize("device", [0, "cuda:1", torch.device("cuda")])
def test_cuda_device_without_cuda_fails_at_first_call(device: Any) -> None:
    f = fdp.pmap(lambda x: x, devices=["cpu", device])  # building does not touch CUDA
    with pytest.raises(ValueError, match=r"devices\[1\] is 'cuda.*CUDA is not available") as info:
        f(torch.zeros(2))
    # GPU code (nn.DataParallel's device_ids=[0, 1]) on a machine without one: the message says
    # how to run the same replicas on the CPU, where it said only that CUDA was missing.
    assert str(info.value).endswith(
        "to run the replicas on the CPU, name it once per replica: ['cpu', 'cpu'] runs two"
    ), str(info.value)
    if torch.version.cuda is None and torch.version.hip is None:
        assert f"(this torch, {torch.__version__}, is built without CUDA)" in str(info.value)
    with pytest.raises(ValueError, match=r"device_ids\[0\] is 'cuda:0', but CUDA .*: to run the replicas on"):
        fdp.DataParallel(torch.nn.Linear(2, 2), device_ids=[0, 1])
    with pytest.raises(
        ValueError, match=r"output_device is 'cuda:0', but CUDA .*: name the CPU, 'cpu', instead$"
    ):
        fdp.pmap(lambda x: x, devices=["cpu"], output_device=0)(torch.zeros(2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_missing_from_a_rocm_build_is_a_missing_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # A ROCm build has no CUDA version, but runs its AMD GPUs as torch.cuda's devices: without
    # one, the GPU is missing, not the build's support ("built without CUDA" was said).
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    with pytest.raises(ValueError, match=r"CUDA is not available on this machine \(no GPU or driver found\)"):
        fdp.pmap(lambda x: x, devices=["cpu", 0])(torch.zeros(2))


def test_output_device_cpu_and_bad_output_device() -> None:
    f = fdp.pmap(lambda x: x + 1, devices=cpus(2), output_device="cpu")
    torch.testing.assert_close(f(torch.zeros(3)), torch.ones(3))
    with pytest.raises(ValueError, match="output_device is not a device"):
        fdp.pmap(lambda x: x, output_device="tpu")


# --- split rules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "n", "expected"),
    [
        (30, 2, [15, 15]),
        (30, 8, [4, 4, 4, 4, 4, 4, 4, 2]),
        (10, 8, [2, 2, 2, 2, 2]),
        (3, 8, [1, 1, 1]),
        (36, 7, [6, 6, 6, 6, 6, 6]),
        (1, 3, [1]),
        (7, 1, [7]),
    ],
)
def test_chunk_split_follows_torch_chunk(batch: int, n: int, expected: list[int]) -> None:
    assert shard_rows(cpus(n), batch) == expected
    assert expected == [c.shape[0] for c in torch.zeros(batch).chunk(n)]


@pytest.mark.parametrize(
    ("batch", "n", "expected"),
    [
        (30, 8, [4, 4, 4, 4, 4, 4, 3, 3]),
        (10, 8, [2, 2, 1, 1, 1, 1, 1, 1]),
        (3, 8, [1, 1, 1]),
        (36, 7, [6, 5, 5, 5, 5, 5, 5]),
    ],
)
def test_balanced_split(batch: int, n: int, expected: list[int]) -> None:
    assert shard_rows(cpus(n), batch, split="balanced") == expected


def test_bad_split_rule() -> None:
    with pytest.raises(ValueError, match=r"split must be one of \('chunk', 'balanced'\)"):
        fdp.pmap(lambda x: x, split="even")  # type: ignore[call-overload]


@pytest.mark.usefixtures("on_workers")
def test_replicas_run_only_as_many_as_shards() -> None:
    seen: list[tuple[int, str]] = []
    lock = threading.Lock()

    def record(x):
        with lock:
            seen.append((x.shape[0], threading.current_thread().name))
        return x

    fdp.pmap(record, devices=cpus(8))(torch.zeros(10))
    assert sorted(rows for rows, _ in seen) == [2] * 5
    assert len({name for _, name in seen}) == 5


# --- in_axes -----------------------------------------------------------------------------------


def test_in_axes_int_negative_and_none(devices: list[str]) -> None:
    x = torch.randn(3, 10)
    w = torch.randn(3)

    @fdp.pmap(in_axes=(-1, None), out_axes=-1, devices=devices)
    def scale(x, w):
        assert w.shape == (3,)
        return x * w[:, None]

    torch.testing.assert_close(scale(x, w), x * w[:, None])


def test_in_axes_nested_prefix(devices: list[str]) -> None:
    batch = {"x": torch.randn(6, 2), "table": torch.randn(4, 2)}

    @fdp.pmap(in_axes=({"x": 0, "table": None},), devices=devices)
    def lookup(b):
        assert b["table"].shape == (4, 2)
        return b["x"] @ b["table"].T

    torch.testing.assert_close(lookup(batch), batch["x"] @ batch["table"].T)


def test_in_axes_longer_than_the_positional_arguments_names_the_keyword_arguments() -> None:
    # A jax.pmap habit too: in_axes covers the positional arguments only, so an argument it
    # describes, passed by keyword, leaves the tuple too long. The message says why.
    f = fdp.pmap(lambda x, w: x @ w, in_axes=(0, None), devices=cpus(2))
    with pytest.raises(
        ValueError,
        match=r"(?s)tree prefix of the tuple of positional arguments \(1 given\).*"
        r"Keyword arguments \['w'\] are not covered by in_axes \(they are mapped along dim 0\)",
    ):
        f(torch.ones(4, 2), w=torch.ones(2, 2))
    torch.testing.assert_close(f(torch.ones(4, 2), torch.ones(2, 2)), torch.full((4, 2), 2.0))


def test_in_axes_list_is_read_as_tuple() -> None:
    f = fdp.pmap(lambda x, w: x * w, in_axes=[0, None], devices=cpus(2))
    torch.testing.assert_close(f(torch.ones(4), torch.tensor(2.0)), torch.full((4,), 2.0))


def test_kwargs_are_split_along_dim_0(devices: list[str]) -> None:
    @fdp.pmap(in_axes=None, devices=devices)
    def f(w, *, x, y):
        return x * w + y

    x, y, w = torch.randn(9, 2), torch.randn(9, 2), torch.randn(2)
    torch.testing.assert_close(f(w, x=x, y=y), x * w + y)


def test_non_tensor_leaves_reach_every_replica_unchanged(devices: list[str]) -> None:
    marker = object()
    seen: list[Any] = []
    lock = threading.Lock()

    def f(x, options, name=None, count=0):
        with lock:
            seen.append((options["obj"], options["flag"], name, count))
        return x

    fdp.pmap(f, devices=devices)(torch.zeros(8), {"obj": marker, "flag": None}, name="run", count=3)
    assert all(
        obj is marker and flag is None and name == "run" and count == 3 for obj, flag, name, count in seen
    )


def test_args_and_kwargs_scatter_as_one_tree() -> None:
    # nn.DataParallel builds 8 replicas here, 5 of them with no positional args (TypeError).
    @fdp.pmap(devices=cpus(8))
    def f(x, *, scale, tag):
        assert tag == "t"
        return x * scale

    torch.testing.assert_close(f(torch.ones(3, 2), scale=2.0, tag="t"), torch.full((3, 2), 2.0))


def test_tensor_kwarg_aligned_with_positional() -> None:
    # nn.DataParallel fails an assertion for a batch-8 arg and a batch-3 kwarg; fdp says why.
    f = fdp.pmap(lambda x, y=None: x, devices=cpus(8))
    with pytest.raises(ValueError, match=r"axis 0 of kwargs\['y'\] of type float32\[3\]"):
        f(torch.zeros(8), y=torch.zeros(3))


# --- torch's nested tensors --------------------------------------------------------------------


def strided_nested() -> torch.Tensor:
    """A nested tensor of torch's strided layout, which has no shape (its prototype warning
    silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.arange(3.0), torch.arange(2.0)])


def jagged_nested() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.arange(3.0), torch.arange(2.0)], layout=torch.jagged)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize(
    ("make", "what"),
    [
        (strided_nested, r"a nested tensor \(type float32\[nested tensor of 2 components\]\)"),
        (jagged_nested, r"a nested tensor \(type float32\[2,j\d+\]\)"),
        (lambda: torch.eye(2).to_sparse(), r"a tensor of layout torch.sparse_coo \(type float32\[2,2\]\)"),
    ],
    ids=["nested", "jagged", "sparse"],
)
def test_an_unsplittable_tensor_is_refused_under_an_int_axis_and_passes_whole_under_none(
    n: int, make: Callable[[], torch.Tensor], what: str
) -> None:
    # Every path read a strided nested tensor's shape, which it has none of: "Internal error:
    # NestedTensorImpl doesn't support sizes. Please file an issue.", naming neither the call
    # nor the argument, alone or beside a dense tensor, as an input or as one replica's output.
    # A jagged or sparse one ran whole on one device, and failed on several: refused alike.
    value = make()
    message = f"is {what}, which fdp cannot split"
    for _ in range(3):  # plans are cached per input structure
        with pytest.raises(TypeError, match=r"args\[0\] " + message + " along axis 0"):
            fdp.pmap(lambda s: s, devices=cpus(n))(value)
        with pytest.raises(TypeError, match=r"args\[1\] " + message + " along axis 0"):
            fdp.pmap(lambda x, s: x, devices=cpus(n))(torch.zeros(4), value)
        with pytest.raises(TypeError, match=r"tree\['s'\] " + message):
            fdp.scatter({"x": torch.zeros(4), "s": value}, cpus(n))
        with pytest.raises(TypeError, match=r"tree\[0\] " + message):
            fdp.scatter([value], cpus(n))
        whole = fdp.pmap(
            lambda x, s: (x, s.to_padded_tensor(-1.0) if s.is_nested else s.to_dense()),
            in_axes=(0, None),
            devices=cpus(n),
        )
        x, padded = whole(torch.zeros(n), value)
        expected = value.to_padded_tensor(-1.0) if value.is_nested else value.to_dense()
        assert torch.equal(padded, expected.repeat(n, 1))
        if n == 1:  # on one device the output is the replica's own
            out = fdp.pmap(lambda x, s: s, in_axes=(0, None), devices=cpus(n))(torch.zeros(1), value)
            assert out is value


# --- nested inputs -----------------------------------------------------------------------------


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    name: str = "batch"


@dataclasses.dataclass(frozen=True)
class Frozen:
    inner: Batch
    weights: list


class Registered:
    """A container registered with optree by its user, in fdp's namespace."""

    def __init__(self, a, b):
        self.a, self.b = a, b


optree.register_pytree_node(
    Registered, lambda r: ((r.a,), r.b, ("a",)), lambda b, a: Registered(*a, b), namespace=fdp.NAMESPACE
)


def nested_input(batch: int) -> Any:
    return {
        "od": collections.OrderedDict(z=torch.randn(batch), a=torch.randn(batch, 2)),
        "list": [torch.randn(batch, 3), (torch.randn(batch), None)],
        "pair": Pair(torch.randn(batch), torch.randn(batch, 1)),
        "dc": Batch(torch.randn(batch, 2), torch.randn(batch), name="b"),
        "frozen": Frozen(Batch(torch.randn(batch), torch.randn(batch)), [torch.randn(batch), 7]),
        "reg": Registered(torch.randn(batch), "meta"),
        "text": "hello",
    }


def test_nested_inputs_are_split_and_types_kept(devices: list[str]) -> None:
    tree = nested_input(11)
    shapes: list[int] = []
    lock = threading.Lock()

    def identity(t):
        assert isinstance(t["od"], collections.OrderedDict) and list(t["od"]) == ["z", "a"]
        assert isinstance(t["pair"], Pair) and isinstance(t["dc"], Batch) and t["dc"].name == "b"
        assert isinstance(t["frozen"], Frozen) and isinstance(t["frozen"].inner, Batch)
        assert isinstance(t["reg"], Registered) and t["reg"].b == "meta"
        with lock:
            shapes.append(t["dc"].x.shape[0])
        assert t["dc"].y.shape[0] == t["frozen"].inner.x.shape[0] == t["dc"].x.shape[0]
        return t

    out = fdp.pmap(identity, devices=devices)(tree)
    assert sum(shapes) == 11 and len(shapes) == len(torch.zeros(11).chunk(len(devices)))
    assert isinstance(out["dc"], Batch) and isinstance(out["pair"], Pair)
    assert isinstance(out["reg"], Registered) and out["reg"].b == "meta"
    assert out["list"][1][1] is None and out["text"] == "hello"
    torch.testing.assert_close(out["dc"].x, tree["dc"].x)
    torch.testing.assert_close(out["frozen"].weights[0], tree["frozen"].weights[0])
    torch.testing.assert_close(out["reg"].a, tree["reg"].a)
    torch.testing.assert_close(out["od"]["a"], tree["od"]["a"])


def test_dataclasses_nested_in_a_dataclass_never_seen_before_are_split_on_the_first_call() -> None:
    """Dataclasses met for the first time, one inside another, are all containers from the
    first call: the innermost one's tensors are split, not handed whole to every replica."""

    @dataclasses.dataclass
    class Inner:
        x: torch.Tensor

    @dataclasses.dataclass
    class Middle:
        inner: Inner

    @dataclasses.dataclass
    class Outer:
        middle: Middle
        y: torch.Tensor

    rows: list[tuple[int, int]] = []
    lock = threading.Lock()

    def f(o: Outer) -> torch.Tensor:
        with lock:
            rows.append((o.middle.inner.x.shape[0], o.y.shape[0]))
        return o.middle.inner.x + o.y

    out = fdp.pmap(f, devices=cpus(2))(Outer(Middle(Inner(torch.arange(4.0))), torch.ones(4)))
    assert sorted(rows) == [(2, 2), (2, 2)]
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_dataclass_defined_inside_the_step_warns_once_it_has_been_made_many_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each call makes a new class, and each one stays registered with optree for good: memory
    # grew call after call, silently.
    from fdp import _tree

    monkeypatch.setattr(_tree, "REDEFINITIONS_WARNED_AT", 5)
    double = fdp.pmap(lambda batch: batch.x * 2, devices=cpus(2))

    def step() -> torch.Tensor:
        @dataclasses.dataclass
        class MadeEveryStep:
            x: torch.Tensor

        return double(MadeEveryStep(torch.arange(4.0)))

    for _ in range(4):
        assert step().tolist() == [0.0, 2.0, 4.0, 6.0]
    with pytest.warns(
        RuntimeWarning, match=r"fdp has registered 5 distinct dataclasses named '.*MadeEveryStep'"
    ) as caught:
        assert step().tolist() == [0.0, 2.0, 4.0, 6.0]
    assert "Define the dataclass once, at module level" in str(caught[0].message)
    # It names the user's line that made the call, not fdp's (where nothing can be changed).
    assert caught[0].filename == __file__
    step()  # once only


def test_a_dict_subclass_is_split_once_registered_and_passes_whole_without_tensors() -> None:
    # Unregistered and holding tensors, it is refused (tests/test_bad_input.py): optree takes it
    # for a leaf, which every replica would get whole.
    class Batch(dict):  # type: ignore[type-arg]
        pass

    rows = fdp.pmap(lambda d, x: x * d["scale"] if isinstance(d, dict) else x, devices=cpus(2))
    options = Batch(scale=2, name="run")  # no tensors: every replica gets it, as any object
    assert rows(options, torch.arange(4.0)).tolist() == [0.0, 2.0, 4.0, 6.0]
    assert rows(torch.Size([4]), torch.arange(4.0)).tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(TypeError, match=r"\.Batch holding tensors"):
        rows(Batch(x=torch.arange(4.0)), torch.arange(4.0))
    with pytest.raises(TypeError, match=r"a UserList holding tensors"):
        rows(collections.UserList([torch.arange(4.0)]), torch.arange(4.0))
    config = collections.ChainMap({"x": torch.arange(4.0)})  # a Mapping, not a container optree knows
    assert rows(config, torch.arange(4.0)).tolist() == [0.0, 1.0, 2.0, 3.0]  # passed as any object
    optree.register_pytree_node(
        Batch,
        lambda d: (tuple(d.values()), tuple(d), tuple(d)),
        lambda keys, values: Batch(zip(keys, values)),
        namespace=fdp.NAMESPACE,
    )
    try:
        seen: list[int] = []
        split = fdp.pmap(lambda d: seen.append(len(d["x"])) or d["x"] * 2, devices=cpus(2))
        assert split(Batch(x=torch.arange(4.0))).tolist() == [0.0, 2.0, 4.0, 6.0]
        assert seen == [2, 2]
    finally:
        optree.unregister_pytree_node(Batch, namespace=fdp.NAMESPACE)


def test_dataclass_with_non_init_field_is_rebuilt_by_post_init() -> None:
    @dataclasses.dataclass
    class WithDerived:
        x: torch.Tensor
        rows: int = dataclasses.field(init=False)

        def __post_init__(self):
            self.rows = self.x.shape[0]

    out = fdp.pmap(lambda d: torch.tensor(d.rows), devices=cpus(2))(WithDerived(torch.zeros(5)))
    assert out.tolist() == [3, 2]


class FirstOfTwo(nn.Module):
    def forward(self, x: torch.Tensor, extra: object) -> torch.Tensor:
        return x


def test_a_tensor_in_a_non_init_field_is_recomputed_or_refused_never_dropped() -> None:
    @dataclasses.dataclass
    class Derived:
        x: torch.Tensor
        mask: torch.Tensor = dataclasses.field(init=False)

        def __post_init__(self):
            self.mask = self.x > 0  # recomputed for each replica's rows

    out = fdp.pmap(lambda d: d.mask.sum(0, keepdim=True), devices=cpus(2))(
        Derived(torch.tensor([1.0, -1, 2]))
    )
    assert out.tolist() == [1, 1]

    @dataclasses.dataclass
    class Late:
        x: torch.Tensor
        weight: torch.Tensor | None = dataclasses.field(init=False, default=None)

    batch = Late(torch.arange(4.0))
    batch.weight = torch.ones(4)  # set after construction: Late(x=...) would not set it again
    for axis in (0, None):  # rebuilt for each replica, whole or split
        f = fdp.pmap(lambda b, y: b.x.sum() * b.weight.sum() * y, in_axes=(axis, 0), devices=cpus(2))
        # Named by the call and the argument's key path (it named neither).
        with pytest.raises(
            ValueError,
            match=r"^fdp\.pmap\(\S*<lambda>\): args\[0\]: fdp cannot rebuild the dataclass .*Late: its field "
            r"'weight' \(init=False\) holds a tensor, but .*sets it to None",
        ):
            f(batch, torch.ones(4))
    # Refused on one replica too (which gets the object itself): alike on any device count.
    with pytest.raises(
        ValueError, match=r"^fdp\.pmap\(\S*<lambda>\): kwargs\['b'\]\['k'\]\[1\]: fdp cannot rebuild"
    ):
        fdp.pmap(lambda x, b: x, devices=cpus(1))(torch.ones(4), b={"k": [0, batch]})
    # The first of several: looking for its path flattened the others, which raised, unsaid.
    other = Late(torch.zeros(4))
    other.weight = torch.ones(4)
    with pytest.raises(ValueError, match=r"^fdp\.pmap\(\S*<lambda>\): args\[0\]\[1\]: fdp cannot rebuild"):
        fdp.pmap(lambda bs: bs[0], devices=cpus(2))([torch.ones(4), batch, other])
    # And where replicas return one, or pass one to a collective; the other calls that take trees.
    with pytest.raises(ValueError, match=r"^fdp\.pmap\(\S*<lambda>\): output\[1\]: fdp cannot rebuild"):
        fdp.pmap(lambda x: (x, batch), devices=cpus(2))(torch.ones(4))
    with pytest.raises(ValueError, match=r"^fdp\.psum: x\['b'\]: fdp cannot rebuild"):
        fdp.pmap(lambda x: fdp.psum({"b": batch}, "i")["b"].x, "i", devices=cpus(2))(torch.ones(4))
    with pytest.raises(ValueError, match=r"^fdp\.psum_scatter: x\['b'\]: fdp cannot rebuild"):  # (cut apart)
        fdp.pmap(lambda x: fdp.psum_scatter({"b": batch}, "i", tiled=True), "i", devices=cpus(2))(
            torch.ones(4)
        )
    with pytest.raises(ValueError, match=r"^fdp\.DataParallel: inputs\[1\]: fdp cannot rebuild"):
        fdp.DataParallel(FirstOfTwo(), device_ids=cpus(2))(torch.ones(4), batch)

    class ReturnsIt(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Late]:
            return x, batch

    # The module's own output path, not that of the (output, state) that its replicas return.
    for n in (1, 2):
        with pytest.raises(ValueError, match=r"^fdp\.DataParallel: output\[1\]: fdp cannot rebuild"):
            fdp.DataParallel(ReturnsIt(), device_ids=cpus(n))(torch.ones(4))
    for call, name in (
        (fdp.device_put_replicated, "device_put_replicated"),
        (fdp.scatter, "scatter"),
        (fdp.replicate, "replicate"),
    ):
        with pytest.raises(ValueError, match=rf"^fdp\.{name}: tree\['b'\]: fdp cannot rebuild"):
            call({"b": batch}, cpus(2))
    with pytest.raises(ValueError, match=r"^fdp\.distributed\.shard_batch: batch\['b'\]: fdp cannot rebuild"):
        fdp.distributed.shard_batch({"b": batch})


def test_tensors_in_a_container_in_a_non_init_field_are_recomputed_or_refused_never_dropped() -> None:
    # A dict of tensors set after construction: rebuilt for each replica, the field held its
    # default {} again, and the replicas ran without the tensors, silently (one replica, given
    # the object itself, had them).
    @dataclasses.dataclass
    class Tagged:
        x: torch.Tensor
        extra: dict = dataclasses.field(init=False, default_factory=dict)

    batch = Tagged(torch.ones(4, 2))
    batch.extra["offset"] = torch.full((4, 2), 10.0)
    for n in (1, 2):
        with pytest.raises(
            ValueError,
            match=r"cannot rebuild the dataclass .*Tagged: its field 'extra' \(init=False\) holds "
            r"tensors \(in a dict\), but .*sets it to \{\}",
        ):
            fdp.pmap(lambda b: b.x + b.extra.get("offset", 0), devices=cpus(n))(batch)

    # One that __post_init__ computes from the init fields is recomputed for each replica's rows.
    @dataclasses.dataclass
    class Derived:
        x: torch.Tensor
        parts: list = dataclasses.field(init=False)

        def __post_init__(self):
            self.parts = [self.x > 0, self.x * 2]

    out = fdp.pmap(lambda d: d.parts[0].sum(0, keepdim=True) + d.parts[1][:1], devices=cpus(2))(
        Derived(torch.tensor([1.0, -1, 2]))
    )
    assert out.tolist() == [3, 5]


def test_a_dataclass_with_a_computed_non_init_field_serves_as_an_axes_prefix() -> None:
    # The prefix's late field holds no tensor (0 != 0 is False) and the argument's does: the
    # structures must still match.
    @dataclasses.dataclass
    class Batch:
        tokens: torch.Tensor
        labels: torch.Tensor
        mask: torch.Tensor = dataclasses.field(init=False)

        def __post_init__(self):
            self.mask = self.tokens != 0

    def loss(b: Batch, scale: torch.Tensor) -> torch.Tensor:
        return (b.mask.sum(1) * b.labels * scale)[:, None]

    batch = Batch(torch.tensor([[0, 1, 2], [3, 0, 0], [1, 1, 1], [0, 0, 2]]), torch.arange(4.0))
    f = fdp.pmap(loss, in_axes=(Batch(tokens=0, labels=0), None), devices=cpus(2))
    torch.testing.assert_close(f(batch, torch.tensor(0.5)), loss(batch, torch.tensor(0.5)))


@pytest.mark.parametrize("n", [1, 2])
def test_a_module_written_as_a_dataclass_is_a_leaf_not_rebuilt(n: int) -> None:
    built: list[int] = []

    @dataclasses.dataclass(eq=False)
    class Scaled(nn.Module):
        width: int = 3

        def __post_init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(self.width, 1)  # new random weights when rebuilt
            built.append(self.width)

    module = Scaled()
    x = torch.randn(4, 3)
    out = fdp.pmap(lambda m, x: m.fc(x), in_axes=(None, 0), devices=cpus(n))(module, x)
    torch.testing.assert_close(out, module.fc(x))
    assert built == [3]


@fdp.pmap(devices=cpus(2))
def doubled(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


def test_a_decorated_function_pickles_by_name_as_functions_do() -> None:
    import pickle

    assert pickle.loads(pickle.dumps(doubled)) is doubled
    torch.testing.assert_close(doubled(torch.ones(4)), torch.full((4,), 2.0))


@pytest.mark.parametrize("n", [1, 2])
def test_copies_and_pickles_take_the_configuration_not_what_calls_learned(n: int) -> None:
    import copy
    import pickle

    mapped = fdp.pmap(torch.neg, in_axes=0, devices=cpus(n))
    x = torch.randn(4, 3)
    mapped(x)  # caches, a lone replica's runner and timings, some holding locks
    for twin in (copy.deepcopy(mapped), pickle.loads(pickle.dumps(mapped))):
        torch.testing.assert_close(twin(x), -x)
        assert twin._inputs is not mapped._inputs
    compiled = fdp.pmap(torch.neg, devices=cpus(n), compile=True)
    assert copy.deepcopy(compiled)._compiled is not compiled._compiled  # compiled afresh


def test_a_pmapped_module_copies_and_pickles_with_a_copy_of_its_module() -> None:
    # A module has no qualified name to pickle by (a decorated function does): it is copied.
    import copy
    import pickle

    model = nn.Linear(3, 2)
    mapped = fdp.pmap(model, devices=cpus(2))
    x = torch.randn(4, 3)
    for twin in (copy.deepcopy(mapped), pickle.loads(pickle.dumps(mapped))):
        assert isinstance(twin.fn, nn.Linear) and twin.fn is not model
        torch.testing.assert_close(twin({}, x), model(x))


def test_copies_and_pickles_keep_unmapped_axes_unmapped() -> None:
    # None in a specification is held as one marker object that fdp compares by identity: a
    # copy must get that very object back, not a lookalike that reads as a mapped axis.
    import copy
    import pickle

    mapped = fdp.pmap(torch.mul, in_axes=(0, None), devices=cpus(2))
    x, w = torch.randn(4, 3), torch.randn(3)
    for twin in (copy.deepcopy(mapped), pickle.loads(pickle.dumps(mapped))):
        torch.testing.assert_close(twin(x, w), x * w)
        assert repr(twin) == repr(mapped)


def test_dataclass_without_init_is_a_clear_error() -> None:
    @dataclasses.dataclass(init=False)
    class NoInit:
        x: torch.Tensor

    value = NoInit()
    value.x = torch.zeros(4)
    with pytest.raises(
        TypeError, match=r"args\[0\]: fdp cannot split the dataclass .*NoInit.*no generated __init__"
    ):
        fdp.pmap(lambda d: d.x, devices=cpus(2))(value)


class OwnNamespace:
    """Registered by its user in their own optree namespace: fdp adopts the registration."""

    def __init__(self, values, tag):
        self.values, self.tag = values, tag


optree.register_pytree_node(
    OwnNamespace,
    lambda o: ((o.values,), o.tag, ("values",)),
    lambda tag, children: OwnNamespace(children[0], tag),
    namespace="a-user-library",
)


def test_types_registered_in_other_namespaces_are_split() -> None:
    out = fdp.pmap(lambda o: OwnNamespace(o.values * 2, o.tag + "!"), devices=cpus(2))(
        OwnNamespace(torch.arange(5.0), "t")
    )
    assert isinstance(out, OwnNamespace) and out.tag == "t!"
    torch.testing.assert_close(out.values, torch.arange(5.0) * 2)


def test_type_registered_in_two_namespaces_is_ambiguous() -> None:
    class Twice:
        def __init__(self, x):
            self.x = x

    for namespace in ("lib-a", "lib-b"):
        optree.register_pytree_node(
            Twice, lambda t: ((t.x,), None), lambda _, c: Twice(*c), namespace=namespace
        )
    # Named by the call and the key path where it was found (it named neither).
    with pytest.raises(
        TypeError,
        match=r"^fdp\.pmap\(\S*<lambda>\): args\[0\]\['t'\]: \S*Twice is registered with optree in several "
        r"namespaces \['lib-a', 'lib-b'\]",
    ):
        fdp.pmap(lambda t: t["t"].x, devices=cpus(2))({"t": Twice(torch.zeros(4))})


def test_user_namespace_registration_still_possible_after_fdp_saw_the_class() -> None:
    @dataclasses.dataclass
    class Point:
        x: torch.Tensor

    fdp.pmap(lambda p: p.x, devices=cpus(2))(Point(torch.zeros(4)))
    optree.dataclasses.register_node(Point, namespace="user-namespace")


# --- out_axes and outputs ----------------------------------------------------------------------


def test_out_axes_int_none_and_prefix(devices: list[str]) -> None:
    x = torch.randn(12, 3)

    @fdp.pmap(in_axes=(0, None), out_axes=(1, None), devices=devices)
    def f(x, w):
        return x.T, w * 2

    transposed, doubled = f(x, torch.ones(2))
    torch.testing.assert_close(transposed, x.T)
    torch.testing.assert_close(doubled, torch.full((2,), 2.0))


def test_zero_dim_outputs_are_stacked_one_per_replica(devices: list[str]) -> None:
    for out_axes in (0, -1):  # the stacked vector's one dim
        f = fdp.pmap(lambda x: x.sum(), devices=devices, out_axes=out_axes)
        x = torch.arange(10.0)
        expected = torch.stack([c.sum() for c in x.chunk(len(devices))])
        torch.testing.assert_close(f(x), expected)


def test_output_containers_are_kept(devices: list[str]) -> None:
    def f(x):
        return {
            "pair": Pair(x, x + 1),
            "dc": Batch(x, x * 2, name="out"),
            "od": collections.OrderedDict(b=x, a=x),
            "list": [x, None],
            "name": "same",
            "count": 3,
        }

    x = torch.randn(9)
    out = fdp.pmap(f, devices=devices)(x)
    assert isinstance(out["pair"], Pair) and isinstance(out["dc"], Batch) and out["dc"].name == "out"
    assert list(out["od"]) == ["b", "a"] and out["list"][1] is None
    assert out["name"] == "same" and out["count"] == 3
    torch.testing.assert_close(out["dc"].y, x * 2)


def test_an_object_holding_tensors_is_refused_only_where_replicas_return_their_own() -> None:
    # Several replicas' Categoricals cannot be joined (docs/errors.md). One replica's comes back
    # as it is (the whole batch's), and refusing it there would refuse a shared object too,
    # which several replicas return once: nothing tells the two apart on one replica.
    def policy(logits):
        return torch.distributions.Categorical(logits=logits)

    logits = torch.randn(4, 3)
    own = fdp.pmap(policy, devices=cpus(1))(logits)
    assert isinstance(own, torch.distributions.Categorical) and own.logits.shape == (4, 3)
    with pytest.raises(TypeError, match=r"the replicas returned a Categorical holding tensors"):
        fdp.pmap(policy, devices=cpus(2))(logits)
    prior = torch.distributions.Categorical(logits=torch.zeros(3))
    for n in (1, 2):
        actions, shared = fdp.pmap(lambda x: (x.argmax(1), prior), devices=cpus(n))(logits)
        assert shared is prior and actions.shape == (4,)


def test_string_output_is_not_corrupted() -> None:
    # nn.DataParallel returns "<map object at 0x...>" here.
    assert fdp.pmap(lambda x: "done", devices=cpus(3))(torch.zeros(6)) == "done"


def test_different_non_tensor_outputs_are_an_error() -> None:
    f = fdp.pmap(lambda x: {"rows": x.shape[0]}, devices=cpus(8))
    with pytest.raises(
        ValueError,
        match=r"different non-tensor values at output\['rows'\]: "
        r"replica 0 returned 4 but replica 7 returned 2",
    ):
        f(torch.zeros(30))


def test_output_structure_mismatch_is_an_error() -> None:
    f = fdp.pmap(lambda x: [x] * x.shape[0], devices=cpus(2))
    with pytest.raises(ValueError, match="outputs of different structure"):
        f(torch.zeros(3))


def test_out_axes_not_a_prefix_is_an_error() -> None:
    f = fdp.pmap(lambda x: (x, x), out_axes=(0, 0, 0), devices=cpus(2))
    with pytest.raises(ValueError, match=r"out_axes specification must be a tree prefix of the output"):
        f(torch.zeros(4))


def test_out_axes_beyond_rank_is_an_error() -> None:
    f = fdp.pmap(lambda x: x, out_axes=2, devices=cpus(2))
    with pytest.raises(ValueError, match=r"cannot concatenate output along out_axes 2") as info:
        f(torch.zeros(4, 3))
    # The dims that exist, for a jax.pmap habit (a new device axis) that out_axes does not have.
    assert "it inserts no new axis, unlike jax.pmap's): a dim in [-2, 1] fits" in str(info.value)


def test_out_axes_past_the_stacked_dim_of_a_zero_dim_output_is_an_error(devices: list[str]) -> None:
    # out_axes=5 (or 1) on a 0-dim output stacked it along 0, silently, where out_axes=1 on a
    # vector is an error; on one replica as on several.
    x = torch.ones(4, 6)
    for out_axes in (5, 1, -2):
        f = fdp.pmap(lambda x: {"loss": x.sum(), "y": x}, out_axes=out_axes, devices=devices)
        with pytest.raises(ValueError) as info:
            f(x)
        kinds = ", ".join(["float32[]"] * len(x.chunk(len(devices))))  # one per replica that ran
        assert str(info.value) == (
            f"fdp.pmap(test_out_axes_past_the_stacked_dim_of_a_zero_dim_output_is_an_error.<locals>."
            f"<lambda>): cannot stack output['loss'] along out_axes {out_axes}: the replicas returned "
            f"{kinds}; 0-dim outputs are stacked into a new vector with one entry per replica, and "
            f"out_axes names a dim of it: a dim in [-1, 0] fits (where the other outputs need out_axes "
            f"{out_axes}, give this one its own entry in an out_axes tree prefix)"
        )
    # What the message advises: the 0-dim output's own entry in a tree prefix.
    f = fdp.pmap(
        lambda x: {"loss": x.sum(), "y": x}, in_axes=1, out_axes={"loss": 0, "y": 1}, devices=devices
    )
    out = f(x)
    torch.testing.assert_close(out["y"], x)
    torch.testing.assert_close(out["loss"], torch.stack([c.sum() for c in x.chunk(len(devices), 1)]))


def test_unmapped_output_comes_from_the_output_device_replica() -> None:
    f = fdp.pmap(lambda x: x[:1], out_axes=None, devices=cpus(3))
    torch.testing.assert_close(f(torch.arange(6.0)), torch.tensor([0.0]))


def test_check_unmapped_outputs() -> None:
    x = torch.arange(6.0)
    agree = fdp.pmap(lambda x: x.sum() * 0, out_axes=None, devices=cpus(3), check_unmapped_outputs=True)
    torch.testing.assert_close(agree(x), torch.tensor(0.0))
    disagree = fdp.pmap(lambda x: x.sum(), out_axes=None, devices=cpus(3), check_unmapped_outputs=True)
    with pytest.raises(ValueError, match="out_axes is None for output, but the replicas disagree"):
        disagree(x)
    unchecked = fdp.pmap(lambda x: x.sum(), out_axes=None, devices=cpus(3))
    torch.testing.assert_close(unchecked(x), torch.tensor(1.0))


@pytest.mark.parametrize(
    ("f", "says"),
    [
        # 0-dim: both values
        (
            lambda x: x.sum(),
            r"replica 0 returned float32\[\] \(the value returned\) but replica 1 returned "
            r"float32\[\]: 1\.0 vs 5\.0",
        ),
        # same shape: where they differ first, and both values there
        (
            lambda x: torch.stack([x[0] * 0, x[1]]),
            r"replica 0 returned float32\[2\] \(the value returned\) but "
            r"replica 1 returned float32\[2\], which differ first at \[1\]: 1\.0 vs 3\.0",
        ),
        # another shape: both shapes
        (
            lambda x: x[: 2 - fdp.axis_index("i")],
            r"replica 0 returned float32\[2\] \(the value returned\) but "
            r"replica 1 returned float32\[1\]$",
        ),
    ],
    ids=["0-dim", "values", "shapes"],
)
def test_check_unmapped_outputs_message_names_both_values(f: Any, says: str) -> None:
    # The message named replica 1's type alone ("differs from replica 0's"): neither what was
    # returned nor where the two disagree.
    disagree = fdp.pmap(f, "i", out_axes=None, devices=cpus(3), check_unmapped_outputs=True)
    with pytest.raises(ValueError, match=r"out_axes is None for output, but the replicas disagree: " + says):
        disagree(torch.arange(6.0))


# --- modules -----------------------------------------------------------------------------------


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x, *, scale=1.0):
        assert len(list(self.parameters())) == 4  # not empty inside forward
        return self.fc2(torch.relu(self.fc1(x))) * scale


def test_module_gets_params_whole_and_in_axes_for_the_rest(devices: list[str]) -> None:
    model = TwoLayer()
    params = dict(model.named_parameters())
    x = torch.randn(13, 4)
    out = fdp.pmap(model, devices=devices)(params, x, scale=0.5)
    torch.testing.assert_close(out, model(x, scale=0.5))
    new = {k: torch.zeros_like(v) for k, v in params.items()}
    torch.testing.assert_close(fdp.pmap(model, devices=devices)(new, x), torch.zeros(13, 2))


def test_module_in_axes_and_static_argnums_index_forward_arguments() -> None:
    class Mix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x, bias, mode):
            assert bias.shape == (3,) and mode == "add"
            return x * self.w + bias

    model = Mix()
    f = fdp.pmap(model, in_axes=(0, None, None), static_argnums=(2,), devices=cpus(2))
    out = f(dict(model.named_parameters()), torch.ones(4, 3), torch.ones(3), "add")
    torch.testing.assert_close(out, torch.full((4, 3), 2.0))


def test_module_without_params_argument_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"takes the module's parameters and buffers as its first argument"):
        fdp.pmap(TwoLayer(), devices=cpus(2))()


def test_module_called_with_the_batch_in_place_of_params_is_a_clear_error() -> None:
    # An nn.DataParallel habit, pmapped(x): the batch lands in params and nothing is mapped.
    with pytest.raises(
        TypeError, match=r"takes the module's parameters and buffers as its first argument"
    ) as info:
        fdp.pmap(TwoLayer(), devices=cpus(2))(torch.ones(4, 3))
    assert "got a tensor" in str(info.value) and "pmapped_model({}, x)" in str(info.value)


@pytest.mark.parametrize(
    ("params", "got"),
    [
        ("module", r"the module itself \(TwoLayer\)"),
        ("other module", r"a module \(Linear\)"),
        (None, "NoneType: None"),
        ("names", r"str: 'names'"),
    ],
)
def test_module_called_with_params_that_are_no_dict_is_a_clear_error(params: Any, got: str) -> None:
    # pmapped(model, x) and the like reached torch.func.functional_call in every replica, which
    # said "Expected parameter_and_buffer_dicts to be a dict ..." naming neither call nor argument.
    model = TwoLayer()
    given = {"module": model, "other module": nn.Linear(1, 1)}.get(params, params)
    with pytest.raises(TypeError) as info:
        fdp.pmap(model, devices=cpus(2))(given, torch.ones(4, 4))
    message = str(info.value)
    assert re.match(
        r"fdp\.pmap\(TwoLayer\) takes the module's parameters and buffers as its first argument "
        rf"\(params, a dict of tensors by name\), but got {got} there: ",
        message,
    ), message
    assert "dict(model.named_parameters())" in message


def test_module_takes_a_sequence_of_dicts_as_params_as_torch_func_does() -> None:
    model = TwoLayer()
    params = dict(model.named_parameters())
    out = fdp.pmap(model, devices=cpus(2))((params, {}), torch.ones(4, 4))
    torch.testing.assert_close(out, model(torch.ones(4, 4)))


def test_module_sees_eval_after_first_call() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.9))
    params = dict(model.named_parameters())
    f = fdp.pmap(model, devices=cpus(2))
    x = torch.ones(8, 3)
    f(params, x)
    model.eval()
    torch.testing.assert_close(f(params, x), model(x))


# --- static arguments --------------------------------------------------------------------------


def test_static_argnums_pass_unchanged() -> None:
    seen: list[Any] = []
    lock = threading.Lock()
    big = torch.zeros(5)

    def f(x, table, mode):
        with lock:
            seen.append((table, mode))
        return x

    g = fdp.pmap(f, static_argnums=(1, -1), devices=cpus(2))
    g(torch.zeros(4), big, "fast")
    assert all(t is big and m == "fast" for t, m in seen) and len(seen) == 2


@pytest.mark.parametrize("static_argnums", [(1, 2), (-2, -1)])
def test_in_axes_may_stop_before_trailing_static_arguments(static_argnums: tuple[int, ...]) -> None:
    # As in jax.pmap, which reads in_axes[i] for the non-static arguments i only: a tuple
    # without entries for the static arguments after the last mapped one was refused.
    def f(x, k, mode):
        assert mode == "scale"
        return x * k

    g = fdp.pmap(f, in_axes=(0,), static_argnums=static_argnums, devices=cpus(2))
    torch.testing.assert_close(g(torch.arange(4.0), 3, "scale"), torch.arange(4.0) * 3)
    # A static argument between mapped ones still needs its entry (jax.pmap's too).
    h = fdp.pmap(lambda x, k, y: x * k + y, in_axes=(0, 0), static_argnums=1, devices=cpus(2))
    with pytest.raises(ValueError, match=r"in_axes has an entry for every positional argument"):
        h(torch.zeros(4), 3, torch.zeros(4))


def test_unhashable_static_argument_is_a_type_error() -> None:
    f = fdp.pmap(lambda x, opts: x, static_argnums=1, devices=cpus(2))
    with pytest.raises(TypeError, match=r"static arguments must be hashable.*args\[1\] of type list"):
        f(torch.zeros(2), [1, 2])


@pytest.mark.parametrize("module", [False, True])
def test_static_argument_not_given_positionally_is_a_value_error(module: bool) -> None:
    # As in jax.pmap. Taken as a keyword argument, a static tensor would be split along dim 0
    # over the replicas, silently; left to its default, it would not be static.
    default = torch.ones(4)

    def f(x, table=default):
        return x + table.sum()

    class Add(nn.Module):
        def forward(self, x, table=default):
            return f(x, table)

    mapped = fdp.pmap(Add() if module else f, static_argnums=1, devices=cpus(2))
    head = ({},) if module else ()
    for kwargs in ({"table": torch.ones(4)}, {}):
        with pytest.raises(
            ValueError,
            match=r"has static_argnums=\(1,\), but entry 1 names no positional argument: this call "
            r"passes only 1 positional argument.*Pass static arguments positionally",
        ):
            mapped(*head, torch.zeros(4), **kwargs)
    with pytest.raises(
        ValueError, match=r"entry -3 names no positional argument.*only 2 positional arguments"
    ):
        fdp.pmap(f, static_argnums=-3, devices=cpus(2))(torch.zeros(4), torch.ones(4))
    torch.testing.assert_close(mapped(*head, torch.zeros(4), torch.ones(4)), torch.full((4,), 4.0))


def test_static_argnums_must_be_ints() -> None:
    with pytest.raises(
        TypeError,
        match=r"^fdp\.pmap\(.*<lambda>\): static_argnums must be an int or a sequence of ints, "
        r"got tuple: \('x',\)$",
    ):
        fdp.pmap(lambda x: x, static_argnums=("x",))  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "got"), [(None, "NoneType: None"), (1.0, "float: 1.0")])
def test_static_argnums_that_is_not_iterable_is_named(value: Any, got: str) -> None:
    # tuple(None) said only "'NoneType' object is not iterable", naming neither call nor option.
    with pytest.raises(
        TypeError,
        match=rf"^fdp\.pmap\(.*<lambda>\): static_argnums must be an int or a sequence of ints, got {got}$",
    ):
        fdp.pmap(lambda x: x, static_argnums=value)


# --- replicated inputs -------------------------------------------------------------------------


def test_replicated_tensor_is_shared_on_one_device() -> None:
    w = torch.randn(3)
    seen: list[torch.Tensor] = []
    lock = threading.Lock()

    def f(x, w):
        with lock:
            seen.append(w)
        return x

    fdp.pmap(f, in_axes=(0, None), devices=cpus(3))(torch.zeros(6), w)
    assert len(seen) == 3 and all(s is w for s in seen)


def test_in_place_update_of_a_replicated_input_is_an_error() -> None:
    buffer = torch.zeros(3)
    f = fdp.pmap(lambda x, b: b.add_(1) * x.sum(), in_axes=(0, None), out_axes=None, devices=cpus(2))
    with pytest.raises(RuntimeError, match=r"modified args\[1\] in place.*replicated"):
        f(torch.ones(4), buffer)
    # One replica is one device: the same update as a direct call.
    one = fdp.pmap(lambda x, b: b.add_(1) * x.sum(), in_axes=(0, None), out_axes=None, devices=cpus(1))
    one(torch.ones(4), torch.zeros(3))


def test_in_place_update_of_a_shard_is_not_blamed_on_a_replicated_view_of_the_same_tensor() -> None:
    # Views of one tensor share its version counter: the mapped shard's update bumps the
    # replicated slice's too, which the replicas did not touch.
    data = torch.ones(4, 3)

    def g(x, row):
        x.add_(1)
        return x.sum(1) + row.sum()

    out = fdp.pmap(g, in_axes=(0, None), devices=cpus(2))(data[:, :2], data[0, 2:])
    torch.testing.assert_close(out, torch.full((4,), 5.0))
    torch.testing.assert_close(data[:, :2], torch.full((4, 2), 2.0))
    # A replicated view of another tensor than the shards' is still checked, and so is one that
    # shares memory with the shards (a shard's update changes it under the replicas too).
    other = torch.zeros(2, 3)
    f = fdp.pmap(lambda x, b: b.add_(1) * x.sum(), in_axes=(0, None), out_axes=None, devices=cpus(2))
    with pytest.raises(RuntimeError, match=r"modified args\[1\] in place.*replicated"):
        f(data[:, :2], other[0])

    def normalise(q, k):
        k.div_(k.norm(dim=1, keepdim=True))
        return q.sum(1) + k.sum()

    x = torch.full((4, 2), 3.0)
    for replicated in (x, x[:, 1:]):
        with pytest.raises(RuntimeError, match=r"modified args\[1\] in place.*replicated"):
            fdp.pmap(normalise, in_axes=(0, None), devices=cpus(2))(x, replicated)


def test_in_place_update_of_a_mapped_input_writes_through(devices: list[str]) -> None:
    x = torch.zeros(7)
    fdp.pmap(lambda x: x.add_(1), devices=devices)(x)
    torch.testing.assert_close(x, torch.ones(7))


# --- regressions from review -------------------------------------------------------------------


def test_callable_object_attributes_do_not_shadow_pmap_settings() -> None:
    class Scaled:
        def __init__(self) -> None:
            self.fn = torch.sin  # same names as pmap's own attributes
            self.split = "whatever"
            self.k = 3.0

        def __call__(self, x):
            return self.k * self.fn(x)

    f = fdp.pmap(Scaled(), devices=cpus(2))
    x = torch.randn(4)
    torch.testing.assert_close(f(x), 3.0 * torch.sin(x))
    assert f.split == "chunk"


def test_module_parameters_and_buffers_not_given_are_replicated_inputs() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    x = torch.randn(8, 3)
    # Training mode: BatchNorm would update the module's own buffers from every replica at once.
    with pytest.raises(
        RuntimeError, match=r"modified params\['1\.(num_batches_tracked|running_mean|running_var)'\]"
    ):
        fdp.pmap(model, devices=cpus(2))(dict(model.named_parameters()), x)
    assert int(model[1].num_batches_tracked) <= 2
    model.eval()
    out = fdp.pmap(model, devices=cpus(2))({}, x)  # everything from the module
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    assert model[0].weight.grad is not None


def test_inference_mode_with_replicated_tensors() -> None:
    f = fdp.pmap(lambda x, w: x * w, in_axes=(0, None), devices=cpus(3))
    with torch.inference_mode():
        out = f(torch.ones(6), torch.full((), 2.0))
    torch.testing.assert_close(out, torch.full((6,), 2.0))


def test_out_axes_list_for_list_outputs() -> None:
    f = fdp.pmap(lambda x: [x, x.sum() * 0], out_axes=[0, None], devices=cpus(2))
    rows, zero = f(torch.ones(4))
    assert rows.shape == (4,) and zero.shape == ()


def test_type_registered_after_fdp_saw_it_as_a_leaf() -> None:
    class Late:
        def __init__(self, x):
            self.x = x

    value = Late(torch.zeros(4))
    with pytest.raises(ValueError, match="found no tensor to map"):
        fdp.pmap(lambda v: v.x, devices=cpus(2))(value)
    optree.register_pytree_node(Late, lambda v: ((v.x,), None), lambda _, c: Late(*c), namespace="late-lib")
    out = fdp.pmap(lambda v: torch.tensor(v.x.shape[0]), devices=cpus(2))(value)
    assert out.tolist() == [2, 2]


def test_dataclass_as_in_axes_prefix_before_any_instance_was_seen() -> None:
    @dataclasses.dataclass
    class Fresh:
        x: torch.Tensor
        table: torch.Tensor

    f = fdp.pmap(lambda b: b.x + b.table.sum(), in_axes=(Fresh(0, None),), devices=cpus(2))
    out = f(Fresh(torch.zeros(4), torch.ones(3)))
    torch.testing.assert_close(out, torch.full((4,), 3.0))


def test_unrebuildable_dataclass_passes_whole_unless_it_must_be_split() -> None:
    @dataclasses.dataclass(init=False)
    class Config:
        depth: int

    config = Config()
    config.depth = 3
    seen: list[Any] = []
    fdp.pmap(lambda x, c: x * c.depth if not seen.append(c) else x, devices=cpus(2))(torch.ones(4), config)
    assert all(c is config for c in seen)


def test_a_dataclass_with_an_init_var_passes_whole_unless_it_must_be_split() -> None:
    """A dataclass with an InitVar (not stored on the instance, so fdp cannot rebuild it from
    its fields) reaches every replica as it is under axis None, and under an int axis, holding a
    tensor, is refused with the reason."""

    @dataclasses.dataclass
    class Scaled:
        x: torch.Tensor
        factor: dataclasses.InitVar[float]

        def __post_init__(self, factor: float) -> None:
            self.x = self.x * factor

    scaled = Scaled(torch.ones(4), 2.0)
    seen: list[Any] = []
    out = fdp.pmap(lambda x, s: seen.append(s) or x * s.x.sum(), in_axes=(0, None), devices=cpus(2))(
        torch.ones(4), scaled
    )
    assert all(s is scaled for s in seen) and out.tolist() == [8.0] * 4
    with pytest.raises(TypeError, match=r"args\[0\]: fdp cannot split the dataclass .*Scaled: its InitVar"):
        fdp.pmap(lambda s: s.x, devices=cpus(2))(scaled)


# --- one replica: the arguments are handed over as they are ----------------------------------


def test_one_cpu_replica_gets_the_arguments_themselves() -> None:
    x, w = torch.randn(6, 3), torch.randn(3)
    kw = {"scale": torch.ones(6)}
    seen: list[Any] = []

    def f(x: torch.Tensor, w: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        seen.extend([x, w, scale])
        return x @ w * scale

    out = fdp.pmap(f, in_axes=(0, None), devices=cpus(1))(x, w, scale=kw["scale"])
    assert seen[0] is x and seen[1] is w and seen[2] is kw["scale"]  # no copy, no view
    torch.testing.assert_close(out, x @ w)


def test_one_cpu_replica_matches_the_direct_call_for_every_input_kind() -> None:
    """Negative and None axes, static arguments, nested trees, a module: one replica computes
    what the function computes, and returns the same containers."""
    net = nn.Linear(3, 2)
    params = dict(net.named_parameters())
    x = {"a": torch.randn(5, 3), "b": [torch.randn(3, 5), 2.5]}

    def f(p: dict[str, torch.Tensor], x: Any, mode: str) -> Any:
        y = torch.func.functional_call(net, p, (x["a"] + x["b"][0].T * x["b"][1],))
        return {"y": y, "mode": mode, "total": y.sum()}

    mapped = fdp.pmap(
        f,
        in_axes=(None, {"a": 0, "b": [-1, None]}, None),
        static_argnums=2,
        out_axes={"y": 0, "mode": None, "total": None},
        devices=cpus(1),
    )
    out, expected = mapped(params, x, "train"), f(params, x, "train")
    assert out["mode"] == "train"
    torch.testing.assert_close(out["y"], expected["y"])
    torch.testing.assert_close(out["total"], expected["total"])
    module_out = fdp.pmap(net, devices=cpus(1))(params, x["a"])
    torch.testing.assert_close(module_out, net(x["a"]))


@pytest.mark.parametrize(
    ("in_axes", "args", "error", "match"),
    [
        (0, (torch.zeros(4), torch.zeros(3)), ValueError, "inconsistent sizes"),
        (0, (torch.zeros(0, 2),), ValueError, "empty batch"),
        (0, (torch.tensor(1.0),), ValueError, "rank should be at least 1"),
        (2, (torch.zeros(4, 2),), ValueError, "rank should be at least 3"),
        (None, (torch.zeros(4),), ValueError, "found no tensor to map"),
        (0, (torch.zeros(4), opaque()), TypeError, r"args\[1\]: fdp cannot split the dataclass"),
    ],
    ids=["sizes", "empty", "scalar", "axis", "nothing mapped", "opaque dataclass"],
)
def test_one_cpu_replica_rejects_what_two_replicas_reject(
    in_axes: Any, args: tuple[Any, ...], error: type[BaseException], match: str
) -> None:
    messages = []
    for n in (1, 2):
        with pytest.raises(error, match=match) as info:
            fdp.pmap(lambda *a: a[0], in_axes=in_axes, devices=cpus(n))(*args)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_one_cpu_replica_runs_collectives_and_random_scopes() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return fdp.psum(x, "i") + fdp.axis_index("i") + torch.rand(()) * 0

    one = fdp.pmap(f, axis_name="i", devices=cpus(1))
    torch.testing.assert_close(one(torch.arange(3.0)), torch.arange(3.0))
    draw = fdp.pmap(lambda x: x + torch.rand(x.shape), devices=cpus(1))
    with fdp.rng_scope(3):
        first = draw(torch.zeros(4))
    with fdp.rng_scope(3):
        again = draw(torch.zeros(4))
    with fdp.rng_scope(fdp.fold_in(fdp.fold_in(3, 0), 0)):
        own = torch.rand(4)  # replica 0 of the first call in rng_scope(3)
    torch.testing.assert_close(first, again)
    torch.testing.assert_close(first, own)


def test_one_cpu_replica_failure_keeps_the_exception_object() -> None:
    class Boom(Exception):
        pass

    error = Boom("replica failed")

    def f(x: torch.Tensor) -> torch.Tensor:
        raise error

    with pytest.raises(Boom) as info:
        fdp.pmap(f, devices=cpus(1))(torch.zeros(2))
    assert info.value is error


def test_calls_that_change_the_argument_structure_are_flattened_anew() -> None:
    # Calls are flattened along the previous call's structure when they repeat it; a container
    # where the previous call had a tensor, or other keys, must be seen as such.
    f = fdp.pmap(lambda t: optree.tree_map(lambda x: x * 2, t, namespace="fdp"), devices=cpus(2))
    x = torch.arange(4.0)
    # Registering types with optree (torch registers its own on first use of some utilities)
    # makes fdp flatten anew anyway: the registry must be settled for this test to test anything.
    torch.testing.assert_close(x, x)
    torch.testing.assert_close(f(x), x * 2)
    nested = {"a": x, "b": x + 1}
    out = f(nested)
    torch.testing.assert_close(out["a"], x * 2)
    torch.testing.assert_close(out["b"], (x + 1) * 2)
    out = f({"b": x, "a": x + 1})  # same keys, another order
    torch.testing.assert_close(out["a"], (x + 1) * 2)
    torch.testing.assert_close(out["b"], x * 2)
    out = f({"a": x, "c": x})
    assert sorted(out) == ["a", "c"]


def test_a_type_registered_with_optree_between_calls_is_a_container_from_then_on() -> None:
    class Pair:
        def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
            self.first, self.second = first, second

    rows = fdp.pmap(lambda p: torch.tensor([p.first.shape[0], p.second.shape[0]]), devices=cpus(2))
    pair = Pair(torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match="found no tensor to map"):  # a leaf: nothing to split
        rows(pair)
    optree.register_pytree_node(
        Pair,  # type: ignore[arg-type]
        lambda p: ((p.first, p.second), None, None),
        lambda _, children: Pair(*children),
        namespace="fdp",
    )
    try:
        assert rows(pair).tolist() == [2, 2, 2, 2]  # now a container: both fields split
    finally:
        optree.unregister_pytree_node(Pair, namespace="fdp")  # type: ignore[arg-type]


@pytest.mark.parametrize("namespace", ["fdp", "a-tensor-library"])
def test_a_tensor_subclass_registered_as_a_node_is_a_container(namespace: str) -> None:
    # fdp tells optree that tensors are leaves (it flattens faster so), except where a tensor
    # type is registered as a node: then optree's registration decides, as it does without fdp.
    class Scaled(torch.Tensor):
        scale: float

    def scaled(values: torch.Tensor, scale: float) -> Scaled:
        out = values.as_subclass(Scaled)
        out.scale = scale
        return out

    # First a registry of the same size as it will have with Scaled, seen by a flatten: fdp
    # must tell registries apart by what they hold, not by their size.
    class Other:
        pass

    optree.register_pytree_node(Other, lambda o: ((), None), lambda *_: Other(), namespace="fdp")  # type: ignore[arg-type]
    fdp.scatter(torch.zeros(2), cpus(2))
    optree.unregister_pytree_node(Other, namespace="fdp")  # type: ignore[arg-type]
    optree.register_pytree_node(
        Scaled,  # type: ignore[arg-type]
        lambda s: ((s.as_subclass(torch.Tensor),), s.scale, None),
        lambda scale, children: scaled(children[0], scale),
        namespace=namespace,
    )
    try:
        seen: list[type] = []

        def f(s):
            seen.append(type(s))
            return scaled(s.as_subclass(torch.Tensor) * s.scale, s.scale)

        out = fdp.pmap(f, devices=cpus(2))(scaled(torch.arange(4.0), 3.0))
        assert type(out) is Scaled and out.scale == 3.0  # rebuilt from the joined child
        torch.testing.assert_close(out.as_subclass(torch.Tensor), torch.arange(4.0) * 3)
        assert seen == [Scaled, Scaled]
        assert fdp.scatter(scaled(torch.arange(4.0), 2.0), cpus(2))[1].scale == 2.0
    finally:
        optree.unregister_pytree_node(Scaled, namespace=namespace)  # type: ignore[arg-type]
        if namespace != "fdp":
            optree.unregister_pytree_node(Scaled, namespace="fdp")  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 2])
def test_plans_follow_the_structure_when_calls_switch(n: int) -> None:
    # Each structure's in and out plans are kept with the last structure seen: calls that
    # switch between structures must never get the other one's.
    f = fdp.pmap(
        lambda x, w: optree.tree_map(lambda t: t * w, x, namespace="fdp"), in_axes=(0, None), devices=cpus(n)
    )
    x, w = torch.arange(4.0), torch.full((4,), 3.0)
    pair = {"p": torch.ones(2, 4), "q": torch.arange(8.0).reshape(2, 4)}
    for _ in range(2):
        for _ in range(2):  # the second call repeats the structure: plans found with it
            torch.testing.assert_close(f(x[:, None].expand(4, 4), w), x[:, None] * w)
        for _ in range(2):
            out = f(pair, w)
            torch.testing.assert_close(out["p"], pair["p"] * w)
            torch.testing.assert_close(out["q"], pair["q"] * w)


@pytest.mark.parametrize("n", [1, 2])
def test_one_replicas_outputs_are_joined_as_several_replicas_outputs_are(n: int) -> None:
    # One replica's output is returned as it is only where joining one piece would change
    # nothing: a 0-dim tensor under an int axis still becomes a vector of one entry per replica.
    def f(x):
        return {"rows": x * 2, "total": x.sum(), "count": 3, "nothing": None}

    out = fdp.pmap(f, devices=cpus(n))(torch.arange(4.0))
    torch.testing.assert_close(out["rows"], torch.arange(4.0) * 2)
    assert out["total"].shape == (n,) and out["count"] == 3 and out["nothing"] is None
    unmapped = fdp.pmap(f, out_axes=None, devices=cpus(n))(torch.arange(4.0))
    assert unmapped["total"].shape == ()
    only_tensors = fdp.pmap(lambda x: (x, x.sum()), devices=cpus(n))(torch.arange(4.0))
    assert only_tensors[1].shape == (n,)


@pytest.mark.parametrize("n", [1, 2])
def test_dict_containers_are_each_calls_own_even_when_the_keys_repeat(n: int) -> None:
    # optree's flatten_up_to matches dict-likes by their keys alone: a structure kept from an
    # earlier call must not hand the replicas, or the caller, that call's dict types and orders.
    x = torch.arange(4.0)
    seen: list[tuple[type, list[str]]] = []

    def f(tree):
        seen.append((type(tree), list(tree)))
        return {"total": tree["a"].sum(), **tree}  # 0-dim: joined, so the output is rebuilt

    mapped = fdp.pmap(f, devices=cpus(n))
    calls = [
        {"a": x, "b": x},
        {"a": x, "b": x},
        {"b": x, "a": x},
        collections.OrderedDict(b=x, a=x),
        collections.defaultdict(list, a=x, b=x),
        collections.defaultdict(int, a=x, b=x),
    ]
    for tree in calls:
        seen.clear()
        out = mapped(tree)
        assert seen == [(type(tree), list(tree))] * n
        assert type(out) is dict and list(out) == ["total", *tree]
    keyed = fdp.pmap(lambda t: t, devices=cpus(n))
    for tree in calls:
        out = keyed(tree)
        assert type(out) is type(tree) and list(out) == list(tree)
        if isinstance(tree, collections.defaultdict):
            assert out.default_factory is tree.default_factory
    # A number among the arguments.
    for tree in [{"a": x, "n": 3}, {"a": x, "n": 3}, collections.OrderedDict(n=3, a=x)]:
        seen.clear()
        mapped(tree)
        assert seen == [(type(tree), list(tree))] * n


@pytest.mark.parametrize("n", [1, 2])
def test_deques_are_each_calls_own_even_when_their_length_repeats(n: int) -> None:
    """optree's flatten_up_to matches a deque by its length, not its maxlen: a deque of another
    maxlen than the last call's reaches the replicas, and comes back, with its own maxlen."""
    x = torch.arange(4.0)
    seen: list[int | None] = []

    def f(d: collections.deque) -> collections.deque:
        seen.append(d.maxlen)
        return d

    mapped = fdp.pmap(f, devices=cpus(n))
    for maxlen in (3, 3, 5, None):
        seen.clear()
        out = mapped(collections.deque([x, 2 * x], maxlen=maxlen))
        assert seen == [maxlen] * n
        assert type(out) is collections.deque and out.maxlen == maxlen
        torch.testing.assert_close(out[1], 2 * x)


@pytest.mark.parametrize("n", [1, 2])
def test_an_output_rebuilt_after_one_returned_as_it_is_keeps_its_own_key_order(n: int) -> None:
    # One replica's output is returned as it is where joining would change nothing, flattened
    # along the last call's structure up to dict key orders. When a later output of the same
    # keys must be rebuilt after all (0-dim leaves), it is rebuilt in its own order.
    def f(tree, reduce):
        return {k: v.sum() if reduce else v for k, v in tree.items()}

    mapped = fdp.pmap(f, static_argnums=1, devices=cpus(n))
    x = torch.arange(4.0)
    assert list(mapped({"a": x, "b": x}, False)) == ["a", "b"]
    out = mapped({"b": x, "a": 2 * x}, True)
    assert list(out) == ["b", "a"] and out["a"].sum() == 12 and out["b"].sum() == 6


def test_an_error_after_a_call_with_other_key_order_blames_each_size_on_its_own_key() -> None:
    # One replica flattens the arguments along the last call's structure where it can (an
    # OrderedDict is matched by its keys, its leaves then come in the last call's key order);
    # a call that needs the general scatter, here to report sizes that disagree, is flattened
    # again exactly, so that each size is named with its own key.
    f = fdp.pmap(lambda d: d["a"] + d["b"], devices=cpus(1))
    f(collections.OrderedDict(a=torch.ones(4), b=torch.ones(4)))
    with pytest.raises(ValueError, match="inconsistent sizes") as info:
        f(collections.OrderedDict(b=torch.ones(3), a=torch.ones(0)))
    assert "size 3: axis 0 of args[0]['b'] of type float32[3]" in str(info.value)
    assert "size 0: axis 0 of args[0]['a'] of type float32[0]" in str(info.value)


@pytest.mark.parametrize("n", [1, 2])
def test_axes_given_by_key_follow_the_keys_whatever_their_order(n: int) -> None:
    # optree.broadcast_prefix lists a dict prefix's axes in the prefix's key order; an
    # OrderedDict argument or output whose keys come in another order must still get each
    # key's own axis.
    a, b = torch.arange(4.0), torch.tensor([10.0, 20.0, 30.0, 40.0])
    expected = a + b.sum()
    by_dict = fdp.pmap(lambda d: d["a"] + d["b"].sum(), in_axes=({"a": 0, "b": None},), devices=cpus(n))
    torch.testing.assert_close(by_dict(collections.OrderedDict(b=b, a=a)), expected)  # fresh
    torch.testing.assert_close(by_dict({"a": a, "b": b}), expected)
    torch.testing.assert_close(by_dict(collections.OrderedDict(b=b, a=a)), expected)  # after a dict
    by_ordered = fdp.pmap(
        lambda d: d["a"] + d["b"].sum(), in_axes=(collections.OrderedDict(b=None, a=0),), devices=cpus(n)
    )
    torch.testing.assert_close(by_ordered({"a": a, "b": b}), expected)
    out = fdp.pmap(
        lambda x: collections.OrderedDict(b=x[:1] * 0 + x.shape[0], a=x),
        out_axes={"a": 0, "b": None},
        devices=cpus(n),
    )(a)
    torch.testing.assert_close(out["a"], a)  # joined along 0
    assert out["b"].tolist() == [4.0 / n]  # replica 0's value


@pytest.mark.parametrize("n", [1, 2])
def test_a_dataclass_with_a_tensor_in_a_non_node_field_can_be_passed_again_and_again(n: int) -> None:
    # Structures compare node data with ==: a tensor there cannot be compared, and such a
    # structure is never taken for another (no cached plan found by it, no flatten along it).
    @dataclasses.dataclass
    class Tagged:
        x: torch.Tensor
        tag: torch.Tensor = dataclasses.field(metadata={"pytree_node": False})

    double = fdp.pmap(lambda t: Tagged(t.x * 2, t.tag), devices=cpus(n))
    earlier = []
    for _ in range(3):
        tag = torch.tensor([1.0, 2.0])
        out = double(Tagged(torch.arange(4.0), tag))
        torch.testing.assert_close(out.x, torch.arange(4.0) * 2)
        assert out.tag is tag
        earlier.append(weakref.ref(tag))
    # Nor kept by the caches of plans (a tensor hashes by identity: one entry per call, each
    # holding its tag alive for good); only the last call's structure may hold its own.
    del tag, out
    collect_when_workers_rest()
    assert [ref() is None for ref in earlier[:-1]] == [True, True]


@pytest.mark.parametrize("n", [1, 2])
def test_plans_of_structures_that_never_repeat_are_not_kept_without_end(n: int) -> None:
    # A dict keyed by sample ids, or a step number in a dataclass's non-node field: a new
    # structure on every call, whose plans (in and out) were kept for as long as the program ran.
    f = fdp.pmap(lambda batch: batch, devices=cpus(n))
    x = torch.arange(4.0)
    for step in range(300):
        out = f({f"sample{step}": x})
        torch.testing.assert_close(out[f"sample{step}"], x)
    assert len(f._plans) <= 256 and len(f._out_plans) <= 256, (len(f._plans), len(f._out_plans))
    out = f({"sample0": x})  # the oldest, dropped: planned again
    torch.testing.assert_close(out["sample0"], x)


@pytest.mark.parametrize("n", [1, 2])
def test_a_dataclass_non_node_field_is_each_calls_own_even_when_equal_to_the_last(n: int) -> None:
    # optree's flatten_up_to compares node data with ==: a structure kept from the last call,
    # whose field held 2 (or 1, or an equal 0-dim tensor), matches a tree whose field holds
    # 2.0 (True, another tensor). Rebuilt from the kept structure, the replicas (and the
    # caller, for outputs) got the last call's value: int math where the caller passed a float.
    @dataclasses.dataclass
    class Scaled:
        x: torch.Tensor
        scale: Any = dataclasses.field(metadata={"pytree_node": False})

    seen: list[Any] = []

    def f(b: Scaled) -> Scaled:
        seen.append(b.scale)
        return Scaled(b.x * b.scale, b.scale)

    mapped = fdp.pmap(f, devices=cpus(n))
    x = torch.arange(4)
    for scale in (2, 2.0, True, 1, torch.tensor(1.0), torch.tensor(1)):
        seen.clear()
        out = mapped(Scaled(x, scale))
        assert all(s is scale for s in seen), (scale, seen)
        assert out.scale is scale, (scale, out.scale)
        assert out.x.dtype == (x * scale).dtype, (scale, out.x.dtype)


@pytest.mark.parametrize(
    ("first", "second", "match"),
    [
        (
            torch.zeros(4),
            torch.tensor(1.0),
            r"args\[1\] of type float32\[\] along axis 0, so its rank should be at least 1",
        ),
        (
            torch.zeros(3),
            torch.zeros(4, 2),
            r"inconsistent sizes .*axis 0 of args\[1\] of type float32\[4,2\]",
        ),
        (
            torch.zeros(4, 2),
            torch.zeros(0, 2),
            r"inconsistent sizes .*axis 0 of args\[1\] of type float32\[0,2\]",
        ),
    ],
)
def test_a_later_leaf_that_cannot_be_split_like_the_first_is_named(
    first: torch.Tensor, second: torch.Tensor, match: str
) -> None:
    # The all-CPU scatter sizes the shards by the first leaf and lets split_with_sizes check
    # the others; a leaf it refuses gets the general path's message.
    with pytest.raises(ValueError, match=f"(?s){match}"):
        fdp.pmap(lambda a, b: a, devices=cpus(2))(first, second)


@pytest.mark.parametrize("kind", ["class", "dataclass without __init__"])
def test_a_leaf_of_a_class_made_at_run_time_is_not_kept(kind: str) -> None:
    """A class made inside a function (a config built per run, with a tensor in a class
    attribute) whose instance a call gets whole: fdp remembers which types are leaves (and
    which dataclasses it cannot rebuild), but must not keep the class, and what it refers to,
    once the program has let it go."""

    def run() -> tuple[weakref.ref[type], weakref.ref[torch.Tensor]]:
        table = torch.randn(3)
        cls = type("Config", (), {"table": table})
        if kind != "class":
            cls = dataclasses.dataclass(init=False)(cls)
        config = cls()
        fdp.pmap(lambda c, x: x + c.table[0], in_axes=(None, 0), devices=cpus(2))(config, torch.ones(4))
        return weakref.ref(type(config)), weakref.ref(table)

    refs = run()
    collect_when_workers_rest()
    assert [r() for r in refs] == [None, None]


@dataclasses.dataclass
class _Masked:
    x: torch.Tensor
    mask: torch.Tensor = dataclasses.field(metadata={"pytree_node": False})


@pytest.mark.parametrize("n", [1, 2])
def test_a_tensor_in_a_non_node_field_is_not_kept_after_the_call(n: int) -> None:
    """A pmapped function remembers its last call's structures, whose node data holds a
    dataclass's non-node fields: a tensor there (of the arguments, or of a lone replica's
    output) must not stay alive with the function once the caller has let it go."""
    f = fdp.pmap(lambda b: _Masked(b.x * b.mask.sum(), b.mask), devices=cpus(n), out_axes=None)
    batch = _Masked(torch.ones(4, 3), torch.ones(5))
    out = f(batch)
    refs = [weakref.ref(batch.mask), weakref.ref(out.mask)]
    del batch, out
    collect_when_workers_rest()
    assert [r() for r in refs] == [None, None]
    assert f(_Masked(torch.ones(4, 3), torch.ones(2))).x[0, 0] == 2  # and calls still work
