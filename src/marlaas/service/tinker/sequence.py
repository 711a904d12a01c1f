"""One training run's requests in `seq_id` order, each answered once.

The SDK numbers a training client's requests 1, 2, 3, ... (`seq_id`; a model created
by loading a checkpoint has had its load as number 0) and may send them out of order:
the chunks of one large `forward_backward` go out concurrently, the first one last.
The server runs them in number order and answers a resent number with the request id
it already gave (the SDK resends after a broken connection).

Each request's `start` is its ordered part: it runs after the previous number's
`start` returned and before the next one's begins. It queues the request's work (on
the device, whose calls of one tenant run in the order they were made) and returns;
the work itself completes later, so consecutive requests overlap on the device
(a `forward_backward` and the `optim_step` after it are queued back to back).

Invariants: a number runs at most once; numbers run in increasing order without gaps
(a request waits for its predecessors, however late they come); `close` fails every
request still waiting, and later numbers are refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from marlaas.service.tinker.errors import UserError

log = logging.getLogger(__name__)

Start = Callable[[], Awaitable[None]]
#: Request ids remembered per model for resends, counted back from the next number.
_REMEMBERED = 4096


class ModelSequence:
    """The ordering of one model's requests (see the module docstring). Event-loop only."""

    def __init__(self, model_id: str, next_seq: int = 1) -> None:
        self.model_id = model_id
        self._next = next_seq
        self._ids: dict[int, str] = {}
        self._waiting: dict[int, tuple[str, Start]] = {}
        self._runner: asyncio.Task[None] | None = None
        self._closed: str | None = None

    @property
    def next_seq(self) -> int:
        """The number that runs next."""
        return self._next

    @property
    def waiting(self) -> int:
        """Requests that arrived before one of their predecessors."""
        return len(self._waiting)

    def known(self, seq_id: int) -> str | None:
        """The request id already given to `seq_id`, if any (a resend)."""
        return self._ids.get(seq_id)

    def put(self, seq_id: int, request_id: str, start: Start) -> None:
        """Run `start` in its turn. `UserError` for a number that has passed, or when
        the model is closed. `start` must not raise: it fails its own future."""
        if self._closed is not None:
            raise UserError(f"training run {self.model_id!r} is closed: {self._closed}")
        if seq_id in self._ids:
            raise UserError(f"seq_id {seq_id} of {self.model_id!r} was already used")
        if seq_id < self._next:
            raise UserError(
                f"seq_id {seq_id} of {self.model_id!r} comes after {self._next - 1} "
                "requests that already ran; number a training client's requests 1, 2, 3, ..."
            )
        self._ids[seq_id] = request_id
        self._waiting[seq_id] = (request_id, start)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run(), name=f"tinker-seq-{self.model_id}")

    def close(self, reason: str) -> list[str]:
        """Refuse later requests; return the ids of those still waiting (to fail)."""
        self._closed = reason
        ids = [rid for rid, _ in self._waiting.values()]
        self._waiting.clear()
        return ids

    async def _run(self) -> None:
        while self._closed is None and self._next in self._waiting:
            _, start = self._waiting.pop(self._next)
            self._next += 1
            try:
                await start()
            except Exception:  # `start` fails its own future; never stop the sequence
                log.exception(
                    "request %d of %s failed outside its future", self._next - 1, self.model_id
                )
            self._ids.pop(self._next - 1 - _REMEMBERED, None)  # numbers pass one by one
