"""docs/configuration.md is the configuration reference: every ``Config`` field has its row
(option, its ``HVD_SPARSE_*`` variable, the default the code has), and every ``HVD_SPARSE_*``
variable the package reads appears on the page (the tools' own marked as such there)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from hvd_sparse.config import Config

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "configuration.md").read_text()
pytestmark = pytest.mark.unit
# defaults the page words rather than prints
WORDED = {"cache_dir": "~/.cache/hvd_sparse", "aggregator_host": "automatic"}
# build-time macros, not variables any process reads
NOT_VARIABLES = {"HVD_SPARSE_DPDK"}


def rows() -> dict[str, tuple[str, str]]:
    """option -> (variable, default) from the page's tables."""
    found = {}
    for m in re.finditer(r"^\| `(\w+)` \| `(HVD_SPARSE_\w+)` \| ([^|]+) \|", PAGE, re.M):
        found[m.group(1)] = (m.group(2), m.group(3).strip().strip("`"))
    return found


def shown(name: str, value: object) -> str:
    if name in WORDED:
        return WORDED[name]
    if isinstance(value, bool):
        return "on" if value else "off"
    if value == "":
        return "empty"
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_every_option_has_its_row_with_the_codes_default() -> None:
    table = rows()
    bad = []
    for f in dataclasses.fields(Config):
        if f.name not in table:
            bad.append(f"{f.name}: no row")
            continue
        var, default = table[f.name]
        if var != f"HVD_SPARSE_{f.name.upper()}":
            bad.append(f"{f.name}: variable {var}")
        if default != shown(f.name, f.default):
            bad.append(f"{f.name}: page says {default!r}, the code {shown(f.name, f.default)!r}")
    extra = set(table) - {f.name for f in dataclasses.fields(Config)}
    assert not bad and not extra, (bad, sorted(extra))


def test_every_variable_the_package_reads_is_on_the_page() -> None:
    read = set()
    lab = ROOT / "hvd_sparse" / "tools" / "lab"  # the scripts' helpers: their own variables
    for path in [*(ROOT / "hvd_sparse").rglob("*.py"), ROOT / "setup.py"]:
        if lab not in path.parents:
            read |= set(re.findall(r"HVD_SPARSE_[A-Z0-9_]+", path.read_text()))
    missing = sorted(v for v in read - NOT_VARIABLES if f"`{v}`" not in PAGE)
    assert not missing, missing
