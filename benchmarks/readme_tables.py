"""README tables generated from the recorded benchmark JSON (``benchmarks/results/*.json``).

Every generated table sits in README.md (or a docs/*.md page) between two markers::

    <!-- table:NAME -->
    ...generated markdown...
    <!-- /table:NAME -->

and is produced by ``benchmarks/tables/NAME.py``, a module with ``render(results_dir: Path) -> str``.
``python -m benchmarks.readme_tables`` rewrites every marked block; ``--check`` only compares and exits 1
naming the tables that differ (``tests/test_readme_tables.py`` runs the same check). Adding a table is adding
a module and a marker pair; nothing here changes.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def pages() -> list[Path]:
    """The pages whose marked tables are generated: README.md and every docs/*.md."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)


def render(name: str, results_dir: Path = RESULTS) -> str:
    """The markdown of table ``name`` (``benchmarks/tables/<name>.py``), ending with a newline."""
    module = importlib.import_module(f"benchmarks.tables.{name.replace('-', '_')}")
    text = module.render(results_dir)
    return text if text.endswith("\n") else text + "\n"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; cells are ``str()``-ed as given (format numbers before)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def update(text: str, results_dir: Path = RESULTS) -> tuple[str, list[str]]:
    """(README text with every marked table regenerated, names of the tables that changed)."""
    changed: list[str] = []

    def sub(match: re.Match) -> str:
        body = render(match.group("name"), results_dir)
        if body != match.group("body"):
            changed.append(match.group("name"))
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(sub, text), changed


def table_names(text: str) -> list[str]:
    return [m.group("name") for m in BLOCK.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if README differs")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text()
        new, changed = update(text)
        name = page.relative_to(ROOT)
        if args.check:
            if changed:
                stale.append(f"{name}: {', '.join(changed)}")
            else:
                print(f"{name} tables up to date: {', '.join(table_names(text)) or '(none)'}")
            continue
        page.write_text(new)
        print(f"{name} regenerated: {', '.join(changed) or '(nothing changed)'}")
    if stale:
        print(f"tables out of date with benchmarks/results: {'; '.join(stale)}; run `.venv/bin/python -m "
              "benchmarks.readme_tables`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
