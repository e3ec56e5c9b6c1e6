"""hvd_sparse installed like a package: a train.py outside the checkout must import it.

(a) ``make build`` installs this checkout into .venv (editable): from a directory outside the
    checkout, with no PYTHONPATH, the venv imports hvd_sparse and its extension, and
    ``hvd-sparse`` is pip's console script.
(b) ``pip wheel --no-build-isolation .`` builds a wheel holding the extension and the torch-free
    binaries; installed into a fresh venv that sees torch and Horovod (a .pth file, as a
    site-wide install would), it runs a 2-rank horovodrun job whose results match
    ``hvd.allreduce``, with local aggregators started from the installed binary.
(c) The same wheel in a venv that sees torch but not Horovod: ``hvd_sparse.ddp`` runs a 2-rank
    torchrun job whose hook matches DDP's own allreduce, and Horovod is never imported.

The wheel is built in the checkout, as ``pip install .`` builds it (in-tree): ninja reuses the
objects ``make build`` compiled, so the build takes seconds here. A clean clone compiles the
extension from scratch (4.7 min measured on the shared 2-core box): checked once by hand, not
repeated by this test.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"
BINARIES = ("hvd-sparse-aggregator", "hvd-sparse-udpblast")


def outside_env(tmp: Path) -> dict[str, str]:
    """The environment of a user's shell: nothing that points Python at the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HVD_SPARSE_"))}
    return {**env, "HVD_SPARSE_CACHE_DIR": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}


