"""One owner for where outputs live: no module of the product but ``speech_assets/layout.py``
spells the name of a file or folder the graph writes.

The names are read from the layout module itself (its upper-case string constants), so a name
added there is guarded at once. Pure AST over the package (tests, their ``support/`` and ``bench/``
are not the product): a file name is flagged wherever it appears as a string, also at the end of
a glob (``"*/quality.json"``); a folder name where it is joined into a path (``root / "probe"``).
A numbered name (a constant with a field, ``"round-{}.json"``) is flagged as an f-string of its
shape (``f"round-{n}.json"``), as its glob (``"round-*.json"``), as a regular expression that
reads it back (``re.compile(...)``) and as its leading text in ``removeprefix``/``startswith``.
The checker is tried on tiny sources first, so a rule that stopped catching its case fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from string import Formatter

import pytest

from speech_assets import layout
from speech_assets_tests.conftest import REPO

PACKAGE = REPO / "speech_assets"


def layout_values() -> list[str]:
    """Every name the layout defines: its upper-case string constants (and those of its dicts),
    the names its folder classes' attributes hold and the templates of its numbered families."""
    values: list[str] = []
    for name, value in vars(layout).items():
        if name.isupper() and isinstance(value, str):
            values.append(value)
        elif name.isupper() and isinstance(value, dict):
            values += [v for v in value.values() if isinstance(v, str)]
        elif isinstance(value, type) and value.__module__ == layout.__name__:
            for attribute in vars(value).values():
                if isinstance(attribute, layout.Numbered):
                    values.append(attribute.template)
                elif isinstance(attribute, layout.Under):
                    values += attribute.name.split("/")
    return values


def layout_names() -> tuple[set[str], set[str]]:
    """(file names and suffixes, folder names) of every output the layout names."""
    values = layout_values()
    files = {v for v in values if "." in v} | {glob(t) for t in templates_of(values)}
    return files, set(values) - files


def templates_of(values: list[str]) -> set[str]:
    return {v for v in values if any(field is not None for _, field, _, _ in Formatter().parse(v))}


def layout_templates() -> set[str]:
    """The layout's numbered names (names with a field: ``"round_{:05d}.pt"``)."""
    return templates_of(layout_values())


def glob(template: str) -> str:
    return "".join(text + ("*" if field is not None else "") for text, field, _, _ in Formatter().parse(template))


FIELD = "\0"  # stands for a field of a template or a formatted value of an f-string


def _shape(template: str) -> str:
    return "".join(text + (FIELD if field is not None else "") for text, field, _, _ in Formatter().parse(template))


def _example(template: str, letter: str = "") -> str:
    """``template`` with each field filled in: what a regular expression reading it must match;
    with ``letter``, each letter of its fixed text replaced by that one (what it must not)."""
    return "".join(
        (re.sub("[a-zA-Z]", letter, text) if letter else text)
        + ((format(7, spec) if spec else "7") if field is not None else "")
        for text, field, spec, _ in Formatter().parse(template)
    )


def _template_spelled(node: ast.AST, templates: set[str]) -> str | None:
    """The template ``node`` spells: an f-string of its shape, a regular expression reading it
    (``re.compile(...)`` and the like) or its leading text in ``removeprefix``/``startswith``."""
    if isinstance(node, ast.JoinedStr):
        shape = "".join(v.value if isinstance(v, ast.Constant) else FIELD for v in node.values)
        if any(c.isspace() for c in shape):  # a message
            return None
        return next((t for t in sorted(templates) if shape == _shape(t) or shape.endswith("/" + _shape(t))), None)
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or not node.args:
        return None
    arg = node.args[0]
    if not isinstance(arg, ast.Constant) or not isinstance(arg.value, str):
        return None
    if isinstance(node.func.value, ast.Name) and node.func.value.id == "re" and node.func.attr in REGEX_CALLS:
        for template in sorted(templates):
            # it reads the template, not any name of the same punctuation (``[a-z]+\.\w+``)
            if re.fullmatch(arg.value, _example(template)) and not re.fullmatch(arg.value, _example(template, "q")):
                return template
    if node.func.attr in PREFIX_CALLS:
        return next((t for t in sorted(templates) if (head := t.partition("{")[0]) and arg.value == head), None)
    return None


