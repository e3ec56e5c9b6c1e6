"""OmniReduce: stream only non-zero blocks to aggregator processes, which sum and return them.

The per-packet work is C++ (csrc/omni/worker/, a background thread in this process); the
job's aggregators are joined at init (hvd_sparse/session.py) and reach this scheme through the
job's context; this module turns one tensor into one submission to that session
(``common.stream``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from typing import Any

import torch

from ..config import format_address
from ..engine import Stage
from ..errors import HvdSparseError
from ..job import Job
from ..session import Session
from . import dense
from .common import Backup, Failure, agree, failed_anywhere, output, stream

log = logging.getLogger("hvd_sparse")
_warned: set[str] = set()  # tensors already said to go dense on a process set


def run(job: Job) -> Stage:
    ctx = job.ctx
    session = ctx.omni
    if not job.comm.is_global:
        # The aggregators sum over every rank of the job. Falls back, never raises: only the
        # set's ranks get here (Horovod's optimizer calls compress on them alone), so an error
        # would stop them while the ranks outside go on, into the next collective (a hang).
        job.stats.reason = "process set"
        if job.name not in _warned:  # once per tensor, not at every step
            _warned.add(job.name)
            log.warning("hvd_sparse: tensor %r: scheme 'omnireduce' sums over every rank of "
                        "the job, not over process set %s: reducing it dense", job.name,
                        job.comm.ranks)
        return (yield from dense.run(job))
    if session is None:
        raise HvdSparseError(
            f"hvd_sparse: tensor {job.name!r}: scheme 'omnireduce' needs aggregators: set "
            "HVD_SPARSE_AGGREGATORS=host:port,... or leave local_aggregators on")
    exponent = None
    if ctx.config.fixed_point:
        exponent, _ = yield from agree(job)
        if exponent is None:  # fixed point cannot carry NaN/Inf: dense propagates them exactly
            job.stats.reason = "non-finite"
            log.info("hvd_sparse: tensor %r holds NaN or Inf on some rank; reducing it dense",
                     job.name)
            return (yield from dense.run(job))
    out = output(job)  # results are scaled as they land, only in blocks some rank sent

    def attempt() -> Generator[Any, Any, Failure | None]:
        return (yield from stream(job, session, out, exponent, "omnireduce"))

    # in place, results overwrite the input: kept to restore it if the attempt fails
    backup = (lambda: Backup(job)) if job.inplace else None
    if not (yield from guarded(job, session, attempt, backup)):
        return (yield from dense.run(job))
    job.stats.scheme = "omnireduce"
    return out


def guarded(job: Job, session: Session, attempt: Callable[[], Generator[Any, Any,
                                                                        Failure | None]],
            make_backup: Callable[[], Backup] | None = None) -> Generator[Any, Any, bool]:
    """Runs ``attempt`` (a submission to the job's aggregators) unless they are down, and
    returns whether it succeeded; False tells the caller to reduce the tensor another way,
    alike on every rank (fallback="dense": the ranks agree on it), or raises (fallback="error").
    ``make_backup``: what saves a tensor reduced in place, called just before the attempt (not
    while the aggregators are down); restored when the attempt fails."""
    fallback = job.ctx.config.fallback == "dense"
    if (session.down or session.lost) and session.retry_due(job.name):
        if fallback:  # every rank looks at this call: the job regroups over those answering
            yield from regroup(job, session)
        elif session.down and session.answered_since_down():  # error: this rank alone
            log.warning("hvd_sparse: the aggregators answer again; aggregation resumes")
            session.down = ""
    if session.down:  # no timeout again for every tensor while an aggregator is down
        if fallback:
            job.stats.reason = "aggregator down"
            return False
        raise HvdSparseError(f"hvd_sparse: tensor {job.name!r}: not aggregated, an aggregator "
                             f"is down (it resumes when they answer again): {session.down}")
    backup = make_backup() if make_backup is not None else None
    failure = yield from attempt()
    if fallback:
        failed, timed_out = yield from failed_anywhere(job, failure)
        if timed_out:
            session.mark_down(str(failure or "an aggregator stopped answering a peer rank"))
            session.probe()  # the next look regroups over those that answer
        if failed:
            log.warning("hvd_sparse: tensor %r: aggregation failed on %d rank(s) (%s); "
                        "reducing it another way", job.name, failed, failure or "on a peer")
            job.stats.reason = "aggregation failed"
            if backup is not None:
                backup.restore(job)
            return False
    if failure is not None:
        if failure.timed_out:
            session.mark_down(str(failure))
        why = str(failure)
        if backup is not None:  # never half a result: the caller's tensor as it was
            backup.restore(job)
            why += " (the tensor reduced in place is left as it was)"
        raise HvdSparseError(why)
    return True


def regroup(job: Job, session: Session) -> Generator[Any, Any, None]:
    """A look (fallback="dense", at the same call on every rank): the aggregators that answer
    every rank's probe (``Session.votes``; one tiny allreduce) carry the job from here, under
    a new epoch. Those in use that stopped answering are left out and the slots re-sharded
    over the others; lost ones that answer again, at the address their name resolves to now,
    are taken back. None answering: aggregation stays down (tensors go dense) until a later
    look."""
    votes = torch.tensor(session.votes(), dtype=torch.int32)
    counts = yield "alive", job.comm.allreduce(votes, job.op_name("alive"))
    live = [a for a, n in zip(session.names, counts.tolist(), strict=True) if n == job.size]
    if not live or (live == session.addrs and not session.down):
        return
    why = session.regroup(live)  # back from down too: the probes moved those to a new epoch
    failed, _ = yield from failed_anywhere(job, Failure(why) if why else None, "regrouped")
    if failed:
        session.mark_down(f"regrouping failed on {failed} rank(s): {why or 'on a peer rank'}")
        return
    session.down = ""
    log.warning("hvd_sparse: aggregation resumes over %d of the job's %d aggregators%s",
                len(live), len(session.names),
                f" ({', '.join(format_address(h, p) for h, p in session.lost)} lost)"
                if session.lost else "")
