"""docs/nki-interpreter.md table: every rule the interpreter enforces, with the AWS doc file and the sentence it
implements (read from ``kernels/nki_cpu``'s registry, not from a results file)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.readme_tables import markdown_table


def render(results_dir: Path) -> str:
    from vllm_moe_w8.kernels.nki_cpu import RULES
    from vllm_moe_w8.kernels.nki_cpu.rules import DOC_COMMIT

    rows = [[f"`{r.id}`", f"`{r.doc}`", r.quote.replace("|", "\\|"), r.does.replace("|", "\\|")] for r in RULES.values()]
    return (markdown_table(["rule", f"aws-neuron-sdk @{DOC_COMMIT} file", "sentence", "what the interpreter does"], rows)
            + f"\n{len(rows)} rules; each has a rule test in tests/test_nki_doc_rules.py or tests/test_nki_doc_rules_engines.py.\n")
