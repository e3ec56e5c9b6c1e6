"""Collectives over ``torch.distributed`` (a process group: Gloo on CPU tensors), for the DDP
front end. Process groups match operations by the order they are issued in, not by name, so
the caller issues one tensor's stages at a time, in the same order on every rank (the DDP hook
reduces its buckets one after another on a thread of its own, over a group of its own)."""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.distributed as dist

from .base import Collectives, Op, Pending

OPS = {"sum": dist.ReduceOp.SUM, "average": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN}
ALIGN = 8  # bytes: the widest element a packed buffer is viewed as (int64, float64)
# Steps of a collective: each yields the work it waits for; the chain returns the value.
Steps = Generator[dist.Work, None, Any]


class _Chain:
    """A collective made of several process-group operations issued one after the other (the
    sizes, then the data): each is issued when the one before has completed."""

    def __init__(self, steps: Steps) -> None:
        self._steps = steps
        self._work: dist.Work | None = next(steps)
        self._done, self._value = False, None

    def poll(self) -> bool:
        while not self._done:
            assert self._work is not None
            if not self._work.is_completed():
                return False
            self._advance()
        return True

    def _advance(self) -> None:
        assert self._work is not None
        self._work.wait()  # raises what the operation failed with
        try:
            self._work = next(self._steps)
        except StopIteration as stop:
            self._done, self._value, self._work = True, stop.value, None

    def value(self) -> Any:
        while not self._done:
            self._advance()
        return self._value


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _one(work: dist.Work, then: Callable[[], Any]) -> Pending:
    def steps() -> Steps:
        yield work
        return then()
    return _Chain(steps())


class TorchCollectives(Collectives):
    """Collectives over ``group`` (the default group when None), a job of ``job_size`` ranks
    (the world's by default; a DDP job over a subgroup: that subgroup's), named ``route`` in
    metrics."""

    def __init__(self, group: dist.ProcessGroup | None = None,
                 job_size: int | None = None, route: str = "torch.distributed") -> None:
        self.group = group
        self.route = route
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.job_size = dist.get_world_size() if job_size is None else job_size

    @property
    def is_global(self) -> bool:
        return self.size == self.job_size

    @property
    def kind(self) -> str:
        return f"torch/{dist.get_backend(self.group)}"

    @property
    def ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.group) if self.group is not None \
            else list(range(self.size))

    def allreduce(self, t: torch.Tensor, name: str, op: Op = "sum", prescale: float = 1.0,
                  postscale: float = 1.0, inplace: bool = False) -> Pending:
        x = t if inplace else t.clone()
        if prescale != 1.0:
            x.mul_(prescale)
        scale = postscale / self.size if op == "average" else postscale
        work = dist.all_reduce(x, OPS[op], group=self.group, async_op=True)
        return _one(work, lambda: x.mul_(scale) if scale != 1.0 else x)

    def allgather(self, t: torch.Tensor, name: str) -> Pending:
        return _Chain(self._allgather(t.contiguous()))

    def _allgather(self, t: torch.Tensor) -> Steps:
        n = self.size
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        yield dist.all_gather(sizes, torch.tensor([t.shape[0]]), group=self.group,
                              async_op=True)
        rows = [int(s) for s in sizes]
        longest = max(rows)
        padded = t if t.shape[0] == longest else \
            torch.cat([t, t.new_zeros((longest - t.shape[0], *t.shape[1:]))])
        parts = [t.new_empty((longest, *t.shape[1:])) for _ in range(n)]
        yield dist.all_gather(parts, padded, group=self.group, async_op=True)
        return torch.cat([p[:r] for p, r in zip(parts, rows, strict=True)])

    def allgather_many(self, tensors: list[torch.Tensor], name: str) -> Pending:
        return _Chain(self._allgather_many([t.contiguous() for t in tensors]))

    def _allgather_many(self, tensors: list[torch.Tensor]) -> Steps:
        """Every rank's rows of every tensor, as bytes, in one padded all_gather (after one
        of the row counts): two operations whatever the number of tensors. Each rank's rows
        stay where they landed (views of one buffer): a copy of megabytes per table saved.
        Every tensor's bytes start at a multiple of ALIGN in each rank's part (and parts are
        ALIGN bytes long), so each view is aligned for its dtype whatever the widths and row
        counts (a 2-byte table of 3 rows before int64 rows would not be)."""
        n, k, on = self.size, len(tensors), tensors[0].device  # (NCCL: a device's tensors)
        rows = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64, device=on)
        sizes = [torch.zeros(k, dtype=torch.int64, device=on) for _ in range(n)]
        yield dist.all_gather(sizes, rows, group=self.group, async_op=True)
        sizes = [sz.cpu() for sz in sizes]
        row_bytes = [t.element_size() * math.prod(t.shape[1:]) for t in tensors]
        longest = max(sum(_aligned(int(r) * b) for r, b in zip(sz, row_bytes, strict=True))
                      for sz in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=on)
        at = 0
        for t in tensors:  # this rank's bytes, copied once
            padded[at:at + t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
            at += _aligned(t.nbytes)
        parts = list(torch.empty(n, longest, dtype=torch.uint8, device=on))
        yield dist.all_gather(parts, padded, group=self.group, async_op=True)
        out: list[list[torch.Tensor]] = [[] for _ in tensors]
        for part, sz in zip(parts, sizes, strict=True):
            at = 0
            for j, (t, r) in enumerate(zip(tensors, sz.tolist(), strict=True)):
                nbytes = r * row_bytes[j]
                out[j].append(part[at:at + nbytes].view(t.dtype).view(r, *t.shape[1:]))
                at += _aligned(nbytes)
        return out

    def allgather_many_here(self, tensors: list[torch.Tensor]) -> torch.futures.Future:
        """``allgather_many``'s two operations issued from the calling thread before it
        returns (it waits for the row counts), for a caller that must issue its group's
        operations in its own order (the DDP hook, on the model's group); a future of the
        value."""
        steps = self._allgather_many([t.contiguous() for t in tensors])
        next(steps).wait()
        data = next(steps)

        def value(_: torch.futures.Future) -> list[list[torch.Tensor]]:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value
            raise AssertionError("allgather_many: more operations than two")
        return data.get_future().then(value)

    def alltoall(self, t: torch.Tensor, splits: list[int], name: str) -> Pending:
        return _Chain(self._alltoall(t.contiguous(), splits))

    def _alltoall(self, t: torch.Tensor, splits: list[int]) -> Steps:
        counts = torch.empty(self.size, dtype=torch.int64)
        yield dist.all_to_all_single(counts, torch.tensor(splits, dtype=torch.int64),
                                     group=self.group, async_op=True)
        out = t.new_empty((int(counts.sum()), *t.shape[1:]))
        yield dist.all_to_all_single(out, t, counts.tolist(), list(splits), group=self.group,
                                     async_op=True)
        return out, counts

    def local_size(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[root], group=self.group)
        return box[0]

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out
