"""Sparse COO gradients reduced by rows, 4 ranks (tests/mp/rows_cases.py)."""
from __future__ import annotations

import pytest
from conftest import launch


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return launch("rows_cases.py", 4, tmp_path_factory.mktemp("rows"), timeout=300)


def test_every_case_matches_dense_on_every_rank(reports):
    for rank, rep in enumerate(reports):
        assert len(rep) >= 13, f"rank {rank} ran only {len(rep)} cases"
        failed = {k: v for k, v in rep.items() if v}
        assert not failed, f"rank {rank}: {failed}"
