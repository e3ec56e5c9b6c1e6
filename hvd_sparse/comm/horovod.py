"""Collectives over Horovod: its asynchronous ops in a process set, matched across ranks by
name (ranks may submit tensors in any order)."""
from __future__ import annotations

import os
import pickle
from typing import Any

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

from .base import Collectives, Op, Pending

OPS = {"sum": hvd.Sum, "average": hvd.Average, "max": hvd.Max, "min": hvd.Min}
SHUT_DOWN = "Horovod has been shut down"  # Horovod's message for every operation after


def elastic() -> bool:
    """Whether this process is a worker of a Horovod elastic job (horovodrun sets
    HOROVOD_ELASTIC=1 in them)."""
    return bool(int(os.environ.get("HOROVOD_ELASTIC", "0") or 0))


class _Handle:
    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def poll(self) -> bool:
        return hvd.poll(self.handle)

    def value(self) -> Any:
        return hvd.synchronize(self.handle)


class HorovodCollectives(Collectives):
    route = "horovod"

    def __init__(self, process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
        self.process_set = process_set

    @property  # type: ignore[override]
    def rank(self) -> int:
        return self.process_set.rank()

    @property  # type: ignore[override]
    def size(self) -> int:
        return self.process_set.size()

    @property
    def is_global(self) -> bool:
        return self.process_set.process_set_id == hvd.global_process_set.process_set_id

    @property
    def kind(self) -> str:
        return "horovod/gloo" if hvd.gloo_enabled() else "horovod/mpi"

    @property
    def ranks(self) -> list[int]:
        return list(self.process_set.ranks or range(hvd.size()))

    def allreduce(self, t: torch.Tensor, name: str, op: Op = "sum", prescale: float = 1.0,
                  postscale: float = 1.0, inplace: bool = False) -> Pending:
        start = hvd.allreduce_async_ if inplace else hvd.allreduce_async
        return _Handle(start(t, name=name, op=OPS[op], prescale_factor=prescale,
                             postscale_factor=postscale, process_set=self.process_set))

    def allgather(self, t: torch.Tensor, name: str) -> Pending:
        return _Handle(hvd.allgather_async(t, name=name, process_set=self.process_set))

    def alltoall(self, t: torch.Tensor, splits: list[int], name: str) -> Pending:
        return _Handle(hvd.alltoall_async(t, splits=torch.tensor(splits, dtype=torch.int32),
                                          name=name, process_set=self.process_set))

    def lost(self, error: BaseException) -> bool:
        """Horovod's session is over: it was shut down (a rank left, or failed), or, under
        elastic, any of its operations failed (``hvd.elastic.run`` resets Horovod after it)."""
        return isinstance(error, HorovodInternalError) and (SHUT_DOWN in str(error) or elastic())

    def takes(self, t: torch.Tensor) -> bool:
        return super().takes(t) or (t.is_cuda and hvd.cuda_built())

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=root, name=name,
                                    process_set=self.process_set)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        # (Horovod 0.28's allgather_object has no process set)
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = hvd.allgather(torch.tensor([data.numel()]), name=f"{name}.sizes",
                              process_set=self.process_set).tolist()
        data = hvd.allgather(data, name=name, process_set=self.process_set)
        return [pickle.loads(part.numpy().tobytes()) for part in data.split(sizes)]

    def local_size(self) -> int:
        return hvd.local_size()

    def hosts(self) -> int:
        return hvd.cross_size()  # as Horovod counts them: by hostname


_by_set: dict[int, HorovodCollectives] = {}


def of(process_set: hvd.ProcessSet = hvd.global_process_set) -> HorovodCollectives:
    """The collectives of ``process_set`` (one object per set, made on first use)."""
    c = _by_set.get(process_set.process_set_id)
    if c is None or c.process_set is not process_set:
        c = _by_set[process_set.process_set_id] = HorovodCollectives(process_set)
    return c
