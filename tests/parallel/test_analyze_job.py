"""A real 2-rank job with a run file (HVD_SPARSE_METRICS_FILE), and `hvd-sparse analyze` on it.

Every scheme reduces a known number of times tensors of known sparsity; each rank records the
non-zero blocks (or rows) it submitted, and every rank gets them all, so the bytes each rank
must receive are worked out here from the blocks and the segment layout (docs/PROTOCOL.md,
csrc/segment.h), not from the code that records them; the analyzer's utilization and what-if
are checked against closed forms. Each rank checks its own run file (written by
hvd_sparse.shutdown(); tests/test_analyze.py checks the one written at exit).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import horovod.torch as hvd
import pytest
import torch
from driver import ROOT, Launch
from ranktools import start

import hvd_sparse
from hvd_sparse import costmodel, runfile
from hvd_sparse.tools import analyze

LAUNCHES = [Launch(np=2, timeout=240, env={
    "HVD_SPARSE_METRICS_FILE": "{out}/run.{rank}.json", "HVD_SPARSE_LINK_RATE": "1gbit",
    "ANALYZE_SOLO_FILE": "{out}/solo.json"})]
NUMEL = 256 * 1000 + 17  # a partial last block: segments still carry it whole
# name -> (scheme, calls, block density)
CALLS = {"ag": ("allgather", 3, 0.05), "zen": ("zen", 3, 0.1), "omni": ("omnireduce", 2, 0.05),
         "dense": ("dense", 2, 0.05), "auto": ("auto", 2, 0.01)}
ROWS, DIM = 4000, 8


def sample(name: str, step: int, density: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 100 + step * 10 + hvd.rank())
    nblocks = -(-NUMEL // 256)
    chosen = (torch.rand(nblocks, generator=g) < density).repeat_interleave(256)[:NUMEL]
    return torch.randn(NUMEL, generator=g) * chosen


def blocks_of(t: torch.Tensor) -> list[int]:
    padded = torch.cat([t, t.new_zeros(-t.numel() % 256)])
    return padded.view(-1, 256).ne(0).any(1).nonzero().view(-1).tolist()


BS, W = 256, 4  # block size, float32 bytes
HEADER = 56  # segment header
RATE = 1e9
ASKED = {"ag": "allgather", "zen": "zen", "omni": "omnireduce", "dense": "dense",
         "auto": "auto", "emb": "rows"}
COUNTS = {"ag": 3, "zen": 3, "omni": 2, "dense": 2, "auto": 2, "emb": 3}


def align8(x: int) -> int:
    return -(-x // 8) * 8


def index_segment(count: int) -> int:
    return align8(HEADER + align8(4 * count) + count * BS * W)


def partition_of(block: int, nparts: int) -> int:
    """Zen's partition hash (csrc/blocks.h), restated."""
    x = ((block + 1) * 0x9E3779B97F4A7C15) % 2**64
    x ^= x >> 29
    return ((x & 0xFFFFFFFF) * nparts) >> 32


def must_receive(scheme: str, mine: list[int], other: list[int], numel: int, dim: int) -> int:
    """Bytes a rank of 2 receives reducing its blocks ``mine`` with the peer's ``other``."""
    if scheme == "dense":
        return numel * W  # ring: 2 (n - 1) / n of the tensor, n = 2
    if scheme == "allgather":
        return index_segment(len(other))
    if scheme == "omnireduce":  # the sum of every block the peer holds; mine alone: none
        return len(set(other)) * BS * W
    if scheme == "rows":  # plus the header row, and the runs entry ([0]: a value per row)
        return (len(other) + 2) * 8 + (len(other) + 1) * dim * W
    if scheme == "rows+omnireduce":  # likewise, by rows
        return len(set(other)) * dim * W
    raise AssertionError(scheme)


