"""Descriptions as the Dagster UI renders them (moved from speech_assets/docs.py: only the tests use it).

The UI renders descriptions with react-markdown and remark-gfm without rehype-raw
(`ui-core/src/ui/MarkdownWithPlugins.tsx`, dagster-webserver 1.13.27): raw HTML is dropped, so
`<data>/probe/results.parquet` shows as `/probe/results.parquet`. markdown-it-py's
`html_inline`/`html_block` tokens are exactly what the UI drops.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import dagster as dg
from markdown_it import MarkdownIt
from markdown_it.token import Token

# RST's inline literal; a single backtick is markdown's, and a fence (```) is not inline
RST_LITERAL = re.compile(r"(?<!`)``(?!`)")


def _ui_markdown() -> MarkdownIt:
    # html=True so raw HTML becomes its own tokens (the UI then drops them); tables and
    # strikethrough are the parts of GitHub's markdown (remark-gfm) a description may use
    md = MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])
    for rule in ("html_inline", "html_block"):
        md.add_render_rule(rule, lambda *args, **kwargs: "")
    return md


def _html_tokens(tokens: Iterable[Token]) -> list[str]:
    found = []
    for token in tokens:
        if token.type in ("html_inline", "html_block"):
            found.append(token.content.strip())
        found += _html_tokens(token.children or [])
    return found


def rendered(description: str) -> str:
    """The HTML the UI makes of a description, raw HTML dropped as the UI drops it."""
    return _ui_markdown().render(description)


def description_problems(description: str) -> list[str]:
    """What a description loses or shows wrongly in the UI: raw HTML (`<data>`) that vanishes, and
    RST's double backticks, which markdown does not read as RST does."""
    problems, start = [], 0
    for tag in _html_tokens(_ui_markdown().parse(description)):
        at = max(description.find(tag, start), 0)
        start = at + len(tag)
        around = " ".join(description[max(0, at - 30) : start + 30].split())
        problems.append(f"{tag!r} vanishes (the UI drops raw HTML): {around!r} shows as {around.replace(tag, '')!r}")
    if RST_LITERAL.search(description):
        problems.append("RST double backticks (``x``): write markdown's single backticks (`x`)")
    return problems


def all_description_problems(defs: dg.Definitions) -> dict[str, list[str]]:
    """Every asset's and asset check's description problems, by asset key or `asset:check`."""
    graph = defs.resolve_asset_graph()
    found: dict[str, list[str]] = {}
    for key in graph.get_all_asset_keys():
        found[key.to_user_string()] = description_problems(graph.get(key).description or "")
    for check in graph.asset_check_keys:
        spec = graph.get_check_spec(check)
        found[f"{check.asset_key.to_user_string()}:{check.name}"] = description_problems(spec.description or "")
    return {name: problems for name, problems in sorted(found.items()) if problems}
