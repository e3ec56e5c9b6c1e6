"""Horovod elastic with hvd_sparse (issue 51): Horovod's own pattern, nothing more.

The unit tests drive ``basics``' state alone (Horovod's calls and the join replaced): when it
joins, joins again, and what it raises. Each job test runs tests/elastic_train.py under
``horovodrun --gloo -np 4 --min-np 2 --max-np 4 --host-discovery-script ...`` over two local
hosts ("localhost" and "127.0.0.1": Horovod counts hosts by name and runs both here). One worker
exits at batch 12 and its host leaves the discovery script's list for a few seconds: the job
restores its last commit and goes on on the two ranks left, then grows back to four when the
host is listed again. The job must finish with every rank holding the same parameters and the
loss fallen, for Horovod's own optimizer (the reference) and hvd_sparse's, under several
schemes and sparsifiers; hvd_sparse must have joined the ranks again by itself at each change
(its log says so). Every wait has a timeout; whatever the job leaves running is killed (found
by its output folder in its environment).
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "parallel"))
from driver import OUT_VAR, _stop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPT = ROOT / "tests" / "elastic_train.py"
HOSTS = ("localhost", "127.0.0.1")
DROPPED_FOR = 3  # seconds the failed worker's host stays off the discovery script's list
TIMEOUT = int(os.environ.get("HVD_SPARSE_TEST_ELASTIC_TIMEOUT", "180"))  # a job's; 20-65 s


# ---- the state alone --------------------------------------------------------------------------

class FakeHorovod:
    """What ``basics`` asks of Horovod: running, as some rank of some size."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, basics) -> None:
        self.world, self.running = (0, 4), True
        monkeypatch.setattr(basics.hvd, "is_initialized", lambda: self.running)
        monkeypatch.setattr(basics.hvd, "rank", lambda: self.world[0])
        monkeypatch.setattr(basics.hvd, "size", lambda: self.world[1])


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    """``basics`` with Horovod faked and the join counted (no collective, no aggregator)."""
    from horovod.common import elastic as hvd_elastic

    from hvd_sparse import basics, costmodel, session

    horovod = FakeHorovod(monkeypatch, basics)
    joins: list[tuple[int, int]] = []
    closed: list[object] = []

    def join_all(cfg, comm, memberships=None):
        joins.append(horovod.world)
        omni = SimpleNamespace(close=lambda: closed.append(omni))
        return omni, None, costmodel.NetModel.default(None, None)

    monkeypatch.setattr(session, "join_all", join_all)
    monkeypatch.setattr(hvd_elastic.State, "on_reset", hvd_elastic.State.on_reset)  # restored
    yield SimpleNamespace(basics=basics, horovod=horovod, joins=joins, closed=closed,
                          elastic=hvd_elastic)
    basics.shutdown()


@pytest.mark.unit
def test_the_error_is_hvd_sparse_s_and_horovod_s():
    from horovod.common.exceptions import HorovodInternalError

    import hvd_sparse
    e = hvd_sparse.HvdSparseInternalError("hvd_sparse: tensor 'w': a peer left")
    assert isinstance(e, hvd_sparse.HvdSparseError) and isinstance(e, HorovodInternalError)
    assert str(e) == "hvd_sparse: tensor 'w': a peer left"


@pytest.mark.unit
def test_under_elastic_the_join_waits_for_a_reduction_and_follows_the_ranks(fake, monkeypatch):
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    b = fake.basics
    b.init(scheme="allgather")
    assert b.is_initialized() and fake.joins == []  # options checked and kept, nothing joined
    st = b.state()  # the first reduction joins
    assert fake.joins == [(0, 4)] and b.state() is st and st.config.scheme == "allgather"

    # a reduction of this state failed: its error is both, and the next reduction joins again
    e = b.failure("hvd_sparse: tensor 'w': Horovod has been shut down", st.joined)
    assert isinstance(e, b.HvdSparseInternalError)
    fake.horovod.world = (0, 2)  # (hvd.elastic.run resets Horovod meanwhile)
    st2 = b.state()
    assert fake.joins == [(0, 4), (0, 2)] and fake.closed == [st.omni]
    assert st2.joined > st.joined and st2.context.joined == st2.joined
    b.failure("an abandoned reduction of the old state fails late", st.joined)
    assert b.state() is st2  # it does not make the new state stale

    # the ranks changed under it (a reset it did not see fail)
    fake.horovod.world = (1, 4)
    st3 = b.state()
    assert fake.joins[-1] == (1, 4) and st3 is not st2

    # Horovod reset on the same ranks (hvd.elastic.run calls on_reset after each reset)
    fake.elastic.ObjectState(bcast_object=None, get_rank=lambda: 1).on_reset()
    assert b.state() is not st3 and fake.joins[-1] == (1, 4) and len(fake.joins) == 4

    # Horovod shut down under it: Horovod's error too, and a join again once it runs
    fake.horovod.running = False
    with pytest.raises(b.HvdSparseInternalError, match="Horovod is shut down"):
        b.state()
    fake.horovod.running = True
    b.state()
    assert len(fake.joins) == 5


