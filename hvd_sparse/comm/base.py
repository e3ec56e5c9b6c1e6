"""The interface: asynchronous tensor collectives for the schemes' stages, blocking object
collectives for set-up (joining aggregators, the cost model's probe)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Literal, Protocol

import torch

from .. import device

Op = Literal["sum", "average", "max", "min"]


class Pending(Protocol):
    """An operation in flight: the progress engine polls it and takes its value once done."""

    def poll(self) -> bool: ...

    def value(self) -> Any:
        """The result; waits for it when not done yet."""
        ...


class Done:
    """A result already there (a collective over one rank, say)."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def poll(self) -> bool:
        return True

    def value(self) -> Any:
        return self._value


class _All:
    """Several operations in flight, done when all are."""

    def __init__(self, parts: list[Pending]) -> None:
        self.parts = parts

    def poll(self) -> bool:
        return all(p.poll() for p in self.parts)

    def value(self) -> list[Any]:
        return [p.value() for p in self.parts]


class _Parts(_All):
    """Several allgathers in flight; value: each one's result as a list of one part."""

    def value(self) -> list[list[torch.Tensor]]:
        return [[v] for v in super().value()]


class Collectives(ABC):
    """The ranks a reduction runs over and the collectives between them. ``name`` identifies an
    operation across ranks (Horovod matches by it; torch.distributed by issue order, so that
    front end issues one tensor's stages at a time)."""

    rank: int
    size: int
    route: str  # what carries a scheme's collectives, for metrics ("horovod", "hook streams")

    @property
    @abstractmethod
    def is_global(self) -> bool:
        """Whether these are all ranks of the job: aggregators sum over every rank of the job
        (all of which join them at start), so a smaller set would leave them waiting."""

    @property
    @abstractmethod
    def kind(self) -> str:
        """What carries the collectives ("horovod/gloo", "torch/nccl", ...): the network
        model is cached per kind."""

    @property
    @abstractmethod
    def ranks(self) -> list[int]:
        """The job-wide ranks taking part, for messages."""

    @abstractmethod
    def allreduce(self, t: torch.Tensor, name: str, op: Op = "sum", prescale: float = 1.0,
                  postscale: float = 1.0, inplace: bool = False) -> Pending:
        """The elementwise reduction of ``t`` over the ranks (same shape everywhere), scaled
        before and after; ``inplace`` may write it into ``t``."""

    @abstractmethod
    def allgather(self, t: torch.Tensor, name: str) -> Pending:
        """Every rank's ``t`` concatenated along dim 0 in rank order (dim 0 may differ)."""

    def allgather_many(self, tensors: list[torch.Tensor], name: str) -> Pending:
        """``allgather`` of each tensor (all ranks pass the same number, dim 0 may differ);
        value: per tensor, a list of parts whose concatenation (dim 0) is its result, as the
        exchange left them (not copied into one). Over a process group it is one exchange, not
        one each."""
        return _Parts([self.allgather(t, f"{name}.{i}") for i, t in enumerate(tensors)])

    @abstractmethod
    def alltoall(self, t: torch.Tensor, splits: list[int], name: str) -> Pending:
        """Rows ``splits[r]`` of ``t`` (in order) go to rank r; value: (what came, in rank
        order, and a tensor of how many rows from each rank)."""

    @abstractmethod
    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        """Rank ``root``'s picklable ``obj`` on every rank (blocking)."""

    @abstractmethod
    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (blocking)."""

    def lost(self, error: BaseException) -> bool:
        """Whether ``error``, raised by one of these collectives, says that none of them can
        complete any more (the engine then fails every reduction in flight at once, rather
        than leave one waiting out its timeout at the aggregators for a peer that left)."""
        return False

    def takes(self, t: torch.Tensor) -> bool:
        """Whether ``allreduce`` takes ``t`` where it is (else a device tensor is staged):
        host tensors (not those posing as a device's, ``HVD_SPARSE_CPU_AS_DEVICE``)."""
        return not device.on_device(t)

    def local_size(self) -> int:
        """Ranks on this host (threads per rank follow from it)."""
        return 1

    def hosts(self) -> int:
        """Hosts the ranks run on."""
        return 1
