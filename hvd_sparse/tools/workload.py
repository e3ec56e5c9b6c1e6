"""A synthetic click-through workload: embedding tables over Zipf-distributed ids, dense
features, and labels from a fixed teacher. The demo trains it, and the training tests compare
sparse and dense synchronization on it: gradients of embedding tables that a batch touches only
in a few rows, the case hvd_sparse is for.

Ids are frequency-ranked (id 0 is the most common), as vocabularies built from counts usually
are. The teacher is seeded without the rank, so all ranks learn the same function; examples are
seeded with it, so each rank sees its own shard.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

# Categorical fields: (name, vocabulary size, Zipf exponent). 264k rows x 32 dims make a 32 MiB
# embedding gradient per step, of which a batch touches a few percent.
FIELDS: tuple[tuple[str, int, float], ...] = (
    ("user", 160_000, 1.05),
    ("item", 96_000, 1.1),
    ("site", 8_000, 1.2),
)
N_DENSE = 8  # dense features per example


def vocab_sizes(scale: float = 1.0) -> list[int]:
    """The fields' vocabulary sizes times ``scale`` (at least 8 rows each)."""
    return [max(8, int(n * scale)) for _, n, _ in FIELDS]


def zipf_ids(rng: np.random.Generator, n: int, a: float, size: int) -> np.ndarray:
    """Truncated Zipf over [0, n): P(k) ~ 1 / (k + 1)^a, by inverse CDF."""
    cdf = np.cumsum(1.0 / np.arange(1, n + 1) ** a)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(size)), n - 1)


@dataclass
class Shard:
    ids: torch.Tensor  # [rows, fields] int64
    dense: torch.Tensor  # [rows, N_DENSE] float32
    label: torch.Tensor  # [rows] float32

    def batch(self, i: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Examples [i * size, (i + 1) * size): (ids, dense, label)."""
        sl = slice(i * size, (i + 1) * size)
        return self.ids[sl], self.dense[sl], self.label[sl]


def make_shard(seed: int, rank: int, rows: int, sizes: list[int], tag: int = 0) -> Shard:
    """``rows`` examples of rank ``rank``; ``tag`` tells apart sets of one seed (train, eval)."""
    t_rng = np.random.default_rng([seed, 0])
    teacher = [t_rng.normal(0.0, 1.0, n) for n in sizes]
    w_dense = t_rng.normal(0.0, 0.5, N_DENSE)

    rng = np.random.default_rng([seed, 1 + tag, rank])
    ids = np.stack(
        [zipf_ids(rng, n, a, rows) for n, (_, _, a) in zip(sizes, FIELDS, strict=True)], axis=1
    )
    dense = rng.normal(0.0, 1.0, (rows, N_DENSE)).astype(np.float32)
    logit = sum(t[ids[:, i]] for i, t in enumerate(teacher)) + dense @ w_dense
    label = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return Shard(torch.from_numpy(ids), torch.from_numpy(dense), torch.from_numpy(label))


class CTRModel(nn.Module):
    """One embedding table per field, concatenated with the dense features, into an MLP.

    ``sparse=False`` (the default) makes each table's gradient a dense, mostly-zero tensor,
    which Horovod's dense path ships in full; ``sparse=True`` makes it a sparse COO tensor.
    """

    def __init__(self, sizes: list[int], dim: int, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.ModuleDict({name: nn.Embedding(n, dim, sparse=sparse)
                                  for (name, _, _), n in zip(FIELDS, sizes, strict=True)})
        for e in self.emb.values():
            nn.init.normal_(e.weight, 0.0, 0.05)
        self.mlp = nn.Sequential(
            nn.Linear(dim * len(FIELDS) + N_DENSE, 64), nn.ReLU(), nn.Linear(64, 1)
        )

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        feats = [e(ids[:, i]) for i, e in enumerate(self.emb.values())]
        return self.mlp(torch.cat([*feats, dense], dim=1)).squeeze(1)

    def loss(self, ids: torch.Tensor, dense: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(self(ids, dense), label)
