"""Sparsifiers under every scheme and both APIs (tests/mp/sparsify_schemes.py)."""
from __future__ import annotations

import pytest
from conftest import launch, passed

SCHEMES = ["dense", "allgather", "zen", "omnireduce", "auto"]
CASES = [(s, "optimizer", "exdyna") for s in SCHEMES] + [
    (s, "compression", "topk") for s in SCHEMES] + [
    ("allgather", "compression", "dgc"), ("zen", "optimizer", "dgc")]


@pytest.fixture(scope="module", params=["np4", "staged-np2"])
def reports(request, tmp_path_factory):
    """4 ranks; and 2 ranks on the path of GPU tensors (HVD_SPARSE_CPU_AS_DEVICE: sparsified by
    torch operations, staged through host memory)."""
    staged = request.param == "staged-np2"
    return launch("sparsify_schemes.py", 2 if staged else 4, tmp_path_factory.mktemp("sparsify"),
                  env={"HVD_SPARSE_CPU_AS_DEVICE": "1"} if staged else {}, timeout=300)


@pytest.mark.parametrize("scheme,api,kind", CASES)
def test_reduces_the_sparsified_gradient_like_dense_allreduce(reports, scheme, api, kind):
    passed(reports, f"{scheme}.{api}.{kind}")
