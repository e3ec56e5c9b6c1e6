"""examples/ run as a reader would run them (2 ranks, a few steps), each checked for its
outcome: the loss went down, every rank ends with the same parameters, and what the example is
about happened (rows for the tables, the aggregators summed packets, the sparsifier kept the
density asked for)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.integration


def run(argv: list[str], timeout: float = 240) -> tuple[dict, str]:
    """The example's output, and its JSON summary (the last line that is one)."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    # horovodrun tags each rank's output; a chunk's tag may land after the line it ends
    tag = r"(?:\[[\d,]+\]<stdout>:)?"
    found = re.findall(rf"^{tag}(\{{\"example\".*\}}){tag}$", p.stdout, re.M)
    assert found, out[-3000:]
    return json.loads(found[-1]), out


def trained(summary: dict) -> None:
    assert summary["ranks"] == 2, summary
    assert summary["last_loss"] < 0.9 * summary["first_loss"], summary
    assert summary["same_parameters_on_every_rank"], summary


def test_horovod_embedding() -> None:
    summary, _ = run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
                      sys.executable, "examples/horovod_embedding.py", "--steps", "20"])
    trained(summary)
    assert {"rows", "rows+omnireduce"} & set(summary["schemes"]), summary


def test_ddp_embedding() -> None:
    summary, _ = run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2",
                      "examples/ddp_embedding.py", "--steps", "20"])
    trained(summary)
    assert {"rows", "rows+omnireduce"} & set(summary["schemes"]), summary


@pytest.mark.parametrize("table_dtype", ["float32", "bfloat16"])
def test_ddp_wide_deep(table_dtype: str) -> None:
    summary, _ = run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2",
                      "examples/ddp_wide_deep.py", "--steps", "40", "--table-dtype", table_dtype])
    trained(summary)
    assert summary["table_dtype"] == table_dtype, summary
    assert {"rows", "rows+omnireduce"} & set(summary["schemes"]), summary


def test_ddp_sparsifier() -> None:
    summary, _ = run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2",
                      "examples/ddp_sparsifier.py", "--steps", "30"])
    trained(summary)
    got = summary["achieved_density"]
    # the two large weights are sparsified, each rank keeping about the density asked for
    assert {"0.weight", "2.weight"} <= got.keys(), got
    assert all(0.5 * summary["density"] <= got[n] <= 2 * summary["density"]
               for n in ("0.weight", "2.weight")), got


def test_dedicated_aggregators() -> None:
    summary, out = run(["bash", "examples/dedicated_aggregators.sh", "20"])
    trained(summary)
    assert set(summary["schemes"]) & {"omnireduce", "rows+omnireduce"}, summary
    stats = [json.loads(s) for s in re.findall(r"^aggregator \d: hvd-sparse aggregator stats "
                                               r"(\{.*\})$", out, re.M)]
    assert len(stats) == 2, out[-3000:]
    # both aggregators summed the job's packets, all of them authenticated
    assert all(s["rx_packets"] > 0 for s in stats), stats


def readme_snippet(filename: str) -> tuple[str, list[str]]:
    """The README's program ``filename`` (the python block after "`filename`:") and the launch
    command of the bash block after it."""
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"`{re.escape(filename)}`:\s*```python\n(.*?)```\s*```bash\n(.*?)```",
                  text, re.S)
    assert m, f"README.md: no `{filename}`: python block followed by its launch command"
    return m.group(1), m.group(2).strip().split()


@pytest.mark.parametrize("filename", ["train.py", "train_ddp.py"])
def test_readme_quickstart_runs_as_written(filename: str, tmp_path: Path) -> None:
    """The README's snippet for each front end, launched by the command written under it."""
    code, argv = readme_snippet(filename)
    assert filename in argv and argv[0] in ("horovodrun", "torchrun"), argv
    (tmp_path / filename).write_text(code)
    launcher = argv[0]
    argv = [str(BIN / launcher), *(["--standalone"] if launcher == "torchrun" else []),
            *argv[1:]]
    argv = [sys.executable if a == "python" else a for a in argv]
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "HVD_SPARSE_PROBE": "off"}
    p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    if filename == "train.py":  # each rank prints how its table went: by rows
        # (horovodrun interleaves the ranks' lines)
        assert p.stdout.count("rows") == 2, p.stdout[-2000:]