REGEX_CALLS = {"compile", "match", "fullmatch", "search"}
PREFIX_CALLS = {"removeprefix", "startswith"}


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


def literals_in(
    source: str, files: set[str], folders: set[str], templates: set[str] = frozenset()
) -> list[tuple[int, str]]:
    """(line, name) of every output name ``source`` spells (``templates``: the numbered ones)."""
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
        if (template := _template_spelled(node, templates)) is not None:
            found.append((node.lineno, template))
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in skip:
            continue
        name = _spells_file(node.value, files)
        if name is None and id(node) in joined:
            head = node.value.split("/", 1)[0]
            name = head if head in folders and (node.value == head or "/" in node.value) else None
        if name is not None:
            found.append((node.lineno, name))
    return found


TEMPLATES = {"round-{}.json", "round_{:05d}.pt", "supernode-{}"}
FILES = {"labels.parquet", "quality.json", ".meta.json"} | {glob(t) for t in TEMPLATES}
FOLDERS = {"kmeans", "probe"}


@pytest.mark.parametrize(
    "source",
    [
        'out / "labels.parquet"',
        'sorted(root.glob("*/quality.json"))',
        'path.with_name(f"{speaker}.meta.json")',
        'root / "kmeans" / client',
        'Path(data, "probe")',
        'write(root / "probe/results")',
        'folder / "secagg" / f"round-{int(n)}.json"',
        'name = f"round_{n:05d}.pt"',
        'node_dir = root / f"supernode-{client}"',
        'folder.glob("round-*.json")',
        'sorted(root.glob("rounds/round_*.pt"))',
        'ROUND = re.compile(r"^round_(\\d{5})\\.pt$")',
        're.fullmatch(r"round-(\\d+)\\.json", name)',
        'ROUND_FILE = re.compile(r"^round_(\\d{5})\\.(pt|json)$")',
        'number = old.stem.removeprefix("round-")',
        'if name.startswith("supernode-"): pass',
    ],
)
def test_the_checker_catches_each_spelling_of_an_output_name(source: str) -> None:
    assert literals_in(source, FILES, FOLDERS, TEMPLATES), source


@pytest.mark.parametrize(
    "source",
    [
        "layout.TargetFiles(out).labels",
        '{"kmeans": 1, "probe": 2}',  # a dict key or an asset's group name, not a path
        'log("probe")',
        'def f():\n    """Reads kmeans/<client>/labels.parquet."""\n',
        'name = "quality"',
        'Daemon(f"supernode {client}", process)',  # a name in messages, with a space
        'log(f"round {n} done")',
        'path.name.endswith(".json")',
        'WORD = re.compile(r"^[a-z]+$")',
        'NAME = re.compile(r"^[a-z]+_\\d+\\.[a-z]+$")',  # any name of that punctuation
        'name.removeprefix("round")',
    ],
)
def test_the_checker_leaves_other_strings_alone(source: str) -> None:
    assert not literals_in(source, FILES, FOLDERS, TEMPLATES), source


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
    templates = layout_templates()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(REPO)
        if path == Path(layout.__file__).resolve():
            continue
        found += [
            f"{relative}:{line}: {name!r}" for line, name in literals_in(path.read_text(), files, folders, templates)
        ]
    assert not found, "output names spelled outside speech_assets/layout.py (use its objects):\n" + "\n".join(found)


# --- each name written once: a name constant of a file or folder is the layout's alone ------------

OUTPUT_SUFFIXES = (
    ".parquet", ".json", ".jsonl", ".onnx", ".pt", ".duckdb", ".db", ".html", ".tmp", ".npz", ".npy", ".png",
    ".arpa", ".txt", ".log", ".lock",
)  # fmt: skip


