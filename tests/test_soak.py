"""scripts/testbed/soak.py on the netns testbed: 4 ranks train the DLRM-like model with the DDP hook
while links fail and the aggregator host is killed or stopped; every bucket of every step is
checked against a dense float64 allreduce of the same gradients.

The default tier runs a short soak (about 22 s of training, 70-100 s in all on a quiet box)
with one wrong sum planted (rank 1 changes one value of a
bucket's result after the hook, at step 5): the check must count exactly that one, and the
ranks' parameters must differ, so a check that saw nothing could not pass. `make
test-extended` runs the 5-minute soak: 0 wrong sums, 0 hangs, no failed step, every fault
recovered from, identical parameters. Needs root."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_sparse.tools.testbed import links

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "testbed" / "soak.py"


def soak(tmp_path: Path, name: str, *args: str, timeout: float) -> tuple[int, dict, str]:
    """Runs the soak on testbed ``name``: (exit status, its JSON, its output)."""
    try:
        p = subprocess.run([sys.executable, str(SCRIPT), "--name", name, "--out-dir",
                            str(tmp_path), *args], capture_output=True, text=True,
                           timeout=timeout, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    finally:
        assert links.namespaces(name) == [], "the soak left its testbed behind"
    out = p.stdout + p.stderr
    found = list(tmp_path.glob("soak-*.json"))
    assert found, f"no report (exit {p.returncode}):\n{out[-4000:]}"
    return p.returncode, json.loads(found[0].read_text()), out


def test_a_planted_wrong_sum_is_counted(tmp_path: Path) -> None:
    # about 22 s of training: 5 s, 10% of w0's frames duplicated for 5 s, w1's link cut 4 s
    code, report, out = soak(tmp_path, f"hvs{os.getpid() % 10000}", "--minutes", "0.5",
                             "--seed", "2", "--kinds", "dup,reorder,link_down", "--gap", "3",
                             "--warmup", "5", "--corrupt", "5", timeout=500)
    (s,) = report["summaries"]
    assert s["wrong_sums"] == 1, out[-4000:]
    assert s["identical"] is False and s["ok"] is False and code == 1
    assert s["hangs"] == 0 and s["errors"] == 0 and s["ranks"] == 4, out[-4000:]
    assert s["faults"] >= 1 and s["recovered"] == s["faults"], out[-4000:]
    assert (tmp_path / "soak-2.png").stat().st_size > 0


@pytest.mark.extended
@pytest.mark.timeout(1200)
def test_five_minute_soak(tmp_path: Path) -> None:
    code, report, out = soak(tmp_path, f"hvs{os.getpid() % 10000}", "--minutes", "5",
                             "--seed", "1", timeout=1100)
    (s,) = report["summaries"]
    assert s["wrong_sums"] == 0 and s["hangs"] == 0 and s["errors"] == 0, out[-6000:]
    assert s["identical"] and s["ranks"] == 4 and s["steps"] > 100, out[-6000:]
    assert s["faults"] >= 8 and s["recovered"] == s["faults"], out[-6000:]
    kinds = {r["fault"] for r in report["rows"]}
    assert {"agg_kill", "agg_stop"} & kinds and {"link_down", "loss", "dup", "reorder"} & kinds
    assert code == 0 and s["ok"], out[-6000:]
    print(out[-5000:])
