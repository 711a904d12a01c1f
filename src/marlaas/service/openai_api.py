"""OpenAI-compatible routes: `GET /v1/models`, `GET /v1/models/{model}`,
`POST /v1/completions` and `POST /v1/chat/completions`, with the tenant's API key.

Model names are described in `marlaas.service.inference`: `base`, `<job id>` (the
job's latest adapter) and `<job id>:ckpt-<step>`.

Wire shapes follow OpenAI's API; these schemas are separate from the engine's records
and converted explicitly. Errors on these routes (authentication, validation, unknown
models) answer in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`;
invalid parameters are 400 with `param` naming the field. Unsupported options
(log-probs, echo, suffix, penalties, logit bias, tools, best_of != n) answer 400
instead of being silently ignored; unknown fields are ignored.

Chat prompts go through the tokenizer's chat template when it has one, else through
the plain format of `chat_prompt` (the embedded base has no template).

Streaming (`stream: true`) answers `text/event-stream` with `data: {chunk}` events and
a final `data: [DONE]`. Chunks leave as the engine samples tokens: one per piece of
text that `service.streaming.IncrementalText` releases (whole characters only; text
that could start a stop string is held back until it is known not to), then one with
the choice's `finish_reason`; the choices of `n > 1` interleave, each chunk naming its
`index`. The response starts once every choice's request is admitted (has its first
token), so errors of admission (a prompt too long, no free adapter slot) keep their
status codes; an error after that ends the stream with a `data: {"error": ...}` event
and no `[DONE]`. When the client disconnects, the choices' engine requests are aborted.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from starlette.types import Receive, Scope, Send

from marlaas.service.api.deps import TenantCaller, tenant_id
from marlaas.service.errors import ServiceError
from marlaas.service.inference import (
    BadInferenceRequest,
    InferenceHub,
    InferenceServer,
    ServedModel,
)
from marlaas.service.streaming import ChoiceEvents, IncrementalText
from marlaas.types import Completion, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

MAX_N = 16
MAX_STOP = 4
MAX_TOKENS = 32768


# -- errors ---------------------------------------------------------------------------

_TYPES = {
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "model_not_found"),
    429: ("rate_limit_error", None),
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    kind, default_code = _TYPES.get(
        status, ("invalid_request_error" if status < 500 else "server_error", None)
    )
    body = {"message": message, "type": kind, "param": param, "code": code or default_code}
    return {"error": body}


def openai_error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(
        error_body(status, message, param, code), status_code=status, headers=headers
    )


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
        for e in errors
    )
    return openai_error(400, message or "invalid request body", param)


class OpenAIRoute(APIRoute):
    """Routes whose errors answer in OpenAI's error shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return _validation_error(e)
            except BadInferenceRequest as e:
                return openai_error(e.status_code, str(e), e.param)
            except ServiceError as e:
                return openai_error(e.status_code, str(e))

        return answer