def _path_operands(tree: ast.Module) -> set[str]:
    """The names (``NAME``, ``module.NAME``, a field of an f-string) joined into a path anywhere
    in ``tree``: an operand of ``/`` or an argument of ``Path``, ``with_name``, ``glob``, ..."""
    found: set[str] = set()
    for node in ast.walk(tree):
        operands: list[ast.expr] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            operands = [node.left, node.right]
        elif isinstance(node, ast.Call) and _joins_paths(node.func):
            is_str_join = (
                isinstance(node.func, ast.Attribute)
                and node.func.attr == "join"
                and not (isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "path")
            )
            operands = [] if is_str_join else list(node.args)
        for operand in operands:
            parts = (
                [v.value for v in operand.values if isinstance(v, ast.FormattedValue)]
                if isinstance(operand, ast.JoinedStr)
                else [operand]
            )
            found |= {
                p.id if isinstance(p, ast.Name) else p.attr for p in parts if isinstance(p, ast.Name | ast.Attribute)
            }
    return found


def name_constants(sources: dict[str, str]) -> list[str]:
    """``module:line: NAME = 'value'`` for each module-level string constant of ``sources``
    (module -> source) that names an output: its value ends in an output suffix, or some module
    joins the constant into a path."""
    trees = {module: ast.parse(source) for module, source in sources.items()}
    joined = set().union(*map(_path_operands, trees.values())) if trees else set()
    found = []
    for module, tree in trees.items():
        for node in tree.body:
            if not (
                isinstance(node, ast.Assign | ast.AnnAssign)
                and isinstance(target := node.targets[0] if isinstance(node, ast.Assign) else node.target, ast.Name)
                and isinstance(node.value, ast.Constant)
                and isinstance(value := node.value.value, str)
            ):
                continue
            named = value.lower().endswith(OUTPUT_SUFFIXES) and not any(c.isspace() for c in value)
            if named or target.id in joined:
                found.append(f"{module}:{node.lineno}: {target.id} = {value!r}")
    return found


@pytest.mark.parametrize(
    "sources",
    [
        {"a.py": 'LM_FILE = "{order}gram.arpa"\n'},
        {"a.py": 'CACHE_SUFFIX = ".png"\n'},
        {"a.py": 'TEMP_SUFFIX = ".tmp"\n'},
        {"a.py": 'PLOT_CACHE = ".plots"\ndef f(p):\n    return p / PLOT_CACHE\n'},
        {"a.py": 'AUDIO = "audio"\n', "b.py": "from a import AUDIO\ndef f(p):\n    return p / AUDIO\n"},
        {"a.py": 'AUDIO = "audio"\n', "b.py": 'import a\ndef f(p):\n    return p / f"{a.AUDIO}/x"\n'},
        {"a.py": 'ARTIFACT: str = "inputs.json"\n'},
    ],
)
def test_the_name_defined_once_checker_finds_each_name_constant(sources: dict[str, str]) -> None:
    assert name_constants(sources), sources


@pytest.mark.parametrize(
    "sources",
    [
        {"a.py": 'SUBSET = "synth"\nrow = f"{SUBSET:<17}| {seconds / 60:5.2f}"\n'},
        {"a.py": 'NBSP = "\\u00a0"\ntext = NBSP.join(parts)\nlines = "".join([NBSP, x])\n'},
        {"a.py": 'SETTINGS_FILE = "pipeline.toml"\n'},  # the settings: read, not written
        {"a.py": 'HELP = "writes results.json"\n'},  # a message
        {"a.py": 'def f():\n    NAME = "x.json"\n'},  # not module level
    ],
)
def test_the_name_defined_once_checker_leaves_other_constants_alone(sources: dict[str, str]) -> None:
    assert not name_constants(sources), sources


def test_each_output_name_defined_once_in_the_layout() -> None:
    """No product module but the layout defines a name constant of an output: each name is
    written once, where the layout names its family. Mutations seen failing: the code
    before the names moved (``AUDIO_FOLDER`` in stats/examples.py, ``PLOT_CACHE`` in stats/report.py,
    ``LM_FILE``/``LEXICON_FILE`` in evaluation/decoding.py, ``CACHE_SUFFIX`` in stats/plots.py,
    ``TEMP_SUFFIX`` in utils.py), and ``ARTIFACT = "inputs.json"`` added to train/tracking.py."""
    sources = {
        str(path.relative_to(REPO)): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != Path(layout.__file__).resolve()
    }
    found = name_constants(sources)
    assert not found, "output names defined outside speech_assets/layout.py (define them there):\n" + "\n".join(found)


