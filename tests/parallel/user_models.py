"""Models as users write them, for the parallel tests of both front ends: Wide&Deep and DeepFM
(first-order tables of width 1 beside wider ones), their tables in any dtype, and a float64
reference of the averaged gradient computed on every rank from every rank's batch."""
from __future__ import annotations

import copy

import shapes
import torch
from torch import nn

ROWS, FIELDS = 100_000, 4


class WideDeep(nn.Module):
    """Wide&Deep: a first-order (wide) table of width 1 summed over an example's ids, beside a
    deep table of width 8 under an MLP."""

    def __init__(self, dtype: torch.dtype = torch.float32, dim: int = 8) -> None:
        super().__init__()
        self.wide = nn.EmbeddingBag(ROWS, 1, mode="sum", sparse=True, dtype=dtype)
        self.deep = nn.EmbeddingBag(ROWS, dim, mode="sum", sparse=True, dtype=dtype)
        self.mlp = nn.Sequential(nn.Linear(dim, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        deep = self.deep(ids).to(self.mlp[0].weight.dtype)
        return self.wide(ids).squeeze(1).to(deep.dtype) + self.mlp(deep).squeeze(1)


class DeepFM(nn.Module):
    """DeepFM: per field id a first-order weight (width 1) and a factor (width 5) from
    ``nn.Embedding`` tables; the factors' pairwise interactions (FM) and an MLP over them."""

    def __init__(self, dtype: torch.dtype = torch.float32, dim: int = 5) -> None:
        super().__init__()
        self.first = nn.Embedding(ROWS, 1, sparse=True, dtype=dtype)
        self.factors = nn.Embedding(ROWS, dim, sparse=True, dtype=dtype)
        self.mlp = nn.Sequential(nn.Linear(FIELDS * dim, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        v = self.factors(ids).to(self.mlp[0].weight.dtype)  # [batch, fields, dim]
        fm = 0.5 * (v.sum(1).square() - v.square().sum(1)).sum(1)
        first = self.first(ids).squeeze(2).sum(1).to(v.dtype)
        return first + fm + self.mlp(v.flatten(1)).squeeze(1)


MODELS = {"wide_deep": WideDeep, "deepfm": DeepFM}


def batch(rank: int, step: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch: ``FIELDS`` ids an example, Zipf-like (hot ids shared by the
    ranks, a long tail), and targets."""
    g = torch.Generator().manual_seed(7919 * rank + step)
    ids = (torch.rand(size, FIELDS, generator=g) ** 4 * ROWS).long()
    return ids, torch.randn(size, generator=g)


def loss(model: nn.Module, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(ids).float(), y)


def reference(model: nn.Module, world: int, step: int
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the gradient averaged over ``world`` ranks' batches, in float64 from ``model``'s
    parameters; per parameter the bound of the error the ranks' rounding in the model's dtypes
    may make): every rank's backward run here, on a float64 copy and on a copy in the model's
    own dtypes."""
    exact = copy.deepcopy(model).double()
    mine = copy.deepcopy(model)
    grads: dict[str, torch.Tensor] = {}
    spread: dict[str, torch.Tensor] = {}
    for r in range(world):
        ids, y = batch(r, step)
        for m in (exact, mine):
            m.zero_grad()
            loss(m, ids, y).backward()
        for (n, p), (_, q) in zip(exact.named_parameters(), mine.named_parameters(),
                                  strict=True):
            g = p.grad.to_dense() / world
            grads[n] = grads.get(n, 0) + g
            # the rank's own rounding (its backward in its dtypes: its terms summed exactly),
            # then the sums' (every term's magnitude: duplicates cancel)
            raw, size = q.grad.double().to_dense(), shapes.magnitudes(q.grad).to_dense()
            err = (raw / world - g).abs() + torch.finfo(q.dtype).eps * (world + 2) * size / world
            spread[n] = spread.get(n, 0) + err
    bound = {n: spread[n] + torch.finfo(q.dtype).eps * grads[n].abs() + 1e-7
             for n, q in mine.named_parameters()}
    return grads, bound
