"""fdp: data parallelism for PyTorch as a function transform.

The public API is re-exported here from private modules, one job each:

* :func:`pmap` (``_pmap``): the transform.
* :func:`scatter`, :func:`replicate` (``_scatter``), :func:`gather` (``_gather``),
  :func:`parallel_apply` (``_parallel_apply``): the ``nn.parallel`` primitives, pytree-generic
  and differentiable, on CPU and CUDA devices.
* :func:`functional_call` (``_functional_call``): a thread-safe ``torch.func.functional_call``.
"""

from ._functional_call import functional_call
from ._gather import gather
from ._parallel_apply import parallel_apply
from ._pmap import Pmapped, pmap
from ._scatter import replicate, scatter
from ._tree import NAMESPACE
from ._version import __version__

__all__ = [
    "__version__",
    "NAMESPACE",
    "Pmapped",
    "functional_call",
    "gather",
    "parallel_apply",
    "pmap",
    "replicate",
    "scatter",
]
