"""Switch: the network sums the tensor. Workers stream non-zero blocks, in fixed point, to a
switch that aggregates them in its registers and multicasts the sums (the emulated one:
hvd_sparse/tools/switch/, csrc/switch/; docs/PROTOCOL.md "In-network aggregation").

A switch sums a packet in one pass of its pipe (256 B of values: docs/PROTOCOL.md), so blocks
too large for one of its slots are halved until a packet of them fits (``block_size``): finer
blocks, alike on every rank.

Per tensor: one tiny max-allreduce agrees on the fixed-point exponent and on the tensor's turn
(session.Turns: the switch takes one tensor at a time, in the same order on every rank); then
the blocks go through the switch like an omnireduce submission. Whatever the switch cannot do
(no switch joined, a process set, NaN/Inf, float64 unless
``switch_fixed_float64`` allows its rounding, any failure on any rank) goes elsewhere, never
as a wrong or silently rounded sum: to the aggregators when there are, else dense,
with the reason logged and in the tensor's metrics ("reason").
"""
from __future__ import annotations

import logging
import math

import torch

from ..engine import Stage
from ..job import Job
from ..session import Session
from . import dense, omnireduce
from .common import Backup, agree, failed_anywhere, local_mask, output, stream

log = logging.getLogger("hvd_sparse")
ROUNDS, IN_FLIGHT = 8, 256  # slots(): union blocks per slot, and the fewest slots


class _Turn:
    """Ready when the tensor numbered ``number`` may stream through the switch."""

    def __init__(self, session: Session, number: int) -> None:
        self.session, self.number = session, number

    def poll(self) -> bool:
        assert self.session.turns is not None
        return self.session.turns.mine(self.number)

    def value(self) -> None:
        return None


def slots(n: int, most: int) -> int:
    """Slots for a tensor whose ranks hold at most ``most`` non-zero blocks each: about
    ROUNDS rounds of its union (at most ``n`` x ``most`` blocks) per slot, but never fewer than
    IN_FLIGHT. A slot sends a packet every round, its first even where no rank holds a block,
    so a sparse tensor spread over every slot pays an empty round per slot; each slot is also
    one packet in flight per worker, and IN_FLIGHT is above rate x RTT of the testbeds (about
    100 packets at 100 Mbit/s). The switch caps it at its groups."""
    return max(IN_FLIGHT, math.ceil(n * most / ROUNDS))


def unsupported(job: Job, session: Session | None) -> str:
    """Why the switch cannot take this tensor ("" when it can): decided alike on every rank."""
    if session is None:
        return "no switch"
    if not job.comm.is_global:
        return "process set"
    if job.tensor.dtype == torch.float64 and not job.ctx.config.switch_fixed_float64:
        return "float64 (fixed point would round it; switch_fixed_float64 allows that)"
    return ""


def run(job: Job) -> Stage:
    session = job.ctx.switch
    why = unsupported(job, session)
    if why:
        return (yield from elsewhere(job, why))
    assert session is not None and session.turns is not None
    if (bs := session.switch_block(job.block_size)) != job.block_size:  # the mask again, finer
        job.block_size, job.mask, job.stats.nnz_local = bs, None, None
    turns = session.turns
    exponent, (number, most) = yield from agree(
        job, float(turns.issue()) if job.rank == 0 else -1.0, float(local_mask(job).sum()))
    number = int(number)
    if exponent is None:  # fixed point cannot carry NaN/Inf
        turns.done(number)
        return (yield from elsewhere(job, "non-finite"))
    try:
        yield "turn", _Turn(session, number)
        backup = Backup(job) if job.inplace else None  # results overwrite the input
        out = output(job)
        failure = yield from stream(job, session, out, exponent, "switch",
                                    slots(job.size, int(most)))
    finally:
        turns.done(number)
    failed, _ = yield from failed_anywhere(job, failure)
    if failed:
        if backup is not None:
            backup.restore(job)
        return (yield from elsewhere(job, f"failed on {failed} rank(s): "
                                          f"{failure or 'on a peer'}"))
    job.stats.scheme = "switch"
    return out


def elsewhere(job: Job, why: str) -> Stage:
    """The tensor without the switch: the aggregators when the job has them, else dense."""
    job.stats.reason = f"switch: {why}"
    level = (logging.DEBUG if why == "no switch" else logging.INFO if why.startswith("float64")
             else logging.WARNING)
    log.log(level, "hvd_sparse: tensor %r: not through the switch (%s)", job.name, why)
    if job.ctx.omni is not None and job.comm.is_global:
        return (yield from omnireduce.run(job))
    return (yield from dense.run(job))
