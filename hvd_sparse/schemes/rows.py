"""Rows: sparse COO gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``) reduced from
their rows, never densified.

Each rank first sums its gradient's repeated rows (an embedding gradient holds one row per
lookup; Horovod's sparse path ships every one of them). Then the distinct rows travel one of two
ways, the same on every rank:

- allgathered: every rank receives every other rank's rows and sums them in rank order
  (csrc/rows.cpp). One header row per rank carries a fingerprint of the tensor's shape and
  dtype, so ranks that disagree raise instead of adding unrelated rows. A rank whose gradient
  repeats value rows (an ``EmbeddingBag``'s: each bag's row once per id) sends, when that is
  fewer bytes, every id with each run of equal rows once instead of its summed rows
  (``_sent``): B bags of L uniform ids are B rows of values, not about B x L.
- aggregated: each row is a block of the aggregation protocol, streamed to the job's
  aggregators, which sum the rows the ranks share and send the union back once
  (csrc/omni/worker/: ``submit_rows``); ranks that disagree on the shape are refused by the
  aggregators. With N ranks that share hot rows, each receives the union instead of N-1
  ranks' rows.

Which: the scheme the caller asked for ("omnireduce": aggregated; "auto": the way that was
faster when both were last tried on this tensor, see ``_way``; otherwise allgathered), given
aggregators, the whole job (not a process set) and rows that fit a packet. The aggregated
layout takes as many slots as the last union needs (``_slots``), not as the table would: a
slot sends a packet every round, however few of its rows are non-zero. Either way the
result is the same coalesced sparse tensor everywhere, at a cost proportional to the rows
touched, not to the table. A COO tensor with several sparse dimensions is reduced over its
linearized indices.
"""
from __future__ import annotations

import math
import time
from collections.abc import Generator, Sequence
from typing import Any

import torch

from .. import costmodel, protocol
from .._C import count_rows, gathered_uses, row_runs, sum_rows
from ..costmodel import NetModel
from ..engine import Stage
from ..errors import HvdSparseError
from ..job import Job, RowsPlan
from ..session import Session
from . import omnireduce
from .common import error, finished

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
RELEARN = 100  # "auto": every this many calls of a tensor, each way is tried again
ROUNDS = 2  # aggregated: union rows per lane the layout aims at
MARGIN = 0.9  # "auto": aggregated only when timed this much faster (one trial is noisy)


def supported(t: torch.Tensor) -> bool:
    return t.is_sparse and t.dtype in FLOATS and t.device.type == "cpu"


def run(job: Job) -> Stage:
    g = job.tensor
    k = g.sparse_dim()
    nrows = math.prod(g.shape[:k])
    s = job.stats
    s.nnz_local = int(g._nnz())
    session = job.ctx.omni
    plan = job.ctx.rows_plans.setdefault(job.name, RowsPlan())
    way = yield from _way(job, plan, g._values())
    t0 = time.perf_counter()
    out = None
    if way == "omnireduce":
        assert session is not None
        rows, vals = summed(g)
        s.rows_local = int(rows.numel())
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
            return failure

        if (yield from omnireduce.guarded(job, session, attempt)):
            s.scheme = "rows+omnireduce"
    if out is None:
        way = "allgather"
        *out, plan.gathered = yield from _allgathered(job, g, nrows)
    seconds = time.perf_counter() - t0
    plan.seconds[way] = min(seconds, plan.seconds.get(way, math.inf)) if plan.trying else seconds
    plan.union = int(out[0].numel())
    out_rows, out_vals = out
    indices = out_rows.unsqueeze(0) if k == 1 else _unravel(out_rows, g.shape[:k])
    return torch.sparse_coo_tensor(indices, out_vals, g.shape, is_coalesced=True,
                                   check_invariants=False)  # sorted and distinct by construction


