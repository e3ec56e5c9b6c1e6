"""OmniReduce: stream only non-zero blocks to aggregator processes, which sum and return them.

The per-packet work is C++ (csrc/omni/worker/, a background thread in this process); the
job's aggregators are joined at init (hvd_sparse/session.py) and reach this scheme through the
job's context; this module turns one tensor into one submission to that session.
"""
from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

import horovod.torch as hvd
import torch

from .. import _C, fixedpoint
from ..engine import Job, Stage
from ..errors import HvdSparseError
from ..segments import local_mask, output
from ..session import Session
from . import dense

log = logging.getLogger("hvd_sparse")


class _Ticket:
    """What the engine waits on: one submission to the worker engine."""

    def __init__(self, worker: _C.OmniWorker, ticket: int) -> None:
        self.worker, self.ticket = worker, ticket

    def poll(self) -> bool:
        return self.worker.poll(self.ticket)

    def value(self) -> None:
        return None


def covers(process_set: hvd.ProcessSet) -> bool:
    """Whether the aggregators sum over exactly ``process_set``'s ranks: they sum over every rank
    of the job, all of which join them at init, so a smaller set would leave them waiting."""
    return process_set.process_set_id == hvd.global_process_set.process_set_id


def run(job: Job) -> Stage:
    ctx = job.ctx
    session = ctx.omni
    if session is None:
        raise HvdSparseError(
            f"hvd_sparse: tensor {job.name!r}: scheme 'omnireduce' needs aggregators: set "
            "HVD_SPARSE_AGGREGATORS=host:port,... or leave local_aggregators on")
    if not covers(job.process_set):
        raise HvdSparseError(
            f"hvd_sparse: tensor {job.name!r}: scheme 'omnireduce' reduces over all ranks of "
            f"the job, not over a process set ({job.process_set.ranks}); use another scheme")
    t = job.tensor
    if t.numel() * t.element_size() < ctx.config.small_bytes:  # a round trip costs more
        job.stats["reason"] = "small"
        return (yield from dense.run(job))
    exponent = None
    if ctx.config.fixed_point:
        exponent, _ = yield from fixedpoint.agree(job)
        if exponent is None:  # fixed point cannot carry NaN/Inf: dense propagates them exactly
            job.stats["reason"] = "non-finite"
            log.info("hvd_sparse: tensor %r holds NaN or Inf on some rank; reducing it dense",
                     job.name)
            return (yield from dense.run(job))
    out = output(job)  # results are scaled as they land, only in blocks some rank sent
    fallback = ctx.config.fallback == "dense"
    backup = t.clone() if fallback and job.inplace else None  # results overwrite the input
    failure, stats = yield from stream(job, session, out, exponent, "omnireduce")
    if fallback:
        failed = yield from failed_anywhere(job, failure)
        if failed:
            log.warning("hvd_sparse: tensor %r: aggregation failed on %d rank(s) (%s); "
                        "reducing it dense", job.name, failed, failure or "on a peer")
            if backup is not None:
                t.copy_(backup)
            return (yield from dense.run(job))
    if failure is not None:
        raise HvdSparseError(failure)
    record(job, "omnireduce", stats)
    return out


def stream(job: Job, session: Session, out: torch.Tensor, exponent: int | None,
           stage: str) -> Generator[tuple[str, _Ticket], Any, tuple[str | None, dict]]:
    """Submits the tensor to ``session`` (results land in ``out``) and waits for it; returns
    (None or why it failed on this rank, the worker engine's stats)."""
    t = job.tensor
    ticket = session.worker.submit(session.tensor_id(job.name), t, out, job.block_size,
                                   job.meta & 0xFFFFFFFF, local_mask(job), job.name, job.scale,
                                   exponent)
    failure: str | None = None
    stats: dict = {}
    try:
        yield stage, _Ticket(session.worker, ticket)
    finally:  # also when abandoned: the engine must not keep writing into `out`
        try:
            stats = session.worker.finish(ticket)
        except RuntimeError as e:
            failure = f"hvd_sparse: {e}"
    return failure, stats


def failed_anywhere(job: Job, failure: str | None) -> Generator[tuple[str, int], Any, int]:
    """How many ranks' aggregation of the tensor failed (one tiny allreduce): they must all
    fall back together, or none."""
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
    failed = yield "agree", hvd.allreduce_async(flag, name=job.op_name("agree"), op=hvd.Sum,
                                                process_set=job.process_set)
    return int(failed)


def record(job: Job, scheme: str, stats: dict) -> None:
    t = job.tensor
    job.stats.update(scheme=scheme, bytes_sent=stats["bytes_sent"],
                     bytes_received=stats["bytes_received"], union=stats["union"],
                     retransmits=stats["retransmits"], rounds=stats["rounds"],
                     block_density=stats["nnz_local"] / max(1, -(-t.numel() // job.block_size)))
