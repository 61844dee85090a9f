"""The docs agree with the code and with themselves (`speech_assets/docs.py`): every relative link
in README.md and docs/*.md leads somewhere (the file exists and, for a `#anchor`, the target file
has a heading whose GitHub anchor is that anchor); every asset and check description renders in
the Dagster UI as written; the asset graph the docs draw is the definitions' graph."""

from __future__ import annotations

import argparse
import difflib
import re
from pathlib import Path

import dagster as dg
import pytest

from speech_assets import docs
from speech_assets.cli import build_parser
from speech_assets.definitions import defs
from speech_assets_tests.support import ui_markdown

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's slug of a heading: the rendered text lower-cased, every character that is not a
    letter, digit, `_`, `-` or space dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "")
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of a markdown file (repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_anchor(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    links = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
                links.append(target)
    return links


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.name}")
    return broken


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("From a laptop to a cluster", "from-a-laptop-to-a-cluster"),
        ("The shared data dir, and locks on NFS", "the-shared-data-dir-and-locks-on-nfs"),
        ("Is the encoder any good?", "is-the-encoder-any-good"),
        ("Differential privacy: what ε covers", "differential-privacy-what-ε-covers"),
        ("k-means (`bench/kmeans.py`)", "k-means-benchkmeanspy"),
        ("Settings: one file for every run", "settings-one-file-for-every-run"),
        ("The probe stage (`bench/probe_stage.py`, issue 36)", "the-probe-stage-benchprobe_stagepy-issue-36"),
    ],
)
def test_github_anchor(heading: str, anchor: str) -> None:
    assert github_anchor(heading) == anchor


def test_the_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n## A section\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#a-section) [ok](other.md#a-section-1) [ok](#here)\n"
        "## Here\n[gone](missing.md) [bad](other.md#nowhere) `[code](not-a-link.md)` [web](https://example.org)\n"
        "```\n[fenced](also-not-a-link.md)\n```\n"
    )
    assert [entry.split(":")[0] for entry in broken_links(page)] == ["missing.md", "other.md#nowhere"]


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []


@pytest.mark.parametrize(
    ("description", "problems"),
    [
        ("writes <data>/probe/results.parquet", ["'<data>' vanishes"]),
        ("writes `<data>/probe/results.parquet`", []),
        ("<data>/export/<checkpoint>/", ["'<data>' vanishes", "'<checkpoint>' vanishes"]),
        ("<div>\na block\n</div>", ["'<div>\\na block\\n</div>' vanishes"]),
        ("a <utt_id> is no tag, nor is 1 < 2 > 0", []),
        ("the ``heldout`` column", ["RST double backticks"]),
        ("the `heldout` column, and a fence:\n```\ncode\n```", []),
    ],
)
def test_descriptions_render_the_checker_sees_what_the_ui_drops(description: str, problems: list[str]) -> None:
    """Kills: parsing with raw HTML off (html=False: no html tokens, `<data>` passes), skipping
    `html_block` or the children of inline tokens, the RST check dropped or matching fences."""
    found = ui_markdown.description_problems(description)
    assert len(found) == len(problems) and all(f.startswith(p) for f, p in zip(found, problems)), found


def test_descriptions_render_the_ui_drops_raw_html() -> None:
    """The renderer drops the tag as the UI does and keeps code spans. Kills: rendering raw HTML."""
    assert ui_markdown.rendered("a <data>/x b") == "<p>a /x b</p>\n"
    assert ui_markdown.rendered("a `<data>/x` b") == "<p>a <code>&lt;data&gt;/x</code> b</p>\n"


def test_descriptions_render_in_the_ui() -> None:
    """Every asset's and check's description loses nothing in the UI and uses markdown, not RST.
    Failed before the fix (`<data>/probe/results.parquet` in `downstream_probe`, ``heldout`` in
    `client_partitions`, ...); kills putting any of them back."""
    assert ui_markdown.all_description_problems(defs) == {}


