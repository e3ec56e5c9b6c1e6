"""The run file (HVD_SPARSE_METRICS_FILE) and `hvd-sparse analyze`'s parts; a real 2-rank job's
run files are tests/parallel/test_analyze_job.py's."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from hvd_sparse import runfile
from hvd_sparse.tools import analyze

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_rate():
    assert runfile.parse_rate("1gbit") == 1e9
    assert runfile.parse_rate("10Gbit") == 1e10
    assert runfile.parse_rate("100mbit") == 1e8
    assert runfile.parse_rate("2.5e9") == 2.5e9
    assert runfile.parse_rate(4e10) == 4e10
    for bad in ("10gbps", "fast", "0", "-1gbit"):
        with pytest.raises(ValueError):
            runfile.parse_rate(bad)


def test_recorder_keeps_the_latest_calls(tmp_path):
    rec = runfile.Recorder(str(tmp_path / "r.json"), 0, 4, {"world_size": 1})
    for i in range(10):
        rec.add(f"x{i % 3}", rec.t0 + i, 0.5, numel=3)
    doc = rec.document()
    assert doc["dropped"] == 6 and len(doc["records"]) == 4
    assert [(r["name"], r["step"]) for r in doc["records"]] == [
        ("x0", 2), ("x1", 2), ("x2", 2), ("x0", 3)]
    assert rec.write() == tmp_path / "r.json" and runfile.load(tmp_path / "r.json")["dropped"] == 6
    assert math.isnan(analyze._util(1, 0, None)[0])  # no seconds: no throughput


@pytest.mark.integration
def test_run_file_is_written_at_exit(tmp_path):
    """A process that records and exits without hvd_sparse.shutdown() still leaves its file."""
    path = tmp_path / "exit.json"
    code = ("from hvd_sparse import runfile\n"
            f"runfile.start({str(path)!r}, 0, 10, {{'world_size': 1}})\n"
            "rec = runfile._recorder\n"
            "rec.add('x', rec.t0 + 1, 0.5, numel=3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = runfile.load(path)
    assert [(r["name"], r["step"]) for r in doc["records"]] == [("x", 0)]
