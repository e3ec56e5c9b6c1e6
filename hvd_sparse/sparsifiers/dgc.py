"""Deep Gradient Compression (Lin et al., ICLR'18): sampled threshold, momentum correction,
momentum factor masking (the last two live in ``MomentumMemory``)."""
from __future__ import annotations

import math
import warnings

import torch

from . import ops
from .base import Sparsifier, check_density
from .memory import MomentumMemory, NoMemory


class DGC(Sparsifier):
    """Threshold from a random sample of |x| (``sample`` of the elements, at least 1000), then
    one selection pass; if that lets through more than 1.3 k, exact top-k among those (DGC's
    hierarchical selection). Per element: pass a small ``block_size`` (1..32). With error
    feedback (default) momentum is corrected here, before sparsification, as the paper does:
    the optimizer must have none of its own. ``hvd_sparse.DistributedOptimizer`` moves an
    optimizer's momentum here with a warning (``optimizer_momentum="move"``, the default) or
    refuses it (``"error"``).

    Args:
        density: the fraction of each tensor's elements sent per step, in (0, 1].
        momentum: the momentum corrected here, in [0, 1) (with error feedback).
        sample: the fraction of elements sampled for the threshold, in (0, 1].
        error_feedback: momentum correction and factor masking (``MomentumMemory``); off:
            what is not sent is dropped, and there is no momentum here.
        optimizer_momentum: "move" (the optimizer's momentum moves here, with a warning) or
            "error" (an optimizer with momentum is refused).
        **kw: ``Sparsifier``'s keyword arguments (warmup, min_selected, min_numel, rank,
            size).

    Raises:
        ValueError: an argument out of its range above.

    Example:
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: DGC has it
        >>> opt = hvd_sparse.DistributedOptimizer(opt, model.named_parameters(), block_size=1,
        ...                                       sparsifier=DGC(0.001, momentum=0.9, warmup=5))
    """

    STATE = Sparsifier.STATE + ("_calls",)

    def __init__(self, density: float, momentum: float = 0.9, sample: float = 0.01,
                 error_feedback: bool = True, *, optimizer_momentum: str = "move",
                 **kw: int) -> None:
        if not 0.0 < sample <= 1.0:
            raise ValueError(f"sample must be in (0, 1], got {sample!r}")
        if optimizer_momentum not in ("move", "error"):
            raise ValueError("optimizer_momentum must be 'move' or 'error', got "
                             f"{optimizer_momentum!r}")
        self.optimizer_momentum = optimizer_momentum
        self.momentum, self.sample = momentum, sample
        super().__init__(error_feedback, **kw)
        self.density = check_density(density)
        self._calls = 0

    def default_memory(self) -> NoMemory:
        """DGC's error feedback.

        Returns:
            A ``MomentumMemory`` with this sparsifier's momentum.
        """
        return MomentumMemory(self.momentum)

    def select(self, name: str, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
        """The threshold from a sample of |x|, then exact top-k among what it lets through when
        that is more than 1.3 k (k = density * numel, at least 1).

        Args:
            name: the tensor's name (its warm-up density).
            x: the flat tensor to select from.
            block_size: unused: the selection is per element.

        Returns:
            (the ascending indices selected, 1).
        """
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

    def take_momentum(self, groups: list[dict]) -> None:
        """Takes the wrapped optimizer's momentum, if any: it must live here instead (momentum
        correction happens before sparsification; the optimizer's would apply it a second
        time, to the sparse update).

        With ``optimizer_momentum="move"`` the groups' one momentum becomes this sparsifier's
        and theirs is set to 0, with a warning. Without error feedback nothing is taken.

        Args:
            groups: the optimizer's ``param_groups`` (changed in place).

        Raises:
            ValueError: the optimizer has momentum and ``optimizer_momentum="error"``, or its
                groups' momenta differ or use Nesterov (they cannot move into one momentum).
        """
        moms = {float(g.get("momentum", 0.0) or 0.0) for g in groups}
        if moms <= {0.0} or not isinstance(self.memory, MomentumMemory):
            return
        how = (f"give the optimizer momentum=0 and DGC(momentum={max(moms)}) (DGC corrects "
               "momentum before sparsifying)")
        if self.optimizer_momentum == "error":
            raise ValueError(f"DGC: the optimizer has momentum {sorted(moms)}: {how}")
        if len(moms) > 1 or any(g.get("nesterov") for g in groups):
            raise ValueError(f"DGC: the optimizer's momentum {sorted(moms)} (nesterov: "
                             f"{any(g.get('nesterov') for g in groups)}) cannot move into "
                             f"DGC's one momentum: {how}")
        (m,) = moms
        warnings.warn(f"hvd_sparse: DGC corrects momentum itself: the optimizer's momentum {m} "
                      f"moves into DGC (was {self.momentum}) and the optimizer's is set to 0 "
                      "(DGC(..., optimizer_momentum='error') refuses instead)", stacklevel=3)
        self.momentum = self.memory.momentum = m
        for g in groups:
            g["momentum"] = 0.0
