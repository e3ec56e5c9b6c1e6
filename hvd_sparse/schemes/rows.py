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

from .. import protocol
from .._C import sum_rows
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
    rows, vals, nrows = _summed(g)
    s = job.stats
    s.nnz_local, s.rows_local = int(g._nnz()), int(rows.numel())
    session = job.ctx.omni
    plan = job.ctx.rows_plans.setdefault(job.name, RowsPlan())
    way = yield from _way(job, plan, vals)
    t0 = time.perf_counter()
    out = None
    if way == "omnireduce":
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
            return failure

        if (yield from omnireduce.guarded(job, session, attempt)):
            s.scheme = "rows+omnireduce"
    if out is None:
        way = "allgather"
        out = yield from _allgathered(job, g, rows, vals, nrows)
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
    faster on the slowest rank, aggregation by at least 1 - MARGIN, until the next trial."""
    session, asked = job.ctx.omni, job.asked
    if (session is None or not job.comm.is_global or asked not in ("omnireduce", "auto")
            or math.prod(vals.shape[1:]) * vals.element_size() > session.payload):
        return "allgather"
    if asked == "omnireduce":
        return "omnireduce"
    plan.calls += 1
    trial = plan.calls % RELEARN
    if trial == 1:
        plan.seconds.clear()
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


def _slots(plan: RowsPlan, session: Session, nrows: int, width: int, esize: int) -> int:
    """Slots for the rows' layout, alike on every rank: a union far smaller than the table
    would otherwise be spread over every slot, a packet per slot and round however few rows
    it holds; so about ROUNDS union rows per lane of the last union seen (at least a slot per
    aggregator), or the engine's default while none was."""
    if not plan.union:
        return 0
    lanes = protocol.layout(nrows, width, esize, session.payload, 1)[0]
    return max(len(session.addrs), math.ceil(plan.union / (ROUNDS * lanes)))


