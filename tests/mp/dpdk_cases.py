"""One job on the netns testbed whose aggregator host runs the DPDK transport (af_packet vdev on
its veth) while the workers use kernel sockets, launched by tests/test_dpdk.py:

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
import torch
from common import barrier, case, close_to, report, start

import hvd_sparse
from hvd_sparse import protocol
from hvd_sparse.tools.testbed import Testbed, lifecycle, loss

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


def main() -> None:
    dpdk_agg = os.environ["HVD_SPARSE_AGGREGATORS"]
    start(probe="off", timeout=TIMEOUT)
    results: dict[str, object] = {}
    dpdk = reduce_all("dpdk")

    def against_reference() -> str:
        bad = []
        for i, dtype in enumerate(DTYPES):
            for j, density in enumerate(DENSITIES):
                key = f"{dtype}.{density}"
                ref = hvd.allreduce(data(10 * i + j, density, dtype).double(), name=f"ref.{key}",
                                    op=hvd.Sum)
                if why := close_to(dpdk[key], ref, dtype):
                    bad.append(f"{key}: {why}")
        return "; ".join(bad)

    def same_as_udp_aggregator() -> str:
        init(aggregators="", local_aggregators=1)  # rank 0's kernel-UDP aggregator
        try:
            udp = reduce_all("udp")
        finally:
            init(aggregators=dpdk_agg)
        diff = [k for k in dpdk if not torch.equal(dpdk[k], udp[k])]
        return f"DPDK and UDP aggregators differ on {diff}" if diff else ""

    def lossy() -> str:
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
        if dropped == 0 or int(retx) == 0:
            return f"loss not exercised: {dropped} frames dropped, {int(retx)} retransmissions"
        diff = [k for k in dpdk if not torch.equal(dpdk[k], out[k])]
        return f"results under 1% loss differ on {diff}" if diff else ""

    def junk_during_a_reduction() -> str:
        host, port = dpdk_agg.split(":")
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
        results["junk_sent"] = sent[0]
        diff = [k for k in dpdk if not torch.equal(dpdk[k], out[k])]
        return f"results with junk differ on {diff}" if diff else ""

    case(results, "reference", against_reference)
    case(results, "udp_aggregator", same_as_udp_aggregator)
    case(results, "loss", lossy)
    case(results, "junk", junk_during_a_reduction)
    report(results)
    hvd_sparse.shutdown()


if __name__ == "__main__":
    main()
