"""Tinker sessions: what one `ServiceClient` opened, kept in memory.

A session belongs to the tenant whose key created it. It lives while its client sends
heartbeats (the SDK sends one every 10 s): one that sends none for `timeout_s`, or
that the client finishes (`ServiceClient.close()` calls `sessions/{id}/finish`), ends,
and the hub then takes its training runs off the device and forgets its samplers (the
runs' saved weights stay). A finished session answers 410 to heartbeats (the SDK stops
them on 410) and refuses new work.

Creation calls are idempotent per session: the `n`-th training client of a session
(`model_seq_id`) and its `n`-th sampling client (`sampling_session_seq_id`) are created
once however often the SDK resends the call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from marlaas.service.tinker.errors import Gone, UserError, not_found
from marlaas.service.tinker.paths import new_session_id

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class Session:
    id: str
    owner: str
    user_metadata: dict[str, Any]
    last_seen: float
    finished: str | None = None
    #: model_seq_id -> the request id of the call that creates it (create or load).
    models: dict[int, str] = field(default_factory=dict)
    #: sampling_session_seq_id -> sampler id.
    samplers: dict[int, str] = field(default_factory=dict)
    #: Model ids of the training runs created in this session.
    runs: set[str] = field(default_factory=set)


class Sessions:
    """The live sessions (see the module docstring). Event-loop only."""

    def __init__(
        self, timeout_s: float = DEFAULT_TIMEOUT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, owner: str, user_metadata: dict[str, Any] | None) -> Session:
        session = Session(
            id=new_session_id(),
            owner=owner,
            user_metadata=dict(user_metadata or {}),
            last_seen=self._clock(),
        )
        self._sessions[session.id] = session
        return session

    def get(self, owner: str, session_id: str) -> Session:
        """A live session of `owner` (404 for a missing or foreign one, `UserError`
        for a finished one)."""
        session = self._lookup(owner, session_id)
        if session.finished is not None:
            raise UserError(
                f"session {session_id!r} has finished ({session.finished}); create a new "
                "ServiceClient"
            )
        session.last_seen = self._clock()
        return session

    def heartbeat(self, owner: str, session_id: str) -> None:
        session = self._lookup(owner, session_id)
        if session.finished is not None:
            raise Gone(f"session {session_id!r} has finished ({session.finished})")
        session.last_seen = self._clock()

    def finish(self, owner: str, session_id: str, reason: str) -> Session | None:
        """Mark the session finished (first reason wins); returns it the first time,
        None when it had finished before."""
        session = self._lookup(owner, session_id)
        if session.finished is not None:
            return None
        session.finished = reason
        return session

    def expire(self) -> list[Session]:
        """Finish every session silent for `timeout_s`; returns them."""
        horizon = self._clock() - self.timeout_s
        out = []
        for session in self._sessions.values():
            if session.finished is None and session.last_seen < horizon:
                session.finished = f"no heartbeat for {self.timeout_s:.0f} s"
                out.append(session)
        return out

    def forget_finished(self, keep: int = 10_000) -> None:
        """Drop the oldest finished sessions beyond `keep` (a finished one is kept a while
        so that its client's late calls get 410 rather than 404)."""
        finished = [s for s in self._sessions.values() if s.finished is not None]
        for session in finished[: max(len(finished) - keep, 0)]:
            del self._sessions[session.id]

    def _lookup(self, owner: str, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            raise not_found("session", session_id)
        return session
