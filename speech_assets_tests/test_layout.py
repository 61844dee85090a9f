"""One owner for where outputs live: no module of the product but ``speech_assets/layout.py``
spells the name of a file or folder the graph writes.

The names are read from the layout module itself (its upper-case string constants), so a name
added there is guarded at once. Pure AST over the package (tests, ``testing/`` and ``bench/``
are not the product): a file name is flagged wherever it appears as a string, also at the end of
a glob (``"*/quality.json"``); a folder name where it is joined into a path (``root / "probe"``).
The checker is tried on tiny sources first, so a rule that stopped catching its case fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from speech_assets import layout
from speech_assets_tests.conftest import REPO

PACKAGE = REPO / "speech_assets"
NOT_PRODUCT = {"testing"}  # test scaffolding: it writes fixtures in the layout's shape


def layout_names() -> tuple[set[str], set[str]]:
    """(file names and suffixes, folder names) of every output the layout names."""
    values: list[str] = []
    for name, value in vars(layout).items():
        if name.isupper() and isinstance(value, str):
            values.append(value)
        elif name.isupper() and isinstance(value, dict):
            values += [v for v in value.values() if isinstance(v, str)]
    files = {v for v in values if "." in v}
    return files, set(values) - files


def _spells_file(text: str, files: set[str]) -> str | None:
    if any(c.isspace() for c in text):  # a message or a help text that names a file, not a path
        return None
    for name in files:
        if text == name or text.endswith("/" + name) or (name.startswith(".") and text.endswith(name)):
            return name
    return None


def _docstrings(tree: ast.Module) -> set[int]:
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


PATH_CALLS = {"Path", "PurePath", "joinpath", "with_name", "glob", "rglob", "join"}


def _joins_paths(func: ast.expr) -> bool:
    return (
        func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    ) in PATH_CALLS


def literals_in(source: str, files: set[str], folders: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every output name ``source`` spells."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    joined: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            joined |= {id(node.left), id(node.right)}
        elif isinstance(node, ast.Call) and _joins_paths(node.func):
            joined |= {id(arg) for arg in node.args}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in skip:
            continue
        name = _spells_file(node.value, files)
        if name is None and id(node) in joined:
            head = node.value.split("/", 1)[0]
            name = head if head in folders and (node.value == head or "/" in node.value) else None
        if name is not None:
            found.append((node.lineno, name))
    return found


FILES, FOLDERS = {"labels.parquet", "quality.json", ".meta.json"}, {"kmeans", "probe"}


@pytest.mark.parametrize(
    "source",
    [
        'out / "labels.parquet"',
        'sorted(root.glob("*/quality.json"))',
        'path.with_name(f"{speaker}.meta.json")',
        'root / "kmeans" / client',
        'Path(data, "probe")',
        'write(root / "probe/results")',
    ],
)
def test_the_checker_catches_each_spelling_of_an_output_name(source: str) -> None:
    assert literals_in(source, FILES, FOLDERS), source


@pytest.mark.parametrize(
    "source",
    [
        "layout.TargetFiles(out).labels",
        '{"kmeans": 1, "probe": 2}',  # a dict key or an asset's group name, not a path
        'log("probe")',
        'def f():\n    """Reads kmeans/<client>/labels.parquet."""\n',
        'name = "quality"',
    ],
)
def test_the_checker_leaves_other_strings_alone(source: str) -> None:
    assert not literals_in(source, FILES, FOLDERS), source


def test_the_layout_names_are_read_from_the_layout_module() -> None:
    files, folders = layout_names()
    assert {
        "labels.parquet",
        "quality.json",
        "codebook.npy",
        "clients.parquet",
        "mlartifacts",
        "mlflow.db",
    } <= files | folders
    assert {"kmeans", "kmeans_iter2", "probe", "export", "finetune", "report", "federated", "distill"} <= folders


def test_no_output_path_literal_outside_the_layout_module() -> None:
    files, folders = layout_names()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(REPO)
        if path == Path(layout.__file__).resolve() or NOT_PRODUCT & set(relative.parts[1:-1]):
            continue
        found += [f"{relative}:{line}: {name!r}" for line, name in literals_in(path.read_text(), files, folders)]
    assert not found, "output names spelled outside speech_assets/layout.py (use its objects):\n" + "\n".join(found)