def _way(job: Job, plan: RowsPlan, vals: torch.Tensor) -> Generator[Any, Any, str]:
    """How the rows travel this time, "allgather" or "omnireduce", alike on every rank. Under
    "auto", measured rather than modelled: every RELEARN calls of the tensor, two calls each
    way (the faster counts), then the ranks agree (one tiny max-allreduce) on the way that was
    faster on the slowest rank, aggregation by at least 1 - MARGIN, until the next trial. The
    aggregated calls are skipped where the first call's union and bytes say they cannot win
    (``may_win``): each can cost many allgathers' time."""
    session, asked = job.ctx.omni, job.asked
    row_bytes = math.prod(vals.shape[1:]) * vals.element_size()
    if (session is None or not job.comm.is_global or asked not in ("omnireduce", "auto")
            or row_bytes > session.payload):
        return "allgather"
    if asked == "omnireduce":
        return "omnireduce"
    plan.calls += 1
    trial = plan.calls % RELEARN
    if trial == 1:
        plan.seconds.clear()
        plan.skipped = False
    elif trial == 2 and not may_win(job.ctx.net, job.size, plan.union, plan.gathered,
                                    row_bytes):
        plan.skipped, plan.aggregate, plan.decided = True, False, {}
    if plan.skipped:
        plan.trying = False
        return "allgather"
    plan.trying = trial in (1, 2, 3, 4)
    if plan.trying:  # each way twice, the faster counts: a first call pays for setting up
        return ("allgather", "omnireduce")[(trial - 1) % 2]
    if trial == 5:
        mine = [plan.seconds.get(w, math.inf) for w in ("allgather", "omnireduce")]
        slowest = yield "trial", job.comm.allreduce(torch.tensor(mine, dtype=torch.float64),
                                                   job.op_name("trial"), "max")
        plan.decided = {"allgather": float(slowest[0]), "omnireduce": float(slowest[1])}
        plan.aggregate = bool(slowest[1] < MARGIN * slowest[0])
    return "omnireduce" if plan.aggregate else "allgather"


def may_win(m: NetModel, n: int, union: int, gathered: int, row_bytes: int) -> bool:
    """Whether aggregating a tensor's rows could beat allgathering them, by the network model
    ``m``: aggregation's per-byte term alone (a lower bound of its time: the ``union`` rows
    through the busiest aggregator link, the ``n`` ranks' rows spread evenly) against the
    allgather of the ``gathered`` bytes (every rank's, together) that a call moved. Alike on
    every rank when its arguments are. True where ``m`` is the untimed default, or nothing
    was gathered yet: nothing to go by."""
    if m.omnireduce is None or m.source == "default" or not gathered:
        return True
    # the fewest rows in (the union once, spread evenly) and out (each rank all but its own
    # share: the union's rows held by one rank each, which do not come back to it)
    spread = [union / n] * n
    alone = spread if n > 1 else None
    through = (costmodel.aggregation_link_blocks(spread, union, m.aggregator_hosts, alone)
               if m.link_bps else (n if n > 1 else 2) * union)
    return m.omnireduce[2] * through * row_bytes < MARGIN * (m.allgather[0]
                                                             + m.allgather[1] * gathered)


def _slots(plan: RowsPlan, session: Session, nrows: int, width: int, esize: int) -> int:
    """Slots for the rows' layout, alike on every rank: a union far smaller than the table
    would otherwise be spread over every slot, a packet per slot and round however few rows
    it holds; so about ROUNDS union rows per lane of the last union seen (at least a slot per
    aggregator), or the engine's default while none was."""
    if not plan.union:
        return 0
    lanes = protocol.layout(nrows, width, esize, session.payload, 1)[0]
    return max(len(session.addrs), math.ceil(plan.union / (ROUNDS * lanes)))


