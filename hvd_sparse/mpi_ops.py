"""``allreduce``, ``allreduce_async``, ``synchronize``, ``poll``: the sparse-aware collectives."""
from __future__ import annotations

import time
from typing import Any

import horovod.torch as hvd
import torch

from . import basics, blocks, engine, runfile, schemes, staging
from .comm import horovod as collectives
from .engine import Handle
from .errors import HvdSparseError
from .job import Job
from .metrics import record as record_metrics
from .schemes import rows


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
) -> Handle:
    """Starts reducing ``tensor`` across ranks; returns a handle for ``synchronize``.

    Ranks match tensors by ``name`` and may submit them in any order; unnamed tensors are
    matched by call order, as in Horovod. ``op`` is ``hvd.Average`` (default) or ``hvd.Sum``.
    A sparse COO tensor (an embedding's gradient) is reduced from its rows and the result is a
    coalesced sparse tensor (``scheme="dense"``, or on a GPU: densified, reduced, returned dense).
    A tensor on a GPU is reduced on the host, only its non-zero blocks crossing the bus both
    ways (staging.py), and its result is on its device. Tensors the codec does not handle
    (integer, empty) use Horovod's dense allreduce.
    With ``process_set`` only its ranks take part (every Horovod collective runs in it); the
    omnireduce scheme refuses one that is not the global set.
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
    t = tensor.detach()
    block_size = block_size or st.config.block_size
    home = to_host = None  # a staged tensor: its flat self on the device, its way to the host
    asked = scheme
    if t.is_sparse and scheme != "dense" and rows.supported(t):
        scheme, inplace, copied = "rows", False, False
    else:
        # A copy (of a sparse or non-contiguous input) is ours: the result is built in it, as in
        # place, rather than in a second fresh tensor.
        copied = t.is_sparse or not t.is_contiguous()
        t = (_dense(t) if t.is_sparse else t.contiguous()).view(-1)
        if t.numel() and staging.staged(t):
            home, to_host, copied = t, staging.ToHost(t, block_size), True
        elif not blocks.supported(t) or t.numel() == 0:
            scheme = "dense"
    job = Job(name=name, tensor=t, shape=tensor.shape, average=op == hvd.Average,
              prescale=prescale_factor, postscale=postscale_factor, block_size=block_size,
              meta=blocks.meta_hash(tensor.shape, tensor.dtype), scheme=scheme,
              ctx=st.context, comm=collectives.of(process_set),
              inplace=t.numel() > 0 and (inplace or copied),
              output=tensor if inplace else None, home=home, asked=asked)
    if to_host is None:
        return engine.submit(job, schemes.run(job), _record)
    job.stats.staged = str(home.device)
    return engine.submit(job, _staged(job, to_host), _record)


def _staged(job: Job, to_host: staging.ToHost) -> engine.Stage:
    """A staged tensor's reduction: its non-zero blocks reach host memory, the scheme runs on
    the host tensor built from them (``synchronize`` takes the result back to the device)."""
    job.tensor = yield "to host", to_host
    job.mask = to_host.mask()
    return (yield from schemes.run(job))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t.to_dense()`` (the same bits: values added into zeros) built in ``blocks.zeros``, so
    that only the pages the values land in are touched (on a GPU: ``to_dense``, on it)."""
    if t.device.type != "cpu":
        return t.to_dense()
    t = t.coalesce()
    out = blocks.zeros(t.numel(), t.dtype).view(t.shape)
    return out.index_put_(tuple(t.indices()), t.values(), accumulate=True)


def _record(h: Handle) -> None:
    seconds = time.monotonic() - h.started
    record_metrics(h.job.name, seconds, h.job.stats)
    runfile.record(h.job, h.started, seconds)


def synchronize(handle: Handle) -> torch.Tensor:
    """Waits for ``handle``; returns the result with the input's shape and dtype."""
    job = handle.job
    out = engine.synchronize(handle, job.ctx.config.timeout)
    if job.home is not None:  # back to the tensor's device; in place when it is the caller's
        target = job.home if job.output is not None else torch.empty_like(job.home)
        out = staging.to_device(out, target, job.block_size)
    if not out.is_sparse:
        out = out.view(job.shape)
    if job.output is not None:
        if out.data_ptr() != job.output.data_ptr():
            job.output.copy_(out)
        return job.output
    return out


def poll(handle: Handle) -> bool:
    """True when ``synchronize(handle)`` would return without waiting."""
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
    """Reduces ``tensor`` across ranks, shipping only its non-zero blocks where that pays."""
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
) -> Handle:
    """In-place ``allreduce_async``: ``synchronize`` writes the result into ``tensor``.

    Cheaper for large tensors: the sum is built in the tensor's own (already mapped) memory.
    """
    return allreduce_async(tensor, name, op, scheme, prescale_factor, postscale_factor,
                           block_size, process_set, inplace=True)


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
    """In-place ``allreduce``: returns ``tensor`` holding the result."""
    return synchronize(allreduce_async_(tensor, name, op, scheme, prescale_factor,
                                        postscale_factor, block_size, process_set))
