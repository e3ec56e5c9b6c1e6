"""Horovod started from mpi4py communicators (Horovod's MPI integration): one 4-rank mpirun
split into two independent 2-rank jobs, as a hyperparameter sweep would; each job starts its
own aggregators and token, and every scheme's sum is its own two ranks' (against a float64 sum
computed with mpi4py over the whole world, so cross-talk between the jobs would show)."""
from __future__ import annotations

import horovod.torch as hvd
import pytest
import torch
from driver import Launch

import hvd_sparse

LAUNCHES = [Launch("mpirun", np=4, timeout=300)]
N, BLOCK = 64 * 256, 256


@pytest.fixture(scope="module", autouse=True)
def job():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    color = world.Get_rank() % 2
    sub = world.Split(color, world.Get_rank())
    torch.set_num_threads(1)
    hvd.init(comm=sub)
    hvd_sparse.init(probe="off", small_bytes=1024)
    yield world, color
    hvd_sparse.shutdown()
    hvd.shutdown()
    sub.Free()


def local(world_rank: int, color: int) -> torch.Tensor:
    """This rank's tensor, 10% of its blocks non-zero; job 1's values are 1000x job 0's."""
    g = torch.Generator().manual_seed(world_rank)
    keep = (torch.rand(N // BLOCK, generator=g) < 0.1).repeat_interleave(BLOCK)
    return torch.randn(N, generator=g) * keep * (1000.0 if color else 1.0)


def test_each_job_has_its_own_ranks_and_aggregators(job) -> None:
    world, color = job
    assert (hvd.size(), hvd.rank()) == (2, world.Get_rank() // 2)
    omni = hvd_sparse.basics.state().omni
    assert omni is not None
    addrs = world.allgather((color, tuple(omni.addrs)))
    mine = {a for c, a in addrs if c == color}
    other = {a for c, a in addrs if c != color}
    assert len(mine) == 1 and not mine & other, addrs


@pytest.mark.parametrize("scheme", ["allgather", "zen", "omnireduce", "auto"])
def test_sums_are_the_jobs_own(job, scheme: str) -> None:
    world, color = job
    x = local(world.Get_rank(), color)
    everyone = world.allgather(x.double().numpy())
    ref = sum(torch.from_numpy(v) for r, v in enumerate(everyone) if r % 2 == color)
    out = hvd_sparse.allreduce(x, name=f"sweep.{scheme}", op=hvd.Sum, scheme=scheme)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-3 if color else 1e-6)
    if scheme != "auto":
        assert hvd_sparse.metrics()[f"sweep.{scheme}"]["scheme"] == scheme
