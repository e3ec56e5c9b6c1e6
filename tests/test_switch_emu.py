"""the emulated switch as the testbed's switch (``--switch emu``, 4 worker hosts, 1 aggregator
host): it owns one DPDK port per host and forwards by MAC learning, so MPI and the aggregation
traffic to other hosts cross it as they would a Linux bridge, and it aggregates the datagrams
sent to its own address: scheme "switch" of real Horovod jobs and of a DDP job, and raw
protocol workers. Needs root and DPDK (make build installs libdpdk-dev): both hold in CI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pyroute2 import NetNS
from test_testbed import run_job, running

from hvd_sparse.tools.switch import control
from hvd_sparse.tools.testbed import launch, lifecycle, links, loss, topology

ROOT = Path(__file__).resolve().parents[1]

NAME = f"hve{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def testbed():
    with running(topology.Testbed(NAME, workers=4, aggregators=1, rate="1gbit", mtu=9000,
                                  switch="emu")) as tb:
        yield tb


def test_jobs_cross_and_aggregate_in_the_emulated_switch(testbed: topology.Testbed,
                                                         tmp_path: Path) -> None:
    """MPI, allgather and omnireduce cross the switch; scheme "switch" sums in it within the
    fixed-point bound, bit-identical on every rank, for every dtype and density; tensors in
    flight together take turns; NaN falls back with its reason, oversized blocks go through in
    finer blocks; a probe times the switch in blocks that fit its packets; tensors of any shape,
    dtype and density drawn by hypothesis; every packet takes one pass."""
    with NetNS(testbed.switch_ns) as sw:  # no bridge: the emulator is the only path
        assert not sw.link_lookup(ifname="br0")
    before = launch.counters(testbed, "switch")
    outcome = run_job(testbed, "test_switch_job.py", tmp_path, select="not test_refused")
    assert len(outcome.tests()) == 6, outcome.tests()
    after = launch.counters(testbed, "switch")
    ports = {p["name"]: p for p in after["ports"]}
    assert sorted(ports) == sorted(h.name for h in testbed.hosts)
    for b in before["ports"]:  # every host's traffic went through the switch
        assert ports[b["name"]]["rx"] - b["rx"] > 100, (b, ports[b["name"]])
        assert ports[b["name"]]["tx"] - b["tx"] > 100, (b, ports[b["name"]])
    assert after["macs"] >= len(testbed.hosts) and after["hosts"] == len(testbed.hosts)
    assert all(p["spoofed"] == 0 for p in after["ports"]), after["ports"]
    agg, was = after["aggregation"], before["aggregation"]
    assert agg["results"] - was["results"] > 0, agg
    # sparse rounds with one holder: its copy left with the header alone, its sums its own
    assert agg["own_results"] - was["own_results"] > 0, agg
    # every job installed itself with its workers' addresses, took its packets from them only,
    # with their checksums intact, and gave its groups back at shutdown
    assert agg["unbound"] == agg["bad_checksum"] == agg["foreign"] == 0, agg
    assert agg["jobs"] - was["jobs"] >= 1 and agg["jobs_installed"] == 0, agg
    # oversized blocks were cut by the scheme, not refused by the switch; one pass per packet
    assert agg["unsupported"] == was["unsupported"] and agg["overflow"] == 0, agg
    assert agg["recirculations"] == was["recirculations"], agg
    assert agg["malformed"] == was["malformed"], agg


# Each torch.distributed rank: DDP with our hook on scheme "switch" (a table whose gradient is
# mostly zero blocks, and a linear layer), two backward passes, every averaged gradient against
# the float64 average of the ranks' gradients (a twin model without DDP gives this rank's);
# writes the worst excess over the fixed-point bound, the schemes that ran, a digest.
DDP_RANK = textwrap.dedent("""
    import copy, hashlib, json, os
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from hvd_sparse import ddp, fixedpoint, metrics
    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(8000, 64, mode="sum"), nn.Linear(64, 1))
    local = copy.deepcopy(model)
    ours = DDP(model)
    state = ddp.State(scheme="switch", probe="off")
    ours.register_comm_hook(state, ddp.hook)
    worst, digest = -1.0, hashlib.sha256()
    for step in range(2):
        g = torch.Generator().manual_seed(10 * r + step)
        ids, y = torch.randint(0, 8000, (32, 4), generator=g), torch.randn(32, 1, generator=g)
        for m in (ours, local):
            m.zero_grad()
            nn.functional.mse_loss(m(ids), y).backward()
        # one bucket (DDP's 25 MB cap): its largest value sets the fixed-point step
        top = torch.stack([p.grad.abs().max() for p in local.parameters()]).max().double()
        dist.all_reduce(top, dist.ReduceOp.MAX)
        # the sum's fixed-point error, averaged, then one rounding to float32
        bound = fixedpoint.error_bound(float(top), n) / n
        for p, q in zip(local.parameters(), model.parameters()):
            exact = p.grad.double()
            dist.all_reduce(exact)
            exact /= n
            allowed = bound + 2.0 ** -23 * (exact.abs() + bound) + 1e-30
            worst = max(worst, float(((q.grad.double() - exact).abs() - allowed).max()))
            digest.update(q.grad.numpy().tobytes())
    out = {"worst": worst, "digest": digest.hexdigest(),
           "schemes": sorted({m["scheme"] for m in metrics().values()}),
           "reasons": [m["reason"] for m in metrics().values() if "reason" in m]}
    open(os.path.join(os.environ["OUT"], f"rank{r}.json"), "w").write(json.dumps(out))
    state.close()
    dist.destroy_process_group()
