"""Training with sparse synchronization tracks dense Horovod step by step (horovodrun -np 4)."""
from __future__ import annotations

import pytest
from conftest import launch, passed

CASES = ["compression-auto-30-steps", "compression-zen", "compression-grouped",
         "compression-omnireduce", "optimizer-omnireduce-predivide-and-passes",
         "sparse-embedding-omnireduce",
         "optimizer-allgather", "op-sum",
         "optimizer-op-sum", "predivide-and-passes", "optimizer-predivide-and-passes",
         "sparse-embedding-compression", "sparse-embedding-optimizer", "adasum-rejected"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return launch("training.py", 4, tmp_path_factory.mktemp("train"), timeout=480)


@pytest.mark.parametrize("name", CASES)
def test_parity(reports, name):
    passed(reports, name)
