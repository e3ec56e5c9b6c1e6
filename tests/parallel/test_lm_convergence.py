"""The convergence suite's language model (task ``lm``: a byte-level transformer on the Python
standard library's own source, ``torch.optim.Adam``), reduced to 60 steps, 4 ranks: dense
(Horovod's allreduce), TopK 1% on the gradient (as users write it), the same with bfloat16
values on the wire (``wire="bf16"``), DGC 1% with ``sparsify="frozen"`` after 6 dense steps
(1-bit Adam's recipe, DGC's momentum correction) and TopK 1% the same way with
``local_updates`` (each rank's own unsent updates in its parameters, flushed at the end).
scripts/checks/convergence.py runs the full 300 steps with every method and 3 seeds;
docs/notes/adam-accuracy.md has the figures.
"""
from __future__ import annotations

import math

import horovod.torch as hvd
import pytest
from driver import Launch
from ranktools import start

from hvd_sparse.tools.lab.accuracy import train

LAUNCHES = [Launch(np=4, timeout=900, extended=True, env={"HVD_SPARSE_ACC_LM_STEPS": "60"})]

SEED = 1
RUNS = {"dense": ("dense", "gradient", 0), "topk": ("topk", "gradient", 0),
        "bf16": ("topk+bf16", "gradient", 0), "frozen": ("dgc", "frozen", 6),
        "local": ("topk", "frozen-local", 6)}
# Held-out loss a sparsified run may end above dense's, in % of dense's, at 60 steps. Measured
# (seed 1, docs/notes/adam-accuracy.md): dense 2.479, TopK 1% 2.988 (+20.5%), DGC 1% frozen
# 2.670 (+7.7%); at 300 steps +22-24% and +9-10% over 3 seeds: Adam's gap is real, and this
# test does not hide it. The bound catches a collapse or a broken reduction (a run that stops
# learning stays near its first evaluation's 3.1-3.9 nats/byte), not a point.
MARGIN = 30.0


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    """run -> every rank's result (every rank trains every run, in the same order)."""
    start()
    out = {}
    for key, (method, sparsify, dense_steps) in RUNS.items():
        res = train("lm", method, SEED, sparsify=sparsify, dense_steps=dense_steps)
        out[key] = hvd.allgather_object(res, name=f"lm.{key}")
    return out


def test_dense_learns_the_text(runs):
    dense = runs["dense"][0]
    assert dense["steps"] == 60 and dense["finite"], dense
    # from ln 256 = 5.5 nats/byte (uniform bytes) to 2.48 measured
    assert dense["score"] < 3.0 and dense["scores"][0] > dense["score"], dense["scores"]
    assert math.log(256) > dense["scores"][0]


@pytest.mark.parametrize("run", ["topk", "bf16", "frozen", "local"])
def test_sparsified_lm_learns_within_the_margin_of_dense(runs, run):
    dense, mine = runs["dense"][0], runs[run][0]
    # learning all along: 0.3 nats/byte or more below its first evaluation (step 10; measured
    # 0.86 for TopK, 0.49 for DGC frozen, whose dense first steps start it lower)
    assert mine["finite"] and mine["scores"][0] - mine["score"] > 0.3, mine["scores"]
    gap = 100 * (mine["score"] / dense["score"] - 1)
    assert gap <= MARGIN, f"{run}: {mine['scores']} vs dense {dense['scores']} (+{gap:.1f}%)"
    # every rank holds the same model (local: after its flush)
    assert len({r["checksum"] for r in runs[run]}) == 1, [r["checksum"] for r in runs[run]]


@pytest.mark.parametrize("run", ["topk", "frozen", "local"])
def test_sparsified_lm_sends_a_fraction_of_dense_bytes(runs, run):
    # Measured at 60 steps: TopK 1% 12% of dense's bytes (small tensors whole, the allgather
    # of 4 ranks' picks); DGC frozen 40% (dense steps 0-5, 12, 24 and 48, and DGC's density
    # warm-up from 25% over 20 steps). Above these bounds, sparsification did not happen.
    dense, mine = runs["dense"][0], runs[run][0]
    # local: 13 dense steps of 60 (the warm-up, the refreshes, their flushes and the last one)
    bound = {"topk": 1 / 3, "frozen": 1 / 2, "local": 1 / 2}[run]
    assert mine["bytes_per_step"] < dense["bytes_per_step"] * bound, (mine, dense)


def test_bf16_values_halve_the_values_bytes(runs):
    # TopK's bytes are its values and their indices (int32) in equal numbers, and the small
    # tensors whole: bfloat16 values take a quarter off at least (measured 0.71 at 300 steps)
    topk, bf16 = runs["topk"][0], runs["bf16"][0]
    assert bf16["wire"] == "bf16" and topk["wire"] == "float32"
    assert bf16["bytes_per_step"] < 0.8 * topk["bytes_per_step"], (bf16, topk)
