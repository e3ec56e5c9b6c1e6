"""Training converges with sparsified gradients at 4 ranks (tests/mp/convergence.py)."""
from __future__ import annotations

import pytest
from conftest import launch

SPARSE = ["topk", "dgc", "exdyna"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    reps = launch("convergence.py", 4, tmp_path_factory.mktemp("conv"), timeout=600)
    for rank, rep in enumerate(reps):
        assert rep["error"] == "", f"rank {rank}: {rep['error']}"
    return reps


@pytest.mark.parametrize("variant", SPARSE)
def test_held_out_accuracy_within_2_points_of_dense(reports, variant):
    rep = reports[0]
    assert rep["dense.accuracy"] > 0.9, "the task itself must be learnt"
    gap = rep["dense.accuracy"] - rep[f"{variant}.accuracy"]
    assert gap <= 0.02, f"{variant}: {rep[f'{variant}.accuracy']:.4f} vs dense " \
                        f"{rep['dense.accuracy']:.4f}"
    # every rank holds the same model
    assert all(r[f"{variant}.accuracy"] == rep[f"{variant}.accuracy"] for r in reports)


def test_exdyna_density_tracks_the_request_and_is_exclusive(reports):
    for rank, rep in enumerate(reports):
        assert abs(rep["exdyna.density"] - 0.01) <= 0.001, f"rank {rank}: {rep['exdyna.density']}"
        assert rep["exdyna.overlap"] == "", f"rank {rank}: {rep['exdyna.overlap']}"


def test_sparse_variants_send_fewer_bytes(reports):
    rep = reports[0]
    for v in SPARSE:
        assert rep[f"{v}.bytes"] < rep["dense.bytes"] / 4, v
