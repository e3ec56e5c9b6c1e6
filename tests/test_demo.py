"""`make demo`'s job, small (2 ranks on loopback, a few steps, a tenth of the tables): its
report fits an 80-column terminal with no name cut short (rich marks a cut with an ellipsis),
it says the runs agree, and it writes the picture it names (a PNG) beside its summary."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parallel
@pytest.mark.timeout(600)
def test_the_demo_fits_80_columns_and_draws_its_picture(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "HVD_SPARSE_CACHE_DIR": str(tmp_path)}
    env.pop("COLUMNS", None)
    p = subprocess.run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
                        sys.executable, "scripts/demo.py", "--steps", "6", "--scale", "0.1",
                        "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    # rank 0's lines, as horovodrun prefixes them ("[0]<stdout>:")
    lines = [ln.split(":", 1)[1] for ln in p.stdout.splitlines() if ln.startswith("[0]<stdout>")]
    assert any("per-tensor schemes" in ln for ln in lines), p.stdout[-4000:]
    wide = [ln for ln in lines if len(ln) > 80]
    assert not wide, wide
    assert not [ln for ln in lines if "…" in ln], "a name was cut:\n" + "\n".join(lines)
    assert json.loads(out.read_text())["ok"]
    picture = out.with_suffix(".png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
    assert any(str(picture) in ln for ln in lines)
