"""One job on the netns testbed whose aggregator host runs the DPDK transport (af_packet vdev on
its veth) while the workers use kernel sockets, launched by tests/test_dpdk.py on its testbed
(no LAUNCHES of its own):

* float32, float16, bfloat16 at densities 0 .. 1: results bit-identical to a kernel-UDP
  aggregator's (rank 0's local one, re-initialized) and close to the float64 reference;
* 1% loss on the switch (UDP): bit-identical results, retransmissions counted;
* junk datagrams fired at the DPDK aggregator during a reduction: the result stays exact (the
  test then checks the aggregator counted every one as malformed and still runs).
"""
from __future__ import annotations

import os
import random
import socket
import struct
import threading

import horovod.torch as hvd
import pytest
import torch
from ranktools import barrier, close_to, start

import hvd_sparse
from hvd_sparse import protocol
from hvd_sparse.tools.testbed import Testbed, lifecycle, loss

LAUNCHES = []  # tests/test_dpdk.py launches it on its testbed
DPDK_AGG = os.environ.get("HVD_SPARSE_AGGREGATORS", "")

NUMEL = 1 << 19
TIMEOUT = 20.0
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DENSITIES = (0.0, 1e-4, 0.01, 0.3, 1.0)
JUNK = 300


def data(seed: int, density: float, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + hvd.rank())
    keep = torch.rand(NUMEL // 256, generator=g) < density
    return (torch.randn(NUMEL // 256, 256, generator=g) * keep[:, None]).view(-1).to(dtype)


def reduce_all(tag: str) -> dict[str, torch.Tensor]:
    out = {}
    for i, dtype in enumerate(DTYPES):
        for j, density in enumerate(DENSITIES):
            key = f"{dtype}.{density}"
            out[key] = hvd_sparse.allreduce(data(10 * i + j, density, dtype), name=f"{tag}.{key}",
                                            scheme="omnireduce", op=hvd.Sum)
    return out


def init(**kw: object) -> None:
    hvd_sparse.init(probe="off", timeout=TIMEOUT, **kw)


@pytest.fixture(scope="module", autouse=True)
def hvd_sparse_started():
    start(probe="off", timeout=TIMEOUT)
    yield
    hvd_sparse.shutdown()


@pytest.fixture(scope="module")
def dpdk() -> dict[str, torch.Tensor]:
    """Every dtype and density reduced through the DPDK aggregator."""
    return reduce_all("dpdk")


def test_against_the_float64_reference(dpdk):
    bad = []
    for i, dtype in enumerate(DTYPES):
        for j, density in enumerate(DENSITIES):
            key = f"{dtype}.{density}"
            ref = hvd.allreduce(data(10 * i + j, density, dtype).double(), name=f"ref.{key}",
                                op=hvd.Sum)
            if (why := close_to(dpdk[key], ref, dtype)) != "":
                bad.append(f"{key}: {why}")
    assert bad == []


def test_same_as_a_kernel_udp_aggregator(dpdk):
    # rank 0's kernel-UDP aggregator (on several hosts the default would be one per host)
    init(aggregators="", local_aggregators=1, aggregator_layout="rank0")
    try:
        udp = reduce_all("udp")
    finally:
        init(aggregators=DPDK_AGG)
    diff = [k for k in dpdk if not torch.equal(dpdk[k], udp[k])]
    assert diff == [], f"DPDK and UDP aggregators differ on {diff}"


def test_loss_gives_identical_results(dpdk):
    tb = Testbed.load(os.environ["HVD_SPARSE_TESTBED"])
    before = hvd_sparse.basics.state().omni.worker.stats()["retransmits"]
    if hvd.rank() == 0:
        lifecycle.update(tb, loss_rate=0.01)
    barrier("loss on")
    try:
        out = reduce_all("lossy")
        barrier("lossy done")
        dropped = loss.dropped(tb)
    finally:
        barrier("loss counted")  # rank 0's update below resets the drop counters
        if hvd.rank() == 0:
            lifecycle.update(tb, loss_rate=0.0)
        barrier("loss off")
    retx = hvd.allreduce(torch.tensor(
        [hvd_sparse.basics.state().omni.worker.stats()["retransmits"] - before]),
        op=hvd.Sum, name="retx")
    assert dropped > 0 and int(retx) > 0, \
        f"loss not exercised: {dropped} frames dropped, {int(retx)} retransmissions"
    diff = [k for k in dpdk if not torch.equal(dpdk[k], out[k])]
    assert diff == [], f"results under 1% loss differ on {diff}"


def test_junk_during_a_reduction(dpdk, record_property):
    """Rank 0 fires junk datagrams at the DPDK aggregator during a reduction; tests/test_dpdk.py
    then checks the aggregator counted every one (``junk_sent``) as malformed."""
    host, port = DPDK_AGG.split(":")
    sent = [0]

    def fire() -> None:
        rng = random.Random(5)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            while sent[0] < JUNK:
                kind = sent[0] % 3
                if kind == 0:  # random bytes, any length up to a header and a bit
                    p = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 90)))
                elif kind == 1:  # a header with the wrong magic
                    p = struct.pack(">I", protocol.MAGIC ^ 1) + bytes(protocol.HEADER_BYTES - 4)
                else:  # truncated: the magic and version only
                    p = struct.pack(">IB", protocol.MAGIC, protocol.VERSION)
                s.sendto(p, (host, int(port)))
                sent[0] += 1
    t = threading.Thread(target=fire) if hvd.rank() == 0 else None
    if t:
        t.start()
    out = reduce_all("junk")
    if t:
        t.join(30)
    barrier("junk")
    record_property("junk_sent", sent[0])
    diff = [k for k in dpdk if not torch.equal(dpdk[k], out[k])]
    assert diff == [], f"results with junk differ on {diff}"
