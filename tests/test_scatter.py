"""fdp.scatter and fdp.replicate: pytree-generic, differentiable, on CPU devices."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import cpus

import fdp


@dataclasses.dataclass
class Example:
    image: torch.Tensor
    label: torch.Tensor
    source: str = "disk"


def test_scatter_splits_tensors_and_shares_the_rest(devices: list[str]) -> None:
    tree = {"batch": Example(torch.randn(10, 3), torch.arange(10)), "step": 4, "mask": None}
    shards = fdp.scatter(tree, devices)
    assert len(shards) == len(torch.zeros(10).chunk(len(devices)))
    assert [s["batch"].image.shape[0] for s in shards] == [
        c.shape[0] for c in torch.zeros(10).chunk(len(devices))
    ]
    assert all(s["step"] == 4 and s["mask"] is None and s["batch"].source == "disk" for s in shards)
    torch.testing.assert_close(torch.cat([s["batch"].label for s in shards]), tree["batch"].label)


def test_scatter_in_axes_and_balanced_split() -> None:
    tree = (torch.randn(4, 30), torch.randn(5))
    shards = fdp.scatter(tree, cpus(8), in_axes=(1, None), split="balanced")
    assert [s[0].shape[1] for s in shards] == [4, 4, 4, 4, 4, 4, 3, 3]
    assert all(s[1] is tree[1] for s in shards)


@pytest.mark.parametrize("tree_type", [list, tuple])
def test_scatter_takes_a_list_of_axes_for_a_list_or_a_tuple(tree_type: type) -> None:
    """A list of axes is read as a tuple for a tuple (pmap's arguments), as a list for a list."""
    x, w = torch.arange(4.0), torch.ones(3)
    shards = fdp.scatter(tree_type([x, w]), cpus(2), in_axes=[0, None])
    assert [type(s) for s in shards] == [tree_type, tree_type]
    assert [s[0].tolist() for s in shards] == [[0.0, 1.0], [2.0, 3.0]]
    assert all(s[1] is w for s in shards)


def test_a_shard_that_is_the_whole_tensor_is_the_tensor_itself_whatever_the_axis() -> None:
    """One replica that runs gets the tensor itself (no view of it), along any axis as along
    axis 0: onto one device, or a batch of one row over several."""
    x = torch.randn(3, 4)
    for axis in (0, 1, -1):
        [shard] = fdp.scatter(x, cpus(1), in_axes=axis)
        assert shard is x
    column = torch.randn(3, 1)
    [(shard, label)] = fdp.scatter((column, torch.zeros(1)), cpus(4), in_axes=(1, 0))
    assert shard is column


def test_scatter_is_differentiable() -> None:
    x = torch.randn(7, 2, requires_grad=True)
    shards = fdp.scatter(x, cpus(3))
    sum((i + 1) * s.sum() for i, s in enumerate(shards)).backward()
    torch.testing.assert_close(x.grad[:, 0], torch.tensor([1.0, 1, 1, 2, 2, 2, 3]))


def test_scatter_errors_name_the_tree_path() -> None:
    with pytest.raises(ValueError, match=r"axis 0 of tree\['b'\] of type float32\[3\]"):
        fdp.scatter({"a": torch.zeros(4), "b": torch.zeros(3)}, cpus(2))
    with pytest.raises(ValueError, match="found no tensor to map"):
        fdp.scatter({"a": 1}, cpus(2))
    with pytest.raises(ValueError, match="in_axes specification must be a tree prefix of the tree"):
        fdp.scatter((torch.zeros(2),), cpus(2), in_axes=(0, 0))


def test_a_sparse_tensor_under_a_mapped_axis_is_named_and_passes_whole_under_none() -> None:
    # torch.split refuses it deep inside ("Could not run 'aten::as_strided' with arguments from
    # the 'SparseCPU' backend ..."), naming neither the call nor the argument.
    sparse = torch.eye(4).to_sparse()
    f = fdp.pmap(lambda x, s: x + torch.sparse.sum(s), devices=cpus(2))
    with pytest.raises(TypeError) as info:
        f(torch.zeros(4), sparse)
    message = str(info.value)
    assert message.startswith(
        "fdp.pmap(test_a_sparse_tensor_under_a_mapped_axis_is_named_and_passes_whole_under_none."
        "<locals>.<lambda>): args[1] is a tensor of layout torch.sparse_coo (type float32[4,4]), "
        "which fdp cannot split along axis 0: to give every replica all of it, pass it positionally "
        "with axis None in in_axes (keyword arguments are always split), or convert it with "
        ".to_dense() to split it"
    ), message
    with pytest.raises(
        TypeError, match=r"^fdp\.scatter: tree\['s'\] is a tensor of layout torch\.sparse_coo"
    ):
        fdp.scatter({"x": torch.zeros(4), "s": sparse}, cpus(2))
    whole = fdp.pmap(lambda x, s: x + torch.sparse.sum(s), in_axes=(0, None), devices=cpus(2))
    torch.testing.assert_close(whole(torch.zeros(4), sparse), torch.full((4,), 4.0))


def test_replicate_gives_every_device_the_tree() -> None:
    params = {"w": torch.randn(3, requires_grad=True), "name": "layer"}
    copies = fdp.replicate(params, cpus(3))
    assert len(copies) == 3
    assert all(c["w"] is params["w"] and c["name"] == "layer" for c in copies)
    sum(c["w"].sum() for c in copies).backward()
    torch.testing.assert_close(params["w"].grad, torch.full((3,), 3.0))
