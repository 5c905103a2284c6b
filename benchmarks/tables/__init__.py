"""One module per generated README table: ``render(results_dir: Path) -> str`` (see ``benchmarks/readme_tables.py``)."""
