"""The Tinker-compatible routes under `/api/v1`, for the unmodified `tinker` SDK.

Authentication: the SDK sends its key as `X-API-Key` (it insists on keys that begin
with `tml-`; the admin issues those with `POST /v1/admin/tenants/{name}/keys`,
`{"format": "tml"}`). Any tenant key works here, and `Authorization: Bearer` too; the
admin key does not (it owns no models). A key resolves to its tenant exactly as on
the other routes (`service.auth`).

Every call that the SDK treats as asynchronous answers `{"request_id": ...}` at once;
`retrieve_future` long-polls for the result (protobuf for samples and
forward/backward outputs when the SDK's `Accept` asks for it, JSON otherwise).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from marlaas.service.auth import Principal, authenticate
from marlaas.service.context import ServiceContext
from marlaas.service.errors import Forbidden, Unauthorized
from marlaas.service.tinker import convert, sampling, training, wire
from marlaas.service.tinker.errors import ERRORS, UserError
from marlaas.service.tinker.futures import Failure, Pending
from marlaas.service.tinker.hub import TinkerHub

PROTOBUF = "application/x-protobuf"

router = APIRouter(prefix="/api/v1", tags=["tinker"], responses=ERRORS)


async def get_hub(request: Request) -> TinkerHub:
    hub: TinkerHub = request.app.state.tinker
    return hub


async def get_caller(
    request: Request,
    x_api_key: Annotated[str | None, Header()] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> str:
    """The calling tenant's id, from `X-API-Key` (or a bearer token)."""
    token = x_api_key
    if token is None and authorization is not None:
        scheme, _, value = authorization.partition(" ")
        token = value if scheme.lower() == "bearer" else None
    if not token:
        raise Unauthorized("missing API key; send it as X-API-Key (TINKER_API_KEY)")
    ctx: ServiceContext = request.app.state.context
    principal = ctx.principals.get(token)
    if principal is None:
        generation = ctx.principals.generation

        def lookup() -> Principal:
            with ctx.db.transaction() as session:
                return authenticate(session, token, ctx.settings.admin_key)

        principal = await run_in_threadpool(lookup)
        ctx.principals.put(token, principal, generation)
    if principal.tenant_id is None:
        raise Forbidden("the admin key owns no models; use a tenant's key (tml-...)")
    return principal.tenant_id


Hub = Annotated[TinkerHub, Depends(get_hub)]
Caller = Annotated[str, Depends(get_caller)]


# -- client configuration and sessions ------------------------------------------------


@router.post("/client/config", response_model=wire.ClientConfigResponse)
async def client_config(request: Request, _: Caller) -> wire.ClientConfigResponse:
    ctx: ServiceContext = request.app.state.context
    # Chunks stay well under the body limit (the SDK's estimate is the protobuf size).
    return wire.ClientConfigResponse(
        fwdbwd_max_chunk_bytes_count=ctx.settings.max_body_bytes * 3 // 4
    )


@router.post("/client/dynamic_config")
async def client_dynamic_config(_: Caller) -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": True}


@router.post("/create_session", response_model=wire.CreateSessionResponse)
async def create_session(
    body: wire.CreateSessionRequest, hub: Hub, caller: Caller
) -> wire.CreateSessionResponse:
    session = hub.sessions.create(caller, body.user_metadata)
    return wire.CreateSessionResponse(session_id=session.id)


@router.post("/session_heartbeat")
async def session_heartbeat(
    body: wire.SessionHeartbeatRequest, hub: Hub, caller: Caller
) -> dict[str, str]:
    hub.sessions.heartbeat(caller, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str, hub: Hub, caller: Caller, body: wire.SessionFinishRequest | None = None
) -> dict[str, str]:
    reason = str((body.reason or {}).get("type", "finished")) if body else "finished"
    session = hub.sessions.finish(caller, session_id, reason)
    if session is not None:
        await hub.end_session(session)
    return {"status": "finished"}


@router.post("/telemetry")
async def telemetry(_: Caller) -> dict[str, str]:
    """Accepted and dropped: this server keeps no client telemetry."""
    return {"status": "accepted"}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities", response_model=wire.ServerCapabilities)
async def get_server_capabilities(hub: Hub, _: Caller) -> wire.ServerCapabilities:
    base = (await hub.device()).base_model
    limits = await hub.limits()
    return wire.ServerCapabilities(
        supported_models=[
            wire.SupportedModel(model_name=base, max_context_length=limits.max_positions)
        ]
    )


# -- training -------------------------------------------------------------------------


