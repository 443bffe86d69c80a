"""Split rules: chunk follows torch.chunk for every size; balanced never leaves a shard empty."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fdp._split import shard_sizes


@given(size=st.integers(1, 300), n=st.integers(1, 16))
def test_chunk_is_torch_chunk(size: int, n: int) -> None:
    assert list(shard_sizes(size, n, "chunk")) == [c.shape[0] for c in torch.empty(size).chunk(n)]


@given(size=st.integers(1, 300), n=st.integers(1, 16))
def test_balanced_sizes_differ_by_at_most_one(size: int, n: int) -> None:
    sizes = shard_sizes(size, n, "balanced")
    assert sum(sizes) == size and len(sizes) == min(size, n)
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert list(sizes) == sorted(sizes, reverse=True)


@pytest.mark.parametrize("split", ["chunk", "balanced"])
@pytest.mark.parametrize(("size", "n"), [(0, 2), (-1, 2), (5, 0)])
def test_no_rows_or_no_devices_is_rejected(size: int, n: int, split: str) -> None:
    # A ValueError that says so, not a ZeroDivisionError from the arithmetic (torch.chunk too
    # refuses 0 chunks).
    with pytest.raises(ValueError, match=f"cannot split {size} rows over {n} devices"):
        shard_sizes(size, n, split)  # type: ignore[arg-type]
