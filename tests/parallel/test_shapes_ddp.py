"""Every shape through the DDP front end (torchrun, no Horovod), property-based (shapes.py):
sparse row gradients of any width, row count, dtype, duplicates and order, a rank with no rows;
dense tensors of any size and density; each scheme against a float64 reference within the
rounding the dtype allows, alike on every rank to the bit. Then the models users write
(Wide&Deep and DeepFM, first-order tables of width 1, tables in 16 bits) trained through the
hook, each step's gradients against the float64 average of every rank's.

Regression cases (``@example``) are the shapes that failed before: rows whose bytes are not a
multiple of 8 (widths 1-7 in 16 bits, odd widths in 32) broke the allgather's packing; the
others are where the tests' own bounds were first too tight (sums that land among float16's
subnormals)."""
from __future__ import annotations

import copy
import itertools
import os

import pytest
import shapes
import torch
import torch.distributed as dist
import user_models
from driver import Launch
from hypothesis import example, given
from shapes import Blocks, Rows
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from hvd_sparse import ddp, metrics

LAUNCHES = [Launch("torchrun", np=2, timeout=400), Launch("torchrun", np=3, timeout=400),
            Launch("torchrun", np=4, timeout=1200, extended=True,
                   env={"HVD_SPARSE_PROPERTY_EXAMPLES": "40"}),
            Launch("torchrun", np=2, timeout=1200, extended=True, id="torch-np2-many",
                   env={"HVD_SPARSE_PROPERTY_EXAMPLES": "100"})]
WORLD = int(os.environ.get("WORLD_SIZE", "2"))
ROWS_SCHEMES = ["auto", "allgather", "omnireduce", "dense"]  # "dense": rows by allgather
BLOCK_SCHEMES = ["dense", "allgather", "zen", "omnireduce", "auto"]
ROWS_RAN = {"auto": "rows", "allgather": "rows", "omnireduce": "rows+omnireduce", "dense": "rows"}
_states: dict[str, ddp.State] = {}
_names = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def group():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    yield
    for s in _states.values():
        s.close()
    dist.destroy_process_group()


def state(scheme: str) -> ddp.State:
    """One per scheme, made at first use (in one order on every rank: it is collective)."""
    if scheme not in _states:
        # small_bytes=0: the drawn tensors (most under 64 KiB) go by the scheme, not dense
        _states[scheme] = ddp.State(scheme=scheme, probe="off", small_bytes=0)
    return _states[scheme]


def gather(obj: object) -> list[object]:
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@pytest.mark.parametrize("scheme", ROWS_SCHEMES)
@shapes.SETTINGS
@given(case=shapes.rows(WORLD))
@example(case=Rows((5000,), (1,), "float16", (1,) * WORLD, 5000, 1, False, 0))
@example(case=Rows((5000,), (7,), "bfloat16", (384,) * WORLD, 5000, 1, False, 1))
@example(case=Rows((5000,), (3,), "float32", (7,) * WORLD, 5000, 1, True, 2))
@example(case=Rows((100_000,), (1,), "float32", (0,) + (129,) * (WORLD - 1), 300, 4, False, 3))
def test_rows(scheme: str, case: Rows) -> None:
    def run():
        name = f"rows.{next(_names)}"
        out = state(scheme).reduce(name, case.grad(dist.get_rank()))
        if not (out.is_sparse and out.is_coalesced()):
            return "not a coalesced sparse tensor", None
        ref, bound = case.reference(WORLD, 1 / WORLD)
        return shapes.mismatch(out.to_dense(), ref, bound, shapes.DTYPES[case.dtype]) or \
            shapes.went_by(metrics()[name], ROWS_RAN[scheme]), out
    shapes.check(case, run, gather)


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
@shapes.SETTINGS
@given(case=shapes.blocks(WORLD))
@example(case=Blocks((257,), "float16", 256, (1.0,) * WORLD, True, 0))
@example(case=Blocks((3, 5), "bfloat16", 256, (0.0,) * WORLD, False, 1))
@example(case=Blocks((26113,), "float16", 256, (0.5,) + (0.0,) * (WORLD - 1), False, 0))
def test_blocks(scheme: str, case: Blocks) -> None:
    def run():
        name = f"blocks.{next(_names)}"
        out = state(scheme).reduce(name, case.tensor(dist.get_rank()))
        ref, bound = case.reference(WORLD, 1 / WORLD)
        return shapes.mismatch(out, ref, bound, shapes.DTYPES[case.dtype]) or \
            shapes.went_by(metrics()[name], scheme), out
    shapes.check(case, run, gather)


# every scheme in float32; 16-bit tables through both row paths (auto's allgather, omnireduce)
MODEL_RUNS = [(m, torch.float32, s) for m in user_models.MODELS for s in ROWS_SCHEMES] + [
    (m, d, s) for m in user_models.MODELS for d in (torch.bfloat16, torch.float16)
    for s in ("auto", "omnireduce")]


@pytest.mark.parametrize(("model", "dtype", "scheme"), MODEL_RUNS,
                         ids=[f"{m}-{str(d)[6:]}-{s}" for m, d, s in MODEL_RUNS])
def test_user_model(model: str, dtype: torch.dtype, scheme: str) -> None:
    """Three SGD steps; each step's synced gradients against the float64 average of every
    rank's from the same parameters, the tables' results sparse as DDP's own, and alike on
    every rank to the bit."""
    torch.manual_seed(0)
    net = user_models.MODELS[model](dtype)
    ours = DDP(copy.deepcopy(net), bucket_cap_mb=0.1)
    ours.register_comm_hook(state(scheme), ddp.hook)
    opt = torch.optim.SGD(ours.parameters(), lr=0.05)
    for step in range(3):
        ref, bound = user_models.reference(ours.module, WORLD, step)
        opt.zero_grad()
        user_models.loss(ours, *user_models.batch(dist.get_rank(), step)).backward()
        for n, p in ours.module.named_parameters():
            assert p.grad.is_sparse == (p.dim() == 2 and n.split(".")[0] in
                                        ("wide", "deep", "first", "factors")), n
            why = shapes.mismatch(p.grad.to_dense(), ref[n], bound[n], p.dtype)
            assert not why, f"step {step}, {n}: {why}"
        digests = gather([shapes.digest(p.grad) for p in ours.parameters()])
        assert all(d == digests[0] for d in digests), f"step {step}: the ranks' gradients differ"
        opt.step()
    ran = {m["scheme"] for n, m in metrics().items() if n.startswith("ddp.bucket")}
    assert ran, "the hook reduced nothing"
