"""ExDyna (CCGrid'24): exclusive, dynamically balanced partitions and an online threshold.

The tensor is cut into fine blocks, the blocks into ``size`` contiguous partitions. At step t,
rank r selects only in partition (t + r) mod size, so no index is chosen by two ranks and the
union of the selections is just the sum of their counts (no "build-up"). ``size`` and ``rank``
are those of each reduction (``Sparsifier.join``): when the ranks change (a Horovod elastic job
that shrank or grew) the partitions are cut anew, alike on every rank. Inside its partition a
rank selects every element with |x| >= threshold, as the paper does: blocks only draw the
partitions. ``per_element=False`` selects whole blocks instead (score: mean |x| over the block),
exactly what the block codec ships, at a cost in accuracy: 4 ranks, MLP 64-256-256-10, SGD
momentum 0.9, 1%, 8 epochs of a teacher task: 86.8% per element (dense 86.4%), 84.2 / 74.2 /
63.6 / 44.4% with blocks of 4 / 16 / 64 / 256. A 256-block goes out about once in 100 steps with
~100 steps of residual in all its elements at once, which the optimizer's momentum then replays
~10 times; an element goes out as soon as it crosses the bar. So give the optimizer a small
``block_size`` (1..32), as for TopK, or the codec ships a whole block around each element.

``density`` is per rank, as for every sparsifier: the union the ranks send together is
``density x size``, the density the paper speaks of. The threshold is global: each step it is
the (1 - union density) quantile of a random sample of |x|
(of block scores with ``per_element=False``) over the whole tensor, times an online factor. A
rank selects only in the partition it drained longest ago, so the bare quantile lets through
too many (about 1.5x at 4 ranks); the factor corrects that. After each reduction every rank
counts the non-zero elements (blocks) of the reduced gradient per partition (identical on all
ranks, so all ranks move the same boundaries): neighbours whose counts differ by more than 5%
trade blocks, and the factor is scaled so the total tracks the requested density: by a damped
proportional step while off by more than 5%, then by the paper's fine steps (x1.005 when too
many, x0.995 when too few). The paper scales the threshold itself, from a fixed start; with
error feedback the residuals grow some 10x in the first 1/density steps, faster than 0.5% steps
can follow, hence the sampled quantile underneath. Without ``observe`` (no reduction seen) the
factor follows this rank's own count and the partitions stay fixed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from . import ops
from .base import Sparsifier, check_density

BALANCE_TOLERANCE = 0.05  # neighbours whose counts differ more than this trade blocks
FINE_STEP = 0.005  # the paper's threshold step inside the tolerance band
GAIN = 0.05  # factor correction per unit of relative count error outside the band
MAX_STEP = 1.1  # largest factor per step outside the band
SAMPLE_MIN, SAMPLE_HITS = 4096, 40  # |x| (or block scores) sampled per step: >= 40 above


@dataclass
class _State:
    bounds: torch.Tensor  # int64 [size + 1] block boundaries of the partitions
    block_size: int
    step: int = 0
    threshold: float | None = None
    scale: float = 1.0  # online factor on the sampled quantile
    density: float = 1.0  # the union's density the last selection aimed at (warm-up aware)
    local: tuple[int, float] | None = None  # this step's (count, best score) not yet observed


class ExDyna(Sparsifier):
    """ExDyna's exclusive, rebalanced partitions with an online threshold.

    ``density`` means what it means for every sparsifier: the fraction of its gradient each
    rank sends per step. The ranks' selections never overlap, so their union is
    ``density x ranks`` of the tensor (capped at 1); the paper's density is that union, so
    pass the paper's figure divided by the ranks.

    Args:
        density: the fraction of the tensor's elements (blocks, with ``per_element=False``)
            each rank sends per step, in (0, 1].
        error_feedback: keep what was not sent for the next step.
        block_size: the partitions' granularity in elements; None: the codec's block size
            of the call.
        per_element: select elements (the paper); False selects whole blocks (see the
            module's docstring for its cost in accuracy).
        **kw: ``Sparsifier``'s options (``warmup``, ``min_selected``, ``min_numel``,
            ``rank``, ``size``).

    Raises:
        ValueError: ``density`` outside (0, 1] or ``block_size`` < 1.

    Example:
        >>> sp = hvd_sparse.ExDyna(density=0.01)  # 1% per rank: a 4% union at 4 ranks
    """

    def __init__(self, density: float, error_feedback: bool = True,
                 block_size: int | None = None, *, per_element: bool = True,
                 **kw: int) -> None:
        super().__init__(error_feedback, **kw)
        self.density = check_density(density)
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.per_element = bool(per_element)
        self.states: dict[str, _State] = {}

    def state_dict(self) -> dict[str, Any]:
        """``Sparsifier.state_dict`` and each tensor's partitions, threshold and factor.

        Returns:
            Tensors and plain values (plain dicts: ``torch.load`` reads only those by default).
        """
        return {**super().state_dict(),
                "states": {n: dataclasses.asdict(st) for n, st in self.states.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what ``state_dict`` returned.

        Args:
            state: a ``state_dict()`` of an ExDyna.
        """
        super().load_state_dict(state)
        self.states = {n: _State(**{**d, "bounds": d["bounds"].clone(),
                                    "local": None if d["local"] is None else tuple(d["local"])})
                       for n, d in state["states"].items()}

    def rejoined(self) -> None:
        """The front end joined the ranks again (a Horovod elastic reset): every tensor's
        partitions, step and threshold are forgotten, on every rank alike, since the ranks that
        survived restored them from the last commit and those just started have none; each
        is cut anew for the ranks there are now. The error-feedback memory stays."""
        self.states.clear()

    def _state(self, name: str, numel: int, block_size: int) -> _State:
        bs = self.block_size or block_size
        st = self.states.get(name)
        nblocks = -(-numel // bs)
        # new partitions for another block, tensor or number of ranks (a job that shrank or
        # grew, a checkpoint of another size)
        if (st is None or st.block_size != bs or int(st.bounds[-1]) != nblocks
                or st.bounds.numel() != self.size + 1):
            edges = [round(i * nblocks / self.size) for i in range(self.size + 1)]
            st = self.states[name] = _State(torch.tensor(edges, dtype=torch.int64), bs)
        return st

    def partition(self, name: str) -> tuple[int, int]:
        """The partition this rank selects in at its next step.

        Args:
            name: the tensor's name (it must have been selected once).

        Returns:
            Its block range [b0, b1).
        """
        st = self.states[name]
        p = (st.step + self.rank) % self.size
        return int(st.bounds[p]), int(st.bounds[p + 1])

    def select(self, name: str, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
        """Selects in this rank's partition every unit at or above the global threshold.

        Args:
            name: the tensor's name.
            x: the gradient plus its memory, flat.
            block_size: the codec's block size of the call.

        Returns:
            (indices of the selected units, elements per unit).
        """
        st = self._state(name, x.numel(), block_size)
        units = self._units(st, x.numel())
        if st.local is not None:  # last step was never observed: steer by this rank alone
            count, best = st.local
            self._steer(st, count * self.size, best, units)
        b0, b1 = self.partition(name)
        st.step += 1
        unit = 1 if self.per_element else st.block_size
        lo, hi = (b0 * st.block_size, min(b1 * st.block_size, x.numel())) if unit == 1 \
            else (b0, b1)
        if lo >= hi:
            st.local = None
            return torch.empty(0, dtype=torch.int64, device=x.device), unit
        # Global threshold: the (1 - density) quantile of a sample of the whole tensor (|x| or
        # block scores), times the online factor that the observed counts steer.
        st.density = self.union_density(name)
        m = min(units, max(SAMPLE_MIN, round(SAMPLE_HITS / st.density)))
        seed = st.step * 7919 + self.rank
        if unit > 1:
            s = ops.sample_block_scores(x, unit, 0, units, m, seed)
        else:  # small tensors: every |x|, exactly
            s = ops.sample_abs(x, m, seed) if m < units else x.abs().float()
        st.threshold = st.scale * float(torch.topk(s, max(1, round(st.density * m))).values[-1])
        if unit > 1:
            idx, best, _ = ops.select_blocks(x, unit, b0, b1, st.threshold)
        else:
            part = x[lo:hi]
            idx = ops.select_abs_ge(part, st.threshold) + lo
            # only "was it all zero" matters to _steer: the max is needed when nothing passed
            best = st.threshold if idx.numel() else float(part.abs().max())
        st.local = (idx.numel(), best)
        return idx, unit

    def _units(self, st: _State, numel: int) -> int:
        """Selection units of the tensor: elements, or blocks with ``per_element=False``."""
        return numel if self.per_element else int(st.bounds[-1])

    def union_density(self, name: str) -> float:
        """The union's density this step: the per-rank density (warm-up aware) times the
        ranks, at most 1; the selections are exclusive, so it is what the threshold aims at.

        Args:
            name: the tensor's name.

        Returns:
            A fraction in (0, 1].
        """
        return min(1.0, self.density_now(name) * self.size)

    def skip(self, name: str) -> None:
        """Called instead of ``select`` on a step that went out dense: the partitions rotate.

        Args:
            name: the tensor's name.
        """
        st = self.states.get(name)
        if st is not None:
            st.step += 1
            st.local = None

    def observe(self, name: str, reduced: torch.Tensor, block_size: int = 1) -> None:
        """Steers the threshold and rebalances the partitions from the reduced gradient's
        counts per partition (alike on every rank, so every rank moves the same bounds).

        Args:
            name: the tensor's name.
            reduced: the reduced gradient.
            block_size: the codec's block size of the call.
        """
        st = self.states.get(name)
        if st is None:
            return super().observe(name, reduced, block_size)
        flat = reduced.detach().reshape(-1)
        flat = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
        if self.per_element:  # non-zero elements per partition: block bounds in elements
            bounds = (st.bounds * st.block_size).clamp_(max=flat.numel())
            counts, union, nonfinite = ops.partition_counts(flat, 1, bounds)
        else:
            counts, union, nonfinite = ops.partition_counts(flat, st.block_size, st.bounds)
        self.record_union(name, union, flat.numel())
        local, st.local = st.local, None
        if nonfinite:  # a rank sent a NaN/Inf gradient whole: these counts say nothing
            return
        best = local[1] if local is not None else 1.0
        self._steer(st, int(counts.sum()), best, self._units(st, flat.numel()))
        self._rebalance(st, counts.tolist())

    def _steer(self, st: _State, total: int, best: float, units: int) -> None:
        """Scales the threshold so the selected count tracks density * units."""
        if st.threshold is None or (total == 0 and best == 0.0):
            return  # an all-zero gradient says nothing about the right threshold
        target = max(1.0, st.density * units)
        ratio = max(total, 0.5) / target
        if abs(ratio - 1.0) > BALANCE_TOLERANCE:
            # Linear in the error, so the mean count (not its geometric mean) meets the target.
            st.scale *= min(MAX_STEP, max(1 / MAX_STEP, 1.0 + GAIN * (ratio - 1.0)))
        else:
            st.scale *= 1.0 + FINE_STEP if ratio > 1.0 else 1.0 - FINE_STEP

    def _rebalance(self, st: _State, counts: list[int]) -> None:
        """Moves the boundary between neighbours whose counts (of any unit) differ by more
        than 5%, towards the heavier one, by half the blocks that would even them out (at most a
        quarter of it)."""
        b = st.bounds.tolist()
        for i in range(len(counts) - 1):
            hi, lo = max(counts[i], counts[i + 1]), min(counts[i], counts[i + 1])
            if hi == 0 or hi - lo <= BALANCE_TOLERANCE * hi:
                continue
            heavy = i if counts[i] > counts[i + 1] else i + 1
            blocks = b[heavy + 1] - b[heavy]
            per_block = hi / max(1, blocks)
            move = min(blocks // 4, max(1, round((hi - lo) / (2 * per_block) / 2)))
            if move <= 0:
                continue
            # heavy on the left gives its right end away; on the right, its left end
            b[i + 1] += -move if heavy == i else move
        st.bounds = torch.tensor(b, dtype=torch.int64)
