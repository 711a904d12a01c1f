"""A job's progress as a server-sent-event stream, read from the `job_events` table.

The table is the source of truth: a stream sends the job's events in id order, after
the id the client last saw (`Last-Event-ID` or `?after=`), and ends once the job is
terminal and every event up to that point was sent (a final `end` event says so and
carries the status; a stream that stops without it was cut, and the client resumes).

Waking up is event-driven: whoever commits a new event (the reporter, the API's
actions) calls `JobNotifier.notify(job_id)` afterwards, which wakes the streams of that
job at once. The stream still re-reads the table every `poll_s` seconds as a safety
net, for events committed by something that does not notify this process (another
server process sharing the database, an operator's script) -- never as the normal path.

No lost wake-up: a stream clears its flag *before* it reads the table, so an event
committed after that read has set the flag again and the next wait returns at once.

A stream also ends (without `end`) after `max_stream_s`, and the client reconnects
with `Last-Event-ID`: uvicorn waits for open responses before it shuts down (the app
hears of the shutdown only afterwards), so an endless stream would hold a graceful
shutdown for as long as a client watches; this bounds the wait to about
`max_stream_s` + `poll_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import select

from marlaas.service.db import Database
from marlaas.service.lifecycle import JobStatus
from marlaas.service.models import Job, JobEvent

#: Events read per query; a long history is sent in pages of this size.
PAGE = 500


class JobEventOut(BaseModel):
    """One event as sent on the wire (the SSE `data:` field, JSON)."""

    model_config = ConfigDict(extra="forbid")

    id: int
    job_id: str
    kind: str
    time: datetime
    data: dict[str, Any]


def event_out(event: JobEvent) -> JobEventOut:
    return JobEventOut(
        id=event.id, job_id=event.job_id, kind=event.kind, time=event.time, data=event.data
    )


class _Waiter:
    """One stream's wake-up flag, settable from any thread."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._flag = asyncio.Event()

    def wake(self) -> None:
        # RuntimeError: its loop is closed, so the stream is gone already.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._flag.set)

    def clear(self) -> None:
        self._flag.clear()

    async def wait(self, timeout: float) -> bool:
        """True when woken, False when `timeout` passed first."""
        try:
            await asyncio.wait_for(self._flag.wait(), timeout)
        except TimeoutError:
            return False
        return True


class JobNotifier:
    """Wakes the event streams of a job when one of its events was committed.

    `notify` may be called from any thread or event loop; it never blocks and never
    touches the database. One notifier per app (it lives on the `JobReporter`).
    """

    def __init__(
        self, *, poll_s: float = 5.0, keepalive_s: float = 15.0, max_stream_s: float = 30.0
    ) -> None:
        self.poll_s = poll_s
        """Safety-net re-read of the table when nothing notified (see the module doc)."""
        self.keepalive_s = keepalive_s
        """A comment line at least this often, so idle proxies keep the connection."""
        self.max_stream_s = max_stream_s
        """A stream's longest life; the client then resumes where it stopped."""
        self._lock = threading.Lock()
        self._waiters: dict[str, set[_Waiter]] = {}

    def notify(self, job_id: str) -> None:
        with self._lock:
            waiters = list(self._waiters.get(job_id, ()))
        for waiter in waiters:
            waiter.wake()

    def listeners(self, job_id: str) -> int:
        """How many streams follow the job now (for tests and metrics)."""
        with self._lock:
            return len(self._waiters.get(job_id, ()))

    @contextmanager
    def subscribe(self, job_id: str) -> Iterator[_Waiter]:
        """A wake-up flag for `job_id`, registered while the block runs; call it from
        the event loop that will wait on it."""
        waiter = _Waiter()
        with self._lock:
            self._waiters.setdefault(job_id, set()).add(waiter)
        try:
            yield waiter
        finally:
            with self._lock:
                group = self._waiters.get(job_id)
                if group is not None:
                    group.discard(waiter)
                    if not group:
                        del self._waiters[job_id]


def _read(db: Database, job_id: str, after: int) -> tuple[JobStatus, list[JobEventOut]]:
    """The job's status, then its events after `after` (one page). Status first: if it
    was terminal, the event that made it so was committed with it and is in the page
    (or a later one), so the stream never ends before sending it."""
    with db.transaction() as session:
        status = session.scalar(select(Job.status).where(Job.id == job_id))
        if status is None:  # deleted while streaming: end as if cancelled
            return JobStatus.CANCELLED, []
        rows = session.scalars(
            select(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.id > after)
            .order_by(JobEvent.id)
            .limit(PAGE)
        )
        return JobStatus(status), [event_out(e) for e in rows]


def sse_message(event: JobEventOut) -> str:
    return f"id: {event.id}\nevent: {event.kind}\ndata: {event.model_dump_json()}\n\n"


def _end_message(status: JobStatus, last_id: int) -> str:
    data = json.dumps({"status": str(status), "last_event_id": last_id})
    return f"event: end\ndata: {data}\n\n"


async def stream_events(
    db: Database, notifier: JobNotifier, job_id: str, *, after: int, follow: bool
) -> AsyncIterator[str]:
    """SSE text of the job's events after `after`. `follow`: wait for new events until
    the job is terminal; otherwise send what exists now, then `end`."""
    started = time.monotonic()
    last_sent = time.monotonic()
    yield "retry: 1000\n\n"  # reconnect delay for EventSource clients, in ms
    with notifier.subscribe(job_id) as waiter:
        while True:
            waiter.clear()
            status, page = await asyncio.to_thread(_read, db, job_id, after)
            for event in page:
                yield sse_message(event)
                after = event.id
            if page:
                last_sent = time.monotonic()
            if len(page) == PAGE:
                continue  # more history to send before deciding anything
            if status.terminal or not follow:
                yield _end_message(status, after)
                return
            now = time.monotonic()
            if now - started >= notifier.max_stream_s:
                return  # cut on purpose: the client resumes after `after`
            if now - last_sent >= notifier.keepalive_s:
                yield ": keepalive\n\n"
                last_sent = now
            await waiter.wait(min(notifier.poll_s, notifier.keepalive_s))
