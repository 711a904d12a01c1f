"""API keys: issuing, hashing, verifying, revoking, and the admin key's bootstrap.

A key reads `mk_<prefix>_<secret>`, or `tml-<prefix>_<secret>` for the `tinker` SDK
(which insists on keys that begin with `tml-`; both kinds resolve alike, on every
route). The prefix (public, unique) finds the row; the
secret is checked against `HMAC-SHA256(salt, secret)` with a random per-key salt, in
constant time. Secrets are 256 random bits, so a fast keyed hash is enough (no password
stretching is needed); the database never holds anything that would let one log in.

Admin keys are rows with no tenant. A key given in the settings (`MARLAAS_ADMIN_KEY`)
is compared directly and never stored.

`PrincipalCache` remembers recently authenticated keys for a few seconds, so a request
with a known key needs no database query (nor a worker thread). A revocation through
this server clears it at once; one made by another process sharing the database takes
effect within the cache's time-to-live.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from marlaas.service.errors import Unauthorized
from marlaas.service.models import ApiKey, Tenant, new_id, utcnow

_SCHEME = "mk"
#: The `tinker` SDK's key prefix (`tml-`): the same keys, spelled its way.
TINKER_SCHEME = "tml"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the admin, or one tenant (by id and name)."""

    tenant_id: str | None
    tenant_name: str | None

    @property
    def is_admin(self) -> bool:
        return self.tenant_id is None


ADMIN = Principal(tenant_id=None, tenant_name=None)


@dataclass(frozen=True)
class IssuedKey:
    """A freshly issued key: `secret_key` is shown to its owner once and never again."""

    row: ApiKey
    secret_key: str


def _digest(salt: str, secret: str) -> str:
    return hmac.new(bytes.fromhex(salt), secret.encode(), hashlib.sha256).hexdigest()


def issue_key(
    session: Session, tenant: Tenant | None, label: str = "", scheme: str = _SCHEME
) -> IssuedKey:
    """Create a key for `tenant` (None: an admin key) and return it with its secret;
    `scheme` `TINKER_SCHEME` spells it `tml-...` for the `tinker` SDK."""
    prefix = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_hex(16)
    row = ApiKey(
        id=new_id("key"),
        tenant_id=tenant.id if tenant else None,
        prefix=prefix,
        salt=salt,
        hash=_digest(salt, secret),
        label=label,
        created_at=utcnow(),
    )
    session.add(row)
    session.flush()
    head = f"{TINKER_SCHEME}-" if scheme == TINKER_SCHEME else f"{_SCHEME}_"
    return IssuedKey(row=row, secret_key=f"{head}{prefix}_{secret}")


class PrincipalCache:
    """Keys authenticated in the last `ttl_s` seconds, by the SHA-256 of the key (the
    key itself is not kept), least recently used evicted beyond `capacity`. Only
    successes are cached. Thread-safe.

    A lookup that misses takes the cache's `generation` before it reads the database
    and passes it to `put`; a `clear` in between (a revocation) makes that `put` a
    no-op, so a key revoked while it was being checked is never cached as valid.
    """

    def __init__(self, ttl_s: float, capacity: int = 4096) -> None:
        if ttl_s < 0 or capacity < 1:
            raise ValueError("ttl_s must be >= 0 and capacity >= 1")
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._entries: OrderedDict[bytes, tuple[float, Principal]] = OrderedDict()
        self._generation = 0
        self._lock = threading.Lock()

    @property
    def generation(self) -> int:
        return self._generation

    def get(self, token: str) -> Principal | None:
        if self.ttl_s == 0:
            return None
        key = _token_digest(token)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry[0] <= time.monotonic():
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, token: str, principal: Principal, generation: int) -> None:
        if self.ttl_s == 0:
            return
        key = _token_digest(token)
        with self._lock:
            if generation != self._generation:
                return
            self._entries[key] = (time.monotonic() + self.ttl_s, principal)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._generation += 1


def _token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def authenticate(session: Session, token: str, configured_admin_key: str | None) -> Principal:
    """The principal that `token` belongs to; `Unauthorized` for anything else."""
    if configured_admin_key and hmac.compare_digest(token.encode(), configured_admin_key.encode()):
        return ADMIN
    if token.startswith(f"{TINKER_SCHEME}-"):
        scheme, rest = _SCHEME, token[len(TINKER_SCHEME) + 1 :]
    else:
        scheme, _, rest = token.partition("_")
    prefix, _, secret = rest.partition("_")
    if scheme != _SCHEME or not prefix or not secret:
        raise Unauthorized("invalid API key; send `Authorization: Bearer mk_...`")
    row = session.scalars(select(ApiKey).where(ApiKey.prefix == prefix)).one_or_none()
    if row is None or not hmac.compare_digest(row.hash, _digest(row.salt, secret)):
        raise Unauthorized("invalid API key; send `Authorization: Bearer mk_...`")
    if row.revoked_at is not None:
        raise Unauthorized("this API key was revoked; ask the admin for a new one")
    if row.tenant_id is None:
        return ADMIN
    tenant = session.get(Tenant, row.tenant_id)
    assert tenant is not None  # the foreign key guarantees it
    return Principal(tenant_id=tenant.id, tenant_name=tenant.name)


def bootstrap_admin_key(session: Session, configured_admin_key: str | None) -> str | None:
    """Make sure some admin key exists. Returns a newly generated one (to print once)
    when none is configured and none is stored; otherwise None."""
    if configured_admin_key:
        return None
    stored = session.scalars(
        select(ApiKey.id).where(ApiKey.tenant_id.is_(None), ApiKey.revoked_at.is_(None))
    ).first()
    if stored is not None:
        return None
    return issue_key(session, None, label="admin (generated at first start)").secret_key
