"""The futures of the Tinker-compatible API: every asynchronous call answers a request id
at once; `retrieve_future` long-polls for its result.

Lifecycle of one future: `create` (owned by one marlaas tenant) -> `resolve` or `fail`,
exactly once -> kept for `ttl_s` after that, then forgotten. A retrieval waits up to
`poll_s` (the SDK's own HTTP timeout is 45 s and it polls again at once) and answers
one of: the result, the failure, or "try again" while the work is still running.

Invariants:
- Only the owning tenant can retrieve a future; anyone else gets the same 404 as for
  an id that never existed (ids are random as well).
- A result can be retrieved any number of times until it expires (the SDK retries a
  retrieval after a broken connection); it is computed once.
- Waiting costs no polling: retrievals wait on the future's event.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from marlaas.service.tinker.errors import Category, not_found

#: How long a retrieval waits for a running request before answering "try again".
DEFAULT_POLL_S = 40.0
#: How long a finished future stays retrievable.
DEFAULT_TTL_S = 30 * 60.0


class Reply(Protocol):
    """A result as the SDK reads it: always as JSON; as protobuf too for the types the
    SDK decodes only from protobuf (samples and forward/backward outputs)."""

    def json(self) -> dict[str, Any]: ...

    def protobuf(self) -> bytes | None:
        """The protobuf encoding, or None when this result has none (JSON only)."""
        ...


@dataclass(frozen=True)
class JsonReply:
    """A result that is JSON only (every reply type but samples and forward/backward)."""

    body: dict[str, Any]

    def json(self) -> dict[str, Any]:
        return self.body

    def protobuf(self) -> bytes | None:
        return None


@dataclass(frozen=True)
class Failure:
    """How a failed request answers: the SDK raises `RequestFailedError(message)`."""

    message: str
    category: Category

    def json(self) -> dict[str, Any]:
        return {"error": self.message, "category": self.category}


@dataclass(frozen=True)
class Pending:
    """The "still running" answer of a retrieval."""

    request_id: str

    def json(self) -> dict[str, Any]:
        return {"type": "try_again", "request_id": self.request_id, "queue_state": "active"}


Outcome = Reply | Failure


@dataclass
class _Entry:
    owner: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    finished_at: float | None = None


class FutureStore:
    """Every future of the API (see the module docstring). Event-loop only."""

    def __init__(
        self,
        *,
        poll_s: float = DEFAULT_POLL_S,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.poll_s = poll_s
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._finished: deque[tuple[float, str]] = deque()  # in finishing order

    def __len__(self) -> int:
        return len(self._entries)

    def create(self, owner: str) -> str:
        """A new pending future of tenant `owner`; returns its request id."""
        self._expire()
        request_id = f"req_{secrets.token_hex(12)}"
        self._entries[request_id] = _Entry(owner=owner)
        return request_id

    def resolve(self, request_id: str, reply: Reply) -> None:
        self._finish(request_id, reply)

    def fail(self, request_id: str, message: str, category: Category = "user") -> None:
        self._finish(request_id, Failure(message, category))

    def done(self, request_id: str) -> bool:
        entry = self._entries.get(request_id)
        return entry is not None and entry.outcome is not None

    async def retrieve(
        self, request_id: str, owner: str, timeout: float | None = None
    ) -> Outcome | Pending:
        """The outcome, waiting up to `timeout` (default `poll_s`) for it; `Pending` if
        it is still running then. 404 for an unknown, expired or foreign id."""
        entry = self._entries.get(request_id)
        if entry is None or entry.owner != owner:
            raise not_found("request", request_id)
        if entry.outcome is None:
            try:
                await asyncio.wait_for(
                    entry.done.wait(), self.poll_s if timeout is None else timeout
                )
            except TimeoutError:
                return Pending(request_id)
        assert entry.outcome is not None
        return entry.outcome

    def _finish(self, request_id: str, outcome: Outcome) -> None:
        entry = self._entries.get(request_id)
        if entry is None or entry.outcome is not None:
            return  # expired, or already answered: a future resolves once
        entry.outcome = outcome
        entry.finished_at = self._clock()
        self._finished.append((entry.finished_at, request_id))
        entry.done.set()

    def _expire(self) -> None:
        horizon = self._clock() - self.ttl_s
        while self._finished and self._finished[0][0] < horizon:
            _, rid = self._finished.popleft()
            self._entries.pop(rid, None)
