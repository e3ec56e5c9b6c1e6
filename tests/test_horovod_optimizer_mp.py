"""Horovod's DistributedOptimizer behaviours hold with hvd_sparse, for every scheme (2 ranks)."""
from __future__ import annotations

import pytest
from conftest import launch, passed

SCHEMES = ["allgather", "zen", "omnireduce", "auto"]
BOTH = ["train", "force", "clip", "step-warning", "unnamed", "bad-names", "requires-grad",
        "resume", "state-options", "no-grad-param", "sparse-embedding", "process-set"]
COMPRESSION_ONLY = ["sparse-as-dense", "groups-2", "groups-list", "groups-sparse-error",
                    "compress-direct"]
CASES = ([f"compression-{s}/{c}" for s in SCHEMES for c in BOTH + COMPRESSION_ONLY]
         + [f"optimizer-{s}/{c}" for s in SCHEMES for c in BOTH]
         + [f"allreduce-{s}/process-set" for s in SCHEMES]
         + ["allreduce-rows/process-set", "auto/process-set-avoids-omnireduce", "reinit"])


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return launch("horovod_optimizer.py", 2, tmp_path_factory.mktemp("hvdopt"), timeout=300)


@pytest.mark.parametrize("name", CASES)
def test_horovod_behaviour(reports, name):
    passed(reports, name)
