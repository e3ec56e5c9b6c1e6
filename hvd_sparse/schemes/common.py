"""What several schemes share: the block mask and the result's buffer, decoding gathered
segments (allgather, Zen), the fixed-point agreement (switch, omnireduce in fixed point), and
one streamed submission to an aggregation session (omnireduce, switch)."""
from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from .. import blocks, fixedpoint
from .._C import AggregatorTimeout, OmniWorker, block_mask
from .._C import decode_sum as _decode_sum
from ..comm import Pending
from ..errors import HvdSparseError
from ..job import Job
from ..session import Session


def error(job: Job, e: Exception) -> HvdSparseError:
    return HvdSparseError(f"hvd_sparse: tensor {job.name!r}: {e}")


def local_mask(job: Job) -> torch.Tensor:
    """The block mask of the job's tensor, computed once and shared by the stages.

    In place, the same pass turns -0 in all-zero blocks into +0: then the tensor is +0 outside
    its non-zero blocks and the result need only rewrite the blocks some rank sent, which
    include those (see ``output``).
    """
    if job.mask is None:
        job.mask = block_mask(job.tensor, job.block_size, job.inplace)
    if job.stats.nnz_local is None:
        job.stats.nnz_local = int(job.mask.sum())
    return job.mask


def output(job: Job) -> torch.Tensor:
    """Where the result is written, +0 outside the blocks some rank sends: in place the tensor
    itself (see ``local_mask``), else fresh zeros, of which only the written pages cost anything
    (``blocks.zeros``)."""
    t = job.tensor
    return t if job.inplace else blocks.zeros(t.numel(), t.dtype)


class Backup:
    """The caller's tensor as it was before an in-place reduction overwrote it: its non-zero
    blocks copied (cost: the non-zero blocks, not the tensor), restored into a zeroed tensor
    (``local_mask`` left +0 everywhere else: all-zero blocks come back as +0)."""

    def __init__(self, job: Job) -> None:
        t, bs = job.tensor, job.block_size
        self.full = t.numel() // bs  # whole blocks; a partial last block is kept apart
        mask = local_mask(job)
        idx = mask[:self.full].nonzero().squeeze(1)
        self.idx, self.blocks = idx, t[:self.full * bs].view(self.full, bs).index_select(0, idx)
        tail = self.full < mask.numel() and bool(mask[self.full])
        self.tail = t[self.full * bs:].clone() if tail else None

    def restore(self, job: Job) -> None:
        t, bs = job.tensor, job.block_size
        t.zero_()
        t[:self.full * bs].view(self.full, bs).index_copy_(0, self.idx, self.blocks)
        if self.tail is not None:
            t[self.full * bs:] = self.tail


def decode_sum(job: Job, gathered: torch.Tensor, out: torch.Tensor, part_is_rank: bool) -> None:
    """Validates one segment per rank (csrc/segment.h) and writes their sum (added in rank order,
    scaled, rounded once) into ``out`` (from ``output``), touching only the blocks the segments
    carry."""
    t = job.tensor
    try:
        _counts, nnz, union = _decode_sum(
            gathered, out, job.block_size, job.meta, blocks.DTYPE_CODES[t.dtype], t.numel(),
            job.size, part_is_rank, scale=job.scale)
    except RuntimeError as e:
        raise error(job, e) from e
    nblocks = max(1, blocks.num_blocks(t.numel(), job.block_size))
    job.stats.nnz, job.stats.union = list(nnz), union
    job.stats.block_density = sum(nnz) / len(nnz) / nblocks


