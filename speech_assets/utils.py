"""Small shared helpers: atomic writes, content hashes, configs filled from one another."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import io
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from speech_assets.layout import TEMP_SUFFIX

Config = TypeVar("Config")


# Files renamed into place inside `deferred_fsync()`, fsynced together when it ends (None: outside).
_DEFERRED: contextvars.ContextVar[list[Path] | None] = contextvars.ContextVar("deferred_fsync", default=None)


def temp_target(name: str) -> str | None:
    """The file whose :func:`atomic_path` temp file is ``name`` (``.<target>.<random>.tmp``), else None."""
    if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
        return None
    target, dot, random = name[1 : -len(TEMP_SUFFIX)].rpartition(".")
    return target if dot and target and random else None


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str], durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``target`` (so the rename is atomic); on success fsync it and
    rename it into place, on any exception remove it: a reader never sees half a file. Inside
    :func:`deferred_fsync` the fsync waits for the block's end; ``durable=False`` never fsyncs (for
    a file whose loss after a crash only costs a rebuild)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMP_SUFFIX, dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    deferred = _DEFERRED.get() if durable else None
    try:
        yield tmp
        if durable and deferred is None:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        # mkstemp creates 0600; the published file gets what a plain open() would give it
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, target)
        if deferred is not None:
            deferred.append(target)
        elif durable:
            fsync_dir(target.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def deferred_fsync() -> Iterator[None]:
    """Files written with :func:`atomic_path` inside this block are fsynced together when it ends, each
    folder once. Only for files that something written after the block vouches for: a crash inside
    it leaves nothing vouched for, so it is rebuilt."""
    if _DEFERRED.get() is not None:  # nested: the outer block syncs
        yield
        return
    written: list[Path] = []
    token = _DEFERRED.set(written)
    try:
        yield
    finally:
        _DEFERRED.reset(token)
    for path in dict.fromkeys(written):
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    for folder in dict.fromkeys(path.parent for path in written):
        fsync_dir(folder)


def current_umask() -> int:
    """This process's umask, read without setting it (which races with threads creating files)."""
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(target: str | os.PathLike[str], text: str, durable: bool = True) -> None:
    with atomic_path(target, durable=durable) as tmp:
        tmp.write_bytes(text.encode("utf-8"))


@contextlib.contextmanager
def published_folder(folder: Path) -> Iterator[Path]:
    """A sibling staging folder, put in ``folder``'s place with the umask's modes (mkdtemp makes
    it 0700) when the block succeeds: never half a folder."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        yield staging
        for file in staging.iterdir():
            file.chmod(0o666 & ~current_umask())
        staging.chmod(0o777 & ~current_umask())
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sha256_file(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def sha256_strings(parts: Iterable[str]) -> str:
    """Hash an ordered sequence of strings unambiguously (each part is length-prefixed)."""
    digest = hashlib.sha256()
    for part in parts:
        encoded = part.encode("utf-8")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()


def remove_stale_temp_files(target: str | os.PathLike[str]) -> int:
    """Delete temp files of writers of ``target`` that died mid-write; hold the target's lock, so no
    live writer's temp file is among them."""
    target = Path(target)
    leftovers = list(target.parent.glob(f".{target.name}.*{TEMP_SUFFIX}"))
    for leftover in leftovers:
        leftover.unlink(missing_ok=True)
    return len(leftovers)


def save_npz(target: str | os.PathLike[str], arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` as an .npz atomically and byte-deterministically (``np.savez`` stamps the time
    into each entry; here entries are sorted and dated 1980-01-01)."""
    with atomic_path(target) as tmp:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as archive:
            for name in sorted(arrays):
                buffer = io.BytesIO()
                np.lib.format.write_array(buffer, np.asarray(arrays[name]), allow_pickle=False)
                archive.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), buffer.getvalue())


def from_fields(cls: type[Config], source: object, **given: Any) -> Config:
    """A ``cls`` dataclass of the ``given`` values, else ``source``'s same-named fields, else its defaults."""
    names = getattr(type(source), "model_fields", None) or {f.name for f in dataclasses.fields(source)}
    shared = {
        f.name: getattr(source, f.name) for f in dataclasses.fields(cls) if f.name in names and f.name not in given
    }
    return cls(**shared, **given)


def read_json(path: Path, *, strict: bool = False) -> dict:
    """The JSON object in ``path``; ``{}`` when there is none or, unless ``strict``, it is corrupt or not
    an object (rebuilt)."""
    if strict:
        return json.loads(path.read_text()) if path.is_file() else {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return {}
    return value if isinstance(value, dict) else {}


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of ``path``, one a line, none when it is missing (NaN and Infinity read as written)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def markdown_table(header: Sequence[str], rows: Iterable[Iterable[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
