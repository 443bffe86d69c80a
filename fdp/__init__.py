"""fdp: data parallelism for PyTorch as a function transform.

The public API is re-exported here from private modules, one job each:

* :func:`pmap` (``_pmap``): the transform.
* :func:`scatter`, :func:`replicate` (``_scatter``), :func:`gather` (``_gather``),
  :func:`parallel_apply` (``_parallel_apply``): the ``nn.parallel`` primitives, pytree-generic
  and differentiable, on CPU and CUDA devices.
* :func:`psum`, :func:`pmean`, :func:`pmax`, :func:`pmin`, :func:`all_gather`,
  :func:`psum_scatter`, :func:`all_to_all`, :func:`ppermute`, :func:`axis_index`,
  :func:`axis_size` (``_collectives``): collectives inside mapped functions.
* :func:`functional_call` (``_functional_call``): a thread-safe ``torch.func.functional_call``.
* :func:`grad`, :func:`value_and_grad` (``_grad``): ``torch.func.grad``, by autograd where it can.
* :class:`SyncBatchNorm` (``_batch_norm``): batch normalization over the replicas of an axis.
"""

import torch

from ._version import __version__, check_torch

check_torch(torch.__version__)  # before anything reads torch's internals

from . import distributed, optim
from ._batch_norm import SyncBatchNorm
from ._collectives import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
)
from ._data_parallel import DataParallel
from ._functional_call import functional_call, stateful_call
from ._gather import gather
from ._grad import grad, value_and_grad
from ._parallel_apply import parallel_apply
from ._pmap import Pmapped, pmap
from ._random import fold_in, replica_seed, rng_checkpoint_context, rng_scope
from ._scatter import replicate, scatter
from ._state import PER_REPLICA, PerReplica, device_put_replicated, unreplicate
from ._tree import NAMESPACE

__all__ = [
    "__version__",
    "DataParallel",
    "NAMESPACE",
    "PER_REPLICA",
    "PerReplica",
    "Pmapped",
    "SyncBatchNorm",
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "device_put_replicated",
    "distributed",
    "fold_in",
    "functional_call",
    "gather",
    "grad",
    "optim",
    "parallel_apply",
    "pmap",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "replica_seed",
    "replicate",
    "rng_checkpoint_context",
    "rng_scope",
    "scatter",
    "stateful_call",
    "unreplicate",
    "value_and_grad",
]
