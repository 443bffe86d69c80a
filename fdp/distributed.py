"""The same pmapped function across processes and nodes, on ``torch.distributed``.

Launch with ``torchrun`` and call :func:`initialize` once: every pmapped call with an
``axis_name`` then spans the replicas of every process (threads in each process x processes),
``fdp.axis_index``/``fdp.axis_size`` are global, and every collective combines all of them.
See ``docs/distributed.md``.

>>> import fdp
>>> fdp.distributed.world_size()
1
"""

from ._distributed import (
    RankFailed,
    broadcast,
    initialize,
    is_initialized,
    is_main_process,
    local_devices,
    rank,
    record_failure,
    shard_batch,
    shutdown,
    world_size,
)

__all__ = [
    "RankFailed",
    "broadcast",
    "initialize",
    "is_initialized",
    "is_main_process",
    "local_devices",
    "rank",
    "record_failure",
    "shard_batch",
    "shutdown",
    "world_size",
]
