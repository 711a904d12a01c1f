"""Errors the API answers with, each carrying its HTTP status. They derive from the
project's hierarchy (and the matching builtin), and their message is the response's
`detail`: it says what was wrong and what to do."""

from __future__ import annotations

import re
from collections.abc import Mapping

from marlaas.errors import CapacityError, MarlaasError

# An absolute path of two components or more, not part of a URL or a relative path.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/(?:[\w.@+~-]+/)+([\w.@+~-]*)")


def redact_paths(text: str, names: Mapping[str, str] | None = None) -> str:
    """`text` without the server's absolute file paths: each of `names` (a path) becomes
    its label, any other absolute path its last component (`.../name`). Messages that
    reach a tenant (a job's failure reason, a 422) go through it."""
    for path, label in (names or {}).items():
        text = text.replace(path, label)
    return _ABSOLUTE_PATH.sub(lambda m: f".../{m.group(1)}", text)


class ServiceError(MarlaasError):
    """Base of the errors that become an HTTP answer."""

    status_code = 500


class Unauthorized(ServiceError, PermissionError):
    status_code = 401


class Forbidden(ServiceError, PermissionError):
    status_code = 403


class NotFound(ServiceError, LookupError):
    status_code = 404


class Conflict(ServiceError, ValueError):
    """The request is valid but clashes with the current state (a name taken, a job
    that cannot be paused in its status)."""

    status_code = 409


class QuotaExceeded(ServiceError, CapacityError):
    status_code = 429


class PayloadTooLarge(ServiceError, ValueError):
    status_code = 413


class InvalidField(ServiceError, ValueError):
    """A field of a valid-looking request that the service cannot accept (an unknown
    task family, a dataset that was never uploaded). Answered as 422 with its location,
    like pydantic's own validation errors."""

    status_code = 422

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message
