"""Threshold: every element with |x| >= threshold (a fixed bar, so the density floats)."""
from __future__ import annotations

import torch

from . import ops
from .base import Sparsifier


class Threshold(Sparsifier):
    """Hard threshold per element; pass a small ``block_size`` (1..32) to the optimizer."""

    def __init__(self, threshold: float, error_feedback: bool = True, **kw: int) -> None:
        super().__init__(error_feedback, **kw)
        if not isinstance(threshold, int | float) or not threshold >= 0.0:
            raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
        self.threshold = float(threshold)

    def select(self, name: str, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
        return ops.select_abs_ge(x, self.threshold), 1
