"""The demo's report: its tables on the console and its summary (bench_results/demo.json)."""
from __future__ import annotations

import argparse
import math
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

import horovod
import horovod.torch as hvd
import torch
from rich import box
from rich.console import Console
from rich.table import Table

import hvd_sparse
from hvd_sparse.tools.workload import FIELDS, vocab_sizes

LOSS_RTOL = 1e-3  # final and held-out loss, dense vs sparse run, relative
PARAM_RTOL = 1e-4
PARAM_ATOL = 1e-5


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError("unreachable")




def plot(runs: list[Any], path: Path) -> None:
    """The demo's picture: each run's sync and step time per step, and the bytes one rank sent
    per step, side by side (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: rank 0 under horovodrun
    import matplotlib.pyplot as plt

    fig, (times, sent) = plt.subplots(1, 2, figsize=(10, 3.8), width_ratios=(2, 1))
    for r, colour in zip(runs, ("tab:gray", "tab:blue"), strict=False):
        steps = range(1, len(r.step_ms) + 1)
        times.plot(steps, r.step_ms, color=colour, label=f"{r.name}: step")
        times.plot(steps, r.sync_ms, color=colour, linestyle="--", label=f"{r.name}: sync")
    times.set(xlabel="timed step", ylabel="ms", title="time per step")
    times.legend(fontsize=8)
    names = [r.name for r in runs]
    values = [(r.bytes_per_step or 0) / 2**20 for r in runs]
    sent.bar(names, values, color=["tab:gray", "tab:blue"][: len(runs)])
    sent.set(ylabel="MiB", title="sent per step, one rank")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(
    console: Console,
    args: argparse.Namespace,
    runs: list[Any],
    checks: dict[str, Any],
    eval0: float,
) -> dict[str, Any]:
    dense, sparse = runs
    stats = {r.name: r.stats() for r in runs}
    speedup_sync = stats["dense"]["sync_ms_median"] / max(stats["sparse"]["sync_ms_median"], 1e-9)
    speedup_step = stats["dense"]["step_ms_median"] / max(stats["sparse"]["step_ms_median"], 1e-9)
    bytes_ratio = (
        dense.bytes_per_step / max(sparse.bytes_per_step, 1.0)
        if dense.bytes_per_step is not None and sparse.bytes_per_step is not None
        else math.nan
    )

    # 80 columns (make demo's promise): names wrap (overflow="fold") rather than being cut,
    # and the sync paths go below the table
    t = Table(title=f"dense vs sparse gradient sync: {hvd.size()} ranks, medians of "
                    f"{args.steps} steps", box=box.SIMPLE_HEAD, pad_edge=False,
              collapse_padding=True)
    for col in ("run", "sync\nms", "step\nms", "final\nloss", "eval\nloss", "sent/\nstep",
                "link rx/\nstep", "link\nutil"):
        t.add_column(col, justify="left" if col == "run" else "right", overflow="fold")
    for r in runs:
        s = stats[r.name]
        t.add_row(
            r.name,
            f"{s['sync_ms_median']:.1f}",
            f"{s['step_ms_median']:.1f}",
            f"{s['final_loss']:.5f}",
            f"{s['eval_loss']:.5f}",
            fmt_bytes(r.bytes_per_step),
            fmt_bytes(r.rx_per_step),
            f"{r.link_util:.0%}" if r.link_util is not None else "-",
        )
    t.caption = (f"sparse: sync {speedup_sync:.2f}x, step {speedup_step:.2f}x as fast, "
                 f"{bytes_ratio:.0f}x fewer bytes")
    console.print(t)
    console.print(
        " ".join(f"{r.name}: {r.path}." for r in runs) + f" Eval loss at init {eval0:.4f}."
        + " sent/step: what one rank sends (mean over ranks; dense: ring model 2 (n - 1) / n x "
        "gradient bytes, sparse: hvd_sparse.metrics() bytes_sent). link rx/step, link util: "
        "what a worker's link received (eth0 counters, mean over ranks), and those bits over "
        "the step time and the link rate (testbed only).", style="dim")
    tt = Table(title=f"hvd_sparse per-tensor schemes (scheme={args.scheme!r}, last step)",
               box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    names = [x["param"] or x["metric_name"] for x in sparse.tensors]
    # names whole (the other columns give way), the rest folded where 80 columns are short
    tt.add_column("tensor", no_wrap=True, min_width=max(map(len, names), default=6))
    for col in ("shape", "scheme", "density", "calls", "sent", "ms", "note"):
        tt.add_column(col, justify="left" if col in ("scheme", "note") else "right",
                      overflow="fold", no_wrap=col != "note")
    for x in sparse.tensors:
        density = x.get("block_density")
        tt.add_row(
            x["param"] or x["metric_name"],
            "x".join(map(str, x["shape"])) if x["shape"] else "?",
            str(x.get("scheme")),
            f"{density:.2%}" if isinstance(density, int | float) else "-",
            str(x.get("calls")),
            fmt_bytes(x.get("bytes_sent")),
            f"{1e3 * x['seconds']:.1f}" if "seconds" in x else "-",
            str(x.get("reason", "")),
        )
    if not sparse.tensors:
        tt.add_row("(hvd_sparse.metrics() is empty)", *[""] * 7)
    tt.caption = ("density: of non-zero blocks; sent: bytes this rank put on the wire (ring "
                  "model); ms: submit to done")
    console.print(tt)

    ct = Table(title="dense vs sparse agreement (all ranks)")
    for col in ("check", "value", "limit", "ok"):
        ct.add_column(col, justify="left" if col == "check" else "right", overflow="fold")

    def mark(ok: bool) -> str:
        return "[green]yes[/]" if ok else "[bold red]NO[/]"

    ct.add_row(
        "final train loss rel diff",
        f"{checks['final_loss_rel_diff']:.2e}",
        f"{LOSS_RTOL:.0e}",
        mark(checks["final_loss_rel_diff"] < LOSS_RTOL),
    )
    ct.add_row(
        "eval loss rel diff",
        f"{checks['eval_loss_rel_diff']:.2e}",
        f"{LOSS_RTOL:.0e}",
        mark(checks["eval_loss_rel_diff"] < LOSS_RTOL),
    )
    ct.add_row(
        f"params max |diff| ({checks['params_worst_tensor'] or '-'})",
        f"{checks['params_max_abs_diff']:.2e}",
        f"rtol {PARAM_RTOL:.0e}, atol {PARAM_ATOL:.0e}",
        mark(checks["params_allclose_all_ranks"]),
    )
    console.print(ct)

    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "world_size": hvd.size(),
        "fields": [
            {"name": n, "rows": r, "zipf_a": a}
            for (n, _, a), r in zip(FIELDS, vocab_sizes(args.scale), strict=True)
        ],
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "horovod": horovod.__version__,
            "hvd_sparse": getattr(hvd_sparse, "__version__", None),
        },
        "eval_loss_init": eval0,
        "runs": {
            r.name: {
                **stats[r.name],
                **{k: v for k, v in asdict(r).items() if k not in ("params", "name")},
            }
            for r in runs
        },
        "sync_speedup": speedup_sync,
        "step_speedup": speedup_step,
        "bytes_ratio": bytes_ratio,
        "checks": checks,
        "ok": checks["ok"],
    }