""")


def test_ddp_hook_sums_in_the_switch(testbed: topology.Testbed, tmp_path: Path) -> None:
    """The DDP front end's scheme "switch": torch.distributed ranks on the worker hosts, their
    buckets summed in the emulated switch, each gradient within the fixed-point bound of the
    float64 average and bit-identical on every rank, one pass per packet."""
    script = tmp_path / "rank.py"
    script.write_text(DDP_RANK)
    was = launch.counters(testbed, "switch")["aggregation"]
    proc = launch.run(testbed, ["python", str(script)], capture=True, timeout=180,
                      env={"OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
                           "PYTHONPATH": str(ROOT)}, launcher="torch")
    assert proc.returncode == 0, proc.stdout[-4000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(g["worst"] <= 0 and g["schemes"] == ["switch"] and not g["reasons"]
               for g in got), got
    assert len({g["digest"] for g in got}) == 1, got
    now = launch.counters(testbed, "switch")["aggregation"]
    assert now["results"] > was["results"] and now["jobs"] > was["jobs"], now
    assert now["recirculations"] == was["recirculations"] and now["overflow"] == 0, now


@pytest.mark.extended
def test_scheme_switch_under_loss(testbed: topology.Testbed, tmp_path: Path) -> None:
    """1% of the frames lost on every port of the switch: scheme "switch" still gives sums
    within the fixed-point bound, bit-identical on every rank (the switch answers a
    retransmission to a completed round from its shadow set)."""
    tb = lifecycle.update(topology.Testbed.load(NAME), loss_rate=0.01)
    lost, was = loss.dropped(tb), launch.counters(tb, "switch")["aggregation"]
    try:
        outcome = run_job(tb, "test_switch_job.py", tmp_path, select="test_aggregate")
        lost = loss.dropped(tb) - lost
    finally:
        lifecycle.update(topology.Testbed.load(NAME), loss_rate=0.0)
    assert [t.split("::")[1] for t in outcome.tests()] == ["test_aggregate"]
    now = launch.counters(tb, "switch")["aggregation"]
    assert lost > 0 and now["retransmits"] > was["retransmits"], (lost, now)
    assert now["malformed"] == was["malformed"] and now["overflow"] == 0, now


def test_a_refused_job_falls_back(testbed: topology.Testbed, tmp_path: Path) -> None:
    """The switch's pool is full, so it refuses a Horovod job's REGISTER: the job's switch
    tensors go to the aggregator host, with the reason, and sum right."""
    c = control.Client(testbed.switch_control)
    free = c.limits()["groups"] - sum(j["groups"] for j in c.jobs())
    c.install(0x7E57, 2, free)
    try:
        outcome = run_job(testbed, "test_switch_job.py", tmp_path, select="test_refused")
        refused = launch.counters(testbed, "switch")["aggregation"]["refused"]
    finally:
        assert c.remove(0x7E57)
    assert [t.split("::")[1] for t in outcome.tests()] == ["test_refused"]
    assert refused > 0


def test_two_jobs_share_the_switch(testbed: topology.Testbed, tmp_path: Path) -> None:
    """Two raw jobs of two workers each, at once, installed with their workers' addresses:
    each gets its own groups and its exact sum."""
    hosts = testbed.hosts[:4]
    c = control.Client(testbed.switch_control)
    for t in (0x7001, 0x7002):
        c.install(t, 2, 64, [h.ip for h in hosts[2 * (t - 0x7001):][:2]])
    procs = [subprocess.Popen(["ip", "netns", "exec", h.ns, sys.executable,
                               str(ROOT / "tests" / "switch_raw.py"), str(i % 2), "2",
                               testbed.switch_address, str(tmp_path / f"raw{i}.json"),
                               str(0x7001 + i // 2)],
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
             for i, h in enumerate(hosts)]
    assert [p.wait(timeout=60) for p in procs] == [0] * 4
    reports = [json.loads((tmp_path / f"raw{i}.json").read_text()) for i in range(4)]
    assert all(r["done"] and r["exact"] for r in reports), reports
    jobs = [c.jobs(t) for t in (0x7001, 0x7002)]
    assert [len(j) for j in jobs] == [1, 1], jobs
    assert all("token" not in j for j in c.jobs()), c.jobs()  # tokens are never printed
    a, b = sorted((j for (j,) in jobs), key=lambda j: j["first"])
    assert a["first"] + a["groups"] <= b["first"]  # disjoint slot ranges
    assert c.remove(0x7001) and c.remove(0x7002)


@pytest.mark.parametrize("lossy", [0.0, 0.02])
def test_the_switch_aggregates_in_the_network(testbed: topology.Testbed, tmp_path: Path,
                                              lossy: float) -> None:
    """Raw workers in the worker namespaces stream FIXED32 blocks to the switch's own address:
    each gets numpy's exact int64 sum back, through real frames (ARP for the switch's address,
    results out of each worker's port), also with 2% of the UDP frames lost on every port; the
    job is installed by the control plane with its workers' addresses and, without loss, all
    its groups are released."""
    n = testbed.workers
    c = control.Client(testbed.switch_control)
    for j in c.jobs():  # the module's earlier jobs: a lossy one may hold groups (a RELEASE or
        c.drop(j["first"])  # BYE lost) until it expires, and "occupied" counts every job's
    c.install(0x5A17, n, 256, [h.ip for h in testbed.hosts[:n]])
    tb = lifecycle.update(topology.Testbed.load(NAME), loss_rate=lossy)
    lost = loss.dropped(tb)
    was = launch.counters(tb, "switch")["aggregation"]
    try:
        procs = [subprocess.Popen(["ip", "netns", "exec", h.ns, sys.executable,
                                   str(ROOT / "tests" / "switch_raw.py"), str(r), str(n),
                                   tb.switch_address, str(tmp_path / f"raw{r}.json")],
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
                 for r, h in enumerate(tb.hosts[:n])]
        assert [p.wait(timeout=60) for p in procs] == [0] * n
        lost = loss.dropped(tb) - lost
    finally:
        lifecycle.update(topology.Testbed.load(NAME), loss_rate=0.0)
    reports = [json.loads((tmp_path / f"raw{r}.json").read_text()) for r in range(n)]
    assert all(r["done"] and r["exact"] for r in reports), reports
    assert (lost > 0) == (lossy > 0), lost
    now = launch.counters(tb, "switch")["aggregation"]
    agg = {k: now[k] - was[k] for k in was if k != "occupied"} | {"occupied": now["occupied"]}
    assert agg["no_route"] == 0 and agg["malformed"] == 0, agg
    # one lane of 64 values per DATA: one pass each, no recirculation (a real pipe keeps line
    # rate); one DATA at least per worker, slot and round
    assert agg["recirculations"] == 0 and agg["passes"] == agg["packets"], agg
    assert agg["packets"] >= n * agg["results"], agg
    job = c.jobs(0x5A17)
    assert [(j["workers"], j["registered"], j["automatic"]) for j in job] == [(n, n, False)]
    if not lossy:
        assert agg["occupied"] == 0 and agg["released"] >= reports[0]["nslots"], (agg, c.jobs())
    assert c.remove(0x5A17)  # the next run's job is new


def test_the_control_plane_installs_disjoint_jobs(testbed: topology.Testbed) -> None:
    """Over the control socket: two installed jobs get disjoint ranges, one beyond the limits
    is refused with the reason, removal frees the range."""
    c = control.Client(testbed.switch_control)
    lim = c.limits()
    assert (lim["cells"], lim["values_per_pass"], lim["max_workers"]) == (8192, 64, 32)
    taken = sum(j["groups"] for j in c.jobs())
    a, b = c.install(101, 4, 10), c.install(102, 32, 10)
    assert abs(a - b) >= 10
    with pytest.raises(control.ControlError, match="at most 32"):
        c.install(103, 33, 1)
    with pytest.raises(control.ControlError, match="pool exhausted"):
        c.install(104, 2, lim["groups"] - taken - 19)
    assert c.remove(101) and c.remove(102) and not c.remove(101)
    assert c.jobs(101) == c.jobs(102) == []


@pytest.mark.integration
def test_control_path_that_is_no_socket_is_left_alone(tmp_path: Path) -> None:
    """--control naming a file that is not a socket: the switch refuses to start (before
    DPDK) and leaves the file as it was."""
    keep = tmp_path / "precious"
    keep.write_text("keep me")
    from hvd_sparse.tools.switch import binary
    p = subprocess.run([str(binary()), "--dpdk", "--no-pci", "--control", str(keep)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "exists and is not a socket" in p.stderr + p.stdout, p
    assert keep.read_text() == "keep me"


NOBODY = """
import os, socket, sys, tempfile
d = tempfile.mkdtemp()
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(os.path.join(d, "c"))
s.settimeout(5)
try:
    s.sendto(b"jobs", sys.argv[1])
    print(s.recv(4096).decode())
