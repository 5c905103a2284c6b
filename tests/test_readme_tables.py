"""README's generated tables equal what ``benchmarks/readme_tables.py`` renders from the committed JSON."""

from __future__ import annotations

from benchmarks import readme_tables


def test_readme_tables_match_recorded_json():
    text = readme_tables.README.read_text()
    _, changed = readme_tables.update(text)
    assert not changed, (f"README tables {changed} differ from benchmarks/results; "
                         "run `.venv/bin/python -m benchmarks.readme_tables`")


def test_check_fails_on_an_edited_table(monkeypatch):
    """Fault injection: a hand-edited number inside a generated block is caught (on every real table, and on a
    stand-in table so the check is exercised before README has any)."""
    text = readme_tables.README.read_text()
    for name in readme_tables.table_names(text):
        start = text.index(f"<!-- table:{name} -->") + len(f"<!-- table:{name} -->")
        end = text.index(f"<!-- /table:{name} -->")
        digit = next((i for i in range(start, end) if text[i].isdigit()), None)
        if digit is None:
            continue
        edited = text[:digit] + str((int(text[digit]) + 1) % 10) + text[digit + 1:]
        assert name in readme_tables.update(edited)[1]

    monkeypatch.setattr(readme_tables, "render", lambda name, results_dir=None: "| ms |\n|---|\n| 1.25 |\n")
    stand_in = "before\n<!-- table:stand-in -->\n| ms |\n|---|\n| 1.25 |\n<!-- /table:stand-in -->\nafter\n"
    assert readme_tables.update(stand_in) == (stand_in, [])
    assert readme_tables.update(stand_in.replace("1.25", "1.26"))[1] == ["stand-in"]


def test_docs_pages_tables_match_recorded_json():
    for page in readme_tables.pages()[1:]:
        _, changed = readme_tables.update(page.read_text())
        assert not changed, (f"{page.name} tables {changed} differ from benchmarks/results; "
                             "run `.venv/bin/python -m benchmarks.readme_tables`")
