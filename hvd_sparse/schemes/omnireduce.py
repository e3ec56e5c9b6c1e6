"""OmniReduce: stream only non-zero blocks to aggregator processes, which sum and return them.

The per-packet work is C++ (csrc/omni/worker/, a background thread in this process); the
job's aggregators are joined at init (hvd_sparse/session.py) and reach this scheme through the
job's context; this module turns one tensor into one submission to that session.
"""
from __future__ import annotations

import logging

import horovod.torch as hvd
import torch

from .. import _C
from ..engine import Job, Stage
from ..errors import HvdSparseError
from ..segments import local_mask, output
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
    out = output(job)  # results are scaled as they land, only in blocks some rank sent
    fallback = ctx.config.fallback == "dense"
    backup = t.clone() if fallback and job.inplace else None  # results overwrite the input
    ticket = session.worker.submit(session.tensor_id(job.name), t, out, job.block_size,
                                   job.meta & 0xFFFFFFFF, local_mask(job), job.name, job.scale)
    failure: str | None = None
    try:
        yield "omnireduce", _Ticket(session.worker, ticket)
    finally:  # also when abandoned: the engine must not keep writing into `out`
        try:
            stats = session.worker.finish(ticket)
        except RuntimeError as e:
            failure = f"hvd_sparse: {e}"
    if fallback:
        flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
        failed = yield "agree", hvd.allreduce_async(flag, name=job.op_name("agree"), op=hvd.Sum)
        if int(failed) > 0:
            log.warning("hvd_sparse: tensor %r: aggregation failed on %d rank(s) (%s); "
                        "reducing it dense", job.name, int(failed), failure or "on a peer")
            if backup is not None:
                t.copy_(backup)
            return (yield from dense.run(job))
    if failure is not None:
        raise HvdSparseError(failure)
    job.stats.update(scheme="omnireduce", bytes_sent=stats["bytes_sent"],
                     bytes_received=stats["bytes_received"], union=stats["union"],
                     retransmits=stats["retransmits"], rounds=stats["rounds"],
                     block_density=stats["nnz_local"] / max(1, -(-t.numel() // job.block_size)))
    return out
