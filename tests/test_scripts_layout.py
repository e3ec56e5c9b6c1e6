"""scripts/ by role against the tree: every script lives in a role's folder (or is the demo),
none edits ``sys.path`` to reach what it shares (hvd_sparse.tools.lab is a package), and every
``scripts/...`` path that the code, the docs or the build names exists, so a script moved or
renamed cannot leave a stale command behind (docs/notes/, the lab notebook, keeps old ones)."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
ROLES = ("bench", "checks", "setup", "testbed")
# a file a command names: scripts/<folder>/<name>.py, .sh or .env
NAMED = re.compile(r"scripts/[\w./-]+?\.(?:py|sh|env)\b")
# where commands are written; docs/notes/ is history and keeps the paths of its day
WHERE = ["README.md", "CHANGELOG.md", "Makefile", "setup.py", ".ci", "docs", "docker",
         "deploy", "examples", "scripts", "tests", "hvd_sparse", "csrc", "fuzz"]
SKIP_SUFFIXES = {".so", ".png", ".pyc", ".whl", ".gz", ".bin"}


def texts() -> dict[Path, str]:
    out = {}
    for name in WHERE:
        top = ROOT / name
        for p in [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []:
            rel = p.relative_to(ROOT)
            if not p.is_file() or p.suffix in SKIP_SUFFIXES or "__pycache__" in rel.parts \
                    or rel.parts[:2] == ("docs", "notes") or rel.parts[:2] == ("fuzz", "corpus"):
                continue
            try:
                out[rel] = p.read_text()
            except UnicodeDecodeError:
                continue
    return out


def test_every_script_is_in_a_role_folder() -> None:
    top = sorted(p.name for p in SCRIPTS.iterdir() if p.name != "__pycache__")
    assert top == sorted(["README.md", "demo.py", *ROLES]), top
    readme = (SCRIPTS / "README.md").read_text()
    for role in ROLES:
        assert f"`{role}/`" in readme, f"scripts/README.md does not describe {role}/"
        assert not (SCRIPTS / role / "__init__.py").exists(), f"scripts/{role}/ is no package"


def test_no_script_edits_sys_path() -> None:
    edits = [f"{p.relative_to(ROOT)}:{n}" for p in sorted(SCRIPTS.rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bsys\.path\s*(\[|\.insert|\.append|\+?=)", line)]
    assert not edits, f"import hvd_sparse.tools.lab instead: {edits}"


@pytest.mark.parametrize("module", ["report", "inputs", "dlrm", "accuracy", "demo_report"])
def test_the_shared_helpers_are_a_package(module: str) -> None:
    importlib.import_module(f"hvd_sparse.tools.lab.{module}")


def test_every_scripts_path_named_exists() -> None:
    found = {(rel, m) for rel, text in texts().items() for m in NAMED.findall(text)}
    assert len({m for _, m in found}) > 20, "the check sees too few commands to mean anything"
    gone = sorted(f"{rel}: {m}" for rel, m in found if not (ROOT / m).is_file())
    assert not gone, "named but not in the tree:\n" + "\n".join(gone)
