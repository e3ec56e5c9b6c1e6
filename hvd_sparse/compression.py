"""``Compression.sparse``: sparse synchronization inside an unmodified ``hvd.DistributedOptimizer``.

Horovod calls ``compress(grad)`` from its backward hook, allreduces what it returns with the
optimizer's op and scaling, and calls ``decompress(result, ctx)`` at ``synchronize()``. Here
``compress`` starts the sparse reduction of the gradient (a plain sum) and hands Horovod a
one-element placeholder of ones; its reduced value tells ``decompress`` the op's scaling (1 for
Average with any predivide factor, size for Sum), which is applied to the sum. Tensors of a dtype
the codec does not take (integer) go back to Horovod unchanged, and sparse gradients with
``sparse_as_dense=False`` never reach ``compress`` (Horovod's COO allgather reduces them):
``decompress`` passes Horovod's result through.
"""
from __future__ import annotations

import itertools
import sys
import warnings
from types import FrameType
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.optimizer import _DistributedAdasumOptimizer

from . import blocks, schemes, staging
from .errors import HvdSparseError
from .mpi_ops import allreduce_async, allreduce_async_, synchronize
from .sparsifiers import DGC, Sparsifier

_HVD_ADASUM = _DistributedAdasumOptimizer._allreduce_grad_async.__code__
_SPARSE_BYPASS = (
    "hvd_sparse.Compression.sparse: hvd.DistributedOptimizer never hands sparse gradients to a "
    "compression object (it reduces them with its own COO allgather, or densifies them with "
    "sparse_as_dense=True); hvd_sparse.DistributedOptimizer reduces them by rows, without "
    "densifying")


def _caller(frame: FrameType | None) -> tuple[Any, torch.Tensor | None]:
    """(Horovod's optimizer, parameter) whose gradient is being compressed, or (None, None).

    Ranks match reductions by name, and ``compress`` receives only the tensor, so the name (and
    the optimizer's process set) is read from the calling optimizer: ``_allreduce_grad_async(self,
    p)`` calls ``compress`` directly, ``_grouped_allreduce_grad_async`` from a comprehension over
    ``p`` (its own frame before Python 3.12).
    """
    p = None
    for _ in range(2):
        if frame is None:
            break
        if frame.f_code is _HVD_ADASUM:
            raise HvdSparseError("hvd_sparse.Compression.sparse does not support op=hvd.Adasum: "
                                 "Adasum combines whole tensors, not sums of sparse blocks")
        p = frame.f_locals.get("p", p)
        opt = frame.f_locals.get("self")
        if p is not None and hasattr(opt, "_parameter_names"):
            return opt, p
        frame = frame.f_back
    return None, None


