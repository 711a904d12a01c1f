"""The OpenAI-compatible Files API (`purpose: fine-tune` only): upload, list, retrieve,
content, delete, with the tenant's API key.

A succeeded job's results CSV (`results`, purpose `fine-tune-results`) is one of these
files too. An upload (multipart `file`, `purpose`, optional `expires_after[anchor]` and
`expires_after[seconds]`) is streamed to disk, checked line by line
(`file_check.check_chat_file`) and stored as the tenant's dataset named by the file's id,
so it counts toward `max_dataset_bytes` and cannot be deleted while an active job uses it
(409). The answer is the file object at once: `status` is `processed`, or `error` with
`status_details` naming the first bad line (a job refuses such a file). Expired files
are gone for their tenant (404) and their bytes are removed when no active job uses them.
Another tenant's file answers 404 exactly like one that never existed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from sqlalchemy import or_, select
from sqlalchemy.orm import Session
from starlette.datastructures import UploadFile

from marlaas.service import datasets as store
from marlaas.service.api.deps import Context, TenantCaller, tenant_id
from marlaas.service.errors import Conflict
from marlaas.service.models import File, new_id, utcnow
from marlaas.service.openai_ft.errors import (
    ERRORS,
    NOT_FOUND,
    FineTuningRoute,
    bad_request,
    not_found,
)
from marlaas.service.openai_ft.file_check import check_chat_file

log = logging.getLogger(__name__)
router = APIRouter(
    prefix="/v1/files", tags=["openai fine-tuning"], route_class=FineTuningRoute, responses=ERRORS
)

PURPOSE = "fine-tune"
#: A succeeded job's results CSV (`results`): listed and downloaded like an upload.
RESULTS_PURPOSE = "fine-tune-results"
_EXPIRY_S = (3600, 30 * 24 * 3600)
_CHUNK = 1 << 20


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def file_object(row: File) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.size_bytes,
        "created_at": int(row.created_at.timestamp()),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": row.status,
        "status_details": row.status_details,
        "expires_at": int(row.expires_at.timestamp()) if row.expires_at else None,
    }


def _live() -> Any:
    now = datetime.now(UTC)
    return or_(File.expires_at.is_(None), File.expires_at > now)


def find_file(session: Session, tenant: str, file_id: str) -> File | None:
    """The tenant's unexpired file `file_id`, or None."""
    return session.scalars(
        select(File).where(File.id == file_id, File.tenant_id == tenant, _live())
    ).one_or_none()


def _get(session: Session, tenant: str, file_id: str) -> File:
    row = find_file(session, tenant, file_id)
    if row is None:
        raise not_found("file", file_id, "List your files with GET /v1/files.")
    return row


def file_path(session: Session, tenant: str, row: File, artifact_dir: Path) -> Path:
    return artifact_dir / store.get(session, tenant, row.id).path


