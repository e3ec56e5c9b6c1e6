"""CPU budgets on the netns testbed (cpu.py, fidelity.py): 8 hosts of 0.25 core, a short real
job in them, and nothing left behind:

* every host has a cgroup with the quota (v1 cpu.cfs_quota_us / cpu.cfs_period_us, or v2
  cpu.max), the aggregators run in their hosts' groups;
* a job's ranks (torch launcher, no torch imported: fast) are born in their hosts' groups, move
  bytes over the links, and a rank that spins gets no more than its quota;
* the Monitor accounts CPU time per host next to link bytes and gives a verdict; status shows
  the budgets;
* down after a crash (state file gone, a process still in a group outside any namespace)
  removes every group, namespace and process.
Needs root (CI runs as root)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hvd_sparse.tools.testbed import cli, cpu, fidelity, lifecycle, topology
from hvd_sparse.tools.testbed import launch as testbed_launch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_testbed import leftovers, running  # noqa: E402

SHARE = 0.25  # 8 hosts of a quarter core: the machine's 2 cores

# Each rank: its cgroups, 2 MiB sent round a ring of the hosts over the links, then 0.5 s of
# spinning to measure the share of a core it gets.
RANK = textwrap.dedent("""
    import json, os, socket, threading, time
    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", 7100))
    ls.listen(1)
    for _ in range(400):
        try:
            c = socket.create_connection((f"10.77.0.{(r + 1) % n + 1}", 7100), timeout=5)
            break
        except OSError:
            time.sleep(0.05)
    data = b"x" * (2 << 20)
    t = threading.Thread(target=c.sendall, args=(data,))
    t.start()
    s, _ = ls.accept()
    got = 0
    while got < len(data) and (b := s.recv(1 << 20)):
        got += len(b)
    t.join()
    w0, c0 = time.monotonic(), time.process_time()
    while time.monotonic() - w0 < 0.5:
        pass
    spin = (time.process_time() - c0) / (time.monotonic() - w0)
    out = {"rank": r, "got": got, "spin": spin, "cgroup": open("/proc/self/cgroup").read()}
    open(os.path.join(os.environ["OUT"], f"rank{r}.json"), "w").write(json.dumps(out))
