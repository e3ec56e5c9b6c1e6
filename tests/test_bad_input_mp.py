"""Bad input under horovodrun -np 2: clear errors on every rank, never a hang or a wrong sum."""
from __future__ import annotations

import pytest
from conftest import launch

TIMEOUT = 4


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return launch("bad_input.py", 2, tmp_path_factory.mktemp("bad"),
                  env={"HVD_SPARSE_TIMEOUT": str(TIMEOUT)}, timeout=240)


@pytest.mark.parametrize("scheme", ["dense", "allgather", "zen", "omnireduce", "auto"])
@pytest.mark.parametrize("kind", ["shape", "numel", "small", "dtype"])
def test_mismatch_raises_on_every_rank(reports, kind, scheme):
    for rank, rep in enumerate(reports):
        assert rep[f"mismatch.{kind}.{scheme}"] == "", f"rank {rank}"


@pytest.mark.parametrize("scheme", ["dense", "allgather", "zen", "omnireduce", "auto"])
def test_edge_shapes_and_nan_inf(reports, scheme):
    for rep in reports:
        assert rep[f"edge.{scheme}"] == ""
        assert rep[f"nan-inf.{scheme}"] == ""


def test_bad_arguments(reports):
    assert all(rep["bad-arguments"] == "" for rep in reports)


def test_silent_peer_times_out_naming_the_tensor(reports):
    assert reports[0]["silent-peer-timeout"] == ""


def test_dead_peer_fails_within_timeout(reports):
    assert reports[0]["dead-peer"] == ""