except OSError as e:
    print("refused:", e)
"""


def test_control_socket_is_the_owners_alone(testbed: topology.Testbed) -> None:
    """The control socket is mode 0600 and a user other than root or the switch's own gets
    nothing from it (no job list, no install)."""
    path = testbed.switch_control
    assert os.stat(path).st_mode & 0o777 == 0o600, oct(os.stat(path).st_mode)
    p = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                        "/usr/bin/python3", "-c", NOBODY, str(path)],
                       capture_output=True, text=True, timeout=30)
    out = p.stdout + p.stderr
    assert "refused:" in out or "permission denied" in out, out
    assert '"jobs"' not in out, out


# A host that knows a job's token (an insider) forges what it can at the switch from its own
# port, from its own MAC unless told: argv: switch ip, victim ip, victim mac, token, seconds.
FORGER = """
import sys, time
from scapy.all import Ether, IP, UDP, Raw, get_if_hwaddr, get_if_addr, sendp
from hvd_sparse import protocol
from hvd_sparse.tools import wire
sw_ip, victim_ip, victim_mac, token, seconds = sys.argv[1:6]
T, PORT, SWMAC = protocol.TYPES, protocol.AGGREGATOR_PORT, "02:68:73:77:00:01"
mine, my_ip = get_if_hwaddr("eth0"), get_if_addr("eth0")
reg = wire.header(type=T["REGISTER"], token=int(token), worker=0, nworkers=2)
def frame(src_mac, src_ip, payload, dst_mac=SWMAC, dst_ip=sw_ip, sport=40000, dport=PORT,
          **udp):
    return (Ether(src=src_mac, dst=dst_mac) / IP(src=src_ip, dst=dst_ip)
            / UDP(sport=sport, dport=dport, **udp) / Raw(payload))
