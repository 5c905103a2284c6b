"""README's generated tables equal what ``benchmarks/readme_tables.py`` renders from the committed JSON."""

from __future__ import annotations

import pytest

from benchmarks import readme_tables


def test_readme_tables_match_recorded_json():
    text = readme_tables.README.read_text()
    _, changed = readme_tables.update(text)
    assert not changed, (f"README tables {changed} differ from benchmarks/results; "
                         "run `.venv/bin/python -m benchmarks.readme_tables`")


def test_check_fails_on_an_edited_table(tmp_path):
    """Fault injection: a hand-edited number inside a generated block is caught."""
    text = readme_tables.README.read_text()
    names = readme_tables.table_names(text)
    if not names:
        pytest.skip("README has no generated table yet")
    start = text.index(f"<!-- table:{names[0]} -->")
    end = text.index(f"<!-- /table:{names[0]} -->")
    block = text[start:end]
    digit = next(i for i, ch in enumerate(block) if ch.isdigit() and i > len(f"<!-- table:{names[0]} -->"))
    edited = text[:start] + block[:digit] + str((int(block[digit]) + 1) % 10) + block[digit + 1:] + text[end:]
    _, changed = readme_tables.update(edited)
    assert names[0] in changed
