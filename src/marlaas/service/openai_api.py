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
a final `data: [DONE]`. The engine answers a request whole, so each choice's chunks
(one per decoded token piece) are sent once that choice is generated; errors are
found before the stream starts, so they keep their status codes.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
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

from marlaas.service.api.deps import TenantCaller, tenant_id
from marlaas.service.errors import ServiceError
from marlaas.service.inference import (
    BadInferenceRequest,
    InferenceHub,
    InferenceServer,
    ServedModel,
)
from marlaas.types import Completion, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


def openai_error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind, default_code = _TYPES.get(
        status, ("invalid_request_error" if status < 500 else "server_error", None)
    )
    body = {"message": message, "type": kind, "param": param, "code": code or default_code}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": body}, status_code=status, headers=headers)


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


def text_pieces(decode: Callable[[list[int]], str], completion: Completion) -> list[str]:
    """The completion's text cut at token boundaries (one piece per token that ends a
    whole character), for streaming; the pieces join to exactly `completion.text`."""
    final, pieces, sent = completion.text, [], 0
    for k in range(1, len(completion.token_ids) + 1):
        if sent >= len(final):
            break
        text = decode(list(completion.token_ids[:k]))
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            continue
        end = min(len(text), len(final))
        if end > sent:
            pieces.append(final[sent:end])
            sent = end
    if sent < len(final):
        pieces.append(final[sent:])
    return pieces


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
    outs = await server.generate(served, prompts, sampling, n)

    rid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
    usage = _usage(prompts, outs)
    if not body.stream:
        choices = [
            {"index": i, "text": c.text, "logprobs": None, "finish_reason": _finish(c)}
            for i, c in enumerate(outs)
        ]
        return {**head, "choices": choices, "usage": usage, "system_fingerprint": None}

    decode = _decoder(server)

    def events() -> list[str]:
        out = []
        for i, c in enumerate(outs):
            for piece in text_pieces(decode, c):
                choice = {"index": i, "text": piece, "logprobs": None, "finish_reason": None}
                out.append(_sse({**head, "choices": [choice]}))
            last = {"index": i, "text": "", "logprobs": None, "finish_reason": _finish(c)}
            out.append(_sse({**head, "choices": [last]}))
        return out

    return _stream(events(), head, usage, body)


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
    outs = await server.generate(served, [prompt], body.sampling(max_tokens, default_stops), n)

    rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
    usage = _usage([prompt], outs)
    if not body.stream:
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
        return {**head, "choices": choices, "usage": usage, "system_fingerprint": None}

    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model}
    decode = _decoder(server)

    def chunk(i: int, delta: dict[str, str], finish: str | None = None) -> str:
        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _sse({**head, "choices": [choice]})

    events = []
    for i, c in enumerate(outs):
        events.append(chunk(i, {"role": "assistant", "content": ""}))
        events.extend(chunk(i, {"content": piece}) for piece in text_pieces(decode, c))
        events.append(chunk(i, {}, _finish(c)))
    return _stream(events, head, usage, body)


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


def _stream(
    events: list[str], head: dict[str, Any], usage: dict[str, int], body: _Sampling
) -> StreamingResponse:
    if body.stream_options is not None and body.stream_options.include_usage:
        events.append(_sse({**head, "choices": [], "usage": usage}))
    events.append(_sse("[DONE]"))

    async def send() -> AsyncIterator[str]:
        for event in events:
            yield event

    return StreamingResponse(
        send(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
