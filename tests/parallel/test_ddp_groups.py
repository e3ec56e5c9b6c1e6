"""The DDP hook over a process group that is not the world (``State(process_group=pg)``), under
torchrun at 4 ranks: two 2-rank DDP jobs side by side, each equal to DDP's own allreduce over
its group, bit-identical inside it and apart from the other (different data: no cross-talk);
and a 2-rank job while the other two ranks run unrelated collectives of their own. Both jobs
bind their aggregation sockets in one shared port range."""
from __future__ import annotations

import copy
import hashlib
import threading

import pytest
import torch
import torch.distributed as dist
from driver import Launch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from hvd_sparse import HvdSparseError, ddp, metrics, reset_metrics

# both jobs kept to one UDP port range (HVD_SPARSE_PORTS): their own aggregators and worker
# sockets share it without sharing a port
LAUNCHES = [Launch("torchrun", np=4, timeout=420, env={"HVD_SPARSE_PORTS": "29650-29661"})]
SCHEMES = ["dense", "allgather", "zen", "omnireduce", "auto"]
ROWS, DIM = 2000, 16
_groups: dict[str, object] = {}


@pytest.fixture(scope="module", autouse=True)
def world():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # every rank makes both groups (new_group's rule for groups made without local sync)
    _groups["a"], _groups["b"] = dist.new_group([0, 1]), dist.new_group([2, 3])
    yield
    dist.destroy_process_group()


def mine() -> tuple[str, dist.ProcessGroup]:
    job = "a" if dist.get_rank() < 2 else "b"
    return job, _groups[job]


class Net(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=sparse)
        self.mlp = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    return (torch.rand(32, 4, generator=g) ** 3 * ROWS).long(), torch.randn(32, 1, generator=g)


def grads(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).clone()
            for n, p in m.named_parameters()}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha1()
    for n in sorted(tensors):
        h.update(tensors[n].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_job(scheme: str, sparse: bool, pg: dist.ProcessGroup, steps: int = 3) -> list[str]:
    """DDP over ``pg`` with its own allreduce and with the hook, same model and data: their
    gradients agree each step; returns this rank's digest of the hook's gradients per step."""
    torch.manual_seed(0)
    model = Net(sparse)
    ref = DDP(model, process_group=pg, bucket_cap_mb=0.05)
    ours = DDP(copy.deepcopy(model), process_group=pg, bucket_cap_mb=0.05)
    state = ddp.State(pg, scheme=scheme, probe="off")
    ours.register_comm_hook(state, ddp.hook)
    lo, hi = state.config.port_range()
    used = [state.omni.worker.local_port(), *(state.omni.local.ports if state.omni.local else [])]
    assert lo and all(lo <= p <= hi for p in used), (lo, hi, used)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, ours)]
    out = []
    try:
        for step in range(steps):
            ids, y = batch(step)
            for m, o in zip((ref, ours), opts, strict=True):
                o.zero_grad()
                nn.functional.mse_loss(m(ids), y).backward()
            a, b = grads(ref), grads(ours)
            for n in a:
                torch.testing.assert_close(b[n], a[n], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=n: f"{scheme} {n}: {m}")
            out.append(digest(b))
            for o in opts:
                o.step()
    finally:
        state.close()
    return out


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_two_jobs_side_by_side(scheme: str, sparse: bool) -> None:
    job, pg = mine()
    reset_metrics()
    steps = run_job(scheme, sparse, pg)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (job, steps))
    for j in ("a", "b"):
        inside = {tuple(s) for k, s in everyone if k == j}
        assert len(inside) == 1, f"job {j}: its ranks differ: {everyone}"
    (a,), (b,) = ({tuple(s) for k, s in everyone if k == j} for j in ("a", "b"))
    assert all(x != y for x, y in zip(a, b, strict=True)), "the two jobs' gradients agree"
    if scheme == "omnireduce":  # the job's own aggregators served it: by rows or by blocks
        ran = {m["scheme"] for m in metrics().values()}
        assert ran & {"omnireduce", "rows+omnireduce"}, ran


def test_job_beside_unrelated_collectives() -> None:
    """Ranks 0 and 1 train with the hook over their group while ranks 2 and 3 run all_reduces
    of their own, on their group, on two threads at the same time (no DDP there)."""
    job, pg = mine()
    if job == "a":
        run_job("auto", True, pg, steps=2)
    else:
        errors: list[BaseException] = []

        def busy() -> None:
            try:
                for i in range(20):
                    t = torch.full((1000,), float(dist.get_rank() + i))
                    dist.all_reduce(t, group=pg)
                    assert torch.all(t == 5 + 2 * i), t[:3]
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        thread = threading.Thread(target=busy)
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive() and not errors, errors
    dist.barrier()


def test_state_outside_its_group_refused() -> None:
    """A rank that is not in the group cannot make the group's state (no collective starts)."""
    other = _groups["b" if dist.get_rank() < 2 else "a"]
    with pytest.raises(HvdSparseError, match=f"rank {dist.get_rank()} is not in its process"):
        ddp.State(other, scheme="allgather", probe="off")
