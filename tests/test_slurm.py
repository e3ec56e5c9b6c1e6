"""deploy/slurm/*.sbatch under a real Slurm: a slurmctld and a slurmd (Debian's slurm-wlm, with a
munged of their own) started here on one node of 2 CPUs, tasks bound to their CPUs
(task/affinity, as task/affinity or task/cgroup bind them on a cluster), each script submitted
unchanged with sbatch (only its node count overridden, to this one node) and its output checked
as tests/test_examples.py checks the examples': the loss went down, every rank ends with the
same parameters, and for the dedicated aggregators both of them summed packets, all
authenticated; and the CPUs the DDP script asks for reach its ranks. The GPU scripts (no GPU
here) and every script's shell and #SBATCH lines are checked statically.

Skipped, with the daemons' own words, where Slurm is not installed (scripts/setup/setup.sh installs
it) or its daemons cannot start here. Everything started is stopped by pid and the temporary
directory removed, also when a test fails."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPTS = ROOT / "deploy" / "slurm"
pytestmark = pytest.mark.integration

SBIN = ":".join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
TOOLS = ("slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scontrol", "scancel")
JOB_TIMEOUT = 100  # seconds for one job (each takes about 10 here)
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
        "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
# Variables that would tie our sbatch to an outer Slurm job or MPI launcher (a CI runner
# that is itself a Slurm job), and the port range, which this test does not depend on.
FOREIGN = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMIX_", "PMI_", "OMPI_COMM_WORLD",
           "HVD_SPARSE_PORTS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_name() -> str:
    """This host's short name, as slurmd calls itself, when it resolves (torchrun's rendezvous
    and the aggregators' addresses use it); else localhost, with slurmd told so (-N)."""
    name = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(name)
        return name
    except OSError:
        return "localhost"


