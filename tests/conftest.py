"""Launching multi-process workers under horovodrun (Gloo) or mpirun (MPI), with a timeout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def launch(script: str, np: int, tmp: Path, *, launcher: str = "horovodrun",
           env: dict[str, str] | None = None, timeout: float = 300,
           reports: bool = True) -> list[dict]:
    """Runs tests/mp/<script> (plus any arguments after its name) on np ranks; returns each
    rank's JSON report (rank order), or [] when ``reports`` is False."""
    name, *args = script.split()
    worker = [str(ROOT / "tests" / "mp" / name), *args]
    if launcher == "horovodrun":
        cmd = [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo",
               sys.executable, *worker]
    else:
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np),
               "-x", "PYTHONPATH", "-x", "HVD_SPARSE_TEST_OUT", "-x", "HOROVOD_CPU_OPERATIONS",
               sys.executable, *worker]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "HVD_SPARSE_TEST_OUT": str(tmp),
                "HVD_SPARSE_CACHE_DIR": str(tmp / "cache"), "OMP_NUM_THREADS": "1",
                "HOROVOD_CPU_OPERATIONS": "mpi" if launcher == "mpirun" else "gloo",
                # Gloo's 30 s default, and ours, end jobs whose 4 ranks share 2 busy cores: this
                # kernel has left a runnable thread without CPU for 27 s (docs/BENCHMARKS.md).
                # Tests of the timeouts set theirs low.
                "HOROVOD_GLOO_TIMEOUT_SECONDS": "120", "HVD_SPARSE_TIMEOUT": "90",
                **(env or {})}
    try:
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} on {np} ranks hung past {timeout}s:\n{(e.stdout or '')[-3000:]}")
    if not reports:
        return []
    out = []
    for r in range(np):
        path = tmp / f"rank{r}.json"
        if not path.exists():
            pytest.fail(f"{script}: rank {r} wrote no report (exit {proc.returncode}):\n"
                        f"{by_rank(proc.stdout, np)}\n{proc.stderr[-3000:]}")
        out.append(json.loads(path.read_text()))
    # Horovod's and Gloo's own errors, shown with a failing test's captured output
    print(f"{script} on {np} ranks, exit {proc.returncode}:\n{proc.stdout[-6000:]}\n"
          f"{proc.stderr[-6000:]}")
    return out


SHUT_DOWN = "Horovod has been shut down"


def by_rank(output: str, np: int, lines: int = 40) -> str:
    """The last lines of each rank's output (horovodrun prefixes them "[r]<std...>"), root
    causes first: a rank that only saw Horovod shut down by a peer comes last."""
    ranks = {r: [ln for ln in output.splitlines() if ln.startswith(f"[{r}]<")] for r in range(np)}
    order = sorted(ranks, key=lambda r: SHUT_DOWN in "\n".join(ranks[r]))
    parts = [f"--- rank {r} ---\n" + "\n".join(ranks[r][-lines:]) for r in order if ranks[r]]
    return "\n".join(parts) if parts else output[-4000:]


def passed(reports: list[dict], key: str) -> None:
    """Asserts that every rank recorded '' for ``key``. A failure lists each failing rank, root
    causes first: a rank whose peer failed sees only Horovod shut down."""
    failing = sorted(((r, str(rep[key])) for r, rep in enumerate(reports) if rep[key] != ""),
                     key=lambda f: SHUT_DOWN in f[1])
    assert not failing, f"{key}:\n" + "\n".join(f"rank {r}: {why}" for r, why in failing)
