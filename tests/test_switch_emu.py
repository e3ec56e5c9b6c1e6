"""switch_emu's switch as the testbed's switch (``--switch emu``): it owns one DPDK port per
host and forwards by MAC learning, so MPI and the aggregation traffic cross it as they would a
Linux bridge. Needs root and DPDK (make build installs libdpdk-dev): both hold in CI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from pyroute2 import NetNS
from test_testbed import leftovers

from hvd_sparse.testbed import launch, lifecycle, topology

NAME = f"hve{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def testbed():
    tb = lifecycle.up(topology.Testbed(NAME, workers=2, aggregators=1, rate="1gbit", mtu=9000,
                                       switch="emu"))
    try:
        yield tb
    finally:
        lifecycle.down(NAME)
        assert leftovers(NAME) == []
        assert not tb.log_dir().exists()


def test_jobs_cross_the_emulated_switch(testbed: topology.Testbed, tmp_path: Path) -> None:
    with NetNS(testbed.switch_ns) as sw:  # no bridge: the emulator is the only path
        assert not sw.link_lookup(ifname="br0")
    before = launch.counters(testbed, "switch")
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'mp'}", "HVD_SPARSE_TEST_OUT": str(tmp_path),
           "HVD_SPARSE_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    try:
        proc = launch.run(testbed, [sys.executable, str(ROOT / "tests/mp/switch_cases.py")],
                          env=env, timeout=300, capture=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"job through the emulated switch hung past 300 s:\n{(e.stdout or '')[-3000:]}")
    for r in range(testbed.workers):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no report:\n{proc.stdout[-3000:]}"
        assert json.loads(path.read_text())["schemes"] == "", path.read_text()
    after = launch.counters(testbed, "switch")
    ports = {p["name"]: p for p in after["ports"]}
    assert sorted(ports) == sorted(h.name for h in testbed.hosts)
    for b in before["ports"]:  # every host's traffic went through the switch
        assert ports[b["name"]]["rx"] - b["rx"] > 100, (b, ports[b["name"]])
        assert ports[b["name"]]["tx"] - b["tx"] > 100, (b, ports[b["name"]])
    assert after["macs"] >= len(testbed.hosts)


def test_loss_is_refused_on_the_emulated_switch(testbed: topology.Testbed) -> None:
    with pytest.raises(ValueError, match="not supported yet"):
        lifecycle.update(topology.Testbed.load(NAME), loss_rate=0.01)
    assert topology.Testbed.load(NAME).loss == 0.0
