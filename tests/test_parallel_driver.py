"""The parallel driver's verdict (tests/parallel/driver.py) on made-up rank reports: every test
must pass on every rank, a skip is no pass, root causes come first, a rank that ended by design
is no failure, LAUNCHES is read without importing the module."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "parallel"))
from driver import Launch, Outcome, launches  # noqa: E402

M = "tests/parallel/test_x.py"
TESTS = [f"{M}::test_{c}" for c in "abc"]


def events(outcomes: dict[str, str], ends: dict | None = None, finish: bool = True,
           longrepr: dict[str, str] | None = None) -> list[dict]:
    """One rank's events: each test in ``outcomes`` started and reported as given ("hung": started
    only); tests not in it never started."""
    evs: list[dict] = [{"event": "collected", "tests": TESTS, "ends": ends or {}}]
    for t in TESTS:
        o = outcomes.get(t.split("::test_")[1])
        if o is None:
            continue
        evs.append({"event": "start", "test": t})
        if o == "hung":
            continue
        text = (longrepr or {}).get(t.split("::test_")[1], f"E   AssertionError: {t} {o}")
        for when in ("setup", "call", "teardown"):
            evs.append({"event": "report", "test": t, "when": when,
                        "outcome": o if when == "call" else "passed", "duration": 0.0,
                        "props": {}, "longrepr": text if when == "call" else ""})
    if finish:
        evs.append({"event": "finish", "exitstatus": 0})
    return evs


def outcome(ranks: dict[int, list[dict]], rc: int = 0, hung: bool = False,
            stdout: str = "[0]<stdout>: out") -> Outcome:
    proc = subprocess.CompletedProcess(["horovodrun"], rc, stdout, "err")
    return Outcome(Path(M), Launch(np=2), ranks, proc, hung, 1.0, Path("/tmp/x"))


PASS = {"a": "passed", "b": "passed", "c": "passed"}


def test_all_passed_on_every_rank_is_a_pass():
    assert outcome({0: events(PASS), 1: events(PASS)}).message() == ""


def test_a_skip_under_the_launcher_is_a_failure():
    fails, _ = outcome({0: events(PASS), 1: events({**PASS, "b": "skipped"})}).failures()
    assert [(f.rank, f.test) for f in fails] == [(1, TESTS[1])]
    assert "a skip never passes" in fails[0].headline


def test_root_cause_first_and_peers_that_saw_horovod_shut_down_last():
    shut = "E   HorovodInternalError: Horovod has been shut down"
    r0 = events({**PASS, "a": "failed", "b": "failed"}, longrepr={"a": shut, "b": shut})
    r1 = events({"a": "passed", "b": "failed", "c": "hung"}, finish=False)
    fails, _ = outcome({0: r0, 1: r1}, rc=1).failures()
    assert [(f.rank, f.test.split("::")[1]) for f in fails] == [
        (1, "test_b"), (1, "test_c"), (0, "test_a"), (0, "test_b")]
    msg = outcome({0: r0, 1: r1}, rc=1).message()
    assert msg.index("AssertionError") < msg.index("Horovod has been shut down")
    assert "launcher" in msg  # a test that never finished: the launcher's output is shown


def test_a_rank_stopped_by_the_per_test_timeout_says_so():
    r1 = events({"a": "passed", "b": "hung"}, finish=False)
    timeout = "[1]<stdout>:" + "+" * 35 + " Timeout " + "+" * 36
    fails, _ = outcome({0: events(PASS), 1: r1}, rc=1, stdout=timeout).failures()
    assert [(f.rank, f.test) for f in fails][:1] == [(1, TESTS[1])]
    assert fails[0].headline.startswith("timed out after 270 s"), fails[0].headline
    fails, _ = outcome({0: events(PASS), 1: r1}, rc=1).failures()
    assert "rank died" in fails[0].headline


def test_a_rank_that_reports_nothing_fails_the_launch():
    _, problems = outcome({0: events(PASS)}, rc=1).failures()
    assert any("[1]" in p and "reported nothing" in p for p in problems)


def test_a_nonzero_launcher_exit_fails_a_clean_looking_launch():
    _, problems = outcome({0: events(PASS), 1: events(PASS)}, rc=1).failures()
    assert problems == ["every test passed but the launcher exited 1"]


def test_ranks_that_collected_other_tests_fail():
    r1 = events(PASS)
    r1[0] = {**r1[0], "tests": TESTS[:2]}
    _, problems = outcome({0: events(PASS), 1: r1}).failures()
    assert any("collected other tests" in p for p in problems)


def test_a_rank_that_leaves_by_design_is_no_failure():
    ends = {TESTS[1]: {"rank": 1, "job": False}}
    r1 = events({"a": "passed", "b": "hung"}, ends=ends, finish=False)
    assert outcome({0: events(PASS, ends=ends), 1: r1}).message() == ""
    # ...but the rank that stays must still pass what follows
    r0 = events({**PASS, "c": "failed"}, ends=ends)
    fails, _ = outcome({0: r0, 1: r1}).failures()
    assert [(f.rank, f.test) for f in fails] == [(0, TESTS[2])]


def test_a_job_ended_by_design_ignores_the_launchers_status():
    ends = {TESTS[2]: {"rank": 0, "job": True}}
    r0 = events({"a": "passed", "b": "passed", "c": "hung"}, ends=ends, finish=False)
    r1 = events({"a": "passed", "b": "passed", "c": "hung"}, ends=ends, finish=False)
    assert outcome({0: r0, 1: r1}, rc=1).message() == ""


def test_launches_are_read_without_importing_the_module(tmp_path):
    mod = tmp_path / "test_m.py"
    mod.write_text("import no_such_module\nLAUNCHES = [Launch(np=4, env={'A': '1'}),\n"
                   "            Launch('mpirun', np=2, id='x', args=('-k', 'y'))]\n")
    assert launches(mod) == [Launch(np=4, env={"A": "1"}),
                             Launch("mpirun", np=2, id="x", args=("-k", "y"))]
    assert [la.name for la in launches(mod)] == ["gloo-np4", "x"]
