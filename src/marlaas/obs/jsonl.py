"""Append-only JSON-lines files that survive a crash line by line.

`JsonlWriter.write` serialises one record as strict JSON (no NaN; see `to_jsonable`),
writes it as one line and flushes it to the operating system at once, so a crash of
the process loses at most the line being written. There is no fsync per line: that
would cost a disk round trip per metric; a power loss may lose the last few lines.
`read_jsonl` reads such a file back and skips a torn last line.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path

from marlaas.fileio import to_jsonable


class JsonlWriter:
    """One JSONL file opened for appending; thread-safe; writes after `close` are dropped."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: Mapping[str, object]) -> None:
        line = json.dumps(to_jsonable(record), separators=(",", ":")) + "\n"
        with self._lock:
            if self._file.closed:
                return  # a late report from a stage still shutting down
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, object]]:
    """The records of a JSONL file; a torn last line (a crash mid-write) is skipped."""
    records = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise
        records.append(record)
    return records
