"""docs/ARCHITECTURE.md against the tree: every runtime module (hvd_sparse/ but its tools/) is
named there, and every file or folder it names exists, so the page cannot fall behind a module
added, moved or removed."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "ARCHITECTURE.md"
# where a name on the page may be relative to: the page names files as the code around them does
BASES = [ROOT, ROOT / "hvd_sparse", ROOT / "hvd_sparse" / "tools", ROOT / "csrc",
         ROOT / "csrc" / "omni"]
PATHLIKE = re.compile(r"^[\w./*-]+(\.(py|cpp|h|cu|cuh|md)|/)$")


def named() -> set[str]:
    """Every code span of the page that names a file or a folder."""
    spans = re.findall(r"`([^`\n]+)`", PAGE.read_text())
    return {s for s in spans if PATHLIKE.match(s)}


def runtime_modules() -> list[str]:
    pkg = ROOT / "hvd_sparse"
    return sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py")
                  if "tools" not in p.relative_to(pkg).parts)


def test_every_runtime_module_is_named() -> None:
    spans = named()
    missing = [m for m in runtime_modules() if m not in spans and f"hvd_sparse/{m}" not in spans]
    assert not missing, f"docs/ARCHITECTURE.md does not name {missing}"


def test_every_path_named_exists() -> None:
    gone = [s for s in sorted(named())
            if not any(list(base.glob(s.rstrip("/"))) for base in BASES)]
    assert not gone, f"docs/ARCHITECTURE.md names what is not in the tree: {gone}"


def test_the_check_sees_the_page() -> None:
    """The two checks above pass vacuously on a page whose names they cannot read."""
    spans = named()
    assert {"hvd_sparse/reduction.py", "csrc/omni/protocol.h", "schemes/zen.py"} <= spans
