"""The run file (HVD_SPARSE_METRICS_FILE) and `hvd-sparse analyze`'s parts; a real 2-rank job's
run files are tests/parallel/test_analyze_job.py's."""
from __future__ import annotations

import json
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
    # float() refused these naming no option; an infinite rate is no rate (fuzz: config_env)
    for bad in ("101.5.3gbit", ".", "1e999", 10**400, math.nan):
        with pytest.raises(ValueError, match="link_rate"):
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


# --- what the run file reader and the analyzer refuse (findings of the fuzz targets run_file
# and run_analysis; their reproducers: fuzz/corpus/run_file/regress-*,
# fuzz/corpus/run_analysis/regress-*) -------------------------------------------------------


@pytest.mark.parametrize("content", [
    b"", b"[" * 5000, b"\xff\xfe\x00", b'{"format": "hvd-sparse-run", "version": 2}',
    b'{"format": "hvd-sparse-run", "version": 2, "records": [1]}'],
    ids=["empty", "nested-past-the-parser", "undecodable", "no-records", "record-not-object"])
def test_load_refuses_what_is_not_a_run_file_naming_it(tmp_path, content):
    """JSON's errors named no file, and nesting past the parser's depth raised RecursionError
    (hvd-sparse analyze printed a traceback)."""
    path = tmp_path / "run.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=str(path)):
        runfile.load(path)


def run_document(tmp_path) -> dict:
    """A small run file as a job writes it: its header and four records of two tensors."""
    from dataclasses import asdict

    from hvd_sparse import costmodel
    header = {"world_size": 2, "hosts": 1, "aggregators": 0, "link_rate_bps": 1e9,
              "net": asdict(costmodel.NetModel.default()), "config": {"slots": 64}}
    rec = runfile.Recorder(str(tmp_path / "run.json"), 0, 10, header)
    for i in range(4):
        rec.add(f"t{i % 2}", rec.t0 + i, 0.01, numel=25600, esize=4, block_size=256, ranks=2,
                requested="auto", scheme="allgather", bytes_sent=5000, bytes_received=9000,
                block_density=0.1, union=18, nnz_local=10)
    return runfile.load(rec.write())


def test_a_run_the_analyzer_reads(tmp_path):
    a = analyze.analyze(run_document(tmp_path))
    assert [t["name"] for t in a["tensors"]] == ["t0", "t1"] and len(a["steps"]) == 2


@pytest.mark.parametrize("field,change", [
    ("seconds", lambda d: d["records"][1].pop("seconds")),
    ("requested", lambda d: d["records"][0].pop("requested")),
    ("name", lambda d: d["records"][1].__setitem__("name", 5)),
    ("world_size", lambda d: d.__setitem__("world_size", "2")),
    ("local_bps", lambda d: d["net"].__setitem__("local_bps", 0)),
    ("ranks", lambda d: d["records"][0].__setitem__("ranks", 0)),
    ("block_size", lambda d: d["records"][0].__setitem__("block_size", 256.0)),
    ("block_density", lambda d: d["records"][0].__setitem__("block_density", math.nan)),
], ids=lambda x: x if isinstance(x, str) else "")
def test_analyze_refuses_a_run_it_cannot_read_naming_the_field(tmp_path, field, change):
    """A run file load accepts with a field missing or of another type crashed the analysis
    (KeyError, TypeError, ZeroDivisionError) or its report (rich refuses a number for a name);
    each is now a ValueError naming the field, which hvd-sparse analyze prints."""
    doc = run_document(tmp_path)
    change(doc)
    with pytest.raises(ValueError, match=field):
        analyze.analyze(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    assert analyze.main([str(path)]) == 2
