"""Errors of the Tinker-compatible API, and how each reaches the SDK.

Two ways out:
- at once, as the HTTP answer of the call (`{"detail": message}` with the status of a
  `ServiceError`): authentication (401), a missing or another tenant's model, session
  or path (404, as if missing), an unparsable body (400), a quota (429);
- through the call's future, when the request was accepted but cannot be served:
  `retrieve_future` answers `{"error": message, "category": "user" | "server"}`, which
  the SDK raises as `RequestFailedError` with that message. A request of a model's
  sequence fails this way (not at once) so that the model's later requests still run
  in `seq_id` order.

Messages say what was wrong and what to do, as everywhere in marlaas.
"""

from __future__ import annotations

from typing import Literal

from marlaas.errors import (
    CapacityError,
    ConfigError,
    DataError,
    InvalidRequest,
    ModelError,
    TenantNotFound,
)
from marlaas.service.api.deps import AUTH_ERRORS, responses
from marlaas.service.errors import NotFound, ServiceError

Category = Literal["user", "server"]


class UserError(ServiceError, ValueError):
    """A request the server understood but cannot serve as asked (an unknown loss,
    shapes that do not match, a token outside the vocabulary, ...)."""

    status_code = 400


class Gone(ServiceError, LookupError):
    """A session that has finished: its heartbeats stop (the SDK stops on 410)."""

    status_code = 410


class NotLoaded(UserError):
    """A training run that exists but is not on the device (the server restarted, or
    its session finished); it can be loaded again from one of its saved states."""


def not_found(what: str, name: str) -> NotFound:
    """The one 404 of the Tinker routes: missing and another tenant's alike."""
    return NotFound(f"{what} {name!r} does not exist or you do not have access to it")


def category_of(error: BaseException) -> Category:
    """How a failed future reports `error`: the caller's fault (bad data, a spec the
    base cannot take, a quota), or the server's (the device stopped, a disk failed)."""
    user = (
        UserError,
        NotFound,
        ConfigError,  # TrainBatchError (bad data of one tenant) derives from it
        DataError,
        InvalidRequest,
        CapacityError,
        ModelError,
        TenantNotFound,
    )
    return "user" if isinstance(error, user) else "server"


#: What every Tinker route may answer at once (the rest reaches the SDK through the
#: call's future, see the module docstring).
ERRORS = AUTH_ERRORS | responses(
    {
        400: "The request cannot be served as asked; `detail` says what to change.",
        404: "No such model, session, sampler, future or path (another tenant's alike).",
        410: "The session has finished (the SDK stops its heartbeats).",
        413: "The body is larger than this service's limit.",
        429: "A quota would be exceeded; the message names it and its limit.",
    }
)