@router.post("/create_model", response_model=wire.UntypedFuture)
async def create_model(
    body: wire.CreateModelRequest, hub: Hub, caller: Caller
) -> wire.UntypedFuture:
    return await training.create_model(hub, caller, body)


@router.post("/get_info", response_model=wire.GetInfoResponse)
async def get_info(body: wire.GetInfoRequest, hub: Hub, caller: Caller) -> wire.GetInfoResponse:
    return await training.get_info(hub, caller, body.model_id)


@router.post("/forward_backward", response_model=wire.UntypedFuture)
async def forward_backward(
    request: Request,
    hub: Hub,
    caller: Caller,
    content_encoding: Annotated[str | None, Header()] = None,
) -> wire.UntypedFuture:
    """A `ForwardBackwardRequest` as protobuf (what the SDK sends), or as JSON."""
    raw = await request.body()
    if request.headers.get("content-type", "").startswith(PROTOBUF):
        from marlaas.service.tinker.protobuf import decode_forward_backward

        body = await asyncio.to_thread(decode_forward_backward, raw, content_encoding)
    else:
        try:
            body = convert.from_json(wire.ForwardBackwardJson.model_validate_json(raw))
        except ValidationError as e:
            raise UserError(f"the forward_backward body is not valid: {e}") from e
    return await training.forward_backward(hub, caller, body)


@router.post("/optim_step", response_model=wire.UntypedFuture)
async def optim_step(body: wire.OptimStepRequest, hub: Hub, caller: Caller) -> wire.UntypedFuture:
    return await training.optim_step(hub, caller, body)


@router.post("/save_weights", response_model=wire.UntypedFuture)
async def save_weights(
    body: wire.SaveWeightsRequest, hub: Hub, caller: Caller
) -> wire.UntypedFuture:
    return await training.save_weights(hub, caller, body)


@router.post("/save_weights_for_sampler", response_model=wire.UntypedFuture)
async def save_weights_for_sampler(
    body: wire.SaveWeightsForSamplerRequest, hub: Hub, caller: Caller
) -> wire.UntypedFuture:
    return await training.save_weights_for_sampler(hub, caller, body)


@router.post("/load_weights", response_model=wire.UntypedFuture)
async def load_weights(
    body: wire.LoadWeightsRequest, hub: Hub, caller: Caller
) -> wire.UntypedFuture:
    return await training.load_weights(hub, caller, body)


# -- sampling -------------------------------------------------------------------------


@router.post("/create_sampling_session", response_model=wire.CreateSamplingSessionResponse)
async def create_sampling_session(
    body: wire.CreateSamplingSessionRequest, hub: Hub, caller: Caller
) -> wire.CreateSamplingSessionResponse:
    return await sampling.create_sampling_session(hub, caller, body)


@router.get("/samplers/{sampler_id}", response_model=wire.GetSamplerResponse)
async def get_sampler(sampler_id: str, hub: Hub, caller: Caller) -> wire.GetSamplerResponse:
    return sampling.get_sampler(hub, caller, sampler_id)


@router.post("/asample", response_model=wire.UntypedFuture, response_model_exclude_none=True)
async def asample(body: wire.SampleRequest, hub: Hub, caller: Caller) -> wire.UntypedFuture:
    return await sampling.asample(hub, caller, body)


# -- futures --------------------------------------------------------------------------


@router.post("/retrieve_future")
async def retrieve_future(
    body: wire.FutureRetrieveRequest,
    hub: Hub,
    caller: Caller,
    accept: Annotated[str | None, Header()] = None,
) -> Response:
    """The result (200), its failure (200, `{"error", "category"}`), or `try_again`
    (200) after a long poll while it runs."""
    outcome = await hub.futures.retrieve(body.request_id, caller)
    if isinstance(outcome, Pending | Failure):
        return JSONResponse(outcome.json())
    if accept is not None and PROTOBUF in accept:
        encoded = outcome.protobuf()
        if encoded is not None:
            return Response(encoded, media_type=PROTOBUF)
    return JSONResponse(outcome.json())


@router.post("/cancel_future")
async def cancel_future(body: wire.CancelFutureRequest, hub: Hub, caller: Caller) -> dict[str, str]:
    """Stop a sample still running (other calls run to the end)."""
    await hub.futures.retrieve(body.request_id, caller, timeout=0)  # 404 unless the caller's
    task = hub.sample_tasks.get(body.request_id)
    if task is not None:
        task.cancel()
    return {"status": "cancelled" if task is not None else "done"}
