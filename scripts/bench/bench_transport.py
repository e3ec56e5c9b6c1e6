"""The aggregator's transports side by side: kernel UDP sockets vs DPDK (af_packet vdev), with
and without packet authentication, on the netns testbed (4 worker hosts, 1 aggregator host,
veth links, MTU 9000). Needs root.

    .venv/bin/python scripts/bench/bench_transport.py [--numel 4194304] [--densities 0.01,1.0]
        [--transports udp,dpdk] [--auth on,off] [--rate 34gbit]

For each transport and authentication setting the script brings a testbed up with that
aggregator, then:

* goodput: 4 worker processes (one per worker host, ``_C.OmniWorker`` on kernel sockets, no
  Horovod) reduce --numel float32 with whole 256-blocks non-zero at random; per density, the
  median over --reps of the slowest worker's time, the blocks the aggregator summed per second
  (every worker's non-zero blocks) and those blocks in GB/s;
* raw limit: 4 blasters (hvd-sparse-udpblast --to, one per worker host) send datagrams of a
  full DATA packet's size at the same aggregator for --seconds; what its transport received
  per second (its counters) is the path's limit, with the protocol doing nothing but reject
  them by their magic.

--rounds times per transport, alternated (medians reported, each round's time listed: the
box is shared and noisy). First, the MAC's cost on one core: GMAC signing and verifying rates
for 1, 8 and 64 KiB packets against 10 and 100 Gbit/s. Writes bench_results/transport.json and
transport.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hvd_sparse import protocol

ROOT = Path(__file__).resolve().parents[2]

BS = 256
TOKEN = 0xBE4C
PAYLOAD = 8192  # 8 blocks of float32 per packet: a DATA datagram fits one 9000-byte frame
DATAGRAM = (protocol.HEADER_BYTES + protocol.BITMAP_BYTES + 8 * protocol.LANE_BYTES  # a full DATA
            + PAYLOAD)


def rank_side(a: argparse.Namespace) -> None:
    import torch

    from hvd_sparse import _C

    host, port = a.agg.split(":")
    w = _C.OmniWorker([(host, int(port))], TOKEN, a.rank, a.workers, payload_bytes=PAYLOAD,
                      timeout=60.0, key=bytes.fromhex(a.key))
    w.register(30.0)
    g = torch.Generator().manual_seed(a.rank + 1)
    keep = torch.rand(a.numel // BS, generator=g) < a.density
    x = (torch.randn(a.numel // BS, BS, generator=g) * keep[:, None]).view(-1)
    out = torch.zeros_like(x)
    times = []
    for rep in range(a.reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        ticket = w.submit(rep + 1, x, out, BS, 1, None, "x", 1.0)
        assert w.wait(ticket, 60.0), "timed out"
        w.finish(ticket)
        times.append(time.perf_counter() - t0)
    w.close()
    Path(a.out).write_text(json.dumps({"times": times[1:], "nnz_blocks": int(keep.sum())}))


def measure(transport: str, auth: bool, a: argparse.Namespace, progress, task) -> list[dict]:
    from hvd_sparse import auth as keys
    from hvd_sparse.aggregator import BINARY
    from hvd_sparse.tools.testbed import launch, lifecycle, topology

    tb = lifecycle.up(topology.Testbed("hvbt", workers=4, aggregators=1, rate=a.rate, mtu=9000,
                                       transport=transport, auth=auth))
    rows = []
    try:
        agg = tb.aggregator_addresses()
        key = keys.job_key(keys.read_secret_file(tb.secret_file()), TOKEN).hex() if auth else ""
        blaster = BINARY.parent / "hvd-sparse-udpblast"
        before = launch.counters(tb, "a0")
        procs = [subprocess.Popen(["ip", "netns", "exec", h.ns, str(blaster), "--to", agg,
                                   "--senders", "1", "--bytes", str(DATAGRAM), "--seconds",
                                   str(a.seconds)]) for h in tb.worker_hosts]
        for p in procs:
            p.wait(timeout=a.seconds + 30)
        time.sleep(0.2)
        after = launch.counters(tb, "a0")
        raw = (after["rx_bytes"] - before["rx_bytes"]) / a.seconds
        progress.advance(task)
        for density in a.densities:
            outs = [Path(f"/tmp/hvbt-{transport}-{auth}-{density}-{r}.json") for r in range(4)]
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
            procs = [subprocess.Popen(
                ["ip", "netns", "exec", h.ns, sys.executable, __file__, "--rank-side",
                 "--rank", str(r), "--workers", "4", "--agg", agg, "--numel", str(a.numel),
                 "--density", str(density), "--reps", str(a.reps), "--out", str(outs[r]),
                 "--key", key],
                env=env) for r, h in enumerate(tb.worker_hosts)]
            for p in procs:
                if p.wait(timeout=600) != 0:
                    raise RuntimeError(f"{transport} auth={auth} {density}: a worker failed")
            res = [json.loads(o.read_text()) for o in outs]
            t = statistics.median(max(r["times"][i] for r in res) for i in range(a.reps))
            blocks = sum(r["nnz_blocks"] for r in res)
            rows.append({"transport": transport, "auth": "on" if auth else "off",
                         "density": density, "time ms": 1e3 * t,
                         "blocks summed/s (M)": blocks / t / 1e6,
                         "summed GB/s": blocks * BS * 4 / t / 1e9,
                         "raw limit GB/s": raw / 1e9,
                         "of raw": blocks * BS * 4 / t / raw if raw else float("nan")})
            progress.advance(task)
    finally:
        lifecycle.down("hvbt")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=4 * 1024 * 1024)
    p.add_argument("--densities", default="0.01,1.0")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seconds", type=float, default=3.0, help="blaster duration")
    p.add_argument("--rate", default="34gbit", help="link cap (default: tbf's highest)")
    p.add_argument("--transports", default="udp,dpdk")
    p.add_argument("--auth", default="on,off", help="packet authentication: on, off or both")
    p.add_argument("--rounds", type=int, default=3, help="testbeds per transport, alternated")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench_results")
    p.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--agg", help=argparse.SUPPRESS)
    p.add_argument("--density", type=float, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--key", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_side:
        return rank_side(a)
    a.densities = [float(x) for x in a.densities.split(",")]
    from rich.progress import Progress

    from hvd_sparse.tools.lab.report import print_table, save_png, write_json

    transports = a.transports.split(",")
    auths = [x == "on" for x in a.auth.split(",")]
    from hvd_sparse import _C
    mac = []
    for size in (1024, 8192, 65536):
        sign, verify = _C.gmac_rate(size, 0.5)
        mac.append({"packet bytes": size, "sign Gbit/s": sign * 8 / 1e9,
                    "verify Gbit/s": verify * 8 / 1e9,
                    "cores for 10 Gbit/s": 10e9 / 8 / min(sign, verify),
                    "cores for 100 Gbit/s": 100e9 / 8 / min(sign, verify)})
    print_table(mac, "AES-128-GMAC on one core (OpenSSL): sign and verify rates")
    runs: list[dict] = []
    with Progress() as progress:
        task = progress.add_task("transports", total=a.rounds * len(transports) * len(auths)
                                 * (1 + len(a.densities)))
        for _ in range(a.rounds):  # alternated, so that load on the box hits both alike
            for tr in transports:
                for au in auths:
                    runs += measure(tr, au, a, progress, task)
    rows = []
    for tr in transports:
        for au in ("on" if x else "off" for x in auths):
            for density in a.densities:
                same = [r for r in runs if r["transport"] == tr and r["auth"] == au
                        and r["density"] == density]
                row = {k: statistics.median(r[k] for r in same) for k in same[0]
                       if k not in ("transport", "auth", "density")}
                rows.append({"transport": tr, "auth": au, "density": density, **row,
                             "time ms (each round)": " ".join(f"{r['time ms']:.0f}"
                                                              for r in same)})
    print_table(rows, f"aggregator transports: 4 kernel-UDP workers, {a.numel:,} float32, "
                f"veth between namespaces at {a.rate}, MTU 9000, {os.cpu_count()} cores, "
                f"median of {a.rounds} rounds")
    out = write_json(a.out_dir / "transport.json", rows, args={**vars(a), "out_dir": None},
                     runs=runs, mac=mac)

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['transport']} {r['auth']}\n{r['density']:g}" for r in rows]
    ax.bar([i - 0.2 for i in range(len(rows))], [r["summed GB/s"] for r in rows], 0.4,
           label="blocks summed (GB/s)")
    ax.bar([i + 0.2 for i in range(len(rows))], [r["raw limit GB/s"] for r in rows], 0.4,
           label="raw limit of the path (GB/s)")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("GB/s")
    ax.set_title("aggregator goodput (transport, authentication, density)")
    ax.legend()
    png = save_png(fig, a.out_dir / "transport.png")
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
