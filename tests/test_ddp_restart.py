"""DDP under torchrun restarts (issue 51): examples/ddp_checkpoint.py, checkpoints as PyTorch's
DDP tutorial writes them with the hook's ``State.state_dict()`` beside them per rank.

A rank that exits mid-run (``os._exit``: a crash) makes torchrun (``--max-restarts 1``) restart
every rank from the top; each loads the last checkpoint and goes on. The run must end with the very
bits of the same run never interrupted (a digest of every parameter, alike on every rank), for the
aggregators' scheme and for a TopK sparsifier, whose error-feedback memory is what each rank saved.
Under ``auto`` it ends within rounding of it: ``auto`` times both ways of the embedding's rows on
each run's first calls (schemes/rows.py), and the two ways sum in different orders, so two runs,
interrupted or not, may take different ways. A job restarted from that checkpoint on three ranks
goes on (the hook's state afresh), its ranks alike and its loss falling. Each job runs with its own
timeout; whatever it leaves running is killed with its process group.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "ddp_checkpoint.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
TIMEOUT = 240  # a job's, with a restart; 15-40 s here


def torchrun(np: int, ckpt: Path, cache: Path, *args: str, restarts: int = 0) -> dict:
    """Runs the example on ``np`` local ranks; rank 0's JSON summary. Fails the test, with
    the output, when the job fails or runs past ``TIMEOUT``."""
    argv = [str(TORCHRUN), "--standalone", f"--nproc-per-node={np}",
            f"--max-restarts={restarts}", str(SCRIPT), "--ckpt", str(ckpt), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "HVD_SPARSE_CACHE_DIR": str(cache), "HVD_SPARSE_TIMEOUT": "60",
           # torch's own restart bug (docs/fault-tolerance.md): without it, a restarted rank's
           # Gloo group reads the last attempt's addresses from the shared store
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    p = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"torchrun ran past {TIMEOUT} s:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # a rank left behind
        except ProcessLookupError:
            pass
    assert p.returncode == 0, f"torchrun exited {p.returncode}:\n{out[-4000:]}"
    lines = [ln for ln in out.splitlines() if ln.startswith('{"digest"')]
    assert len(lines) == 1, out[-4000:]
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The network model's cache, shared by the module's jobs: probed once, so every job's
    ``auto`` decides from the same model."""
    return tmp_path_factory.mktemp("restart-cache")


VARIANTS = [pytest.param(("--scheme", "omnireduce"), id="omnireduce"),
            pytest.param(("--scheme", "allgather", "--topk", "0.05"), id="topk-allgather",
                         marks=pytest.mark.extended)]


@pytest.mark.parallel
@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("args", VARIANTS)
def test_a_killed_rank_resumes_bitwise(tmp_path: Path, cache: Path, args: tuple[str, ...]):
    whole = torchrun(2, tmp_path / "whole", cache, *args)
    assert whole["attempt"] == 0 and whole["resumed_from"] is None and whole["identical"]
    resumed = torchrun(2, tmp_path / "resumed", cache, *args, "--fail-step", "10",
                       "--fail-rank", "1", restarts=1)
    assert resumed["attempt"] == 1 and resumed["resumed_from"] == 8, resumed
    assert resumed["identical"] and resumed["digest"] == whole["digest"], (resumed, whole)
    assert whole["end_loss"] < 0.9 * whole["start_loss"], whole


@pytest.mark.parallel
@pytest.mark.timeout(3 * TIMEOUT)
def test_auto_resumes_within_rounding(tmp_path: Path, cache: Path):
    whole = torchrun(2, tmp_path / "whole", cache, "--scheme", "auto")
    resumed = torchrun(2, tmp_path / "resumed", cache, "--scheme", "auto", "--fail-step", "10",
                       "--fail-rank", "1", restarts=1)
    assert resumed["attempt"] == 1 and resumed["resumed_from"] == 8, resumed
    assert whole["identical"] and resumed["identical"], (whole, resumed)
    # the last checkpoint (step 24) holds each run's final model
    a, b = (torch.load(tmp_path / run / "model.pt")["model"] for run in ("whole", "resumed"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6, msg=name)
    assert whole["end_loss"] < 0.9 * whole["start_loss"], whole


@pytest.mark.parallel
@pytest.mark.timeout(3 * TIMEOUT)
def test_a_restart_on_more_ranks_goes_on(tmp_path: Path, cache: Path):
    ckpt = tmp_path / "ckpt"
    two = torchrun(2, ckpt, cache, "--scheme", "auto", "--topk", "0.05", "--steps", "12")
    three = torchrun(3, ckpt, cache, "--scheme", "auto", "--topk", "0.05", "--steps", "24")
    assert three["resumed_from"] == 12 and three["world"] == 3 and three["identical"], three
    assert three["start_loss"] == two["end_loss"], (two, three)  # the checkpoint's model
    assert three["end_loss"] < 0.9 * three["start_loss"], three
