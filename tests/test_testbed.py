"""The netns testbed: 4 worker hosts and 1 aggregator host at 1 Gbit/s, every scheme against
Horovod, loss, a cut link, the same over IPv6 aggregators (`testbed up --ipv6`), a
torch.distributed job (the DDP front end) on 2 hosts, and nothing left behind. Needs root (CI
runs as root)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hvd_sparse.tools.testbed import cpu, lifecycle, links, names, topology
from hvd_sparse.tools.testbed import launch as testbed_launch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "parallel"))
from driver import Launch, Outcome, run  # noqa: E402

NAME = f"hvt{os.getpid() % 100000}"  # unique: never touches another run's namespaces


def leftovers(name: str) -> list[str]:
    """Namespaces, veths, CPU budgets (cgroups), hosts files and processes of testbed `name`
    that still exist."""
    out = links.namespaces(name) + [str(g) for g in cpu.groups(name)]
    out += [str(d) for d in names.ROOT.glob(f"{name}-*")]
    ip = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    out += [line.split(":")[1].strip() for line in ip.splitlines()
            if line.split(":")[1].strip().split("@")[0].startswith(name)]
    return out


@contextlib.contextmanager
def running(tb: topology.Testbed) -> Iterator[topology.Testbed]:
    """The testbed up for the block, and down after it, leaving nothing behind."""
    up = lifecycle.up(tb)
    try:
        yield up
    finally:
        lifecycle.down(tb.name)
        assert leftovers(tb.name) == []
        assert not topology.Testbed.state_path(tb.name).exists()
        assert not tb.log_dir().exists()


def run_job(tb: topology.Testbed, module: str, out: Path, timeout: float = 300,
            select: str | None = None, env: dict[str, str] | None = None) -> Outcome:
    """Runs tests/parallel/``module`` (its tests chosen by ``select``, pytest's -k; ``env``:
    more of the ranks' environment) as one rank per worker host, under `hvd-sparse testbed
    run`'s launcher; fails with the failing (rank, test) pairs unless every rank passed every
    test."""
    launch = Launch("mpirun", np=tb.workers, timeout=timeout,
                    args=("-k", select) if select else (), env=env or {})
    outcome = run(ROOT / "tests" / "parallel" / module, launch, out, runner=lambda argv, env, t:
                  testbed_launch.run(tb, argv, env=env, timeout=t, capture=True))
    outcome.check()
    return outcome


@pytest.fixture(scope="module", params=["ipv4", "ipv6"])
def testbed(request):
    """The testbed; with ipv6 its hosts have fd77::N addresses too, and its aggregator binds
    and is reached at its IPv6 one only (MPI stays on IPv4)."""
    with running(topology.Testbed(NAME, workers=4, aggregators=1, rate="1gbit", mtu=9000,
                                  loss_proto="udp", ipv6=request.param == "ipv6")) as tb:
        yield tb


# Over IPv6, the tests whose addresses are IPv6: every scheme through the aggregator, the
# error naming it as [fd77::101]:9999, rank 0's own aggregator at its IPv6 address (loss and
# link flaps act on frames whatever they carry: the IPv4 run has them)
V6_TESTS = "every_scheme or link_cut_is or rank0_local"


def test_job_on_testbed(testbed: topology.Testbed, tmp_path: Path) -> None:
    # The aggregator: out of the caller's process group (Ctrl-C spares it) but in its session,
    # whose scheduling group the ranks share (in a session of its own, 16 ranks' load once
    # starved it for up to 80 s: launch.py).
    agg = testbed.pids[testbed.aggregator_hosts[0].name]
    assert os.getpgid(agg) == agg != os.getpgid(0)
    assert os.getsid(agg) == os.getsid(0)
    before = links.counters(testbed)
    t0 = time.monotonic()
    if testbed.ipv6:
        agg_host = testbed.aggregator_hosts[0]
        assert testbed.aggregator_addresses() == f"[{agg_host.ip6}]:9999"
        # rank 0's own aggregator (rank0 layout) advertised at w0's IPv6 address
        outcome = run_job(testbed, "test_testbed_job.py", tmp_path, timeout=240,
                          select=V6_TESTS,
                          env={"HVD_SPARSE_AGGREGATOR_HOST": testbed.worker_hosts[0].ip6})
        assert len(outcome.tests()) == 3, outcome.tests()
    else:
        outcome = run_job(testbed, "test_testbed_job.py", tmp_path, timeout=240)
        assert len(outcome.tests()) == 7, outcome.tests()
    took = time.monotonic() - t0
    # The traffic went over the testbed's links: every worker and the aggregator host moved
    # megabytes (the tensors are 8 MiB each).
    after = links.counters(testbed)
    for h in testbed.hosts:
        assert after[h.name]["rx_bytes"] - before[h.name]["rx_bytes"] > 2e6, h.name
    print(f"testbed job: {took:.0f} s")


# Each torch.distributed rank: an all_reduce checked against its closed form, then 2 SGD steps
# of DDP with our hook (allgather) against the same model reduced by hand (all_reduce of the
# gradients, averaged); it writes what it saw to $OUT/rank<r>.json.
DDP_RANK = textwrap.dedent("""
    import copy, json, os, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from hvd_sparse import ddp, metrics
    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(1000, dtype=torch.float32) * (r + 1)
    dist.all_reduce(x)
    assert torch.equal(x, torch.arange(1000, dtype=torch.float32) * n * (n + 1) / 2)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.EmbeddingBag(2000, 16, mode="sum"), nn.Linear(16, 1))
    ours = DDP(copy.deepcopy(ref))
    ours.register_comm_hook(ddp.State(scheme="allgather", probe="off", local_aggregators=0),
                            ddp.hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(2):
        g = torch.Generator().manual_seed(10 * r + step)
        ids, y = torch.randint(0, 2000, (32, 4), generator=g), torch.randn(32, 1, generator=g)
        for m, o in zip((ref, ours), opts):
            o.zero_grad()
            nn.functional.mse_loss(m(ids), y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= n
        for o in opts:
            o.step()
    diff = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(), ours.parameters()))
    out = {"rank": r, "size": n, "diff": diff, "schemes": sorted({m["scheme"] for m in
           metrics().values()}), "master": os.environ["MASTER_ADDR"]}
    open(os.path.join(os.environ["OUT"], f"rank{r}.json"), "w").write(json.dumps(out))
    dist.destroy_process_group()
""")


def test_torch_job_on_testbed(tmp_path: Path) -> None:
    """`run(launcher="torch")`: one torch.distributed rank per host over the links, our DDP
    hook matching an allreduce of the gradients; a failing rank ends the job at once with its
    exit code."""
    script = tmp_path / "rank.py"
    script.write_text(DDP_RANK)
    with running(topology.Testbed(f"hvq{os.getpid() % 100000}", workers=2, aggregators=0,
                                  rate="1gbit")) as tb:
        before = links.counters(tb)
        proc = testbed_launch.run(tb, ["python", str(script)], capture=True,
                                  env={"OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
                                       "PYTHONPATH": str(ROOT)},
                                  timeout=60, launcher="torch")
        assert proc.returncode == 0, proc.stdout[-4000:]
        got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        for g in got:
            assert g["size"] == 2 and g["master"] == tb.worker_hosts[0].ip, g
            assert g["diff"] < 1e-6 and g["schemes"] == ["allgather"], g
        after = links.counters(tb)
        assert after["w1"]["rx_bytes"] - before["w1"]["rx_bytes"] > 50_000  # over the link
        t0 = time.monotonic()
        fail = testbed_launch.run(
            tb, ["python", "-c", "import os, sys, time\n"
                 "sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(60)"],
            capture=True, timeout=30, launcher="torch")
        assert fail.returncode == 3 and time.monotonic() - t0 < 15, fail.stdout


ELASTIC_RANK = textwrap.dedent("""
    import json, os, socket
    import horovod.torch as hvd, torch
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    names = hvd.allgather_object(socket.gethostname())  # a process set's Gloo context
    out = {"rank": hvd.rank(), "size": hvd.size(), "total": float(total), "names": names,
           "host": os.environ["HOROVOD_HOSTNAME"], "netns": os.readlink("/proc/self/ns/net"),
           "elastic": os.environ.get("HOROVOD_ELASTIC")}
    open(os.path.join(os.environ["OUT"], f"rank{hvd.rank()}.json"), "w").write(json.dumps(out))
""")


def test_horovod_elastic_job_on_testbed(tmp_path: Path) -> None:
    """`run(launcher="horovodrun")`: a Horovod elastic job, horovodrun in w0's namespace and
    the other hosts' workers started through the ssh shim in theirs; Gloo over the links
    (each host's address as its hostname); nothing left running after it."""
    script = tmp_path / "rank.py"
    script.write_text(ELASTIC_RANK)
    with running(topology.Testbed(f"hve{os.getpid() % 100000}", workers=3, aggregators=0,
                                  rate="1gbit")) as tb:
        before = links.counters(tb)
        proc = testbed_launch.run(tb, ["python", str(script)], capture=True,
                                  env={"OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
                                       "PYTHONPATH": str(ROOT)},
                                  timeout=120, launcher="horovodrun")
        assert proc.returncode == 0, proc.stdout[-4000:]
        got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
        ips = sorted(h.ip for h in tb.worker_hosts)
        assert sorted(g["host"] for g in got) == ips, got
        assert len({g["netns"] for g in got}) == 3, got  # one per host's namespace
        for g in got:
            assert g["size"] == 3 and g["total"] == 6.0 and g["elastic"] == "1", g
            assert sorted(g["names"]) == ips, g
        after = links.counters(tb)
        assert all(after[h]["rx_bytes"] - before[h]["rx_bytes"] > 1000 for h in ("w1", "w2"))
        assert all(links.pids_in(h.ns) == [] for h in tb.worker_hosts)
        # the discovery file: a host taken off and listed again
        testbed_launch.list_hosts(tb, ["w0", "w2"])
        assert testbed_launch.listed_hosts(tb) == ["w0", "w2"]
        testbed_launch.list_hosts(tb)
        assert testbed_launch.listed_hosts(tb) == ["w0", "w1", "w2"]


def test_cli_up_status_down(tmp_path: Path) -> None:
    name = f"hvc{os.getpid() % 100000}"
    cli = [sys.executable, "-m", "hvd_sparse.tools.cli", "testbed"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        # up from a session of its own (another terminal, say): its aggregator stays there
        up = subprocess.run([*cli, "up", "--name", name, "--workers", "2", "--aggregators", "1",
                             "--rate", "100mbit"], capture_output=True, text=True, env=env,
                            timeout=120, start_new_session=True)
        assert up.returncode == 0, up.stderr
        # ... and `run` from this one says that the aggregator may starve (launch.py)
        run = subprocess.run([*cli, "run", "--name", name, "--", "true"], capture_output=True,
                             text=True, env=env, timeout=120)
        assert run.returncode == 0, run.stderr
        autogroups = Path("/proc/sys/kernel/sched_autogroup_enabled")
        warned = "a0 run in another session" in run.stderr
        assert warned == (autogroups.exists() and autogroups.read_text().strip() == "1"), \
            run.stderr
        again = subprocess.run([*cli, "up", "--name", name], capture_output=True, text=True,
                               env=env, timeout=60)
        assert again.returncode == 1 and "already up" in again.stderr
        st = subprocess.run([*cli, "status", "--name", name, "--json"], capture_output=True,
                            text=True, env=env, timeout=60)
        d = json.loads(st.stdout)
        assert [h["host"] for h in d["hosts"]] == ["w0", "w1", "a0"]
        assert d["rate"] == "100mbit" and d["aggregators"] == "10.77.0.101:9999"
        assert [h["processes"] for h in d["hosts"]] == [0, 0, 1]  # the aggregator runs
        # tc shows the cap on both ends of a link
        for ns, dev in ((f"{name}-w0", "eth0"), (f"{name}-sw", "w0")):
            tc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                                capture_output=True, text=True).stdout
            assert "tbf" in tc and "100Mbit" in tc, tc
        # set: one host's rate and loss, and its link cut, seen by tc, nft and status
        for extra in (["--rate", "50mbit", "--loss", "0.25"], ["--down"]):
            st = subprocess.run([*cli, "set", "--name", name, "--host", "w1", *extra],
                                capture_output=True, text=True, env=env, timeout=60)
            assert st.returncode == 0, st.stderr
        tc = subprocess.run(["ip", "netns", "exec", f"{name}-sw", "tc", "qdisc", "show", "dev",
                             "w1"], capture_output=True, text=True).stdout
        assert "50Mbit" in tc, tc
        nft = subprocess.run(["ip", "netns", "exec", f"{name}-sw", "nft", "list", "ruleset"],
                             capture_output=True, text=True).stdout
        assert 'iifname "w1"' in nft and "< 250000" in nft, nft
        d = json.loads(subprocess.run([*cli, "status", "--name", name, "--json"],
                                      capture_output=True, text=True, env=env).stdout)
        w1 = d["hosts"][1]
        assert (w1["rate"], w1["loss"], w1["link"]) == ("50mbit", 0.25, "down"), w1
        # move: the aggregator host at another address, its name with it in every host
        def resolve(host: str) -> str:
            return subprocess.run(["ip", "netns", "exec", f"{name}-w0", "getent", "hosts",
                                   f"{host}.{name}"], capture_output=True, text=True).stdout
        assert resolve("a0").split() == ["10.77.0.101", f"a0.{name}"]
        mv = subprocess.run([*cli, "move", "--name", name, "--host", "a0", "--ip",
                             "10.77.0.150"], capture_output=True, text=True, env=env, timeout=60)
        assert mv.returncode == 0, mv.stderr
        assert resolve("a0").split() == ["10.77.0.150", f"a0.{name}"]
        assert resolve("w1").split() == ["10.77.0.2", f"w1.{name}"]
        d = json.loads(subprocess.run([*cli, "status", "--name", name, "--json"],
                                      capture_output=True, text=True, env=env).stdout)
        assert d["aggregators"] == "10.77.0.150:9999" and d["hosts"][2]["processes"] == 1, d
        for bad in (["--host", "w0", "--ip", "10.77.0.151"], ["--host", "a0", "--ip",
                    "10.77.0.2"], ["--host", "a0", "--ip", "10.78.0.1"]):
            mv = subprocess.run([*cli, "move", "--name", name, *bad], capture_output=True,
                                text=True, env=env, timeout=60)
            assert mv.returncode == 1 and "move:" in mv.stderr, (bad, mv.stderr)
        # A crash that lost the state file, and a stray process in a host: down still
        # removes everything of this testbed.
        stray = subprocess.Popen(["ip", "netns", "exec", f"{name}-w1", "sleep", "300"])
        topology.Testbed.state_path(name).unlink()
        down = subprocess.run([*cli, "down", "--name", name], capture_output=True, text=True,
                              env=env, timeout=60)
        assert down.returncode == 0, down.stderr
        assert stray.wait(timeout=10) is not None
        assert leftovers(name) == []
    finally:
        lifecycle.down(name)


def test_needs_root() -> None:
    nobody = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         "from hvd_sparse.tools.testbed import lifecycle, topology\n"
         "lifecycle.up(topology.Testbed('hvtroot'))"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert nobody.returncode != 0 and "needs root" in nobody.stderr, nobody.stderr[-2000:]
    assert leftovers("hvtroot") == []