# -- request schemas ------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _union(value: Any, handler: ValidatorFunctionWrapHandler, what: str) -> Any:
    """Validate a union field with one clear message, not one per member of the union."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(f"must be {what}") from None


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    model: str = Field(min_length=1, max_length=200)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _union(value, handler, "a string, a list of strings or null")

    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise BadInferenceRequest(f"at most {MAX_STOP} stop sequences are allowed", "stop")
        if any(s == "" for s in stops):
            raise BadInferenceRequest("stop sequences must not be empty", "stop")
        return tuple(stops)

    def check_supported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise BadInferenceRequest(f"{name} is not supported; leave it at 0", name)
        if self.logit_bias:
            raise BadInferenceRequest("logit_bias is not supported", "logit_bias")

    def sampling(self, max_tokens: int, extra_stops: tuple[str, ...] = ()) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            max_new_tokens=max_tokens,
            stop=tuple(dict.fromkeys(self.stops() + extra_stops)),
            seed=self.seed,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS)
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _union(
            value,
            handler,
            "a string, a list of strings, a list of token ids or a list of token-id lists",
        )


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    @field_validator("content", mode="wrap")
    @classmethod
    def _content(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _union(value, handler, "a string, a list of content parts or null")

    def text(self) -> str:
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise BadInferenceRequest("only text content parts are supported", "messages")
        return "".join(part.text or "" for part in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


DEFAULT_CHAT_MAX_TOKENS = 256


# -- conversion -----------------------------------------------------------------------


#: Ends each message in the plain chat format; also the default stop of a chat reply
#: there, because a model turn of the embedded base is one line (`envs.base.TURN_END`).
PLAIN_TURN_END = "\n"


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Text to token ids as the pipeline encodes prompts (no special tokens added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[tuple[str, str]]
) -> tuple[list[int], tuple[str, ...]]:
    """Token ids of a chat prompt and the default stop strings of its reply.

    With a tokenizer chat template: the template with the generation prompt, no
    default stops. Without one (the embedded base), the plain format that matches the
    built-in tasks' `Q: ...\\nA: ` prompts: each message on its own line -- system and
    developer text as is, a user turn as `Q: <text>`, an assistant turn as
    `A: <text>` -- then `A: ` for the reply, which stops at the end of its line.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages],
            tokenize=False,
            add_generation_prompt=True,
        )
        return encode(tokenizer, str(text)), ()
    prefix = {"system": "", "developer": "", "user": "Q: ", "assistant": "A: "}
    lines = [f"{prefix[role]}{content}{PLAIN_TURN_END}" for role, content in messages]
    return encode(tokenizer, "".join(lines) + "A: "), (PLAIN_TURN_END,)


def _finish(completion: Completion) -> str:
    return "length" if completion.finish_reason == "length" else "stop"


def _usage(prompts: Sequence[Sequence[int]], outs: Sequence[Completion]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, whatever n
    completion_tokens = sum(len(c.token_ids) for c in outs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _model_card(m: ServedModel, owner: str) -> dict[str, Any]:
    created = int(m.created.timestamp()) if m.created is not None else 0
    return {"id": m.name, "object": "model", "created": created, "owned_by": owner}


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


# -- routes ---------------------------------------------------------------------------


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    hub = InferenceHub(app.state.context)
    app.state.inference_hub = hub
    try:
        yield
    finally:
        await hub.close()


router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute, lifespan=lifespan)


def _hub(request: Request) -> InferenceHub:
    hub: InferenceHub | None = getattr(request.app.state, "inference_hub", None)
    if hub is None:  # the app runs without its lifespan: an engine it never closes
        hub = request.app.state.inference_hub = InferenceHub(request.app.state.context)
    return hub


async def _server(request: Request) -> InferenceServer:
    return await _hub(request).server()


@router.get("/models")
async def list_models(request: Request, caller: TenantCaller) -> dict[str, Any]:
    """The caller's models: `base`, and per job with a checkpoint (or training now) its
    latest adapter (`<job id>`) and each checkpoint (`<job id>:ckpt-<step>`)."""
    models = await _hub(request).models(tenant_id(caller))
    owner = caller.tenant_name or "tenant"
    return {
        "object": "list",
        "data": [_model_card(m, "marlaas" if m.job_id is None else owner) for m in models],
    }


@router.get("/models/{model:path}")
async def get_model(model: str, request: Request, caller: TenantCaller) -> dict[str, Any]:
    found = await _hub(request).resolve(tenant_id(caller), model)
    owner = "marlaas" if found.job_id is None else caller.tenant_name or "tenant"
    return _model_card(found, owner)


@router.post("/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, request: Request, caller: TenantCaller
) -> dict[str, Any] | StreamingResponse:
    """Text completion of one prompt or a batch of prompts (strings or token ids)."""
    body.check_supported()
    for name in ("echo", "suffix", "logprobs"):
        if getattr(body, name):
            raise BadInferenceRequest(f"{name} is not supported", name)
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise BadInferenceRequest("best_of other than n is not supported", "best_of")
    server = await _server(request)
    served = await server.resolve(tenant_id(caller), body.model)
    prompts = _completion_prompts(body.prompt, server)
    sampling = body.sampling(body.max_tokens or 16)
    rid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": body.model}

    if body.stream:

        def piece(i: int, text: str) -> str:
            choice = {"index": i, "text": text, "logprobs": None, "finish_reason": None}
            return _sse({**head, "choices": [choice]})

        def finish(i: int, c: Completion) -> str:
            last = {"index": i, "text": "", "logprobs": None, "finish_reason": _finish(c)}
            return _sse({**head, "choices": [last]})

        chunks = _Chunks(head, piece, finish)
        return await _stream(server, served, prompts, sampling, n, body, chunks)

    outs = await server.generate(served, prompts, sampling, n)
    choices = [
        {"index": i, "text": c.text, "logprobs": None, "finish_reason": _finish(c)}
        for i, c in enumerate(outs)
    ]
    usage = _usage(prompts, outs)
    return {**head, "choices": choices, "usage": usage, "system_fingerprint": None}


@router.post("/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatRequest, request: Request, caller: TenantCaller
) -> dict[str, Any] | StreamingResponse:
    """A chat reply. Messages go through the tokenizer's chat template, or through the
    plain format of `chat_prompt` when the base has none."""
    body.check_supported()
    if body.logprobs:
        raise BadInferenceRequest("logprobs is not supported", "logprobs")
    if body.tools:
        raise BadInferenceRequest("tools are not supported", "tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise BadInferenceRequest("only the text response format is supported", "response_format")
    n = body.n or 1
    messages = [(m.role, m.text()) for m in body.messages]
    server = await _server(request)
    served = await server.resolve(tenant_id(caller), body.model)
    prompt, default_stops = chat_prompt(server.provider.tokenizer, messages)
    max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    sampling = body.sampling(max_tokens, default_stops)
    rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

    if body.stream:
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": body.model,
        }

        def chunk(i: int, delta: dict[str, str], finish: str | None = None) -> str:
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            return _sse({**head, "choices": [choice]})

        chunks = _Chunks(
            head,
            piece=lambda i, text: chunk(i, {"content": text}),
            finish=lambda i, c: chunk(i, {}, _finish(c)),
            opening=lambda i: chunk(i, {"role": "assistant", "content": ""}),
        )
        return await _stream(server, served, [prompt], sampling, n, body, chunks)

    outs = await server.generate(served, [prompt], sampling, n)
    head = {"id": rid, "object": "chat.completion", "created": created, "model": body.model}
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": None,
            "finish_reason": _finish(c),
        }
        for i, c in enumerate(outs)
    ]
    usage = _usage([prompt], outs)
    return {**head, "choices": choices, "usage": usage, "system_fingerprint": None}