@pytest.mark.unit
def test_outside_elastic_init_joins_and_other_ranks_ask_for_init(fake, monkeypatch):
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    b = fake.basics
    b.init()
    st = b.state()
    assert fake.joins == [(0, 4)]
    b.failure("a reduction failed", st.joined)  # raised, but nothing joins by itself
    fake.elastic.ObjectState(bcast_object=None, get_rank=lambda: 0).on_reset()
    assert b.state() is st and fake.joins == [(0, 4)]
    fake.horovod.world = (0, 2)
    with pytest.raises(b.HvdSparseError, match=r"call hvd_sparse.init\(\) again"):
        b.state()

# Lists both hosts, 2 slots each, but the one named in <shared>/dropped while that file is
# younger than DROPPED_FOR seconds.
DISCOVERY = """#!/bin/sh
d={shared}/dropped
for h in {hosts}; do
  if [ -e "$d" ] && [ "$(cat "$d")" = "$h" ] \\
     && [ $(( $(date +%s) - $(stat -c %Y "$d") )) -lt {secs} ]; then continue; fi
  echo "$h:2"
done
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The network model's cache, shared by the module's jobs: each size is probed once."""
    return tmp_path_factory.mktemp("elastic-cache")


# Horovod 0.28.1's elastic driver itself, now and then, ends such a job when a worker exits
# before the others have seen the failure: it records the failed worker's slot, blacklists
# both of its host's slots and, counting every slot it knows as blacklisted, stops the job
# ("blacklisted slots count == 4 -> stop running"), or a worker's READY at the barrier is
# overridden by its FAILURE and the registration thread ends. Its own decisions (its log at
# INFO), not hvd_sparse's.
DRIVER_RACE = re.compile(r"blacklisted slots count == \d+ -> stop running|"
                         r"State READY overridden by FAILURE")


def run_elastic(shared: Path, cache: Path, *args: str, env: dict[str, str] | None = None
                ) -> tuple[list[dict], str]:
    """Runs the elastic job with ``args`` for tests/elastic_train.py (and ``env`` over the
    environment); (each final rank's result, the launcher's output). Fails the test if the job
    fails or hangs (with every live worker's stacks). Run once more, and only once, where
    Horovod's driver ended the job by its own race (``DRIVER_RACE``) or hung with no worker
    left to run: said in a warning, the first run's output kept in ``first-run/``."""
    code, out, stacks = _launch(shared, cache, args, env or {})
    race = DRIVER_RACE.search(out) if code != 0 else None
    driver_hung = code is None and not stacks
    if race or driver_hung:
        why = race.group(0) if race else "horovodrun hung with no worker left"
        warnings.warn(f"Horovod's elastic driver ended the job by itself ({why}): run again",
                      stacklevel=2)
        first = shared / "first-run"
        first.mkdir()
        for f in list(shared.iterdir()):
            if f.is_file() and f.name != "discover.sh":
                f.rename(first / f.name)
        code, out, stacks = _launch(shared, cache, args, env or {})
    if code is None:
        pytest.fail(f"the elastic job ran past {TIMEOUT} s and was stopped:\n{story(out)}\n"
                    f"----- the stacks of the workers still running -----\n{stacks}")
    assert code == 0, f"horovodrun exited {code}:\n{story(out)}"
    results = [json.loads(f.read_text()) for f in sorted(shared.glob("result.*.json"))]
    return results, out


