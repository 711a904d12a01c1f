"""Errors of the OpenAI fine-tuning routes, answered in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: `ApiError` carries the status, the
`param` at fault and OpenAI's `code`; other service errors keep their status; a body
that fails validation is a 400 naming the first bad field."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from marlaas.service.api.deps import AUTH_ERRORS, responses
from marlaas.service.errors import ServiceError
from marlaas.service.openai_schemas import error_body


class ApiError(ServiceError):
    """An answer in OpenAI's error shape; the message says what to fix."""

    def __init__(
        self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(message, status=400, param=param, code=code)


def not_found(what: str, object_id: str, hint: str) -> ApiError:
    """The one 404 for an id that is missing or another tenant's alike."""
    return ApiError(f"No such {what}: {object_id!r}. {hint}", status=404, param="id")


def answer(status: int, message: str, param: str | None, code: str | None) -> JSONResponse:
    body = error_body(status, message, param, code)
    body["error"]["code"] = code  # error_body's default codes are inference's
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if status == 401:
        body["error"]["code"] = code or "invalid_api_key"
    return JSONResponse(body, status_code=status, headers=headers)


def _validation(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    kind = first.get("type")
    if kind == "extra_forbidden":
        what = "unknown field: marlaas does not know it and never ignores a setting; remove it"
    elif kind == "missing":
        what = "required field is missing; add it"
    else:
        what = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return answer(400, f"{param or 'body'}: {what}", param, None)


class FineTuningRoute(APIRoute):
    """Routes whose errors answer in OpenAI's error shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return _validation(e)
            except ServiceError as e:
                return answer(
                    e.status_code, str(e), getattr(e, "param", None), getattr(e, "code", None)
                )

        return route


#: What every fine-tuning route may answer, in OpenAI's error shape (the key's checks,
#: a request this server refuses and why, a tenant quota).
ERRORS = AUTH_ERRORS | responses(
    {
        400: "The request is invalid; the error names the parameter and what to fix.",
        409: "The object is in a state that does not allow this (in use, finished).",
        413: "The body is larger than this service's limit.",
        422: "The job cannot run on this server as asked (the message says what to change).",
        429: "A quota would be exceeded; the message names it and its limit.",
    }
)
#: Routes that name one object: another tenant's is missing alike.
NOT_FOUND = responses({404: "No such object, or another tenant's."})
