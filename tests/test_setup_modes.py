"""What each make target installs (issue 55): `make build`, a training host's set-up, takes
scripts/setup/setup.sh's runtime mode, whose Debian packages hold no Slurm, munge, DPDK, nftables or
packet capture and whose Python packages no test or docs tools; the targets that test,
benchmark or run testbeds take the full set-up first. Read from what make would run
(``make -n``) and from scripts/setup/versions.env, as the set-up reads them."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB_ONLY = {"slurm-wlm", "munge", "libdpdk-dev", "nftables", "libpcap0.8", "ethtool"}
TEST_TOOLS = {"pytest", "pytest-timeout", "hypothesis", "ruff", "kubernetes-validate", "mkdocs"}


def versions() -> dict[str, str]:
    """scripts/setup/versions.env's variables, as bash sources them."""
    out = subprocess.run(["bash", "-c", "set -a; source scripts/setup/versions.env; env -0"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    return dict(kv.split("=", 1) for kv in out.decode().split("\0") if "=" in kv)


def setup_runs(target: str) -> list[str]:
    """The set-up commands ``make <target>`` would run first (make -n: nothing runs)."""
    out = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return [ln.strip() for ln in out.splitlines() if "scripts/setup/setup.sh" in ln]


@pytest.mark.unit
def test_a_training_hosts_set_up_has_no_lab_tools():
    v = versions()
    runtime = set(v["APT_RUNTIME_PACKAGES"].split())
    assert runtime and not runtime & LAB_ONLY, runtime & LAB_ONLY
    assert LAB_ONLY <= set(v["APT_PACKAGES"].split())  # the full set-up has them
    assert setup_runs("build") == ["HVD_SPARSE_SETUP=runtime bash scripts/setup/setup.sh"]
    apps = {d.split("==")[0] for d in v["PY_APP_DEPS"].split() + v["PY_BUILD_DEPS"].split()}
    assert not apps & TEST_TOOLS, apps & TEST_TOOLS
    setup = (ROOT / "scripts" / "setup" / "setup.sh").read_text()
    assert 'runtime) APT_PACKAGES=$APT_RUNTIME_PACKAGES; PY_TEST_DEPS="" ;;' in setup


@pytest.mark.unit
@pytest.mark.parametrize("target", ["test", "test-extended", "test-fast", "demo", "bench",
                                    "fuzz", "sanitize"])
def test_the_lab_targets_take_the_full_set_up(target: str):
    assert "bash scripts/setup/setup.sh" in setup_runs(target), setup_runs(target)
