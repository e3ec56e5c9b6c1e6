"""Which collectives carry the DDP hook's buckets (torchrun, 2 ranks), read from the calls
themselves: the model's group is "recording" (recording_pg.py: a group that is not Gloo, as
NCCL is, and that records every call). A bucket that goes dense (scheme "dense", a small one,
one "auto" keeps sending dense) is reduced by the model's group from the hook, as DDP's default
hook reduces it, to DDP's own bits; sparsified buckets by the hook's streams, a host's sparse
buckets too; metrics name every bucket's route. Under HVD_SPARSE_CPU_AS_DEVICE the buckets
pose as a device's: a sparse bucket's rows are allgathered by the model's group and summed
where they are (equal to DDP's own within rounding), a sparsified bucket crosses to the host by
its non-zero blocks, not whole; and with a plain Gloo model's group, dense buckets still take
it. The ``cuda`` launches (gpu: scripts/checks/gpu_check.sh) run the same on CUDA models, one rank
per GPU where there are enough, else two ranks on one: the recording group over Gloo's CUDA
collectives, then the native group (NCCL with a GPU per rank, else Gloo)."""
from __future__ import annotations

import copy
import os

import pytest
import recording_pg
import torch
import torch.distributed as dist
from driver import Launch
from recording_pg import Recording
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from hvd_sparse import TopK, ddp, metrics, reset_metrics
from hvd_sparse.schemes import auto

LAUNCHES = [Launch("torchrun", np=2, timeout=300, args=("-k", "not device_")),
            Launch("torchrun", np=2, timeout=300, id="torch-np2-device",
                   env={"HVD_SPARSE_CPU_AS_DEVICE": "1"}),
            Launch("torchrun", np=2, timeout=300, id="torch-np2-device-gloo",
                   env={"HVD_SPARSE_CPU_AS_DEVICE": "1", "HVD_SPARSE_TEST_MODEL_GROUP": "gloo"}),
            Launch("torchrun", np=2, timeout=600, id="torch-np2-cuda", gpu=True,
                   env={"HVD_SPARSE_TEST_DEVICE": "cuda"}),
            Launch("torchrun", np=2, timeout=600, id="torch-np2-cuda-native", gpu=True,
                   env={"HVD_SPARSE_TEST_DEVICE": "cuda", "HVD_SPARSE_TEST_MODEL_GROUP": "native"})]
DEV = torch.device(os.environ.get("HVD_SPARSE_TEST_DEVICE", "cpu"))
DEVICE = DEV.type != "cpu" or os.environ.get("HVD_SPARSE_CPU_AS_DEVICE") == "1"
MODEL_GROUP = os.environ.get("HVD_SPARSE_TEST_MODEL_GROUP", recording_pg.NAME)
RECORDED = MODEL_GROUP == recording_pg.NAME


@pytest.fixture(scope="module", autouse=True)
def group():
    torch.set_num_threads(1)
    recording_pg.register()
    backend = MODEL_GROUP
    if DEV.type == "cuda":
        gpus = torch.cuda.device_count()
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local % gpus)  # two ranks on one GPU where there is one
        if backend == "native":  # NCCL takes one GPU per rank
            backend = "nccl" if gpus >= int(os.environ["LOCAL_WORLD_SIZE"]) else "gloo"
    dist.init_process_group(backend)
    yield
    dist.destroy_process_group()


def mlp() -> nn.Module:
    torch.manual_seed(0)  # buckets of 0.1 MB: the 256x256 layer (256 KiB) is one of its own
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 1)).to(DEV)