def _launch(shared: Path, cache: Path, args: tuple[str, ...], env: dict[str, str]
            ) -> tuple[int | None, str, str]:
    """One elastic job in ``shared``: horovodrun's exit status (None if it was stopped), its
    output (also in horovodrun.log there) and, if stopped, the stacks of the workers that
    still ran ("" if none did)."""
    discovery = shared / "discover.sh"
    discovery.write_text(DISCOVERY.format(shared=shared, hosts=" ".join(HOSTS),
                                          secs=DROPPED_FOR))
    discovery.chmod(0o755)
    argv = [str(BIN / "horovodrun"), "--gloo", "-np", "4", "--min-np", "2", "--max-np", "4",
            "--host-discovery-script", str(discovery),
            # the failed worker's host is blacklisted; listed again after this, it is taken back
            "--blacklist-cooldown-range", "1", "2",
            "--log-level", "INFO",  # the driver's decisions (DRIVER_RACE)
            sys.executable, str(SCRIPT), "--shared", str(shared), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), OUT_VAR: str(shared), "OMP_NUM_THREADS": "1",
           "HVD_SPARSE_CACHE_DIR": str(cache), "HVD_SPARSE_LOG_LEVEL": "INFO",
           # 4 ranks share 2 cores: generous, as tests/parallel/driver.py's
           "HOROVOD_GLOO_TIMEOUT_SECONDS": "120", "HVD_SPARSE_TIMEOUT": "90", **env}
    log = shared / "horovodrun.log"
    stacks, stopped = "", False
    with open(log, "w") as f:
        p = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
        deadline = time.monotonic() + TIMEOUT
        try:
            while p.poll() is None:
                if time.monotonic() > deadline:
                    stacks, stopped = _dump_stacks(shared), True
                    _stop(p, shared)
                    break
                time.sleep(0.5)
        finally:
            _stop_leftovers(p, shared)
    return (None if stopped else p.returncode), log.read_text(errors="replace"), stacks


def _workers(shared: Path) -> list[int]:
    """The job's workers still running (found by the output folder in their environment)."""
    marker = f"{OUT_VAR}={shared}".encode() + b"\0"
    found = []
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            if (marker in Path(f"/proc/{pid}/environ").read_bytes()
                    and b"elastic_train.py" in Path(f"/proc/{pid}/cmdline").read_bytes()):
                found.append(pid)
        except OSError:
            pass
    return found


def _dump_stacks(shared: Path) -> str:
    """The threads' stacks of every worker of the job still running (faulthandler on SIGUSR1
    into stacks.<pid>.txt, registered by tests/elastic_train.py); "" when none runs."""
    pids = _workers(shared)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(3)
    return "\n".join(f"--- worker pid {pid} ---\n" + _read(shared / f"stacks.{pid}.txt")
                     for pid in pids)


def _read(f: Path) -> str:
    try:
        return f.read_text(errors="replace")
    except OSError:
        return "(no stacks written)"


STORY = re.compile(r"elastic_train .*: (starts|trains|exits|done)|hvd_sparse: (join|\d+ red)|"
                   r"Error|error|Exception|exit with|blacklist|Terminated|terminate|Aborted")


def story(out: str) -> str:
    """What a failure message shows of the job: what each rank did and every error line,
    then the output's tail (all of it is in horovodrun.log, in the test's folder)."""
    lines = [ln[:300] for ln in (out or "").splitlines() if STORY.search(ln)]
    return "\n".join(lines[:150]) + "\n----- the output's end -----\n" + (out or "")[-3000:]


def _stop_leftovers(p: subprocess.Popen, shared: Path) -> None:
    """Whatever of the job still runs (a worker, an aggregator) is killed."""
    if p.poll() is None:
        _stop(p, shared)
    else:
        marker = f"{OUT_VAR}={shared}".encode() + b"\0"
        for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
            try:
                if marker in Path(f"/proc/{pid}/environ").read_bytes():
                    os.kill(pid, 9)
            except OSError:
                pass


def check_job(results: list[dict], out: str) -> None:
    """Four ranks at the end, the same parameters on each, the loss fallen, the job shrunk to
    two and grown back."""
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3], story(out)
    assert all(r["size"] == 4 for r in results)
    assert all(r["identical"] for r in results) and len({r["digest"] for r in results}) == 1
    for r in results:
        assert isinstance(r["last_loss"], float) and math.isfinite(r["last_loss"]), r
        assert r["last_loss"] < 0.9 * r["first_loss"], r
    survivors = [r for r in results if 2 in r["sizes"]]
    assert len(survivors) == 2 and all(4 in r["sizes"] for r in survivors), results
    # the job restored a commit or reset after a change of hosts each time the training
    # function started again: the sparsifier's memory was the last commit's every time
    assert all(all(r["rolled_back"]) for r in results), results
    assert all(len(r["rolled_back"]) >= 3 for r in survivors), results  # start, 4->2, 2->4


