"""A checkpoint's adapter as a downloadable archive (`.tar.gz` or `.zip`), streamed.

A checkpoint row's `path` (relative to the artifact directory) is either a PEFT
adapter directory itself or a tenant checkpoint directory holding one under
`adapter/` (the layout of `marlaas.train.checkpoint`). Only the two PEFT files are
sent, inside one top-level folder, and only when they are regular files that resolve
inside the artifact directory: a row or a symlink pointing elsewhere answers 404 like
a missing file, never the file.

The files are opened before the answer starts (so a missing file is a clean 404, and
an atomic replace of the directory meanwhile cannot mix two versions); the archive is
then produced chunk by chunk as the client reads, never whole in memory.
"""

from __future__ import annotations

import enum
import os
import stat
import tarfile
import time
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from marlaas.model.peft_io import CONFIG_NAME, WEIGHTS_NAME
from marlaas.service.errors import NotFound

CHUNK = 256 * 1024
ADAPTER_FILES = (CONFIG_NAME, WEIGHTS_NAME)
ADAPTER_SUBDIR = "adapter"


class ArchiveFormat(enum.StrEnum):
    TAR_GZ = "tar.gz"
    ZIP = "zip"

    @property
    def media_type(self) -> str:
        return "application/gzip" if self is ArchiveFormat.TAR_GZ else "application/zip"


@dataclass
class OpenFile:
    name: str
    handle: BinaryIO
    size: int
    mtime: float


def _gone(step: int) -> NotFound:
    return NotFound(
        f"the adapter files of the checkpoint at step {step} are not on disk (older "
        "checkpoints are pruned); list the job's checkpoints and download a newer one"
    )


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def open_adapter(artifact_dir: Path, relative: str, step: int) -> list[OpenFile]:
    """Open the PEFT files of the checkpoint stored at `relative`; `NotFound` when they
    are missing or anything resolves outside `artifact_dir`. The caller closes them
    (`stream_archive` does)."""
    root = artifact_dir.resolve()
    start = (root / relative).resolve()
    if not _inside(start, root) or not start.is_dir():
        raise _gone(step)
    folder = start if (start / CONFIG_NAME).exists() else (start / ADAPTER_SUBDIR).resolve()
    if not _inside(folder, root):
        raise _gone(step)
    opened: list[OpenFile] = []
    try:
        for name in ADAPTER_FILES:
            path = (folder / name).resolve()
            if not _inside(path, root) or not path.is_file():
                raise _gone(step)
            handle = open(path, "rb")  # noqa: SIM115 - closed by the caller/stream
            info = os.fstat(handle.fileno())
            opened.append(OpenFile(name, handle, info.st_size, info.st_mtime))
            if not stat.S_ISREG(info.st_mode):
                raise _gone(step)
    except BaseException:
        close_all(opened)
        raise
    return opened


def close_all(files: list[OpenFile]) -> None:
    for f in files:
        f.handle.close()


def _chunks(f: OpenFile) -> Iterator[bytes]:
    """Exactly `f.size` bytes of the file (its size when opened)."""
    left = f.size
    while left > 0:
        data = f.handle.read(min(CHUNK, left))
        if not data:
            raise OSError(f"{f.name} shrank while it was being sent")
        left -= len(data)
        yield data


def _tar_gz(folder: str, files: list[OpenFile]) -> Iterator[bytes]:
    gz = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: gzip framing
    now = int(time.time())
    head = tarfile.TarInfo(folder)
    head.type, head.mode, head.mtime = tarfile.DIRTYPE, 0o755, now
    yield gz.compress(head.tobuf(format=tarfile.USTAR_FORMAT))
    for f in files:
        info = tarfile.TarInfo(f"{folder}/{f.name}")
        info.size, info.mode, info.mtime = f.size, 0o644, int(f.mtime)
        yield gz.compress(info.tobuf(format=tarfile.USTAR_FORMAT))
        for data in _chunks(f):
            yield gz.compress(data)
        yield gz.compress(b"\0" * (-f.size % tarfile.BLOCKSIZE))
    yield gz.compress(b"\0" * (2 * tarfile.BLOCKSIZE))  # end-of-archive marker
    yield gz.flush()


class _Sink:
    """A write-only, non-seekable file that hands out what was written so far."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


def _zip(folder: str, files: list[OpenFile]) -> Iterator[bytes]:
    sink = _Sink()
    with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_DEFLATED) as zf:  # type: ignore[call-overload]
        for f in files:
            info = zipfile.ZipInfo(
                f"{folder}/{f.name}", date_time=time.localtime(max(f.mtime, 315532800))[:6]
            )
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            info.file_size = f.size
            with zf.open(info, "w", force_zip64=f.size > 2**31) as out:
                for data in _chunks(f):
                    out.write(data)
                    if chunk := sink.take():
                        yield chunk
            if chunk := sink.take():
                yield chunk
    yield sink.take()


def stream_archive(fmt: ArchiveFormat, folder: str, files: list[OpenFile]) -> Iterator[bytes]:
    """The archive of `files` under `folder/`, chunk by chunk; closes the files."""
    produce = _tar_gz if fmt is ArchiveFormat.TAR_GZ else _zip
    try:
        for chunk in produce(folder, files):
            if chunk:
                yield chunk
    finally:
        close_all(files)
