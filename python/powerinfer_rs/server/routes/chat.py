"""/v1/chat/completions: a conversation in the model's chat template, answered with the chat
sampling of `powerinfer-rs chat` for the fields a request omits (`settings.CHAT`: llama.cpp's
temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), and ended with finish_reason "stop" when the
answer only repeats itself (the log line says so). A gpt-oss model's reasoning comes apart from
its answer, as `reasoning_content` beside `content` (`harmony`)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from ...harmony import HarmonySplit, split
from ...settings import CHAT
from ..generation import answer, chunker, open_generation, refuse_unsupported
from ..schemas import GENERATION_OK, V1_ERRORS, APIError, ChatRequest, check_text
from ..state import ServerState, authorize, server_state

router = APIRouter(dependencies=[Depends(authorize)], responses=V1_ERRORS)


def chat_prompt(state: ServerState, body: ChatRequest) -> list[int]:
    """The conversation's token ids in the model's chat template; refuses what it cannot
    render (tools, non-text parts, messages without content)."""
    engine = state.engine
    if body.tools or body.functions:
        raise APIError(400, "tools and function calling are not supported", param="tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise APIError(
            400, "only response_format {'type': 'text'} is supported", param="response_format"
        )
    if body.logprobs:
        raise APIError(400, "logprobs are not supported", param="logprobs")
    messages = []
    for i, m in enumerate(body.messages):
        # an assistant turn may come without content (it made tool calls); a request may not
        if m.content is None and m.role in ("system", "developer", "user"):
            raise APIError(
                400,
                f"messages[{i}]: a '{m.role}' message needs content",
                param=f"messages.{i}.content",
            )
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise APIError(
                    400,
                    f"messages[{i}]: only text content parts are supported",
                    param=f"messages.{i}.content",
                )
            content = "".join(p.text for p in m.content)
        else:
            content = m.content or ""
        check_text(content, f"messages.{i}.content")
        check_text(m.role, f"messages.{i}.role")
        messages.append({"role": m.role, "content": content})
    try:
        text = engine.apply_chat_template(messages)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # the template itself failed (jinja2 errors)
        raise APIError(
            400, f"the model's chat template failed on these messages: {e}", param="messages"
        ) from None
    return engine.tokenizer.encode(text, add_bos=False, special=True)


@router.post("/v1/chat/completions", responses=GENERATION_OK)
async def chat_completions(body: ChatRequest, request: Request):
    state = server_state(request)
    state.check_model(body.model)
    refuse_unsupported(body)
    if body.max_completion_tokens is not None:
        max_tokens, explicit = body.max_completion_tokens, True
    else:
        max_tokens, explicit = body.max_tokens, body.max_tokens is not None

    def setup():  # rendering and tokenizing are work: off the event loop
        return open_generation(state, body, CHAT, chat_prompt(state, body), max_tokens, explicit)

    gen = await run_in_threadpool(setup)
    chunk = chunker(
        state,
        "chat.completion.chunk",
        f"chatcmpl-{uuid.uuid4().hex}",
        body,
        lambda delta, finish: {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        },
    )

    # gpt-oss: the reasoning (its analysis channel) apart from the answer, as llama.cpp's
    # server gives them
    harmony = HarmonySplit() if state.engine.tokenizer.harmony else None

    def message(text: str) -> dict:
        return split(text) if harmony else {"content": text}

    def text_chunk(t: str) -> dict | None:
        if harmony is None:
            return chunk({"content": t}, None)
        delta: dict[str, str] = {}
        for field, part in harmony.push(t):
            delta[field] = delta.get(field, "") + part
        return chunk(delta, None) if delta else None

    def whole(text: str, reason: str) -> dict:
        out = chunk(None, reason)
        out["object"] = "chat.completion"
        out["choices"] = [
            {
                "index": 0,
                "message": {"role": "assistant", **message(text)},
                "logprobs": None,
                "finish_reason": reason,
            }
        ]
        return out

    return await answer(
        state,
        request,
        body,
        gen,
        text_chunk=text_chunk,
        end_chunk=lambda r: chunk({}, r),
        first=[chunk({"role": "assistant", "content": ""}, None)],
        whole=whole,
    )
