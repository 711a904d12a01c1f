"""Dependencies every route shares: the service context and the authenticated caller.

Authentication happens before any lookup, so an unauthenticated caller learns nothing
about which ids exist; a tenant then only ever queries its own rows (see `jobs`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from marlaas.service.auth import Principal, authenticate
from marlaas.service.context import ServiceContext
from marlaas.service.errors import Forbidden, Unauthorized

_bearer = HTTPBearer(auto_error=False, description="A tenant API key or the admin key.")


# The light dependencies are `async`: FastAPI runs a plain `def` dependency in a worker
# thread, and each such hop costs more than the work itself under load.


async def get_context(request: Request) -> ServiceContext:
    ctx: ServiceContext = request.app.state.context
    return ctx


Context = Annotated[ServiceContext, Depends(get_context)]


async def get_principal(
    ctx: Context,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise Unauthorized("missing API key; send `Authorization: Bearer <your key>`")
    token = credentials.credentials
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


TenantCaller = Annotated[Principal, Depends(get_tenant)]
AdminCaller = Annotated[Principal, Depends(get_admin)]


def tenant_id(caller: Principal) -> str:
    assert caller.tenant_id is not None  # get_tenant guarantees it
    return caller.tenant_id
