"""Aggregator failures on 4 ranks: a killed aggregator is an error naming it on every rank, or,
with fallback="dense", a correct dense result; killing rank 0 takes its aggregators with it.

argv[1]: "kill-aggregator" or "kill-rank0". Run with HVD_SPARSE_TIMEOUT set low.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from common import case, close_to, report, start

import hvd_sparse
from hvd_sparse import basics

NUMEL = 1 << 22


def data() -> torch.Tensor:
    g = torch.Generator().manual_seed(hvd.rank())
    return torch.randn(NUMEL, generator=g) * (torch.rand(NUMEL, generator=g) < 0.3)


def kill_mid_flight(name: str, inplace: bool) -> torch.Tensor:
    """Ranks 1.. start reducing `name`; rank 0 kills the aggregator once they have, then joins:
    the aggregator dies with the reduction in flight on every peer."""
    t = data()
    if hvd.rank() != 0:
        h = (hvd_sparse.allreduce_async_(t, name=name, scheme="omnireduce") if inplace else
             hvd_sparse.allreduce_async(t, name=name, scheme="omnireduce"))
    hvd.allreduce(torch.zeros(1), name=f"barrier.{name}")
    if hvd.rank() == 0:
        basics.state().omni.local.procs[0].send_signal(signal.SIGKILL)
        h = (hvd_sparse.allreduce_async_(t, name=name, scheme="omnireduce") if inplace else
             hvd_sparse.allreduce_async(t, name=name, scheme="omnireduce"))
    return hvd_sparse.synchronize(h)


def main() -> None:
    mode = sys.argv[1]
    start(probe="off")
    results: dict[str, object] = {}
    timeout = basics.state().config.timeout
    if mode == "kill-rank0":
        if hvd.rank() == 0:
            pids = [p.pid for p in basics.state().omni.local.procs]
            Path(os.environ["HVD_SPARSE_TEST_OUT"], "aggregator_pids.json").write_text(
                json.dumps(pids))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # horovodrun ends the job once rank 0 is gone
        return

    ref = hvd.allreduce(data().double(), name="ref")

    def killed() -> str:
        t0 = time.monotonic()
        try:
            kill_mid_flight("killed", inplace=False)
            return "no error after the aggregator was killed"
        except hvd_sparse.HvdSparseError as e:
            took = time.monotonic() - t0
            port = basics.state().omni.addrs[0][1]
            if f"127.0.0.1:{port}" not in str(e) or "'killed'" not in str(e):
                return f"error does not name the aggregator and tensor: {e}"
            return "" if took < timeout + 10 else f"took {took:.1f}s"

    case(results, "killed-aggregator-error", killed)

    # fallback="dense": the same failure ends in the dense result on every rank.
    hvd_sparse.init(probe="off", fallback="dense")
    case(results, "killed-aggregator-fallback",
         lambda: close_to(kill_mid_flight("fallback", inplace=False), ref, torch.float32))
    hvd_sparse.init(probe="off", fallback="dense")
    case(results, "killed-aggregator-fallback-inplace",
         lambda: close_to(kill_mid_flight("fallback.inplace", inplace=True), ref, torch.float32))
    report(results)


if __name__ == "__main__":
    main()
