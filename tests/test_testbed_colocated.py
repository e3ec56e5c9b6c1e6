"""The job's own aggregators on several hosts (aggregator_layout "auto" -> colocated): on the
netns testbed with no aggregator host, 3 worker hosts, a shard on each, started by the host's
lowest rank, under both front ends (Horovod under mpirun with 2 ranks per host, and
torch.distributed's DDP state):

* one shard per worker host, every rank holding the same ordered list, authenticated with one
  secret handed to the hosts;
* omnireduce results equal to dense Horovod (or torch.distributed) allreduce in float64;
* every host link carries about the same bytes, where "rank0" (all on rank 0's host, the
  layout before) makes rank 0's host link carry about twice any other's;
* one aggregator_host given to every host: a clear error on every rank;
* no shard process left in any host once hvd_sparse has shut down.
Needs root (CI runs as root)."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from hvd_sparse.tools.testbed import launch as testbed_launch
from hvd_sparse.tools.testbed import topology

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_testbed import running  # noqa: E402

HOSTS, PER_HOST = 3, 2

# What both front ends' ranks share: data, the check against float64, the shards on this host.
COMMON = textwrap.dedent("""
    import json, os, sys
    import torch

    NUMEL = 1 << 20

    def data(seed, rank, dtype):
        # whole 256-blocks non-zero at random (10%), a different pattern per rank
        g = torch.Generator().manual_seed(1000 * seed + rank)
        keep = torch.rand(NUMEL // 256, generator=g) < 0.1
        return (torch.randn(NUMEL // 256, 256, generator=g) * keep[:, None]).view(-1).to(dtype)

    def differs(out, ref):
        tol = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-12, 1e-12)}[out.dtype]
        scale = max(1.0, float(ref.abs().max()))
        if torch.allclose(out.double(), ref, rtol=tol[0], atol=tol[1] * scale):
            return ""
        return f"max abs error {float((out.double() - ref).abs().max()):g}"

    def shards_here():
        # aggregator processes in this rank's network namespace (its "host")
        me, out = os.stat("/proc/self/ns/net").st_ino, []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if (os.stat(f"/proc/{pid}/ns/net").st_ino == me and
                        os.readlink(f"/proc/{pid}/exe").endswith("hvd-sparse-aggregator")):
                    out.append(int(pid))
            except OSError:
                pass
        return sorted(out)

    def link_bytes(before, after):
        return {h: after[h]["rx_bytes"] - before[h]["rx_bytes"]
                + after[h]["tx_bytes"] - before[h]["tx_bytes"] for h in after}
""")

# Horovod: the default session (colocated), then a "rank0" one over the same ranks; rank 0
# reads every host's link counters around each one's reductions.
HOROVOD_RANK = COMMON + textwrap.dedent("""
    import dataclasses
    import horovod.torch as hvd
    import hvd_sparse
    from hvd_sparse import basics, session
    from hvd_sparse.tools.testbed import links
    from hvd_sparse.tools.testbed.topology import Testbed

    hvd.init()
    torch.set_num_threads(1)
    hvd_sparse.init(probe="off", timeout=60)
    st, r = basics.state(), hvd.rank()
    tb = Testbed.load(os.environ["HVD_SPARSE_TESTBED"])

    def barrier(name):
        hvd.allreduce(torch.zeros(1), name=f"barrier.{name}")

    def reduce_all(tag):
        xs = [data(i, r, dt) for i, dt in enumerate((torch.float32, torch.float64,
                                                      torch.float32))]
        refs = [hvd.allreduce(x.double(), name=f"ref.{tag}.{i}", op=hvd.Sum)
                for i, x in enumerate(xs)]
        barrier(f"{tag}.0")
        before = links.counters(tb) if r == 0 else None
        outs = [hvd_sparse.allreduce(x, name=f"{tag}.{i}", scheme="omnireduce", op=hvd.Sum)
                for i, x in enumerate(xs)]
        barrier(f"{tag}.1")
        bad = [f"{tag}.{i}: {w}" for i, (o, ref) in enumerate(zip(outs, refs))
               if (w := differs(o, ref))]
        m = hvd_sparse.metrics()
        bad += [f"{tag}.{i}: went {m[f'{tag}.{i}']['scheme']}" for i in range(len(xs))
                if m[f"{tag}.{i}"]["scheme"] != "omnireduce"]
        return bad, link_bytes(before, links.counters(tb)) if r == 0 else None

    omni = st.omni
    info = {"rank": r, "placement": omni.placement, "addrs": omni.addrs,
            "netns": os.stat("/proc/self/ns/net").st_ino,
            "started": [p.pid for p in omni.local.procs] if omni.local else [],
            "shards_here": shards_here()}
    info["bad"], info["bytes"] = reduce_all("coloc")
    other = session.start(dataclasses.replace(st.config, aggregator_layout="rank0"), st.comm)
    info["rank0_placement"], info["rank0_addrs"] = other.placement, other.addrs
    with basics.joined(omni=other):
        bad, info["rank0_bytes"] = reduce_all("rank0")
    info["bad"] += bad
    other.close()
    # One aggregator_host for every host cannot be right when colocated: a clear error on
    # every rank, and the shards it started stopped (info["left"] below).
    try:
        session.start(dataclasses.replace(st.config, aggregator_host="10.77.0.250"), st.comm)
        info["bad"].append("one aggregator_host for every host was taken")
    except hvd_sparse.HvdSparseError as e:
        if "HVD_SPARSE_AGGREGATOR_HOST per host" not in str(e):
            info["bad"].append(f"unclear error: {e}")
    hvd_sparse.shutdown()
    barrier("shut")  # every host's lowest rank has stopped its shard
    info["left"] = shards_here()
    open(os.path.join(os.environ["OUT"], f"rank{r}.json"), "w").write(json.dumps(info))
    hvd.shutdown()
""")

# torch.distributed: the DDP front end's state joins the same way over its Gloo group.
TORCH_RANK = COMMON + textwrap.dedent("""
    import torch.distributed as dist
    from hvd_sparse import ddp

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    state = ddp.State(scheme="omnireduce", probe="off", timeout=60)
    info = {"rank": r, "placement": state.omni.placement, "addrs": state.omni.addrs,
            "netns": os.stat("/proc/self/ns/net").st_ino,
            "started": [p.pid for p in state.omni.local.procs] if state.omni.local else [],
            "shards_here": shards_here(), "bad": []}
    for i, dt in enumerate((torch.float32, torch.float64)):
        x = data(i, r, dt)
        ref = x.double().clone()  # (a float64 x would be reduced in place)
        dist.all_reduce(ref)
        out = state.reduce(f"t{i}", x.clone())  # the average, as DDP's hook wants it
        if (w := differs(out, ref / n)):
            info["bad"].append(f"t{i}: {w}")
    state.close()
    dist.barrier()
    info["left"] = shards_here()
    open(os.path.join(os.environ["OUT"], f"rank{r}.json"), "w").write(json.dumps(info))
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def testbed():
    with running(topology.Testbed(f"hvl{os.getpid() % 100000}", workers=HOSTS, aggregators=0,
                                  rate="1gbit", mtu=9000)) as tb:
        yield tb


def run_ranks(tb: topology.Testbed, script: str, tmp: Path, launcher: str,
              per_host: int) -> list[dict]:
    path = tmp / "rank.py"
    path.write_text(script)
    env = {"OUT": str(tmp), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = testbed_launch.run(tb, ["python", str(path)], env=env, timeout=240, capture=True,
                              launcher=launcher, per_host=per_host)
    out = (proc.stdout or "") + (proc.stderr or "")
    assert proc.returncode == 0, out[-6000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(HOSTS * per_host)]


def check_layout(got: list[dict], per_host: int) -> None:
    """One shard per host, started by its lowest rank, the same ordered list on every rank,
    gone after the job."""
    addrs = got[0]["addrs"]
    assert all(g["placement"] == "colocated" and g["addrs"] == addrs for g in got), got
    ips = [a[0] for a in addrs]
    # the shards in host order (w0's first), each at its host's address
    assert ips == [f"{topology.SUBNET}.{h + 1}" for h in range(HOSTS)], addrs
    for h in range(HOSTS):
        ranks = got[h * per_host:(h + 1) * per_host]
        assert len({g["netns"] for g in ranks}) == 1
        lowest, rest = ranks[0], ranks[1:]
        assert len(lowest["started"]) == 1 and all(g["started"] == [] for g in rest), ranks
        assert all(g["shards_here"] == lowest["started"] for g in ranks), ranks
    assert [g for g in got if g["bad"] or g["left"]] == []


def test_colocated_under_horovod(testbed: topology.Testbed, tmp_path: Path) -> None:
    got = run_ranks(testbed, HOROVOD_RANK, tmp_path, "mpirun", PER_HOST)
    check_layout(got, PER_HOST)
    assert got[0]["rank0_placement"] == "rank0"
    assert [a[0] for a in got[0]["rank0_addrs"]] == [f"{topology.SUBNET}.1"]
    coloc, rank0 = got[0]["bytes"], got[0]["rank0_bytes"]
    print(f"link bytes (rx + tx) per host: colocated {coloc}, all on rank 0's host {rank0}")
    # colocated: every host link about alike; rank0: w0's carries its peers' traffic both ways
    assert max(coloc.values()) < 1.25 * min(coloc.values()), coloc
    assert rank0["w0"] > 1.6 * max(rank0["w1"], rank0["w2"]), rank0
    # 6 ranks on 3 hosts, c blocks each, union u: all on w0, its link carries 4 (c + u); a
    # colocated host's 8 (c + u) / 3, so 1.5x (measured 1.42-1.45; retransmissions in the
    # colocated half once added 11% to it, leaving 1.28x)
    assert rank0["w0"] > 1.2 * coloc["w0"], (rank0, coloc)


def test_colocated_under_torch_distributed(testbed: topology.Testbed, tmp_path: Path) -> None:
    check_layout(run_ranks(testbed, TORCH_RANK, tmp_path, "torch", 1), 1)