class Tabled(nn.Module):
    """``mlp()`` beside a sparse table (in ``dtype``)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.mlp = mlp()
        self.emb = nn.EmbeddingBag(5000, 16, mode="sum", sparse=True, dtype=dtype)
        self.to(DEV)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) + self.emb(ids).float().sum(1, keepdim=True)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    return torch.randn(32, 64, generator=g).to(DEV), torch.randn(32, 1, generator=g).to(DEV)


def step(m: nn.Module, k: int) -> None:
    m.zero_grad()
    x, y = batch(k)
    nn.functional.mse_loss(m(x), y).backward()


def routes() -> dict[str, str]:
    return {n: v["route"] for n, v in metrics().items() if n.startswith("ddp.bucket")}


def backward_calls(m: nn.Module, k: int) -> list[recording_pg.Call]:
    """The model's group's calls during one step's backward (the forward issues none)."""
    Recording.calls.clear()
    step(m, k)
    return list(Recording.calls)


@pytest.mark.parametrize("scheme", ["dense", "auto"])
def test_dense_buckets_go_by_the_models_group(scheme: str) -> None:
    """Every bucket of a dense model: under "dense" at once, under "auto" once it has sent
    the bucket dense ``auto.STEADY`` times; then bit for bit DDP's own result, one allreduce
    per bucket on the model's group from the thread running backward."""
    ref = DDP(mlp(), bucket_cap_mb=0.1)
    ours = DDP(copy.deepcopy(ref.module), bucket_cap_mb=0.1)
    state = ddp.State(scheme=scheme, probe="off")
    ours.register_comm_hook(state, ddp.hook)
    try:
        warm = 0 if scheme == "dense" else auto.STEADY + 1
        for k in range(warm):
            step(ours, k)
        step(ref, warm)
        reset_metrics()  # (DDP rebuilds its buckets after the first step: new numbers)
        calls = backward_calls(ours, warm)
        for (n, p), q in zip(ours.module.named_parameters(), ref.module.parameters(),
                             strict=True):
            assert torch.equal(p.grad, q.grad), n
        assert set(routes().values()) == {"model group"}, metrics()
        if RECORDED:  # one allreduce a bucket
            sizes = [c.numel[0] for c in calls if c.op == "allreduce"]
            assert len(sizes) == len(routes()), (calls, routes())
            assert sum(sizes) == sum(p.numel() for p in ours.parameters()), calls
            assert {c.thread for c in calls} == {"MainThread"}, calls
    finally:
        state.close()


