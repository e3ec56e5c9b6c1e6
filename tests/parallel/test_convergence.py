"""Sparsified training keeps dense accuracy, 4 ranks: the convergence suite's MLP (momentum in
the optimizer, as users write it) and its CNN on scikit-learn's digits
(hvd_sparse/tools/lab/accuracy.py), TopK, DGC and ExDyna at 1% through
hvd_sparse.DistributedOptimizer against the dense scheme (Horovod's allreduce), one seed.
scripts/checks/convergence.py runs the same with 3 seeds, the CTR task and PowerSGD, and
docs/BENCHMARKS.md has its table and the spread the margins allow for.
"""
from __future__ import annotations

import horovod.torch as hvd
import pytest
from driver import Launch
from ranktools import start

from hvd_sparse.tools.lab.accuracy import train

LAUNCHES = [Launch(np=4, timeout=900, extended=True)]

SEED = 1
SPARSE = ("topk", "dgc", "exdyna")
# Held-out points a method may trail dense by in one run. The suite's means over 3 seeds are
# within 1 point on both tasks, but one MLP run is noisy, and two runs of one seed differ
# (Horovod's fusion changes the order of float sums; threshold selection turns that into other
# picks): ExDyna on seed 1 was 1.0 point ahead of dense in one run, 3.9 behind in another;
# per-seed gaps over the suite's seeds -2.9 to +2.9 (PowerSGD's -4.0 to +1.9); dense itself
# moves ~1 point. Digits: -0.3 to +0.3 (one test image is 0.28). The margins catch a collapse
# (ExDyna trailed by 21 points on this MLP before per-element selection, and sat at chance on
# digits before small tensors went out whole), not a point. (docs/BENCHMARKS.md, Convergence.)
MARGIN = {"mlp": 5.0, "digits": 1.5}


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], list[dict]]:
    """(task, method) -> every rank's result (all ranks train every run, in the same order)."""
    start()
    out = {}
    for task in MARGIN:
        for method in ("dense", *SPARSE):
            res = train(task, method, SEED)
            out[task, method] = hvd.allgather_object(res, name=f"acc.{task}.{method}")
    for method in SPARSE:  # stopped after 10 of its 20 epochs and resumed from a checkpoint
        res = train("digits", method, SEED, resume_at=10)
        out["resumed", method] = hvd.allgather_object(res, name=f"acc.resumed.{method}")
    return out


@pytest.mark.parametrize("task", list(MARGIN))
@pytest.mark.parametrize("method", SPARSE)
def test_sparsified_training_stays_within_the_margin_of_dense(runs, task, method):
    dense, mine = runs[task, "dense"][0], runs[task, method][0]
    assert dense["score"] > {"mlp": 0.7, "digits": 0.95}[task], "the task itself must be learnt"
    gap = 100 * (dense["score"] - mine["score"])
    assert gap <= MARGIN[task], f"{task}/{method}: {mine['scores']} vs dense {dense['scores']}"
    # every rank holds the same model
    assert len({r["checksum"] for r in runs[task, method]}) == 1, runs[task, method]


@pytest.mark.parametrize("task", list(MARGIN))
def test_sparsified_methods_send_a_fraction_of_dense_bytes(runs, task):
    # The suite measured 6-25% (DGC the most: its warm-up starts at 25% and each rank's 1% is
    # its own, so the union reaches 4%; digits sends 14% of its elements whole, the tensors
    # under 16,384 elements): under a third, or sparsification did not happen.
    dense = runs[task, "dense"][0]["bytes_per_step"]
    for method in SPARSE:
        sent = runs[task, method][0]["bytes_per_step"]
        assert sent < dense / 3, f"{task}/{method}: {sent:.0f} B/step vs dense {dense:.0f}"


@pytest.mark.parametrize("method", SPARSE)
def test_training_resumed_from_a_checkpoint_keeps_its_accuracy(runs, method):
    """digits, checkpointed after 10 of 20 epochs (model and optimizer state through
    torch.save/torch.load) and finished by a new model, optimizer and sparsifier loaded from
    it: the sparsifier's state (residuals, DGC's momentum, ExDyna's partitions and threshold)
    came back whole, and the run ends within the margin of dense, one model on every rank."""
    dense, mine = runs["digits", "dense"][0], runs["resumed", method]
    assert all(r["restored"] for r in mine), [r["restored"] for r in mine]
    gap = 100 * (dense["score"] - mine[0]["score"])
    assert gap <= MARGIN["digits"], f"resumed {method}: {mine[0]['scores']} vs {dense['scores']}"
    assert len({r["checksum"] for r in mine}) == 1, mine
