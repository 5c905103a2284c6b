"""Generated tables of README.md and docs/*.md, rendered from the benchmark JSON (``benchmarks/results/*.json``).

Every generated table sits in one page (README.md or a page of docs/, where its topic lives) between two markers::

    <!-- table:NAME -->
    ...generated markdown...
    <!-- /table:NAME -->

and is produced by ``benchmarks/tables/NAME.py``, a module with ``render(results_dir: Path) -> str``.
``python -m benchmarks.readme_tables`` rewrites every marked block of every page; ``--check`` only compares and
exits 1 naming the page and the tables that differ, a table placed on two pages (or twice on one), and a table
module placed on no page (``tests/test_readme_tables.py`` runs the same check). Adding a table is adding a module
and a marker pair in the page of its topic; nothing here changes.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
TABLES = Path(__file__).resolve().parent / "tables"
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
    """(one page's text with every marked table regenerated, names of the tables that changed)."""
    changed: list[str] = []

    def sub(match: re.Match) -> str:
        body = render(match.group("name"), results_dir)
        if body != match.group("body"):
            changed.append(match.group("name"))
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(sub, text), changed


def table_names(text: str) -> list[str]:
    return [m.group("name") for m in BLOCK.finditer(text)]


def pages() -> list[Path]:
    """The pages that may hold generated tables: README.md, then every docs/*.md."""
    return [README] + (sorted(DOCS.glob("*.md")) if DOCS.is_dir() else [])


def table_modules() -> list[str]:
    """Every table a module of ``benchmarks/tables/`` renders."""
    return sorted(p.stem for p in TABLES.glob("*.py") if p.stem != "__init__")


def placement(paths: list[Path] | None = None) -> tuple[dict[str, Path], list[str]]:
    """({table name: the page holding it}, problems): a table on two pages or twice on one, a module on no page."""
    where: dict[str, Path] = {}
    problems: list[str] = []
    for path in paths if paths is not None else pages():
        for name in table_names(path.read_text()):
            if name in where:
                problems.append(f"table {name} is placed twice: {_rel(where[name])} and {_rel(path)}")
            else:
                where[name] = path
    if paths is None:
        problems += [f"table {name} (benchmarks/tables/{name}.py) is placed on no page" for name in table_modules()
                     if name.replace("_", "-") not in where and name not in where]
    return where, problems


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if a page differs")
    args = parser.parse_args(argv)
    _, problems = placement()
    stale: list[str] = []
    for path in pages():
        text = path.read_text()
        new, changed = update(text)
        if changed:
            stale.append(f"{_rel(path)}: {', '.join(changed)}")
        if not args.check and new != text:
            path.write_text(new)
    if args.check:
        if stale or problems:
            for line in problems:
                print(line, file=sys.stderr)
            if stale:
                print(f"tables out of date with benchmarks/results: {'; '.join(stale)}; "
                      "run `.venv/bin/python -m benchmarks.readme_tables`", file=sys.stderr)
            return 1
        where, _ = placement()
        print("tables up to date: " + ("; ".join(f"{_rel(p)}: {n}" for n, p in where.items()) or "(none)"))
        return 0
    for line in problems:
        print(line, file=sys.stderr)
    print(f"regenerated: {'; '.join(stale) or '(nothing changed)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
