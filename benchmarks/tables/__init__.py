"""One module per generated table of README.md or a docs/*.md page: ``render(results_dir: Path) -> str``
(see ``benchmarks/readme_tables.py``)."""
