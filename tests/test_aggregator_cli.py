"""The aggregator's command line: help through every entry point, bad flags, periodic stats and
stats at exit, and an aggregator whose parent (rank 0) dies exits too."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from aggregator_helpers import HOST

from hvd_sparse import aggregator

ROOT = Path(__file__).resolve().parents[1]
BINARY = aggregator.binary()


def test_cli_help():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", mod, *args, "--help"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for mod, args in (("hvd_sparse.tools.cli", ["aggregator"]),
                               ("hvd_sparse.aggregator", []))]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
        assert "--bind ADDR:PORT" in out and "--workers" in out, out
    direct = subprocess.run([str(BINARY), "--help"], capture_output=True, text=True, timeout=10)
    assert direct.returncode == 0 and "--drop-rate" in direct.stderr
    bad = subprocess.run([str(BINARY), "--bogus"], capture_output=True, text=True, timeout=10)
    assert bad.returncode == 2 and "--bogus" in bad.stderr


def test_periodic_stats_and_stats_at_exit(aggs):
    agg = aggs(2, "--stats", "0.2")
    first = agg.log.read_text().splitlines()[0]
    assert first.startswith(f"hvd-sparse aggregator listening on {HOST}:{agg.port}")
    deadline = time.monotonic() + 20
    while len(agg.stat_lines()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = agg.stat_lines()
    assert len(lines) >= 3, agg.log.read_text()
    assert {"rx_packets", "retransmits", "malformed", "injected_drops"} <= set(lines[0])
    n = len(lines)
    final = agg.stop()
    assert len(agg.stat_lines()) > n and final["rx_packets"] == 0


def test_parent_pid_exit_stops_the_aggregator(tmp_path):
    """The aggregator's parent (standing in for rank 0) is SIGKILLed: the aggregator exits."""
    pid_file = tmp_path / "agg.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([{str(BINARY)!r}, '--bind', '127.0.0.1:0', '--workers', '1',"
        " '--parent-pid', str(os.getpid())], stdout=subprocess.DEVNULL)\n"
        f"open({str(pid_file)!r} + '.tmp', 'w').write(str(p.pid))\n"
        f"os.rename({str(pid_file)!r} + '.tmp', {str(pid_file)!r})\n"
        "time.sleep(120)\n")])
    agg_pid = None
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        agg_pid = int(pid_file.read_text())
        time.sleep(0.3)
        assert process_alive(agg_pid), "the aggregator must run while its parent lives"
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while process_alive(agg_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_alive(agg_pid), "aggregator outlived its parent"
    finally:
        parent.kill()
        if agg_pid and process_alive(agg_pid):
            os.kill(agg_pid, signal.SIGKILL)


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return False


def test_local_aggregators_leave_no_directory_behind(caplog):
    """A job's local aggregators keep their port files, logs and secret in a directory of their
    own: it goes when they stop; when one had died, only its secret goes, and the warning names
    the directory with the logs."""
    clean = aggregator.LocalAggregators(2, 1, "127.0.0.1", secret=True)
    assert (clean.dir / "secret").exists() and len(clean.ports) == 2
    clean.stop()
    assert not clean.dir.exists()

    died = aggregator.LocalAggregators(2, 1, "127.0.0.1", secret=True)
    try:
        died.procs[1].kill()
        died.procs[1].wait(timeout=10)
        died.stop()
        assert (died.dir / "agg1.log").exists() and not (died.dir / "secret").exists()
        assert str(died.dir) in caplog.text and "[1]" in caplog.text
        died.stop()  # again, as at exit: the logs stay
        assert (died.dir / "agg1.log").exists()
    finally:
        died.stop()
        for f in died.dir.glob("*"):
            f.unlink()
        died.dir.rmdir()
