"""docs/lifecycle.md embeds diagrams and tables generated from the code; they must agree."""

from __future__ import annotations

from pathlib import Path

from lifecycle import TABLES
from lifecycle.diagram import doc_blocks, pdlife_doc_extra, sync_docs

DOC = Path(__file__).resolve().parent.parent / "docs" / "lifecycle.md"


def test_lifecycle_doc_matches_the_tables() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert sync_docs(text, TABLES, pdlife_doc_extra()) == text, (
        "docs/lifecycle.md is out of date with the lifecycle tables; regenerate it with "
        "`pdlife diagram --write-docs` (or `python -m scheduler.cli diagram --write-docs`)"
    )


def test_lifecycle_doc_embeds_every_generated_block() -> None:
    text = DOC.read_text(encoding="utf-8")
    for name, block in doc_blocks(TABLES, pdlife_doc_extra()).items():
        assert f"<!-- BEGIN GENERATED: {name} -->\n{block}<!-- END GENERATED: {name} -->" in text