def _allgathered(job: Job, g: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor, nrows: int
                 ) -> Stage:
    header = torch.tensor([-1 - job.meta])  # negative: never a row; sum_rows skips it
    ids, runs, vals = _sent(g, rows, vals)
    vals = torch.cat([vals.new_zeros((1, *vals.shape[1:])), vals])
    # The allgather only moves values: bfloat16 (which Horovod 0.28 lacks) travels as its bits.
    bf16 = vals.dtype == torch.bfloat16
    all_rows, all_runs, all_vals = yield "rows", job.comm.allgather_many(
        [torch.cat([header, ids]), runs, vals.view(torch.int16) if bf16 else vals],
        job.op_name("rows"))
    if bf16:
        all_vals = all_vals.view(torch.bfloat16)
    starts = (all_rows < 0).nonzero().squeeze(1)
    if starts.numel() != job.size or bool((all_rows[starts] != header).any()):
        raise HvdSparseError(f"hvd_sparse: tensor {job.name!r}: tensor mismatch across ranks: "
                             "the ranks' sparse gradients differ in shape or dtype")
    uses = _uses(job, starts, all_rows.numel(), all_runs, all_vals.shape[0])
    try:
        out_rows, out_vals = sum_rows(all_rows, all_vals, nrows, job.scale, uses)
    except RuntimeError as e:
        raise error(job, e) from e
    n = job.size
    gathered = sum(t.numel() * t.element_size() for t in (all_rows, all_runs, all_vals))
    own = (ids.numel() + 1 + runs.numel()) * 8 + vals.nbytes  # header rows included
    s = job.stats
    s.scheme = "rows"
    s.union = int(out_rows.numel())
    s.bytes_sent, s.bytes_received = int(gathered * (n - 1) / n), gathered - own
    return out_rows, out_vals


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _sent(g: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What this rank sends: (row of every value it sends, its runs, the values). Either its
    summed distinct rows (runs ``[0]``: a value each), or, when fewer bytes, the gradient as
    it came with each run of bit-identical value rows sent once (runs ``[m, len_1 .. len_m]``):
    an ``EmbeddingBag``'s gradient repeats its bag's row for each id of the bag, so a batch of
    B bags of L ids sends B rows of values, not up to B x L."""
    plain = rows, torch.zeros(1, dtype=torch.int64), vals
    v = g._values()
    n = v.shape[0]
    if g.is_coalesced() or n < 2 or v[0].numel() == 0:
        return plain
    row_bytes = v[0].nbytes

    def fewer(m: int) -> bool:  # m runs' values, every id and the lengths, against the sums
        return m * row_bytes + (n + m) * 8 < rows.numel() * (row_bytes + 8)

    bits = v.reshape(n, -1).view(_BITS[v.element_size()])
    # rows that differ from the last in their first element start runs: at least that many
    # runs, so an Embedding's gradient (no runs) costs one column's look, not every element's
    if not fewer(1 + int((bits[1:, 0] != bits[:-1, 0]).sum())):
        return plain
    first = torch.cat([torch.ones(1, dtype=torch.bool), (bits[1:] != bits[:-1]).any(1)])
    first = first.nonzero().squeeze(1)
    m = first.numel()
    if not fewer(m):
        return plain
    lens = torch.diff(first, append=torch.tensor([n]))
    k = g.sparse_dim()
    line = g._indices()[0] if k == 1 else _linear(g._indices(), g.shape[:k])
    return line.contiguous(), torch.cat([torch.tensor([m]), lens]), v[first]


def _uses(job: Job, starts: torch.Tensor, nrows_sent: int, runs: torch.Tensor, nvals: int
          ) -> torch.Tensor | None:
    """The value row of every gathered row (``_sent``'s runs undone), or None when every rank
    sent a value per row. Each rank's part: a header row (its value row a zero row) then its
    rows; its runs ``[0]`` or ``[m, lengths]`` with lengths summing to its rows."""
    counts = torch.diff(starts, append=torch.tensor([nrows_sent])) - 1
    out, at, base = [], 0, 0
    for r, c in enumerate(counts.tolist()):
        m = int(runs[at]) if at < runs.numel() else -1
        lens = runs[at + 1:at + 1 + m]
        if m < 0 or lens.numel() != m or (m and (int(lens.sum()) != c or bool((lens < 1).any()))):
            raise HvdSparseError(f"hvd_sparse: tensor {job.name!r}: rank {r} sent malformed "
                                 f"runs ({m} of them for {c} rows)")
        mine = torch.arange(base + 1, base + 1 + c) if m == 0 else \
            torch.repeat_interleave(torch.arange(base + 1, base + 1 + m), lens)
        out += [torch.tensor([base]), mine]
        at, base = at + 1 + m, base + 1 + (m or c)
    if at != runs.numel() or base != nvals:
        raise HvdSparseError(f"hvd_sparse: tensor {job.name!r}: the gathered runs and values "
                             "do not match the rows")
    return None if at == job.size else torch.cat(out)  # all [0]: a value row each


def fuse(grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Sparse COO tensors of one row shape and dtype (several embedding tables' gradients) as
    one: their rows one after another, reduced by one exchange instead of one each. Returns the
    tensor and where each one's rows start (``split`` undoes it). Each is summed by rows first:
    an embedding's gradient holds a row per lookup, its sum only the distinct ones."""
    offsets, lines, vals = [0], [], []
    for g in grads:
        line, v, nrows = _summed(g)
        lines.append(line + offsets[-1])
        vals.append(v)
        offsets.append(offsets[-1] + nrows)
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


def _summed(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A COO tensor's distinct rows (linearized over its sparse dimensions, sorted), their
    sums, and how many rows it has."""
    k = g.sparse_dim()
    nrows = math.prod(g.shape[:k])
    idx = g._indices()
    line = idx[0] if k == 1 else _linear(idx, g.shape[:k])
    rows, vals = sum_rows(line.contiguous(), g._values().contiguous(), nrows)
    return rows, vals, nrows


def _linear(idx: torch.Tensor, dims: torch.Size) -> torch.Tensor:
    strides = torch.tensor([math.prod(dims[d + 1:]) for d in range(len(dims))])
    return (idx * strides.unsqueeze(1)).sum(0)


def _unravel(line: torch.Tensor, dims: torch.Size) -> torch.Tensor:
    out = []
    for d in reversed(dims):
        out.append(line % d)
        line = line // d
    return torch.stack(out[::-1])
