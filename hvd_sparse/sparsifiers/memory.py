"""Error feedback, kept apart from selection (GRACE's "memory"): what a sparsifier does not send
this step is remembered and added to the next step's gradient.

A memory owns one buffer (or two, for DGC) per tensor name. ``compensate`` returns the tensor to
select from; ``update`` moves the selection into the outgoing gradient and keeps the rest.
"""
from __future__ import annotations

import torch

from . import ops


class NoMemory:
    """No error feedback: what is not selected is dropped."""

    STATE: tuple[str, ...] = ()  # the per-tensor buffers: what state_dict saves

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The per-tensor buffers, copied.

        Returns:
            Buffer kind (``STATE``: "residuals", "velocities") -> tensor name -> tensor.
        """
        return {k: {n: t.clone() for n, t in getattr(self, k).items()} for k in self.STATE}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restores (copies of) what ``state_dict`` returned.

        Args:
            state: a ``state_dict()`` of a memory of the same class.
        """
        for k in self.STATE:
            setattr(self, k, {n: t.clone() for n, t in state[k].items()})

    def compensate(self, name: str, grad: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Adds the memory of ``name`` to the step's gradient (here: none).

        Args:
            name: the tensor's name.
            grad: the flat gradient of this step.

        Returns:
            (the tensor to select from, the number of non-finite elements in it).
        """
        return grad, ops.count_nonfinite(grad)

    def update(self, name: str, x: torch.Tensor, out: torch.Tensor, idx: torch.Tensor,
               unit: int) -> None:
        """Leaves only the selected units in ``out`` (here: what is not selected is dropped).

        Args:
            name: the tensor's name.
            x: what ``compensate`` returned.
            out: the outgoing gradient.
            idx: the selected units, ascending.
            unit: elements per unit.
        """
        ops.extract_(out, out, idx, unit, False)

    def flush(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Sends all of ``x`` in ``out``: nothing is kept back.

        Args:
            x: what ``compensate`` returned.
            out: the outgoing gradient.
        """
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)

    def reset(self, name: str) -> None:
        """Forgets the memory of ``name`` (after a step with NaN/Inf went out dense).

        Args:
            name: the tensor's name.
        """


class ResidualMemory(NoMemory):
    """Residual accumulation: e = e + g; send the selection of e; e keeps what was not sent."""

    STATE = ("residuals",)

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, grad: torch.Tensor) -> tuple[torch.Tensor, int]:
        """e = e + g, in the residual of ``name`` (a new zero one for a new name or shape).

        Args:
            name: the tensor's name.
            grad: the flat gradient of this step.

        Returns:
            (the residual, the number of non-finite elements in it).
        """
        e = self.residuals.get(name)
        if e is None or e.shape != grad.shape or e.dtype != grad.dtype:
            e = self.residuals[name] = torch.zeros_like(grad)
        return e, ops.accumulate_(e, grad)

    def update(self, name: str, x: torch.Tensor, out: torch.Tensor, idx: torch.Tensor,
               unit: int) -> None:
        """Moves the selected units of the residual into ``out`` (zeros elsewhere); the
        residual keeps the rest.

        Args:
            name: the tensor's name.
            x: the residual, as ``compensate`` returned it.
            out: the outgoing gradient.
            idx: the selected units, ascending.
            unit: elements per unit.
        """
        ops.extract_(x, out, idx, unit, True)

    def flush(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Sends the whole residual in ``out`` and zeroes it.

        Args:
            x: the residual, as ``compensate`` returned it.
            out: the outgoing gradient.
        """
        # The residual goes out now. MomentumMemory keeps its velocity (no masking): a tensor
        # sent whole every step gets momentum SGD, the optimizer's momentum having moved here.
        super().flush(x, out)
        x.zero_()

    def reset(self, name: str) -> None:
        """Drops the residual of ``name``.

        Args:
            name: the tensor's name.
        """
        # A non-finite value went out dense; keeping it would poison every later step.
        self.residuals.pop(name, None)


class MomentumMemory(ResidualMemory):
    """DGC's momentum correction and factor masking: u = m u + g, v = v + u; send the selection
    of v; zero u and v where sent (so stale momentum does not push those coordinates again).

    Use it with an optimizer without momentum: the momentum lives here, before sparsification.

    Without masking, u is an exact momentum and only v is error feedback: every gradient
    reaches the parameters with its whole momentum tail (m, m^2, ...), late where not sent,
    as without sparsification. With masking a coordinate sent every step moves by its
    gradient alone: no momentum at all.

    Args:
        momentum: m, in [0, 1).
        masking: zero u where sent (DGC's factor masking; default on).

    Raises:
        ValueError: ``momentum`` is not in [0, 1).
    """

    STATE = ("residuals", "velocities")

    def __init__(self, momentum: float = 0.9, masking: bool = True) -> None:
        super().__init__()
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum, self.masking = momentum, masking
        self.velocities: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, grad: torch.Tensor) -> tuple[torch.Tensor, int]:
        """u = m u + g, v = v + u, in the buffers of ``name`` (new zero ones for a new name or
        shape).

        Args:
            name: the tensor's name.
            grad: the flat gradient of this step.

        Returns:
            (v, the number of non-finite elements in it).
        """
        v = self.residuals.get(name)
        if v is None or v.shape != grad.shape or v.dtype != grad.dtype:
            v = self.residuals[name] = torch.zeros_like(grad)
            self.velocities[name] = torch.zeros_like(grad)
        return v, ops.momentum_accumulate_(self.velocities[name], v, grad, self.momentum)

    def update(self, name: str, x: torch.Tensor, out: torch.Tensor, idx: torch.Tensor,
               unit: int) -> None:
        """Moves the selected units of v into ``out`` and, with masking, zeroes u there too.

        Args:
            name: the tensor's name.
            x: v, as ``compensate`` returned it.
            out: the outgoing gradient.
            idx: the selected units, ascending.
            unit: elements per unit.
        """
        ops.extract_(x, out, idx, unit, True)
        if self.masking:
            ops.zero_units_(self.velocities[name], idx, unit)

    def reset(self, name: str) -> None:
        """Drops both buffers of ``name``.

        Args:
            name: the tensor's name.
        """
        super().reset(name)
        self.velocities.pop(name, None)
