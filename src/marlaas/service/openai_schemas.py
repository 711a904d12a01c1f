"""Wire shapes of the OpenAI-compatible routes (`service.openai_api`): the request
bodies, OpenAI's error object and the usage object.

These schemas follow OpenAI's API and are separate from the engine's records; the
routes convert between them explicitly. Unknown fields are ignored; union fields fail
with one clear message each. Checks that pydantic cannot express (stop sequences,
unsupported options) raise `BadInferenceRequest` naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from marlaas.config.specs import Float, Int, integer_only, number_only
from marlaas.service.inference_limits import BadInferenceRequest
from marlaas.types import Completion, SamplingParams

MAX_N = 16
MAX_STOP = 4
MAX_TOKENS = 32768

# Bounded numbers that refuse booleans and strings (bounds before the validator, so the
# JSON schema states them; see `config.specs.Seed`).
Temperature = Annotated[float, Field(ge=0.0, le=2.0), BeforeValidator(number_only)]
TopP = Annotated[float, Field(gt=0.0, le=1.0), BeforeValidator(number_only)]
Choices = Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(integer_only)]
Seed64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1), BeforeValidator(integer_only)]
Tokens = Annotated[int, Field(ge=1, le=MAX_TOKENS), BeforeValidator(integer_only)]


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


# -- usage ----------------------------------------------------------------------------


def usage_of(prompts: Sequence[Sequence[int]], outs: Sequence[Completion]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, whatever n
    completion_tokens = sum(len(c.token_ids) for c in outs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


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


class SamplingRequest(_Request):
    model: str = Field(min_length=1, max_length=200)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Choices | None = None
    stop: str | list[str] | None = None

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _union(value, handler, "a string, a list of strings or null")

    seed: Seed64 | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
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


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Tokens | None = 16
    echo: bool | None = False
    logprobs: Int | None = None
    best_of: Int | None = None
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


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    logprobs: bool | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


DEFAULT_CHAT_MAX_TOKENS = 256
