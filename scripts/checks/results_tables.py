"""Write the results tables of README.md, docs/results.md, docs/BENCHMARKS.md from the data.

The data: docs/results.yaml.

Each table sits between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` on its page;
this script rewrites what is between them. ``--check`` writes nothing and exits 1, naming the
page, where a table differs from what the data file gives (tests/test_results_pages.py runs it).

    python scripts/checks/results_tables.py          # rewrite the tables
    python scripts/checks/results_tables.py --check  # fail where a page disagrees with the data
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "results.yaml"

# table name -> (page, how a details link is written from that page)
PAGES = {
    "readme": ROOT / "README.md",
    "results": ROOT / "docs" / "results.md",
    "benchmarks": ROOT / "docs" / "BENCHMARKS.md",
}


def load(path: Path = DATA) -> list[dict]:
    """The claims of the data file, in order."""
    return yaml.safe_load(path.read_text())["claims"]


def figure_text(fig: dict) -> str:
    """One figure as the pages print it: "1.60-1.68x Gaussian ids", "0.5-0.6% at 1 Gbit/s"."""
    if "text" in fig:
        return fig["text"]
    unit = fig["unit"]
    value = f"{fig['value']}{unit}" if unit in ("x", "%") else f"{fig['value']} {unit}"
    return f"{value} {fig['label']}" if fig.get("label") else value


def figures_text(claim: dict) -> str:
    text = ", ".join(figure_text(f) for f in claim["figures"])
    return f"{text} ({claim['note']})" if claim.get("note") else text


def speedups(claim: dict) -> set[str]:
    """The claim's figures in x, as printed ("1.60-1.68x") and each end ("1.60x")."""
    out = set()
    for fig in claim["figures"]:
        if fig.get("unit") != "x":
            continue
        value = fig["value"]
        out.add(f"{value}x")
        out.update(f"{end}x" for end in value.split("-"))
    out.update(f"{v}x" for v in claim.get("was", []))
    return out


def _link(details: str, table: str) -> str:
    if table == "readme":
        return f"docs/{details}"
    if table == "benchmarks" and details.startswith("BENCHMARKS.md#"):
        return details[len("BENCHMARKS.md"):]
    return details


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(table: str, claims: list[dict]) -> str:
    rows = [c for c in claims if table in c.get("tables", [])]
    if table == "readme":
        lines = ["| what | figure | workload | set-up |", "|---|---|---|---|"]
        for c in rows:
            fig = f"[{figures_text(c)}]({_link(c['details'], table)})"
            lines.append(f"| {_cell(c['what'])} | {_cell(fig)} | {_cell(c['workload'])} | "
                         f"{_cell(c['setup'])} |")
    else:
        lines = ["| claim | figure | workload | set-up | command |", "|---|---|---|---|---|"]
        for c in rows:
            cmd = f"`{c['script']}` ([details]({_link(c['details'], table)}))"
            lines.append(f"| {_cell(c['what'])} | {_cell(figures_text(c))} | "
                         f"{_cell(c['workload'])} | {_cell(c['setup'])} | {_cell(cmd)} |")
    return "\n".join(lines)


def _markers(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- results:{name} -->\n)(.*?)(\n<!-- /results:{name} -->)", re.S)


def update(text: str, table: str, claims: list[dict]) -> str:
    pattern = _markers(table)
    if not pattern.search(text):
        raise SystemExit(f"no <!-- results:{table} --> markers")
    body = render(table, claims)
    return pattern.sub(lambda m: m.group(1) + body + m.group(3), text, count=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 where a page differs")
    args = ap.parse_args(argv)
    claims = load()
    stale = []
    for table, page in PAGES.items():
        text = page.read_text()
        new = update(text, table, claims)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print("results tables differ from docs/results.yaml on: " + ", ".join(map(str, stale))
              + " (run python scripts/checks/results_tables.py)", file=sys.stderr)
        return 1
    for page in stale:
        print(f"rewrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
