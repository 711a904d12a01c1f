"""File helpers every stage shares: JSON-safe values and atomic writes.

State and reports on disk are written through these (temporary file, fsync, rename), so a
crash leaves the old file or the complete new one, never a partial one.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path


def to_jsonable(value: object) -> object:
    """`value` as something `json.dumps` writes as strict JSON.

    Non-finite floats become None (strict JSON has no NaN); containers are converted
    recursively; anything else unknown becomes its `str`.
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [to_jsonable(v) for v in value]
    try:  # numpy and torch scalars
        item = value.item()  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return str(value)
    return to_jsonable(item) if isinstance(item, bool | int | float | str) else str(value)


def atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` on a temporary file next to `path`, fsync it, rename it over `path`.

    Readers see the old file or the complete new one, never a partial one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    tmp.chmod(0o644)  # mkstemp makes it owner-only; these are reports meant to be shared
    try:
        write(tmp)
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""

    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")

    return atomic_write(path, write)


def atomic_write_json(path: Path, data: object, *, sort_keys: bool = False) -> Path:
    """Write `data` as indented strict JSON to `path` atomically."""
    text = json.dumps(to_jsonable(data), indent=2, sort_keys=sort_keys) + "\n"
    return atomic_write_text(path, text)
