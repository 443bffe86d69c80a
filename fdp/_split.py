"""Split rules: how a batch of ``size`` rows is cut into shards for ``n`` devices.

``"chunk"`` is ``torch.chunk``'s rule and therefore ``nn.DataParallel``'s: pieces of
``ceil(size / n)`` rows, the last one shorter, and fewer pieces than devices when the batch is
small (30 over 8 gives 4,4,4,4,4,4,4,2; 10 over 8 gives five pieces of 2).
``"balanced"`` gives shard sizes that differ by at most one and never an empty shard
(30 over 8 gives 4,4,4,4,4,4,3,3).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

__all__ = ["SplitRule", "SPLIT_RULES", "shard_sizes", "check_split", "equal_shapes_hint"]

SplitRule = Literal["chunk", "balanced"]
SPLIT_RULES: tuple[str, ...] = ("chunk", "balanced")


def check_split(split: object, *, what: str) -> SplitRule:
    if split not in SPLIT_RULES:
        raise ValueError(f"{what} must be one of {SPLIT_RULES}, got {split!r}")
    return split  # type: ignore[return-value]


@lru_cache(maxsize=4096)
def shard_sizes(size: int, n: int, split: SplitRule) -> tuple[int, ...]:
    """Shard sizes for ``size`` rows over ``n`` devices; as many entries as replicas that run.

    >>> shard_sizes(30, 8, "chunk")
    (4, 4, 4, 4, 4, 4, 4, 2)
    >>> shard_sizes(10, 8, "chunk")
    (2, 2, 2, 2, 2)
    >>> shard_sizes(30, 8, "balanced")
    (4, 4, 4, 4, 4, 4, 3, 3)
    """
    if size <= 0 or n <= 0:
        raise ValueError(f"cannot split {size} rows over {n} devices")
    if split == "chunk":
        piece = -(-size // n)  # ceil
        full, rest = divmod(size, piece)
        return (piece,) * full + ((rest,) if rest else ())
    replicas = min(n, size)
    base, extra = divmod(size, replicas)
    return (base + 1,) * extra + (base,) * (replicas - extra)


def equal_shapes_hint(
    *, reduction: bool, among: str = "shards (a batch that does not divide evenly over the replicas)"
) -> str:
    """What to do about per-replica (or per-process) values of different shapes given to a
    collective: mostly the work of uneven ``among``, which a reduction can fold away (a sum,
    weighted for means) and a gather cannot (padding, or a batch that divides evenly). The
    collective cannot tell which split rule cut the shards, so the hint names none: under
    ``split="balanced"`` too, 7 rows over 2 replicas are shards of 4 and 3."""
    if reduction:
        return (
            f"With uneven {among}, reduce per-replica values to equal shapes first "
            "(e.g. a sum, with fdp.pmean's weight= for means)."
        )
    return (
        f"With uneven {among}, pad per-replica values to one shape first, or give every replica "
        "as many rows (a batch that divides evenly)."
    )
