"""Every shape through the Horovod front end (horovodrun, Gloo), property-based (shapes.py):
``hvd_sparse.allreduce`` of sparse row gradients of any width, row count, dtype, duplicates and
order, a rank with no rows; of dense tensors of any size, density and block size; several of
them in flight at once; each scheme and op against a float64 reference within the rounding the
dtype allows, alike on every rank to the bit. Then Wide&Deep and DeepFM (first-order tables of
width 1, tables in 16 bits) trained with ``hvd_sparse.DistributedOptimizer``, each step's
gradients against the float64 average of every rank's.

Regression cases (``@example``): rows whose bytes are not a multiple of 8; an uncoalesced
float16 gradient densified (``scheme="dense"``), whose duplicates ``to_dense`` added in 16 bits
(now in float32, rounded once)."""
from __future__ import annotations

import copy
import itertools
import os

import horovod.torch as hvd
import pytest
import shapes
import torch
import user_models
from driver import Launch
from hypothesis import example, given
from hypothesis import strategies as st
from ranktools import start
from shapes import Blocks, Rows

import hvd_sparse

LAUNCHES = [Launch(np=2, timeout=400), Launch(np=3, timeout=400),
            Launch(np=4, timeout=1200, extended=True, env={"HVD_SPARSE_PROPERTY_EXAMPLES": "40"}),
            Launch(np=2, timeout=1200, extended=True, id="gloo-np2-many",
                   env={"HVD_SPARSE_PROPERTY_EXAMPLES": "100"})]
WORLD = int(os.environ.get("HOROVOD_SIZE", "2"))
ROWS_SCHEMES = ["auto", "allgather", "omnireduce", "dense"]  # "dense": densified, reduced
BLOCK_SCHEMES = ["dense", "allgather", "zen", "omnireduce", "auto"]
ROWS_RAN = {"auto": "auto", "allgather": "rows", "omnireduce": "rows+omnireduce",
            "dense": "dense"}
OPS = {"average": hvd.Average, "sum": hvd.Sum}
_names = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def horovod():
    start(probe="off", small_bytes=0)  # the drawn tensors (most under 64 KiB) go by the scheme
    yield
    hvd_sparse.shutdown()


def gather(obj: object) -> list[object]:
    return hvd.allgather_object(obj, name=f"verdict.{next(_names)}")


def compare(case: Rows | Blocks, out: torch.Tensor, op: str) -> str:
    ref, bound = case.reference(WORLD, 1 / WORLD if op == "average" else 1.0)
    return shapes.mismatch(out.to_dense() if out.is_sparse else out, ref, bound,
                           shapes.DTYPES[case.dtype])


def tensor(case: Rows | Blocks) -> torch.Tensor:
    return case.grad(hvd.rank()) if isinstance(case, Rows) else case.tensor(hvd.rank())


@pytest.mark.parametrize("scheme", ROWS_SCHEMES)
@shapes.SETTINGS
@given(case=shapes.rows(WORLD), op=st.sampled_from(list(OPS)))
@example(case=Rows((5000,), (1,), "float16", (1,) * WORLD, 5000, 1, False, 0), op="average")
@example(case=Rows((5000,), (5,), "bfloat16", (385,) * WORLD, 5000, 1, False, 1), op="sum")
@example(case=Rows((1,), (1,), "float16", (70,) + (0,) * (WORLD - 1), 1, 1, False, 0),
         op="average")
def test_rows(scheme: str, case: Rows, op: str) -> None:
    def run():
        name = f"rows.{next(_names)}"
        out = hvd_sparse.allreduce(tensor(case), name=name, op=OPS[op], scheme=scheme)
        if out.is_sparse != (scheme != "dense") or (out.is_sparse and not out.is_coalesced()):
            return f"a {out.layout} result", out
        return compare(case, out, op) or shapes.went_by(hvd_sparse.metrics()[name],
                                                        ROWS_RAN[scheme]), out
    shapes.check(case, run, gather)


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
@shapes.SETTINGS
@given(case=shapes.blocks(WORLD, st.sampled_from([1, 7, 64, 256, 1000])),
       op=st.sampled_from(list(OPS)))
@example(case=Blocks((257,), "float16", 256, (1.0,) * WORLD, True, 0), op="average")
def test_blocks(scheme: str, case: Blocks, op: str) -> None:
    def run():
        name = f"blocks.{next(_names)}"
        out = hvd_sparse.allreduce(tensor(case), name=name, op=OPS[op], scheme=scheme,
                                   block_size=case.block)
        return compare(case, out, op) or shapes.went_by(hvd_sparse.metrics()[name], scheme), out
    shapes.check(case, run, gather)


@shapes.SETTINGS
@given(cases=st.lists(st.one_of(shapes.rows(WORLD), shapes.blocks(WORLD)), min_size=2,
                      max_size=5),
       scheme=st.sampled_from(["auto", "allgather", "omnireduce"]))
def test_in_flight_together(cases: list[Rows | Blocks], scheme: str) -> None:
    """Several tensors of several shapes submitted before any is waited for, finished in the
    reverse order."""
    def run():
        handles = [hvd_sparse.allreduce_async(tensor(c), name=f"many.{next(_names)}",
                                              scheme=scheme) for c in cases]
        outs = [hvd_sparse.synchronize(h) for h in reversed(handles)][::-1]
        why = "; ".join(f"tensor {i}: {w}" for i, (c, o) in enumerate(zip(cases, outs,
                                                                          strict=True))
                        if (w := compare(c, o, "average")))
        return why, torch.cat([(o.to_dense() if o.is_sparse else o).reshape(-1).double()
                               for o in outs])
    shapes.check(cases, run, gather)


# every scheme in float32; 16-bit tables through both row paths (auto's allgather, omnireduce)
MODEL_RUNS = [(m, torch.float32, s) for m in user_models.MODELS
              for s in ("auto", "allgather", "omnireduce")] + [
    (m, d, s) for m in user_models.MODELS for d in (torch.bfloat16, torch.float16)
    for s in ("auto", "omnireduce")]


@pytest.mark.parametrize(("model", "dtype", "scheme"), MODEL_RUNS,
                         ids=[f"{m}-{str(d)[6:]}-{s}" for m, d, s in MODEL_RUNS])
def test_user_model(model: str, dtype: torch.dtype, scheme: str) -> None:
    """Three SGD steps through ``hvd_sparse.DistributedOptimizer``; each step's reduced
    gradients against the float64 average of every rank's from the same parameters, the
    tables' by their rows, alike on every rank to the bit."""
    torch.manual_seed(0)
    net = copy.deepcopy(user_models.MODELS[model](dtype))
    opt = hvd_sparse.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05),
                                          named_parameters=net.named_parameters(),
                                          scheme=scheme)
    for step in range(3):
        ref, bound = user_models.reference(net, WORLD, step)
        opt.zero_grad()
        user_models.loss(net, *user_models.batch(hvd.rank(), step)).backward()
        opt.synchronize()
        for n, p in net.named_parameters():
            why = shapes.mismatch(p.grad.to_dense(), ref[n], bound[n], p.dtype)
            assert not why, f"step {step}, {n}: {why}"
            ran = hvd_sparse.metrics()[n]["scheme"]
            assert not p.grad.is_sparse or ran.startswith("rows"), f"{n} reduced by {ran}"
        digests = gather([shapes.digest(p.grad) for p in net.parameters()])
        assert all(d == digests[0] for d in digests), f"step {step}: the ranks' gradients differ"
        with opt.skip_synchronize():
            opt.step()
