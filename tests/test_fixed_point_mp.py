"""omnireduce in fixed point (HVD_SPARSE_FIXED_POINT=1) under horovodrun -np 4: one launch,
the cases in tests/mp/fixed_point.py."""
from __future__ import annotations

import pytest
from conftest import launch, passed


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return launch("fixed_point.py", 4, tmp_path_factory.mktemp("fixed"),
                  env={"HVD_SPARSE_FIXED_POINT": "1", "HVD_SPARSE_TIMEOUT": "20"}, timeout=300)


def test_within_the_bound_and_the_integer_model_on_every_rank(reports):
    for rank, rep in enumerate(reports):
        cases = {k: v for k, v in rep.items() if k.startswith("fixed/")}
        assert len(cases) == 15, f"rank {rank} ran {len(cases)} cases"
        failures = {k: v for k, v in cases.items() if v}
        assert not failures, f"rank {rank}: {failures}"


def test_bit_identical_on_every_rank(reports):
    digests = [{k: v for k, v in rep.items() if k.startswith("_digest/")} for rep in reports]
    assert len(digests[0]) == 15
    assert all(d == digests[0] for d in digests[1:])


@pytest.mark.parametrize("name", ["nonfinite/nan", "nonfinite/inf"])
def test_non_finite_goes_dense_like_hvd_allreduce(reports, name):
    passed(reports, name)


@pytest.mark.parametrize("name", ["overflow/error", "overflow/fallback"])
def test_overflow_is_an_error_naming_the_tensor_or_goes_dense(reports, name):
    passed(reports, name)
