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
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from speech_assets.layout import TEMP_SUFFIX

_CHUNK = 1 << 20
Config = TypeVar("Config")


# Files renamed into place inside `deferred_fsync()`, fsynced together when it ends (None: outside).
_DEFERRED: contextvars.ContextVar[list[Path] | None] = contextvars.ContextVar("deferred_fsync", default=None)


def temp_target(name: str) -> str | None:
    """The name of the file whose :func:`atomic_path` temp file is ``name``
    (``.<target>.<random>.tmp``), or ``None`` where ``name`` is no such temp file."""
    if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
        return None
    target, dot, random = name[1 : -len(TEMP_SUFFIX)].rpartition(".")
    return target if dot and target and random else None


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str], durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success fsync it and rename it into place.

    The temp file lives in the same folder (so the rename is atomic on POSIX) and carries a
    ``.tmp`` suffix that no reader trusts. On any exception it is removed and ``target`` is
    left untouched: a reader sees the old file or the new one, never half of one.

    Inside :func:`deferred_fsync` the file is renamed at once and fsynced (with its folder) when
    that block ends. ``durable=False`` never fsyncs: for a file whose loss after a crash only
    costs a rebuild (a shard's meta, written after the files it vouches for are durable).
    """
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
    """Files written with :func:`atomic_path` inside this block are renamed into place at once and
    made durable together when it ends: each file fsynced once, each folder once.

    For a group of files that something written *after* the block vouches for (a shard's meta
    records its files' sizes and mtimes): a crash inside the block can leave a renamed file
    whose data never reached the disk, but nothing vouches for it yet, so it is rebuilt. Saves
    a folder fsync per file (a shard and its two sidecars: one instead of three).
    """
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
    """This process's umask, read without changing it (``os.umask`` can only be read by setting it,
    which races with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(target: str | os.PathLike[str], data: bytes, durable: bool = True) -> None:
    with atomic_path(target, durable=durable) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(target: str | os.PathLike[str], text: str, durable: bool = True) -> None:
    atomic_write_bytes(target, text.encode("utf-8"), durable=durable)


def publish_folder(staging: Path, folder: Path) -> None:
    """Put the finished ``staging`` folder (a sibling of ``folder``) in ``folder``'s place, its
    files and itself with the modes the umask gives (mkdtemp made the folder 0700)."""
    for file in staging.iterdir():
        file.chmod(0o666 & ~current_umask())
    staging.chmod(0o777 & ~current_umask())
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)


def fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_strings(parts: Iterable[str]) -> str:
    """Hash an ordered sequence of strings unambiguously (each part is length-prefixed)."""
    digest = hashlib.sha256()
    for part in parts:
        encoded = part.encode("utf-8")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()


def remove_stale_temp_files(target: str | os.PathLike[str]) -> int:
    """Delete leftovers of writers of ``target`` that died mid-write (``.<name>.*.tmp``).

    Only temp files of this one target: call it while holding the target's lock
    (:func:`speech_assets.runtime.locks.exclusive_lock`), so that no live writer's temp file can be among them.
    """
    target = Path(target)
    removed = 0
    for leftover in target.parent.glob(f".{target.name}.*{TEMP_SUFFIX}"):
        leftover.unlink(missing_ok=True)
        removed += 1
    return removed


def save_npz(target: str | os.PathLike[str], arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` as an .npz atomically and byte-deterministically.

    ``np.savez`` stamps the current time into each zip entry, so the same arrays would hash
    differently on every run; here entries are sorted and dated 1980-01-01.
    """
    with atomic_path(target) as tmp:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as archive:
            for name in sorted(arrays):
                buffer = io.BytesIO()
                np.lib.format.write_array(buffer, np.asarray(arrays[name]), allow_pickle=False)
                archive.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), buffer.getvalue())


def from_fields(cls: type[Config], source: object, **given: Any) -> Config:
    """A ``cls`` dataclass filled from ``source`` (a dataclass or pydantic model): the ``given``
    values, else ``source``'s same-named fields, else ``cls``'s defaults; never copied by hand."""
    names = getattr(type(source), "model_fields", None) or {f.name for f in dataclasses.fields(source)}
    shared = {
        f.name: getattr(source, f.name) for f in dataclasses.fields(cls) if f.name in names and f.name not in given
    }
    return cls(**shared, **given)


def read_json(path: Path, *, strict: bool = False) -> dict:
    """The JSON object a step recorded in ``path``; ``{}`` when there is none. An unreadable or
    corrupt file reads as ``{}`` too (the step rebuilds it), unless ``strict``: a check, or a
    reader that needs the file, fails on it instead."""
    if strict:
        return json.loads(path.read_text()) if path.is_file() else {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
