"""Dependencies every route shares: the service context, the authenticated caller, and
the error answers every authenticated route documents.

Authentication happens before any lookup, so an unauthenticated caller learns nothing
about which ids exist; a tenant then only ever queries its own rows (see `jobs`).

The `Authorization` header must read exactly `Bearer <key>`: one space, a key of token
characters only (RFC 6750). Anything else -- padding inside the header, a second word,
another scheme -- is refused (401) rather than repaired, so that a key is accepted in one
spelling only. (HTTP itself trims whitespace around a header's value.)
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from marlaas.service.auth import Principal, authenticate
from marlaas.service.context import ServiceContext
from marlaas.service.errors import Forbidden, Unauthorized

# Declares the security scheme in the OpenAPI schema; the header itself is parsed here.
_bearer = HTTPBearer(auto_error=False, description="A tenant API key or the admin key.")
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


def responses(answers: Mapping[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these status codes, each with its description."""
    return {status: {"description": text} for status, text in answers.items()}


#: What every authenticated route may answer before it looks at anything.
AUTH_ERRORS = responses(
    {
        401: "Missing, malformed, unknown or revoked API key.",
        403: "The key is of the wrong kind (the admin key on a tenant route, or a "
        "tenant's key on an admin route).",
    }
)


#: What a route with a request body may answer before it reads it.
BODY_ERRORS = responses(
    {
        400: "The body is not valid JSON.",
        413: "The body is larger than this service's limit.",
    }
)


# The light dependencies are `async`: FastAPI runs a plain `def` dependency in a worker
# thread, and each such hop costs more than the work itself under load.


async def get_context(request: Request) -> ServiceContext:
    ctx: ServiceContext = request.app.state.context
    return ctx


Context = Annotated[ServiceContext, Depends(get_context)]


def bearer_token(request: Request) -> str:
    """The key of the request's `Authorization: Bearer <key>`; `Unauthorized` else."""
    header = request.headers.get("authorization")
    if header is None:
        raise Unauthorized("missing API key; send `Authorization: Bearer <your key>`")
    scheme, space, token = header.partition(" ")
    if scheme.lower() != "bearer" or not space or not _TOKEN.fullmatch(token):
        raise Unauthorized(
            "malformed Authorization header; send exactly `Authorization: Bearer <your key>` "
            "(one space, the key without padding or quotes)"
        )
    return token


async def get_principal(
    ctx: Context,
    request: Request,
    _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    token = bearer_token(request)
    cached = ctx.principals.get(token)
    if cached is not None:
        return cached
    generation = ctx.principals.generation

    def lookup() -> Principal:
        with ctx.db.transaction() as session:
            return authenticate(session, token, ctx.settings.admin_key)

    principal = await run_in_threadpool(lookup)
    ctx.principals.put(token, principal, generation)
    return principal


async def get_tenant(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if principal.is_admin:
        raise Forbidden(
            "the admin key manages tenants and keys only; use a tenant's API key for jobs"
        )
    return principal


async def get_admin(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if not principal.is_admin:
        raise Forbidden("this endpoint needs the admin key")
    return principal


async def get_metrics_reader(
    ctx: Context,
    request: Request,
    _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """The admin, or whoever holds the service's metrics token (a scraper); tenants are
    refused (the figures name every tenant and job)."""
    token = bearer_token(request)
    configured = ctx.settings.metrics_token
    if configured and hmac.compare_digest(token.encode(), configured.encode()):
        return
    principal = await get_principal(ctx, request, None)
    await get_admin(principal)


TenantCaller = Annotated[Principal, Depends(get_tenant)]
AdminCaller = Annotated[Principal, Depends(get_admin)]
MetricsReader = Depends(get_metrics_reader)


def tenant_id(caller: Principal) -> str:
    assert caller.tenant_id is not None  # get_tenant guarantees it
    return caller.tenant_id
