"""Parallel test modules, Horovod's way: one pytest module, run by pytest on every rank.

A module tests/parallel/test_<x>.py is ordinary pytest; its tests run on every rank of a job
and compare against references (hvd.allreduce in float64, ...), with collectives where a check
spans ranks. It says how it is launched in a module-level literal, read here with ``ast``
(without importing the module, Horovod or torch)::

    LAUNCHES = [Launch(np=2), Launch("mpirun", np=2, env={"X": "1"}, id="mpi-x")]

From the top (``pytest tests``), tests/parallel/conftest.py turns each launch into one test
item that runs ``horovodrun -np N ... python -m pytest tests/parallel/test_<x>.py`` (or mpirun)
with a timeout; every rank writes its per-test outcomes (``RankReporter``, JSON lines) and
``Outcome`` fails the item with the failing (rank, test) pairs, root causes first, each with its
own traceback, and the launcher's last output where a rank wrote nothing. Under a launcher the
same module's tests are collected normally. Torch-free: the driver imports nothing heavy.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "TORCHELASTIC_RUN_ID")
OUT_VAR = "HVD_SPARSE_TEST_OUT"  # where each rank writes rank<r>.jsonl
SHUT_DOWN = "Horovod has been shut down"


@dataclasses.dataclass(frozen=True)
class Launch:
    """How one module is run: launcher ("horovodrun", Gloo; "mpirun", MPI operations; or
    "torchrun", torch.distributed without Horovod: the DDP front end), ranks,
    extra environment ("{out}" stands for the launch's output folder), extra pytest arguments
    (e.g. ("-k", "not rank0")), the whole job's timeout, whether it needs a GPU, and whether it
    belongs to the extended tier (marker "extended")."""

    launcher: str = "horovodrun"
    np: int = 2
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    id: str = ""
    args: tuple[str, ...] = ()
    timeout: float = 300
    gpu: bool = False
    extended: bool = False  # a rerun or a long run: `make test-extended`, not `make test`

    @property
    def name(self) -> str:
        kind = {"horovodrun": "gloo", "mpirun": "mpi", "torchrun": "torch"}[self.launcher]
        return self.id or f"{kind}-np{self.np}"


def launches(path: Path) -> list[Launch]:
    """The module's ``LAUNCHES``, evaluated as a literal of Launch(...) calls only."""
    tree = ast.parse(Path(path).read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "LAUNCHES" for t in node.targets):
            code = compile(ast.Expression(node.value), str(path), "eval")
            return list(eval(code, {"__builtins__": {}, "Launch": Launch}))  # noqa: S307
    return []


def rank() -> int | None:
    """This process's rank when a launcher started it, else None."""
    for var in RANK_VARS:
        if var in os.environ:  # (torchrun: its run id says RANK is the launcher's)
            return int(os.environ["RANK" if var == "TORCHELASTIC_RUN_ID" else var])
    return None


# ------------------------------------------------------------------------------------------
# On every rank: the outcome of each test, one JSON line per event, flushed as it happens
# ------------------------------------------------------------------------------------------

class RankReporter:
    """A pytest plugin (registered by tests/parallel/conftest.py under a launcher when
    HVD_SPARSE_TEST_OUT is set): collection, each test's start and reports, the end."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "w", buffering=1)  # noqa: SIM115 - open for the session
        self.hard_exit = False

    def _write(self, **event: Any) -> None:
        self.file.write(json.dumps(event, default=str) + "\n")
        self.file.flush()

    def pytest_collection_finish(self, session: Any) -> None:
        ends = {}
        for item in session.items:
            m = item.get_closest_marker("ends")
            if m is not None:
                ends[item.nodeid] = {"rank": m.kwargs["rank"], "job": m.kwargs.get("job", False)}
        self.hard_exit = any(not e["job"] for e in ends.values())
        self._write(event="collected", tests=[i.nodeid for i in session.items], ends=ends)

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self._write(event="start", test=nodeid, t=time.time())

    def pytest_runtest_logreport(self, report: Any) -> None:
        ev: dict[str, Any] = {"event": "report", "test": report.nodeid, "when": report.when,
                              "outcome": report.outcome, "duration": report.duration,
                              "props": dict(report.user_properties)}
        if report.failed or report.skipped:
            ev["longrepr"] = report.longreprtext
            ev["sections"] = [(k, v[-3000:]) for k, v in report.sections]
        self._write(**ev)

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        self._write(event="finish", exitstatus=int(exitstatus))

    def pytest_unconfigure(self) -> None:
        self.file.close()
        if self.hard_exit:  # a rank left by design: Horovod's shutdown would wait for it
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


# ------------------------------------------------------------------------------------------
# In the driver: launch, then read every rank's events
# ------------------------------------------------------------------------------------------

def environment(launch: Launch, out: Path) -> dict[str, str]:
    env = {"PYTHONPATH": str(ROOT), OUT_VAR: str(out), "HVD_SPARSE_CACHE_DIR": str(out / "cache"),
           "OMP_NUM_THREADS": "1",
           "HOROVOD_CPU_OPERATIONS": "mpi" if launch.launcher == "mpirun" else "gloo",
           # Gloo's 30 s default, and ours, end jobs whose 4 ranks share 2 busy cores: this
           # kernel has left a runnable thread without CPU for 27 s (docs/BENCHMARKS.md).
           # Tests of the timeouts set theirs low.
           "HOROVOD_GLOO_TIMEOUT_SECONDS": "120", "HVD_SPARSE_TIMEOUT": "90"}
    env.update({k: v.replace("{out}", str(out)) for k, v in launch.env.items()})
    return env


def _test_timeout(launch: Launch) -> int:
    return max(30, int(launch.timeout) - 30)


def pytest_args(module: Path, launch: Launch, extra: Sequence[str] = ()) -> list[str]:
    """pytest on one rank: quiet, no cache (the ranks share the checkout), a per-test timeout
    below the job's that dumps every thread's stack and ends the rank (not the next test: the
    ranks' collectives must stay matched)."""
    return [sys.executable, "-m", "pytest", str(module), "-q", "-p", "no:cacheprovider",
            "-o", f"timeout={_test_timeout(launch)}", "-o", "timeout_method=thread",
            *launch.args, *extra]


def command(module: Path, launch: Launch, env: dict[str, str], extra: Sequence[str] = ()
            ) -> list[str]:
    worker = pytest_args(module, launch, extra)
    if launch.launcher == "horovodrun":
        return [str(BIN / "horovodrun"), "-np", str(launch.np), "-H", f"localhost:{launch.np}",
                "--gloo", *worker]
    if launch.launcher == "mpirun":
        xs = [a for k in env for a in ("-x", k)]
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--tag-output", "-np",
                str(launch.np), *xs, *worker]
    if launch.launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={launch.np}",
                "--no-python", *worker]
    raise ValueError(f"unknown launcher {launch.launcher!r}")


