"""``allreduce``, ``allreduce_async``, ``synchronize``, ``poll``: the sparse-aware collectives."""
from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch

from . import basics, engine, reduction, schemes
from .comm import horovod as collectives
from .engine import Handle
from .errors import HvdSparseError
from .sparsifiers import Sparsifier


def allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = None,
    scheme: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    block_size: int | None = None,
    process_set: hvd.ProcessSet = hvd.global_process_set,
    *,
    inplace: bool = False,
    sparsifier: Sparsifier | None = None,
) -> Handle:
    """Starts reducing ``tensor`` across ranks, shipping only its non-zero parts where that pays.

    Ranks match tensors by ``name`` and may submit them in any order; unnamed tensors are
    matched by call order, as in Horovod. A sparse COO tensor (an embedding's gradient) is
    reduced from its rows and the result is a coalesced sparse tensor (with ``scheme="dense"``,
    or on a GPU: densified, reduced, returned dense). A tensor on a GPU is reduced on the host,
    only its non-zero blocks crossing the bus both ways, and its result is on its device.
    Tensors the codec does not handle (integer, empty) use Horovod's dense allreduce.

    Args:
        tensor: the input; unchanged unless ``inplace``.
        name: matches the tensor across ranks; None: the call order does.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        scheme: "auto", "dense", "allgather", "zen", "omnireduce" or "switch"; None: the
            configured one (``HVD_SPARSE_SCHEME``, default "auto").
        prescale_factor: multiplies the input before the sum.
        postscale_factor: multiplies the sum.
        block_size: the codec's block, in elements; None: the configured one (256).
        process_set: only its ranks take part (every collective runs in it); the aggregated
            schemes (omnireduce, switch) serve the global set only and reduce a tensor of
            another set dense instead, with a warning.
        inplace: ``synchronize`` writes the result into ``tensor``.
        sparsifier: sparsifies a dense ``tensor`` in place first, on its device, with its
            error-feedback memory kept under ``name`` (e.g. ``hvd_sparse.TopK(0.01)``); a
            tensor it finds too small goes dense.

    Returns:
        A handle for ``synchronize`` or ``poll``.

    Raises:
        HvdSparseError: hvd_sparse is not initialized, this rank is not in ``process_set``,
            or a reduction of the same name is in flight.
        HvdSparseInternalError: Horovod is shut down, or (under Horovod elastic, where the
            first reduction after ``init`` or a reset joins the ranks) the join failed with
            Horovod; an ``HvdSparseError`` and Horovod's ``HorovodInternalError``.
        ValueError: ``op`` or ``scheme`` is not one of the above, or the sparsifier refuses
            the tensor (not floating-point).

    Example:
        >>> h = hvd_sparse.allreduce_async(grad, name="emb.weight")
        >>> avg = hvd_sparse.synchronize(h)
    """
    st = basics.state()
    op = hvd.Average if op is None else op
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("hvd_sparse supports op=hvd.Average or hvd.Sum (not Adasum, Min, Max...)")
    scheme = scheme or st.config.scheme
    schemes.check(scheme)
    name = f"noname.{next(st.unnamed)}" if name is None else name
    if not process_set.included():
        raise HvdSparseError(f"hvd_sparse: tensor {name!r}: rank {hvd.rank()} is not in "
                             f"process set {process_set.ranks}")
    return reduction.start(tensor, name, comm=collectives.of(process_set), ctx=st.context,
                           scheme=scheme, average=op == hvd.Average,
                           block_size=block_size or st.config.block_size,
                           prescale=prescale_factor, postscale=postscale_factor, inplace=inplace,
                           sparsifier=sparsifier)


def synchronize(handle: Handle) -> torch.Tensor:
    """Waits for ``handle``, driving every reduction in flight meanwhile.

    Args:
        handle: what ``allreduce_async`` or ``allreduce_async_`` returned.

    Returns:
        The result with the input's shape, dtype and device (a coalesced sparse tensor for a
        sparse input reduced by its rows); for an in-place reduction, the input itself.

    Raises:
        HvdSparseInternalError: the reduction failed (naming the tensor and why: a peer that
            left or timed out, an aggregator or the switch that timed out, Horovod shut down
            under it) or one of its stages (a collective, an aggregation) took longer than the
            ``timeout`` option. It is an ``HvdSparseError`` and Horovod's
            ``HorovodInternalError``, the error ``hvd.elastic.run`` recovers from.
    """
    try:
        return reduction.finish(handle)
    except HvdSparseError as e:
        raise basics.failure(e, handle.job.ctx.joined) from e


def poll(handle: Handle) -> bool:
    """Moves the reductions in flight on and tells whether ``handle``'s has finished.

    Args:
        handle: what ``allreduce_async`` or ``allreduce_async_`` returned.

    Returns:
        True when ``synchronize(handle)`` would return (or raise) without waiting.
    """
    return engine.poll(handle)


