"""Shared reporting for the benchmark scripts: a rich table, a JSON record, a PNG."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: benchmarks run under horovodrun with no display

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from hvd_sparse.tools.analyze import json_safe

Row = Mapping[str, Any]
# Under horovodrun stdout is a pipe; rich would fall back to 80 columns and squash the tables.
console = Console(width=None if sys.stdout.isatty() else 160)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if math.isnan(v):  # a column that does not apply to this row
            return "-"
        return f"{v:,.1f}" if 10 <= abs(v) < 1e6 else f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def print_table(
    rows: Sequence[Row], title: str, columns: Sequence[str] | None = None, caption: str = ""
) -> None:
    """Print rows as a table; columns defaults to the keys of the first row."""
    cols = list(columns) if columns is not None else list(rows[0]) if rows else []
    table = Table(title=title, caption=caption or None, caption_justify="left")
    for c in cols:
        table.add_column(c, justify="right" if rows and not isinstance(rows[0].get(c), str)
                         else "left")
    for r in rows:
        table.add_row(*(_fmt(r.get(c, "")) for c in cols))
    console.print(table)


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge the numbers: cores, library versions, when."""
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    try:
        import horovod

        info["horovod"] = horovod.__version__
    except ImportError:
        pass
    return info


def write_json(path: str | Path, rows: Sequence[Row], **extra: Any) -> Path:
    """Write rows plus the command line and machine info; extra keys go in verbatim."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": [sys.executable, *sys.argv], "machine": machine_info(), **extra,
           "rows": list(map(dict, rows))}
    path.write_text(json.dumps(json_safe(doc), indent=2, default=str) + "\n")
    return path


def save_png(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def rank_rows(tb: Any, script: str, args: Sequence[str], what: str) -> list[dict] | None:
    """Runs ``script --rank-side OUT *args`` as the ranks of the testbed ``tb``, with a fresh
    cache directory (auto probes these links, not a cached model of others); the rows rank 0
    wrote to OUT, or None (said, naming ``what``) when the job failed."""
    from hvd_sparse.tools.testbed import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        proc = launch.run(tb, [sys.executable, script, "--rank-side", str(out), *args],
                          env={"HVD_SPARSE_CACHE_DIR": tmp, "OMP_NUM_THREADS": "1"},
                          timeout=3600)
        if proc.returncode != 0 or not out.exists():
            console.print(f"[red]rank job failed at {what} (exit {proc.returncode})[/]")
            return None
        return json.loads(out.read_text())


def testbed_main(name: str, args: Any, rank_side: Any, drive: Any) -> int:
    """A testbed script's entry: ``rank_side(args)`` when launched as one of its ranks, else
    ``drive(args)``, which needs root (network namespaces)."""
    if args.rank_side:
        rank_side(args)
        return 0
    if os.geteuid() != 0:
        console.print(f"[red]{name} needs root (network namespaces)[/]")
        return 1
    return drive(args)