Runner = Callable[[list[str], dict[str, str], float], subprocess.CompletedProcess]


def run(module: Path | str, launch: Launch, out: Path, *, extra: Sequence[str] = (),
        runner: Runner | None = None) -> Outcome:
    """Runs ``module`` on ``launch.np`` ranks; every rank's outcomes come back. ``runner``
    (argv of one rank's pytest, its extra environment, timeout) replaces horovodrun/mpirun:
    the testbed's launcher, say."""
    module = Path(module)
    module = module if module.is_absolute() else ROOT / module
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.jsonl"):
        old.unlink()
    env = environment(launch, out)
    t0 = time.monotonic()
    hung = False
    if runner is not None:
        try:
            proc = runner(pytest_args(module, launch, extra), env, launch.timeout)
        except subprocess.TimeoutExpired as e:
            hung = True
            proc = subprocess.CompletedProcess(e.cmd, -9, _text(e.stdout), _text(e.stderr))
    else:
        argv = command(module, launch, env, extra)
        p = subprocess.Popen(argv, env={**os.environ, **env}, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = p.communicate(timeout=launch.timeout)
        except subprocess.TimeoutExpired:
            hung = True
            stdout, stderr = _stop(p, out)
        proc = subprocess.CompletedProcess(argv, p.returncode, stdout, stderr)
    ranks = {}
    for r in range(launch.np):
        path = out / f"rank{r}.jsonl"
        if path.exists():
            ranks[r] = [json.loads(line) for line in path.read_text().splitlines()
                        if line.endswith("}")]
    return Outcome(module, launch, ranks, proc, hung, time.monotonic() - t0, out)


def _text(x: str | bytes | None) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def _stop(p: subprocess.Popen, out: Path) -> tuple[str, str]:
    """The job hung: SIGTERM the launcher's session (horovodrun and mpirun pass it on), then
    SIGKILL whatever of this launch is left (found by its own output folder in the
    environment, so nothing else on the machine)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            stdout, stderr = p.communicate(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    else:
        stdout, stderr = "", ""
    marker = f"{OUT_VAR}={out}".encode() + b"\0"
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            if marker in Path(f"/proc/{pid}/environ").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except (OSError, PermissionError):
            pass
    return stdout or "", stderr or ""


# ------------------------------------------------------------------------------------------
# The verdict
# ------------------------------------------------------------------------------------------

# How likely a failure is a consequence of another rank's: a peer that saw Horovod shut down,
# or a test that never finished, comes after the failures that explain them.
ROOT_CAUSE, TIMED_OUT, CONSEQUENCE = 0, 1, 2


@dataclasses.dataclass
class Failure:
    rank: int
    test: str
    kind: int
    order: int
    headline: str
    detail: str


@dataclasses.dataclass
class Outcome:
    module: Path
    launch: Launch
    ranks: dict[int, list[dict]]
    proc: subprocess.CompletedProcess
    hung: bool
    seconds: float
    out: Path

    def props(self, rank: int) -> dict[str, Any]:
        """Every ``record_property`` of a rank's tests, merged."""
        merged: dict[str, Any] = {}
        for ev in self.ranks.get(rank, []):
            if ev["event"] == "report":
                merged.update(ev["props"])
        return merged

    def tests(self) -> list[str]:
        for evs in self.ranks.values():
            for ev in evs:
                if ev["event"] == "collected":
                    return ev["tests"]
        return []

    def failures(self) -> tuple[list[Failure], list[str]]:
        """(failing (rank, test) pairs, problems with the job as a whole)."""
        problems: list[str] = []
        fails: list[Failure] = []
        collected = {r: next((e for e in evs if e["event"] == "collected"), None)
                     for r, evs in self.ranks.items()}
        tests = self.tests()
        missing = [r for r in range(self.launch.np) if collected.get(r) is None]
        if missing:
            problems.append(f"rank(s) {missing} reported nothing (no collection): see the "
                            "launcher's output below")
        for r, c in collected.items():
            if c is not None and c["tests"] != tests:
                problems.append(f"rank {r} collected other tests than rank "
                                f"{min(collected)}: {len(c['tests'])} vs {len(tests)}")
        if not tests and not missing:
            problems.append("no test was collected")
        ends = next((c["ends"] for c in collected.values() if c is not None), {})
        # After a test that ends a whole job by design, nothing more is expected of anyone.
        job_end = min((tests.index(t) for t, e in ends.items() if e["job"] and t in tests),
                      default=len(tests))
        left = {e["rank"]: tests.index(t) for t, e in ends.items()
                if not e["job"] and t in tests}
        for r in range(self.launch.np):
            if collected.get(r) is None:
                continue
            started = {e["test"] for e in self.ranks[r] if e["event"] == "start"}
            reports: dict[str, list[dict]] = {}
            for e in self.ranks[r]:
                if e["event"] == "report":
                    reports.setdefault(e["test"], []).append(e)
            for i, t in enumerate(tests):
                if i > job_end or (r in left and i > left[r]):
                    continue  # the job, or this rank, has ended by design
                designed_end = (i == job_end) or (left.get(r) == i and ends[t]["rank"] == r)
                reps = reports.get(t, [])
                bad = [e for e in reps if e["outcome"] != "passed"]
                if bad:
                    e = bad[0]
                    text = e.get("longrepr", "")
                    what = ("skipped under the launcher (a skip never passes): "
                            if e["outcome"] == "skipped" else "")
                    fails.append(Failure(r, t, _kind(text), i, what + _headline(text),
                                         _detail(e)))
                elif t in started and not any(e["when"] == "teardown" for e in reps):
                    if designed_end:
                        continue
                    if self._timed_out(r):
                        why = (f"timed out after {_test_timeout(self.launch)} s (pytest-timeout: "
                               "the rank's stacks are in the launcher's output)")
                    elif self.hung:
                        why = "started, never finished: the job hung and was stopped"
                    else:
                        why = "started, never finished: the rank died or the launcher ended it"
                    fails.append(Failure(r, t, TIMED_OUT, i, why, ""))
                elif t not in started:
                    if designed_end:
                        continue
                    fails.append(Failure(r, t, CONSEQUENCE, i, "never ran (the rank had ended)",
                                         ""))
            if not any(e["event"] == "finish" for e in self.ranks[r]) and not fails \
                    and job_end == len(tests) and r not in left:
                problems.append(f"rank {r} ran every test but its session did not finish")
        ended_by_design = job_end < len(tests)
        if not self.hung and self.proc.returncode != 0 and not ended_by_design \
                and not fails and not problems:
            problems.append(f"every test passed but the launcher exited {self.proc.returncode}")
        if self.hung:
            problems.append(f"the job ran past its {self.launch.timeout:.0f} s and was stopped")
        fails.sort(key=lambda f: (f.kind, f.order, f.rank))
        return fails, problems

    def _timed_out(self, rank: int) -> bool:
        out = (self.proc.stdout or "") + (self.proc.stderr or "")
        return any(re.match(rf"\[(\d+,)?{rank}\]<std\w+>:\++ Timeout \++", ln)
                   for ln in out.splitlines())

    def message(self) -> str:
        fails, problems = self.failures()
        if not fails and not problems:
            return ""
        rel = self.module.relative_to(ROOT) if self.module.is_relative_to(ROOT) else self.module
        n = len(self.tests())
        head = (f"{rel} [{self.launch.name}] on {self.launch.np} ranks ({self.launch.launcher}, "
                f"{self.seconds:.0f} s): {len(fails)} failing (rank, test) pair(s) of "
                f"{n} tests x {self.launch.np} ranks, root cause first")
        lines = [head]
        groups: dict[tuple[str, str], list[Failure]] = {}
        for f in fails:  # one line for a test failing alike on several ranks
            groups.setdefault((f.test, f.headline), []).append(f)
        rows = [(_ranks([f.rank for f in g]), _short(t), h) for (t, h), g in groups.items()]
        width = max([len(t) for _, t, _ in rows] + [10])
        wwho = max([len(w) for w, _, _ in rows] + [6])
        for who, t, h in rows[:40]:
            lines.append(f"  {who:<{wwho}}  {t:<{width}}  {h}")
        if len(rows) > 40:
            lines.append(f"  ... and {len(rows) - 40} more")
        lines += [f"  job: {p}" for p in problems]
        shown = 0
        for g in groups.values():  # each group's first traceback (the others are alike)
            f = g[0]
            if f.detail and shown < 6:
                lines += ["", f"===== rank {f.rank}: {_short(f.test)} =====", f.detail]
                shown += 1
        if problems or any(not f.detail for f in fails):
            lines += ["", f"===== launcher: {' '.join(map(str, self.proc.args[:8]))} ..., "
                          f"exit {self.proc.returncode} =====",
                      by_rank(self.proc.stdout or "", self.launch.np),
                      (self.proc.stderr or "")[-3000:]]
        lines.append(f"(per-rank events: {self.out}/rank<r>.jsonl)")
        return "\n".join(lines)

    def check(self) -> None:
        """Raises LaunchError with ``message()`` unless every rank passed every test."""
        msg = self.message()
        if msg:
            raise LaunchError(msg)


class LaunchError(AssertionError):
    pass


def _kind(text: str) -> int:
    if SHUT_DOWN in text or "HorovodInternalError" in text:
        return CONSEQUENCE
    if "Timeout" in text.split("\n")[-1] or "+++ Timeout +++" in text:
        return TIMED_OUT
    return ROOT_CAUSE


def _headline(text: str) -> str:
    """The exception line of a pytest long representation."""
    errs = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    errs = [e for e in errs if e]
    line = errs[0] if errs else (text.strip().splitlines() or ["?"])[-1]
    if "..." in line and len(errs) > 1:  # pytest shortened the values: its diff has them
        line += " | " + errs[-1]
    return line[:240]


def _detail(ev: dict) -> str:
    text = ev.get("longrepr", "")
    lines = text.splitlines()
    if len(lines) > 80:
        lines = lines[:20] + [f"... ({len(lines) - 70} lines) ..."] + lines[-50:]
    out = "\n".join(lines)
    for name, body in ev.get("sections", []):
        if body.strip():
            out += f"\n----- {name} (last lines) -----\n" + "\n".join(body.splitlines()[-25:])
    return out


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))


def _short(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


def by_rank(output: str, np: int, lines: int = 30) -> str:
    """The last lines of each rank's output (horovodrun prefixes them "[r]<std...>", mpirun
    --tag-output "[job,r]<std...>"), root causes first: a rank that only saw Horovod shut down
    by a peer comes last."""
    ranks = {r: [ln for ln in output.splitlines()
                 if re.match(rf"\[(\d+,)?{r}\]<", ln)] for r in range(np)}
    order = sorted(ranks, key=lambda r: SHUT_DOWN in "\n".join(ranks[r]))
    parts = [f"--- rank {r} ---\n" + "\n".join(ranks[r][-lines:]) for r in order if ranks[r]]
    return "\n".join(parts) if parts else output[-4000:]


def cleanup(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
