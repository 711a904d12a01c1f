"""The job event stream (SSE): history in id order, resume after an id (query or
`Last-Event-ID`), the end at a terminal status, waking by notification rather than
polling, a deliberate cut, and tenant isolation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi.testclient import TestClient

from helpers.live_support import events_of
from helpers.service_support import ScriptedBackend, Tenants, job_body
from marlaas.client import sse
from marlaas.service.context import ServiceContext
from marlaas.service.events import stream_events
from marlaas.service.lifecycle import JobStatus


def _create(client: TestClient, headers: dict[str, str], **kw: Any) -> str:
    r = client.post("/v1/jobs", json=job_body(**kw), headers=headers)
    assert r.status_code == 201, r.text
    jid: str = r.json()["id"]
    return jid


def _summary(messages: list[sse.Message]) -> list[str]:
    out = []
    for m in messages:
        data = json.loads(m.data)
        if m.event == "end":
            out.append(f"end:{data['status']}")
        elif m.event == "status":
            out.append(f"status:{data['data']['status']}")
        else:
            out.append(f"{m.event}:{data['data']['step']}")
    return out


def test_stream_sends_the_history_in_order_and_ends_at_the_terminal_status(
    client: TestClient, tenants: Tenants
) -> None:
    acme = tenants.create("acme")
    jid = _create(client, acme, steps=3, checkpoint_every=2)
    r = client.get(f"/v1/jobs/{jid}/events", headers=acme)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    messages = events_of(r.text)
    assert _summary(messages) == [
        "status:queued",
        "status:running",
        "step:1",
        "step:2",
        "checkpoint:2",
        "step:3",
        "checkpoint:3",
        "status:done",
        "end:done",
    ]
    ids = [int(m.id) for m in messages[:-1] if m.id is not None]
    assert ids == sorted(set(ids)) and len(ids) == 8
    step2 = json.loads(messages[3].data)
    assert step2["job_id"] == jid and step2["data"]["metrics"] == {"reward": 0.2, "loss": 0.5}
    assert json.loads(messages[-1].data) == {"status": "done", "last_event_id": ids[-1]}


def test_stream_resumes_after_an_id_from_the_query_or_last_event_id(
    client: TestClient, tenants: Tenants
) -> None:
    acme = tenants.create("acme")
    jid = _create(client, acme, steps=3)
    all_ids = [
        int(m.id)
        for m in events_of(client.get(f"/v1/jobs/{jid}/events", headers=acme).text)
        if m.id
    ]
    third = all_ids[2]
    by_query = events_of(client.get(f"/v1/jobs/{jid}/events?after={third}", headers=acme).text)
    by_header = events_of(
        client.get(
            f"/v1/jobs/{jid}/events?after=0", headers={**acme, "Last-Event-ID": str(third)}
        ).text
    )
    assert [m.id for m in by_query] == [m.id for m in by_header]
    assert [int(m.id) for m in by_query if m.id] == all_ids[3:]
    assert by_query[-1].event == "end"
    # past the last event: only the end
    past = events_of(client.get(f"/v1/jobs/{jid}/events?after={all_ids[-1]}", headers=acme).text)
    assert [m.event for m in past] == ["end"]
    bad = client.get(f"/v1/jobs/{jid}/events", headers={**acme, "Last-Event-ID": "x"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["header", "Last-Event-ID"]
    assert client.get(f"/v1/jobs/{jid}/events?after=-1", headers=acme).status_code == 422


def test_no_follow_sends_what_exists_and_ends_while_running(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    acme = tenants.create("acme")
    backend.hold_at = 1
    jid = _create(client, acme, steps=3)
    r = client.get(f"/v1/jobs/{jid}/events?follow=false", headers=acme)
    assert _summary(events_of(r.text)) == [
        "status:queued",
        "status:running",
        "step:1",
        "end:running",
    ]


def test_a_stream_past_its_lifetime_stops_without_end(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend, context: ServiceContext
) -> None:
    acme = tenants.create("acme")
    backend.hold_at = 1
    jid = _create(client, acme, steps=3)
    context.reporter.notifier.max_stream_s = 0.0
    messages = events_of(client.get(f"/v1/jobs/{jid}/events", headers=acme).text)
    assert _summary(messages) == ["status:queued", "status:running", "step:1"]


async def test_a_new_event_wakes_a_waiting_stream_without_polling(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend, context: ServiceContext
) -> None:
    acme = tenants.create("acme")
    backend.hold_at = 1
    jid = _create(client, acme, steps=2)
    notifier = context.reporter.notifier
    notifier.poll_s = notifier.keepalive_s = 3600.0  # only a notification can wake it
    seen: list[str] = []

    async def follow() -> None:
        stream = stream_events(context.db, notifier, jid, after=0, follow=True)
        async for chunk in stream:
            seen.extend(_summary(events_of(chunk)))

    task = asyncio.create_task(follow())
    for _ in range(3000):  # bounded wait until the stream has caught up and waits
        if "step:1" in seen and notifier.listeners(jid) == 1:
            break
        await asyncio.sleep(0.01)
    assert seen == ["status:queued", "status:running", "step:1"]
    await context.reporter.step(jid, 2, {"reward": 1.0})
    await context.reporter.status(jid, JobStatus.DONE)
    await asyncio.wait_for(task, timeout=60)
    assert seen[3:] == ["step:2", "status:done", "end:done"]
    assert notifier.listeners(jid) == 0


def test_an_action_through_the_api_notifies_the_streams(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend, context: ServiceContext
) -> None:
    acme = tenants.create("acme")
    backend.hold_at = 1
    jid = _create(client, acme, steps=2)
    woken: list[str] = []
    original = context.reporter.notifier.notify
    context.reporter.notifier.notify = lambda job_id: (woken.append(job_id), original(job_id))  # type: ignore[method-assign]
    assert client.post(f"/v1/jobs/{jid}/pause", headers=acme).status_code == 200
    assert woken == [jid]


def test_other_tenants_streams_answer_like_missing_ones(
    client: TestClient, tenants: Tenants
) -> None:
    acme, globex = tenants.create("acme"), tenants.create("globex")
    jid = _create(client, acme)
    theirs = client.get(f"/v1/jobs/{jid}/events", headers=globex)
    missing = client.get("/v1/jobs/job_0000000000000000/events", headers=globex)
    assert theirs.status_code == missing.status_code == 404
    assert theirs.content == missing.content
    assert client.get(f"/v1/jobs/{jid}/events").status_code == 401


def test_a_resumed_job_reruns_its_steps_without_repeating_their_events(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    """Killed at step 7 with a checkpoint at 5: the restarted job says it is at step 5
    (not 7) and keeps no metrics past it; the re-run steps 6 and 7 update their events
    in place, so the stream holds each step once, with the metrics it has now."""
    acme = tenants.create("acme")
    backend.hold_at = 7
    jid = _create(client, acme, steps=10, checkpoint_every=5)
    assert backend.reporter is not None
    reporter = backend.reporter

    def history() -> list[sse.Message]:
        r = client.get(f"/v1/jobs/{jid}/events", params={"follow": "false"}, headers=acme)
        return [m for m in events_of(r.text) if m.event != "end"]

    def step_ids(messages: list[sse.Message]) -> dict[int, int]:
        return {
            json.loads(m.data)["data"]["step"]: int(m.id or 0)
            for m in messages
            if m.event == "step"
        }

    before = step_ids(history())
    assert sorted(before) == list(range(1, 8))
    asyncio.run(reporter.restored(jid, 5))
    assert client.get(f"/v1/jobs/{jid}", headers=acme).json()["steps_done"] == 5
    points = client.get(f"/v1/jobs/{jid}/metrics", headers=acme).json()["points"]
    assert max(p["step"] for p in points) == 5
    for step in (6, 7, 8):
        asyncio.run(reporter.step(jid, step, {"reward": 1.0, "loss": float(step)}))
    messages = history()
    after = step_ids(messages)
    assert [json.loads(m.data)["data"]["step"] for m in messages if m.event == "step"] == list(
        range(1, 9)
    )  # once each
    assert after[6] == before[6] and after[7] == before[7]  # the same events, updated
    step7 = next(json.loads(m.data) for m in messages if int(m.id or 0) == after[7])
    assert step7["data"]["metrics"] == {"reward": 1.0, "loss": 7.0}
    assert [json.loads(m.data)["data"] for m in messages if m.event == "resumed"] == [{"step": 5}]
    assert client.get(f"/v1/jobs/{jid}", headers=acme).json()["steps_done"] == 8
