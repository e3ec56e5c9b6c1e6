"""The results pages against docs/results.yaml, and the pages against dates, clock times and hashes.

Each headline figure is held once, in docs/results.yaml. These tests fail where a page says
otherwise: a results table that differs from what scripts/checks/results_tables.py writes from the
data, a speedup quoted on a page that no claim holds, a claim whose command or figures its
details section does not show. The last test keeps dates, clock times and commit hashes (the
lab notebook's material) in docs/notes/.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

_spec = importlib.util.spec_from_file_location("results_tables",
                                               ROOT / "scripts" / "checks" / "results_tables.py")
results_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_tables)

CLAIMS = results_tables.load()

pytestmark = pytest.mark.unit

# "1.60-1.68x", "2.5x", "0.28-0.41x": a speedup as the pages write it.
SPEEDUP = re.compile(r"(?<![\w.-])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b")


def _unreleased(text: str) -> str:
    start = text.index("## [Unreleased]")
    end = text.index("\n## [", start + 1)
    return text[start:end]


# The pages whose every speedup must be one of the data file's: the pages a reader meets first,
# and the changelog entry that quotes the benchmark. The details pages (BENCHMARKS.md, SCALE.md,
# CONVERGENCE.md) hold the runs' own tables, checked claim by claim below.
QUOTING = {
    "README.md": lambda t: t,
    "docs/index.md": lambda t: t,
    "docs/results.md": lambda t: t,
    "docs/faq.md": lambda t: t,
    "CHANGELOG.md": _unreleased,
}


def test_tables_written_from_the_data():
    assert results_tables.main(["--check"]) == 0, "run: python scripts/checks/results_tables.py"


def test_every_claim_names_workload_command_and_details():
    for c in CLAIMS:
        for field in ("id", "what", "figures", "workload", "setup", "command", "script",
                      "details", "tables"):
            assert c.get(field), f"{c.get('id')}: no {field}"
        assert set(c["tables"]) <= set(results_tables.PAGES), c["id"]
        for fig in c["figures"]:
            assert "value" in fig and "unit" in fig, f"{c['id']}: a figure without value or unit"
    ids = [c["id"] for c in CLAIMS]
    assert len(ids) == len(set(ids))


def test_a_changed_figure_fails_the_check():
    claims = [dict(c) for c in CLAIMS]
    claims[0] = dict(claims[0], figures=[{"value": "9.99", "unit": "x", "label": "made up"}])
    page = (ROOT / "README.md").read_text()
    assert results_tables.update(page, "readme", CLAIMS) == page
    assert results_tables.update(page, "readme", claims) != page


@pytest.mark.parametrize("page", sorted(QUOTING))
def test_quoted_speedups_are_the_datas(page):
    allowed = set().union(*(results_tables.speedups(c) for c in CLAIMS))
    text = QUOTING[page]((ROOT / page).read_text())
    stray = sorted({m.group(0) for m in SPEEDUP.finditer(text)} - allowed)
    assert not stray, f"{page} quotes speedups that docs/results.yaml does not hold: {stray}"


def _slug(heading: str) -> str:
    """The anchor MkDocs' toc extension gives a heading."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[-\s]+", "-", text)


def _section(page: Path, anchor: str) -> str:
    lines = page.read_text().split("\n")
    fence = False
    for i, line in enumerate(lines):
        fence ^= line.startswith("```")
        m = None if fence else re.match(r"(#+) (.*)", line)
        if m and _slug(m.group(2)) == anchor:
            level, body, inner = len(m.group(1)), [], False
            for rest in lines[i + 1:]:
                inner ^= rest.startswith("```")
                h = None if inner else re.match(r"(#+) ", rest)
                if h and len(h.group(1)) <= level:
                    break
                body.append(rest)
            return "\n".join(body)
    raise AssertionError(f"{page.name} has no section #{anchor}")


def _flat(text: str) -> str:
    """Text with line continuations, code marks and line breaks folded away."""
    return " ".join(text.replace("\\\n", " ").replace("`", "").split())


@pytest.mark.parametrize("claim", CLAIMS, ids=[c["id"] for c in CLAIMS])
def test_details_section_shows_command_and_figures(claim):
    page, anchor = claim["details"].split("#")
    section = _flat(_section(DOCS / page, anchor))
    for command in claim["command"].splitlines():
        assert _flat(command) in section, (
            f"{claim['id']}: {page}#{anchor} does not show `{command}`")
    for fig in claim["figures"]:
        for end in str(fig["value"]).split("-"):
            assert re.search(rf"(?<![\d.]){re.escape(end)}(?![\d])", section), (
                f"{claim['id']}: {page}#{anchor} does not show the figure {end}")


# Dates (2026-11-28), clock times (12:35 UTC, 13:57-13:59 UTC) and commit hashes (7-40 hex
# digits with at least one letter and one digit; a hash of digits alone is not told from a
# number) belong to the lab notebook, docs/notes/. The pages checked: README.md, CHANGELOG.md
# and every Markdown page under docs/ outside docs/notes/.
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
CLOCK = re.compile(r"\b\d{1,2}:\d{2}(?:-\d{1,2}:\d{2})? ?UTC\b")
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
# The exceptions, each a (page, line pattern) pair, kept few: a release heading carries its
# date by Keep a Changelog's format.
EXEMPT = [
    ("CHANGELOG.md", re.compile(r"^## \[\d+\.\d+\.\d+\] - \d{4}-\d{2}-\d{2}$")),
]


def _pages():
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    pages += sorted(p for p in DOCS.rglob("*.md") if DOCS / "notes" not in p.parents)
    return pages


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dates_clock_times_or_hashes_outside_the_notes(page):
    rel = str(page.relative_to(ROOT))
    found = []
    for n, line in enumerate(page.read_text().split("\n"), 1):
        if any(rel == name and pat.match(line) for name, pat in EXEMPT):
            continue
        for pattern in (DATE, CLOCK, HASH):
            found += [f"{rel}:{n}: {m.group(0)}" for m in pattern.finditer(line)]
    assert not found, "move to docs/notes/: " + "; ".join(found)


def test_the_date_patterns_catch_what_they_should():
    assert DATE.search("(2026-11-28, 12:35 UTC)") and CLOCK.search("(2026-11-28, 12:35 UTC)")
    assert CLOCK.search("13:57-13:59 UTC") and HASH.search("checkout (0d48f3e and 3417afd)")
    assert not HASH.search("--numel 6553600") and not HASH.search("doi:10.1145/3452296.3472904")