def _completion_prompts(
    prompt: str | list[str] | list[int] | list[list[int]], server: InferenceServer
) -> list[list[int]]:
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise BadInferenceRequest("prompt is empty", "prompt")
    tokenizer = server.provider.tokenizer
    out = [encode(tokenizer, p) if isinstance(p, str) else list(p) for p in items]
    if any(not ids for ids in out):
        raise BadInferenceRequest("prompt is empty; give at least one token", "prompt")
    return out


def _decoder(server: InferenceServer) -> Callable[[list[int]], str]:
    tokenizer = server.provider.tokenizer

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    return decode


@dataclass(frozen=True)
class _Chunks:
    """How one route words its stream: a text piece of choice `i`, its finish, and an
    optional first chunk per choice (chat's role)."""

    head: dict[str, Any]
    piece: Callable[[int, str], str]
    finish: Callable[[int, Completion], str]
    opening: Callable[[int], str] | None = None


async def _stream(
    server: InferenceServer,
    served: ServedModel,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    n: int,
    body: _Sampling,
    chunks: _Chunks,
) -> StreamingResponse:
    """Start generating; once every choice is admitted, the response that streams it
    (see the module docstring). Errors before that raise, as for a plain answer."""
    count = len(prompts) * n
    events = ChoiceEvents(count)
    task = asyncio.ensure_future(server.generate(served, prompts, sampling, n, events))
    task.add_done_callback(functools.partial(_report_failure, events))
    try:
        await events.started()
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
            yield _sse(error_body(e.status_code, str(e), getattr(e, "param", None)))
            return
        except Exception:
            log.exception("a streamed answer failed")
            yield _sse(error_body(500, "the answer failed while it was streamed"))
            return
        if include_usage:
            yield _sse({**chunks.head, "choices": [], "usage": _usage(prompts, outs)})
        yield _sse("[DONE]")

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