kinds = [
    frame(mine, victim_ip, reg),                        # the victim's address: spoofed
    frame(victim_mac, victim_ip, reg),                  # its MAC too: spoofed (wrong port)
    frame(SWMAC, my_ip, reg),                           # the switch's MAC: spoofed
    frame(mine, sw_ip, wire.header(type=T["ERROR"], token=int(token), worker=0, nworkers=2),
          dst_mac=victim_mac, dst_ip=victim_ip, sport=PORT, dport=40000),  # the switch's IP
    frame(mine, my_ip, reg),                            # worker 0 from this host: foreign
    frame(mine, my_ip, reg, chksum=0x1234),             # a bad UDP checksum
]
end, sent = time.monotonic() + float(seconds), 0
while time.monotonic() < end:
    sendp(kinds[sent % len(kinds)], iface="eth0", verbose=False)
    sent += 1
    time.sleep(0.01)
print(sent)
"""


def test_hostile_host_at_the_switch(testbed: topology.Testbed, tmp_path: Path) -> None:
    """While a raw 2-worker job runs (installed with its workers' addresses), a third host
    holding the job's token forges at the switch: the victim's IP, its MAC, the switch's own
    MAC and IP (an ERROR to the victim), REGISTER as the victim's worker from its own address,
    a broken UDP checksum. The switch drops each where the issue says (source guard, worker
    binding, checksum), counts it, and the job's sums stay exact."""
    token, (w0, w1, bad) = 0x5B17, testbed.hosts[:3]
    c = control.Client(testbed.switch_control)
    c.install(token, 2, 64, [w0.ip, w1.ip])
    was = launch.counters(testbed, "switch")
    try:
        forger = subprocess.Popen(
            ["ip", "netns", "exec", bad.ns, sys.executable, "-c", FORGER,
             testbed.switch_address.split(":")[0], w0.ip, links.mac(w0.ns), str(token), "4"],
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
        procs = [subprocess.Popen(["ip", "netns", "exec", h.ns, sys.executable,
                                   str(ROOT / "tests" / "switch_raw.py"), str(r), "2",
                                   testbed.switch_address, str(tmp_path / f"raw{r}.json"),
                                   str(token)],
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
                 for r, h in enumerate((w0, w1))]
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
        sent = int(forger.communicate(timeout=60)[0])
    finally:
        c.remove(token)
    reports = [json.loads((tmp_path / f"raw{r}.json").read_text()) for r in range(2)]
    assert all(r["done"] and r["exact"] for r in reports), reports
    now = launch.counters(testbed, "switch")
    spoofed = {p["name"]: p["spoofed"] for p in now["ports"]}
    spoofed_was = {p["name"]: p["spoofed"] for p in was["ports"]}
    agg = {k: now["aggregation"][k] - was["aggregation"][k] for k in was["aggregation"]}
    kinds = 6
    assert sent >= 2 * kinds, sent
    # four of the six kinds claim an address that is not the forger's: dropped at its port
    assert spoofed[bad.name] - spoofed_was[bad.name] >= 4 * (sent // kinds), (spoofed, sent)
    assert all(spoofed[h] == spoofed_was[h] for h in spoofed if h != bad.name), spoofed
    assert agg["foreign"] >= sent // kinds and agg["bad_checksum"] >= sent // kinds, agg
