"""Inference as a bounded resource (see `service.inference`): the errors of a request
the server refuses, the size of one request against the engine and the tenant's quota,
requests in flight per tenant, and cancellation when the client hangs up."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from marlaas.service.db import Database
from marlaas.service.errors import QuotaExceeded, ServiceError
from marlaas.service.models import Tenant

T = TypeVar("T")


class BadInferenceRequest(ServiceError, ValueError):
    """A request the model cannot serve as asked; `param` names the field at fault."""

    status_code = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ClientGone(ServiceError, ConnectionError):
    """The client disconnected before its answer was ready; its requests were aborted.
    (Nobody reads the answer: 499, nginx's "client closed request", for the logs.)"""

    status_code = 499


@dataclass(frozen=True)
class InferenceQuotas:
    """A tenant's inference quotas (`settings.QuotaSpec`)."""

    tenant: str
    max_requests: int
    max_tokens: int


def inference_quotas(db: Database, tenant_id: str) -> InferenceQuotas:
    """The tenant's inference quotas, read from the database (blocking)."""
    with db.transaction() as session:
        tenant = session.get(Tenant, tenant_id)
        assert tenant is not None  # authenticated tenants exist
        return InferenceQuotas(
            tenant.name, tenant.max_inference_requests, tenant.max_inference_tokens
        )


def check_request_size(
    prompts: int, n: int, max_tokens: int, quotas: InferenceQuotas, max_rows: int
) -> None:
    """`BadInferenceRequest` (400, naming the parameter) for a request larger than the
    engine's rows or the tenant's tokens per request."""
    rows = prompts * n
    if rows > max_rows:
        raise BadInferenceRequest(
            f"this request asks for {prompts} prompt(s) x n {n} = {rows} completions at "
            f"once, and this server's engine runs at most {max_rows}; send fewer prompts "
            "per request (or a smaller n)",
            "n" if n > 1 else "prompt",
        )
    tokens = rows * max_tokens
    if tokens > quotas.max_tokens:
        raise BadInferenceRequest(
            f"this request asks for up to {tokens} tokens ({prompts} prompt(s) x n {n} x "
            f"max_tokens {max_tokens}), and tenant {quotas.tenant!r} may ask at most "
            f"{quotas.max_tokens} per request (quota max_inference_tokens); lower "
            "max_tokens or split the request, or ask the admin to raise the quota",
            "max_tokens",
        )


class RequestSlots:
    """Inference requests in flight, per tenant, bounded by each tenant's quota. Used
    on the event loop only."""

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}

    def in_flight(self, tenant_id: str) -> int:
        return self._in_flight.get(tenant_id, 0)

    def take(self, tenant_id: str, quotas: InferenceQuotas) -> Callable[[], None]:
        """Count one request of the tenant; returns the idempotent release. Raises
        `QuotaExceeded` (429) when the tenant has its quota's worth in flight."""
        used = self.in_flight(tenant_id)
        if used >= quotas.max_requests:
            raise QuotaExceeded(
                f"quota max_inference_requests exceeded: tenant {quotas.tenant!r} has "
                f"{used} inference requests in flight and the limit is "
                f"{quotas.max_requests}; retry when one has finished, or ask the admin "
                "to raise it"
            )
        self._in_flight[tenant_id] = used + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                left = self._in_flight[tenant_id] - 1
                if left:
                    self._in_flight[tenant_id] = left
                else:
                    del self._in_flight[tenant_id]

        return release


async def _disconnected(receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
    """Return once the client has disconnected. Called after the request's body was
    read, so the server's next message is the disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(
    receive: Callable[[], Awaitable[Mapping[str, Any]]], work: Awaitable[T]
) -> T:
    """`await work`, unless the client disconnects first: then `work` is cancelled
    (which aborts its engine requests) and `ClientGone` is raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone("the client disconnected; its requests were aborted")
    finally:
        watch.cancel()
        task.cancel()  # a no-op once it is done