class Cluster:
    """A one-node Slurm cluster in a temporary directory (conf, state, spool, logs)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hvdsp-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.node = node_name()
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    # -- environment and commands -----------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN)}
        env.update(SLURM_CONF=str(self.conf), PATH=f"{BIN}:{SBIN}", OMP_NUM_THREADS="1",
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra)
        return env

    def cmd(self, *argv: str, timeout: float = 20, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env(), capture_output=True, text=True,
                              timeout=timeout, **kw)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = self.dir / f"{name}.out"
        self.logs[name] = log
        with open(log, "w") as f:
            self.procs[name] = subprocess.Popen(argv, env=self.env(), stdout=f,
                                                stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def tail(self, lines: int = 15) -> str:
        """The last lines of every daemon's output and log file."""
        out = []
        for f in [*self.logs.values(), *sorted(self.dir.glob("log/*.log"))]:
            text = f.read_text(errors="replace").strip().splitlines() if f.exists() else []
            if text:
                out.append(f"--- {f.name}\n" + "\n".join(text[-lines:]))
        return "\n".join(out)

    # -- start --------------------------------------------------------------------------------
    def start(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir()
        auth = self._auth()
        d = self.dir
        self.conf.write_text(f"""\
# Written by tests/test_slurm.py: one node, this host, for the deploy/slurm scripts' test.
ClusterName=hvdsptest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
{auth}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
MailProg=/bin/true
# No cgroups: processes tracked by their process group, nothing measured. Tasks bound to the
# CPUs their step was given (sched_setaffinity): a step that gets one CPU runs on one CPU.
ProctrackType=proctrack/pgid
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
KillWait=5
# The node as configured, whatever hwloc finds (2 CPUs: 2 ranks, as the examples' tests).
SlurmdParameters=config_overrides
NodeName={self.node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        self._spawn("slurmd", ["slurmd", "-D", "-N", self.node])
        self._wait_idle(30)

    def _auth(self) -> str:
        """A munged of our own (its key and socket here) when munge is installed; else
        auth/none, where this Slurm still has it (22.05 does)."""
        munged = shutil.which("munged", path=SBIN)
        if munged:
            key = self.dir / "munge.key"
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, os.urandom(128))
            os.close(fd)
            sock = self.dir / "munge.sock"
            self._spawn("munged", [munged, "-F", "-f", f"--key-file={key}", f"--socket={sock}",
                                   f"--pid-file={self.dir}/munged.pid",
                                   f"--log-file={self.dir}/log/munged.log",
                                   f"--seed-file={self.dir}/munged.seed"])
            for _ in range(100):
                if sock.exists() or self.procs["munged"].poll() is not None:
                    break
                time.sleep(0.05)
            if not sock.exists():
                pytest.skip(f"munged did not start:\n{self.tail()}")
            return f"AuthType=auth/munge\nAuthInfo=socket={sock}\nCredType=cred/munge"
        if glob.glob("/usr/lib*/**/auth_none.so", recursive=True):
            return "AuthType=auth/none\nCredType=cred/none"
        pytest.skip("neither munged nor Slurm's auth/none plugin is installed")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for name in ("slurmctld", "slurmd"):
                if self.procs[name].poll() is not None:
                    pytest.skip(f"{name} exited ({self.procs[name].returncode}) on start:\n"
                                f"{self.tail()}")
            p = self.cmd("sinfo", "-h", "-N", "-o", "%T")
            state = p.stdout.strip() or p.stderr.strip()
            if state == "idle":
                return
            time.sleep(0.3)
        reason = self.cmd("scontrol", "show", "node", self.node).stdout
        pytest.skip(f"the node is not idle after {timeout:.0f} s ({state}):\n{reason}\n"
                    f"{self.tail()}")

    # -- jobs -----------------------------------------------------------------------------------
    def submit(self, script: str, *options: str, timeout: float = JOB_TIMEOUT,
               script_args: tuple[str, ...] = (), **env: str) -> str:
        """Submits deploy/slurm/``script`` from the checkout (the scripts' default root is the
        submit directory) with sbatch, ``options`` for sbatch and ``script_args`` for the
        script, waits for it and returns its output; fails with the output when it does not
        complete (cancelling it when it overruns)."""
        out = self.dir / f"{script}.out"
        p = subprocess.run(["sbatch", "--parsable", f"--output={out}", *options,
                            str(SCRIPTS / script), *script_args], cwd=ROOT, env=self.env(**env),
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stdout + p.stderr
        job = p.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        state = exit_code = ""
        while time.monotonic() < deadline:
            info = self.cmd("scontrol", "-o", "show", "job", job).stdout
            m = re.search(r"JobState=(\S+)", info)
            state = m.group(1) if m else ""
            if state in DONE:
                exit_code = re.search(r" ExitCode=(\S+)", info).group(1)
                break
            time.sleep(0.5)
        text = out.read_text(errors="replace") if out.exists() else "(no output file)"
        if state not in DONE:
            self.cmd("scancel", job)
            pytest.fail(f"job {job} ({script}) still {state} after {timeout} s:\n"
                        f"{text[-4000:]}\n{self.tail()}")
        assert (state, exit_code) == ("COMPLETED", "0:0"), \
            f"job {job} ({script}): {state} {exit_code}\n{text[-4000:]}"
        return text

    # -- stop -----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancels every job, stops the daemons, kills whatever still carries this cluster's
        SLURM_CONF (job steps, ranks, their aggregators), all by pid; removes the directory."""
        try:
            if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
                jobs = self.cmd("squeue", "-h", "-o", "%i", timeout=10).stdout.split()
                if jobs:
                    self.cmd("scancel", *jobs, timeout=10)
                    for _ in range(40):
                        if not self.cmd("squeue", "-h", "-o", "%i", timeout=10).stdout.split():
                            break
                        time.sleep(0.25)
        except (subprocess.SubprocessError, OSError):
            pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self._ours()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            for _ in range(20):
                if not self._ours():
                    break
                time.sleep(0.1)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _ours(self) -> list[int]:
        """Processes whose environment names this cluster's slurm.conf: slurmstepd, the job
        scripts, their ranks (Slurm sets SLURM_CONF in every job's environment)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids


@pytest.fixture(scope="module")
def slurm():
    missing = [t for t in TOOLS if not shutil.which(t, path=SBIN)]
    if missing:
        pytest.skip(f"Slurm is not installed (no {', '.join(missing)}; scripts/setup/setup.sh "
                    "installs slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("slurmd runs jobs as their users: it needs root")
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def summary(out: str) -> dict:
    """The example's JSON summary (its last line that is one)."""
    found = re.findall(r"^(\{\"example\".*\})$", out, re.M)
    assert found, out[-4000:]
    s = json.loads(found[-1])
    assert s["ranks"] == 2, s
    assert s["last_loss"] < 0.9 * s["first_loss"], s
    assert s["same_parameters_on_every_rank"], s
    return s


def test_horovod_srun(slurm: Cluster) -> None:
    """srun --mpi=pmix starts both ranks; the job's own aggregators (the default)."""
    s = summary(slurm.submit("horovod.sbatch", "--nodes=1", STEPS="20"))
    assert {"rows", "rows+omnireduce"} & set(s["schemes"]), s


def test_ddp_torchrun(slurm: Cluster) -> None:
    """One torchrun on the one node, its two ranks meeting at the c10d rendezvous, on the port
    the script picked for this job in RDZV_PORTS."""
    out = slurm.submit("ddp.sbatch", "--nodes=1", STEPS="20")
    s = summary(out)
    assert {"rows", "rows+omnireduce"} & set(s["schemes"]), s
    port = int(re.search(r"rendezvous \S+:(\d+),", out).group(1))
    assert 29400 <= port <= 29499, out[-2000:]


# One write(2) a line: print() writes the text and its newline apart, so two ranks' lines can
# run together in the step's shared output.
CPU_PROBE = """import json, os
os.write(1, ("cpus " + json.dumps({"rank": int(os.environ["RANK"]),
                                   "cpus": sorted(os.sched_getaffinity(0))}) + "\\n").encode())
"""


def test_ddp_ranks_get_the_cpus_sbatch_asked_for(slurm: Cluster) -> None:
    """ddp.sbatch asks for 2 CPUs for its one task a node, and its ranks run on both. Since
    Slurm 22.05 srun does not inherit sbatch's --cpus-per-task: a step asks for one CPU a task
    unless told (SRUN_CPUS_PER_TASK, which the script sets). Slurm 22.05 still gives a
    one-task step every CPU of the job on the node unless the step is exact (--exact, which
    sites set for everyone with SLURM_EXACT=1, or any --cpus-per-task); the job runs exact
    here, and under task/affinity a script that does not pass its CPUs on puts torchrun and
    both ranks on one CPU."""
    probe = slurm.dir / "cpu_probe.py"
    probe.write_text(CPU_PROBE)
    out = slurm.submit("ddp.sbatch", "--nodes=1", script_args=(str(probe),), SLURM_EXACT="1")
    ranks = [json.loads(m) for m in re.findall(r"cpus (\{[^{}]*\})", out)]
    assert sorted(r["rank"] for r in ranks) == [0, 1], out[-3000:]
    asked = int(sbatch_options(SCRIPTS / "ddp.sbatch")["cpus-per-task"])
    assert asked == 2
    for r in ranks:
        assert len(r["cpus"]) == asked, f"rank {r['rank']} runs on CPUs {r['cpus']}: {out[-2000:]}"


def test_dedicated_aggregators(slurm: Cluster) -> None:
    """The aggregators as a job step of their own, their secret (0600) and addresses on the
    shared directory, which the job removes at its end."""
    shared = slurm.dir / "shared"
    shared.mkdir()
    # AGG_PORT=0: any free port (the default 9999 may be taken by another test here)
    out = slurm.submit("dedicated-aggregators.sbatch", "--nodes=1", STEPS="20", AGG_PORT="0",
                       SHARED_DIR=str(shared))
    s = summary(out)
    assert {"omnireduce", "rows+omnireduce"} & set(s["schemes"]), s
    stats = [json.loads(m) for m in re.findall(r"^aggregator \d+: hvd-sparse aggregator stats "
                                               r"(\{.*\})$", out, re.M)]
    assert len(stats) == 2, out[-4000:]
    # both summed the job's packets, every one authenticated under the job's secret
    assert all(st["rx_packets"] > 0 for st in stats), stats
    assert all(st.get("unauthenticated", 0) == st.get("bad_mac", 0) == 0 for st in stats), stats
    assert not list(shared.iterdir()), list(shared.iterdir())


# ------------------------------------------------------------------------------------------
# Statically: every script, the GPU ones included (no GPU here to run them on)
# ------------------------------------------------------------------------------------------

def sbatch_options(script: Path) -> dict[str, str]:
    """The active #SBATCH options of a script (``##SBATCH`` lines are comments to sbatch)."""
    out = {}
    for line in script.read_text().splitlines():
        m = re.match(r"#SBATCH --([\w-]+)(?:=(\S+))?", line)
        if m:
            out[m.group(1)] = m.group(2) or ""
    return out


ALL_SCRIPTS = sorted(SCRIPTS.glob("*.sbatch"))


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=[p.name for p in ALL_SCRIPTS])
def test_scripts_parse_and_hand_their_cpus_to_srun(script: Path) -> None:
    """bash -n; strict mode; the CPUs per task reach srun; no fixed rendezvous port."""
    p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    text = script.read_text()
    assert "set -euo pipefail" in text
    opts = sbatch_options(script)
    assert {"job-name", "nodes", "ntasks-per-node", "cpus-per-task", "time"} <= set(opts), opts
    assert "export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}" in text, script.name
    assert "29500" not in text.split("set -euo pipefail", 1)[1], "a fixed rendezvous port"
    # under set -u, every variable read without a default is set by the script or by Slurm
    # (an unset $IFACE would end the job)
    body = text.split("set -euo pipefail", 1)[1]
    assigned = set(re.findall(r"\b([A-Z_][A-Z0-9_]*)=", body))
    for var in set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)\b(?!:?-)", body)):
        assert var.startswith("SLURM_") or var in assigned or var in ("PATH", "PWD"), \
            f"{script.name}: ${var} is read but never set"


