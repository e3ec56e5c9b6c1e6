"""Convergence with sparsified gradients at 4 ranks: dense vs TopK / DGC / ExDyna at 1%.

A synthetic teacher-student task with a fixed seed: a random linear teacher labels Gaussian
inputs with 10 classes; a softmax-regression student (one weight tensor) learns them from
per-rank batches and is scored on a held-out set. Every variant starts from the same student and
sees the same batches, through hvd_sparse.DistributedOptimizer: the sparse variants with a
sparsifier (error feedback on), the allgather scheme and 4-element blocks; dense with the dense
scheme (Horovod's allreduce, unchanged). ExDyna's selected blocks are gathered at the end to
check that no block was selected by two ranks in one step.

``train`` gives per rank: "<variant>.accuracy", "<variant>.density" (mean union density after
warm-up), "<variant>.bytes" (mean bytes this rank sent per step), "seconds", "exdyna.overlap"
('' or which steps had a block chosen twice). scripts/convergence.py prints them (through
tests/mp/convergence.py).
"""
from __future__ import annotations

import os
import time

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from ranktools import start
from torch import nn

import hvd_sparse

LAUNCHES = [Launch(np=4, timeout=600)]

IN, CLASSES = 128, 10
STEPS = int(os.environ.get("HVD_SPARSE_CONV_STEPS", "3000"))
WARMUP = STEPS // 4  # density is judged after this many steps
BATCH, LR, DENSITY, BLOCK = 32, 0.1, 0.01, 4


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-labelled train shards (this rank's) and a held-out set (the same on all ranks)."""
    g = torch.Generator().manual_seed(1234)
    teacher = torch.randn(IN, CLASSES, generator=g)

    def label(x: torch.Tensor) -> torch.Tensor:
        return (x @ teacher).argmax(1)

    x_test = torch.randn(4000, IN, generator=g)
    x = torch.randn(hvd.size() * STEPS * BATCH, IN, generator=g)
    mine = x.view(hvd.size(), STEPS * BATCH, IN)[hvd.rank()]
    return mine, label(mine), x_test, label(x_test)


def student() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(IN, CLASSES, bias=False)


class Recording(hvd_sparse.ExDyna):
    """ExDyna that also keeps each tensor's last selection, for the exclusivity check."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.seen: dict[str, torch.Tensor] = {}

    def select(self, name, x, block_size):
        idx, unit = super().select(name, x, block_size)
        mask = torch.zeros(-(-x.numel() // unit), dtype=torch.uint8)
        mask[idx] = 1
        self.seen[name] = mask
        return idx, unit


VARIANTS = ("dense", "topk", "dgc", "exdyna")


def make(variant: str) -> tuple[nn.Module, torch.optim.Optimizer, hvd_sparse.Sparsifier | None]:
    model = student()
    sparsifier = {"dense": None, "topk": hvd_sparse.TopK(DENSITY),
                  "dgc": hvd_sparse.DGC(DENSITY, momentum=0.9),
                  "exdyna": Recording(DENSITY)}[variant]
    # DGC corrects momentum before sparsifying: its optimizer has none of its own.
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0 if variant == "dgc" else 0.9)
    named = [(f"{variant}.{n}", p) for n, p in model.named_parameters()]
    # Dense: the dense scheme is Horovod's allreduce, unchanged.
    opt = hvd_sparse.DistributedOptimizer(
        opt, named_parameters=named, scheme="dense" if sparsifier is None else "allgather",
        block_size=BLOCK, sparsifier=sparsifier)
    return model, opt, sparsifier


def train(results: dict[str, object]) -> None:
    """All variants step together, so their reductions share Horovod's cycles."""
    runs = {v: make(v) for v in VARIANTS}
    x, y, x_test, y_test = data()
    loss_fn = nn.CrossEntropyLoss()
    sent: dict[str, float] = dict.fromkeys(VARIANTS, 0.0)
    union: dict[str, float] = dict.fromkeys(VARIANTS, 0.0)
    seen: list[torch.Tensor] = []  # ExDyna: this rank's selected blocks, per step
    t0 = time.perf_counter()
    for step in range(STEPS):
        sl = slice(step * BATCH, (step + 1) * BATCH)
        for model, opt, _ in runs.values():
            opt.zero_grad()
            loss_fn(model(x[sl]), y[sl]).backward()  # starts the reduction
        for _, opt, _ in runs.values():
            opt.step()
        m = hvd_sparse.metrics()
        for v, (model, _, _) in runs.items():
            names = [f"{v}.{n}" for n, _ in model.named_parameters()]
            sent[v] += sum(m[n]["bytes_sent"] for n in names)
            if step >= WARMUP and v != "dense":
                union[v] += sum(m[n]["union"] for n in names)
        exdyna_model, _, recording = runs["exdyna"]
        seen.append(torch.cat([recording.seen[f"exdyna.{n}"]
                               for n, _ in exdyna_model.named_parameters()]))
    seconds = time.perf_counter() - t0
    numel = sum(p.numel() for p in student().parameters())
    for v, (model, _, _) in runs.items():
        with torch.no_grad():
            acc = float((model(x_test).argmax(1) == y_test).float().mean())
        results.update({f"{v}.accuracy": acc, f"{v}.bytes": sent[v] / STEPS,
                        f"{v}.density": (union[v] / (STEPS - WARMUP) / numel
                                         if v != "dense" else 1.0)})
    results["seconds"] = seconds
    # One allgather at the end: [ranks, steps, blocks]; a block counted twice in one step was
    # selected by two ranks.
    everyone = hvd.allgather(torch.stack(seen).unsqueeze(0), name="exdyna.seen")
    twice = (everyone.sum(0) > 1).any(1).nonzero()
    results["exdyna.overlap"] = (f"{len(twice)} steps had a block chosen twice, first step "
                                 f"{int(twice[0])}" if len(twice) else "")


SPARSE = ["topk", "dgc", "exdyna"]


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    """Every rank's results (one allgather: the checks below need no collective)."""
    start()
    results: dict[str, object] = {}
    train(results)
    return hvd.allgather_object(results, name="results")


@pytest.mark.parametrize("variant", SPARSE)
def test_held_out_accuracy_within_2_points_of_dense(runs, variant):
    rep = runs[0]
    assert rep["dense.accuracy"] > 0.9, "the task itself must be learnt"
    gap = rep["dense.accuracy"] - rep[f"{variant}.accuracy"]
    assert gap <= 0.02, f"{variant}: {rep[f'{variant}.accuracy']:.4f} vs dense " \
                        f"{rep['dense.accuracy']:.4f}"
    # every rank holds the same model
    assert all(r[f"{variant}.accuracy"] == rep[f"{variant}.accuracy"] for r in runs)


def test_exdyna_density_tracks_the_request_and_is_exclusive(runs):
    for rank, rep in enumerate(runs):
        assert abs(rep["exdyna.density"] - 0.01) <= 0.001, f"rank {rank}: {rep['exdyna.density']}"
        assert rep["exdyna.overlap"] == "", f"rank {rank}: {rep['exdyna.overlap']}"


def test_sparse_variants_send_fewer_bytes(runs):
    rep = runs[0]
    for v in SPARSE:
        assert rep[f"{v}.bytes"] < rep["dense.bytes"] / 4, v