def _allgathered(job: Job, g: torch.Tensor, nrows: int) -> Stage:
    header = -1 - job.meta  # negative: never a row; sum_rows skips it
    ids, runs, vals = _sent(job, g, nrows)
    # The allgather only moves values: bfloat16 (which Horovod 0.28 lacks) travels as its bits.
    bf16 = vals.dtype == torch.bfloat16
    rows_parts, runs_parts, vals_parts = yield "rows", job.comm.allgather_many(
        [torch.cat([torch.tensor([header]), ids]), runs, vals.view(torch.int16) if bf16 else vals],
        job.op_name("rows"))
    # the indices joined (8 bytes a row); the values summed where they landed
    all_rows, all_runs = torch.cat(rows_parts), torch.cat(runs_parts)
    if bf16:
        vals_parts = [v.view(torch.bfloat16) for v in vals_parts]
    nvals = sum(v.shape[0] for v in vals_parts)
    try:  # the ranks' headers and runs checked, and undone
        uses = gathered_uses(all_rows, header, all_runs, nvals, job.size)
        out_rows, out_vals = sum_rows(all_rows, vals_parts, nrows, job.scale, uses)
    except RuntimeError as e:
        raise error(job, e) from e
    n = job.size
    gathered = (all_rows.nbytes + all_runs.nbytes) + sum(v.nbytes for v in vals_parts)
    own = (ids.numel() + 1 + runs.numel()) * 8 + vals.nbytes  # header rows included
    s = job.stats
    s.scheme = "rows"
    s.union = int(out_rows.numel())
    s.bytes_sent, s.bytes_received = int(gathered * (n - 1) / n), gathered - own
    return out_rows, out_vals, gathered


