"""Sparsifiers under every scheme and both APIs (tests/mp/sparsify_schemes.py, 4 ranks)."""
from __future__ import annotations

import pytest
from conftest import launch, passed

SCHEMES = ["dense", "allgather", "zen", "omnireduce", "auto"]
CASES = [(s, "optimizer", "exdyna") for s in SCHEMES] + [
    (s, "compression", "topk") for s in SCHEMES] + [
    ("allgather", "compression", "dgc"), ("zen", "optimizer", "dgc")]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return launch("sparsify_schemes.py", 4, tmp_path_factory.mktemp("sparsify"), timeout=300)


@pytest.mark.parametrize("scheme,api,kind", CASES)
def test_reduces_the_sparsified_gradient_like_dense_allreduce(reports, scheme, api, kind):
    passed(reports, f"{scheme}.{api}.{kind}")
