"""OpenAI-compatible routes: `GET /v1/models`, `GET /v1/models/{model}`,
`POST /v1/completions` and `POST /v1/chat/completions`, with the tenant's API key.

Model names are described in `marlaas.service.models_catalog`: `base`, `<job id>` (the
job's latest adapter) and `<job id>:ckpt-<step>`.

Wire shapes follow OpenAI's API (`service.openai_schemas`); they are separate from the
engine's records and converted explicitly here. Errors on these routes (authentication,
validation, unknown models) answer in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`; invalid parameters are 400 with
`param` naming the field. Unsupported options (log-probs, echo, suffix, penalties,
logit bias, tools, best_of != n) answer 400 instead of being silently ignored; unknown
fields are ignored.

Chat prompts go through the tokenizer's chat template when it has one, else through
the plain format of `chat_prompt` (the embedded base has no template).

Streaming (`stream: true`) answers server-sent events as `service.openai_stream`
describes; the routes here only word each chunk.

Every generation is admitted first (`service.inference`): its size against the engine's
rows and the tenant's `max_inference_tokens` (400), then one of the tenant's
`max_inference_requests` slots (429), held until the generation ends. Prompts are
tokenized off the event loop, and a client that disconnects has its requests aborted.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute

from marlaas.service.api.deps import AUTH_ERRORS, TenantCaller, responses, tenant_id
from marlaas.service.errors import ServiceError
from marlaas.service.inference import InferenceHub, InferenceServer
from marlaas.service.inference_limits import (
    BadInferenceRequest,
    check_request_size,
    unless_disconnected,
)
from marlaas.service.models_catalog import ServedModel
from marlaas.service.openai_schemas import (
    DEFAULT_CHAT_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    error_body,
    usage_of,
)
from marlaas.service.openai_stream import Chunks, sse, stream_answer
from marlaas.types import Completion

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# -- errors ---------------------------------------------------------------------------


def openai_error(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
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
                return openai_error(e.status_code, str(e), headers=getattr(e, "headers", None))

        return answer


# -- request schemas ------------------------------------------------------------------
# -- conversion -----------------------------------------------------------------------


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Text to token ids as the pipeline encodes text prompts (BOS as the tokenizer
    expects, no other special tokens)."""
    from marlaas.model.chat import encode_text  # torch and transformers: on first use

    return encode_text(tokenizer, text)


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[tuple[str, str]]
) -> tuple[list[int], tuple[str, ...]]:
    """Token ids of a chat prompt and the default stop strings of its reply
    (`marlaas.model.chat.chat_prompt`: the template, else the plain format)."""
    from marlaas.model.chat import chat_prompt as render  # transformers: on first use

    return render(tokenizer, messages)


def _finish(completion: Completion) -> str:
    return "length" if completion.finish_reason == "length" else "stop"


def _model_card(m: ServedModel, owner: str) -> dict[str, Any]:
    created = int(m.created.timestamp()) if m.created is not None else 0
    return {"id": m.name, "object": "model", "created": created, "owned_by": owner}


# -- routes ---------------------------------------------------------------------------


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    hub = app.state.context.inference_hub()
    app.state.inference_hub = hub
    try:
        yield
    finally:
        await hub.close()


router = APIRouter(
    prefix="/v1",
    tags=["openai"],
    route_class=OpenAIRoute,
    lifespan=lifespan,
    responses={**AUTH_ERRORS, **responses({404: "No such model (or not yours)."})},
)
#: What a generation may answer besides 200 (OpenAI's error shape).
_GENERATION = responses(
    {
        400: "An invalid or unsupported parameter (`param` names it), or a request larger "
        "than the engine's rows or the tenant's max_inference_tokens.",
        413: "The body is larger than this service's limit.",
        429: "The tenant has max_inference_requests requests in flight.",
        503: "The engine cannot serve now (closed, or every adapter slot in use).",
    }
)


def inference_hub(request: Request) -> InferenceHub:
    """The app's serving state (also the OpenAI fine-tuning routes' judge models)."""
    hub: InferenceHub | None = getattr(request.app.state, "inference_hub", None)
    if hub is None:  # the app runs without its lifespan: an engine it never closes
        hub = request.app.state.inference_hub = request.app.state.context.inference_hub()
    return hub


async def _server(request: Request) -> InferenceServer:
    return await inference_hub(request).server()


async def _admit(
    request: Request, caller: TenantCaller, prompts: int, n: int, max_tokens: int
) -> Callable[[], None]:
    """Admit a generation of `prompts` x `n` completions of up to `max_tokens` each
    (see the module docstring); returns the release of its slot."""
    hub = inference_hub(request)
    quotas = await hub.quotas(tenant_id(caller))
    max_rows = request.app.state.context.settings.max_batch_rows
    check_request_size(prompts, n, max_tokens, quotas, max_rows)
    return hub.slots.take(tenant_id(caller), quotas)


