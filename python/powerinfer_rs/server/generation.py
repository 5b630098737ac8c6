"""What the generating routes share: a request's sampling fields turned into `SamplingSettings`
(the endpoint's defaults for what it omits), the checks that open a `Generation` for a prompt,
the builder of OpenAI's response chunks, and answering whole or as a server-sent-event stream."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request

from ..engine import Generation
from ..settings import SamplingSettings
from .scheduler import PREFILL_CHUNK, Job
from .schemas import APIError, ChatRequest, _Sampling, check_text, include_usage
from .sse import EventStream, run_to_end, usage
from .state import ServerState

# The request fields that map onto `SamplingSettings` fields of the same name; a request that
# leaves one out gets the endpoint's default.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty")


def refuse_unsupported(body: _Sampling) -> None:
    """Refuses the OpenAI fields this server cannot honour, naming them."""
    if body.n != 1:
        raise APIError(
            400,
            f"n={body.n} is not supported: this server returns one choice per request (n=1)",
            param="n",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported (use repeat_penalty)", param=name)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")


def sampling_for(body: _Sampling, defaults: SamplingSettings, max_tokens: int) -> SamplingSettings:
    """The sampling of a request: its fields, `defaults` for those it omits, at most `max_tokens`
    tokens. A ValueError names the field it refuses first."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    for x in stop:
        check_text(x, "stop")
    given = {
        name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None
    }
    return dataclasses.replace(
        defaults,
        max_tokens=max_tokens,
        seed=None if body.seed is None else body.seed % 2**64,
        stop=stop,
        **given,
    )


def open_generation(
    state: ServerState,
    body: _Sampling,
    defaults: SamplingSettings,
    prompt_ids: list[int],
    max_tokens: int | None,
    explicit: bool,
) -> Generation:
    """Checks the prompt and the token limit against the context and opens a generation (no
    compute yet). `max_tokens` None: until an end token or a full context; `explicit`: the
    client asked for that many, so a prompt leaving less room is refused, as OpenAI does. The
    server's `n_predict` caps both."""
    engine = state.engine
    n_prompt, n_ctx = len(prompt_ids), engine.n_ctx
    if n_prompt == 0:
        raise APIError(400, "the prompt is empty", param="prompt")
    if n_prompt > n_ctx:
        raise APIError(
            400,
            f"This model's maximum context length is {n_ctx} tokens. However, your prompt has {n_prompt} tokens. "
            "Please reduce the length of the prompt.",
            param="messages" if isinstance(body, ChatRequest) else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and explicit and n_prompt + max_tokens > n_ctx:
        raise APIError(
            400,
            f"This model's maximum context length is {n_ctx} tokens. However, you requested {n_prompt + max_tokens} tokens "
            f"({n_prompt} in the prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if state.n_predict is not None and (max_tokens is None or max_tokens > state.n_predict):
        max_tokens = state.n_predict  # the server's -n: an answer ends there, finish "length"
    try:
        sampling = sampling_for(body, defaults, n_ctx if max_tokens is None else max_tokens)
        gen = engine.stream(prompt_ids, **sampling.as_kwargs())
    except (ValueError, OverflowError) as e:
        first = str(e).split(" ", 1)[0]
        raise APIError(
            400, str(e), param=first if first in type(body).model_fields else None
        ) from None
    gen.prefill_chunk = PREFILL_CHUNK
    return gen


def chunker(
    state: ServerState,
    obj: str,
    rid: str,
    body: _Sampling,
    choice: Callable[[Any, str | None], dict],
) -> Callable[[Any, str | None], dict]:
    """The builder of one response's chunks: `chunk(part, finish)` is OpenAI's object `obj`
    with the single choice `choice(part, finish)`; with include_usage a stream's chunks carry
    "usage": null until the last (the caller fills it in a whole response)."""
    created_at, usage_field = int(time.time()), include_usage(body)

    def chunk(part: Any, finish: str | None) -> dict:
        c = {
            "id": rid,
            "object": obj,
            "created": created_at,
            "model": state.model_id,
            "system_fingerprint": state.fingerprint,
            "choices": [choice(part, finish)],
        }
        if usage_field:
            c["usage"] = None
        return c

    return chunk


async def answer(
    state: ServerState,
    request: Request,
    body: _Sampling,
    gen: Generation,
    text_chunk: Callable[[str], dict | None],
    end_chunk: Callable[[str | None], dict],
    first: list[dict],
    whole: Callable[[str, str], dict],
):
    """Runs `gen` through the scheduler: as server-sent events when the request streams
    (`first`, then `text_chunk` per piece unless it gives None, `end_chunk` with the finish
    reason), else the object `whole(text, finish_reason)` with its usage."""
    job = Job(gen, asyncio.get_running_loop())
    if body.stream:
        return EventStream(state.scheduler, job, text_chunk, end_chunk, first, include_usage(body))
    text, reason = await run_to_end(state.scheduler, job, request)
    out = whole(text, reason)
    out["usage"] = usage(gen)
    return out
