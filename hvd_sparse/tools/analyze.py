"""``hvd-sparse analyze RUN.json``: is the network the bottleneck?

Reads a run file (``HVD_SPARSE_METRICS_FILE``, runfile.py) and reports, per tensor and per step,
the bytes each reduction moved, how fast, and how much of the link that used; then a what-if from
the cost model's own formulas (``costmodel.predict`` on ``NetModel.for_link``): each scheme's
sync time at other link rates and worker counts, and the link rate from which dense allreduce at
full utilization would already be enough. Needs no Horovod job.

    hvd-sparse analyze run.json [--png out.png] [--json out.json] [--link-rate 10gbit]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .. import costmodel, runfile

RATES = (1e9, 10e9, 100e9, 400e9)
WORKERS = (4, 16, 64, 256, 1024)
SCHEMES = ("dense", "allgather", "zen", "omnireduce")
FRACTION = 0.1  # "dense is enough" when its sync takes at most this share of a step
SEARCH = (1e6, 1e13)  # link rates searched for "dense is enough", bit/s

Record = dict[str, Any]


# What check_run() takes: ranks (a run's world size, a record's ranks) up to this many (the cost
# model's terms are per rank: far beyond, one analysis takes minutes), tensors of up to
# 2**62 elements (torch's numel is an int64), elements of at most 16 bytes.
MAX_RANKS = 1 << 16
MAX_NUMEL = 1 << 62
MAX_ESIZE = 16
MAX_BLOCK = 1 << 32  # the protocol's block_size and the cost model's layout take 32 bits


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_number(v: Any, lo: float = -math.inf, positive: bool = False) -> bool:
    """A finite JSON number (not a boolean) of at least ``lo``; above 0 with ``positive``."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        x = float(v)
    except OverflowError:  # an integer beyond the floats
        return False
    return math.isfinite(x) and x >= lo and (x > 0 or not positive)


def _is_numbers(v: Any, n: int, lo: float = 0.0) -> bool:
    return isinstance(v, list | tuple) and len(v) == n and all(_is_number(x, lo) for x in v)


def _check_net(d: Any) -> None:
    """``net``: what NetModel is built from (net_model), every term a finite number."""
    if not isinstance(d, dict):
        raise ValueError("run file: \"net\" is not an object")
    terms = {"allreduce": 2, "allgather": 2, "alltoall": 2}
    for k, n in terms.items():
        if not _is_numbers(d.get(k), n):
            raise ValueError(f"run file: net.{k} is not {n} non-negative numbers")
    for k in ("decode_bps", "local_bps"):
        if not _is_number(d.get(k), positive=True):
            raise ValueError(f"run file: net.{k} is not a positive number")
    for k in ("omnireduce", "switch"):
        if d.get(k) is not None and not _is_numbers(d[k], 3):
            raise ValueError(f"run file: net.{k} is neither null nor 3 non-negative numbers")
    for k in ("omni_layout", "switch_layout"):  # (payload bytes, slots)
        v = d.get(k)
        if v is not None and not (isinstance(v, list) and len(v) == 2
                                  and _is_int(v[0], 0, MAX_NUMEL) and _is_int(v[1], 1, 1 << 32)):
            raise ValueError(f"run file: net.{k} is not [payload bytes >= 0, slots >= 1]")
    if d.get("link_bps") is not None and not _is_number(d["link_bps"], positive=True):
        raise ValueError("run file: net.link_bps is neither null nor a positive number")
    if "aggregator_hosts" in d and not _is_int(d["aggregator_hosts"], 0, MAX_RANKS):
        raise ValueError("run file: net.aggregator_hosts is not a count of hosts")


