"""Deep Gradient Compression (Lin et al., ICLR'18): sampled threshold, momentum correction,
momentum factor masking (the last two live in ``MomentumMemory``)."""
from __future__ import annotations

import math

import torch

from . import ops
from .base import Sparsifier, check_density
from .memory import MomentumMemory, NoMemory


class DGC(Sparsifier):
    """Threshold from a random sample of |x| (``sample`` of the elements, at least 1000), then
    one selection pass; if that lets through more than 1.3 k, exact top-k among those (DGC's
    hierarchical selection). Per element: pass a small ``block_size`` (1..32). With error
    feedback (default) momentum is corrected here: give the optimizer no momentum of its own.
    """

    STATE = Sparsifier.STATE + ("_calls",)

    def __init__(self, density: float, momentum: float = 0.9, sample: float = 0.01,
                 error_feedback: bool = True, **kw: int) -> None:
        if not 0.0 < sample <= 1.0:
            raise ValueError(f"sample must be in (0, 1], got {sample!r}")
        self.momentum, self.sample = momentum, sample
        super().__init__(error_feedback, **kw)
        self.density = check_density(density)
        self._calls = 0

    def default_memory(self) -> NoMemory:
        return MomentumMemory(self.momentum)

    def select(self, name: str, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
        self._calls += 1
        n = x.numel()
        density = self.density_now(name)
        k = max(1, round(density * n))
        m = min(n, max(1000, math.ceil(self.sample * n)))
        s = ops.sample_abs(x, m, self._calls) if m < n else x.abs().float()
        thr = float(torch.topk(s, max(1, round(density * m))).values[-1])
        idx = ops.select_abs_ge(x, thr)
        if idx.numel() > 1.3 * k:
            idx = idx[ops.topk_abs(x[idx], k, self._calls)]
        return idx, 1
