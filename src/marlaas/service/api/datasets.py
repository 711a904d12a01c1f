"""Tenant dataset routes under /v1: upload (raw JSONL body, streamed), list, get one,
delete.

An upload is `PUT /v1/datasets/{name}` with the JSONL file as the request body
(`Content-Type: application/x-ndjson` or any other), so no multipart parsing is
needed and the body streams to disk while it is checked.
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import Annotated

from fastapi import APIRouter, Path, Request, Response, status
from sqlalchemy import select

from marlaas.config.job import NAME_PATTERN, NAME_RULE, check_name
from marlaas.service import datasets as store
from marlaas.service.api.deps import AUTH_ERRORS, Context, TenantCaller, responses, tenant_id
from marlaas.service.errors import InvalidField, PayloadTooLarge
from marlaas.service.models import Dataset, new_id
from marlaas.service.schemas import DatasetList, DatasetOut, dataset_out

router = APIRouter(prefix="/v1/datasets", tags=["datasets"], responses=AUTH_ERRORS)
#: The `{name}` path parameter, with its rule in the schema.
DatasetName = Annotated[
    str,
    Path(description="The dataset's name. " + NAME_RULE, pattern=NAME_PATTERN, max_length=64),
]


#: Datasets named so are the files of the OpenAI-compatible Files API (`/v1/files`).
FILE_PREFIX = "file-"


def _check_name(name: str) -> None:
    try:
        check_name(name)
    except ValueError:
        raise InvalidField(
            ("path", "name"), f"invalid dataset name {name!r}: {NAME_RULE}"
        ) from None
    if name.startswith(FILE_PREFIX):
        raise InvalidField(
            ("path", "name"),
            f"dataset names starting with {FILE_PREFIX!r} belong to the Files API; manage "
            "that file with /v1/files or pick another name",
        )


@router.put(
    "/{name}",
    response_model=DatasetOut,
    status_code=status.HTTP_201_CREATED,
    responses={
        409: {"description": "An active job uses the dataset it would replace."},
        413: {"description": "Larger than the upload limit."},
        422: {"description": "Not JSONL: the message names the line."},
        429: {"description": "The tenant's max_dataset_bytes quota would be exceeded."},
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            # Any media type is taken; these two are the usual ones.
            "content": {
                "application/x-ndjson": {"schema": {"type": "string"}},
                "text/plain": {"schema": {"type": "string"}},
            },
        }
    },
)
async def upload_dataset(
    name: DatasetName, request: Request, ctx: Context, caller: TenantCaller
) -> DatasetOut:
    """Upload (or replace) the JSONL dataset `name`: one JSON object per line. A job
    uses it with `task: {type: dataset, path: <name>, ...}`."""
    _check_name(name)
    tenant = tenant_id(caller)
    declared = request.headers.get("content-length")
    if declared and declared.isdigit():
        if int(declared) > ctx.settings.max_upload_bytes:
            raise PayloadTooLarge(
                f"the upload is {declared} bytes, above this service's limit of "
                f"{ctx.settings.max_upload_bytes} bytes; split the dataset"
            )

        def precheck() -> None:  # fail before receiving anything when the quota is known short
            with ctx.db.transaction() as session:
                store.check_quota(session, tenant, name, int(declared))

        await asyncio.to_thread(precheck)
    tmp = store.tenant_dir(ctx.settings.artifact_dir, tenant) / f".upload-{new_id('tmp')}"
    upload = await store.receive(request.stream(), tmp, ctx.settings.max_upload_bytes)

    def save() -> tuple[Dataset, pathlib.Path | None]:
        with ctx.db.transaction() as session:
            return store.store(session, tenant, name, upload, ctx.settings.artifact_dir)

    try:
        row, replaced = await asyncio.to_thread(save)
    finally:
        upload.tmp_path.unlink(missing_ok=True)
    if replaced is not None:
        replaced.unlink(missing_ok=True)
    return dataset_out(row)


@router.get("", response_model=DatasetList)
def list_datasets(ctx: Context, caller: TenantCaller) -> DatasetList:
    """The caller's datasets, by name."""
    with ctx.db.transaction() as session:
        rows = session.scalars(
            select(Dataset).where(Dataset.tenant_id == tenant_id(caller)).order_by(Dataset.name)
        )
        return DatasetList(datasets=[dataset_out(d) for d in rows])


@router.get("/{name}", response_model=DatasetOut, responses=responses({404: "No such dataset."}))
def get_dataset(name: DatasetName, ctx: Context, caller: TenantCaller) -> DatasetOut:
    """One of the caller's datasets: its size, rows and SHA-256."""
    with ctx.db.transaction() as session:
        return dataset_out(store.get(session, tenant_id(caller), name))


@router.delete(
    "/{name}",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    responses=responses({404: "No such dataset.", 409: "An active job uses it."}),
)
def delete_dataset(name: DatasetName, ctx: Context, caller: TenantCaller) -> Response:
    """Delete a dataset no active job uses; its bytes stop counting against the quota."""
    _check_name(name)
    with ctx.db.transaction() as session:
        path = store.delete(session, tenant_id(caller), name, ctx.settings.artifact_dir)
    path.unlink(missing_ok=True)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
