"""The OpenAI request shapes we accept, their checks, and OpenAI-style error bodies.

Every way a request can be wrong becomes an `APIError` with a 4xx status and the body OpenAI clients parse:
`{"error": {"message", "type", "param", "code"}}`. Types are strict (a string where a number belongs is an error,
not silently converted). Fields we do not know are ignored, as OpenAI-compatible servers do, so clients that send
extensions keep working; fields we know but do not implement (n > 1, logprobs, penalties, ...) are refused rather
than silently ignored, because ignoring them would change what the client asked for.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from draftsmith.data.tokenize import encode_chat
from draftsmith.serve.scheduler import GenerationRequest
from draftsmith.serve.text import TOKENIZER_LOCK
from draftsmith.target import Target

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: each generated token is checked against the tail a stop could end in
MAX_MESSAGES = 1024
CHARS_PER_TOKEN = 16  # a prompt longer than context x this many characters cannot fit: refused before tokenising
SEED_RANGE = (-(2**63), 2**63 - 1)  # what torch.Generator.manual_seed accepts


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if value is None:
            return None
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise PydanticCustomError("stop_type", "expected a string or a list of strings")
        if len(items) > MAX_STOP_STRINGS or any(not s for s in items):
            raise PydanticCustomError("stop_value", f"expected 1 to {MAX_STOP_STRINGS} non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in items):
            raise PydanticCustomError("stop_length", f"expected stop strings of at most {MAX_STOP_CHARS} characters")
        return items


class CompletionRequest(_Common):
    prompt: str | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]  # a batch of one prompt is that prompt
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
            raise PydanticCustomError("batched_prompt", "batched prompts are not supported; send one per request")
        raise PydanticCustomError("prompt_type", "expected a string or a non-empty list of token ids")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        """A string, or OpenAI's list of content parts of which only text parts are supported."""
        if isinstance(value, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value
            ):
                raise PydanticCustomError("content_parts", "only text content parts ({type: text, text}) are supported")
            return "".join(p["text"] for p in value)
        return value


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)


# Known OpenAI fields this server does not implement, with the values that mean "not used".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}


def parse(model: type[_Common], payload: Any) -> Any:
    """Validate a decoded JSON body into `model`, or raise a 400 naming the first bad field."""
    if not isinstance(payload, dict):
        raise APIError(400, f"the request body must be a JSON object, found {type(payload).__name__}")
    for name, neutral in _NEUTRAL.items():
        value = payload.get(name)
        if not any(_same(value, v) for v in neutral):
            raise APIError(400, f"{name}={value!r} is not supported by this server", param=name, code="unsupported")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        found = "" if err["type"] == "missing" else f" (found {_short(err.get('input'))})"
        raise APIError(400, f"{loc}: {err['msg']}{found}", param=loc, code=err["type"]) from None


def check_size(req: _Common, target: Target) -> None:
    """Refuse a prompt whose characters alone show it cannot fit the context, before paying to tokenise it."""
    if isinstance(req, ChatRequest):
        where, chars = "messages", sum(len(m.content) for m in req.messages)
    else:
        where, chars = "prompt", len(req.prompt) if isinstance(req.prompt, str) else 0
    limit = target.context_length * CHARS_PER_TOKEN
    if chars > limit:
        raise APIError(
            400,
            f"{where}: the prompt has {chars} characters; this server takes at most {limit} "
            f"({CHARS_PER_TOKEN} per token of the {target.context_length}-token context)",
            param=where,
            code="context_length_exceeded",
        )


def to_generation(req: _Common, target: Target, default_max_tokens: int) -> GenerationRequest:
    """Token ids and sampling settings for the engine, checked against the target's vocabulary and context.
    Tokenising can take a while: the server calls this off its event loop."""
    check_size(req, target)
    if isinstance(req, ChatRequest):
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in req.messages]
        try:
            with TOKENIZER_LOCK:
                ids = encode_chat(target.tokenizer, messages)
        except TemplateError as exc:
            raise APIError(400, f"messages: the chat template refused them: {exc}", param="messages") from None
        where, max_tokens = "messages", req.max_tokens or req.max_completion_tokens
    else:
        where, max_tokens = "prompt", req.max_tokens
        if isinstance(req.prompt, str):
            with TOKENIZER_LOCK:
                ids = target.tokenizer(req.prompt)["input_ids"]
        else:
            ids = list(req.prompt)
            bad = [t for t in ids if not 0 <= t < target.vocab_size]
            if bad:
                raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary 0..{target.vocab_size - 1}")
    context = target.context_length
    if not ids:
        raise APIError(400, f"{where}: the prompt is empty (0 tokens)", param=where)
    if len(ids) >= context:
        raise APIError(
            400,
            f"{where}: the prompt has {len(ids)} tokens; the model's context is {context} tokens, which leaves no "
            "room for an answer",
            param=where,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(default_max_tokens, context - len(ids))
    elif len(ids) + max_tokens > context:
        raise APIError(
            400,
            f"max_tokens: the model's context is {context} tokens; you asked for {len(ids)} prompt tokens and "
            f"{max_tokens} new ones; lower max_tokens to at most {context - len(ids)}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return GenerationRequest(
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=secrets.randbits(31) if req.seed is None else req.seed,  # no seed: a fresh sample, as OpenAI does
        stop=tuple(req.stop or ()),
    )


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality where 0 == 0.0 but False != 0 (a bool is not a number here)."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, int | float):
        return isinstance(value, int | float) and value == neutral
    return value == neutral


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
