"""A dead aggregator under horovodrun -np 4: a clear error or the dense fallback, never a hang,
never a partial sum; no aggregator outlives the rank that started it."""
from __future__ import annotations

import json
import os
import time

import pytest
from conftest import launch, passed

TIMEOUT = 4


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return launch("aggregation_faults.py kill-aggregator", 4, tmp_path_factory.mktemp("faults"),
                  env={"HVD_SPARSE_TIMEOUT": str(TIMEOUT)}, timeout=300)


@pytest.mark.parametrize("name", ["killed-aggregator-error", "killed-aggregator-fallback",
                                  "killed-aggregator-fallback-inplace"])
def test_killed_aggregator(reports, name):
    passed(reports, name)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return False


def test_killing_rank0_leaves_no_aggregator(tmp_path):
    launch("aggregation_faults.py kill-rank0", 2, tmp_path, timeout=120, reports=False)
    pids = json.loads((tmp_path / "aggregator_pids.json").read_text())
    assert pids
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [p for p in pids if _alive(p)]
    for p in alive:
        os.kill(p, 9)
    assert not alive, f"aggregator(s) {alive} outlived rank 0"