def test_sparse_and_sparsified_buckets() -> None:
    """The buckets a sparsifier works on are the hook's streams', and so is a host's sparse
    table (the model's group carries nothing of them); on a device a sparsified bucket is staged
    by its non-zero blocks (a fraction of its bytes), not moved whole (a bucket of parameters
    all too small to sparsify goes dense, where it is), and the table's rows go by the model's
    group."""
    reset_metrics()
    torch.manual_seed(0)
    model = Tabled()
    ours = DDP(model, bucket_cap_mb=0.1)
    state = ddp.State(scheme="allgather", probe="off", sparsifier=TopK(0.01),
                      named_parameters=model.named_parameters())
    ours.register_comm_hook(state, ddp.hook)
    try:
        ids = torch.randint(0, 5000, (32, 4), generator=torch.Generator().manual_seed(1)).to(DEV)
        Recording.calls.clear()
        ours.zero_grad()
        x, y = batch(0)
        nn.functional.mse_loss(ours(x, ids), y).backward()
        table = [n for n, v in metrics().items()
                 if n.startswith("ddp.bucket") and v["scheme"] == "rows"]
        assert len(table) == 1, metrics()
        assert {r for n, r in routes().items() if n not in table} == {"hook streams"}
        assert metrics()[table[0]]["route"] == ("model group" if DEVICE else "hook streams")
        if RECORDED:  # the model's group: the table's rows (on a device) alone
            gathers = [c for c in Recording.calls if c.op in ("allreduce", "allgather")]
            assert [c.op for c in gathers] == (["allgather"] * 2 if DEVICE else []), gathers
        if DEVICE:  # sparsified buckets staged, by their non-zero blocks (TopK 1%)
            sparsified = [v for n, v in metrics().items()
                          if n.startswith("ddp.bucket") and v["scheme"] == "allgather"]
            assert sparsified and all(
                str(v.get("staged")).split(":")[0] == DEV.type for v in sparsified), metrics()
            nbytes = sum(p.numel() * 4 for p in model.mlp.parameters())
            assert sum(v["bytes_sent"] for v in sparsified) < 0.5 * nbytes, sparsified
    finally:
        state.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_device_rows_by_the_models_group(dtype: torch.dtype) -> None:
    """A device's sparse table, three steps: its rows allgathered by the model's group (row
    counts, then rows: two calls from the thread running backward) and summed where they are;
    the gradient equals DDP's own (its sparse allreduce) within rounding, alike on every rank
    to the bit. (Its launches pose as a device: HVD_SPARSE_CPU_AS_DEVICE.)"""
    torch.manual_seed(0)
    net = Tabled(dtype)
    ref = DDP(net, bucket_cap_mb=0.1)
    ours = DDP(copy.deepcopy(net), bucket_cap_mb=0.1)
    state = ddp.State(scheme="auto", probe="off")
    ours.register_comm_hook(state, ddp.hook)
    ids = torch.randint(0, 5000, (32, 4), generator=torch.Generator().manual_seed(
        dist.get_rank())).to(DEV)
    try:
        for k in range(3):
            x, y = batch(k)
            ref.zero_grad()
            nn.functional.mse_loss(ref(x, ids), y).backward()
            Recording.calls.clear()
            ours.zero_grad()
            nn.functional.mse_loss(ours(x, ids), y).backward()
            gathers = [c for c in Recording.calls if c.op == "allgather"]
            got, want = ours.module.emb.weight.grad, ref.module.emb.weight.grad
            assert got.is_sparse and got.is_coalesced()
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got.to_dense().float(), want.to_dense().float(),
                                       rtol=tol, atol=tol)
            digests: list = [None] * dist.get_world_size()
            dist.all_gather_object(digests, got.to_dense().float().sum().item())
            assert len(set(digests)) == 1, digests
            if RECORDED:
                assert len(gathers) == 2 and {c.thread for c in gathers} == {"MainThread"}
        table = [v for n, v in metrics().items() if v.get("scheme") == "rows"]
        assert table and {v["route"] for v in table} == {"model group"}, metrics()
    finally:
        state.close()


def test_device_route_is_probed_on_the_models_group(tmp_path_factory) -> None:
    """Under "auto", a device's first dense bucket probes the model's group from the hook (its
    allreduce at two sizes, the bus by a device-host copy, the slowest rank's times agreed on
    the group): the route is alike on every rank, and "auto" predicts a staged bucket's dense
    by it (the route's allreduce of the bucket's bytes)."""
    reset_metrics()
    model = DDP(mlp())  # one bucket: DDP's first holds 1 MB
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    state = ddp.State(scheme="auto", probe="force", cache_dir=str(tmp_path_factory.mktemp("c")))
    model.register_comm_hook(state, ddp.hook)
    try:
        Recording.calls.clear()
        step(model, 0)
        assert state.context is not None
        route = state.context.routes[str(next(model.parameters()).device)]
        assert route.source == "probe" and route.dense[1] > 0 and route.bus_bps > 0, route
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, route)
        assert all(r == route for r in everyone), everyone
        if RECORDED:  # on the model's group, from the thread running backward
            probes = [c for c in Recording.calls if c.op == "allreduce"]
            assert {256, 1 << 20, 3} <= {c.numel[0] for c in probes}, probes
            assert {c.thread for c in probes} == {"MainThread"}, probes
        (m,) = [v for n, v in metrics().items() if n.startswith("ddp.bucket")]
        assert m.get("staged") and "predicted_ms" in m, m
        want = (route.dense[0] + route.dense[1] * nbytes) * 1e3
        assert abs(m["predicted_ms"]["dense"] - want) <= 1e-3, (m, want)
    finally:
        state.close()
