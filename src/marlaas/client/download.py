"""Unpacking a downloaded adapter archive safely: only regular files, only inside the
destination, at most one folder deep; the result is a plain PEFT directory."""

from __future__ import annotations

import re
import shutil
import tarfile
import zipfile
from pathlib import Path
from typing import IO

from marlaas.client.errors import ClientError

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _target(out: Path, name: str) -> Path:
    """Where member `name` goes, flattened into `out` (checked first)."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or len(parts) > 2 or not all(_SAFE.match(p) for p in parts):
        raise ClientError(
            f"the downloaded archive holds an unexpected entry {name[:80]!r}; refusing "
            "to unpack it (is the URL a marlaas server?)"
        )
    return out / parts[-1]


def _copy(source: IO[bytes], target: Path) -> None:
    if target.exists():
        raise ClientError(f"the downloaded archive holds {target.name} twice")
    with open(target, "wb") as f:
        shutil.copyfileobj(source, f, 1 << 20)


def unpack(archive: Path, fmt: str, out: Path) -> Path:
    """Unpack `archive` (`tar.gz` or `zip`) into the new folder `out`; check it is a
    PEFT adapter directory."""
    out.mkdir()
    try:
        if fmt == "zip":
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    target = _target(out, info.filename)
                    if info.is_dir():
                        continue
                    with zf.open(info) as source:
                        _copy(source, target)
        else:
            with tarfile.open(archive, "r:gz") as tf:
                for member in tf:
                    target = _target(out, member.name)
                    if member.isdir():
                        continue
                    if not member.isfile():
                        raise ClientError(
                            f"the downloaded archive holds a link or device {member.name!r}; "
                            "refusing to unpack it"
                        )
                    packed = tf.extractfile(member)
                    assert packed is not None  # a regular file always has one
                    with packed:
                        _copy(packed, target)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
        raise ClientError(f"the downloaded adapter archive is damaged: {e}") from e
    missing = [name for name in PEFT_FILES if not (out / name).is_file()]
    if missing:
        raise ClientError(
            f"the downloaded archive is not a PEFT adapter: it lacks {', '.join(missing)}"
        )
    return out
