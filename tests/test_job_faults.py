"""Faults that end a Horovod job: killing rank 0 takes its aggregators with it
(tests/parallel/test_aggregation_faults.py::test_rank0_dies, on 2 ranks)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "parallel"))
from driver import Launch, run  # noqa: E402

MODULE = "tests/parallel/test_aggregation_faults.py"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return False


def test_killing_rank0_leaves_no_aggregator(tmp_path):
    outcome = run(MODULE, Launch(np=2, args=("-k", "rank0_dies"), timeout=120), tmp_path)
    outcome.check()
    assert outcome.tests() == [f"{MODULE}::test_rank0_dies"]
    pids = json.loads((tmp_path / "aggregator_pids.json").read_text())
    assert pids
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [p for p in pids if _alive(p)]
    for p in alive:
        os.kill(p, 9)
    assert not alive, f"aggregator(s) {alive} outlived rank 0"