class SparseCompressor:
    """Compression object for ``hvd.DistributedOptimizer(compression=...)``: each gradient is
    reduced by hvd_sparse (named by its parameter) while Horovod reduces a placeholder.

    Usually made by ``hvd_sparse.Compression.sparse(...)``.

    Args:
        scheme: the scheme (None: the configured one, default "auto").
        block_size: the codec's block in elements (None: the configured one, 256);
            element-wise sparsifiers (TopK, Threshold, DGC) want a small one.
        sparsifier: sparsifies each gradient before its reduction, e.g.
            ``hvd_sparse.TopK(0.01)``; a DGC takes the optimizer's momentum at the first
            gradient.

    Raises:
        ValueError: an unknown scheme, or a sparsifier that is not an hvd_sparse one.
    """

    def __init__(self, scheme: str | None = None, block_size: int | None = None,
                 sparsifier: Sparsifier | None = None) -> None:
        schemes.check(scheme)
        if sparsifier is not None and not isinstance(sparsifier, Sparsifier):
            raise ValueError(f"sparsifier must be an hvd_sparse Sparsifier, got {sparsifier!r}")
        self.scheme = scheme
        self.block_size = block_size
        self.sparsifier = sparsifier
        self._unnamed = itertools.count()

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Starts the gradient's reduction (a plain sum; sparsified first, with a sparsifier).

        Horovod calls it from its backward hook. The name (``grad.<parameter name>``) and the
        process set come from the calling optimizer; other callers' tensors are named by call
        order, and reduced into a new tensor rather than in place.

        Args:
            tensor: a dense gradient.

        Returns:
            (a one-element placeholder of ones for Horovod to reduce, the context
            ``decompress`` needs); for a tensor the codec does not take (integer):
            (``tensor``, None), which Horovod reduces itself.

        Raises:
            HvdSparseError: ``tensor`` is sparse (Horovod's grouped path hands sparse
                gradients over), the optimizer's op is ``hvd.Adasum``, hvd_sparse is not
                initialized, or a reduction of the same name is in flight.
            HvdSparseInternalError: Horovod is shut down, or the join of the ranks (under
                Horovod elastic, at the first reduction after init or a reset) failed with
                Horovod.
            ValueError: the sparsifier refuses the tensor (not floating-point) or, for DGC,
                the optimizer's momentum.
        """
        opt, p = _caller(sys._getframe(1))
        pname = opt._parameter_names.get(p) if opt is not None else None
        name = "grad." + (pname or f"compress.{next(self._unnamed)}")
        if tensor.is_sparse:  # from Horovod's grouped path, which ignores sparse_as_dense
            raise HvdSparseError(
                f"hvd_sparse: gradient {name!r} is sparse: Compression.sparse takes dense tensors "
                "(with groups=, hvd.DistributedOptimizer ignores sparse_as_dense); use "
                "groups=None or hvd_sparse.DistributedOptimizer")
        process_set = getattr(opt, "process_set", hvd.global_process_set)
        if isinstance(self.sparsifier, DGC) and opt is not None:  # before the first step
            self.sparsifier.take_momentum(opt.param_groups)
        if not (blocks.supported(tensor) or staging.staged(tensor)):  # integer: Horovod's own
            if self.sparsifier is not None:
                self.sparsifier(name, tensor)  # refuses it, naming it
            return tensor, None
        # Horovod's optimizer replaces the gradient with the result: reduce it in place. Other
        # callers (hvd.allreduce(t, compression=...)) get a new tensor and keep theirs.
        start = allreduce_async_ if opt is not None else allreduce_async
        handle = start(tensor, name=name, op=hvd.Sum, scheme=self.scheme,
                       block_size=self.block_size, process_set=process_set,
                       sparsifier=self.sparsifier)
        # A host placeholder for a GPU tensor: a CPU-only Horovod can reduce it
        placeholder = tensor.new_ones(1) if tensor.device.type == "cpu" else torch.ones(1)
        return placeholder, (handle, process_set.size())

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Waits for the reduction ``compress`` started and scales it as Horovod's op asks.

        Args:
            tensor: Horovod's reduction of what ``compress`` returned.
            ctx: what ``compress`` returned with it.

        Returns:
            The reduced gradient, in the tensor ``compress`` was given when Horovod's optimizer
            called it: the sum scaled by the placeholder's reduced value over the process
            set's size (the average for ``hvd.Average``, the sum for ``hvd.Sum``). With ctx
            None, ``tensor`` as Horovod reduced it (a sparse one with a warning: Horovod's COO
            allgather reduced it, not hvd_sparse).

        Raises:
            HvdSparseInternalError: the reduction failed or timed out (a peer left, an
                aggregator timed out, Horovod shut down under it): an ``HvdSparseError`` and
                Horovod's ``HorovodInternalError``, which ``hvd.elastic.run`` recovers from.
        """
        if ctx is None:  # Horovod reduced it itself: a tensor handed back by compress, or a
            # sparse gradient (sparse_as_dense=False), which Horovod's optimizer sends to its own
            # sparse_allreduce_async (COO allgather) without calling compress
            if tensor.is_sparse:
                warnings.warn(_SPARSE_BYPASS, stacklevel=2)
            return tensor
        handle, size = ctx
        total = synchronize(handle)
        # The placeholder reduced to 1 (Average) or the process set's size (Sum), up to rounding.
        scale = round(float(tensor.reshape(-1)[0]))
        return total.mul_(scale / size)


class _SparseDefault(SparseCompressor):
    """``Compression.sparse``: called, it makes a compressor with the arguments given; passed
    uncalled, as Horovod's own are (``compression=hvd.Compression.fp16``), it is the
    compressor with its defaults."""

    def __call__(self, scheme: str | None = None, block_size: int | None = None,
                 sparsifier: Sparsifier | None = None) -> SparseCompressor:
        """A sparse compressor for ``hvd.DistributedOptimizer(compression=...)``.

        Args:
            scheme: the scheme (None: the configured one, default "auto").
            block_size: the codec's block in elements (None: the configured one, 256);
                element-wise sparsifiers (TopK, Threshold, DGC) want a small one.
            sparsifier: sparsifies each gradient before its reduction, e.g.
                ``hvd_sparse.TopK(0.01)``.

        Returns:
            The compression object.

        Raises:
            ValueError: an unknown scheme, or a sparsifier that is not an hvd_sparse one.

        Example:
            >>> opt = hvd.DistributedOptimizer(
            ...     opt, named_parameters=model.named_parameters(),
            ...     compression=hvd_sparse.Compression.sparse(scheme="auto"))
        """
        return SparseCompressor(scheme=scheme, block_size=block_size, sparsifier=sparsifier)


class Compression:
    """Sparse compression objects, in the style of ``hvd.Compression``: ``Compression.sparse``
    (uncalled: its defaults) or ``Compression.sparse(scheme=..., block_size=...,
    sparsifier=...)``.

    Example:
        >>> opt = hvd.DistributedOptimizer(
        ...     opt, named_parameters=model.named_parameters(),
        ...     compression=hvd_sparse.Compression.sparse)
    """

    sparse = _SparseDefault()