NUMBERED = sorted(
    {
        v
        for cls in vars(layout).values()
        if isinstance(cls, type)
        for v in vars(cls).values()
        if isinstance(v, layout.Numbered)
    },
    key=lambda n: n.template,
)


@pytest.mark.parametrize("family", NUMBERED, ids=lambda n: n.template)
def test_a_numbered_name_reads_back_the_number_it_was_written_with(family: layout.Numbered) -> None:
    for number in (0, 7, 99999, 123456):
        name = family.name(number)
        assert family.number(name) == number, name
    written = family.name(7)
    others = [
        f".{written}.x1y2.tmp",  # the temp file of an atomic write of it
        written + ".tmp",
        "x" + written,
        written.replace("7", "-7"),
        written.replace("7", "seven"),
        written.replace("7", "٧"),  # a non-ASCII digit
        written.replace("7", ""),
    ]
    if family.name(7) != family.template.replace("{}", "7"):  # zero-padded: only the padded spelling
        others.append(family.template.split("{")[0] + "7" + family.template.split("}")[1])
    assert [o for o in others if family.number(o) is not None] == []


def test_the_numbered_families_are_found() -> None:
    assert {n.template for n in NUMBERED} >= {"round_{:05d}.pt", "round_{:05d}.json", "round-{}.json"}


def test_the_flower_and_client_state_names_are_the_ones_on_disk(tmp_path: Path) -> None:
    """The names users, scripts and the deployment read (kept when they moved into the layout)."""
    flower = layout.DataLayout(tmp_path).federated_run("r").flower
    assert flower.root == tmp_path / "federated/r/flower"
    found = {
        flower.run_log: "flwr-run.log",
        flower.simulation_log: "simulation.log",
        flower.simulation_nodes: "simulation_nodes.json",
        flower.pids: "pids.json",
        flower.nodes: "nodes.json",
        flower.cli: "cli",
        layout.FlowerHome(flower.cli).config: "cli/config.toml",
        flower.superlink_log: "superlink/superlink.log",
        flower.superlink_home: "superlink/home",
        flower.supernode_log("c1"): "supernode-c1/supernode.log",
        flower.supernode_home("c1"): "supernode-c1/home",
        flower.tls.ca: "tls/ca.crt",
        flower.tls.cert: "tls/superlink.crt",
        flower.tls.key: "tls/superlink.key",
        flower.auth.private("c1"): "auth/c1.key",
        flower.auth.public("c1"): "auth/c1.pub",
    }
    assert {str(path.relative_to(flower.root)): name for path, name in found.items()} == {n: n for n in found.values()}
    client = layout.ClientRunFiles(tmp_path / "c1" / "r")
    assert client.secagg_round(3) == tmp_path / "c1/r/secagg/round-3.json"
    assert client.head(3) == tmp_path / "c1/r/heads/round_00003.pt"
    run = layout.RunFiles(tmp_path / "batch")
    assert (run.rank_result(0), run.rank_result(2)) == (
        tmp_path / "batch/result.json",
        tmp_path / "batch/result.rank2.json",
    )
    finetune = layout.DataLayout(tmp_path).finetune
    assert (finetune.runs, finetune.batches) == (tmp_path / "finetune/runs", tmp_path / "finetune/batches")


def test_a_killed_writes_temp_file_is_traced_to_the_numbered_file_it_was_writing(tmp_path: Path) -> None:
    """``prune_checkpoints`` deletes the temp files a killed write of a step checkpoint left, and
    nothing else: the temp file of an ``atomic_path`` write names its target, other names none."""
    from speech_assets.utils import atomic_path, temp_target

    steps = layout.RunFiles(tmp_path).checkpoint_steps
    with atomic_path(layout.RunFiles(tmp_path).checkpoint(25)) as tmp:
        assert steps.number(temp_target(tmp.name) or "") == 25, tmp.name
    for name in ("step_00000025.pt", ".step_00000025.pt", ".step_00000025.pt.tmp", "x.tmp", "..tmp", ".a.b.tmp"):
        target = temp_target(name)
        assert target is None or steps.number(target) is None, name
