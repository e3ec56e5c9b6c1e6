"""A process-group backend for tests that records every collective: "recording", registered
with ``torch.distributed.Backend.register_backend``, a Python ``ProcessGroup`` over a Gloo one
made from the same store. As the model's group of a DDP job (``init_process_group
("recording")``) it stands for NCCL on a machine without GPUs: a group that is not Gloo, whose
calls (operation, tensor sizes, devices, calling thread) the tests read back. Gloo takes CUDA
tensors too (through host memory), so it records a CUDA model's group as well."""
from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

NAME = "recording"


@dataclasses.dataclass(frozen=True)
class Call:
    op: str
    numel: tuple[int, ...]  # each input tensor's elements
    devices: tuple[str, ...]
    thread: str


class Recording(dist.ProcessGroup):
    calls: list[Call] = []  # every group's, in the order issued (a test clears it)

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore(NAME, store), rank, size, timeout)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    def _record(self, op: str, tensors: list[torch.Tensor]) -> None:
        Recording.calls.append(Call(op, tuple(t.numel() for t in tensors),
                                    tuple(str(t.device) for t in tensors),
                                    threading.current_thread().name))

    def allreduce(self, tensors, opts=c10d.AllreduceOptions()):  # noqa: B008 - torch's API
        self._record("allreduce", tensors)
        return self.gloo.allreduce(tensors, opts)

    def allgather(self, outputs, inputs, opts=c10d.AllgatherOptions()):  # noqa: B008
        self._record("allgather", inputs)
        return self.gloo.allgather(outputs, inputs, opts)

    def broadcast(self, tensors, opts=c10d.BroadcastOptions()):  # noqa: B008
        self._record("broadcast", tensors)
        return self.gloo.broadcast(tensors, opts)

    def barrier(self, opts=c10d.BarrierOptions()):  # noqa: B008
        self._record("barrier", [])
        return self.gloo.barrier(opts)


def register() -> None:
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, Recording, devices=["cpu", "cuda"])
