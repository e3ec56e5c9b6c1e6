"""Rows: sparse COO gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``) reduced from
their rows, never densified.

Each rank first sums its gradient's repeated rows (an embedding gradient holds one row per
lookup; Horovod's sparse path ships every one of them). Then the distinct rows travel one of two
ways, the same on every rank:

- allgathered: every rank receives every other rank's rows and sums them in rank order
  (csrc/rows.cpp). One header row per rank carries a fingerprint of the tensor's shape and
  dtype, so ranks that disagree raise instead of adding unrelated rows.
- aggregated: each row is a block of the aggregation protocol, streamed to the job's
  aggregators, which sum the rows the ranks share and send the union back once
  (csrc/omni/worker/: ``submit_rows``); ranks that disagree on the shape are refused by the
  aggregators. With N ranks that share hot rows, each receives the union instead of N-1
  ranks' rows.

Which: the scheme the caller asked for ("omnireduce": aggregated; "auto": the cost model's
choice from what the last allgather of the tensor showed; otherwise allgathered), given
aggregators, the whole job (not a process set) and rows that fit a packet. Either way the
result is the same coalesced sparse tensor everywhere, at a cost proportional to the rows
touched, not to the table. A COO tensor with several sparse dimensions is reduced over its
linearized indices.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .. import costmodel, protocol
from .._C import sum_rows
from ..engine import Stage
from ..errors import HvdSparseError
from ..job import Job
from ..session import Session
from . import omnireduce
from .common import error, finished

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
RELEARN = 64  # "auto": every this many calls of a tensor, an allgather updates what it knows
ROUNDS = 2  # aggregated: union rows per lane the layout aims at


@dataclass
class Plan:
    """What "auto" knows of one sparse tensor, the same on every rank (learnt from allgathers,
    which show every rank's rows)."""

    calls: int = 0
    nnz: list[int] = field(default_factory=list)  # each rank's distinct rows, last allgather
    union: int = 0


def supported(t: torch.Tensor) -> bool:
    return t.is_sparse and t.dtype in FLOATS and t.device.type == "cpu"


def run(job: Job) -> Stage:
    g = job.tensor
    k = g.sparse_dim()
    nrows = math.prod(g.shape[:k])
    idx, vals = g._indices(), g._values().contiguous()
    line = idx[0] if k == 1 else _linear(idx, g.shape[:k])
    rows, vals = sum_rows(line.contiguous(), vals, nrows)
    s = job.stats
    s.nnz_local, s.rows_local = int(idx.shape[1]), int(rows.numel())
    session = job.ctx.omni
    plan = job.ctx.rows_plans.setdefault(job.name, Plan())
    out = None
    if _aggregate(job, plan, nrows, vals):
        assert session is not None
        width = math.prod(vals.shape[1:])
        flat = vals.reshape(rows.numel(), width)

        def attempt():
            ticket = session.worker.submit_rows(
                session.tensor_id(job.name), rows, flat, nrows, job.meta & 0xFFFFFFFF, job.name,
                job.scale, None, _slots(plan, session, nrows, width, vals.element_size()))
            failure, result = yield from finished(job, session, ticket, "omnireduce")
            nonlocal out
            if failure is None:
                out = result["rows"], result["values"].view(-1, *vals.shape[1:])
                plan.union = int(result["union"])
            return failure

        if (yield from omnireduce.guarded(job, session, attempt)):
            s.scheme = "rows+omnireduce"
    if out is None:
        out = yield from _allgathered(job, rows, vals, nrows)
    out_rows, out_vals = out
    indices = out_rows.unsqueeze(0) if k == 1 else _unravel(out_rows, g.shape[:k])
    return torch.sparse_coo_tensor(indices, out_vals, g.shape, is_coalesced=True,
                                   check_invariants=False)  # sorted and distinct by construction


def _aggregate(job: Job, plan: Plan, nrows: int, vals: torch.Tensor) -> bool:
    """Whether the rows go to the aggregators, decided alike on every rank."""
    session, asked = job.ctx.omni, job.asked
    width = math.prod(vals.shape[1:])
    if (session is None or not job.comm.is_global or asked not in ("omnireduce", "auto")
            or width * vals.element_size() > session.payload):
        return False
    plan.calls += 1
    if asked == "omnireduce":
        return True
    if not plan.nnz or plan.calls % RELEARN == 0:
        return False  # allgathered: it shows every rank's rows and the union
    net = job.ctx.net
    if net.omnireduce is not None:  # the rows' own layout: fewer slots than a dense tensor's
        slots = _slots(plan, session, nrows, width, vals.element_size())
        net = dataclasses.replace(net, omni_layout=(net.omni_layout[0], slots))
    p = costmodel.predict(net, nrows * width, vals.element_size(), width, plan.nnz, plan.union)
    job.stats.predicted_ms = {k: round(v * 1e3, 3) for k, v in p.seconds.items()
                              if k in ("allgather", "omnireduce")}
    return p.seconds.get("omnireduce", math.inf) < p.seconds["allgather"]


def _slots(plan: Plan, session: Session, nrows: int, width: int, esize: int) -> int:
    """Slots for the rows' layout, alike on every rank: a union far smaller than the table
    would otherwise be spread over every slot, a packet per slot and round however few rows
    it holds; so about ROUNDS union rows per lane of the last union seen (at least a slot per
    aggregator), or the engine's default while none was."""
    if not plan.union:
        return 0
    lanes = protocol.layout(nrows, width, esize, session.payload, 1)[0]
    return max(len(session.addrs), math.ceil(plan.union / (ROUNDS * lanes)))


def _allgathered(job: Job, rows: torch.Tensor, vals: torch.Tensor, nrows: int
                 ) -> Stage:
    header = torch.tensor([-1 - job.meta])  # negative: never a row; sum_rows skips it
    vals = torch.cat([vals.new_zeros((1, *vals.shape[1:])), vals])
    # The allgather only moves values: bfloat16 (which Horovod 0.28 lacks) travels as its bits.
    bf16 = vals.dtype == torch.bfloat16
    all_rows, all_vals = yield "rows", job.comm.allgather_many(
        [torch.cat([header, rows]), vals.view(torch.int16) if bf16 else vals],
        job.op_name("rows"))
    if bf16:
        all_vals = all_vals.view(torch.bfloat16)
    starts = (all_rows < 0).nonzero().squeeze(1)
    if starts.numel() != job.size or bool((all_rows[starts] != header).any()):
        raise HvdSparseError(f"hvd_sparse: tensor {job.name!r}: tensor mismatch across ranks: "
                             "the ranks' sparse gradients differ in shape or dtype")
    try:
        out_rows, out_vals = sum_rows(all_rows, all_vals, nrows, job.scale)
    except RuntimeError as e:
        raise error(job, e) from e
    n = job.size
    gathered = all_rows.numel() * all_rows.element_size() + all_vals.nbytes
    own = (rows.numel() + 1) * rows.element_size() + vals.nbytes  # header rows included
    s = job.stats
    s.scheme = "rows"
    s.union = int(out_rows.numel())
    s.bytes_sent, s.bytes_received = int(gathered * (n - 1) / n), gathered - own
    plan = job.ctx.rows_plans.setdefault(job.name, Plan())
    counts = torch.diff(starts, append=torch.tensor([all_rows.numel()])) - 1
    plan.nnz, plan.union = counts.tolist(), s.union
    return out_rows, out_vals


def _linear(idx: torch.Tensor, dims: torch.Size) -> torch.Tensor:
    strides = torch.tensor([math.prod(dims[d + 1:]) for d in range(len(dims))])
    return (idx * strides.unsqueeze(1)).sum(0)


def _unravel(line: torch.Tensor, dims: torch.Size) -> torch.Tensor:
    out = []
    for d in reversed(dims):
        out.append(line % d)
        line = line // d
    return torch.stack(out[::-1])
