"""Every make target runs in a test: `make ui` and `make mlflow` for real (they serve their page on
127.0.0.1 only, print no warning a user cannot act on, and a Ctrl-C leaves no process behind), the
others in the form that is meaningful and cheap: `make clean` for real in a scratch folder, `make
-n` for the rest, whose every command must resolve to a program, script or module that exists.

make runs with `VENV=` this interpreter's venv and `-o` its install stamp: the targets' `install`
prerequisite is taken as done (under `make test` it is; in a checkout without its own .venv the
venv of another one is borrowed), so no test reinstalls anything. Each run gets its own
DAGSTER_HOME, data dir and free ports."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from speech_assets.runtime.processes import die_with_parent
from speech_assets.runtime.waiting import wait_until
from speech_assets_tests.conftest import REPO
from speech_assets_tests.support.ports import free_port

VENV = Path(sys.prefix)
STAMP = VENV / ".installed"  # the Makefile's $(STAMP) for VENV=$(VENV)
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="LOUD SKIP: no make on this machine")

# what each test below covers; the Makefile's .PHONY list and the README's `make X` must agree
SERVED = ("ui", "mlflow")
DRY = ("demo", "test", "test-all", "bench")
TESTED = {*SERVED, *DRY, "install", "clean"}

# what a user cannot act on: Python's warnings (`SupersessionWarning: ...`) and Dagster's WARNING lines
WARNING = re.compile(r"\w+Warning: |WARNING")  # Dagster colours the level: no \b before it


def _env(tmp_path: Path) -> dict[str, str]:
    """This environment without the variables of a make that runs this test (`make test`), with a
    DAGSTER_HOME and data dir of the test's own."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    return env | {
        "DAGSTER_HOME": str(tmp_path / "dagster_home"),
        "SPEECH_ASSETS_DATA_DIR": str(tmp_path / "out"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }


def _make_args(*args: str) -> list[str]:
    return [MAKE or "make", "--no-print-directory", f"VENV={VENV}", "-o", str(STAMP), *args]


