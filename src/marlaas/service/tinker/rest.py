"""The REST side of the Tinker-compatible API (`tinker.RestClient`, and the cookbook's
checkpoint handling when it resumes): training runs, their checkpoints, and the PEFT
archive of saved weights (a marlaas addition: `GET .../archive`).

Everything answers from the database (a run need not be on the device), filtered by
the caller's tenant: another tenant's run or path is 404, as if missing.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.responses import StreamingResponse
from starlette.convertors import Convertor, register_url_convertor

from marlaas.service.archive import ArchiveFormat, open_adapter, stream_archive
from marlaas.service.tinker import convert, wire
from marlaas.service.tinker.errors import ERRORS
from marlaas.service.tinker.paths import TinkerPath, parse_checkpoint_id
from marlaas.service.tinker.routes import Caller, Hub
from marlaas.service.tinker.store import CheckpointRecord, RunRecord, TinkerStore


class _CheckpointId(Convertor[str]):
    """A checkpoint id in a URL, `weights/NAME` or `sampler_weights/NAME` (one slash):
    so `.../checkpoints/ID/archive` is never read as the id `ID/archive`, and a method a
    path does not serve answers 405."""

    regex = "(?:weights|sampler_weights)/[^/]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("checkpoint", _CheckpointId())

router = APIRouter(prefix="/api/v1", tags=["tinker"], responses=ERRORS)


def checkpoint_out(c: CheckpointRecord) -> wire.CheckpointOut:
    return wire.CheckpointOut(
        checkpoint_id=c.path.checkpoint_id,
        checkpoint_type=c.path.kind,
        time=c.created_at,
        tinker_path=str(c.path),
        size_bytes=c.size_bytes,
        user_metadata=c.user_metadata,
        expires_at=c.expires_at,
    )


def _run_out(store: TinkerStore, run: RunRecord) -> wire.TrainingRunOut:
    saved = store.checkpoints(run.tenant_id, run.id)
    training = [c for c in saved if c.path.kind == "training"]
    sampler = [c for c in saved if c.path.kind == "sampler"]
    metadata = {str(k): str(v) for k, v in (run.user_metadata or {}).items()} or None
    return wire.TrainingRunOut(
        training_run_id=run.id,
        base_model=run.base_model,
        model_owner=run.tenant_name,
        lora_rank=run.lora.rank,
        last_request_time=run.last_request_at,
        last_checkpoint=checkpoint_out(training[-1]) if training else None,
        last_sampler_checkpoint=checkpoint_out(sampler[-1]) if sampler else None,
        user_metadata=metadata,
    )


@router.get("/training_runs", response_model=wire.TrainingRunsResponse)
async def list_training_runs(
    hub: Hub,
    caller: Caller,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> wire.TrainingRunsResponse:
    def read() -> wire.TrainingRunsResponse:
        runs, total = hub.store.runs(caller, limit, offset)
        return wire.TrainingRunsResponse(
            training_runs=[_run_out(hub.store, r) for r in runs],
            cursor={"offset": offset, "limit": limit, "total_count": total},
        )

    return await asyncio.to_thread(read)


@router.get("/training_runs/{run_id}", response_model=wire.TrainingRunOut)
async def get_training_run(run_id: str, hub: Hub, caller: Caller) -> wire.TrainingRunOut:
    return await asyncio.to_thread(lambda: _run_out(hub.store, hub.store.run(caller, run_id)))


@router.get("/training_runs/{run_id}/checkpoints", response_model=wire.CheckpointsListResponse)
async def list_run_checkpoints(
    run_id: str, hub: Hub, caller: Caller
) -> wire.CheckpointsListResponse:
    def read() -> wire.CheckpointsListResponse:
        hub.store.run(caller, run_id)  # 404 for a foreign or missing run
        return wire.CheckpointsListResponse(
            checkpoints=[checkpoint_out(c) for c in hub.store.checkpoints(caller, run_id)]
        )

    return await asyncio.to_thread(read)


@router.get("/checkpoints", response_model=wire.CheckpointsListResponse)
async def list_user_checkpoints(hub: Hub, caller: Caller) -> wire.CheckpointsListResponse:
    saved = await asyncio.to_thread(hub.store.checkpoints, caller)
    return wire.CheckpointsListResponse(checkpoints=[checkpoint_out(c) for c in saved])


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:checkpoint}", status_code=204)
async def delete_checkpoint(run_id: str, checkpoint_id: str, hub: Hub, caller: Caller) -> Response:
    path = parse_checkpoint_id(run_id, checkpoint_id)
    await asyncio.to_thread(hub.store.delete_checkpoint, caller, path)
    return Response(status_code=204)


@router.post("/weights_info", response_model=wire.WeightsInfoResponse)
async def weights_info(
    body: wire.WeightsInfoRequest, hub: Hub, caller: Caller
) -> wire.WeightsInfoResponse:
    path = TinkerPath.parse(body.tinker_path)
    roles = (await hub.device()).port.model.target_roles  # the one base this server serves

    def read() -> wire.WeightsInfoResponse:
        hub.store.checkpoint(caller, path)
        run = hub.store.run(caller, path.run_id)
        flags = convert.lora_flags(run.lora, roles)
        return wire.WeightsInfoResponse(base_model=run.base_model, lora_rank=run.lora.rank, **flags)

    return await asyncio.to_thread(read)


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:checkpoint}/archive")
async def download_checkpoint(
    run_id: str,
    checkpoint_id: str,
    hub: Hub,
    caller: Caller,
    format: ArchiveFormat = ArchiveFormat.TAR_GZ,
) -> StreamingResponse:
    """The adapter of saved weights (sampler weights, or a saved state's adapter) as a
    PEFT directory archive, loadable with `PeftModel.from_pretrained`."""
    path = parse_checkpoint_id(run_id, checkpoint_id)
    record = await asyncio.to_thread(hub.store.checkpoint, caller, path)
    root = hub.store.artifact_dir
    rel = str(record.directory.relative_to(root))
    files = await asyncio.to_thread(open_adapter, root, rel, record.version)
    folder = f"{run_id.replace(':', '_')}-{path.kind}-{path.name}"
    return StreamingResponse(
        stream_archive(format, folder, files),
        media_type=format.media_type,
        headers={"Content-Disposition": f'attachment; filename="{folder}.{format.value}"'},
    )