# A record's fields that analyze reads: name -> (what it must be, the check)
_RECORD = {
    "name": ("a string", lambda v: isinstance(v, str)),
    "scheme": ("a string", lambda v: isinstance(v, str)),
    "requested": ("any value", lambda v: True),  # reported as it is
    "step": ("an integer >= 0", lambda v: _is_int(v, 0, MAX_NUMEL)),
    "numel": (f"an integer in [0, {MAX_NUMEL}]", lambda v: _is_int(v, 0, MAX_NUMEL)),
    "esize": (f"an integer in [1, {MAX_ESIZE}]", lambda v: _is_int(v, 1, MAX_ESIZE)),
    "block_size": (f"an integer in [1, {MAX_BLOCK - 1}]", lambda v: _is_int(v, 1, MAX_BLOCK - 1)),
    "ranks": (f"an integer in [1, {MAX_RANKS}]", lambda v: _is_int(v, 1, MAX_RANKS)),
    "t": ("a finite number", _is_number),
    "seconds": ("a finite number >= 0", lambda v: _is_number(v, 0.0)),
    "bytes_sent": ("null or a number >= 0", lambda v: v is None or _is_number(v, 0.0)),
    "bytes_received": ("null or a number >= 0", lambda v: v is None or _is_number(v, 0.0)),
    "block_density": ("null or a number >= 0", lambda v: v is None or _is_number(v, 0.0)),
    "union": ("null or a number >= 0", lambda v: v is None or _is_number(v, 0.0)),
}


def check_run(run: dict[str, Any]) -> None:
    """What analyze() reads of a run file's document (as runfile.load returns it), checked
    before it reads any of it: the run's world size, link rate, aggregators and network model,
    and each record's fields.

    Raises:
        ValueError: naming the first field that is missing, of another type or out of range.
    """
    if not _is_int(run.get("world_size"), 1, MAX_RANKS):
        raise ValueError(f"run file: \"world_size\" is not an integer in [1, {MAX_RANKS}]")
    rate = run.get("link_rate_bps")
    if rate is not None and not _is_number(rate, positive=True):
        raise ValueError("run file: \"link_rate_bps\" is neither null nor a positive number")
    for k in ("aggregator_hosts", "aggregators"):
        if run.get(k) is not None and not _is_int(run[k], 0, MAX_RANKS):
            raise ValueError(f"run file: \"{k}\" is neither null nor a count")
    config = run.get("config", {})
    if not isinstance(config, dict) or not _is_int(config.get("slots", 64), 1, 1 << 32):
        raise ValueError("run file: \"config\" is not an object whose slots are >= 1")
    _check_net(run.get("net"))
    if not isinstance(run.get("records"), list):
        raise ValueError("run file: \"records\" is not a list")
    for i, r in enumerate(run["records"]):
        if not isinstance(r, dict):
            raise ValueError(f"run file: record {i} is not an object")
        for k, (what, ok) in _RECORD.items():
            if k not in r:  # null or not, the writer writes every field (runfile.FIELDS)
                raise ValueError(f"run file: record {i} has no \"{k}\"")
            if not ok(r[k]):
                raise ValueError(f"run file: record {i}: \"{k}\" is not {what}, got "
                                 f"{str(r[k])[:40]}")


def net_model(d: dict[str, Any]) -> costmodel.NetModel:
    """The run's NetModel from its JSON (lists back to tuples; fields this version lacks are
    dropped, so run files of a newer cost model still load)."""
    names = {f.name for f in dataclasses.fields(costmodel.NetModel)}
    return costmodel.NetModel(**{k: tuple(v) if isinstance(v, list) else v
                                 for k, v in d.items() if k in names})


def _median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else math.nan


def _util(nbytes: float, seconds: float, rate: float | None) -> tuple[float, float]:
    """(achieved bit/s, share of the link rate) of receiving ``nbytes`` in ``seconds``."""
    bps = 8 * nbytes / seconds if seconds > 0 else math.nan
    return bps, (bps / rate if rate else math.nan)


def tensors(records: Sequence[Record], rate: float | None) -> list[dict[str, Any]]:
    """One row per tensor: its calls, what it is, and what its reductions moved and took."""
    by_name: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_name[r["name"]].append(r)
    out = []
    for name, rs in by_name.items():
        last = rs[-1]
        received = sum(r["bytes_received"] or 0 for r in rs)
        seconds = sum(r["seconds"] for r in rs)
        bps, util = _util(received, seconds, rate)
        densities = [r["block_density"] for r in rs if r["block_density"] is not None]
        unions = [r["union"] for r in rs if r["union"] is not None]
        schemes = Counter(r["scheme"] for r in rs)
        out.append({
            "name": name, "steps": len(rs), "scheme": schemes.most_common(1)[0][0],
            "schemes": dict(schemes), "requested": last["requested"], "numel": last["numel"],
            "esize": last["esize"], "block_size": last["block_size"], "ranks": last["ranks"],
            "bytes": last["numel"] * last["esize"],
            "block_density": statistics.fmean(densities) if densities else None,
            "union": statistics.fmean(unions) if unions else None,
            "bytes_sent_mean": statistics.fmean(r["bytes_sent"] or 0 for r in rs),
            "bytes_received_mean": received / len(rs), "bytes_received_total": received,
            "seconds_median": _median(r["seconds"] for r in rs), "seconds_total": seconds,
            "throughput_bps": bps, "utilization": util,
        })
    return sorted(out, key=lambda x: -x["seconds_total"])


