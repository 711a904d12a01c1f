"""Admin routes under /v1/admin: tenants, their quotas, their API keys. Only the admin
key reaches them (401 without a valid key, 403 with a tenant's)."""

from __future__ import annotations

from fastapi import APIRouter, status
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from marlaas.service import auth
from marlaas.service.api.deps import AUTH_ERRORS, BODY_ERRORS, AdminCaller, Context, responses
from marlaas.service.errors import Conflict, NotFound
from marlaas.service.models import ApiKey, Tenant, new_id, utcnow
from marlaas.service.schemas import (
    IssuedKeyOut,
    KeyCreate,
    KeyOut,
    QuotaPatch,
    TenantCreate,
    TenantOut,
    key_out,
    tenant_out,
)

router = APIRouter(prefix="/v1/admin", tags=["admin"], responses=AUTH_ERRORS)
_NO_TENANT = responses({404: "No tenant of that name."})


def _tenant(session: Session, name: str) -> Tenant:
    tenant = session.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()
    if tenant is None:
        raise NotFound(f"no tenant named {name!r}; list them with GET /v1/admin/tenants")
    return tenant


def _apply(tenant: Tenant, patch: QuotaPatch) -> None:
    for field, value in patch.model_dump(exclude_none=True).items():
        setattr(tenant, field, value)


@router.post(
    "/tenants",
    status_code=status.HTTP_201_CREATED,
    response_model=TenantOut,
    responses={**BODY_ERRORS, **responses({409: "A tenant of that name exists."})},
)
def create_tenant(body: TenantCreate, ctx: Context, _: AdminCaller) -> TenantOut:
    """Create a tenant with the given quotas (the service's defaults for those left out)."""
    defaults = ctx.settings.default_quotas
    with ctx.db.transaction() as session:
        if session.scalar(select(Tenant.id).where(Tenant.name == body.name)) is not None:
            raise Conflict(f"a tenant named {body.name!r} exists; pick another name")
        tenant = Tenant(
            id=new_id("ten"), name=body.name, created_at=utcnow(), **defaults.model_dump()
        )
        _apply(tenant, body.quotas)
        session.add(tenant)
        try:
            session.flush()
        except IntegrityError:
            raise Conflict(f"a tenant named {body.name!r} exists; pick another name") from None
        return tenant_out(tenant)


@router.get("/tenants", response_model=list[TenantOut])
def list_tenants(ctx: Context, _: AdminCaller) -> list[TenantOut]:
    with ctx.db.transaction() as session:
        return [tenant_out(t) for t in session.scalars(select(Tenant).order_by(Tenant.name))]


@router.get("/tenants/{name}", response_model=TenantOut, responses=_NO_TENANT)
def get_tenant(name: str, ctx: Context, _: AdminCaller) -> TenantOut:
    with ctx.db.transaction() as session:
        return tenant_out(_tenant(session, name))


@router.patch(
    "/tenants/{name}/quotas", response_model=TenantOut, responses={**BODY_ERRORS, **_NO_TENANT}
)
def set_quotas(name: str, body: QuotaPatch, ctx: Context, _: AdminCaller) -> TenantOut:
    """Change some of a tenant's quotas. Lowering one never stops running jobs; it
    only refuses new work beyond the new limit."""
    with ctx.db.transaction() as session:
        tenant = _tenant(session, name)
        _apply(tenant, body)
        return tenant_out(tenant)


@router.post(
    "/tenants/{name}/keys",
    status_code=status.HTTP_201_CREATED,
    response_model=IssuedKeyOut,
    responses={**BODY_ERRORS, **_NO_TENANT},
)
def issue_key(
    name: str, ctx: Context, _: AdminCaller, body: KeyCreate | None = None
) -> IssuedKeyOut:
    """Issue an API key for the tenant. The key is in this answer only; it is stored
    hashed and cannot be shown again."""
    with ctx.db.transaction() as session:
        tenant = _tenant(session, name)
        issued = auth.issue_key(
            session, tenant, body.label if body else "", body.format if body else "mk"
        )
        out = key_out(issued.row, tenant.name)
        return IssuedKeyOut(**out.model_dump(), key=issued.secret_key)


@router.get("/tenants/{name}/keys", response_model=list[KeyOut], responses=_NO_TENANT)
def list_keys(name: str, ctx: Context, _: AdminCaller) -> list[KeyOut]:
    """The tenant's keys (prefix and label only), revoked ones included."""
    with ctx.db.transaction() as session:
        tenant = _tenant(session, name)
        rows = session.scalars(
            select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.created_at)
        )
        return [key_out(k, tenant.name) for k in rows]


@router.post(
    "/keys/{key_id}/revoke", response_model=KeyOut, responses=responses({404: "No such key."})
)
def revoke_key(key_id: str, ctx: Context, _: AdminCaller) -> KeyOut:
    """Revoke a key (tenant or admin): it stops working at once. Idempotent."""
    with ctx.db.transaction() as session:
        key = session.get(ApiKey, key_id)
        if key is None:
            raise NotFound(f"no API key with id {key_id!r}")
        if key.revoked_at is None:
            key.revoked_at = utcnow()
        tenant = session.get(Tenant, key.tenant_id) if key.tenant_id else None
        out = key_out(key, tenant.name if tenant else None)
    ctx.principals.clear()  # after the commit: no request re-caches the key
    return out
