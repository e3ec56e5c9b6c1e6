"""One worker of a raw job aggregated in the emulated switch (tests/test_switch_emu.py): the
protocol simulation of test_aggregator_core (independent of the C++ worker engine) over a real
UDP socket, FIXED32 values, a per-slot RELEASE after each slot's last result. Writes whether
its result equals numpy's int64 sum.

    python switch_raw.py RANK WORKERS SWITCH_IP:PORT OUT.json [TOKEN]
"""
from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_switch_pipeline import fixed_job  # noqa: E402

from hvd_sparse import protocol  # noqa: E402
from hvd_sparse.tools import wire  # noqa: E402

T = protocol.TYPES


def main() -> None:
    rank, n, (host, port), out = (int(sys.argv[1]), int(sys.argv[2]),
                                  sys.argv[3].split(":"), sys.argv[4])
    token = int(sys.argv[5]) if len(sys.argv) > 5 else 0x5A17
    switch = (host, int(port))
    # one lane of 64 values per packet: what one switch pass sums
    ws, ref = fixed_job(n, 50_000, 64, 1, 8, 0.3, seed=token % 1000, token=token)
    w = ws[rank]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(0.1)
    deadline = time.monotonic() + 30
    acked = False
    while not acked and time.monotonic() < deadline:  # the first REGISTER may wait for ARP
        s.sendto(wire.header(type=T["REGISTER"], token=token, worker=rank, nworkers=n), switch)
        try:
            acked = wire.parse(s.recv(100))["type"] == T["REGACK"]
        except TimeoutError:
            pass
    time.sleep(0.3)  # every worker registered: results have all their addressees
    pending = range(w.nslots)
    while not all(w.done) and time.monotonic() < deadline:
        for slot in pending:
            if not w.done[slot]:
                s.sendto(w.data(slot), switch)
        pending = []
        try:
            p = wire.parse(s.recv(65536))
        except TimeoutError:
            pending = range(w.nslots)  # the retransmission timer
            continue
        if (nxt := w.on_result(p)) is not None:
            s.sendto(nxt, switch)
        if p["type"] == T["RESULT"] and p["flags"] & protocol.FLAGS["LAST"]:
            s.sendto(wire.header(type=T["RELEASE"], token=token, worker=rank, nworkers=n,
                                 tensor=w.tensor, slot=p["slot"], nslots=w.nslots), switch)
    exact = all(w.done) and np.array_equal(w.result()[:ref.size].astype(np.int64), ref)
    Path(out).write_text(json.dumps({"done": all(w.done), "exact": bool(exact),
                                     "nslots": w.nslots}))


if __name__ == "__main__":
    main()