GPU_SCRIPTS = [p for p in ALL_SCRIPTS if p.stem.endswith("-gpu")]


def test_gpu_scripts_run_one_rank_per_gpu() -> None:
    """Each GPU script asks for GPUs on every node and runs one rank per GPU: Horovod one
    task per GPU, each seeing the node's GPUs (the examples take cuda:local_rank), DDP one
    torchrun per node with a rank per GPU."""
    assert sorted(p.name for p in GPU_SCRIPTS) == ["ddp-gpu.sbatch", "horovod-gpu.sbatch"]
    for script in GPU_SCRIPTS:
        opts, text = sbatch_options(script), script.read_text()
        gpus = int(opts["gpus-per-node"])
        assert gpus >= 1 and "not run on a gpu" in text.lower(), script.name
        if script.name == "horovod-gpu.sbatch":
            assert int(opts["ntasks-per-node"]) == gpus
            srun = [ln for ln in text.splitlines() if ln.startswith("srun ")]
            assert srun and not any("--gpus-per-task" in ln for ln in srun), srun
        else:
            assert int(opts["ntasks-per-node"]) == 1
            assert 'NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-' in text
        # the same steps as the CPU script it follows, which runs under Slurm above
        cpu = (SCRIPTS / script.name.replace("-gpu", "")).read_text()
        steps = [[ln for ln in t.splitlines() if ln.startswith("srun ")] for t in (cpu, text)]
        assert steps[0] and steps[0] == steps[1], script.name