def _expiry(form: Any) -> timedelta | None:
    """The file's lifetime after its `created_at` (`expires_after`), or None."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise bad_request(
            f"expires_after.anchor must be 'created_at', got {anchor!r}", "expires_after.anchor"
        )
    try:
        value = int(str(seconds))
    except ValueError:
        value = -1
    lo, hi = _EXPIRY_S
    if not lo <= value <= hi:
        raise bad_request(
            f"expires_after.seconds must be an integer from {lo} to {hi}, got {seconds!r}",
            "expires_after.seconds",
        )
    return timedelta(seconds=value)


async def _receive(upload: UploadFile, tmp: Path) -> tuple[int, str]:
    """Copy the upload to `tmp`; its size and sha256."""
    digest, size = hashlib.sha256(), 0
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("wb") as out:
        while chunk := await upload.read(_CHUNK):
            size += len(chunk)
            digest.update(chunk)
            await asyncio.to_thread(out.write, chunk)
    return size, digest.hexdigest()


def purge_expired(artifact_dir: Path, session: Session, tenant: str) -> list[Path]:
    """Delete the tenant's expired files that no active job uses; their paths, to
    remove after the commit."""
    now = datetime.now(UTC)
    gone: list[Path] = []
    expired = session.scalars(
        select(File).where(File.tenant_id == tenant, File.expires_at <= now)
    ).all()
    for row in expired:
        try:
            gone.append(store.delete(session, tenant, row.id, artifact_dir))
        except Conflict:
            continue  # an active job trains on it: removed once the job is done
        session.delete(row)
    return gone


@router.post("")
async def create_file(request: Request, ctx: Context, caller: TenantCaller) -> dict[str, Any]:
    """Upload a fine-tuning file (JSONL in OpenAI's chat format)."""
    tenant = tenant_id(caller)
    declared = request.headers.get("content-length", "")
    if declared.isdigit():  # fail before receiving anything when the quota is known short

        def precheck() -> None:
            with ctx.db.transaction() as session:
                store.check_quota(session, tenant, "", int(declared))

        await asyncio.to_thread(precheck)
    form = await request.form(max_files=1, max_fields=16)
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != PURPOSE:
            raise bad_request(
                f"purpose must be {PURPOSE!r} (marlaas stores fine-tuning files only), got "
                f"{purpose!r}",
                "purpose",
            )
        if not isinstance(upload, UploadFile):
            raise bad_request("send the file as the multipart field 'file'", "file")
        lifetime = _expiry(form)
        file_id = new_file_id()
        tmp = store.tenant_dir(ctx.settings.artifact_dir, tenant) / f".upload-{new_id('tmp')}"
        size, sha = await _receive(upload, tmp)
        try:
            check = await asyncio.to_thread(check_chat_file, tmp)

            def save() -> tuple[dict[str, Any], list[Path]]:
                with ctx.db.transaction() as session:
                    # Expired files give their bytes back before this one is counted.
                    removed = purge_expired(ctx.settings.artifact_dir, session, tenant)
                    received = store.Upload(tmp, size, check.rows, sha)
                    store.store(session, tenant, file_id, received, ctx.settings.artifact_dir)
                    # Anchored at the row's own creation time, not at when the
                    # request came in (a second may pass while the upload arrives).
                    created = utcnow()
                    row = File(
                        id=file_id,
                        tenant_id=tenant,
                        filename=(upload.filename or "upload.jsonl")[:256],
                        purpose=PURPOSE,
                        size_bytes=size,
                        rows=check.rows,
                        status="error" if check.problem else "processed",
                        status_details=check.problem,
                        created_at=created,
                        expires_at=None if lifetime is None else created + lifetime,
                    )
                    session.add(row)
                    session.flush()
                    return file_object(row), removed

            answer, removed = await asyncio.to_thread(save)
            for path in removed:
                path.unlink(missing_ok=True)
            return answer
        finally:
            tmp.unlink(missing_ok=True)
    finally:
        await form.close()


@router.get("")
def list_files(
    ctx: Context,
    caller: TenantCaller,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    """The caller's files, newest first (`order=asc`: oldest first)."""
    tenant = tenant_id(caller)
    with ctx.db.transaction() as session:
        removed = purge_expired(ctx.settings.artifact_dir, session, tenant)
        query = select(File).where(File.tenant_id == tenant, _live())
        if purpose is not None:
            query = query.where(File.purpose == purpose)
        by = (File.created_at, File.id)
        query = query.order_by(*(c.asc() if order == "asc" else c.desc() for c in by))
        rows = [file_object(r) for r in session.scalars(query)]
    for path in removed:
        path.unlink(missing_ok=True)
    return page(rows, after, limit)


def page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page of `items` (already in order): those after the id `after`."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "has_more": len(items) > limit,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


@router.get("/{file_id}", responses=NOT_FOUND)
def retrieve_file(file_id: str, ctx: Context, caller: TenantCaller) -> dict[str, Any]:
    with ctx.db.transaction() as session:
        return file_object(_get(session, tenant_id(caller), file_id))


@router.get("/{file_id}/content", response_model=None, responses=NOT_FOUND)
def file_content(file_id: str, ctx: Context, caller: TenantCaller) -> FileResponse:
    """The file's bytes as uploaded (a job's results file: its CSV)."""
    tenant = tenant_id(caller)
    with ctx.db.transaction() as session:
        row = _get(session, tenant, file_id)
        path, name = file_path(session, tenant, row, ctx.settings.artifact_dir), row.filename
        csv = row.purpose == RESULTS_PURPOSE
    return FileResponse(path, media_type="text/csv" if csv else "application/jsonl", filename=name)


@router.delete("/{file_id}", responses=NOT_FOUND)
def delete_file(file_id: str, ctx: Context, caller: TenantCaller) -> dict[str, Any]:
    """Delete a file no active job uses (409 otherwise); its bytes stop counting."""
    tenant = tenant_id(caller)
    with ctx.db.transaction() as session:
        row = _get(session, tenant, file_id)
        path = store.delete(session, tenant, row.id, ctx.settings.artifact_dir)
        session.delete(row)
    path.unlink(missing_ok=True)
    return {"id": file_id, "object": "file", "deleted": True}
