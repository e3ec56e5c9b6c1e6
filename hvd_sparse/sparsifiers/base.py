"""What every sparsifier shares: input checks, error feedback, the in-place step, metrics.

A sparsifier is called once per step per tensor, before the reduction, as
``sparsifier(name, grad, block_size)``: it adds the error-feedback memory to ``grad``, selects,
and leaves ``grad`` holding the selected values and zeros elsewhere (the tensor every scheme then
reduces). After the reduction, ``observe(name, reduced, block_size)`` lets it see the result
(union size; ExDyna's load balancing). Subclasses implement only ``select``.

Small tensors go out whole with what their memory held: those under ``min_numel`` elements
(16,384: 64 KiB of float32, the size below which ``auto`` sends a tensor dense anyway,
``Config.small_bytes``) and those where the density selects fewer than ``min_selected`` (16)
elements a step. Sparsified, 1% of a bias, a small convolution or the last layer is a few
elements a step, and error feedback then sends each element once in ~100 steps with ~100 steps
of gradient in it, which the optimizer's momentum replays. On a CNN for scikit-learn's digits at
1%, 4 ranks, ExDyna fell to chance (8%) sparsifying every tensor; ExDyna at 1% on the suite's
click-through model trailed dense by 1.2 AUC points with only the tensors under 16 selected
elements whole and by 0.2 with those under 16,384 elements whole too. Such tensors are a small
share of a model's bytes (docs/BENCHMARKS.md, Convergence).

A gradient holding NaN or Inf (after adding the memory) is not sparsified: it goes out whole,
so the reduced gradient carries the NaN/Inf exactly as a dense allreduce would, and the memory
of that tensor is cleared. An all-zero gradient selects nothing and reduces to zeros, as dense.
"""
from __future__ import annotations

import copy
import time
from typing import Any

import torch

from ..config import Config
from ..metrics import record_sparsify
from . import ops
from .memory import NoMemory, ResidualMemory

_FLOATS = (torch.float32, torch.float64)
WARMUP_START = 0.25  # density of the first warm-up step
MIN_SELECTED = 16  # tensors where density * numel is below this go out whole
# and tensors under this many elements: float32 that "auto" would send dense anyway (16,384)
MIN_NUMEL = Config.small_bytes // 4


def check_density(density: float) -> float:
    if not isinstance(density, int | float) or not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return float(density)


