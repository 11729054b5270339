"""mkdocs hook: the fused-activation table of docs/timm.md, generated from the one registry
(``syncbn_lightning.ops.activations.ACTIVATIONS``), so the docs never list a different set."""

from __future__ import annotations

from typing import Any

MARKER = "<!-- activation-table -->"


def on_page_markdown(markdown: str, **_kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    from syncbn_lightning.ops.activations import markdown_table

    return markdown.replace(MARKER, markdown_table())
