"""Server-sent-event answers of the OpenAI-compatible routes (`stream: true`).

A streamed answer is `text/event-stream` with `data: {chunk}` events and a final
`data: [DONE]`. Chunks leave as the engine samples tokens: one per piece of text that
`service.streaming.IncrementalText` releases (whole characters only; text that could
start a stop string is held back until it is known not to), then one with the choice's
`finish_reason`; the choices of `n > 1` interleave, each chunk naming its `index`. How
each route words its chunks is its `Chunks`. The response starts once every choice's
request is admitted (has its first token), so errors of admission (a prompt too long,
no free adapter slot) keep their status codes; an error after that ends the stream with
a `data: {"error": ...}` event and no `[DONE]`. When the client disconnects, the
choices' engine requests are aborted, whether it does so before the response started
(while its requests wait for the engine) or while it streams.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from marlaas.service.errors import ServiceError
from marlaas.service.inference import InferenceServer
from marlaas.service.inference_limits import unless_disconnected
from marlaas.service.models_catalog import ServedModel
from marlaas.service.openai_schemas import SamplingRequest, error_body, usage_of
from marlaas.service.streaming import ChoiceEvents, IncrementalText
from marlaas.types import Completion, SamplingParams

log = logging.getLogger(__name__)


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <payload as compact JSON, or as is>`."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def _decoder(server: InferenceServer) -> Callable[[list[int]], str]:
    tokenizer = server.provider.tokenizer

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    return decode


@dataclass(frozen=True)
class Chunks:
    """How one route words its stream: a text piece of choice `i`, its finish, and an
    optional first chunk per choice (chat's role)."""

    head: dict[str, Any]
    piece: Callable[[int, str], str]
    finish: Callable[[int, Completion], str]
    opening: Callable[[int], str] | None = None


async def stream_answer(
    server: InferenceServer,
    served: ServedModel,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    n: int,
    body: SamplingRequest,
    chunks: Chunks,
    receive: Receive,
    release: Callable[[], None],
) -> StreamingResponse:
    """Start generating; once every choice is admitted, the response that streams it
    (see the module docstring). Errors before that raise, as for a plain answer.
    `receive`: the request's ASGI channel (to see a disconnect); `release`: called once
    the generation has ended, however it ends."""
    count = len(prompts) * n
    events = ChoiceEvents(count)
    task = asyncio.ensure_future(server.generate(served, prompts, sampling, n, events))
    task.add_done_callback(functools.partial(_report_failure, events))
    task.add_done_callback(lambda _: release())
    try:
        await unless_disconnected(receive, events.started())
    except BaseException:
        task.cancel()
        raise
    if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
        raise exc
    decode = _decoder(server)
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    async def send() -> AsyncIterator[str]:
        texts = [IncrementalText(decode, sampling.stop) for _ in range(count)]
        outs: list[Completion] = []
        try:
            if chunks.opening is not None:
                for i in range(count):
                    yield chunks.opening(i)
            async for event in events:
                i = event.index
                if event.completion is None:
                    text = texts[i].push(event.token)
                    if text:
                        yield chunks.piece(i, text)
                    continue
                for text in texts[i].finish(event.completion):
                    yield chunks.piece(i, text)
                outs.append(event.completion)
                yield chunks.finish(i, event.completion)
        except ServiceError as e:
            yield sse(error_body(e.status_code, str(e), getattr(e, "param", None)))
            return
        except Exception:
            log.exception("a streamed answer failed")
            yield sse(error_body(500, "the answer failed while it was streamed"))
            return
        if include_usage:
            yield sse({**chunks.head, "choices": [], "usage": usage_of(prompts, outs)})
        yield sse("[DONE]")

    return _EventStream(send(), task)


def _report_failure(events: ChoiceEvents, task: asyncio.Future[list[Completion]]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        events.fail(exc)


class _EventStream(StreamingResponse):
    """A server-sent-event stream that ends its generation when the response ends, for
    whatever reason (done, client gone, never started): in-flight requests are aborted."""

    def __init__(self, content: AsyncIterator[str], generation: asyncio.Future[Any]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.cancel()  # a no-op once it is done