class Sparsifier:
    """Base class: input checks, error feedback, the in-place step, metrics; a subclass
    implements ``select`` (and sets ``density``).

    Args:
        error_feedback: keep what is not sent for the next step (default on).
        warmup: steps that start at density 0.25 and decay exponentially to the requested
            density (DGC's warm-up training); default 0.
        min_selected: tensors where the requested density selects fewer elements than this
            (default 16) go out whole.
        min_numel: tensors under this many elements (default 16,384) go out whole; both 0:
            sparsify every tensor.
        rank: this rank; None: that of each reduction's ranks, as the front end tells it
            (``join``), else Horovod's.
        size: the number of ranks; None: as ``rank`` (under Horovod elastic it follows the
            job as it shrinks and grows).

    Raises:
        ValueError: ``warmup``, ``min_selected`` or ``min_numel`` is not an int >= 0.
    """

    density: float | None = None  # requested fraction of elements; None when not fixed
    STATE: tuple[str, ...] = ("_steps",)  # attributes training changes: what state_dict saves
    # the ranks of the reductions (rank, size) and which join of them, as ``join`` was last
    # told (class defaults: sparsifiers pickled before these existed load without them)
    _joined: tuple[int, int] | None = None
    _joined_epoch: int | None = None

    def __init__(self, error_feedback: bool = True, *, warmup: int = 0,
                 min_selected: int = MIN_SELECTED, min_numel: int = MIN_NUMEL,
                 rank: int | None = None, size: int | None = None) -> None:
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        if not isinstance(min_selected, int) or min_selected < 0:
            raise ValueError(f"min_selected must be an int >= 0, got {min_selected!r}")
        if not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {min_numel!r}")
        self.min_selected, self.min_numel = min_selected, min_numel
        self.memory = self.default_memory() if error_feedback else NoMemory()
        self.warmup = warmup
        self._steps: dict[str, int] = {}
        self._rank, self._size = rank, size

    def density_now(self, name: str) -> float:
        """The density this step of tensor ``name``.

        Args:
            name: the tensor's name.

        Returns:
            The requested density, or its warm-up value.
        """
        assert self.density is not None
        t, start = self._steps.get(name, 0), max(WARMUP_START, self.density)
        if t >= self.warmup:
            return self.density
        return start * (self.density / start) ** (t / self.warmup)

    def default_memory(self) -> NoMemory:
        """The error-feedback memory used when ``error_feedback`` is on.

        Returns:
            A fresh ``ResidualMemory`` (DGC: a ``MomentumMemory``).
        """
        return ResidualMemory()

    def state_dict(self) -> dict[str, Any]:
        """What training changed: save it with the checkpoint, ``load_state_dict`` it on
        resume, or the residuals not yet sent are lost.

        Returns:
            The error-feedback memory, step counts and adaptive thresholds, as tensors and
            plain values (what ``torch.load`` reads by default), with the class's name.

        Example:
            >>> torch.save({"model": model.state_dict(), "sparsifier": sp.state_dict()}, path)
        """
        return {"type": type(self).__name__, "memory": self.memory.state_dict(),
                **{k: copy.deepcopy(getattr(self, k)) for k in self.STATE}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what ``state_dict`` returned.

        Args:
            state: a ``state_dict()`` of a sparsifier of the same class.

        Raises:
            ValueError: ``state`` is of another class of sparsifier.
        """
        if state.get("type") != type(self).__name__:
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state is of a "
                             f"{state.get('type')}")
        self.memory.load_state_dict(state["memory"])
        for k in self.STATE:
            setattr(self, k, copy.deepcopy(state[k]))

    def join(self, rank: int, size: int, epoch: int = 0) -> None:
        """The ranks of the reduction about to run, told by the front end at each call
        (``reduction.start``); a rank or size given to the constructor is kept.

        Args:
            rank: this rank among the reduction's ranks.
            size: how many ranks take part.
            epoch: which join of the ranks the front end is at (the Horovod front end joins
                again after an elastic reset): a new one means the ranks may be others
                (``rejoined``).
        """
        self._joined = (rank, size)
        if epoch != self._joined_epoch:
            first = self._joined_epoch is None
            self._joined_epoch = epoch
            if not first:
                self.rejoined()

    def rejoined(self) -> None:
        """Called when the front end has joined the ranks again (after a Horovod elastic
        reset: other ranks, perhaps another size). Here nothing: the error-feedback memory is
        this rank's own and stays (it rolls back with the optimizer's state_dict); ExDyna
        forgets its partitions, which must be alike on every rank."""

    @property
    def rank(self) -> int:
        """This rank: as given, else as last joined, else Horovod's."""
        if self._rank is not None:
            return self._rank
        if self._joined is not None:
            return self._joined[0]
        import horovod.torch as hvd
        return hvd.rank()

    @property
    def size(self) -> int:
        """The number of ranks: as given, else as last joined, else Horovod's."""
        if self._size is not None:
            return self._size
        if self._joined is not None:
            return self._joined[1]
        import horovod.torch as hvd
        return hvd.size()

    def select(self, name: str, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
        """What to send of ``x``: the one method a subclass implements.

        Args:
            name: the tensor's name (state per tensor).
            x: the flat tensor to select from (the gradient plus the memory), float32 or
                float64.
            block_size: the codec's block of this call, in elements.

        Returns:
            (ascending int64 indices of the selected units, elements per unit): units of 1
            for element-wise selection.

        Raises:
            NotImplementedError: in the base class.
        """
        raise NotImplementedError

    def skip(self, name: str) -> None:
        """Called instead of ``select`` on a step that went out dense (non-finite values).

        Args:
            name: the tensor's name.
        """

    def too_small(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` elements goes out whole.

        By its size and the requested density, so a tensor's treatment does not change during
        warm-up.

        Args:
            numel: the tensor's elements.

        Returns:
            True when under ``min_numel`` elements, or when the density selects fewer than
            ``min_selected``.
        """
        return numel < self.min_numel or (self.density is not None
                                          and self.density * numel < self.min_selected)

    def __call__(self, name: str, grad: torch.Tensor, block_size: int = 1) -> torch.Tensor:
        """Sparsifies ``grad`` in place: zeros outside the selection.

        Adds the error-feedback memory first; a tensor that is too small (``too_small``) or
        holds NaN/Inf goes out whole (the latter clears its memory). Records the step in
        ``hvd_sparse.metrics()``.

        Args:
            name: the tensor's name: its memory and metrics are kept under it.
            grad: the gradient, floating-point; float16/bfloat16 are selected in float32.
            block_size: the codec's block of the reduction, in elements.

        Returns:
            ``grad``, sparsified.

        Raises:
            ValueError: ``grad`` is not floating-point.

        Example:
            >>> sp = hvd_sparse.TopK(0.01, min_numel=0)
            >>> g = sp("fc.weight", torch.randn(1000, 100))
            >>> int((g != 0).sum())
            1000
        """
        if not grad.is_floating_point():
            raise ValueError(f"{type(self).__name__}: tensor {name!r} is {grad.dtype}; "
                             "sparsifiers take floating-point gradients")
        if grad.numel() == 0:
            return grad
        flat = grad.view(-1) if grad.is_contiguous() else grad.reshape(-1).clone()
        # float16/bfloat16 are selected in float32 and rounded once on the way back.
        work = flat if flat.dtype in _FLOATS else flat.float()
        t0 = time.perf_counter()
        x, nonfinite = self.memory.compensate(name, work)
        if self.too_small(work.numel()) and not nonfinite:
            self.memory.flush(x, work)
            selected = work.numel()
        elif nonfinite:
            if x.data_ptr() != work.data_ptr():
                work.copy_(x)
            self.memory.reset(name)
            self.skip(name)
            selected = work.numel()
        else:
            idx, unit = self.select(name, x, block_size)
            self.memory.update(name, x, work, idx, unit)
            selected = _elements(idx, unit, work.numel())
        seconds = time.perf_counter() - t0
        self._steps[name] = self._steps.get(name, 0) + 1
        if work.data_ptr() != flat.data_ptr():
            flat.copy_(work)
        if flat.data_ptr() != grad.data_ptr():
            grad.copy_(flat.view(grad.shape))
        record_sparsify(name, sparsifier=type(self).__name__,
                                requested_density=(self.density if self.density is None
                                                    else self.density_now(name)),
                                achieved_density=selected / grad.numel(), selected=selected,
                                selection_ms=seconds * 1e3, nonfinite=int(nonfinite))
        return grad

    def observe(self, name: str, reduced: torch.Tensor, block_size: int = 1) -> None:
        """Sees the reduced gradient: records the union of the ranks' selections.

        Args:
            name: the tensor's name.
            reduced: the reduced gradient.
            block_size: the codec's block of the reduction, in elements.
        """
        flat = reduced.detach().reshape(-1)
        if flat.dtype not in _FLOATS:
            flat = flat.float()
        bounds = torch.tensor([0, flat.numel()], dtype=torch.int64)
        _, union, _ = ops.partition_counts(flat, 1, bounds)
        self.record_union(name, union, flat.numel())

    @staticmethod
    def record_union(name: str, union: int, numel: int) -> None:
        """Records the union in ``hvd_sparse.metrics()`` (``union``, ``union_density``).

        Args:
            name: the tensor's name.
            union: non-zero elements of the reduced gradient.
            numel: the tensor's elements.
        """
        record_sparsify(name, union=union, union_density=union / max(1, numel))


def _elements(idx: torch.Tensor, unit: int, numel: int) -> int:
    """Elements covered by ``len(idx)`` units of ``unit`` (the tail unit may be short)."""
    n = idx.numel() * unit
    if n and unit > 1 and int(idx[-1]) == (numel - 1) // unit:
        n -= (-numel) % unit
    return n