def _edges(mermaid: str) -> set[tuple[str, str]]:
    edges = set()
    for line in mermaid.splitlines():
        if "-->" in line:
            parents, child = line.split("-->")
            edges |= {(parent.strip(), child.strip()) for parent in parents.split("&")}
    return edges


def test_readme_graph_has_every_edge_and_group() -> None:
    """The rendered graph has exactly the definitions' dependencies (all 7 upstreams of
    `finetuned_asr`) and each asset in its group. Kills: drawing only the first parent, or a
    partitioned asset outside its subgraph."""
    graph = defs.resolve_asset_graph()
    mermaid = docs.mermaid_graph(defs)
    expected = {
        (p.to_user_string(), k.to_user_string()) for k in graph.get_all_asset_keys() for p in graph.get(k).parent_keys
    }
    assert _edges(mermaid) == expected
    assert len({p for p, child in expected if child == "finetuned_asr"}) == 7
    group = None
    for line in mermaid.splitlines():
        if line.strip().startswith("subgraph "):
            group = line.split()[1]
        elif line.startswith("    "):
            name = line.strip().split("[")[0]
            assert graph.get(dg.AssetKey(name)).group_name == group, name


@pytest.mark.parametrize("name", ["README.md", "docs/USER_GUIDE.md"])
def test_readme_graph_is_the_definitions_graph(name: str) -> None:
    """README.md and the user guide hold the graph rendered from the definitions, once each.
    Failed on the hand-drawn graphs (no marker; the README's lacked 6 of `finetuned_asr`'s
    upstream edges); kills any hand edit of a copy. `python -m speech_assets.docs` rewrites them."""
    copies = docs.graph_copies((REPO / name).read_text(encoding="utf-8"))
    assert copies == [docs.mermaid_graph(defs)], "run `python -m speech_assets.docs` to redraw it"


def test_readme_graph_rewrite_replaces_only_the_copy() -> None:
    """Kills: a rewrite that drops the text around the block or leaves the old graph."""
    text = f"before\n{docs.GRAPH_MARKER}\n```mermaid\nflowchart LR\n  old --> graph\n```\nafter\n"
    rewritten = docs.with_graph(text, "flowchart LR\n  new --> graph\n")
    assert rewritten == f"before\n{docs.GRAPH_MARKER}\n```mermaid\nflowchart LR\n  new --> graph\n```\nafter\n"


# Figures: each is stated once, in BENCHMARKS.md's current tables; README.md and the user guide
# link there or quote a row exactly.
BENCHMARKS = REPO / "docs" / "BENCHMARKS.md"
QUOTING = [REPO / "README.md", REPO / "docs" / "USER_GUIDE.md"]
TIMED = re.compile(r"`(make (demo|test|test-all|install)|pytest -m slow)`|the `slow` tests")
MINUTES = re.compile(r"\b\d+(?:\.\d+)?(?:\s*[–-]\s*\d+)?\s*(?:min|minutes)\b")


def table_rows(text: str) -> list[str]:
    return [line for line in prose_lines(text) if line.startswith("|") and not re.match(r"^\|[\s|:-]+\|$", line)]


def current_rows(text: str) -> list[str]:
    """The rows (header rows too) of the tables under BENCHMARKS.md's `## Current figures`."""
    section = text.split("\n## Current figures", 1)[1].split("\n## ", 1)[0]
    return table_rows(section)


def first_cell(row: str) -> str:
    return row.strip("|").split(" | ")[0].strip()


def unquoted_figures(text: str, current: list[str]) -> list[str]:
    """The rows and paragraphs of `text` that state a time of `make demo`/`make test`/... or misquote
    a current row: a table row whose first cell is a current row's must be that row."""
    by_name = {first_cell(row): row for row in current}
    found = []
    for row in table_rows(text):
        if first_cell(row) in by_name and row != by_name[first_cell(row)]:
            found.append(f"misquoted: {row}")
        elif row not in current and TIMED.search(row) and MINUTES.search(row):
            found.append(f"a figure not quoted from the current table: {row}")
    for paragraph in "\n".join(line for line in prose_lines(text) if not line.startswith("|")).split("\n\n"):
        if TIMED.search(paragraph) and MINUTES.search(paragraph):
            found.append(f"a figure in prose: {' '.join(paragraph.split())[:200]}")
    return found