def agree(job: Job, *extra: float) -> Generator[tuple[str, Pending], Any,
                                                 tuple[int | None, list[float]]]:
    """Yields one max-allreduce of [max |x| over finite values, 1 if any value is NaN/Inf,
    *extra]; returns the job's fixed-point exponent, or None when some rank
    holds a non-finite value (the tensor must not go in fixed point: its NaN/Inf would be lost),
    and the maxima of ``extra`` over the ranks (what else a scheme agrees on in the same
    message)."""
    t = job.tensor
    lo, hi = (float(v) for v in torch.aminmax(t)) if t.numel() else (0.0, 0.0)
    nonfinite = not (math.isfinite(lo) and math.isfinite(hi))  # aminmax propagates NaN
    local = max(hi, -lo)
    if nonfinite:  # rare: the exact finite maximum costs one more pass
        local = float(t.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).max())
    vec = torch.tensor([local, 1.0 if nonfinite else 0.0, *extra], dtype=torch.float64)
    out = yield "scale", job.comm.allreduce(vec, job.op_name("scale"), "max")
    maxima = out[2:].tolist()
    if out[1] > 0:
        return None, maxima
    return fixedpoint.exponent(float(out[0]), job.size), maxima


class Ticket:
    """What the engine waits on: one submission to an aggregation session's worker engine."""

    def __init__(self, worker: OmniWorker, ticket: int) -> None:
        self.worker, self.ticket = worker, ticket

    def poll(self) -> bool:
        return self.worker.poll(self.ticket)

    def value(self) -> None:
        return None


def stream(job: Job, session: Session, out: torch.Tensor, exponent: int | None,
           stage: str, max_slots: int = 0) -> Generator[tuple[str, Ticket], Any, Failure | None]:
    """Submits the tensor to ``session`` (results land in ``out``, scaled; laid out on at most
    ``max_slots`` slots, alike on every rank, when not 0) and waits for it; returns None, or why
    it failed on this rank. On success the job's stats say what it took."""
    t = job.tensor
    ticket = session.worker.submit(session.tensor_id(job.name), t, out, job.block_size,
                                   job.meta & 0xFFFFFFFF, local_mask(job), job.name, job.scale,
                                   exponent, max_slots)
    failure, stats = yield from finished(job, session, ticket, stage)
    if failure is None:
        job.stats.block_density = stats["nnz_local"] / max(1, blocks.num_blocks(
            t.numel(), job.block_size))
    return failure


def finished(job: Job, session: Session, ticket: int, stage: str
             ) -> Generator[tuple[str, Ticket], Any, tuple[Failure | None, dict[str, Any]]]:
    """Waits for a submission to ``session``; returns (None, its counters and results) or (why it
    failed on this rank, {}). On success the job's stats say what it took."""
    failure: Failure | None = None
    stats: dict[str, Any] = {}
    try:
        yield stage, Ticket(session.worker, ticket)
    finally:  # also when abandoned: the engine must not keep writing into the output
        try:
            stats = session.worker.finish(ticket)
        except RuntimeError as e:
            failure = Failure(f"hvd_sparse: {e}", isinstance(e, AggregatorTimeout))
    if failure is None:
        s = job.stats
        s.bytes_sent, s.bytes_received = stats["bytes_sent"], stats["bytes_received"]
        s.union, s.retransmits, s.rounds = stats["union"], stats["retransmits"], stats["rounds"]
    return failure, stats


@dataclass(frozen=True)
class Failure:
    """Why a tensor's aggregation failed on this rank. ``timed_out``: an aggregator stopped
    answering (the worker engine's AggregatorTimeout), after which aggregation is down."""

    why: str
    timed_out: bool = False

    def __str__(self) -> str:
        return self.why


def failed_anywhere(job: Job, failure: Failure | None, what: str = "agree"
                    ) -> Generator[tuple[str, Pending], Any, tuple[int, int]]:
    """How many ranks' aggregation of the tensor failed, and how many of them because an
    aggregator stopped answering (one tiny allreduce): they must all fall back together, or
    none."""
    flags = [failure is not None, failure is not None and failure.timed_out]
    counts = yield what, job.comm.allreduce(torch.tensor(flags, dtype=torch.int32),
                                            job.op_name(what))
    return int(counts[0]), int(counts[1])
