"""ASGI middleware: request body size limits and request latency metrics.

Both are plain ASGI (not Starlette's BaseHTTPMiddleware), so a streamed upload is
counted chunk by chunk as it arrives and never buffered here.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
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
