"""Convergence table: dense vs TopK / DGC / ExDyna at 1% on 4 ranks (tests/mp/convergence.py).

    .venv/bin/python scripts/convergence.py              # 3000 steps, as the test
    .venv/bin/python scripts/convergence.py --steps 500  # shorter

Runs the test's worker under ``horovodrun -np 4 --gloo`` and prints held-out accuracy, the mean
union density after warm-up (a quarter of the steps) and the bytes each rank sent per step.
Writes <out-dir>/convergence.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts")]

from _report import console, print_table, write_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench_results")
    args = ap.parse_args()
    bindir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HVD_SPARSE_TEST_OUT": tmp,
               "HVD_SPARSE_CACHE_DIR": str(Path(tmp) / "cache"), "OMP_NUM_THREADS": "1",
               "HVD_SPARSE_CONV_STEPS": str(args.steps)}
        cmd = [str(bindir / "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}",
               "--gloo", sys.executable, str(ROOT / "tests" / "mp" / "convergence.py")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        path = Path(tmp) / "rank0.json"
        if not path.exists():
            console.print(proc.stdout[-3000:], proc.stderr[-3000:])
            return 1
        rep = json.loads(path.read_text())
    if rep["error"]:
        console.print(rep["error"])
        return 1
    rows = []
    for v in ("dense", "topk", "dgc", "exdyna"):
        rows.append({"variant": v, "accuracy %": 100 * rep[f"{v}.accuracy"],
                     "vs dense (points)": 100 * (rep[f"{v}.accuracy"] - rep["dense.accuracy"]),
                     "union density %": 100 * rep[f"{v}.density"],
                     "bytes/step/rank": rep[f"{v}.bytes"]})
    print_table(rows, f"convergence, {args.np} ranks, {args.steps} steps, requested density 1%",
                caption=f"training {rep['seconds']:.1f} s; ExDyna overlap: "
                + (rep["exdyna.overlap"] or "none (no block chosen by two ranks)"))
    out = write_json(args.out_dir / "convergence.json", rows, args=vars(args),
                     seconds=rep["seconds"])
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
