"""A several-layer model trained with every sparsifier (horovodrun -np 4), scheme "auto".

MLP 64-256-256-10 (ReLU), SGD, batch 64 per rank, on a teacher-labelled synthetic task. Its
tensors span every case the one-tensor convergence test never met: a 64k-element weight,
a 256-element bias (one block), and the last bias with 10 elements (fewer blocks than ranks).
Each variant goes through hvd_sparse.DistributedOptimizer; "auto" may pick any scheme,
omnireduce included (local aggregators). Dense is the dense scheme (Horovod's allreduce).
TopK and DGC select 1% per rank; ExDyna's density is global, so it gets 4%: the same union.

Writes per rank: "<variant>.accuracy" (held-out), "<variant>.params" (a checksum of the final
weights, which every rank must share), "<variant>.error" ('' or a traceback).
"""
from __future__ import annotations

import os
import traceback

import horovod.torch as hvd
import torch
from common import report, start
from torch import nn

import hvd_sparse

IN, HIDDEN, CLASSES = 64, 256, 10
STEPS = int(os.environ.get("HVD_SPARSE_MLP_STEPS", "240"))  # ~3 "epochs" of 80 steps
BATCH, LR, DENSITY = 64, 0.05, 0.01
VARIANTS = ("dense", "topk", "threshold", "dgc", "exdyna")


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    teacher = torch.randn(IN, CLASSES, generator=g)
    x_test = torch.randn(2000, IN, generator=g)
    x = torch.randn(hvd.size(), STEPS * BATCH, IN, generator=g)[hvd.rank()]
    return x, (x @ teacher).argmax(1), x_test, (x_test @ teacher).argmax(1)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def sparsifier(variant: str) -> hvd_sparse.Sparsifier | None:
    return {"dense": None, "topk": hvd_sparse.TopK(DENSITY),
            "threshold": hvd_sparse.Threshold(1e-3), "dgc": hvd_sparse.DGC(DENSITY),
            "exdyna": hvd_sparse.ExDyna(DENSITY * hvd.size())}[variant]


def train(variant: str, results: dict[str, object]) -> None:
    net, sp = model(), sparsifier(variant)
    # DGC corrects momentum itself: its optimizer has none.
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.0 if variant == "dgc" else 0.9)
    opt = hvd_sparse.DistributedOptimizer(
        opt, named_parameters=[(f"{variant}.{n}", p) for n, p in net.named_parameters()],
        scheme="dense" if sp is None else "auto", sparsifier=sp,
        block_size=None if variant == "dense" else 4)
    x, y, x_test, y_test = data()
    loss_fn = nn.CrossEntropyLoss()
    for step in range(STEPS):
        sl = slice(step * BATCH, (step + 1) * BATCH)
        opt.zero_grad()
        loss_fn(net(x[sl]), y[sl]).backward()
        opt.step()
    with torch.no_grad():
        results[f"{variant}.accuracy"] = float((net(x_test).argmax(1) == y_test).float().mean())
        results[f"{variant}.params"] = float(sum(p.double().sum() * (i + 1)
                                                 for i, p in enumerate(net.parameters())))


def main() -> None:
    start()
    results: dict[str, object] = {}
    for variant in os.environ.get("HVD_SPARSE_MLP_VARIANTS", ",".join(VARIANTS)).split(","):
        try:
            results[f"{variant}.error"] = ""
            train(variant, results)
        except Exception:  # noqa: BLE001 - the report carries the failure to pytest
            results[f"{variant}.error"] = traceback.format_exc(limit=6)
    report(results)


if __name__ == "__main__":
    main()
