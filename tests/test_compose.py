"""The compose cluster for real: docker/'s two images built (docker's layer cache keeps a
rebuild to seconds), 4 worker containers and 1 aggregator container at 1 Gbit/s, a horovodrun
job across the containers checked against Horovod's float64 allreduce, authenticated with the
cluster's secret; then nothing left behind: no container, network or volume, and the Docker
engine this test started stopped with the host's network as it was (scripts/testbed/dockerd.py).
Skipped, with the reason, where Docker cannot run (not root, no docker.io package)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

TESTBED = Path(__file__).resolve().parents[1] / "scripts" / "testbed"


def script(name: str) -> ModuleType:
    """scripts/testbed/``name``.py as a module: a script beside its siblings, not in a package,
    so loaded by its path (registered first: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, TESTBED / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


compose, dockerd = script("compose"), script("dockerd")
PY = sys.executable
DOCKERD = str(TESTBED / "dockerd.py")
# The engine fixture's waits are bounded by their own timeouts (dockerd's start, the build's
# BUILD_TIMEOUT_S): a cold image build compiles Horovod and the extension and outlasts
# pytest's default of 600 s, which counts a module fixture's setup into its first test.
pytestmark = pytest.mark.timeout(1800 + compose.BUILD_TIMEOUT_S + 900)


def host_network() -> dict:
    """What dockerd may change in the root namespace, as this test checks it is restored."""
    return {"sysctls": dockerd.read_sysctls(), "iptables": dockerd.iptables_dump("iptables"),
            "links": [n for n in dockerd.links() if n == "docker0" or n.startswith("br-")]}


@pytest.fixture(scope="module")
def engine():
    """A Docker engine for this module, and both images built; what this started, stopped."""
    if os.geteuid() != 0:
        pytest.skip("the compose cluster needs root (dockerd, NET_ADMIN containers)")
    before = host_network()
    started = subprocess.run([PY, DOCKERD, "start"],
                             capture_output=True, text=True, timeout=1800)
    if started.returncode != 0:
        pytest.skip(f"no Docker engine can run here: {started.stderr.strip()[-600:]}")
    try:
        seconds = compose.build()
        print(f"images built in {seconds:.0f} s")
        yield
    finally:
        stop = subprocess.run([PY, DOCKERD, "stop"],
                              capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        if json.loads(subprocess.run([PY, DOCKERD, "status"],
                                     capture_output=True, text=True).stdout)["users"] == 0:
            assert host_network() == before, "dockerd's changes to the host were not undone"


def test_compose_job_against_dense_reference(engine):
    res = compose.run("python /opt/hvd-sparse/scripts/testbed/cluster_job.py --numel 1048576 "
                      "--reps 2",
                      project=f"hvdsc{os.getpid()}", timeout=600)
    assert res.leftovers == [], res.leftovers
    assert res.returncode == 0, res.output[-6000:]
    lines = [ln for ln in res.output.splitlines() if "cluster_job: " in ln]
    assert lines, res.output[-6000:]
    job = json.loads(lines[-1].split("cluster_job: ", 1)[1])
    assert job["ranks"] == 4 and job["bad"] == []
    paths = {r["path"] for r in job["rows"]}
    assert paths == {"horovod", "dense", "allgather", "omnireduce"}
    # Bytes crossed each container's capped link; the aggregator took the omnireduce rounds,
    # every packet authenticated with the cluster's secret (none dropped as unauthenticated).
    assert all(r["bytes"] > 0 for r in job["rows"]), job["rows"]
    agg = res.aggregator
    assert agg.get("jobs", 0) >= 1 and agg["rounds"] > 0 and agg["rx_packets"] > 0, agg
    assert agg["unauthenticated"] == 0 and agg["bad_mac"] == 0 and agg["replayed"] == 0, agg


def test_compose_failing_job_leaves_nothing(engine):
    """A job that fails: its exit status comes back, and the teardown is as complete."""
    res = compose.run("python -c 'import sys; sys.exit(3)'", project=f"hvdsf{os.getpid()}",
                      timeout=300)
    assert res.returncode != 0
    assert res.leftovers == [], res.leftovers