async def _holding(
    release: Callable[[], None], answer: Awaitable[dict[str, Any] | StreamingResponse]
) -> dict[str, Any] | StreamingResponse:
    """`answer` while holding its request slot: released when it is ready or fails; a
    stream releases its slot itself, when its generation ends."""
    try:
        out = await answer
    except BaseException:
        release()
        raise
    if not isinstance(out, StreamingResponse):
        release()
    return out


@router.get("/models")
async def list_models(request: Request, caller: TenantCaller) -> dict[str, Any]:
    """The caller's models: `base`, and per job with a checkpoint (or training now) its
    latest adapter (`<job id>`) and each checkpoint (`<job id>:ckpt-<step>`)."""
    models = await inference_hub(request).models(tenant_id(caller))
    owner = caller.tenant_name or "tenant"
    return {
        "object": "list",
        "data": [_model_card(m, "marlaas" if m.job_id is None else owner) for m in models],
    }


@router.get("/models/{model:path}")
async def get_model(model: str, request: Request, caller: TenantCaller) -> dict[str, Any]:
    found = await inference_hub(request).resolve(tenant_id(caller), model)
    owner = "marlaas" if found.job_id is None else caller.tenant_name or "tenant"
    return _model_card(found, owner)


@router.post("/completions", response_model=None, responses=_GENERATION)
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
    items = _prompt_items(body.prompt)
    max_tokens = body.max_tokens or 16
    release = await _admit(request, caller, len(items), n, max_tokens)
    return await _holding(release, _complete(body, request, caller, items, n, max_tokens, release))


async def _complete(
    body: CompletionRequest,
    request: Request,
    caller: TenantCaller,
    items: list[Any],
    n: int,
    max_tokens: int,
    release: Callable[[], None],
) -> dict[str, Any] | StreamingResponse:
    server = await _server(request)
    served = await server.resolve(tenant_id(caller), body.model)
    prompts = await asyncio.to_thread(_encode_prompts, items, server)
    sampling = body.sampling(max_tokens)
    rid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": body.model}

    if body.stream:

        def piece(i: int, text: str) -> str:
            choice = {"index": i, "text": text, "logprobs": None, "finish_reason": None}
            return sse({**head, "choices": [choice]})

        def finish(i: int, c: Completion) -> str:
            last = {"index": i, "text": "", "logprobs": None, "finish_reason": _finish(c)}
            return sse({**head, "choices": [last]})

        chunks = Chunks(head, piece, finish)
        return await stream_answer(
            server, served, prompts, sampling, n, body, chunks, request.receive, release
        )

    outs = await unless_disconnected(request.receive, server.generate(served, prompts, sampling, n))
    choices = [
        {"index": i, "text": c.text, "logprobs": None, "finish_reason": _finish(c)}
        for i, c in enumerate(outs)
    ]
    usage = usage_of(prompts, outs)
    return {**head, "choices": choices, "usage": usage, "system_fingerprint": None}


@router.post("/chat/completions", response_model=None, responses=_GENERATION)
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
    max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    release = await _admit(request, caller, 1, n, max_tokens)
    return await _holding(release, _chat(body, request, caller, messages, n, max_tokens, release))


async def _chat(
    body: ChatRequest,
    request: Request,
    caller: TenantCaller,
    messages: Sequence[tuple[str, str]],
    n: int,
    max_tokens: int,
    release: Callable[[], None],
) -> dict[str, Any] | StreamingResponse:
    server = await _server(request)
    served = await server.resolve(tenant_id(caller), body.model)
    tokenizer = server.provider.tokenizer
    prompt, default_stops = await asyncio.to_thread(chat_prompt, tokenizer, messages)
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
            return sse({**head, "choices": [choice]})

        chunks = Chunks(
            head,
            piece=lambda i, text: chunk(i, {"content": text}),
            finish=lambda i, c: chunk(i, {}, _finish(c)),
            opening=lambda i: chunk(i, {"role": "assistant", "content": ""}),
        )
        return await stream_answer(
            server, served, [prompt], sampling, n, body, chunks, request.receive, release
        )

    outs = await unless_disconnected(
        request.receive, server.generate(served, [prompt], sampling, n)
    )
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
    usage = usage_of([prompt], outs)
    return {**head, "choices": choices, "usage": usage, "system_fingerprint": None}


def _prompt_items(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """The request's prompts, each a string or a list of token ids."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise BadInferenceRequest("prompt is empty", "prompt")
    return items


def _encode_prompts(items: list[Any], server: InferenceServer) -> list[list[int]]:
    """Token ids of each prompt (blocking: run off the event loop)."""
    tokenizer = server.provider.tokenizer
    out = [encode(tokenizer, p) if isinstance(p, str) else list(p) for p in items]
    if any(not ids for ids in out):
        raise BadInferenceRequest("prompt is empty; give at least one token", "prompt")
    return out
