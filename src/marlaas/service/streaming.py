"""Streaming answers: the events of a streamed generation, and its text piece by piece.

`ChoiceEvents` collects, on the event loop, what the engine reports for every choice of
one answer while it generates: each token as it is sampled, then the choice's
`Completion`, or the error that failed the generation. `InferenceServer.generate` feeds
it; the OpenAI routes iterate it and turn the tokens into text with one
`IncrementalText` per choice.

`IncrementalText` invariants (the pieces it gives, in order, for one choice):
- they join to exactly `Completion.text` (the engine's final text: special tokens
  skipped, cut before the stop string that ended the choice);
- no piece splits a multi-byte character (a token that ends inside one waits for the
  rest);
- no piece holds text at or after a stop string: the last `len(longest stop) - 1`
  characters are held back until the next tokens show they do not start a stop string
  (or the completion comes).
Tokens the engine did not stream (a front end that cannot, e.g. the Ray client) are
taken from the completion, so its caller still gets one piece per token, only later.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from marlaas.types import Completion

log = logging.getLogger(__name__)

#: What a partial multi-byte character decodes to.
_REPLACEMENT = "\ufffd"


class IncrementalText:
    """The text of one choice, released piece by piece as its tokens arrive (see the
    module docstring). `decode` is the engine's (special tokens skipped); `stops` the
    request's stop strings."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = []
        # ids[:_read] are decoded into `_text`; ids[_prefix:_read] (the last decoded
        # step) are decoded again with the new tokens, as context for their first one.
        self._prefix = 0
        self._read = 0
        self._text = ""
        self._sent = 0
        self._stopped = False

    @property
    def sent(self) -> str:
        """The text released so far."""
        return self._text[: self._sent]

    def push(self, token: int) -> str:
        """Take the next sampled token; the text it releases (often "")."""
        self._ids.append(token)
        if self._stopped:  # a stop string appeared: the completion ends the text
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release()

    def finish(self, completion: Completion) -> list[str]:
        """The remaining pieces: one per token the engine did not stream, then whatever
        makes the pieces join to exactly `completion.text`."""
        pieces: list[str] = []
        seen = len(self._ids)
        if tuple(self._ids) == completion.token_ids[:seen]:
            for token in completion.token_ids[seen:]:
                piece = self.push(token)
                if piece:
                    pieces.append(piece)
        final, sent = completion.text, self.sent
        if not final.startswith(sent):  # a tokenizer whose decoding is not prefix-stable
            log.warning("request %s: the streamed text left its final text", completion.request_id)
        if len(final) > len(sent):
            pieces.append(final[len(sent) :])
        return pieces

    def _release(self) -> str:
        safe = len(self._text) - self._hold
        for stop in self._stops:
            at = self._text.find(stop, self._sent)
            if at >= 0:
                safe = min(safe, at)
                self._stopped = True
        if safe <= self._sent:
            return ""
        piece = self._text[self._sent : safe]
        self._sent = safe
        return piece


def text_pieces(
    decode: Callable[[list[int]], str], completion: Completion, stops: Sequence[str] = ()
) -> list[str]:
    """A finished completion's text cut at token boundaries, as it would have streamed:
    the pieces join to exactly `completion.text` and keep characters whole."""
    return IncrementalText(decode, stops).finish(completion)


@dataclass(frozen=True)
class ChoiceEvent:
    """A sampled token of choice `index` (`completion` None), or its completion."""

    index: int
    token: int = -1
    completion: Completion | None = None


class ChoiceEvents:
    """The events of the `count` choices of one streamed answer (use on the loop).

    `token` and `done` are called by `InferenceServer.generate`, `fail` by whoever runs
    it. `started()` returns once every choice has a token or an answer (its request was
    admitted) or the generation failed; iterating gives the events in the order they
    happened until every choice is done, and raises the failure if one comes first.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self._queue: asyncio.Queue[ChoiceEvent | BaseException] = asyncio.Queue()
        self._waiting = set(range(count))
        self._started = asyncio.Event()
        if not self._waiting:
            self._started.set()

    def token(self, index: int, token: int) -> None:
        self._queue.put_nowait(ChoiceEvent(index, token=token))
        self._begun(index)

    def done(self, index: int, completion: Completion) -> None:
        self._queue.put_nowait(ChoiceEvent(index, completion=completion))
        self._begun(index)

    def fail(self, exc: BaseException) -> None:
        self._queue.put_nowait(exc)
        self._started.set()

    async def started(self) -> None:
        await self._started.wait()

    async def __aiter__(self) -> AsyncIterator[ChoiceEvent]:
        left = self.count
        while left:
            event = await self._queue.get()
            if isinstance(event, BaseException):
                raise event
            if event.completion is not None:
                left -= 1
            yield event

    def _begun(self, index: int) -> None:
        if self._waiting:
            self._waiting.discard(index)
            if not self._waiting:
                self._started.set()