def repeated_benchmarks(current: list[str]) -> list[str]:
    """Benchmarks with more than one current row: the same first cell twice, or two rows timing
    the same command (the command a first cell starts with, e.g. `make demo`, with minutes)."""
    names = [first_cell(row) for row in current if not first_cell(row).startswith("**")]
    names = [name for name in names if name not in ("what", "benchmark", "stage", "encoder", "target", "measure")]
    timed = [
        command.group(1)
        for row in current
        if (command := re.match(r"`([^`]+)`", first_cell(row))) and MINUTES.search(row.split(" | ", 1)[-1])
    ]
    return sorted({name for name in names if names.count(name) > 1} | {c for c in timed if timed.count(c) > 1})


def test_benchmarks_current_table_has_one_row_per_benchmark() -> None:
    """Each benchmark has one current row (its history is below). Failed on the table that listed
    `make test` eight times and the demo four times; kills a second row for a benchmark."""
    assert repeated_benchmarks(current_rows(BENCHMARKS.read_text(encoding="utf-8"))) == []
    two = ["| `make demo` (idle) | 6 min 26 s | a |", "| `make demo` (loaded) | 22 min 40 s | b |"]
    assert repeated_benchmarks(two) == ["make demo"]
    assert repeated_benchmarks([two[0], two[0].replace("6 min 26 s", "1.5 GB")]) == ["`make demo` (idle)"]


def test_docs_quote_benchmark_figures_exactly(tmp_path: Path) -> None:
    """A copy of a current row that differs, or a demo/test time outside the current table, is
    found. Kills: comparing first cells only, or missing times written in prose."""
    current = ["| what | figure | measured |", "| `make test` (idle) | **9 min 2 s** | 2026-11-28 |"]
    assert unquoted_figures("| `make test` (idle) | **9 min 2 s** | 2026-11-28 |\n", current) == []
    assert unquoted_figures("| `make test` (idle) | 9 min | 2026-11-28 |\n", current)[0].startswith("misquoted")
    assert unquoted_figures("| `make demo` | 6 min 26 s | x |\n", current)[0].startswith("a figure not quoted")
    assert unquoted_figures("`make test` takes\nabout 6–8 minutes.\n", current)[0].startswith("a figure in prose")
    assert unquoted_figures("`make test`: its row in the current table.\n", current) == []


@pytest.mark.parametrize("path", QUOTING, ids=lambda path: str(path.relative_to(REPO)))
def test_docs_quote_benchmark_figures_agree(path: Path) -> None:
    """README.md and the user guide state no test or demo time of their own. Failed when the user
    guide said 6–8 min and 12 for the suites and the README 9 and 20."""
    current = current_rows(BENCHMARKS.read_text(encoding="utf-8"))
    assert unquoted_figures(path.read_text(encoding="utf-8"), current) == []


