"""A small parser of server-sent events (the WHATWG `text/event-stream` format): lines
in, one message per blank line out; comments come out as heartbeats."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Message:
    """One dispatched message. `event` None and empty `data`: a comment (heartbeat)."""

    event: str | None
    data: str
    id: str | None


HEARTBEAT = Message(event=None, data="", id=None)


def parse(lines: Iterable[str]) -> Iterator[Message]:
    """Messages of a stream given as lines without their line endings."""
    event: str | None = None
    data: list[str] = []
    last_id: str | None = None
    for line in lines:
        if line == "":
            if data or event is not None:
                yield Message(event=event or "message", data="\n".join(data), id=last_id)
            event, data = None, []
            continue
        if line.startswith(":"):
            yield HEARTBEAT
            continue
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id" and "\0" not in value:
            last_id = value
        # `retry` and unknown fields are ignored; reconnecting is the caller's business
