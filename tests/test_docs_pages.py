"""README.md and docs/*.md as a user meets them: a short README whose quick start comes first and is the command CI
runs, links and anchors that resolve, and no prose block standing in two pages (the depth lives in one place)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300  # issue #33: a README for the people who run models; the depth is in docs/
QUICK_START = ("bash scripts/setup_cpu_env.sh && .venv/bin/vllm-moe-w8 demo",
               "bash scripts/setup_cpu_env.sh && bash scripts/test_vllm024.sh && .venv/bin/python -m pytest -q tests")
MIN_DUPLICATE_CHARS = 60  # shorter lines (fences, table separators, short items) may repeat by nature
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$")


def pages(root: Path = REPO) -> list[Path]:
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def prose_lines(text: str) -> list[str]:
    """The page's lines outside code fences."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def code_blocks(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"```[a-z]*\n(.*?)```", text, re.S)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(text):
        m = HEADING.match(line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def broken_links(paths: list[Path]) -> list[str]:
    """Every relative link (and #anchor) of the pages that does not resolve."""
    bad = []
    for path in paths:
        for line in prose_lines(path.read_text()):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # not inside code spans
                if re.match(r"[a-z]+:", target):
                    continue  # http(s), mailto: not checked here
                file, _, anchor = target.partition("#")
                dest = (path.parent / file).resolve() if file else path
                if not dest.exists():
                    bad.append(f"{path.name}: {target} (no file {file})")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                    bad.append(f"{path.name}: {target} (no heading #{anchor} in {dest.name})")
    return bad


def repeated_lines(paths: list[Path]) -> dict[str, list[str]]:
    """Prose lines of at least MIN_DUPLICATE_CHARS characters that stand in more than one page."""
    where: dict[str, set[str]] = {}
    for path in paths:
        for line in prose_lines(path.read_text()):
            if len(line.strip()) >= MIN_DUPLICATE_CHARS:
                where.setdefault(line.strip(), set()).add(path.name)
    return {line: sorted(found) for line, found in where.items() if len(found) > 1}


def test_readme_is_short_and_starts_with_the_quick_start_ci_runs():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert tuple(code_blocks(text)[:2]) == QUICK_START
    before = text[:text.index("```")]
    assert before.count("\n## ") == 1 and "## Quick start" in before  # the quick start is the first section
    ci = (REPO / ".ci" / "run").read_text()
    assert f"#   {QUICK_START[1]}\n" in ci  # the README's test command is the one CI says it runs


def test_every_link_and_anchor_resolves():
    assert broken_links(pages()) == []


def test_no_prose_line_stands_in_two_pages():
    assert repeated_lines(pages()) == {}


def test_the_checks_catch_a_broken_link_a_missing_anchor_and_a_copied_block(tmp_path):
    """Fault injection: a stand-in README and docs page with one fault each are refused, the clean pair passes."""
    (tmp_path / "docs").mkdir()
    readme, topic = tmp_path / "README.md", tmp_path / "docs" / "topic.md"
    claim = "neuron-w8 repacks the experts to Trn2 FP8 at load time, exactly, and keeps them as uint8."
    topic.write_text("# Topic\n\n## What ran where — on CPU\n\n" + claim + "\n")
    readme.write_text("# r\n\nSee [the topic](docs/topic.md#what-ran-where--on-cpu).\n")
    assert broken_links(pages(tmp_path)) == [] and repeated_lines(pages(tmp_path)) == {}
    readme.write_text("# r\n\nSee [the topic](docs/topic.md#what-ran-where) and [gone](docs/gone.md).\n" + claim + "\n")
    assert broken_links(pages(tmp_path)) == ["README.md: docs/topic.md#what-ran-where (no heading #what-ran-where in topic.md)",
                                             "README.md: docs/gone.md (no file docs/gone.md)"]
    assert repeated_lines(pages(tmp_path)) == {claim: ["README.md", "topic.md"]}
