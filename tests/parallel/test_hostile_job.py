"""The job a hostile host attacks (tests/test_hostile.py launches it on the netns testbed, one
rank per worker host; no LAUNCHES of its own): the ranks reduce HOSTILE_TENSORS sparse tensors
with omnireduce while a host that sniffs the aggregation traffic sends forged, replayed and junk
packets at the aggregator and at the workers. Every result must equal Horovod's allreduce in
float64 on every rank; each rank leaves its worker engine's counters in the output folder.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import horovod.torch as hvd
import torch
from ranktools import close_to, start

import hvd_sparse
from hvd_sparse import basics

LAUNCHES = []  # tests/test_hostile.py launches it on its testbed
NUMEL = 1 << 20


def data(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + hvd.rank())
    keep = torch.rand(NUMEL // 256, generator=g) < 0.2
    return (torch.randn(NUMEL // 256, 256, generator=g) * keep[:, None]).view(-1)


def test_results_stay_exact_under_attack() -> None:
    start(probe="off", timeout=30)
    bad = []
    n = int(os.environ["HOSTILE_TENSORS"])
    for i in range(n):
        t = data(i)
        ref = hvd.allreduce(t.double(), name=f"ref.{i}", op=hvd.Sum)
        out = hvd_sparse.allreduce(t, name=f"t.{i}", scheme="omnireduce", op=hvd.Sum)
        why = close_to(out, ref, torch.float32)
        if why or hvd_sparse.metrics()[f"t.{i}"]["scheme"] != "omnireduce":
            bad.append(f"tensor {i}: {why or 'not aggregated'}")
    counters = {k: v for k, v in basics.state().omni.worker.stats().items()
                if isinstance(v, int)}
    Path(os.environ["HVD_SPARSE_TEST_OUT"], f"worker{hvd.rank()}.json").write_text(
        json.dumps({"tensors": n, **counters}))
    assert bad == [], bad
