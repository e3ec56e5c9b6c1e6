"""Many reductions in flight, inputs dropped, synchronized in reverse (tests/mp/stress.py, 4 ranks):
no deadlock between the aggregation engine's thread and Python, and correct sums."""
from __future__ import annotations

import pytest
from conftest import launch, passed


@pytest.mark.parametrize("scheme,iters", [("omnireduce", 150), ("auto", 30)])
def test_inflight_reductions_finish_and_match_the_reference(tmp_path, scheme, iters):
    # The hang showed as a Gloo/hvd_sparse timeout on the peers: keep it short.
    reports = launch(f"stress.py {scheme} {iters}", 4, tmp_path, timeout=240,
                     env={"HVD_SPARSE_TIMEOUT": "20"})
    passed(reports, f"{scheme}-inflight")
