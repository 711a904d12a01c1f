"""`/v1/fine_tuning/checkpoints/{checkpoint}/permissions` (the SDK's
`fine_tuning.checkpoints.permissions.create/retrieve/list/delete`): refused, in
OpenAI's error shape, with a 400 that says why.

OpenAI's permissions let an organization's admin share a fine-tuned checkpoint with
other projects of the same organization. marlaas has no such level: a tenant is its
own organization and project at once, and no tenant may sample, list or download
another tenant's models (the isolation every route keeps; DESIGN.md pins it as an invariant).
Honouring a grant would make one tenant's adapter answer another tenant's key, so these
routes answer that sharing is not supported and what to do instead; they answer alike
whether the checkpoint exists or is another tenant's, so they tell nobody anything.
"""

from __future__ import annotations

from typing import Any, NoReturn

from fastapi import APIRouter

from marlaas.service.api.deps import TenantCaller
from marlaas.service.openai_ft.errors import ERRORS, FineTuningRoute, bad_request

router = APIRouter(
    prefix="/v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions",
    tags=["openai fine-tuning"],
    route_class=FineTuningRoute,
    responses=ERRORS,
)

MESSAGE = (
    "checkpoint permissions are not supported: a marlaas tenant is its own organization "
    "and project, and its fine-tuned models and checkpoints answer only its own API keys "
    "(no tenant can sample another tenant's adapters). To use a checkpoint elsewhere, "
    "download its PEFT adapter (GET /v1/jobs/{job_id}/checkpoints/{step}/adapter) and "
    "serve it where you need it, or train the job under the tenant that will call it."
)


def _refuse() -> NoReturn:
    raise bad_request(MESSAGE, "fine_tuned_model_checkpoint", "unsupported_feature")


@router.post("")
def create_permission(fine_tuned_model_checkpoint: str, caller: TenantCaller) -> dict[str, Any]:
    """Share a checkpoint with other projects: not supported (see the module docstring)."""
    _refuse()


@router.get("")
def list_permissions(fine_tuned_model_checkpoint: str, caller: TenantCaller) -> dict[str, Any]:
    """A checkpoint's permissions (`retrieve` and `list`): not supported."""
    _refuse()


@router.delete("/{permission_id}")
def delete_permission(
    fine_tuned_model_checkpoint: str, permission_id: str, caller: TenantCaller
) -> dict[str, Any]:
    """Revoke a permission: not supported."""
    _refuse()
