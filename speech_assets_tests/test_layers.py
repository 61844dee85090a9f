"""The layers of the package and its import rule (docs/ARCHITECTURE.md), read from the source.

Pure AST: nothing is imported, so the whole tree is checked in well under a second. Every import
counts, the ones inside functions and under ``TYPE_CHECKING`` too: a lazy import is still an
import. The checker is tested on tiny fake trees first, so a rule that stopped catching its case
fails here instead of passing quietly on the real tree.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from speech_assets_tests.conftest import REPO

PACKAGE = "speech_assets"
# lowest first: a module may import its own part of the package and any part on a lower floor
FLOORS: list[set[str]] = [
    {"", "runtime", "utils", "hosts", "locations", "layout"},  # "": the package's own __init__
    {"corpus"},
    {"features"},
    {"model"},
    {"targets"},
    {"train"},
    {"federated", "evaluation"},
    {"stats"},
    {"defs"},
    {"definitions", "cli", "deploy", "docs", "demo"},
]
APART = [{"federated", "evaluation"}]  # parts of one floor that must not import each other
DAGSTER_PARTS = {"defs", "definitions", "deploy", "cli", "docs", "demo"}  # the only parts importing dagster
LIGHT_DAGSTER = {"dagster_pipes"}  # the worker-side library, fine anywhere
INTERNALS = "defs.dagster_internals"  # the one module that may use private names of Dagster and multiprocessing
PRIVATE_OWNED = f"a private name of Dagster or multiprocessing: only {PACKAGE}.{INTERNALS} uses those, saying why"


def private_owner(top: str) -> bool:
    """Whether the private names of top-level module ``top`` are for :data:`INTERNALS` only."""
    return top in ("dagster", "multiprocessing") or top.startswith("dagster_")


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    module: str
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module} imports {self.imported}: {self.why}"


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # the module imported from (absolute)
    names: tuple[str, ...]  # names taken from it (empty for `import x`)


def modules_of(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of ``package`` under ``root``."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def part_of(module: str) -> str:
    """The top-level part of the package a module belongs to ("" for the package itself)."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else ""


def floor_of(part: str) -> int | None:
    return next((index for index, parts in enumerate(FLOORS) if part in parts), None)


