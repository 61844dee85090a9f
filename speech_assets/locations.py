"""Where things live: repository root, corpus, data dir, Dagster home and MLflow store.

Relative values of the environment variables resolve against the repository root, so that
`make demo`, `dagster dev` and tests agree on one layout.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlparse

from speech_assets import layout


def repo_root() -> Path:
    """The checkout this package runs from (falls back to the working directory when installed)."""
    explicit = os.environ.get("SPEECH_ASSETS_REPO_ROOT")
    if explicit:
        return Path(explicit).resolve()
    candidate = Path(__file__).resolve().parent.parent
    if (candidate / "pyproject.toml").is_file():
        return candidate
    return Path.cwd().resolve()


def resolve(path: str | os.PathLike[str]) -> Path:
    """Absolute form of ``path``; relative paths are taken from the repository root."""
    path = Path(os.path.expanduser(os.fspath(path)))
    return path if path.is_absolute() else (repo_root() / path)


def sample_corpus() -> Path:
    return repo_root() / "data" / "sample"


def corpus_location() -> Path:
    """``$SPEECH_ASSETS_CORPUS``: a LibriSpeech-layout folder or a .csv/.jsonl manifest file."""
    return resolve(os.environ.get("SPEECH_ASSETS_CORPUS") or sample_corpus())


def data_dir() -> Path:
    return resolve(os.environ.get("SPEECH_ASSETS_DATA_DIR") or "data/out")


def dagster_home() -> Path:
    return resolve(os.environ.get("DAGSTER_HOME") or "data/dagster_home")


TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"


def mlflow_tracking_uri(data: Path | None = None) -> str:
    return os.environ.get(TRACKING_URI_ENV) or f"sqlite:///{layout.DataLayout(data or data_dir()).mlflow_db}"


MLFLOW_SERVER_SCHEMES = ("http", "https")
# query parameters that carry a credential (?token=..., ?access_token=..., ?X-Amz-Signature=...)
SECRET_PARAMETER = re.compile(r"token|secret|passw|pwd|key|sig|auth|credential|session", re.IGNORECASE)
REDACTED = "REDACTED"


def redact_uri(uri: str) -> str:
    """``uri`` fit to store, log or show: without the user info of a server's address, without
    a database password, and with the value of every credential-like query parameter replaced.

    A database user keeps its name (libpq then reads the password from ``$PGPASSWORD``)."""
    parsed = urlparse(uri)
    changed = parsed
    if "@" in parsed.netloc:
        user, _, host = parsed.netloc.rpartition("@")
        keep = parsed.scheme not in MLFLOW_SERVER_SCHEMES  # a database role, not a token
        changed = changed._replace(netloc=f"{user.split(':', 1)[0]}@{host}" if keep else host)
    if parsed.query:
        pairs = parse_qsl(parsed.query, keep_blank_values=True)
        if any(SECRET_PARAMETER.search(name) for name, _ in pairs):
            query = urlencode([(name, REDACTED if SECRET_PARAMETER.search(name) else value) for name, value in pairs])
            changed = changed._replace(query=query)
    return uri if changed is parsed else changed.geturl()


def with_credentials(uri: str) -> str:
    """The tracking URI to connect with: ``$MLFLOW_TRACKING_URI`` where ``uri`` is its redacted
    form (credentials travel in the environment, never in a config file), else ``uri``."""
    explicit = os.environ.get(TRACKING_URI_ENV)
    if explicit and explicit != uri and redact_uri(explicit) == uri:
        return explicit
    return uri


def mlflow_artifact_location(tracking_uri: str, data: Path | None = None) -> str | None:
    """Where a new MLflow experiment keeps its artifacts: for a tracking server, ``None`` (its own
    store, which every client on the team sees); for a store the client writes itself,
    ``<data>/mlartifacts`` or beside a SQLite/file store, never MLflow's fallback ``./mlruns``."""
    parsed = urlparse(tracking_uri)
    if parsed.scheme in MLFLOW_SERVER_SCHEMES:
        return None
    if data is not None:
        return str(layout.DataLayout(data).mlflow_artifacts)
    if parsed.scheme == "sqlite":
        return str(Path(tracking_uri[len("sqlite:///") :]).parent / layout.DataLayout.mlflow_artifacts.name)
    if parsed.scheme in ("", "file"):
        return str(Path(parsed.path or tracking_uri) / layout.DataLayout.mlflow_artifacts.name)
    return None


def git_commit() -> str | None:
    """The repository's HEAD commit, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_root(), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


MODEL_URI_SCHEMES = ("models", "runs")  # MLflow model URIs `transcribe --model` downloads