def allreduce(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = None,
    scheme: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    block_size: int | None = None,
    process_set: hvd.ProcessSet = hvd.global_process_set,
) -> torch.Tensor:
    """Reduces ``tensor`` across ranks, shipping only its non-zero blocks where that pays.

    ``synchronize(allreduce_async(...))``: see ``allreduce_async`` for what each form of
    tensor becomes.

    Args:
        tensor: the input (dense or sparse COO, on the host or a GPU); unchanged.
        name: matches the tensor across ranks; None: the call order does.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        scheme: "auto", "dense", "allgather", "zen", "omnireduce" or "switch"; None: the
            configured one (default "auto").
        prescale_factor: multiplies the input before the sum.
        postscale_factor: multiplies the sum.
        block_size: the codec's block, in elements; None: the configured one (256).
        process_set: only its ranks take part (see ``allreduce_async``).

    Returns:
        The result: a new tensor with the input's shape, dtype and device (a coalesced sparse
        tensor for a sparse input reduced by its rows).

    Raises:
        HvdSparseError: hvd_sparse is not initialized, this rank is not in ``process_set``, or
            a reduction of the same name is in flight.
        HvdSparseInternalError: the reduction failed or timed out, or Horovod is shut down
            (see ``synchronize``): also Horovod's ``HorovodInternalError``.
        ValueError: ``op`` or ``scheme`` is not one of the above.

    Example:
        >>> avg = hvd_sparse.allreduce(grad, name="emb.weight", op=hvd.Average)
    """
    return synchronize(allreduce_async(tensor, name, op, scheme, prescale_factor,
                                       postscale_factor, block_size, process_set))


def allreduce_async_(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = None,
    scheme: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    block_size: int | None = None,
    process_set: hvd.ProcessSet = hvd.global_process_set,
    *,
    sparsifier: Sparsifier | None = None,
) -> Handle:
    """In-place ``allreduce_async``: ``synchronize`` writes the result into ``tensor``.

    Cheaper for large tensors: the sum is built in the tensor's own (already mapped) memory.
    A sparse tensor reduced by its rows is not written in place: ``synchronize`` returns a new
    one.

    Args:
        tensor: the input (dense or sparse COO, on the host or a GPU); holds the result
            after ``synchronize``.
        name: matches the tensor across ranks; None: the call order does.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        scheme: "auto", "dense", "allgather", "zen", "omnireduce" or "switch"; None: the
            configured one (default "auto").
        prescale_factor: multiplies the input before the sum.
        postscale_factor: multiplies the sum.
        block_size: the codec's block, in elements; None: the configured one (256).
        process_set: only its ranks take part (see ``allreduce_async``).
        sparsifier: sparsifies ``tensor`` first (see ``allreduce_async``).

    Returns:
        A handle for ``synchronize`` or ``poll``.

    Raises:
        HvdSparseError: hvd_sparse is not initialized, this rank is not in ``process_set``, or
            a reduction of the same name is in flight.
        HvdSparseInternalError: Horovod is shut down, or the join under elastic failed with
            Horovod (see ``allreduce_async``).
        ValueError: ``op`` or ``scheme`` is not one of the above, or the sparsifier refuses
            the tensor.

    Example:
        >>> h = hvd_sparse.allreduce_async_(grad, name="fc.weight")
        >>> hvd_sparse.synchronize(h)  # grad now holds the average
    """
    return allreduce_async(tensor, name, op, scheme, prescale_factor, postscale_factor,
                           block_size, process_set, inplace=True, sparsifier=sparsifier)


def allreduce_(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = None,
    scheme: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    block_size: int | None = None,
    process_set: hvd.ProcessSet = hvd.global_process_set,
) -> torch.Tensor:
    """In-place ``allreduce``: the result is written into ``tensor``.

    Args:
        tensor: the input (dense or sparse COO, on the host or a GPU); holds the result.
        name: matches the tensor across ranks; None: the call order does.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        scheme: "auto", "dense", "allgather", "zen", "omnireduce" or "switch"; None: the
            configured one (default "auto").
        prescale_factor: multiplies the input before the sum.
        postscale_factor: multiplies the sum.
        block_size: the codec's block, in elements; None: the configured one (256).
        process_set: only its ranks take part (see ``allreduce_async``).

    Returns:
        ``tensor``, holding the result (for a sparse tensor reduced by its rows: a new
        coalesced sparse tensor).

    Raises:
        HvdSparseError: hvd_sparse is not initialized, this rank is not in ``process_set``, or
            a reduction of the same name is in flight.
        HvdSparseInternalError: the reduction failed or timed out, or Horovod is shut down
            (see ``synchronize``): also Horovod's ``HorovodInternalError``.
        ValueError: ``op`` or ``scheme`` is not one of the above.

    Example:
        >>> hvd_sparse.allreduce_(grad, name="fc.weight", op=hvd.Sum)
    """
    return synchronize(allreduce_async_(tensor, name, op, scheme, prescale_factor,
                                        postscale_factor, block_size, process_set))
