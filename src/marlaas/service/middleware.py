"""ASGI middleware: request body size limits, the methods a path allows, and request
latency metrics.

All are plain ASGI (not Starlette's BaseHTTPMiddleware), so a streamed upload is
counted chunk by chunk as it arrives and never buffered here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from marlaas.service.metrics import RequestMetrics


def _too_large(limit: int, upload: bool) -> str:
    what = "upload" if upload else "request body"
    fix = "split the dataset" if upload else "send a smaller body (upload datasets separately)"
    return f"the {what} is larger than this service's limit of {limit} bytes; {fix}"


class BodyLimit:
    """Answers 413 for a body above the limit: at once when Content-Length says so,
    otherwise as soon as the streamed bytes pass it. Dataset uploads
    (`PUT /v1/datasets/...`, `POST /v1/files`) get the larger upload limit."""

    def __init__(self, app: ASGIApp, *, max_body: int, max_upload: int) -> None:
        self.app = app
        self.max_body = max_body
        self.max_upload = max_upload

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = (scope["method"] == "PUT" and scope["path"].startswith("/v1/datasets/")) or (
            scope["method"] == "POST" and scope["path"] == "/v1/files"
        )
        limit = self.max_upload if upload else self.max_body
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            response = JSONResponse({"detail": _too_large(limit, upload)}, status_code=413)
            await response(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # An HTTPException passes through FastAPI's body parsing unchanged and
                    # becomes a 413 answer with this detail.
                    raise HTTPException(413, _too_large(limit, upload))
            return message

        await self.app(scope, counted, send)


_HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
_PARAM = re.compile(r"\{([^}:]+)(:path)?\}")


def _path_regex(template: str) -> re.Pattern[str]:
    """`/v1/jobs/{job_id}` -> a regex of the paths it matches (`{x:path}` spans '/')."""
    out, last = [], 0
    for m in _PARAM.finditer(template):
        out.append(re.escape(template[last : m.start()]))
        out.append(".+" if m.group(2) else "[^/]+")
        last = m.end()
    out.append(re.escape(template[last:]))
    return re.compile("".join(out))


class AllowedMethods:
    """Every method a path takes, in `Allow` (RFC 9110): `OPTIONS` answers 204 with
    them, and a 405 lists all of them. (Starlette answers `OPTIONS` with 405, and its
    405 names only the methods of the first route whose path matched, while a path such
    as `/v1/jobs/{id}` has one route per method.) The methods are the OpenAPI schema's
    (`paths`, read once, on first use), so `Allow` and the schema agree."""

    def __init__(
        self, app: ASGIApp, *, paths: Callable[[], Mapping[str, Mapping[str, Any]]]
    ) -> None:
        self.app = app
        self._paths = paths
        self._table: list[tuple[re.Pattern[str], frozenset[str]]] | None = None

    def allowed(self, path: str) -> list[str]:
        """The methods of every schema path that matches `path` (none: unknown path)."""
        if self._table is None:
            self._table = [
                (_path_regex(template), frozenset(m.upper() for m in item if m in _HTTP_METHODS))
                for template, item in self._paths().items()
            ]
        methods: set[str] = set()
        for regex, declared in self._table:
            if regex.fullmatch(path):
                methods |= declared
        return sorted(methods | {"OPTIONS"}) if methods else []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if scope["method"] == "OPTIONS" and (allowed := self.allowed(path)):
            headers = {"Allow": ", ".join(allowed)}
            await Response(status_code=204, headers=headers)(scope, receive, send)
            return

        async def complete_allow(message: Message) -> None:
            start = message["type"] == "http.response.start"
            if start and message["status"] == 405 and (allowed := self.allowed(path)):
                MutableHeaders(scope=message)["Allow"] = ", ".join(allowed)
            await send(message)

        await self.app(scope, receive, complete_allow)


class RequestTimer:
    """Observes each HTTP request's latency, labelled by route template and status."""

    def __init__(self, app: ASGIApp, *, metrics: RequestMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route: Any = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.latency.labels(scope["method"], template, str(status)).observe(
                time.perf_counter() - start
            )
