"""hvd-sparse: sparse gradient synchronization for Horovod.

    import horovod.torch as hvd, hvd_sparse
    hvd.init(); hvd_sparse.init()
    out = hvd_sparse.allreduce(t, name="emb", op=hvd.Average, scheme="auto")
"""
from .basics import init, is_initialized, shutdown
from .compression import Compression, SparseCompressor
from .errors import HvdSparseError
from .metrics import metrics, reset_metrics
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

__all__ = [
    "DGC", "Compression", "DistributedOptimizer", "ExDyna", "HvdSparseError", "SparseCompressor",
    "Sparsifier", "Threshold", "TopK", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "init", "is_initialized", "metrics", "poll", "reset_metrics", "shutdown",
    "synchronize",
]
__version__ = "0.1.0"
