"""Regenerates the seed corpora (fuzz/corpus/NAME), from real traffic and real run files:

- the packet decoders' and the dissector's: exchanges between worker engines and aggregator
  cores or a switch pipeline, recorded by fuzz/seeds.cpp (built here with the system compiler);
- protocol_header: single datagrams of those exchanges, one per type, with and without a
  trailer; dpdk_frames: Ethernet frames that carry them (IPv4 with and without options, a
  fragment, padding) and ARP;
- run_file and run_analysis: the run files of a real 2-rank Horovod job (`--job`; else the
  committed ones are kept), and variants of a reader's edge (version 1, no records);
- config_env: a few environments of the documented options.

Then each corpus is minimized with libFuzzer's -merge=1 (fuzz/run.py --merge: the clang builds
and atheris), keeping the reproducers of findings (regress-*) as they are.

    python fuzz/seeds.py [--job]
"""
from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import targets
from pyharness import datagrams

ROOT = targets.ROOT
SEEDS_BIN = ROOT / "build" / "fuzz-seeds" / "seeds"
RUN_JOB = r"""
import sys, torch, horovod.torch as hvd, hvd_sparse
hvd.init()
hvd_sparse.init(metrics_file=sys.argv[1], probe="off", link_rate="1gbit", block_size=64,
                metrics_records=50)
g = torch.Generator().manual_seed(hvd.rank())
for step in range(3):
    for name, scheme, density in (("ag", "allgather", 0.05), ("zen", "zen", 0.1),
                                  ("omni", "omnireduce", 0.05), ("dense", "dense", 1.0),
                                  ("auto", "auto", 0.02)):
        keep = (torch.rand(300, generator=g) < density).repeat_interleave(64)
        hvd_sparse.allreduce(torch.randn(64 * 300, generator=g) * keep, name=name, scheme=scheme)
emb = torch.nn.EmbeddingBag(500, 8, mode="sum", sparse=True)
opt = hvd_sparse.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                      named_parameters=emb.named_parameters())
for step in range(2):
    opt.zero_grad()
    emb(torch.randint(0, 500, (16, 3), generator=g)).sum().backward()
    opt.step()
hvd_sparse.shutdown()
"""
CONFIGS = [
    "timeout=60\nscheme=omnireduce\naggregators=10.0.0.1:9999,10.0.0.2:9999\n",
    "link_rate=10gbit\nports=20000-20100\nauth=0\nfixed_point=true\n",
    "block_size=64\nslots=8\nrto=0.01\nlog_level=DEBUG\nswitch=10.0.0.9:9999\n",
    "scheme=switch\nswitch_control=/run/switch.sock\nswitch_fixed_float64=on\nprobe=off\n",
    "aggregator_layout=colocated\nlocal_aggregators=2\nfallback=dense\nmetrics_records=10\n",
]


def exchanges(raw: Path) -> None:
    """fuzz/seeds.cpp's recordings into raw/NAME."""
    SEEDS_BIN.parent.mkdir(parents=True, exist_ok=True)
    srcs = ["fuzz/seeds.cpp", "csrc/omni/aggregator/core.cpp", "csrc/switch/pipeline.cpp",
            "csrc/omni/worker/engine.cpp", "csrc/omni/auth.cpp"]
    subprocess.run(["g++", *targets.CXXFLAGS, *srcs, "-o", str(SEEDS_BIN), "-lcrypto"],
                   cwd=ROOT, check=True)
    for d in ("aggregator_core", "switch_pipeline", "worker_engine", "dissector"):
        (raw / d).mkdir(parents=True)
    subprocess.run([str(SEEDS_BIN), str(raw)], check=True)


def single_datagrams(raw: Path) -> list[bytes]:
    """One datagram of each type of the recorded exchanges, trailers kept where they were."""
    by_type: dict[tuple[int, bool], bytes] = {}
    for f in sorted((raw / "dissector").iterdir()):
        for _, d in datagrams(f.read_bytes()):
            if len(d) >= 56:
                by_type.setdefault((d[5], bool(d[7] & 4)), d)
    return list(by_type.values())


