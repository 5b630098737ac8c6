"""The server's request bodies (pydantic) and its error type, in OpenAI's shapes."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator


class APIError(Exception):
    """An error answered with OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=headers)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """What every error answers (OpenAI's shape)."""

    error: ErrorBody


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


#: The error statuses every /v1 route may answer, for the OpenAPI schema (`/openapi.json`).
V1_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error("an invalid request: the message and `param` name the problem"),
    401: _error("no or a wrong API key (`--api-key`)"),
    404: _error("a model this server does not serve"),
    500: _error("an internal error"),
}

#: A generation's 200: JSON, or server-sent events with `"stream": true`.
GENERATION_OK: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the completion, or with `stream` its chunks as server-sent events",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}


# ----- request bodies (unknown fields are ignored, as OpenAI's newer clients send fields older
# servers do not know; fields we know but cannot honour are refused by the routes)


class StreamOptions(BaseModel):
    include_usage: bool = False


# Fields OpenAI's reference marks nullable: an explicit null means the default.
_NULL_MEANS_DEFAULT = {
    "temperature",
    "top_p",
    "n",
    "stream",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repeat_penalty",
    "echo",
    "max_tokens",
    "max_completion_tokens",
}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _NULL_MEANS_DEFAULT)}
        return data

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    # sampling: None (left out) takes the endpoint's default (`settings.COMPLETIONS`, `settings.CHAT`)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = 1
    stream: StrictBool = False  # "true" or 1 is a client bug, not a request to stream
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(
        None, ge=-(2**63), le=2**63 - 1
    )  # llama.cpp's range: a signed 64-bit integer
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # llama.cpp server's extensions
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


#: The roles of OpenAI's chat messages.
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: ChatRole
    content: str | list[TextPart] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None


def check_text(text: str, param: str) -> None:
    """Refuses strings that are not valid Unicode (JSON allows lone surrogates like "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            400, f"{param} is not valid Unicode: {e.reason} at position {e.start}", param=param
        ) from None


def include_usage(body: _Sampling) -> bool:
    """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
    return bool(body.stream_options and body.stream_options.include_usage)
