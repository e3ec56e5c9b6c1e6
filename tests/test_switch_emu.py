"""switch_emu's switch as the testbed's switch (``--switch emu``): it owns one DPDK port per
host and forwards by MAC learning, so MPI and the aggregation traffic cross it as they would a
Linux bridge. Needs root and DPDK (make build installs libdpdk-dev): both hold in CI."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from pyroute2 import NetNS
from test_testbed import run_job, running

from hvd_sparse.testbed import launch, lifecycle, topology

NAME = f"hve{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def testbed():
    with running(topology.Testbed(NAME, workers=2, aggregators=1, rate="1gbit", mtu=9000,
                                  switch="emu")) as tb:
        yield tb


def test_jobs_cross_the_emulated_switch(testbed: topology.Testbed, tmp_path: Path) -> None:
    with NetNS(testbed.switch_ns) as sw:  # no bridge: the emulator is the only path
        assert not sw.link_lookup(ifname="br0")
    before = launch.counters(testbed, "switch")
    for rep in run_job(testbed, "switch_cases.py", tmp_path):
        assert rep["schemes"] == "", rep
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
