"""What adopting the project needs holds together: one version everywhere (the package, its
metadata, the citation, the changelog's latest release, ``hvd-sparse --version``), an
Apache-2.0 license, and a library logger that leaves the application's logging alone."""
from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hvd_sparse

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.unit


def test_one_version_everywhere() -> None:
    v = hvd_sparse.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", v), v
    assert f'version="{v}"' in (ROOT / "setup.py").read_text()
    assert re.search(rf"^version: {re.escape(v)}$", (ROOT / "CITATION.cff").read_text(), re.M)
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert released and released[0] == v, released
    out = subprocess.run([sys.executable, "-m", "hvd_sparse.tools.cli", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"hvd-sparse {v}", out


def test_license_is_apache_2() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_library_logger_leaves_the_root_logger_alone(caplog: pytest.LogCaptureFixture) -> None:
    """A NullHandler on the library's logger, none added to the root logger; the level of
    ``log_level`` and the rank on every record once a front end configured it."""
    from hvd_sparse import logs
    root_handlers = list(logging.getLogger().handlers)
    lib = logging.getLogger("hvd_sparse")
    assert any(isinstance(h, logging.NullHandler) for h in lib.handlers)
    try:
        logs.configure("info", 3)
        assert lib.level == logging.INFO
        with caplog.at_level(logging.INFO, logger="hvd_sparse"):
            lib.info("hvd_sparse: something %s", "happened")
        (rec,) = [r for r in caplog.records if r.name == "hvd_sparse"]
        assert rec.rank == 3 and rec.getMessage() == "[rank 3] hvd_sparse: something happened"
    finally:
        logs.configure("warning", 0)
        logs._rank = None
    assert logging.getLogger().handlers == root_handlers