def imports_of(module: str, path: Path, tree: ast.Module, modules: dict[str, Path]) -> list[Import]:
    """Every import of a module, relative ones resolved against its package; ``from p import m``
    of a submodule ``m`` counts as an import of ``p.m``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    found.append(Import(node.lineno, submodule, ()))
                else:
                    found.append(Import(node.lineno, base, (alias.name,)))
    return found


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_attributes(tree: ast.Module, module_aliases: set[str]) -> list[tuple[int, str, str]]:
    """``alias._name`` where ``alias`` is a module of the package bound by an import."""
    return [
        (node.lineno, node.value.id, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in module_aliases
        and private(node.attr)
    ]


def module_aliases(tree: ast.Module, imports: list[Import], modules: dict[str, Path]) -> dict[str, str]:
    """Local name -> module of the package, for names an import binds to one of its modules."""
    bound = {}
    resolved = {(i.line, i.target) for i in imports}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                for line, target in resolved:
                    if line == node.lineno and target.endswith(f".{alias.name}") and target in modules:
                        bound[alias.asname or alias.name] = target
    return bound


def owner_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> what it is bound to, for names an import takes from a :func:`private_owner`."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if private_owner(alias.name.split(".")[0]):
                    bound[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
        elif isinstance(node, ast.ImportFrom) and not node.level and private_owner((node.module or "").split(".")[0]):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def check_tree(root: Path, package: str = PACKAGE) -> list[Violation]:
    """Every breach of the import rule in ``root/package`` (test scaffolding lives in the tests' support/)."""
    modules = modules_of(root, package)
    internals = f"{package}.{INTERNALS}"
    violations: list[Violation] = []
    edges: dict[tuple[str, str], tuple[str, int, str]] = {}  # (from part, to part) -> one example
    module_edges: dict[tuple[str, str], tuple[str, int, str]] = {}  # (from module, to module) -> one example
    for module, path in modules.items():
        part = part_of(module)
        where = str(path.relative_to(root))
        floor = floor_of(part)
        if floor is None:
            if module == f"{package}.{part}":
                violations.append(
                    Violation(
                        where, 1, module, "-", f"{module} is on no floor: add it to FLOORS and docs/ARCHITECTURE.md"
                    )
                )
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        imports = imports_of(module, path, tree, modules)
        checked = set()  # (line, module): `from m import a, b` is one import of m
        reported = set()  # (line, private name of Dagster or multiprocessing)
        for item in imports:
            top = item.target.split(".")[0]
            for name in item.names if top == package else ():
                if private(name):
                    violations.append(
                        Violation(
                            where,
                            item.line,
                            module,
                            f"{item.target}.{name}",
                            "a private name of another module: make it public or move it",
                        )
                    )
            heavy_dagster = top == "dagster" or (top.startswith("dagster_") and top not in LIGHT_DAGSTER)
            hidden = (
                [item.target]
                if any(map(private, item.target.split(".")))
                else [f"{item.target}.{n}" for n in item.names if private(n)]
            )
            if (
                private_owner(top)
                and hidden
                and module != internals
                and not (heavy_dagster and part not in DAGSTER_PARTS)
            ):
                if (item.line, hidden[0]) not in reported:  # `from dagster._x import a, b`: once
                    violations.append(Violation(where, item.line, module, hidden[0], PRIVATE_OWNED))
                reported.add((item.line, hidden[0]))
            if (item.line, item.target) in checked:
                continue
            checked.add((item.line, item.target))
            if heavy_dagster:
                if part not in DAGSTER_PARTS:
                    violations.append(
                        Violation(
                            where,
                            item.line,
                            module,
                            item.target,
                            f"only {sorted(DAGSTER_PARTS)} import Dagster; pure code stays runnable without it",
                        )
                    )
                continue
            if top == f"{package}_tests":
                violations.append(
                    Violation(where, item.line, module, item.target, "the tests: the product never imports them")
                )
            if top != package:
                continue
            if item.target in modules and item.target != module:
                module_edges.setdefault((module, item.target), (where, item.line, item.target))
            target_part = part_of(item.target)
            target_floor = floor_of(target_part)
            if target_part == part or target_floor is None:
                continue
            edges.setdefault((part, target_part), (where, item.line, item.target))
            if target_floor > floor:
                violations.append(
                    Violation(
                        where,
                        item.line,
                        module,
                        item.target,
                        f"imports up: {target_part or package} is on floor {target_floor}, above "
                        f"{part or package} (floor {floor})",
                    )
                )
            elif target_floor == floor and any({part, target_part} <= apart for apart in APART):
                violations.append(
                    Violation(
                        where,
                        item.line,
                        module,
                        item.target,
                        f"{part} and {target_part} share a floor and must not import each other",
                    )
                )
        aliases = module_aliases(tree, imports, modules)
        for line, alias, attr in private_attributes(tree, set(aliases)):
            violations.append(
                Violation(
                    where,
                    line,
                    module,
                    f"{aliases[alias]}.{attr}",
                    "a private name of another module (as an attribute): make it public or move it",
                )
            )
        owned = owner_aliases(tree) if module != internals else {}
        for line, alias, attr in private_attributes(tree, set(owned)):
            violations.append(Violation(where, line, module, f"{owned[alias]}.{attr}", PRIVATE_OWNED))
    violations += cycle_violations(edges, package)
    violations += cycle_violations(
        {edge: example for edge, example in module_edges.items() if part_of(edge[0]) == part_of(edge[1])},
        package,
        between="modules",
    )
    return violations


def cycle_violations(
    edges: dict[tuple[str, str], tuple[str, int, str]], package: str, between: str = "parts"
) -> list[Violation]:
    """One violation per import cycle (strongly connected nodes of ``edges``): between parts of the
    package, or (``between="modules"``) between modules of one part, which a lazy import hides
    from Python but not from a reader."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    violations = []
    for group in groups:
        inside = sorted((a, b) for a, b in edges if a in group and b in group)
        where, line, target = edges[inside[0]]
        examples = "; ".join(f"{a or package} -> {b or package} ({edges[a, b][0]}:{edges[a, b][1]})" for a, b in inside)
        first = inside[0][0] if between == "modules" else f"{package}.{inside[0][0]}".rstrip(".")
        violations.append(
            Violation(
                where,
                line,
                first,
                target,
                f"an import cycle between {between} {sorted(g or package for g in group)}: {examples}",
            )
        )
    return violations


# --- the checker on fake trees: each rule catches its case, and allowed imports pass -----------


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name in ["__init__.py", *files]:
        path = tmp_path / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or name in files:
            path.write_text(files.get(name, ""))
        for parent in path.relative_to(tmp_path / PACKAGE).parents:
            init = tmp_path / PACKAGE / parent / "__init__.py"
            if not init.exists():
                init.write_text("")
    return tmp_path


ALLOWED = {
    "down": {"features/build.py": "from speech_assets.corpus import manifest\n", "corpus/manifest.py": ""},
    "within a part, relative": {
        "features/build.py": "from . import audio\nfrom .audio import decode\n",
        "features/audio.py": "",
    },
    "floor 0 parts": {"runtime/locks.py": "from speech_assets.utils import atomic_path\n", "utils.py": ""},
    "lazy and down": {"defs/stats.py": "def f():\n    from speech_assets.stats import plots\n", "stats/plots.py": ""},
    "dagster in defs": {"defs/x.py": "import dagster as dg\nfrom dagster import asset\n"},
    "dagster_pipes in a worker": {"train/tracking.py": "from dagster_pipes import open_dagster_pipes\n"},
    "a dunder name": {"cli.py": "from speech_assets import __version__\n"},
    "a public attribute": {
        "defs/x.py": "from speech_assets.targets import labels\nlabels.read_labels\n",
        "targets/labels.py": "",
    },
    "Dagster's internals in their module": {
        "defs/dagster_internals.py": (
            "from dagster._core.x import a, b\nfrom multiprocessing import forkserver\nforkserver._forkserver\n"
        )
    },
    "public multiprocessing and os._exit": {
        "runtime/x.py": "import os\nfrom multiprocessing import get_context\nos._exit(1)\n"
    },
}

FORBIDDEN = {
    "up": (
        {"corpus/replicate.py": "from speech_assets.features.audio import to_mono\n", "features/audio.py": ""},
        "corpus/replicate.py:1: speech_assets.corpus.replicate imports speech_assets.features.audio: imports up",
    ),
    "up, relative": (
        {"corpus/replicate.py": "from ..features import audio\n", "features/audio.py": ""},
        "imports speech_assets.features.audio: imports up: features is on floor 2, above corpus (floor 1)",
    ),
    "up, lazily": (
        {
            "targets/iteration2.py": "def f():\n    from speech_assets.evaluation.encoders import pad\n",
            "evaluation/encoders.py": "",
        },
        "targets/iteration2.py:2: speech_assets.targets.iteration2 imports "
        "speech_assets.evaluation.encoders: imports up",
    ),
    "up, under TYPE_CHECKING": (
        {"train/data.py": "if TYPE_CHECKING:\n    import speech_assets.defs.x\n", "defs/x.py": ""},
        "imports speech_assets.defs.x: imports up",
    ),
    "sideways": (
        {"federated/local.py": "from speech_assets.evaluation import distill\n", "evaluation/distill.py": ""},
        "federated and evaluation share a floor and must not import each other",
    ),
    "testing": (
        {"defs/automation.py": "from speech_assets_tests.support.local_runs import START\n"},
        "defs/automation.py:1: speech_assets.defs.automation imports speech_assets_tests.support.local_runs: the tests",
    ),
    "test scaffolding back in the package": (
        {"testing/runs.py": "import dagster\nfrom speech_assets.defs import x\n", "defs/x.py": ""},
        "speech_assets.testing is on no floor",
    ),
    "a private name": (
        {"targets/iteration2.py": "from speech_assets.targets.labels import _write_outputs\n", "targets/labels.py": ""},
        "imports speech_assets.targets.labels._write_outputs: a private name of another module",
    ),
    "a private attribute": (
        {"defs/x.py": "from speech_assets.defs import targets\ntargets._read_json(1)\n", "defs/targets.py": ""},
        "defs/x.py:2: speech_assets.defs.x imports speech_assets.defs.targets._read_json: a private name",
    ),
    "dagster in pure code": (
        {"runtime/reaper.py": "from dagster._core.executor import Executor, InProcessExecutor\n"},
        "runtime/reaper.py:1: speech_assets.runtime.reaper imports dagster._core.executor: only",
    ),
    "a dagster library in pure code": ({"train/x.py": "import dagster_k8s\n"}, "imports dagster_k8s: only"),
    "a private Dagster module": (
        {"defs/lineage.py": "from dagster._core.definitions.data_version import A, B\n"},
        "defs/lineage.py:1: speech_assets.defs.lineage imports dagster._core.definitions.data_version: a "
        "private name of Dagster",
    ),
    "a private Dagster name": (
        {"defs/x.py": "from dagster import asset, _check\n"},
        "imports dagster._check: a private name of Dagster",
    ),
    "a private Dagster attribute": (
        {"cli.py": "import dagster as dg\ndg._core.x\n"},
        "cli.py:2: speech_assets.cli imports dagster._core: a private name of Dagster",
    ),
    "a private name of a Dagster library": (
        {"deploy/k8s.py": "import dagster_k8s.job\nfrom dagster_k8s.job import _label\n"},
        "deploy/k8s.py:2: speech_assets.deploy.k8s imports dagster_k8s.job._label: a private name of Dagster",
    ),
    "the worker-side library's private names": (
        {"train/x.py": "from dagster_pipes import _X\n"},
        "imports dagster_pipes._X: a private name of Dagster",
    ),
    "multiprocessing's private names": (
        {"runtime/x.py": "from multiprocessing import forkserver\nforkserver._forkserver._lock\n"},
        "runtime/x.py:2: speech_assets.runtime.x imports multiprocessing.forkserver._forkserver: a private "
        "name of Dagster or multiprocessing: only speech_assets.defs.dagster_internals",
    ),
    "the tests": (
        {"defs/x.py": "from speech_assets_tests.conftest import REPO\n"},
        "defs/x.py:1: speech_assets.defs.x imports speech_assets_tests.conftest: the tests",
    ),
    "a cycle on one floor": (
        {
            "runtime/locks.py": "from speech_assets import utils\n",
            "utils.py": "from speech_assets.runtime import locks\n",
        },
        "an import cycle between parts ['runtime', 'utils']",
    ),
    "a circle of modules in one part, hidden in a function": (
        {
            "evaluation/protocol.py": "def f():\n    from speech_assets.evaluation.compare import FBANK\n",
            "evaluation/compare.py": "def g():\n    from speech_assets.evaluation import probe\n",
            "evaluation/probe.py": "from speech_assets.evaluation.protocol import ProbeOptions\n",
        },
        "an import cycle between modules ['speech_assets.evaluation.compare', 'speech_assets.evaluation.probe', "
        "'speech_assets.evaluation.protocol']",
    ),
    "a part on no floor": ({"extras/x.py": ""}, "speech_assets.extras is on no floor"),
}


@pytest.mark.parametrize("files", ALLOWED.values(), ids=list(ALLOWED))
def test_allowed_imports_pass(tmp_path: Path, files: dict[str, str]) -> None:
    assert check_tree(tree(tmp_path, files)) == []


@pytest.mark.parametrize(("files", "message"), FORBIDDEN.values(), ids=list(FORBIDDEN))
def test_each_forbidden_import_is_caught_and_said(tmp_path: Path, files: dict[str, str], message: str) -> None:
    found = [str(v) for v in check_tree(tree(tmp_path, files))]
    assert len(found) == 1 and message in found[0], found


# --- the real tree --------------------------------------------------------------------------------


def test_the_package_keeps_its_layers() -> None:
    violations = check_tree(REPO)
    assert not violations, "imports that break the layers (docs/ARCHITECTURE.md):\n" + "\n".join(map(str, violations))


def test_no_circle_between_modules_even_through_lazy_imports() -> None:
    """No module of the package reaches itself through imports, those inside functions and under
    ``TYPE_CHECKING`` counted. Mutations seen failing: the code before ``ProbeOptions`` left
    ``evaluation/protocol.py`` (protocol -> compare -> probe -> protocol, the backward arrows in
    functions), and ``evaluation/probe.py`` importing ``ProbeLeak`` from the protocol in a function."""
    circles = [str(v) for v in check_tree(REPO) if "import cycle between modules" in v.why]
    assert not circles, "\n".join(circles)


def test_every_part_of_the_package_is_on_a_floor() -> None:
    parts = {part_of(module) for module in modules_of(REPO)}
    assert parts == set().union(*FLOORS)
