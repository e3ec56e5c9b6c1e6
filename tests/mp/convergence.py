"""The convergence run for scripts/convergence.py (which starts this file under horovodrun and
reads rank0.json): the training of tests/parallel/test_convergence.py, its results as JSON.
The test itself runs that module under pytest on every rank; this file only keeps the script
working (point scripts/convergence.py at a runner of its own, then delete it)."""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
import horovod.torch as hvd  # noqa: E402
from ranktools import start  # noqa: E402
from test_convergence import train  # noqa: E402


def main() -> None:
    start()
    results: dict[str, object] = {"error": ""}
    try:
        train(results)
    except Exception:  # noqa: BLE001 - the report carries the failure to the script
        results["error"] = traceback.format_exc(limit=6)
    path = Path(os.environ["HVD_SPARSE_TEST_OUT"]) / f"rank{hvd.rank()}.json"
    path.write_text(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
