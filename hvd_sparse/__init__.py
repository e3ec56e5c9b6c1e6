"""hvd-sparse: sparse gradient synchronization for Horovod and PyTorch DDP (``hvd_sparse.ddp``).

    import horovod.torch as hvd, hvd_sparse
    hvd.init(); hvd_sparse.init()
    out = hvd_sparse.allreduce(t, name="emb", op=hvd.Average, scheme="auto")

The public names are imported on first use (PEP 562), so the torch-free parts (the
``hvd-sparse aggregator`` command, ``hvd_sparse.protocol``, ``hvd_sparse.tools.wire``) run on
hosts without torch or Horovod.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Torch-free, so imported now: and `metrics` must be bound before anything imports the
# submodule of the same name, or the import system would set the package's `metrics` to it.
from .errors import HvdSparseError
from .metrics import metrics, reset_metrics

if TYPE_CHECKING:
    from .basics import HvdSparseInternalError, init, is_initialized, shutdown
    from .compression import Compression, SparseCompressor
    from .mpi_ops import (
        allreduce,
        allreduce_,
        allreduce_async,
        allreduce_async_,
        poll,
        synchronize,
    )
    from .optimizer import DistributedOptimizer
    from .sparsifiers import DGC, ExDyna, Sparsifier, Threshold, TopK

# public name -> the submodule that defines it
_EXPORTS = {
    "init": "basics", "is_initialized": "basics", "shutdown": "basics",
    "HvdSparseInternalError": "basics",
    "Compression": "compression", "SparseCompressor": "compression",
    "allreduce": "mpi_ops", "allreduce_": "mpi_ops", "allreduce_async": "mpi_ops",
    "allreduce_async_": "mpi_ops", "poll": "mpi_ops", "synchronize": "mpi_ops",
    "DistributedOptimizer": "optimizer",
    "DGC": "sparsifiers", "ExDyna": "sparsifiers", "Sparsifier": "sparsifiers",
    "Threshold": "sparsifiers", "TopK": "sparsifiers",
}

__all__ = [
    "DGC", "Compression", "DistributedOptimizer", "ExDyna", "HvdSparseError",
    "HvdSparseInternalError", "SparseCompressor", "Sparsifier", "Threshold", "TopK",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "init", "is_initialized",
    "metrics", "poll", "reset_metrics", "shutdown", "synchronize",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "ddp":  # the DDP front end: a submodule, imported on first use (no Horovod)
        return importlib.import_module(".ddp", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