# Commands, asset keys and check names written in backticks exist.
def code_spans(path: Path) -> list[str]:
    """Inline code in prose, and the lines of fenced blocks (commands shown in ```bash blocks)."""
    spans, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif fenced:
            spans.append(line.split("#")[0].strip())
        else:
            spans += [span.strip("`") for span in INLINE_CODE.findall(line)]
    return spans


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)", text, flags=re.M))


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def command_problems(span: str, targets: set[str], parser: argparse.ArgumentParser) -> list[str]:
    """What a command written in the docs names that does not exist: a make target, or a
    `speech-assets` subcommand or option (checked against the parser, level by level)."""
    span = re.sub(r"\"[^\"]*\"|'[^']*'|\$\([^)]*\)", "ARG", span)  # quoted arguments are values
    problems = []
    for target in re.findall(r"(?:^|[\s;(])make ((?:[\w=.-]+)(?:\s+[\w=.-]+)*)", span):
        for word in target.split():
            if "=" not in word and word not in targets:
                problems.append(f"make {word}: no such Makefile target")
    match = re.search(r"(?:^|[\s/])speech-assets\s+(.*)", span)
    if match:
        current, words = parser, match.group(1).replace("\\|", "|").split()
        for word in words:
            word = word.strip("[]()")
            if word.startswith("-"):
                if word.split("=")[0] not in _options(current):
                    problems.append(f"speech-assets: no option {word.split('=')[0]} in {current.prog!r}")
                continue
            choices = _subcommands(current)
            if not choices:
                continue  # arguments of a leaf command: values, not names
            if word in choices:
                current = choices[word]
            elif re.fullmatch(r"[a-z][a-z-]*", word) and word not in ("ARG",):
                problems.append(f"speech-assets: no subcommand {word!r} in {current.prog!r}")
                break
            else:
                break  # a placeholder: COMMAND, <x>, ...
    return problems


def test_commands_exist_the_checker_finds_unknown_names() -> None:
    """Kills: a checker that reads only the first word, ignores options, or stops at subcommands."""
    targets, parser = {"demo", "test"}, build_parser()
    assert command_problems("make demo && make test PYTEST_WORKERS=0", targets, parser) == []
    assert command_problems("make bogus", targets, parser) == ["make bogus: no such Makefile target"]
    assert command_problems('speech-assets sql "SELECT 1" --raw [--max-rows N]', targets, parser) == []
    assert command_problems("speech-assets partitions speakers\\|clients [--range]", targets, parser) == []
    assert command_problems("speech-assets corpus synth --out /tmp/c --speakers 8", targets, parser) == []
    assert command_problems("speech-assets transcribe X --jsn", targets, parser) == [
        "speech-assets: no option --jsn in 'speech-assets transcribe'"
    ]
    assert command_problems("speech-assets corpus mix", targets, parser) == [
        "speech-assets: no subcommand 'mix' in 'speech-assets corpus'"
    ]


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_commands_exist(path: Path) -> None:
    """Every `make` target and `speech-assets` subcommand and option the docs write exists in the
    Makefile and the CLI's parser. Kills: a renamed or removed target, subcommand or option."""
    targets, parser = make_targets(), build_parser()
    assert [p for span in code_spans(path) for p in command_problems(span, targets, parser)] == []


def _section(path: Path, heading: str) -> str:
    text = path.read_text(encoding="utf-8")
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize(
    ("name", "heading"), [("docs/REFERENCE.md", "## Commands"), ("docs/USER_GUIDE.md", "## The command line")]
)
def test_commands_exist_every_subcommand_is_listed(name: str, heading: str) -> None:
    """The reference's command table and the user guide's command list name every subcommand.
    Failed on the user guide's list without `finetune` and `transcribe`."""
    spans = " ".join(f"`{s}`" for s in INLINE_CODE.findall(_section(REPO / name, heading)))
    missing = [sub for sub in _subcommands(build_parser()) if not re.search(rf"`(speech-assets )?{sub}\b", spans)]
    assert missing == []


def asset_table_problems(text: str, assets: dict[str, set[str]]) -> list[str]:
    """In every table whose first column is `asset`: each name in that column is an asset key; in
    a `check` column each name is a check of the row's assets."""
    problems, header = [], None
    for row in table_rows(text):
        cells = [cell.strip() for cell in row.strip().strip("|").split(" | ")]
        if cells[0].lower() == "asset":
            header = [cell.lower() for cell in cells]
            continue
        if header is None:
            continue
        if not cells[0].startswith("`"):
            header = None  # another table
            continue
        keys = re.findall(r"`([^`]+)`", cells[0])
        problems += [f"no asset {key!r}" for key in keys if key not in assets]
        if "check" in header and len(cells) > header.index("check"):
            checks = set().union(*(assets.get(key, set()) for key in keys))
            named = re.findall(r"`([^`]+)`", cells[header.index("check")])
            problems += [f"no check {name!r} on {keys}" for name in named if name not in checks]
    return problems