def steps(records: Sequence[Record], rate: float | None) -> list[dict[str, Any]]:
    """One row per step (the k-th call of every tensor): bytes, and the wall time from the first
    reduction's start to the last one's end (reductions in flight together overlap)."""
    by_step: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        by_step[r["step"]].append(r)
    out = []
    for k in sorted(by_step):
        rs = by_step[k]
        start = min(r["t"] for r in rs)
        wall = max(r["t"] + r["seconds"] for r in rs) - start
        received = sum(r["bytes_received"] or 0 for r in rs)
        bps, util = _util(received, wall, rate)
        out.append({"step": k, "tensors": len(rs), "start": start, "wall_s": wall,
                    "seconds_sum": sum(r["seconds"] for r in rs),
                    "bytes_sent": sum(r["bytes_sent"] or 0 for r in rs),
                    "bytes_received": received, "throughput_bps": bps, "utilization": util})
    return out


def predict_tensor(net: costmodel.NetModel, t: dict[str, Any], n: int,
                   union: float | None = None) -> dict[str, float]:
    """costmodel.predict's seconds per scheme for tensor ``t`` on ``n`` workers that each hold
    its mean block density; dense only where the density is unknown (it ran dense, or by rows)."""
    nblocks = max(1, -(-t["numel"] // t["block_size"]))
    density = t["block_density"]
    nnz = [round((density if density is not None else 1.0) * nblocks)] * n
    p = costmodel.predict(net, t["numel"], t["esize"], t["block_size"], nnz, union)
    if density is None or str(t["scheme"]).startswith("rows"):
        return {"dense": p.seconds["dense"]}
    return dict(p.seconds)


def step_prediction(net: costmodel.NetModel, ts: Sequence[dict[str, Any]],
                    n: int) -> dict[str, float]:
    """Seconds of one step's reductions one after the other, per scheme (a tensor the scheme
    cannot take counts as dense) and "best" (each tensor's fastest)."""
    total = dict.fromkeys((*SCHEMES, "best"), 0.0)
    for t in ts:
        p = predict_tensor(net, t, n)
        for s in SCHEMES:
            total[s] += p.get(s, p["dense"])
        total["best"] += min(p.values())
    return total


class WhatIf:
    """The run's model moved to other links and worker counts."""

    def __init__(self, run: dict[str, Any], ts: Sequence[dict[str, Any]]) -> None:
        self.base = net_model(run["net"])
        self.ts = ts
        self.n = run["world_size"]
        # the hosts whose links carry the aggregation (older run files: one per aggregator)
        self.agg_hosts = int(run.get("aggregator_hosts", run.get("aggregators")) or 0)
        self.remote = run.get("aggregator_placement", "remote") == "remote"
        self.slots = int(run.get("config", {}).get("slots", 64))

    def net(self, rate: float, n: int) -> costmodel.NetModel:
        # the run's aggregator hosts at its own n; at another, configured ones grow with the
        # workers (as many per worker as the run had), the job's own are the multi-host
        # default, a shard on every worker host (0)
        hosts = self.agg_hosts if n == self.n else (
            max(1, round(self.agg_hosts * n / self.n)) if self.remote and self.agg_hosts else 0)
        return costmodel.NetModel.for_link(rate, n, self.base, hosts, self.slots,
                                           base_n=self.n)

    def step(self, rate: float, n: int) -> dict[str, float]:
        return step_prediction(self.net(rate, n), self.ts, n)

    def dense_step(self, rate: float, n: int) -> float:
        """A step's dense seconds alone (the union, which dense does not use, given as 0)."""
        net = self.net(rate, n)
        return sum(costmodel.predict(net, t["numel"], t["esize"], t["block_size"], [0] * n,
                                     0.0).seconds["dense"] for t in self.ts)

    def dense_enough(self, n: int, target_s: float) -> float | None:
        """The smallest link rate at which a step's dense allreduces take at most
        ``target_s``, by bisection on the model (dense time falls as the rate rises); None
        when even SEARCH's top rate is not enough (latency alone exceeds the target)."""
        if not target_s > 0:
            return None
        lo, hi = SEARCH
        if self.dense_step(hi, n) > target_s:
            return None
        if self.dense_step(lo, n) <= target_s:
            return lo
        while hi / lo > 1 + 1e-6:
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if self.dense_step(mid, n) <= target_s else (mid, hi)
        return hi


def analyze(run: dict[str, Any], rates: Sequence[float] = RATES,
            workers: Sequence[int] = WORKERS, fraction: float = FRACTION,
            link_rate: float | None = None) -> dict[str, Any]:
    """The whole analysis as a JSON-able dict (what ``--json`` writes).

    Raises:
        ValueError: ``run`` is not a run file's document it can analyze (``check_run``).
    """
    check_run(run)
    rate = link_rate or run.get("link_rate_bps")
    records = run["records"]
    ts = tensors(records, rate)
    ss = steps(records, rate)
    wi = WhatIf(run, ts)
    n = run["world_size"]
    sync = _median(s["wall_s"] for s in ss)  # measured sync time of a step
    starts = [s["start"] for s in ss]
    period = _median(b - a for a, b in zip(starts, starts[1:], strict=False))
    grid = []
    for r in rates:
        for w in workers:
            p = wi.step(r, w)
            grid.append({"rate_bps": r, "workers": w,
                         **{f"{s}_s": v for s, v in p.items()}})
    enough = [{"workers": w,
               "rate_for_measured_sync_bps": wi.dense_enough(w, sync),
               "rate_for_step_fraction_bps": wi.dense_enough(w, fraction * period)}
              for w in sorted({n, *workers})]
    check = []
    for t in ts:
        row = {"name": t["name"], "scheme": t["scheme"], "measured_s": t["seconds_median"],
               "predicted_run_model_s": predict_tensor(wi.base, t, t["ranks"], t["union"]).get(
                   t["scheme"], math.nan)}
        if rate:
            row["predicted_link_model_s"] = predict_tensor(
                wi.net(rate, t["ranks"]), t, t["ranks"], t["union"]).get(t["scheme"], math.nan)
        check.append(row)
    bytes_total = sum(s["bytes_received"] for s in ss)
    wall_total = sum(s["wall_s"] for s in ss)
    return {
        "run": {k: run.get(k) for k in ("world_size", "hosts", "aggregators", "link_rate_bps",
                                        "max_records", "dropped", "net")}
        | {"link_rate_bps": rate, "records": len(records)},
        "summary": {"steps": len(ss), "sync_s_median": sync, "step_period_s": period,
                    "bytes_received_per_step": bytes_total / max(1, len(ss)),
                    "throughput_bps": _util(bytes_total, wall_total, rate)[0],
                    "utilization": _util(bytes_total, wall_total, rate)[1],
                    "fraction": fraction},
        "tensors": ts, "steps": ss, "whatif": grid, "dense_enough": enough,
        "model_check": check,
        "notes": [
            "bytes: what this rank received (dense: Horovod's ring modelled, 2 (n-1)/n of the "
            "tensor); utilization: received bits / seconds / link rate",
            "what-if: costmodel.predict on NetModel.for_link (each scheme's busiest link at "
            "the share of the rate bulk transfers reach, CPU rates as measured, latencies as "
            "measured growing as log2 of the workers); every worker holds the tensor's mean "
            "block density, blocks placed independently; a step's tensors reduced one after "
            "the other; tensors without a measured density (they ran dense) count as dense in "
            "every scheme; checked against emulated hosts in docs/SCALE.md",
        ],
    }


# --- output ----------------------------------------------------------------------------------


def _num(v: Any, scale: float = 1.0, fmt: str = ".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v * scale, fmt)


def _rate(bps: float | None) -> str:
    if bps is None or (isinstance(bps, float) and math.isnan(bps)):
        return "-"
    for unit, k in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if bps >= k:
            return f"{bps / k:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def _pct(share: float | None) -> str:
    s = _num(share, 100, ".1f")
    return s if s == "-" else s + "%"


def _mib(b: float) -> str:
    return f"{b / 2**20:.3g}"


def print_report(a: dict[str, Any], max_steps: int = 10) -> None:
    from rich.console import Console
    from rich.table import Table

    # Through a pipe rich assumes 80 columns and squashes the tables.
    con = Console(width=None if sys.stdout.isatty() else 160)
    run, sm = a["run"], a["summary"]
    rate = run["link_rate_bps"]
    dropped = f", {run['dropped']} older ones dropped" if run["dropped"] else ""
    unknown = "" if rate else " (unknown: set HVD_SPARSE_LINK_RATE or --link-rate)"
    con.print(f"run: {run['world_size']} ranks, {run['hosts']} host(s) (by hostname), "
              f"{run['aggregators']} aggregator(s); link rate {_rate(rate)}{unknown}; "
              f"{run['records']} calls recorded{dropped}")

    t = Table(title="per tensor (this rank)", caption="received: bytes this rank received per "
              "call (dense: ring model); util: received / seconds / link rate")
    for c in ("tensor", "scheme", "steps", "MiB", "density", "recv MiB", "ms (median)",
              "throughput", "util"):
        t.add_column(c, justify="left" if c in ("tensor", "scheme") else "right")
    for x in a["tensors"]:
        t.add_row(x["name"], ",".join(x["schemes"]), str(x["steps"]), _mib(x["bytes"]),
                  _pct(x["block_density"]),
                  _mib(x["bytes_received_mean"]), _num(x["seconds_median"], 1e3),
                  _rate(x["throughput_bps"]), _pct(x["utilization"]))
    con.print(t)

    ss = a["steps"]
    shown = ss if len(ss) <= max_steps else ss[: max_steps // 2] + ss[-(max_steps // 2):]
    t = Table(title="per step (the k-th call of every tensor)",
              caption=f"{len(ss)} steps; median sync {_num(sm['sync_s_median'], 1e3)} ms, step "
              f"period {_num(sm['step_period_s'], 1e3)} ms; overall {_rate(sm['throughput_bps'])}"
              f" = {_pct(sm['utilization'])} of the link"
              + ("" if len(shown) == len(ss) else f"; {len(ss) - len(shown)} steps not shown"))
    for c in ("step", "tensors", "sent MiB", "recv MiB", "wall ms", "throughput", "util"):
        t.add_column(c, justify="right")
    for s in shown:
        t.add_row(str(s["step"]), str(s["tensors"]), _mib(s["bytes_sent"]),
                  _mib(s["bytes_received"]), _num(s["wall_s"], 1e3), _rate(s["throughput_bps"]),
                  _pct(s["utilization"]))
    con.print(t)

    t = Table(title="what-if: predicted sync ms per step (cost model, busiest links)",
              caption=a["notes"][1])
    for c in ("link", "workers", *SCHEMES, "best"):
        t.add_column(c, justify="right")
    for g in a["whatif"]:
        t.add_row(_rate(g["rate_bps"]), str(g["workers"]),
                  *(_num(g[f"{s}_s"], 1e3) for s in (*SCHEMES, "best")))
    con.print(t)

    t = Table(title="where dense allreduce at full utilization is already enough",
              caption=f"smallest link rate at which a step's dense sync takes at most the measured"
              f" sync ({_num(sm['sync_s_median'], 1e3)} ms) or {sm['fraction']:.0%} of the "
              f"measured step period ({_num(sm['step_period_s'], 1e3)} ms); '-': no rate "
              "(latency-bound, or unknown)")
    for c in ("workers", "<= measured sync", f"<= {sm['fraction']:.0%} of step"):
        t.add_column(c, justify="right")
    for e in a["dense_enough"]:
        t.add_row(str(e["workers"]), _rate(e["rate_for_measured_sync_bps"]),
                  _rate(e["rate_for_step_fraction_bps"]))
    con.print(t)

    t = Table(title="model check: measured vs predicted ms (scheme that ran, this run's n)")
    for c in ("tensor", "scheme", "measured", "run model", "ratio", "link model", "ratio "):
        t.add_column(c, justify="left" if c in ("tensor", "scheme") else "right")
    for c in a["model_check"]:
        m, p, q = c["measured_s"], c["predicted_run_model_s"], c.get("predicted_link_model_s")
        t.add_row(c["name"], c["scheme"], _num(m, 1e3), _num(p, 1e3), _num(p / m if m else None),
                  _num(q, 1e3), _num(q / m if q is not None and m else None))
    con.print(t)


def plot(a: dict[str, Any], run: dict[str, Any], path: str | Path) -> Path:
    """Predicted step sync time vs link rate per scheme at the run's worker count, with the
    measured point; and vs worker count at the what-if's rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wi = WhatIf(run, a["tensors"])
    n, sm = a["run"]["world_size"], a["summary"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    xs = [10 ** (8 + k / 10) for k in range(41)]  # 100 Mbit/s .. 1 Tbit/s
    curves = [wi.step(x, n) for x in xs]
    for s in (*SCHEMES, "best"):
        ax.plot([x / 1e9 for x in xs], [c[s] * 1e3 for c in curves], label=s,
                linestyle=":" if s == "best" else "-")
    measured = sm["sync_s_median"] * 1e3
    ran = ",".join(sorted({s for t in a["tensors"] for s in t["schemes"]}))
    if a["run"]["link_rate_bps"]:
        ax.plot([a["run"]["link_rate_bps"] / 1e9], [measured], "k*", markersize=14,
                label=f"measured ({ran})")
    else:
        ax.axhline(measured, color="k", linestyle="--", label=f"measured ({ran}), rate unknown")
    enough = next((e for e in a["dense_enough"] if e["workers"] == n), None)
    if enough and enough["rate_for_measured_sync_bps"]:
        ax.axvline(enough["rate_for_measured_sync_bps"] / 1e9, color="grey", linestyle="-.",
                   label="dense enough from here")
    ax.set(xscale="log", yscale="log", xlabel="link rate (Gbit/s)",
           ylabel="sync ms per step", title=f"predicted vs link rate, {n} workers")
    ax.legend(fontsize=8)
    ws = sorted({n, *(g["workers"] for g in a["whatif"])})
    for r in sorted({g["rate_bps"] for g in a["whatif"]}):
        ps = [wi.step(r, w) for w in ws]
        line = bx.plot(ws, [p["dense"] * 1e3 for p in ps], label=f"dense, {_rate(r)}")[0]
        bx.plot(ws, [p["best"] * 1e3 for p in ps], linestyle=":", color=line.get_color(),
                label=f"best, {_rate(r)}")
    bx.set(xscale="log", yscale="log", xlabel="workers", ylabel="sync ms per step",
           title="predicted vs workers")
    bx.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def json_safe(x: Any) -> Any:
    """NaN and infinities (a value that does not apply) are not valid JSON: null instead."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hvd-sparse analyze",
        description="Is the network the bottleneck? Bytes, link utilization and a cost-model "
        "what-if from a run file (HVD_SPARSE_METRICS_FILE).")
    p.add_argument("run", type=Path, help="run file (HVD_SPARSE_METRICS_FILE)")
    p.add_argument("--png", type=Path, help="plot: predicted vs link rate and workers")
    p.add_argument("--json", type=Path, help="write the analysis here")
    p.add_argument("--link-rate", help="link rate, e.g. 10gbit (default: the run file's)")
    p.add_argument("--rates", default="1gbit,10gbit,100gbit,400gbit", help="what-if link rates")
    p.add_argument("--workers", default=",".join(map(str, WORKERS)),
                   help="what-if worker counts")
    p.add_argument("--fraction", type=float, default=FRACTION,
                   help="dense is enough when its sync is at most this share of a step")
    p.add_argument("--max-steps", type=int, default=10, help="steps shown in the step table")
    args = p.parse_args(argv)
    try:
        run = runfile.load(args.run)
        rates = [runfile.parse_rate(r) for r in args.rates.split(",")]
        workers = [int(w) for w in args.workers.split(",")]
        link = runfile.parse_rate(args.link_rate) if args.link_rate else None
    except (OSError, ValueError) as e:
        print(f"hvd-sparse analyze: {e}", file=sys.stderr)
        return 2
    if not run["records"]:
        print(f"hvd-sparse analyze: {args.run}: no reductions recorded", file=sys.stderr)
        return 1
    try:
        a = analyze(run, rates, workers, args.fraction, link)
    except ValueError as e:  # a run file this analyzer cannot read (check_run)
        print(f"hvd-sparse analyze: {args.run}: {e}", file=sys.stderr)
        return 2
    print_report(a, args.max_steps)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(json_safe(a), indent=1) + "\n")
        print(f"analysis: {args.json}")
    if args.png:
        print(f"plot: {plot(a, run, args.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