def run(cmd: list[str | Path], cwd: Path, env: dict[str, str],
        timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    return proc


def test_venv_imports_hvd_sparse_outside_the_checkout(tmp_path: Path) -> None:
    env = outside_env(tmp_path)
    # _C links against torch's libraries: it loads once torch has (hvd_sparse's API does that).
    out = run([VENV_BIN / "python", "-c", "import hvd_sparse; hvd_sparse.allreduce; "
               "import hvd_sparse._C; print(hvd_sparse.__file__)"], tmp_path, env).stdout.strip()
    where = Path(out).resolve()
    assert where.is_relative_to(ROOT) or "site-packages" in where.parts, \
        f".venv imports hvd_sparse from {where}, neither this checkout nor site-packages " \
        "(another checkout sharing this venv ran make build after this one?)"

    script = VENV_BIN / "hvd-sparse"
    assert "from hvd_sparse.tools.cli import main" in script.read_text(), \
        f"{script} is not pip's console script"
    help_text = run([script, "aggregator", "--help"], tmp_path, env)
    assert "--workers" in help_text.stdout + help_text.stderr
    usage = subprocess.run([str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: hvd-sparse" in usage.stdout


# Run by each rank of the installed-wheel job: every sparse scheme against Horovod's dense
# allreduce in float64; writes rank<r>.json into argv[1].
WORKER = '''
import json, sys
import horovod.torch as hvd, torch
import hvd_sparse, hvd_sparse.aggregator

torch.set_num_threads(1)
hvd.init()
hvd_sparse.init(probe="off", small_bytes=1024)
g = torch.Generator().manual_seed(hvd.rank())
blocks = torch.rand(400, generator=g) < 0.1          # ~10% of 256-element blocks non-zero
x = torch.randn(400 * 256, generator=g) * blocks.repeat_interleave(256)
ref = hvd.allreduce(x.double(), name="ref", op=hvd.Average)
errors, schemes = {}, {}
for scheme in ("allgather", "zen", "omnireduce", "auto"):
    out = hvd_sparse.allreduce(x, name=scheme, op=hvd.Average, scheme=scheme)
    errors[scheme] = float((out.double() - ref).abs().max())
    schemes[scheme] = hvd_sparse.metrics()[scheme]["scheme"]
report = {"file": hvd_sparse.__file__, "binary": str(hvd_sparse.aggregator.binary()),
          "errors": errors, "schemes": schemes, "ref_max": float(ref.abs().max())}
with open(f"{sys.argv[1]}/rank{hvd.rank()}.json", "w") as f:
    json.dump(report, f)
'''


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    run([VENV_BIN / "python", "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
         ".", "-w", tmp], ROOT, outside_env(tmp), timeout=900)
    (whl,) = tmp.glob("hvd_sparse-*.whl")
    return whl


def venv_with(tmp_path: Path, wheel: Path, site: list[str]) -> tuple[Path, Path]:
    """A fresh venv seeing the folders ``site`` (a .pth file, as a site-wide install would),
    with ``wheel`` installed: (its bin, its hvd_sparse package)."""
    env, py = outside_env(tmp_path), VENV_BIN / "python"
    venv = tmp_path / "v"
    run([py, "-m", "venv", "--without-pip", venv], tmp_path, env)
    purelib = run([venv / "bin" / "python", "-c", "import sysconfig; "
                   "print(sysconfig.get_paths()['purelib'])"], tmp_path, env).stdout.strip()
    Path(purelib, "dependencies.pth").write_text("\n".join(sorted(site)) + "\n")
    # --ignore-installed: where the dependencies' site-packages also hold an (editable)
    # hvd-sparse, pip must not count it as this venv's.
    run([py, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-deps",
         "--ignore-installed", wheel], tmp_path, env)
    return venv / "bin", Path(purelib) / "hvd_sparse"


def test_wheel_installs_and_runs_in_another_venv(tmp_path: Path, wheel: Path) -> None:
    env = outside_env(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    for ext in ("_C", "_protocol"):
        assert any(n.startswith(f"hvd_sparse/{ext}.") and n.endswith(".so") for n in names), names
    for b in BINARIES:
        assert f"hvd_sparse/bin/{b}" in names, f"{b} missing from the wheel: {names}"
    # nor the lab helpers that scripts/ and tests/ share (setup.py leaves them out)
    assert not any(n.startswith(("csrc/", "tests/", "scripts/", "hvd_sparse/tools/lab/"))
                   for n in names), names
    # built against this torch, it requires this torch's release (any local label)
    import torch
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    requires = [ln.split(":", 1)[1].strip() for ln in
                zipfile.ZipFile(wheel).read(meta).decode().splitlines()
                if ln.startswith("Requires-Dist:")]
    assert f"torch=={torch.__version__.split('+')[0]}" in requires, requires

    # torch and Horovod come from the site-packages they are installed in
    deps = {str(Path(importlib.util.find_spec(m).origin).parents[1])
            for m in ("torch", "horovod")}
    bin_, installed = venv_with(tmp_path, wheel, sorted(deps))
    venv = bin_.parent
    for b in BINARIES:
        assert os.access(installed / "bin" / b, os.X_OK), f"{b} not installed executable"
    run([installed / "bin" / "hvd-sparse-aggregator", "--help"], tmp_path, env)
    run([venv / "bin" / "hvd-sparse", "aggregator", "--help"], tmp_path, env)

    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "check.py").write_text(WORKER)
    run([VENV_BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo",
         venv / "bin" / "python", "check.py", out], work, env, timeout=300)
    for r in range(2):
        rep = json.loads((out / f"rank{r}.json").read_text())
        assert Path(rep["file"]).resolve().is_relative_to(installed.resolve()), rep["file"]
        assert Path(rep["binary"]).resolve().is_relative_to(installed.resolve()), rep["binary"]
        assert rep["ref_max"] > 0
        for scheme, err in rep["errors"].items():
            assert err <= 1e-5 * rep["ref_max"], f"rank {r} {scheme}: max error {err}"
        assert rep["schemes"]["omnireduce"] == "omnireduce", rep["schemes"]
        assert rep["schemes"]["zen"] == "zen", rep["schemes"]


# Each rank of the torchrun job without Horovod: DDP's own allreduce against our hook, three
# schemes; writes rank<r>.json into argv[1].
DDP_WORKER = '''
import copy, json, os, sys
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import hvd_sparse, hvd_sparse.ddp

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
errors, schemes = {}, {}
for scheme in ("allgather", "zen", "omnireduce"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(4000, 32), nn.Linear(32, 1))
    ref, ours = DistributedDataParallel(model), DistributedDataParallel(copy.deepcopy(model))
    ours.register_comm_hook(hvd_sparse.ddp.State(scheme=scheme, probe="off"),
                            hvd_sparse.ddp.hook)
    g = torch.Generator().manual_seed(rank)
    ids = (torch.rand(64, 4, generator=g) ** 3 * 4000).long()
    for m in (ref, ours):
        m(ids).square().mean().backward()
    errors[scheme] = max(float((a.grad - b.grad).abs().max()) for a, b in
                         zip(ref.parameters(), ours.parameters()))
    schemes[scheme] = sorted({m["scheme"] for m in hvd_sparse.metrics().values()})
    hvd_sparse.reset_metrics()
report = {"file": hvd_sparse.__file__, "errors": errors, "schemes": schemes,
          "horovod_imported": any(m.startswith("horovod") for m in sys.modules)}
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(report, f)
'''


def test_ddp_front_end_without_horovod(tmp_path: Path, wheel: Path) -> None:
    """torch's site-packages less Horovod (and the checkout's editable install) as the venv's
    dependencies: the DDP front end and the aggregator run; Horovod cannot be imported."""
    env = outside_env(tmp_path)
    site_packages = Path(importlib.util.find_spec("torch").origin).parents[1]
    site = tmp_path / "site"
    site.mkdir()
    for entry in site_packages.iterdir():
        if not entry.name.lower().startswith(("horovod", "hvd_sparse", "hvd-sparse",
                                              "__editable__")) and entry.suffix != ".pth":
            (site / entry.name).symlink_to(entry)
    bin_, installed = venv_with(tmp_path, wheel, [str(site)])
    probe = subprocess.run([str(bin_ / "python"), "-c", "import horovod"], cwd=tmp_path,
                           env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'horovod'" in probe.stderr, probe.stderr
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "check.py").write_text(DDP_WORKER)
    run([bin_ / "python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "check.py", out], work, env, timeout=300)
    for r in range(2):
        rep = json.loads((out / f"rank{r}.json").read_text())
        assert Path(rep["file"]).resolve().is_relative_to(installed.resolve()), rep["file"]
        assert rep["horovod_imported"] is False
        for scheme, err in rep["errors"].items():
            assert err <= 1e-6, f"rank {r} {scheme}: max error {err}"
            assert scheme in rep["schemes"][scheme], rep["schemes"]