def definitions_names() -> dict[str, set[str]]:
    graph = defs.resolve_asset_graph()
    names: dict[str, set[str]] = {key.to_user_string(): set() for key in graph.get_all_asset_keys()}
    for check in graph.asset_check_keys:
        names[check.asset_key.to_user_string()].add(check.name)
    return names


def test_asset_names_exist_the_checker_reads_the_tables() -> None:
    """Kills: a checker that skips the check column or reads rows of other tables."""
    assets = {"manifest": {"schema"}, "cmvn_stats": set()}
    text = (
        "| asset | check |\n| --- | --- |\n| `manifest` | `schema`, `no_such_check` |\n| `cmvn_stat` | x |\n\n"
        "| other | table |\n| --- | --- |\n| `not_an_asset` | y |\n"
    )
    assert asset_table_problems(text, assets) == ["no check 'no_such_check' on ['manifest']", "no asset 'cmvn_stat'"]


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_asset_names_exist(path: Path) -> None:
    """Every asset key and check name in the docs' asset tables exists in the definitions.
    Kills: a renamed asset or check left in a table."""
    assert asset_table_problems(path.read_text(encoding="utf-8"), definitions_names()) == []


@pytest.mark.parametrize("name", ["README.md", "docs/USER_GUIDE.md", "docs/REFERENCE.md"])
def test_asset_names_exist_every_asset_is_in_the_table(name: str) -> None:
    """The README's stages, the user guide's outputs and the reference's checks name every asset.
    Failed on the user guide's table without `finetuned_asr`."""
    text = (REPO / name).read_text(encoding="utf-8")
    named = {key for row in table_rows(text) for key in re.findall(r"`([a-z0-9_]+)`", first_cell(row))}
    assert sorted(set(definitions_names()) - named) == []


def near_misses(spans: list[str], known: set[str]) -> list[str]:
    """Backticked names that are almost an asset key or check name but not one (`finetune_asr`,
    `pretrained_checkpoints`); a name that is another one's `_`-joined part (`inputs_are_current`
    of `cmvn_inputs_are_current`) is a different word, not a typo."""
    found = []
    for span in spans:
        if not re.fullmatch(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+", span) or span in known:
            continue
        for name in difflib.get_close_matches(span, known, n=3, cutoff=0.85):
            if not (name.endswith("_" + span) or name.startswith(span + "_") or span.endswith("_" + name)):
                found.append(f"`{span}`: did you mean `{name}`?")
                break
    return found


def test_asset_names_exist_the_near_miss_checker() -> None:
    """Kills: a checker that passes typos, or flags a word that is part of a name."""
    known = {"finetuned_asr", "pretrained_checkpoint", "cmvn_inputs_are_current", "speakers"}
    spans = ["finetune_asr", "pretrained_checkpoints", "inputs_are_current", "dev_speakers", "finetuned_asr", "utt_id"]
    assert near_misses(spans, known) == [
        "`finetune_asr`: did you mean `finetuned_asr`?",
        "`pretrained_checkpoints`: did you mean `pretrained_checkpoint`?",
    ]


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_asset_names_exist_in_prose(path: Path) -> None:
    """No misspelt asset key or check name anywhere in the docs' inline code. Kills: a typo or a
    renamed asset left in prose (`finetune_asr`)."""
    names = definitions_names()
    known = set(names).union(*names.values())
    spans = [
        span.strip("`") for line in prose_lines(path.read_text(encoding="utf-8")) for span in INLINE_CODE.findall(line)
    ]
    assert near_misses(spans, known) == []
