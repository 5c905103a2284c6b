"""The generated tables of README.md and every docs/*.md page equal what ``benchmarks/readme_tables.py`` renders from
the committed JSON; each table module is placed on exactly one page."""

from __future__ import annotations

import pytest

from benchmarks import readme_tables


def test_every_page_holds_no_stale_table():
    stale = {}
    for path in readme_tables.pages():
        _, changed = readme_tables.update(path.read_text())
        if changed:
            stale[path.name] = changed
    assert not stale, (f"tables {stale} differ from benchmarks/results; run `.venv/bin/python -m benchmarks.readme_tables`")


def test_every_table_module_is_placed_on_exactly_one_page():
    where, problems = readme_tables.placement()
    assert not problems, problems
    assert sorted(where) == readme_tables.table_modules()
    assert readme_tables.main(["--check"]) == 0


def test_check_fails_on_an_edited_table(monkeypatch):
    """Fault injection: a hand-edited number inside a generated block is caught (on every real table of every page,
    and on a stand-in table so the check is exercised whatever the pages hold)."""
    checked = 0
    for path in readme_tables.pages():
        text = path.read_text()
        for name in readme_tables.table_names(text):
            start = text.index(f"<!-- table:{name} -->") + len(f"<!-- table:{name} -->")
            end = text.index(f"<!-- /table:{name} -->")
            digit = next((i for i in range(start, end) if text[i].isdigit()), None)
            if digit is None:
                continue
            edited = text[:digit] + str((int(text[digit]) + 1) % 10) + text[digit + 1:]
            assert name in readme_tables.update(edited)[1]
            checked += 1
    assert checked == len(readme_tables.table_modules())

    monkeypatch.setattr(readme_tables, "render", lambda name, results_dir=None: "| ms |\n|---|\n| 1.25 |\n")
    stand_in = "before\n<!-- table:stand-in -->\n| ms |\n|---|\n| 1.25 |\n<!-- /table:stand-in -->\nafter\n"
    assert readme_tables.update(stand_in) == (stand_in, [])
    assert readme_tables.update(stand_in.replace("1.25", "1.26"))[1] == ["stand-in"]


@pytest.fixture
def stand_in_pages(tmp_path, monkeypatch):
    """A README and a docs/ page in a scratch folder, each holding one stand-in table."""
    monkeypatch.setattr(readme_tables, "README", tmp_path / "README.md")
    monkeypatch.setattr(readme_tables, "DOCS", tmp_path / "docs")
    monkeypatch.setattr(readme_tables, "TABLES", tmp_path / "tables")
    (tmp_path / "docs").mkdir()
    (tmp_path / "tables").mkdir()
    for name in ("front", "deep"):
        (tmp_path / "tables" / f"{name}.py").write_text("")
    bodies = {"front": "| ms |\n|---|\n| 1.25 |\n", "deep": "| GB |\n|---|\n| 9.51 |\n"}
    monkeypatch.setattr(readme_tables, "render", lambda name, results_dir=None: bodies[name])
    (tmp_path / "README.md").write_text(f"# r\n<!-- table:front -->\n{bodies['front']}<!-- /table:front -->\n")
    (tmp_path / "docs" / "topic.md").write_text(f"# t\n<!-- table:deep -->\n{bodies['deep']}<!-- /table:deep -->\n")
    return tmp_path


def test_check_reads_every_page_and_rewrite_fixes_the_page_that_differs(stand_in_pages, capsys):
    assert readme_tables.main(["--check"]) == 0
    page = stand_in_pages / "docs" / "topic.md"
    page.write_text(page.read_text().replace("9.51", "9.52"))
    assert readme_tables.main(["--check"]) == 1
    assert "docs/topic.md: deep" in capsys.readouterr().err
    assert readme_tables.main([]) == 0
    assert "9.51" in page.read_text() and readme_tables.main(["--check"]) == 0


def test_a_table_on_two_pages_or_on_none_fails_the_check(stand_in_pages, capsys):
    readme = stand_in_pages / "README.md"
    original = readme.read_text()
    readme.write_text(original + (stand_in_pages / "docs" / "topic.md").read_text())
    assert readme_tables.main(["--check"]) == 1
    assert "table deep is placed twice" in capsys.readouterr().err
    readme.write_text("# r\n")
    assert readme_tables.main(["--check"]) == 1
    assert "table front (benchmarks/tables/front.py) is placed on no page" in capsys.readouterr().err
