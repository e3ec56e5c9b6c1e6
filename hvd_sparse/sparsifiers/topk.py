"""Top-k: the k = density * numel largest magnitudes, exactly (expected O(n), no sort)."""
from __future__ import annotations

import torch

from . import ops
from .base import Sparsifier, check_density


class TopK(Sparsifier):
    """Exact top-k by |x|, per element: pass the optimizer a small ``block_size`` (1..32), since
    the codec ships whole blocks and a 256-element block around each element sends 256x more."""

    STATE = Sparsifier.STATE + ("_calls",)

    def __init__(self, density: float, error_feedback: bool = True, **kw: int) -> None:
        super().__init__(error_feedback, **kw)
        self.density = check_density(density)
        self._calls = 0

    def select(self, name: str, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
        self._calls += 1  # varies the sampling seed; the result is exact whatever the seed
        k = max(1, round(self.density_now(name) * x.numel()))
        return ops.topk_abs(x, k, self._calls), 1
