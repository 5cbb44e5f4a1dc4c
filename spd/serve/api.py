"""The OpenAI request bodies this server reads, checked the way OpenAI checks them, and its error answers.

Status codes: 400 for a body that is not JSON or has a wrong type, an out-of-range value or an argument OpenAI does
not know (OpenAI's own rule); 401 for a missing or wrong API key; 404 for an unknown route or model; 413 for a prompt
that leaves no room in the context window for max_tokens; 422 for a valid OpenAI request this server cannot do
(n > 1, logprobs, penalties, a method or W the loaded configuration does not run); 429 when the queue is full;
500 when the decode failed; 503 while shutting down."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

# OpenAI arguments that are valid but change nothing here only at their neutral value
NEUTRAL = {"frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
           "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
           "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
           "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
           "parallel_tool_calls": (None, False, True), "audio": (None,), "modalities": (None, ["text"]),
           "prediction": (None,)}
# OpenAI arguments that only describe the caller or the service: accepted, ignored
IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
           "reasoning_effort", "verbosity")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Optional[StrictBool] = None


class Sampling(BaseModel):
    """What both endpoints share. None = the server's configured value (`spd-infer serve temperature=...`)."""
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(None, ge=-1)         # vLLM's extension; -1 or 0 = off
    seed: Optional[StrictInt] = Field(None, ge=0, lt=2 ** 63)
    stop: Optional[Union[str, list[str]]] = None
    n: Optional[StrictInt] = Field(None, ge=1, le=128)
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    method: Optional[str] = None                             # the suite's: the loaded method, or "ar"
    W: Optional[StrictInt] = Field(None, ge=1)               # the suite's: draft-tree width; must be the server's W
    # valid OpenAI arguments, refused unless neutral (NEUTRAL) or ignored (IGNORED)
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    logprobs: Optional[Union[StrictBool, StrictInt]] = None
    top_logprobs: Optional[StrictInt] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None and len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    def refuse_unsupported(self) -> None:
        """422 for an argument this server cannot honour."""
        if (self.n or 1) != 1:
            raise ApiError(422, f"n={self.n}: this server decodes one choice per request; use n=1", param="n")
        for name, neutral in NEUTRAL.items():
            value = getattr(self, name, None)
            if value not in neutral:
                raise ApiError(422, f"{name}={value!r} is not supported by this server; drop it", param=name)


class CompletionBody(Sampling):
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(16, ge=1)        # OpenAI's default for completions
    echo: Optional[bool] = None
    best_of: Optional[StrictInt] = None
    suffix: Optional[str] = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None
    parallel_tool_calls: Optional[bool] = None
    audio: Optional[Any] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[Any] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None


def validation_error(errors: list[dict]) -> ApiError:
    """pydantic's first complaint as OpenAI words it."""
    first = errors[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {where}", param=where)
    if first.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON", code="invalid_json")
    if first.get("type") == "missing":
        return ApiError(400, f"Missing required parameter: '{where}'", param=where)
    message = first.get("msg", "invalid value")
    return ApiError(400, f"Invalid value for '{where}': {message}" if where else message, param=where or None)