def _dry_run(target: str, tmp_path: Path) -> list[str]:
    done = subprocess.run(
        _make_args("-n", target), cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _unresolved(line: str, env: dict[str, str]) -> list[str]:
    """The programs, scripts and modules a shell command line names that do not exist."""
    missing = []
    for command in re.split(r"&&|\|\||;", line):
        words = shlex.split(command)
        path = env["PATH"]
        while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value prefixes
            name, value = words.pop(0).split("=", 1)
            if name == "PATH":
                path = value.replace("$PATH", env["PATH"])
        if words[:1] == ["env"]:
            words.pop(0)
            while words and (words[0].startswith("-") or "=" in words[0]):
                words = words[2:] if words[0] == "-u" else words[1:]
        if words[:1] in (["exec"], ["@exec"]):
            words.pop(0)
        if not words or words[0] in ("cd", "test", "touch", "command", "mkdir", "rm", "echo"):
            continue
        program = words[0]
        found = (REPO / program).is_file() if "/" in program else shutil.which(program, path=path)
        if not found or ("/" in program and not os.access(REPO / program, os.X_OK)):
            missing.append(program)
        missing += [word for word in words[1:] if word.endswith((".py", ".sh")) and not (REPO / word).is_file()]
        if words[1:2] == ["-m"] and importlib.util.find_spec(words[2]) is None:  # python -m MODULE
            missing.append(f"-m {words[2]}")
    return missing


def test_make_targets_are_all_tested_and_the_readme_names_only_real_ones() -> None:
    """Kills: a target added to the Makefile (or named in the README) that no test here runs."""
    makefile = (REPO / "Makefile").read_text()
    phony = set(re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split())
    assert phony == TESTED
    named = set(re.findall(r"`make ([\w-]+)", (REPO / "README.md").read_text()))
    assert named and named <= phony, named - phony


@pytest.mark.parametrize("target", DRY)
def test_make_targets_dry_run_commands_resolve(target: str, tmp_path: Path) -> None:
    """`make -n TARGET`: every command it would run names a program on its PATH (the venv's
    for the project's tools), a script or benchmark of the repository, or a module that imports.
    Kills: `PATH="$(CURDIR)/$(BIN):..."` (with an absolute VENV, /repo//abs/venv/bin: `make demo`'s
    script finds no dagster), and any renamed script, benchmark or tool."""
    env = _env(tmp_path)
    lines = _dry_run(target, tmp_path)
    assert lines, f"make -n {target} runs nothing"
    problems = {line: _unresolved(line, env) for line in lines}
    assert not any(problems.values()), problems
    if target == "demo":  # materialize_all.sh calls `dagster` and `python` from that PATH
        (line,) = lines
        path = shlex.split(line)[0].split("=", 1)[1].replace("$PATH", "")
        assert shutil.which("dagster", path=path) == str(VENV / "bin" / "dagster"), line


def test_make_targets_install_creates_the_venv_and_installs_the_project(tmp_path: Path) -> None:
    """`make -n install` into an empty folder: the venv is created with $(PYTHON), the project
    installed editable with its dev extra (which pyproject.toml defines), the stamp touched last.
    Kills: a stamp touched before the install, and installing an extra pyproject.toml lacks."""
    import tomllib

    venv = tmp_path / "venv"
    done = subprocess.run(
        [MAKE or "make", "--no-print-directory", "-n", f"VENV={venv}", "install"],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert any(f"-m venv {venv}" in line for line in lines), lines
    (install,) = [line for line in lines if " -e " in line]
    assert shlex.split(install)[0] == f"{venv}/bin/pip"
    extras = re.findall(r"\.\[([\w,-]+)\]", install)
    defined = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras and set(",".join(extras).split(",")) <= set(defined), (extras, sorted(defined))
    assert lines[-1] == f"touch {venv}/.installed"


def test_make_targets_clean_removes_the_outputs_and_keeps_the_corpus(tmp_path: Path) -> None:
    """`make clean` for real, in a scratch folder laid out like the repository's data/. Kills:
    `rm -rf data` (the sample corpus with it), and a clean that leaves the Dagster instance."""
    for folder in ("out/features", "dagster_home/history", "sample/19"):
        (tmp_path / "data" / folder).mkdir(parents=True)
        (tmp_path / "data" / folder / "file").write_text("x")
    done = subprocess.run(
        [MAKE or "make", "--no-print-directory", "-f", str(REPO / "Makefile"), "clean"],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["sample"]
    assert (tmp_path / "data" / "sample" / "19" / "file").is_file()


DAGSTER_DEV_STOP_S = 2 * 60 + 60


def _as_a_terminal_job() -> None:
    """In the child, before make: SIGINT at its default, as a terminal's foreground job has it.
    A pytest started in the background (`pytest &`, nohup) passes SIGINT on ignored; Python then
    installs no KeyboardInterrupt handler and Dagster's `dg dev` maps SIGTERM to that ignored
    handler too, so Ctrl-C left the webserver, daemon and code server running (the 2026-11-29
    "under load" failures were such background runs)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent(signal.SIGTERM)


class Served:
    """`make TARGET VAR=...` started in a session of its own, its output in a file; :meth:`stop`
    is the user's Ctrl-C (SIGINT to the whole group, as a terminal sends it)."""

    def __init__(self, tmp_path: Path, target: str, *variables: str) -> None:
        self.env = _env(tmp_path)
        self.data_dir = self.env["SPEECH_ASSETS_DATA_DIR"]
        self.log = tmp_path / f"make-{target}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                _make_args(target, *variables),
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_as_a_terminal_job,  # noqa: PLW1509
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def check_running(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"make exited with {self.process.returncode}:\n{self.output()[-4000:]}")

    def tree(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        return []

    def listening(self) -> set[tuple[str, int]]:
        """(address, port) of every TCP socket a process of the tree listens on."""
        found = set()
        for process in self.tree():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                found |= {
                    (c.laddr.ip, c.laddr.port)
                    for c in process.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN
                }
        return found

    def left_behind(self) -> list[psutil.Process]:
        """Live processes (zombies aside) with this run's data dir in their environment: the whole
        tree, also what left the session or was re-parented."""
        found = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                if process.pid == os.getpid() or process.status() == psutil.STATUS_ZOMBIE:
                    continue
                if process.environ().get("SPEECH_ASSETS_DATA_DIR") == self.data_dir:
                    found.append(process)
        return found

    def stop(self, grace: float = 120.0) -> list[str]:
        """Ctrl-C, then what is still there after ``grace`` seconds (killed, so nothing stays)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGINT)
        with contextlib.suppress(Exception):
            wait_until(lambda: not self.left_behind(), grace, "make and its processes to exit", interval=0.5)
        left = []
        for process in self.left_behind():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                left.append(f"{process.pid} {' '.join(process.cmdline())[:160]}")
                process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        return left


def _get(url: str, data: bytes | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} if data else {}
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=30) as response:
        return response.status, response.read()


def _answers(url: str) -> bool:
    with contextlib.suppress(OSError):
        return _get(url)[0] == 200
    return False


LOCATION_QUERY = json.dumps(
    {
        "query": "{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus locationOrLoadError "
        "{ __typename } } } } }"
    }
).encode()


# slow: dg dev starts a webserver, a daemon and a code server (alone the test takes about 20 s)
@pytest.mark.slow
def test_make_targets_ui_serves_dagster_on_loopback_quietly_and_stops(tmp_path: Path) -> None:
    """`make ui`: the webserver answers on 127.0.0.1 with the speech_assets code location loaded,
    nothing listens beyond loopback, the output has no warning (Dagster 1.13's SupersessionWarning
    for `dagster dev`, its warning about a dagster.yaml in the working folder that is not
    $DAGSTER_HOME's), and Ctrl-C leaves no process. Kills: `dagster dev` instead of `dg dev`, the
    UI run from the repository root, `UI_HOST ?= 0.0.0.0`, and a code location that fails to load
    from $DAGSTER_HOME."""
    port = free_port()
    served = Served(tmp_path, "ui", f"UI_PORT={port}")
    try:

        def loaded() -> bool:
            served.check_running()
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                entries = json.loads(_get(f"http://127.0.0.1:{port}/graphql", LOCATION_QUERY)[1])
                (entry,) = entries["data"]["workspaceOrError"]["locationEntries"]
                assert entry["locationOrLoadError"]["__typename"] != "PythonError", entry
                return entry["name"] == "speech_assets" and entry["loadStatus"] == "LOADED"
            return False

        wait_until(loaded, 300, "make ui to serve the loaded code location", interval=1.0)
        assert _answers(f"http://127.0.0.1:{port}/asset-groups")
        listening = served.listening()
        assert ("127.0.0.1", port) in listening, listening
        assert {address for address, _ in listening} <= {"127.0.0.1", "::1"}, listening
        assert (Path(served.env["DAGSTER_HOME"]) / "dagster.yaml").is_file()
    finally:
        # `dagster dev` gives the webserver and then the daemon 60 s each to stop before it kills them
        left = served.stop(grace=DAGSTER_DEV_STOP_S)
    output = served.output()
    assert not left, left
    assert "Serving dagster-webserver on http://127.0.0.1:" in output, output
    assert not WARNING.findall(output), output


def test_make_targets_mlflow_prints_the_runs_table_serves_on_loopback_and_stops(tmp_path: Path) -> None:
    """`make mlflow` over a data dir with no store yet: it prints the link to the speech_assets
    experiment's runs table on its port (the experiment created in the store it then serves), the
    server answers for that experiment on 127.0.0.1 only, without MLflow's GenAI job runner (eight
    processes more and a slower start), and Ctrl-C leaves no process. Kills: the Makefile's import
    of a function tracking.py lacks (the target failed at once), a link to another port or
    experiment, `--host 0.0.0.0`, and the job runner left on."""
    port = free_port()
    served = Served(tmp_path, "mlflow", f"MLFLOW_PORT={port}")
    try:

        def link() -> str | None:
            served.check_running()
            found = re.search(r"MLflow runs \(every model, tagged by mode\): (\S+)", served.output())
            return found and found.group(1)

        url = wait_until(link, 300, "make mlflow to print its link", interval=0.5)
        found = re.fullmatch(
            rf"http://127\.0\.0\.1:{port}/#/experiments/(\d+)/runs\?workflowType=machine_learning", url
        )
        assert found, url

        def up() -> bool:
            served.check_running()
            return _answers(f"http://127.0.0.1:{port}/health")

        wait_until(up, 300, "make mlflow to serve", interval=1.0)
        _, body = _get(f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/get?experiment_id={found[1]}")
        assert json.loads(body)["experiment"]["name"] == "speech_assets"
        assert _answers(f"http://127.0.0.1:{port}/")  # the UI's page
        listening = served.listening()
        assert ("127.0.0.1", port) in listening, listening
        assert {address for address, _ in listening} <= {"127.0.0.1", "::1"}, listening
        jobs = [p.cmdline() for p in served.tree() if "mlflow.server.jobs" in " ".join(p.cmdline())]
        assert not jobs, jobs
    finally:
        left = served.stop()
    assert not left, left


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
def test_make_targets_mlflow_link_opens_the_runs_table_in_a_browser(tmp_path: Path) -> None:
    """The link `make mlflow` prints, opened in headless Chromium: the runs table (its Run Name
    column) in the UI's machine-learning view (its sidebar has the model registry). Kills: a link
    without `/runs` (MLflow 3.17 opens the experiment on its GenAI traces, whatever the experiment's
    kind tag) and one without `workflowType=machine_learning` (the GenAI sidebar)."""
    if CHROMIUM is None:
        pytest.skip("LOUD SKIP: Debian's chromium is not installed (make test-all installs it when run as root)")
    from playwright.sync_api import sync_playwright

    port = free_port()
    served = Served(tmp_path, "mlflow", f"MLFLOW_PORT={port}")
    try:
        url = wait_until(
            lambda: (
                served.check_running()
                or re.search(r"MLflow runs \(every model, tagged by mode\): (\S+)", served.output())
            ),
            300,
            "make mlflow to print its link",
            interval=0.5,
        ).group(1)
        wait_until(
            lambda: served.check_running() or _answers(f"http://127.0.0.1:{port}/health"), 300, "the UI", interval=1.0
        )
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu", "--no-first-run"]
            )
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.goto(url)
                page.get_by_text("Run Name", exact=True).first.wait_for(timeout=90_000)
                page.get_by_text("Model registry", exact=True).first.wait_for(timeout=30_000)
                assert "/runs" in page.url and "workflowType=machine_learning" in page.url, page.url
            finally:
                browser.close()
    finally:
        left = served.stop()
    assert not left, left


def test_make_test_hands_out_the_heaviest_modules_first() -> None:
    """Kills: loadscope's modules handed out by test count (xdist's default) or a table that names a
    module no longer there; each module keeps its own order (its fixtures rely on it)."""
    from types import SimpleNamespace

    from speech_assets_tests import conftest

    tests = REPO / "speech_assets_tests"
    assert all((tests / module).is_file() for module in conftest.MODULE_SECONDS), "a stale MODULE_SECONDS entry"
    config = SimpleNamespace(option=SimpleNamespace(dist="loadscope", loadscopereorder=True))
    conftest.pytest_configure(config)
    assert config.option.loadscopereorder is False
    heavy, light = sorted(conftest.MODULE_SECONDS, key=conftest.MODULE_SECONDS.get)[-2:], "test_cli.py"
    nodeids = [f"speech_assets_tests/{module}::test_{i}" for module in (light, *heavy) for i in range(3)]
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]
    conftest.pytest_collection_modifyitems(items)
    assert [item.nodeid for item in items] == nodeids[6:] + nodeids[3:6] + nodeids[:3]
