"""Top-k: the k = density * numel largest magnitudes, exactly (expected O(n), no sort)."""
from __future__ import annotations

import torch

from . import ops
from .base import Sparsifier, check_density


class TopK(Sparsifier):
    """Exact top-k by |x|, per element: pass the optimizer a small ``block_size`` (1..32), since
    the codec ships whole blocks and a 256-element block around each element sends 256x more.

    Args:
        density: the fraction of each tensor's elements sent per step, in (0, 1].
        error_feedback: keep what is not sent for the next step.
        **kw: ``Sparsifier``'s keyword arguments (warmup, min_selected, min_numel, rank,
            size).

    Raises:
        ValueError: ``density`` is not in (0, 1], or a ``Sparsifier`` argument is invalid.

    Example:
        >>> opt = hvd_sparse.DistributedOptimizer(opt, model.named_parameters(),
        ...                                       block_size=1, sparsifier=TopK(0.01))
    """

    STATE = Sparsifier.STATE + ("_calls",)

    def __init__(self, density: float, error_feedback: bool = True, **kw: int) -> None:
        super().__init__(error_feedback, **kw)
        self.density = check_density(density)
        self._calls = 0

    def select(self, name: str, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
        """The k = density * numel (at least 1) largest magnitudes of ``x``.

        Args:
            name: the tensor's name (its warm-up density).
            x: the flat tensor to select from.
            block_size: unused: the selection is per element.

        Returns:
            (their ascending indices, 1).
        """
        self._calls += 1  # varies the sampling seed; the result is exact whatever the seed
        k = max(1, round(self.density_now(name) * x.numel()))
        return ops.topk_abs(x, k, self._calls), 1
