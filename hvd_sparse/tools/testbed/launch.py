"""Processes on the testbed: the aggregator on each aggregator host, and a job with one rank per
worker host: Horovod under Open MPI, torch.distributed (torchrun's environment, no launcher),
or a Horovod elastic job under horovodrun (``run_elastic``: ssh into the hosts' namespaces).

mpirun runs in the root namespace and each rank in its host's namespace, where the launcher's
PMIx server (127.0.0.1:PORT in the root namespace) is out of reach: a forwarder listens on
127.0.0.1:PORT inside every worker namespace and pipes each connection to the real server.
Ranks talk to each other only over the testbed links (TCP BTL on eth0, no shared memory), with
Horovod's MPI operations, since its Gloo operations do not start under plain mpirun."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from pyroute2 import netns

from ...aggregator import binary
from ...auth import write_secret_file
from ...config import format_address
from . import cpu, links
from .topology import AGGREGATOR_PORT, Testbed

# Open MPI's dynamic rules for MPI_Allgatherv (collective 1): one rule for communicators of
# 1 rank and more, by bytes gathered in all: from 0, algorithm 0 (Open MPI's fixed choice);
# from 1 MiB, algorithm 3 (ring).
RULES = Path(__file__).with_name("collectives.rules")

# The aggregators and the switch run in a process group of their own, so that neither Ctrl-C
# nor the end of `testbed up` stops them (`down` does), but in the caller's session: with the
# kernel's autogroups (sched_autogroup_enabled) a session of their own is a scheduling group
# of their own, and under 16 ranks' load (2 cores, load ~40) this kernel left such a group's
# woken aggregator runnable and unscheduled for up to 80 s, every time, which the workers saw
# as an aggregator that stopped answering (docs/SCALE.md). In the session that also starts the
# ranks (a shell, a script) it shares their group and gets its turn like any of them.


def elsewhere(tb: Testbed) -> list[str]:
    """The testbed's processes (aggregators, switch) in another session than this one while
    autogroups are on and no CPU budgets apply (a budget's group replaces the autogroup): `up`
    and `run` from two terminals. Under load those may starve (see above)."""
    try:
        on = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        on = False
    if not on or tb.cpu_per_host:
        return []
    mine, out = os.getsid(0), []
    for name, pid in sorted(tb.pids.items()):
        try:
            if os.getsid(pid) != mine:
                out.append(name)
        except OSError:  # gone: `status` says so
            pass
    return out


def start_aggregators(tb: Testbed) -> None:
    """Starts `hvd-sparse aggregator` on every aggregator host; they run until `down`."""
    tb.log_dir().mkdir(parents=True, exist_ok=True)
    # The testbed's secret: its aggregators take only jobs authenticated with it (job_env).
    if tb.auth and tb.aggregator_hosts and not tb.secret_file().exists():
        write_secret_file(tb.secret_file())
    for h in tb.aggregator_hosts:
        start_aggregator(tb, h.name)


def start_aggregator(tb: Testbed, host: str) -> int:
    """Starts the aggregator of aggregator host ``host`` (again, after a crash: same address,
    same secret) and waits until it listens.

    Args:
        tb: the testbed; ``tb.pids[host]`` is set to the new process.
        host: "a0", "a1", ...

    Returns:
        Its process id.

    Raises:
        RuntimeError: it exited or did not listen within 20 s (its log's end in the message).
    """
    h = tb.host(host)
    port_file = tb.log_dir() / f"{h.name}.port"
    port_file.unlink(missing_ok=True)
    workers = tb.workers if tb.aggregator_workers < 0 else tb.aggregator_workers
    cmd = [str(binary()), "--bind", format_address(tb.address(h), AGGREGATOR_PORT), "--workers",
           str(workers), "--port-file", str(port_file)]
    if tb.auth:
        cmd += ["--secret-file", str(tb.secret_file())]
    if tb.transport == "dpdk":
        cmd += ["--transport", "dpdk", "--dpdk", dpdk_args(tb, h.name)]
        # DPDK owns the host's address: without it the kernel answers neither ARP nor,
        # with ICMP port-unreachable, the workers' datagrams.
        links.flush_addresses(h.ns)
    with open(tb.log_dir() / f"{h.name}.log", "a") as log:
        p = subprocess.Popen(
            cpu.wrap(tb, h.name, ["ip", "netns", "exec", h.ns, *cmd]),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            process_group=0)  # the caller's session: see above
    tb.pids[h.name] = p.pid
    deadline = time.monotonic() + 20
    while not port_file.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"testbed: aggregator on {h.name} did not start: "
                               + (tb.log_dir() / f"{h.name}.log").read_text()[-1000:])
        time.sleep(0.01)
    return p.pid


def start_switch(tb: Testbed) -> None:
    """With ``switch="emu"``: the emulated switch in the switch namespace, one af_packet port
    per host, in place of the bridge, aggregating at ``tb.switch_address``; it runs until
    `down`. Every host is bound to its port, MAC and address, as a fabric's controller knows
    them; jobs are installed by their rank 0 with their workers' addresses (the control socket
    is ``HVD_SPARSE_SWITCH_CONTROL`` in the job's environment)."""
    if tb.switch != "emu":
        return
    from hvd_sparse.tools.switch import control

    tb.log_dir().mkdir(parents=True, exist_ok=True)
    ready, log = tb.log_dir() / "switch.ready", tb.log_dir() / "switch.log"
    ready.unlink(missing_ok=True)
    cmd = control.command(control.eal_args([h.port for h in tb.hosts], f"{tb.name}-sw"),
                          [h.name for h in tb.hosts], aggregate=tb.switch_address,
                          control=tb.switch_control, ready_file=ready)
    with open(log, "w") as f:
        # its own group, with no quota: it stands for switch hardware, but its CPU is counted
        p = subprocess.Popen(cpu.wrap(tb, cpu.SWITCH, ["ip", "netns", "exec", tb.switch_ns, *cmd]),
                             stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             process_group=0)  # the caller's session: see above
    tb.pids["switch"] = p.pid
    try:
        control.wait_ready(p, ready, log)
        c = control.Client(tb.switch_control)
        for h in tb.hosts:
            c.bind(h.name, links.mac(h.ns), h.ip)
    except RuntimeError as e:
        raise RuntimeError(f"testbed: {e}") from None


def counters(tb: Testbed, name: str, timeout: float = 10.0) -> dict:
    """The counters of a testbed process (an aggregator host's ``a0``.., or ``switch``) now:
    SIGUSR1, then the newest stats line of its log."""
    log = tb.log_dir() / f"{name}.log"
    n = log.read_text().count(" stats ")
    os.kill(tb.pids[name], signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [x for x in log.read_text().splitlines() if " stats " in x]
        if len(lines) > n:
            return json.loads(lines[-1].split(" stats ", 1)[1])
        time.sleep(0.05)
    raise RuntimeError(f"testbed: no counters from {name}: {log.read_text()[-2000:]}")


def dpdk_args(tb: Testbed, host: str) -> str:
    """EAL arguments for an aggregator host: no hugepages, no PCI, the host's veth through an
    af_packet vdev with frames up to 16 KiB (jumbo MTUs), through the link's qdisc (its rate
    cap) rather than around it, and a file prefix of its own."""
    return ("--no-huge --no-pci -m 256 --no-shconf --log-level=warning "
            f"--file-prefix={tb.name}-{host} "
            "--vdev=net_af_packet0,iface=eth0,framesz=16384,blocksz=16384,qdisc_bypass=0")


class PmixForwarder:
    """Listens on 127.0.0.1:port in each namespace; pipes connections to 127.0.0.1:port here."""

    def __init__(self, namespaces: Sequence[str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.listeners = []
        for ns in namespaces:
            netns.pushns(ns)  # a socket stays in the namespace it was created in
            try:
                ls = socket.socket()
                ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                ls.bind(("127.0.0.1", self.port))
                ls.listen(64)
            finally:
                netns.popns()
            self.listeners.append(ls)
            threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                c, _ = ls.accept()
                u = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                u.settimeout(None)
            except OSError:
                return
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        for ls in self.listeners:
            ls.close()


def job_env(tb: Testbed, extra: dict[str, str] | None = None, per_host: int = 1
            ) -> dict[str, str]:
    """What every rank gets (``per_host`` of them per worker host): MPI over the testbed
    links, the aggregators, the link rate, its share of the cores."""
    env = {
        "HOROVOD_CPU_OPERATIONS": "mpi",
        "OMPI_MCA_btl": "tcp,self",  # no shared memory: the ranks are on different "hosts"
        "OMPI_MCA_btl_tcp_if_include": "eth0",
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "HVD_SPARSE_LINK_RATE": str(tb.rate_bps),
        "HVD_SPARSE_TESTBED": tb.name,
    }
    # Horovod's allgather is MPI_Allgatherv: Open MPI's default choice reached 0.54-0.57 of a
    # 1 Gbit/s link into each of 4 ranks, its ring algorithm 0.83-0.88 (Gloo's all_gather:
    # 0.86). Every peer-to-peer scheme rides on it. The ring only from 1 MiB gathered in all
    # (RULES): below, its N-1 steps cost 5-20% at 8 ranks. The same for the dense allreduce:
    # Open MPI's choice moved 0.51-0.59 of a 100 Mbit/s link for 26 MB on 4 ranks, the ring
    # 0.92. The caller's own settings win.
    if not any(k.startswith("OMPI_MCA_coll_tuned_") for k in os.environ):
        env.update({"OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
                    "OMPI_MCA_coll_tuned_dynamic_rules_filename": str(RULES)})
    if tb.aggregator_hosts:
        env["HVD_SPARSE_AGGREGATORS"] = tb.aggregator_addresses()
        if tb.auth:
            env["HVD_SPARSE_SECRET_FILE"] = str(tb.secret_file())
        else:
            env["HVD_SPARSE_AUTH"] = "0"
    if tb.cpu_per_host:
        # Threads share their host's quota: more than its cores only queue on it. Waits run
        # 1/c times longer on a host of c cores (the scaled time of cpu.py's hosts).
        # The caller's own settings win.
        scaled = {"HVD_SPARSE_THREADS": str(max(1, int(tb.cpu_per_host))),
                  "HVD_SPARSE_TIMEOUT": f"{30 / min(1.0, tb.cpu_per_host):g}"}
        scaled["OMP_NUM_THREADS"] = scaled["HVD_SPARSE_THREADS"]
        env.update({k: v for k, v in scaled.items() if k not in os.environ})
    elif "HVD_SPARSE_THREADS" not in os.environ:
        # Hosts without budgets share the machine's cores: a rank's share is cores / ranks,
        # not every core (its kernels' threads would spin against the other hosts').
        env["HVD_SPARSE_THREADS"] = str(max(1, (os.cpu_count() or 1) // (tb.workers * per_host)))
    if tb.switch == "emu":
        env["HVD_SPARSE_SWITCH"] = tb.switch_address
        env["HVD_SPARSE_SWITCH_CONTROL"] = str(tb.switch_control)
    env.update(extra or {})
    return env


def _python(cmd: Sequence[str]) -> list[str]:
    cmd = list(cmd)
    if cmd and cmd[0] in ("python", "python3"):  # the venv's, which has torch and Horovod
        cmd[0] = sys.executable
    return cmd


def command(tb: Testbed, cmd: Sequence[str], env: dict[str, str], per_host: int = 1
            ) -> list[str]:
    """The mpirun command line: ``per_host`` ranks per worker host, host by host in rank
    order."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise RuntimeError("testbed: mpirun not found (Open MPI; make build installs it)")
    cmd = _python(cmd)
    out = [mpirun, "--oversubscribe", "--bind-to", "none"]
    for k in env:
        out += ["-x", k]
    for i, h in enumerate(tb.worker_hosts):
        out += [":"] if i else []
        out += ["-np", str(per_host), *cpu.wrap(tb, h.name, ["ip", "netns", "exec", h.ns, *cmd])]
    return out


LAUNCHERS = ("mpirun", "torch", "horovodrun")
TORCH_PORT = 29500  # worker 0's rendezvous port (its namespace is the testbed's own)


def run(tb: Testbed, cmd: Sequence[str], env: dict[str, str] | None = None,
        timeout: float | None = None, capture: bool = False,
        launcher: str = "mpirun", per_host: int = 1) -> subprocess.CompletedProcess:
    """Runs ``cmd`` as ``per_host`` ranks per worker host (ranks 0..per_host-1 on w0, and so
    on) and returns the job's result (its output as text with ``capture``): under mpirun
    (Horovod), with ``launcher="torch"`` as torch.distributed ranks (see `torch_env`), or with
    ``launcher="horovodrun"`` as a Horovod elastic job on every worker host (see
    `run_elastic`, whose own arguments take more). Past
    ``timeout`` the job is stopped and TimeoutExpired raised; no rank outlives the call either
    way."""
    if not cmd:
        raise ValueError("testbed run: no command given (hvd-sparse testbed run -- CMD ...)")
    if launcher not in LAUNCHERS:
        raise ValueError(f"testbed run: launcher must be one of {LAUNCHERS}, got {launcher!r}")
    if per_host < 1:
        raise ValueError(f"testbed run: ranks per host must be >= 1, got {per_host}")
    if apart := elsewhere(tb):
        print(f"testbed {tb.name}: warning: {', '.join(apart)} run in another session than "
              "this command, so in a scheduling group of their own (the kernel's autogroups), "
              "which heavy load can starve for seconds (docs/SCALE.md); start `testbed up` and "
              "`testbed run` from one shell or script", file=sys.stderr)
    if launcher == "torch":
        return _run_torch(tb, cmd, env, timeout, capture, per_host)
    if launcher == "horovodrun":
        return run_elastic(tb, cmd, env, timeout, capture, per_host)
    fwd = PmixForwarder([h.ns for h in tb.worker_hosts])
    job = job_env(tb, env, per_host)
    full = {**os.environ, **job, "PMIX_MCA_ptl_tcp_ipv4_port": str(fwd.port)}
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(command(tb, cmd, job, per_host), env=full, stdout=pipe, stderr=pipe,
                            text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        proc.terminate()  # mpirun passes it on to the ranks
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    finally:
        fwd.close()
        # ranks mpirun lost track of (it was killed, or crashed)
        links.kill_processes([h.ns for h in tb.worker_hosts])


def torch_env(tb: Testbed, rank: int, port: int = TORCH_PORT, per_host: int = 1
              ) -> dict[str, str]:
    """What torchrun would give rank ``rank`` with ``per_host`` processes per node
    (``env://`` rendezvous at worker 0), and Gloo bound to the testbed link rather than
    loopback."""
    node = rank // per_host
    return {"RANK": str(rank), "WORLD_SIZE": str(tb.workers * per_host),
            "LOCAL_RANK": str(rank % per_host), "LOCAL_WORLD_SIZE": str(per_host),
            "GROUP_RANK": str(node), "NODE_RANK": str(node),
            "MASTER_ADDR": tb.worker_hosts[0].ip, "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "eth0"}


def _run_torch(tb: Testbed, cmd: Sequence[str], env: dict[str, str] | None,
               timeout: float | None, capture: bool, per_host: int = 1
               ) -> subprocess.CompletedProcess:
    """``per_host`` processes per worker host, in its namespace. When a rank fails the others are
    stopped (as torchrun does): they would wait for it until Gloo's timeout."""
    argv, job = _python(cmd), job_env(tb, env, per_host)
    procs: list[subprocess.Popen] = []
    logs: list[IO[str]] = []
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        for r in range(tb.workers * per_host):
            h = tb.worker_hosts[r // per_host]
            # Files rather than pipes: nobody has to drain N pipes while the job runs.
            log = tempfile.TemporaryFile("w+") if capture else None
            logs += [log] if log else []
            procs.append(subprocess.Popen(
                cpu.wrap(tb, h.name, ["ip", "netns", "exec", h.ns, *argv]),
                env={**os.environ, **job,
                                                          **torch_env(tb, r,
                                                                      per_host=per_host)},
                stdout=log, stderr=subprocess.STDOUT if log else None,
                stdin=subprocess.DEVNULL, text=True))
        while (codes := [p.poll() for p in procs]).count(None):
            if any(codes):
                time.sleep(2)  # let the others report the failure as they see it
                break
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(argv, timeout or 0, _output(tb, logs))
            time.sleep(0.05)
        rc = next((c for c in (p.poll() for p in procs) if c), 0)
        return subprocess.CompletedProcess(argv, rc, _output(tb, logs) if capture else None,
                                           "" if capture else None)
    finally:
        links.kill_processes([h.ns for h in tb.worker_hosts])
        for p in procs:
            p.wait()
        for log in logs:
            log.close()


def _output(tb: Testbed, logs: list[IO[str]]) -> str:
    parts = []
    for r, log in enumerate(logs):
        log.seek(0)
        host = tb.worker_hosts[r * len(tb.worker_hosts) // len(logs)].name
        parts.append(f"--- rank {r} ({host}) ---\n{log.read()}")
    return "".join(parts)


# ---- Horovod elastic: horovodrun in w0's namespace, ssh to the other hosts' namespaces --------

DISCOVERY = "elastic-hosts"  # in the testbed's log folder: what the discovery script prints

# ssh as horovodrun calls it (horovod/runner/util/remote.py: ``ssh -o OPT ... HOST [-p PORT]
# [-i FILE] [-o OPT] 'cd DIR; env K=V ... CMD'``), for a testbed: the command runs in HOST's
# namespace (and its CPU budget), where ssh would have run it on HOST, under a hostname of its
# own (``HOSTNAME``). exec all the way, so that horovodrun's signals, stdin and the command's
# exit status pass as through ssh.
SSH_SHIM = """#!/bin/sh
# ssh for testbed {name}: runs the command in the namespace of the host given by its address
while [ $# -gt 0 ]; do
  case "$1" in -o|-p|-i|-l|-F) shift 2 ;; -*) shift ;; *) break ;; esac
done
host=$1; shift
while [ $# -gt 0 ]; do
  case "$1" in -o|-p|-i|-l|-F) shift 2 ;; -*) shift ;; *) break ;; esac
done
case "$host" in
{cases}
  *) echo "ssh (testbed {name}): no worker host $host" >&2; exit 255 ;;
esac
"""


# Each host's processes get a UTS namespace whose hostname is the host's address, as hosts have
# names of their own that resolve to them: Horovod 0.28.1 builds its process sets' Gloo
# contexts (the global one's included) without HOROVOD_GLOO_IFACE, so Gloo binds them to the
# address the hostname resolves to, which for the machine's own name is 127.0.0.1 in every
# namespace (gloo_context.cc, InitializeForProcessSet: the new context's own empty iface).
HOSTNAME = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"']


def _in_host(tb: Testbed, host: str, argv: list[str]) -> list[str]:
    """``argv`` in ``host``'s namespace, CPU budget and hostname (its address)."""
    h = tb.host(host)
    return cpu.wrap(tb, h.name, ["ip", "netns", "exec", h.ns, *HOSTNAME, h.ip, *argv])


def discovery_file(tb: Testbed) -> Path:
    """The file an elastic job's discovery script prints: one ``address:slots`` a line."""
    return tb.log_dir() / DISCOVERY


def list_hosts(tb: Testbed, hosts: Sequence[str] | None = None, per_host: int = 1) -> None:
    """Says which worker hosts an elastic job on ``tb`` may run on now (its discovery script
    reads this at each look, about once a second): ``hosts`` by name ("w0", ...; None: every
    worker host), ``per_host`` slots each. Written whole (a rename), never half."""
    names = [h.name for h in tb.worker_hosts] if hosts is None else list(hosts)
    lines = "".join(f"{tb.host(n).ip}:{per_host}\n" for n in names)
    path = discovery_file(tb)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(lines)
    tmp.replace(path)


def listed_hosts(tb: Testbed) -> list[str]:
    """The worker hosts (by name) the discovery file lists now (every worker host if none)."""
    try:
        text = discovery_file(tb).read_text()
    except FileNotFoundError:
        return [h.name for h in tb.worker_hosts]
    ips = {line.split(":")[0] for line in text.split()}
    return [h.name for h in tb.worker_hosts if h.ip in ips]


def elastic_env(tb: Testbed, extra: dict[str, str] | None = None, per_host: int = 1
                ) -> dict[str, str]:
    """``job_env`` less what is Open MPI's: horovodrun runs Horovod on Gloo (its own
    HOROVOD_CPU_OPERATIONS=gloo), over eth0 (``--network-interface``)."""
    env = {k: v for k, v in job_env(tb, None, per_host).items()
           if not k.startswith("OMPI_") and k != "HOROVOD_CPU_OPERATIONS"}
    env.update(extra or {})
    return env


def run_elastic(tb: Testbed, cmd: Sequence[str], env: dict[str, str] | None = None,
                timeout: float | None = None, capture: bool = False, per_host: int = 1,
                min_np: int = 0, cooldown: tuple[int, int] = (1, 2),
                log_level: str = "INFO") -> subprocess.CompletedProcess:
    """Runs ``cmd`` as a Horovod elastic job (``horovodrun --gloo --min-np ... --max-np ...
    --host-discovery-script``) on ``tb``'s worker hosts, ``per_host`` slots on each.

    horovodrun runs in w0's namespace, so that its driver and rendezvous are at w0's address,
    reached over the links, and w0's slots are local to it; it starts the other hosts' workers
    with ``ssh HOST ...``, which a shim first on its PATH (``SSH_SHIM``) runs in HOST's
    namespace. The hosts are the worker hosts' addresses, as ``list_hosts`` last listed them
    (every worker host if never; the caller changes the list while the job runs: a host taken
    off it loses its workers at Horovod's next look, one listed again gets them back). A host
    whose worker failed is taken back ``cooldown`` seconds (a range) after it is listed again
    (Horovod's blacklist). No process of the job outlives the call.

    Args:
        tb: the testbed.
        cmd: the worker's command ("python ..." runs this interpreter).
        env: over ``elastic_env``'s (HVD_SPARSE_*, the aggregators, the link rate).
        timeout: seconds before the job is stopped (then ``TimeoutExpired``).
        capture: the job's output as text in the result (else it goes to this stdout).
        per_host: slots per worker host.
        min_np: the fewest ranks the job goes on with (0: half of them, at least 1).
        cooldown: Horovod's ``--blacklist-cooldown-range``, seconds.
        log_level: horovodrun's ``--log-level`` (INFO: its driver's decisions).

    Returns:
        horovodrun's result (its exit status: 0 when every worker of the last membership
        succeeded).

    Raises:
        RuntimeError: horovodrun is not installed beside this interpreter.
        subprocess.TimeoutExpired: past ``timeout`` (the job stopped).
    """
    horovodrun = Path(sys.executable).parent / "horovodrun"
    if not horovodrun.exists():
        raise RuntimeError(f"testbed: {horovodrun} not found (Horovod; make build installs it)")
    n = tb.workers * per_host
    min_np = min_np or max(1, n // 2)
    if not discovery_file(tb).exists():
        list_hosts(tb, per_host=per_host)
    job = elastic_env(tb, env, per_host)
    w0 = tb.worker_hosts[0]
    log = tempfile.TemporaryFile("w+") if capture else None
    with tempfile.TemporaryDirectory(prefix=f"hvd-sparse-{tb.name}-ssh-") as tmp:
        cases = "\n".join(
            f"  {h.ip}|{h.name}) exec "
            f"{shlex.join(_in_host(tb, h.name, ['sh', '-c']))}"
            ' "$*" ;;' for h in tb.worker_hosts)
        shim = Path(tmp) / "ssh"
        shim.write_text(SSH_SHIM.format(name=tb.name, cases=cases))
        discover = Path(tmp) / "discover.sh"
        discover.write_text(f"#!/bin/sh\nexec cat {shlex.quote(str(discovery_file(tb)))}\n")
        for f in (shim, discover):
            f.chmod(0o755)
        argv = _in_host(tb, w0.name, [
            str(horovodrun), "--gloo", "-np", str(n),
            "--min-np", str(min_np), "--max-np", str(n), "--host-discovery-script",
            str(discover), "--network-interface", "eth0", "--blacklist-cooldown-range",
            str(cooldown[0]), str(cooldown[1]), "--log-level", log_level, *_python(cmd)])
        full = {**os.environ, **job, "PATH": f"{tmp}:{os.environ.get('PATH', '')}"}
        proc = subprocess.Popen(argv, env=full, stdout=log,
                                stderr=subprocess.STDOUT if log else None,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()  # horovodrun stops its workers on SIGTERM
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                raise subprocess.TimeoutExpired(argv, timeout or 0, _read_log(log)) from None
            return subprocess.CompletedProcess(argv, proc.returncode, _read_log(log),
                                               "" if capture else None)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            # workers horovodrun lost track of, the ssh shims' commands, the discovery script
            links.kill_processes([h.ns for h in tb.worker_hosts])
            if log:
                log.close()


def _read_log(log: IO[str] | None) -> str | None:
    if log is None:
        return None
    log.seek(0)
    return log.read()