def check_rejoined(out: str) -> None:
    """hvd_sparse joined the two ranks left, then the four again, by itself."""
    assert len(re.findall(r"hvd_sparse: joined as rank \d of 2 ", out)) >= 2, story(out)
    assert re.search(r"joined as rank \d of 4 \(join [2-9]", out), story(out)


OMNI = {"fc.weight": "omnireduce", "emb.weight": "rows+omnireduce"}
# a crashed worker is seen at a timeout: Gloo's, or the aggregators' (hvd_sparse's)
CRASH = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "30", "HVD_SPARSE_TIMEOUT": "30"}
VARIANTS = [  # (the script's arguments, the schemes expected of some tensors, environment)
    pytest.param(("--scheme", "auto"), {}, {}, id="auto"),
    pytest.param(("--scheme", "omnireduce"), OMNI, {}, id="omnireduce"),
    pytest.param(("--scheme", "allgather"), {"fc.weight": "allgather", "emb.weight": "rows"}, {},
                 id="allgather", marks=pytest.mark.extended),
    pytest.param(("--scheme", "omnireduce", "--sparsifier", "topk:0.05"),
                 {"fc.weight": "omnireduce"}, {}, id="topk-omnireduce",
                 marks=pytest.mark.extended),
    pytest.param(("--scheme", "auto", "--sparsifier", "exdyna:0.01"), {}, {}, id="exdyna-auto",
                 marks=pytest.mark.extended),
    # rank 0 leaves: the job's aggregators (on its host) go with it, the other host's ranks
    # start their own
    pytest.param(("--scheme", "omnireduce", "--fail-rank", "0"), OMNI, {},
                 id="omnireduce-rank0-leaves", marks=pytest.mark.extended),
    # the worker crashes (no Horovod shutdown): the others fail at a timeout, then recover
    pytest.param(("--scheme", "omnireduce", "--crash"), OMNI, CRASH, id="omnireduce-crash",
                 marks=pytest.mark.extended),
    # hvd.DistributedOptimizer with Compression.sparse: its dense gradients are hvd_sparse's
    pytest.param(("--optimizer", "compression", "--scheme", "omnireduce"),
                 {"grad.fc.weight": "omnireduce"}, {}, id="compression-omnireduce",
                 marks=pytest.mark.extended),
]


@pytest.mark.parallel
@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("args,schemes,env", VARIANTS)
def test_hvd_sparse_survives_a_worker_leaving_and_the_job_growing_back(
        tmp_path: Path, cache_dir: Path, args: tuple[str, ...], schemes: dict[str, str],
        env: dict[str, str]) -> None:
    optimizer = () if "--optimizer" in args else ("--optimizer", "hvd_sparse")
    results, out = run_elastic(tmp_path, cache_dir, *optimizer, *args, env=env)
    check_job(results, out)
    check_rejoined(out)
    for r in results:
        assert {n: r["schemes"].get(n) for n in schemes} == schemes, r


@pytest.mark.parallel
@pytest.mark.extended
@pytest.mark.timeout(TIMEOUT + 60)
def test_horovod_optimizer_does_the_same(tmp_path: Path, cache_dir: Path) -> None:
    """The reference: Horovod's own optimizer in the same job passes the same checks."""
    results, out = run_elastic(tmp_path, cache_dir, "--optimizer", "horovod")
    check_job(results, out)


@pytest.mark.parallel
@pytest.mark.extended
@pytest.mark.timeout(TIMEOUT + 60)
def test_dedicated_aggregators_are_joined_again(tmp_path: Path, cache_dir: Path) -> None:
    """Configured aggregators (here one of any job size, started by the test, on loopback
    without authentication) outlive the job's resets: each join registers anew with them."""
    from hvd_sparse.aggregator import LocalAggregators

    (tmp_path / "agg").mkdir()
    agg = LocalAggregators(1, 0, "127.0.0.1", log_dir=str(tmp_path / "agg"))
    try:
        env = {"HVD_SPARSE_AGGREGATORS": f"127.0.0.1:{agg.ports[0]}", "HVD_SPARSE_AUTH": "0"}
        results, out = run_elastic(tmp_path, cache_dir, "--optimizer", "hvd_sparse",
                                   "--scheme", "omnireduce", env=env)
        assert agg.procs[0].poll() is None, "the aggregator must outlive the job's resets"
    finally:
        agg.stop()
    check_job(results, out)
    check_rejoined(out)
    for r in results:
        assert {n: r["schemes"].get(n) for n in OMNI} == OMNI, r
