"""Asset modules orchestrate; what two of them share lives below them (plain code) or in the
defs infrastructure named here, never in another asset module. Pure AST, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from speech_assets_tests.conftest import REPO

DEFS = "speech_assets.defs"
# shared infrastructure of the asset modules: no asset, sensor or check is defined in these
INFRASTRUCTURE = {
    "resources",
    "lineage",
    "per_partition",
    "partitions",
    "runs",
    "readable",
    "dagster_internals",
    "progress",
    "conditions",
    "cluster",
    "torchrun",
}


def defs_imports(source: str) -> list[tuple[int, str]]:
    """(line, module of speech_assets.defs) for every import of one, lazy ones too."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == DEFS:
                found += [(node.lineno, alias.name) for alias in node.names]
            elif node.module.startswith(DEFS + "."):
                found.append((node.lineno, node.module.split(".")[2]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[2]) for a in node.names if a.name.startswith(DEFS + ".")]
    return found


def violations(defs_dir: Path) -> list[str]:
    asset_modules = {p.stem for p in defs_dir.glob("*.py")} - INFRASTRUCTURE - {"__init__"}
    found = []
    for path in sorted(defs_dir.glob("*.py")):
        for line, imported in defs_imports(path.read_text()):
            if path.stem in asset_modules and imported in asset_modules and imported != path.stem:
                found.append(f"{path.name}:{line}: asset module {path.stem} imports asset module {imported}")
    return found


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("from speech_assets.defs.training import run_training", True),
        ("def f():\n    from speech_assets.defs import probe", True),
        ("import speech_assets.defs.targets", True),
        ("from speech_assets.defs.lineage import read_json", False),
        ("from speech_assets.defs import readable", False),
        ("from speech_assets.targets.publish import publish_client_targets", False),
    ],
)
def test_the_rule_catches_an_asset_module_importing_another(tmp_path: Path, source: str, caught: bool) -> None:
    for name in ("federated", "training", "probe", "targets", "lineage", "readable"):
        (tmp_path / f"{name}.py").write_text("")
    (tmp_path / "federated.py").write_text(source + "\n")
    assert bool(violations(tmp_path)) is caught


def test_infrastructure_modules_exist() -> None:
    missing = {name for name in INFRASTRUCTURE if not (REPO / "speech_assets" / "defs" / f"{name}.py").is_file()}
    assert not missing, f"INFRASTRUCTURE names modules that are gone: {sorted(missing)}"


def test_no_asset_module_imports_another() -> None:
    found = violations(REPO / "speech_assets" / "defs")
    assert not found, "move the shared helper below (plain code) or into defs infrastructure:\n" + "\n".join(found)
