"""What the documentation takes from the code: descriptions as the Dagster UI renders them, and the
asset graph drawn from the definitions (`python -m speech_assets.docs` rewrites its copies).

The UI renders descriptions with react-markdown and remark-gfm without rehype-raw
(`ui-core/src/ui/MarkdownWithPlugins.tsx`, dagster-webserver 1.13.27): raw HTML is dropped, so
`<data>/probe/results.parquet` shows as `/probe/results.parquet`. markdown-it-py's
`html_inline`/`html_block` tokens are exactly what the UI drops.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path

import dagster as dg
from markdown_it import MarkdownIt
from markdown_it.token import Token

GRAPH_MARKER = "<!-- the asset graph, generated from the definitions by `python -m speech_assets.docs` -->"
# RST's inline literal; a single backtick is markdown's, and a fence (```) is not inline
RST_LITERAL = re.compile(r"(?<!`)``(?!`)")
GRAPH_BLOCK = re.escape(GRAPH_MARKER) + r"\n```mermaid\n(.*?)```\n"


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


def _label(node: dg.AssetSpec | object, name: str) -> str:
    partitions = getattr(node, "partitions_def", None)
    if isinstance(partitions, dg.DynamicPartitionsDefinition) and partitions.name:
        return f'{name}["{name}<br/>(one per {partitions.name.removesuffix("s")})"]'
    return name


def mermaid_graph(defs: dg.Definitions) -> str:
    """The asset graph as a mermaid flowchart: one subgraph per asset group, every asset (one per
    partition key where it is partitioned), every dependency edge the definitions have."""
    graph = defs.resolve_asset_graph()
    order = list(graph.toposorted_asset_keys)
    rank = {key: i for i, key in enumerate(order)}
    groups: dict[str, list[dg.AssetKey]] = {}
    for key in order:
        groups.setdefault(graph.get(key).group_name or "default", []).append(key)
    lines = ["flowchart LR"]
    for group, keys in groups.items():
        lines.append(f"  subgraph {group}")
        lines += [f"    {_label(graph.get(key), key.to_user_string())}" for key in keys]
        lines.append("  end")
    for key in order:
        parents = sorted(graph.get(key).parent_keys, key=rank.__getitem__)
        if parents:
            lines.append(f"  {' & '.join(p.to_user_string() for p in parents)} --> {key.to_user_string()}")
    return "\n".join(lines) + "\n"


def graph_copies(text: str) -> list[str]:
    """The mermaid blocks of a markdown file that follow `GRAPH_MARKER`."""
    return re.findall(GRAPH_BLOCK, text, flags=re.S)


def with_graph(text: str, graph: str) -> str:
    """The markdown `text` with every copy after `GRAPH_MARKER` replaced by `graph`."""
    return re.sub(GRAPH_BLOCK, lambda _: f"{GRAPH_MARKER}\n```mermaid\n{graph}```\n", text, flags=re.S)


def main(paths: list[str]) -> int:
    """Rewrites the graph's copies in the given markdown files (default: README.md and docs/USER_GUIDE.md)."""
    from speech_assets.definitions import defs
    from speech_assets.utils import atomic_write_text

    graph = mermaid_graph(defs)
    for path in [Path(p) for p in paths] or [Path("README.md"), Path("docs/USER_GUIDE.md")]:
        text = path.read_text(encoding="utf-8")
        if not graph_copies(text):
            print(f"{path}: no line {GRAPH_MARKER!r} followed by a mermaid block", file=sys.stderr)
            return 1
        atomic_write_text(path, with_graph(text, graph))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
