"""One tensor's reduction set up and finished, for either front end (``mpi_ops`` and the
optimizer and compression under Horovod, ``ddp`` under torch.distributed): a sparsifier applied
on the tensor's own device (each parameter's part with a memory of its own; parts too small to
sparsify sent whole by the dense allreduce), which scheme its form allows, a device tensor
staged to the host by its non-zero blocks, the ``Job`` the schemes run, its metrics and
run-file record, and the result taken back to the caller's form, the sparsifier shown it.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import torch

from . import blocks, engine, runfile, schemes, staging
from .comm import Collectives
from .engine import Handle
from .errors import HvdSparseError
from .job import Context, Job, Stats
from .metrics import record as record_metrics
from .schemes import dense, rows
from .sparsifiers import Sparsifier

Part = tuple[str, int, int]  # a gradient in a flat tensor: its name, offset and elements


def start(tensor: torch.Tensor, name: str, *, comm: Collectives, ctx: Context, scheme: str,
          average: bool, block_size: int, prescale: float = 1.0, postscale: float = 1.0,
          inplace: bool = False, sparsifier: Sparsifier | None = None,
          parts: Sequence[Part] = ()) -> Handle:
    """Starts reducing ``tensor`` over ``comm``'s ranks by ``scheme`` (checked by the caller).

    A sparse COO tensor goes by rows where ``rows.supported`` (else densified); a dense one by
    ``scheme``, or by Horovod's or Gloo's dense allreduce where the codec does not take it
    (integer, empty); on an accelerator only its non-zero blocks cross to the host (staging.py),
    unless it goes dense anyway and the collectives take it where it is (``Collectives.takes``:
    Horovod built with CUDA).
    With a ``sparsifier``, a dense tensor is sparsified first, in place and on its device (told
    ``comm``'s rank and size and ``ctx.joined`` first: ``Sparsifier.join``): each
    of ``parts`` under its own name (the whole tensor under ``name`` when none), the parts
    the sparsifier finds ``too_small`` sent whole by the dense allreduce beside it (a ring ships
    them cheapest) and zeroed in what the scheme reduces, every part dense when all are
    (``finish`` shows the sparsifier each part's result).

    Args:
        tensor: the input, any shape; left unchanged unless ``inplace``.
        name: the reduction's name (metrics, run file; Horovod matches ranks by it).
        comm: the ranks taking part and their collectives.
        ctx: the process's aggregators, switch, network model and what ``auto`` learnt.
        scheme: the scheme asked for ("auto", "dense", ...).
        average: divide the sum by the ranks.
        block_size: the codec's block, in elements.
        prescale: factor applied before the sum.
        postscale: factor applied after it.
        inplace: ``finish`` writes the result into ``tensor`` (dense tensors).
        sparsifier: sparsifies a dense ``tensor`` (contiguous, floating-point) in place first.
        parts: the gradients in the flat ``tensor`` (name, offset, elements) the sparsifier
            keeps apart, e.g. the parameters of a DDP bucket.

    Returns:
        The handle to pass to ``finish``.

    Raises:
        HvdSparseError: a reduction of the same name is in flight.
        ValueError: the sparsifier refuses the tensor (not floating-point).
    """
    t = tensor.detach()
    home = to_host = None  # a staged tensor: its flat self on the device, its way to the host
    whole: list[Part] = []
    apart = None
    if sparsifier is None or t.is_sparse:
        parts = ()
    else:
        sparsifier.join(comm.rank, comm.size, ctx.joined)  # the ranks it selects among now
        parts = parts or [(name, 0, t.numel())]
        whole = _sparsify(t, name, sparsifier, parts, block_size)
        if len(whole) == len(parts):
            scheme = "dense"
        if scheme == "dense":
            whole = []
        if whole:  # cut out (to the host: they are small), the scheme reduces the rest
            flat = t.view(-1)
            apart = torch.cat([flat[s:s + n] for _, s, n in whole]).cpu()
            for _, s, n in whole:
                flat[s:s + n].zero_()
    asked = scheme
    widen, caller, wire = None, None, wire_type(t, ctx.config.wire)
    if wire is not None:  # a 16-bit copy is reduced; ``finish`` widens it into the caller's form
        widen, caller, inplace = t.dtype, (tensor if inplace else None), False
        # (a sparse gradient as it is: an EmbeddingBag's runs of equal values stay runs)
        t = t.to(wire)
    if t.is_sparse and scheme != "dense" and rows.supported(t):
        scheme, inplace, copied = "rows", False, False
    else:
        # A copy (of a sparse or non-contiguous input) is ours: the result is built in it, as in
        # place, rather than in a second fresh tensor.
        copied = t.is_sparse or not t.is_contiguous()
        t = (densified(t) if t.is_sparse else t.contiguous()).view(-1)
        if t.numel() and staging.staged(t):
            # going dense anyway: the front end's own allreduce takes it where it is, if it can
            if not (_dense_anyway(t, scheme, ctx) and comm.takes(t)):
                home, to_host, copied = t, staging.ToHost(t, block_size), True
        elif not blocks.supported(t) or t.numel() == 0:
            scheme = "dense"
    job = Job(name=name, tensor=t, shape=tensor.shape, average=average, prescale=prescale,
              postscale=postscale, block_size=block_size,
              meta=blocks.meta_hash(tensor.shape, t.dtype), scheme=scheme, ctx=ctx,
              comm=comm, inplace=t.numel() > 0 and (inplace or copied),
              output=tensor if inplace else None, home=home, asked=asked,
              sparsifier=sparsifier, parts=tuple(parts), whole=tuple(whole), apart=apart,
              widen=widen, caller=caller)
    if wire is not None:
        job.stats.wire = str(wire).removeprefix("torch.")
    if to_host is not None:
        job.stats.staged = str(home.device)
    return engine.submit(job, _run(job, to_host), _record)


def finish(handle: Handle) -> torch.Tensor:
    """Waits for ``handle`` (at most the configured timeout).

    Args:
        handle: what ``start`` returned.

    Returns:
        The result with the input's shape, dtype and device (sparse for a sparse input reduced
        by rows); the input itself when started ``inplace``.

    Raises:
        HvdSparseError: the reduction failed or timed out (naming the tensor and the peer).
    """
    job = handle.job
    out = engine.synchronize(handle, job.ctx.config.timeout)
    if job.home is not None:  # back to the tensor's device; in place when it is the caller's
        target = job.home if job.output is not None else torch.empty_like(job.home)
        out = staging.to_device(out, target, job.block_size)
    if not out.is_sparse:
        out = out.view(job.shape)
    if job.widen is not None:  # the 16-bit result widened, into the caller's tensor in place
        out = out.to(job.widen)
        if job.caller is not None:
            out = job.caller.copy_(out)
    if job.output is not None:
        if out.data_ptr() != job.output.data_ptr():
            job.output.copy_(out)
        out = job.output
    if job.parts:
        flat = out.view(-1)
        at = 0
        for _, s, n in job.whole:  # the parts sent whole, back in their places
            flat[s:s + n] = job.apart[at:at + n]
            at += n
        for part, s, n in job.parts:
            job.sparsifier.observe(part, flat[s:s + n], job.block_size)
    return out


def wire_type(t: torch.Tensor, wire: str) -> torch.dtype | None:
    """The 16-bit type ``t``'s values travel as (option ``wire``).

    bfloat16 only: it has float32's range, so no finite value arrives as infinity (float16's
    65504 would need a scale agreed by the ranks).

    Args:
        t: the tensor to reduce.
        wire: the option's value ("bf16" or "").

    Returns:
        ``torch.bfloat16``, or None: the values travel in their own type (no option, or not
        float32 or float64).
    """
    if wire != "bf16" or t.dtype not in (torch.float32, torch.float64) or t.numel() == 0:
        return None
    return torch.bfloat16


def _dense_anyway(t: torch.Tensor, scheme: str, ctx: Context) -> bool:
    """Whether ``t`` goes dense whatever its blocks: asked so, or small (``schemes.run``)."""
    return scheme == "dense" or (scheme in schemes.SMALL_GO_DENSE and
                                 t.numel() * t.element_size() < ctx.config.small_bytes)


def _sparsify(t: torch.Tensor, name: str, sparsifier: Sparsifier, parts: Sequence[Part],
              block_size: int) -> list[Part]:
    """Sparsifies each part of ``t`` in place; returns those to send whole."""
    if not t.is_contiguous():
        raise HvdSparseError(f"hvd_sparse: tensor {name!r}: a sparsifier works on contiguous "
                             "tensors, in place")
    flat = t.view(-1)
    for part, s, n in parts:
        sparsifier(part, flat[s:s + n], block_size)
    return [p for p in parts if sparsifier.too_small(p[2])]


def _run(job: Job, to_host: staging.ToHost | None) -> engine.Stage:
    """The job's stages: the parts sent whole, by the dense allreduce (``finish`` puts them back
    in place), a staged tensor's non-zero blocks to host memory (``finish`` takes the result
    back to the device), the scheme."""
    if job.apart is not None:
        apart = dataclasses.replace(job, name=f"{job.name}.whole", tensor=job.apart,
                                    shape=job.apart.shape, inplace=True, output=None,
                                    home=None, stats=Stats())
        started = time.monotonic()
        job.apart = yield from dense.run(apart)
        _done(apart, started)
    if to_host is not None:
        job.tensor = yield "to host", to_host
        job.mask = to_host.mask()
    return (yield from schemes.run(job))


def densified(t: torch.Tensor) -> torch.Tensor:
    """A sparse COO ``t`` as a dense tensor built in ``blocks.zeros``, so that only the pages
    the values land in are touched; its duplicates added as ``rows.summed`` adds them (16-bit
    ones in float32, rounded once: ``to_dense`` adds them in 16 bits), then into zeros, as
    ``to_dense`` does (on a GPU: ``to_dense``, on it).

    Args:
        t: a sparse COO tensor.

    Returns:
        The dense tensor, ``t``'s shape and dtype.
    """
    if t.device.type != "cpu":
        return t.to_dense()
    out = blocks.zeros(t.numel(), t.dtype)
    if rows.supported(t):
        k = t.sparse_dim()
        line, vals = rows.summed(t)
        return out.view(math.prod(t.shape[:k]), *t.shape[k:]).index_add_(0, line, vals
                                                                         ).view(t.shape)
    t = t.coalesce()
    return out.view(t.shape).index_put_(tuple(t.indices()), t.values(), accumulate=True)


def _record(h: Handle) -> None:
    _done(h.job, h.started)


def _done(job: Job, started: float) -> None:
    """A reduction's (or the whole parts') metrics and run-file record."""
    seconds = time.monotonic() - started
    s = job.stats
    s.route = s.route or ("aggregators" if s.scheme in ("omnireduce", "rows+omnireduce") else
                          "switch" if s.scheme == "switch" else job.comm.route)
    record_metrics(job.name, seconds, s)
    runfile.record(job, started, seconds)