def checksum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f">{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def frame(payload: bytes, options: bytes = b"", padding: bytes = b"", frag: int = 0x4000,
          udp_sum: bool = True) -> bytes:
    """Ethernet/IPv4/UDP to the aggregation port: IP options, bytes after the UDP datagram
    inside the IP payload (RFC 768's length then differs from IP's), a fragment's flags."""
    src, dst = bytes([10, 0, 0, 1]), bytes([10, 0, 0, 100])
    ulen = 8 + len(payload)
    udp = struct.pack(">HHHH", 40000, 9999, ulen, 0) + payload
    if udp_sum:
        c = checksum(src + dst + struct.pack(">BBH", 0, 17, ulen) + udp) or 0xFFFF
        udp = udp[:6] + struct.pack(">H", c) + udp[8:]
    ihl = 20 + len(options)
    ip = struct.pack(">BBHHHBBH4s4s", 0x40 | ihl // 4, 0, ihl + len(udp) + len(padding), 1,
                     frag, 64, 17, 0, src, dst) + options
    ip = ip[:10] + struct.pack(">H", checksum(ip)) + ip[12:]
    return bytes(6) + bytes([2, 0, 0, 0, 0, 1]) + b"\x08\x00" + ip + udp + padding


def arp(op: int) -> bytes:
    body = struct.pack(">HHBBH6s4s6s4s", 1, 0x0800, 6, 4, op, bytes([2, 0, 0, 0, 0, 1]),
                       bytes([10, 0, 0, 1]), bytes(6), bytes([10, 0, 0, 100]))
    return b"\xff" * 6 + bytes([2, 0, 0, 0, 0, 1]) + b"\x08\x06" + body


def frames(singles: list[bytes]) -> list[bytes]:
    small = min(singles, key=len)
    return [frame(small), frame(max(singles, key=len)), frame(small, options=bytes(4)),
            frame(small, udp_sum=False), frame(small, frag=0x2000), arp(1), arp(2)]


def run_files(raw: Path, job: bool) -> None:
    """The real job's run files (``job``), else the committed ones, and edge variants."""
    out = raw / "run_file"
    out.mkdir(parents=True)
    if job:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "job.py"
            script.write_text(RUN_JOB)
            subprocess.run([str(Path(sys.executable).parent / "horovodrun"), "-np", "2",
                            sys.executable, str(script), f"{tmp}/run.{{rank}}.json"], check=True,
                           cwd=ROOT, timeout=600)
            docs = [json.loads((Path(tmp) / f"run.{r}.json").read_text()) for r in (0, 1)]
    else:
        docs = [json.loads(p.read_bytes()) for p in (targets.CORPUS / "run_file").glob("job-*")]
    if not docs:
        sys.exit("fuzz: no run files: run with --job (a 2-rank Horovod job) first")
    for i, d in enumerate(docs):
        (out / f"job-{i}").write_text(json.dumps(d))
    first = docs[0]
    v1 = {**first, "version": 1,
          "records": [{k: v for k, v in r.items() if k not in ("retransmits", "rounds")}
                      for r in first["records"][:4]]}
    (out / "version-1").write_text(json.dumps(v1))
    (out / "no-records").write_text(json.dumps({**first, "records": []}))


def write(corpus: Path, files: dict[str, bytes]) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    for name, b in files.items():
        (corpus / name).write_bytes(b)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", action="store_true", help="run files from a new 2-rank job")
    p.add_argument("--no-merge", action="store_true", help="raw seeds, not minimized")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp)
        exchanges(raw)
        singles = single_datagrams(raw)
        write(raw / "protocol_header", {f"datagram-{i}": d for i, d in enumerate(singles)})
        write(raw / "dpdk_frames", {f"frame-{i}": f for i, f in enumerate(frames(singles))})
        run_files(raw, a.job)
        shutil.copytree(raw / "run_file", raw / "run_analysis")
        write(raw / "config_env", {f"env-{i}": c.encode() for i, c in enumerate(CONFIGS)})
        for name in targets.TARGETS:
            corpus = targets.CORPUS / name
            corpus.mkdir(parents=True, exist_ok=True)
            keep = {p.name for p in corpus.iterdir() if p.name.startswith("regress-")}
            for p in corpus.iterdir():
                if p.name not in keep:
                    p.unlink()
            if a.no_merge or name in ("run_file", "run_analysis"):  # the job's files, whole
                for p in (raw / name).iterdir():
                    shutil.copy(p, corpus / p.name)
            else:
                subprocess.run([sys.executable, str(ROOT / "fuzz" / "run.py"), "--merge", name,
                                str(raw / name)], check=True, cwd=ROOT)
            print(f"{name}: {len(list(corpus.iterdir()))} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