def _sent(job: Job, g: torch.Tensor, nrows: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What this rank sends: (row of every value row it sends, its runs, a zero row then the
    value rows). Either its summed distinct rows (runs ``[0]``: a value each), or, when fewer
    bytes, the gradient as it came with each run of bit-identical value rows sent once (runs
    ``[m, len_1 .. len_m]``): an ``EmbeddingBag``'s gradient repeats its bag's row for each
    id of the bag, so a batch of B bags of L ids sends B rows of values, not up to B x L."""
    v = g._values().contiguous()
    n = v.shape[0]
    if not g.is_coalesced() and n >= 2 and v[0].numel():
        row_bytes = v[0].nbytes
        first = row_runs(v)
        m = first.numel()
        cost = m * row_bytes + (n + m) * 8  # the runs' values, every id, their lengths
        line = _line(g)
        # against the summed rows, a value and an id each: first their bound, n, then their
        # count, which costs a sort
        if cost < n * (row_bytes + 8) and cost < (distinct := count_rows(line, nrows)) * (
                row_bytes + 8):
            job.stats.rows_local = distinct
            out = v.new_empty((m + 1, *v.shape[1:]))
            out[0] = 0
            torch.index_select(v, 0, first, out=out[1:])
            lens = torch.diff(first, append=torch.tensor([n]))
            return line, torch.cat([torch.tensor([m]), lens]), out
    rows, vals = summed(g)
    job.stats.rows_local = int(rows.numel())
    zero = vals.new_zeros((1, *vals.shape[1:]))
    return rows, torch.zeros(1, dtype=torch.int64), torch.cat([zero, vals])


def device_parts(g: torch.Tensor, meta: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What this rank allgathers of sparse ``g`` where it is (a device's rows, by the model's
    process group): its distinct rows (summed in float32, float64 for float64) after a header
    row fingerprinting the shape and dtype (``-1 - meta``), and their values after a zero row.
    Torch operations on ``g``'s device; ``device_sum`` undoes it."""
    k = g.sparse_dim()
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    c = torch.sparse_coo_tensor(_line(g).unsqueeze(0), g._values().to(acc),
                                (math.prod(g.shape[:k]), *g.shape[k:])).coalesce()
    ids = torch.cat([torch.tensor([-1 - meta], device=g.device), c.indices()[0]])
    vals = c.values().to(g.dtype)
    return ids, torch.cat([vals.new_zeros((1, *vals.shape[1:])), vals])


def device_sum(g: torch.Tensor, meta: int, ids_parts: Sequence[torch.Tensor],
               vals_parts: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """Every rank's ``device_parts`` (in rank order) summed where they are: the coalesced sparse
    tensor of ``g``'s shape, each row's values added in rank order in float32 (float64), times
    ``scale``, rounded once; the same bits on every rank (a rank's rows are distinct, so each
    ``index_add_`` adds at most one value to a row).

    Raises:
        HvdSparseError: a rank's header differs: the ranks disagree on the shape or dtype.
    """
    for r, ids in enumerate(ids_parts):
        if ids.numel() == 0 or int(ids[0]) != -1 - meta:
            raise HvdSparseError(
                f"hvd_sparse: sparse gradient of shape {tuple(g.shape)} ({g.dtype}): tensor "
                f"mismatch across ranks: rank {r}'s differs in shape or dtype")
    ids = torch.cat([p[1:] for p in ids_parts])
    out_rows, where = torch.unique(ids, sorted=True, return_inverse=True)
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    k = g.sparse_dim()
    total = torch.zeros((out_rows.numel(), *g.shape[k:]), dtype=acc, device=g.device)
    at = 0
    for v in vals_parts:
        total.index_add_(0, where[at:at + v.shape[0] - 1], v[1:].to(acc))
        at += v.shape[0] - 1
    indices = out_rows.unsqueeze(0) if k == 1 else _unravel(out_rows, g.shape[:k])
    return torch.sparse_coo_tensor(indices, (total * scale).to(g.dtype), g.shape,
                                   is_coalesced=True, check_invariants=False)


def fuse(grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Sparse COO tensors of one row shape and dtype (several embedding tables' gradients) as
    one: their rows one after another, reduced by one exchange instead of one each. Returns the
    tensor and where each one's rows start (``split`` undoes it). Each is summed by rows first:
    an embedding's gradient holds a row per lookup, its sum only the distinct ones."""
    offsets, lines, vals = [0], [], []
    for g in grads:
        line, v = summed(g)
        lines.append(line + offsets[-1])
        vals.append(v)
        offsets.append(offsets[-1] + math.prod(g.shape[:g.sparse_dim()]))
    rows_shape = grads[0].shape[grads[0].sparse_dim():]
    fused = torch.sparse_coo_tensor(torch.cat(lines).unsqueeze(0), torch.cat(vals),
                                    (offsets[-1], *rows_shape), check_invariants=False)
    return fused, offsets


def split(fused: torch.Tensor, shapes: Sequence[torch.Size], offsets: list[int]
          ) -> list[torch.Tensor]:
    """``fuse``'s tensors back from its reduced (coalesced) result."""
    line, vals = fused._indices()[0], fused._values()
    cuts = torch.searchsorted(line, torch.tensor(offsets)).tolist()
    out = []
    for j, shape in enumerate(shapes):
        k = len(shape) - (vals.dim() - 1)
        mine = line[cuts[j]:cuts[j + 1]] - offsets[j]
        indices = mine.unsqueeze(0) if k == 1 else _unravel(mine, shape[:k])
        out.append(torch.sparse_coo_tensor(indices, vals[cuts[j]:cuts[j + 1]], shape,
                                           is_coalesced=True, check_invariants=False))
    return out


def summed(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A COO tensor's distinct rows (linearized over its sparse dimensions, sorted) and their
    sums (a coalesced tensor's own), added in float32 (float64 for float64) and rounded once:
    ``coalesce`` adds 16-bit duplicates in 16 bits."""
    if g.is_coalesced():
        return _line(g), g._values()
    return sum_rows(_line(g), g._values().contiguous(), math.prod(g.shape[:g.sparse_dim()]))


def _line(g: torch.Tensor) -> torch.Tensor:
    """A COO tensor's row of every value row, linearized over its sparse dimensions."""
    k, idx = g.sparse_dim(), g._indices()
    return (idx[0] if k == 1 else _linear(idx, g.shape[:k])).contiguous()


def _linear(idx: torch.Tensor, dims: torch.Size) -> torch.Tensor:
    strides = torch.tensor([math.prod(dims[d + 1:]) for d in range(len(dims))])
    return (idx * strides.unsqueeze(1)).sum(0)


def _unravel(line: torch.Tensor, dims: torch.Size) -> torch.Tensor:
    out = []
    for d in reversed(dims):
        out.append(line % d)
        line = line // d
    return torch.stack(out[::-1])