""")


def quota_of(hier: cpu.Hierarchy, group: Path) -> tuple[int, int]:
    if hier.version == 2:
        q, p = (group / "cpu.max").read_text().split()
        return int(q), int(p)
    return (int((group / "cpu.cfs_quota_us").read_text()),
            int((group / "cpu.cfs_period_us").read_text()))


def test_budgets_smoke(tmp_path: Path) -> None:
    hier = cpu.detect()
    if hier is None:
        pytest.skip("no cgroup cpu controller mounted")
    name = f"hvb{os.getpid() % 100000}"
    t0 = time.monotonic()
    with running(topology.Testbed(name, workers=6, aggregators=2, rate="100mbit",
                                  cpu_per_host=SHARE)) as tb:
        up_s = time.monotonic() - t0
        # a group per host with the quota, in each mount (cpu and cpuacct apart on v1 here)
        for top in hier.top(name):
            assert sorted(d.name for d in top.iterdir() if d.is_dir()) == sorted(
                [h.name for h in tb.hosts] + [cpu.SWITCH])
        for h in tb.hosts:
            assert quota_of(hier, hier.cpu / f"hvd-sparse-{name}" / h.name) == (
                cpu.quota_us(SHARE), cpu.period_us(SHARE)) == (2500, 10_000)
        for a in ("a0", "a1"):
            assert tb.pids[a] in cpu.procs(tb, a), (a, cpu.procs(tb, a))

        script = tmp_path / "rank.py"
        script.write_text(RANK)
        with fidelity.Monitor(tb, interval=0.05) as mon:
            proc = testbed_launch.run(tb, ["python", str(script)], capture=True, timeout=60,
                                      env={"OUT": str(tmp_path)}, launcher="torch")
        assert proc.returncode == 0, proc.stdout[-4000:]
        rep = mon.report
        for r in range(tb.workers):
            got = json.loads((tmp_path / f"rank{r}.json").read_text())
            assert got["got"] == 2 << 20, got
            # born in its host's group, in every mount
            for top in hier.top(name):
                assert f"{top.name}/w{r}\n" in got["cgroup"], got["cgroup"]
            # the quota holds (contention may give it less, never more)
            assert got["spin"] <= SHARE * 1.15 + 0.02, got
            h = rep["hosts"][f"w{r}"]
            assert h["tx_bytes"] >= 2 << 20 and h["rx_bytes"] >= 2 << 20, h
            assert 0.05 < h["cpu_s"] <= h["budget_s"] * 1.1 + 0.05, h
            assert h["periods"] > 0, h
            assert cpu.procs(tb, f"w{r}") == []  # the job is over, nothing of it left
        assert rep["hosts"]["a0"]["cpu_s"] < 0.5 * rep["hosts"]["w0"]["cpu_s"], rep["hosts"]
        assert rep["verdict"] in ("link-bound", "CPU-bound", "mixed", "neither"), rep
        assert rep["busy_intervals"] > 0 and rep["emulated"].startswith("8 hosts of 0.25 core")
        assert "CPU-bound" in fidelity.format_report(rep)
        st = cli.status(tb)
        assert st["cfs_quota_us"] == 2500 and all(
            h["cpu_budget"] == SHARE and h["cpu_s"] >= 0 for h in st["hosts"]), st

        # A crash: the state file is gone and a process joined w0's group outside any
        # namespace; down still finds and removes everything.
        stray = subprocess.Popen([str(cpu.join_script(tb)), "w0", "sleep", "300"])
        deadline = time.monotonic() + 10
        while stray.pid not in cpu.procs(tb, "w0") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stray.pid in cpu.procs(tb, "w0")
        topology.Testbed.state_path(name).unlink()
        lifecycle.down(name)
        assert stray.wait(timeout=10) is not None
        assert leftovers(name) == []
    print(f"budgets smoke: up {up_s:.1f} s, all {time.monotonic() - t0:.1f} s; "
          f"{fidelity.format_report(rep)}")


@pytest.mark.unit
def test_detect(tmp_path: Path) -> None:
    """The controller's hierarchy from mountinfo: v1 apart or together, v2 when it offers cpu."""
    def info(*mounts: str) -> Path:
        p = tmp_path / "mountinfo"
        p.write_text("".join(f"{30 + i} 23 0:{40 + i} / {m}\n" for i, m in enumerate(mounts)))
        return p

    apart = info("/sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu",
                 "/sys/fs/cgroup/cpuacct rw - cgroup cgroup rw,cpuacct")
    assert cpu.detect(str(apart)) == cpu.Hierarchy(1, Path("/sys/fs/cgroup/cpu"),
                                                   Path("/sys/fs/cgroup/cpuacct"))
    both = info("/sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct")
    h = cpu.detect(str(both))
    assert h is not None and h.cpu == h.acct and len(h.top("x")) == 1
    v2 = tmp_path / "unified"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert cpu.detect(str(info(f"{v2} rw - cgroup2 cgroup2 rw",
                               "/sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu",
                               "/sys/fs/cgroup/cpuacct rw - cgroup cgroup rw,cpuacct"))
                      ) == cpu.Hierarchy(2, v2, v2)
    (v2 / "cgroup.controllers").write_text("hugetlb\n")  # a hybrid whose v2 has no cpu
    assert cpu.detect(str(info(f"{v2} rw - cgroup2 cgroup2 rw"))) is None
    # the period: 10 ms, longer only to keep a 1 ms quota
    assert [(cpu.period_us(c), cpu.quota_us(c)) for c in (1.0, 0.25, 1 / 24)] == [
        (10_000, 10_000), (10_000, 2500), (24_000, 1000)]
