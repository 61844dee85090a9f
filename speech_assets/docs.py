"""What the documentation takes from the code: the asset graph drawn from the definitions
(`python -m speech_assets.docs` rewrites its copies)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import dagster as dg

GRAPH_MARKER = "<!-- the asset graph, generated from the definitions by `python -m speech_assets.docs` -->"
GRAPH_BLOCK = re.escape(GRAPH_MARKER) + r"\n```mermaid\n(.*?)```\n"


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
        if parents := sorted(graph.get(key).parent_keys, key=rank.__getitem__):
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
