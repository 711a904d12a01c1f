"""What the SDK raises. Every error derives from `marlaas.errors.MarlaasError` (and the
matching builtin), and its message is the server's own `detail`, so the CLI can print
it as one line."""

from __future__ import annotations

from typing import Any

from marlaas.errors import CapacityError, MarlaasError


class ClientError(MarlaasError):
    """Base of the SDK's errors."""


class ConnectionFailed(ClientError, ConnectionError):
    """The server could not be reached (or the connection broke)."""


class ApiError(ClientError):
    """The server answered with an error status; `detail` is its explanation."""

    def __init__(self, status_code: int, detail: str, body: Any = None) -> None:
        super().__init__(f"{detail} (HTTP {status_code})")
        self.status_code = status_code
        self.detail = detail
        self.body = body


class AuthError(ApiError, PermissionError):
    """401/403: a missing, invalid or revoked key, or the wrong kind of key."""


class NotFoundError(ApiError, LookupError):
    """404: no such job, checkpoint or route (another tenant's job answers the same)."""


class ConflictError(ApiError, ValueError):
    """409: the request clashes with the current state (a taken name, a done job)."""


class RequestInvalid(ApiError, ValueError):
    """422: the server rejected a field; `detail` lists each field and what is wrong."""


class PayloadTooLarge(ApiError, ValueError):
    """413: the request body is above the server's limit."""


class QuotaExceeded(ApiError, CapacityError):
    """429: a quota of the tenant would be exceeded."""


class ServerError(ApiError, RuntimeError):
    """5xx, or an answer the SDK does not understand."""


_BY_STATUS: dict[int, type[ApiError]] = {
    401: AuthError,
    403: AuthError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLarge,
    422: RequestInvalid,
    429: QuotaExceeded,
}


def _detail(body: Any, fallback: str) -> str:
    """The server's message; FastAPI's field errors become `loc: msg; loc: msg`."""
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, str) and detail:
        return detail
    if isinstance(detail, list) and detail:
        parts = []
        for item in detail:
            if not isinstance(item, dict):
                parts.append(str(item))
                continue
            loc = [str(p) for p in item.get("loc", ()) if p not in ("body", "query", "path")]
            msg = str(item.get("msg", "invalid"))
            parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
        return "; ".join(parts)
    return fallback


def api_error(status_code: int, body: Any, reason: str) -> ApiError:
    """The exception for an error answer with JSON (or text) `body`."""
    fallback = (body if isinstance(body, str) and body.strip() else reason) or "error"
    cls = _BY_STATUS.get(status_code, ServerError if status_code >= 500 else ApiError)
    return cls(status_code, _detail(body, str(fallback).strip()[:500]), body)
