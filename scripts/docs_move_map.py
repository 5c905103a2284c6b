"""Where the old README's content went when it was split into README.md + docs/*.md (issue #33): before -> after.

    python scripts/docs_move_map.py [--base REV] [--changed]

Reads README.md as it was at REV (default: the parent of the commit that first added docs/cost-model.md, i.e. the
last one-page README) with ``git show``, and the current README.md and docs/*.md from the working tree. Prints:

- every generated table of the old README, the page that holds it now, and the JSON files its module reads
  (the table is still rendered by ``benchmarks/tables/NAME.py`` from the same files);
- every heading of the old README, and for its section (heading to the next heading) the pages that now hold its
  lines, with how many of its non-blank lines stand there verbatim and how many do not;
- with ``--changed``, each old line that stands nowhere verbatim beside the closest current line (the references
  fixed by the move), so a reviewer can read every edit;
- prose lines that stand in more than one current page (a block the move duplicated).

Exits 1 when an old table or an old section has no current page, or when a line is duplicated across pages.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = re.compile(r"<!-- table:([\w-]+) -->")
HEADING = re.compile(r"^(#{1,6}) (.+)$")
JSON_NAME = re.compile(r"[\"']([\w.*-]+\.json)[\"']")
MIN_DUPLICATE_CHARS = 60  # shorter lines (table separators, "```", short list items) may repeat by nature
RENAMED = {"Serving with vLLM": "Serving on CPU with vLLM"}  # old heading -> its current name


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def default_base() -> str:
    added = git("log", "--diff-filter=A", "--format=%H", "--", "docs/cost-model.md").split()
    if not added:
        sys.exit("docs/cost-model.md was never committed: pass --base REV (the one-page README's commit)")
    return added[-1][:9] + "^"


def current_pages() -> dict[str, list[str]]:
    paths = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    return {str(p.relative_to(ROOT)): p.read_text().split("\n") for p in paths}


def sections(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(heading text, body lines) per heading outside code fences; lines before the first heading under ''."""
    out: list[tuple[str, list[str]]] = [("", [])]
    fenced = False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else HEADING.match(line)
        if m:
            out.append((m.group(2), []))
        else:
            out[-1][1].append(line)
    return out


def json_sources(name: str) -> list[str]:
    module = ROOT / "benchmarks" / "tables" / f"{name.replace('-', '_')}.py"
    return sorted(set(JSON_NAME.findall(module.read_text()))) if module.exists() else ["(no module)"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the commit of the one-page README (default: before docs/ was added)")
    parser.add_argument("--changed", action="store_true", help="print every old line not found verbatim")
    args = parser.parse_args(argv)
    base = args.base or default_base()
    old = git("show", f"{base}:README.md").split("\n")
    pages = current_pages()
    where_line: dict[str, set[str]] = defaultdict(set)
    for page, lines in pages.items():
        for line in lines:
            if line.strip():
                where_line[line].add(page)
    failures = 0

    print(f"old README: {base} ({len(old)} lines) -> " + ", ".join(f"{p} ({len(ls)})" for p, ls in pages.items()))
    print("\n## generated tables (before -> after; the JSON its module reads)")
    table_page = {name: page for page, lines in pages.items() for line in lines for name in TABLE.findall(line)}
    for line in old:
        for name in TABLE.findall(line):
            page = table_page.get(name)
            failures += page is None
            print(f"  {name}: README.md -> {page or 'NOWHERE'}  [{', '.join(json_sources(name))}]")

    print("\n## headings (before -> pages holding the section's lines: verbatim / not verbatim)")
    changed: list[tuple[str, str]] = []
    for heading, body in sections(old):
        lines = [line for line in body if line.strip()]
        held: dict[str, int] = defaultdict(int)
        missing, common = [], 0
        for line in lines:
            found = where_line.get(line)
            if not found:
                missing.append(line)
            elif len(found) > 1 and len(line.strip()) < MIN_DUPLICATE_CHARS:
                common += 1  # a fence, a table separator or a short line that stands in several pages
            else:
                for page in found:
                    held[page] += 1
        name = RENAMED.get(heading, heading)
        heading_pages = sorted(p for p, ls in pages.items() if any(HEADING.match(x) and HEADING.match(x).group(2) == name for x in ls))
        targets = ", ".join(f"{p} {n}" for p, n in sorted(held.items(), key=lambda kv: -kv[1])) or "NOWHERE"
        failures += not held and bool(lines)
        label = heading or "(before the first heading)"
        note = f"; heading kept in {', '.join(heading_pages)}" if heading_pages else "; heading not kept"
        if name != heading:
            note += f" as {name!r}"
        shared = f", short lines found in several pages {common}" if common else ""
        print(f"  {label} [{len(lines)} lines]: {targets}{shared}; not verbatim {len(missing)}{note}")
        changed += [(label, line) for line in missing]

    old_headings = {RENAMED.get(h, h) for h, _ in sections(old)}
    print("\n## headings added by the move (page: heading)")
    for page, lines in pages.items():
        for heading, _ in sections(lines)[1:]:
            if heading not in old_headings:
                print(f"  {page}: {heading}")

    if args.changed:
        print("\n## old lines found nowhere verbatim, beside the closest current line")
        every = list(where_line)
        for label, line in changed:
            close = difflib.get_close_matches(line, every, n=1, cutoff=0.5)
            print(f"  [{label}]\n    - {line}\n    + {close[0] if close else '(no close line)'}")

    print(f"\n## prose lines standing in more than one page (>= {MIN_DUPLICATE_CHARS} characters)")
    duplicated = {line: found for line, found in where_line.items() if len(found) > 1 and len(line.strip()) >= MIN_DUPLICATE_CHARS}
    for line, found in duplicated.items():
        print(f"  {', '.join(sorted(found))}: {line[:100]}")
    if not duplicated:
        print("  none")
    failures += len(duplicated)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
