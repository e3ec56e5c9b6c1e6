"""The block-sparse gradients the block benchmarks reduce (bench_codec.py, bench_sync.py,
bench_testbed.py, bench_hostwork.py, switch_accuracy.py)."""
from __future__ import annotations

import torch


def make_tensor(numel: int, block: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """Zeros except round(density * nblocks) whole blocks (at least one) of N(0,1) values."""
    nblocks = -(-numel // block)
    x = torch.zeros(nblocks, block)
    k = max(1, round(density * nblocks))
    rows = torch.randperm(nblocks, generator=gen)[:k]
    x[rows] = torch.randn(k, block, generator=gen)
    flat = x.view(-1)
    return flat if flat.numel() == numel else flat[:numel].clone()
