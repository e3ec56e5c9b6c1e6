"""The torch-free tools run on a host with neither torch nor Horovod: ``hvd-sparse aggregator``
(hvd_sparse.tools.cli -> hvd_sparse.aggregator), ``hvd_sparse.protocol`` and
``hvd_sparse.tools.wire``.

A venv of the system Python (which has no torch: asserted first) sees only this checkout
(PYTHONPATH). In it, the CLI starts a real aggregator for one worker, and a client script
speaks the protocol over a real socket: REGISTER -> REGACK, one DATA round of a small float32
tensor -> a RESULT whose blocks are the input (the sum over one worker), and checks that
neither torch nor Horovod was imported. Every wait has a timeout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_install import run

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = Path("/usr/bin/python3")

# Run in the torch-free venv: argv[1] is the aggregator's port. Prints a JSON report.
CLIENT = r'''
import json, socket, struct, sys
import hvd_sparse
from hvd_sparse import protocol
from hvd_sparse.tools import wire

T, INF = protocol.TYPES, protocol.INF
token, bs, values = 0x70C, 4, [1.5, -2.25, 0.0, 3.0, 0.125, 0.0, -7.0, 1e-3]
code, esize = protocol.DTYPES["float32"]
nblocks = -(-len(values) // bs)
lanes, nslots = protocol.layout(nblocks, bs, esize, 64512, 64)
raw = struct.pack(f"<{len(values)}f", *values)
block = {b: raw[b * bs * esize:(b + 1) * bs * esize] for b in range(nblocks)}
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(10)
agg = ("127.0.0.1", int(sys.argv[1]))
s.sendto(wire.header(type=T["REGISTER"], token=token, worker=0, nworkers=1), agg)
regack = wire.parse(s.recv(65536))
table, blocks = [], {}
for lane in range(lanes):  # round 0: position 0 of every non-empty lane; nothing beyond
    if protocol.stream_length(0, lane, nblocks, nslots, lanes) == 0:
        table.append((INF, INF))
    else:
        table.append((0, INF))
        blocks[lane] = block[protocol.stream_block(0, lane, 0, nslots, lanes)]
s.sendto(wire.data(table, blocks, token=token, worker=0, nworkers=1, dtype=code, slot=0,
                   tensor=1, round=0, block_size=bs, nblocks=nblocks, nslots=nslots, meta=7),
         agg)
result = wire.parse(s.recv(65536))
got = b"".join(result["blocks"])
s.sendto(wire.header(type=T["BYE"], token=token, worker=0, nworkers=1), agg)
print(json.dumps({
    "regack": regack["type"] == T["REGACK"], "result": result["type"] == T["RESULT"],
    "last": bool(result["flags"] & protocol.FLAGS["LAST"]), "blocks_equal": got == raw,
    "nblocks": nblocks, "lanes": lanes, "nslots": nslots,
    "torch": "torch" in sys.modules, "horovod": any(m.split(".")[0] == "horovod"
                                                     for m in sys.modules),
    "package": hvd_sparse.__file__}))
'''


def wait_port(port_file: Path, proc: subprocess.Popen, log: Path, timeout: float = 15) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text())
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    pytest.fail(f"aggregator did not start (exit {proc.poll()}): {log.read_text()[-3000:]}")


def test_aggregator_and_wire_without_torch(tmp_path: Path) -> None:
    if not SYSTEM_PYTHON.exists():
        pytest.skip(f"no {SYSTEM_PYTHON}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HVD_SPARSE_"))}
    probe = subprocess.run([str(SYSTEM_PYTHON), "-c", "import torch"], env=env,
                           capture_output=True, timeout=60)
    assert probe.returncode != 0, f"{SYSTEM_PYTHON} imports torch: this test needs one without"

    venv = tmp_path / "venv"
    run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", venv], tmp_path, env, timeout=60)
    py = venv / "bin" / "python"
    env = {**env, "PYTHONPATH": str(ROOT)}
    info = run([py, "-c", "import sys, importlib.util as u; print(sys.version_info[:2], "
                "u.find_spec('torch'), u.find_spec('horovod'))"], tmp_path, env, timeout=60).stdout
    assert info.strip() == f"{tuple(sys.version_info[:2])} None None", \
        f"the venv must be torch-free and of this Python's version (for the extension): {info}"

    port_file, log = tmp_path / "port", tmp_path / "aggregator.log"
    with open(log, "w") as out:
        agg = subprocess.Popen(
            [str(py), "-m", "hvd_sparse.tools.cli", "aggregator", "--bind", "127.0.0.1:0",
             "--workers", "1", "--port-file", str(port_file)],
            env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        port = wait_port(port_file, agg, log)
        report = json.loads(run([py, "-c", CLIENT, str(port)], tmp_path, env, timeout=60).stdout)
    finally:
        agg.terminate()
        try:
            agg.wait(timeout=10)
        except subprocess.TimeoutExpired:
            agg.kill()
            agg.wait(timeout=10)
    assert Path(report["package"]).resolve().is_relative_to(ROOT), report
    assert report["nblocks"] == 2 and report["nslots"] == 1, report
    assert report["regack"] and report["result"] and report["last"], report
    assert report["blocks_equal"], report
    assert report["torch"] is False and report["horovod"] is False, report