def zen_receive(rank: int, mine: list[int], other: list[int], numel: int) -> int:
    """Zen on 2 ranks: the peer's blocks of my partition, then the peer's partition sum as an
    index list or a bitmap over its positions, whichever is smaller."""
    peer = 1 - rank
    to_me = sum(partition_of(b, 2) == rank for b in other)
    union = sum(partition_of(b, 2) == peer for b in set(mine) | set(other))
    positions = sum(partition_of(b, 2) == peer for b in range(-(-numel // BS)))
    head = min(align8(-(-positions // 8)), align8(4 * union))
    return index_segment(to_me) + align8(HEADER + head + union * BS * W)


def by_name(run: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in run["records"]:
        out.setdefault(r["name"], []).append(r)
    return out


@pytest.fixture(scope="module")
def job() -> tuple[Path, list[dict], dict]:
    """(the run files' folder, every rank's report, this rank's run file)."""
    solo = Path(os.environ["ANALYZE_SOLO_FILE"])
    # A run file given as an init option, without {rank}: rank 0 alone writes it, at shutdown.
    start(probe="off", metrics_file=str(solo))
    hvd_sparse.allreduce(sample("solo", 0, 0.1), name="solo", scheme="allgather")
    solo_recording = runfile._recorder is not None
    hvd_sparse.shutdown()
    hvd_sparse.init(probe="off")  # the environment's file, "{rank}": each rank its own
    calls: dict[str, list[list[int]]] = {}
    for step in range(3):
        for name, (scheme, count, density) in CALLS.items():
            if step < count:
                t = sample(name, step, density)
                calls.setdefault(name, []).append(blocks_of(t))
                hvd_sparse.allreduce(t, name=name, op=hvd.Sum, scheme=scheme)
        g = torch.Generator().manual_seed(7 * hvd.rank() + step)
        ids = (torch.rand(300, generator=g) ** 2 * ROWS).long()  # repeated rows
        emb = torch.sparse_coo_tensor(ids.unsqueeze(0), torch.randn(300, DIM, generator=g),
                                      (ROWS, DIM))
        calls.setdefault("emb", []).append(sorted(set(ids.tolist())))
        hvd_sparse.allreduce(emb, name="emb")
    metrics = hvd_sparse.metrics()
    hvd_sparse.shutdown()  # writes this rank's run file
    reports = hvd.allgather_object({"calls": calls, "metrics": metrics, "numel": NUMEL,
                                    "dim": DIM, "solo_recording": solo_recording},
                                   name="reports")
    run_file = Path(os.environ["HVD_SPARSE_METRICS_FILE"].replace("{rank}", str(hvd.rank())))
    return solo.parent, reports, runfile.load(run_file)


def test_one_record_per_call_with_the_scheme_asked(job):
    _, reports, run = job
    rank = hvd.rank()
    assert run["format"] == runfile.FORMAT and run["rank"] == rank
    assert run["world_size"] == 2 and run["link_rate_bps"] == RATE
    assert run["aggregators"] == 1 and run["aggregators_local"] and run["dropped"] == 0
    assert run["config"]["link_rate"] == "1gbit" and run["net"]["allreduce"]
    recs = by_name(run)
    assert {k: len(v) for k, v in recs.items()} == COUNTS
    for name, rs in recs.items():
        assert [r["step"] for r in rs] == list(range(COUNTS[name]))
        for r in rs:
            assert r["requested"] == (ASKED[name] if name != "emb" else "rows")
            # "emb" (auto): the first of its trials, each way twice from the first call
            ran = {"auto": r["scheme"],
                   "emb": ("rows", "rows+omnireduce")[r["step"] % 2]}.get(name, ASKED[name])
            assert r["scheme"] == ran, (name, r)
            assert r["ranks"] == 2 and r["block_size"] == BS and r["seconds"] > 0
            assert r["numel"] == (reports[rank]["numel"] if name != "emb"
                                  else 4000 * reports[rank]["dim"])
    assert recs["auto"][0]["scheme"] in ("allgather", "zen")  # 1% blocks: not dense
    starts = [r["t"] for r in run["records"]]
    assert starts == sorted(starts)
    # the records agree with metrics(), which still keeps each tensor's last call
    m = reports[rank]["metrics"]
    assert m["ag"]["calls"] == 3 and m["ag"]["scheme"] == "allgather"
    for key in ("bytes_sent", "bytes_received", "union"):
        assert m["ag"][key] == by_name(run)["ag"][-1][key]


def test_bytes_received_are_what_each_rank_must_receive(job):
    _, reports, run = job
    numel, dim = reports[0]["numel"], reports[0]["dim"]
    rank = hvd.rank()
    mine, other = reports[rank]["calls"], reports[1 - rank]["calls"]
    for name, rs in by_name(run).items():
        for r in rs:
            a, b = mine[name][r["step"]], other[name][r["step"]]
            scheme = r["scheme"]
            want = (zen_receive(rank, a, b, numel) if scheme == "zen"
                    else must_receive(scheme, a, b, numel, dim))
            if name == "auto":
                want += 4 * 8  # the decision's stats row from the peer
            assert r["bytes_received"] == want, (rank, name, r["step"], scheme)
            if scheme not in ("dense", "rows", "rows+omnireduce"):
                assert r["nnz_local"] == len(a)
                assert r["union"] == len(set(a) | set(b))


def test_solo_file_written_by_rank_0_at_shutdown(job):
    tmp, reports, _ = job
    assert [r["solo_recording"] for r in reports] == [True, False]  # only the writer records
    solo = runfile.load(tmp / "solo.json")
    assert solo["rank"] == 0 and [r["name"] for r in solo["records"]] == ["solo"]
    assert not list(tmp.glob("solo.json.*")) and not list(tmp.glob(".solo*"))


def test_utilization_is_bytes_over_seconds_over_rate(job):
    _, _, run = job
    a = analyze.analyze(run)
    recs = by_name(run)
    for t in a["tensors"]:
        rs = recs[t["name"]]
        want = 8 * sum(r["bytes_received"] for r in rs) / sum(r["seconds"] for r in rs) / RATE
        assert t["utilization"] == pytest.approx(want, rel=1e-12)
        assert t["steps"] == COUNTS[t["name"]]
    for s in a["steps"]:
        rs = [r for r in run["records"] if r["step"] == s["step"]]
        wall = max(r["t"] + r["seconds"] for r in rs) - min(r["t"] for r in rs)
        assert s["wall_s"] == pytest.approx(wall)
        assert s["utilization"] == pytest.approx(
            8 * sum(r["bytes_received"] for r in rs) / wall / RATE)
    assert [s["tensors"] for s in a["steps"]] == [6, 6, 3]
    # no link rate known: throughput still, no utilization
    a = analyze.analyze({**run, "link_rate_bps": None})
    assert all(math.isnan(t["utilization"]) and t["throughput_bps"] > 0 for t in a["tensors"])
    assert analyze.analyze({**run, "link_rate_bps": None}, link_rate=2 * RATE)[
        "summary"]["utilization"] == pytest.approx(a["summary"]["throughput_bps"] / (2 * RATE))


def test_whatif_dense_is_the_ring_formula_and_falls_with_the_rate(job):
    _, _, run = job
    a = analyze.analyze(run)
    alpha = run["net"]["allreduce"][0]
    eff = costmodel.COLLECTIVE_EFFICIENCY  # the share of the link a ring reaches
    sizes = [t["numel"] * t["esize"] for t in a["tensors"]]
    assert len(sizes) == 6
    for g in a["whatif"]:
        n, rate = g["workers"], g["rate_bps"]
        steps = math.log2(n) / math.log2(run["world_size"])  # latency grows as a tree's
        ring = sum(alpha * steps + 2 * (n - 1) / n * b * 8 / rate / eff for b in sizes)
        assert g["dense_s"] == pytest.approx(ring, rel=0.01)
        assert g["best_s"] <= min(g[f"{s}_s"] for s in analyze.SCHEMES) + 1e-12
    assert {(g["rate_bps"], g["workers"]) for g in a["whatif"]} == {
        (r, w) for r in analyze.RATES for w in analyze.WORKERS}
    for w in analyze.WORKERS:
        rows = sorted((g for g in a["whatif"] if g["workers"] == w), key=lambda g: g["rate_bps"])
        for s in (*analyze.SCHEMES, "best"):
            times = [g[f"{s}_s"] for g in rows]
            assert times == sorted(times, reverse=True), (w, s)
            assert len(set(times)) == len(rows), (w, s)
    # one tensor, through the public constructor
    base = analyze.net_model(run["net"])
    p = costmodel.predict(costmodel.NetModel.for_link(10e9, 64, base), 1 << 20, 4, BS, [0] * 64,
                          None)
    assert p.seconds["dense"] == pytest.approx(
        alpha + 2 * 63 / 64 * 4 * 2**20 * 8 / 10e9 / eff, rel=0.01)


def test_dense_enough_rate_solves_the_ring_formula(job):
    _, _, run = job
    a = analyze.analyze(run)
    alpha = run["net"]["allreduce"][0]
    total = sum(t["numel"] * t["esize"] for t in a["tensors"])
    target = a["summary"]["sync_s_median"]
    assert a["summary"]["steps"] == 3 and target > 0
    for e in a["dense_enough"]:
        n = e["workers"]
        # k * alpha log2 n / log2 n0 + 2 (n-1)/n * bytes * 8 / (R * efficiency) = target
        steps = math.log2(n) / math.log2(run["world_size"])
        if 6 * alpha * steps >= target:  # latency alone is more: no rate is enough
            assert e["rate_for_measured_sync_bps"] is None, n
            continue
        want = (2 * (n - 1) / n * total * 8 / (target - 6 * alpha * steps)
                / costmodel.COLLECTIVE_EFFICIENCY)
        assert e["rate_for_measured_sync_bps"] == pytest.approx(want, rel=0.01), n


def test_cli_end_to_end(job, capsys):
    tmp, _, _ = job
    png, out = tmp / f"a{hvd.rank()}.png", tmp / f"a{hvd.rank()}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hvd_sparse.tools.cli", "analyze",
         str(tmp / f"run.{hvd.rank()}.json"),
         "--png", str(png), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for text in ("per tensor", "per step", "what-if", "dense allreduce at full utilization",
                 "model check", "allgather", "omni", "1 Gbit/s", "1024"):
        assert text in proc.stdout, text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    doc = json.loads(out.read_text())
    assert {t["name"] for t in doc["tensors"]} == set(COUNTS)
    assert len(doc["whatif"]) == len(analyze.RATES) * len(analyze.WORKERS)
    assert analyze.main([str(png)]) == 2  # not a run file: a one-line error, no traceback
    assert "hvd-sparse analyze" in capsys.readouterr().err


