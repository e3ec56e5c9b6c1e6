"""Threshold: every element with |x| >= threshold (a fixed bar, so the density floats)."""
from __future__ import annotations

import torch

from . import ops
from .base import Sparsifier


class Threshold(Sparsifier):
    """Hard threshold per element; pass a small ``block_size`` (1..32) to the optimizer.

    Args:
        threshold: elements with |x| >= this are sent (after adding the memory).
        error_feedback: keep what is not sent for the next step.
        **kw: ``Sparsifier``'s keyword arguments (warmup, min_selected, min_numel, rank,
            size); ``warmup`` has no effect (the density is not fixed) and ``min_selected``
            none (no density to select by).

    Raises:
        ValueError: ``threshold`` is not a number >= 0, or a ``Sparsifier`` argument is
            invalid.

    Example:
        >>> sp = hvd_sparse.Threshold(1e-3)
    """

    def __init__(self, threshold: float, error_feedback: bool = True, **kw: int) -> None:
        super().__init__(error_feedback, **kw)
        if not isinstance(threshold, int | float) or not threshold >= 0.0:
            raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
        self.threshold = float(threshold)

    def select(self, name: str, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
        """Every element of ``x`` with |x| >= ``threshold``.

        Args:
            name: the tensor's name (unused).
            x: the flat tensor to select from.
            block_size: unused: the selection is per element.

        Returns:
            (their ascending indices, 1).
        """
        return ops.select_abs_ge(x, self.threshold), 1
