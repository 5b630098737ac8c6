"""/v1/completions: a text (or token ids) continued, with OpenAI's sampling defaults
(`settings.COMPLETIONS`) and no repetition guard: a raw continuation may repeat on purpose."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from ...settings import COMPLETIONS
from ..generation import answer, chunker, open_generation, refuse_unsupported
from ..schemas import GENERATION_OK, V1_ERRORS, APIError, CompletionRequest, check_text
from ..state import ServerState, authorize, server_state

router = APIRouter(dependencies=[Depends(authorize)], responses=V1_ERRORS)


def completion_prompt(state: ServerState, body: CompletionRequest) -> tuple[list[int], str]:
    """The prompt's token ids and text: one string, or one list of token ids."""
    engine, prompt = state.engine, body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise APIError(
                400, f"one prompt per request is supported, got {len(prompt)}", param="prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        return engine.tokenize(prompt), prompt
    ids = list(prompt)
    bad = [t for t in ids if not 0 <= t < engine.n_vocab]
    if bad:
        raise APIError(
            400,
            f"token id {bad[0]} is outside the vocabulary (0..{engine.n_vocab - 1})",
            param="prompt",
        )
    return ids, engine.detokenize(ids)


@router.post("/v1/completions", responses=GENERATION_OK)
async def completions(body: CompletionRequest, request: Request):
    state = server_state(request)
    state.check_model(body.model)
    refuse_unsupported(body)
    if body.logprobs:
        raise APIError(400, "logprobs are not supported", param="logprobs")
    if body.best_of not in (None, 1):
        raise APIError(400, "best_of > 1 is not supported", param="best_of")
    if body.suffix:
        raise APIError(400, "suffix (insertion) is not supported", param="suffix")
    explicit = "max_tokens" in body.model_fields_set

    def setup():  # tokenizing is work: off the event loop
        ids, text = completion_prompt(state, body)
        return open_generation(state, body, COMPLETIONS, ids, body.max_tokens, explicit), text

    gen, prompt_text = await run_in_threadpool(setup)
    echo = prompt_text if body.echo else ""
    chunk = chunker(
        state,
        "text_completion",
        f"cmpl-{uuid.uuid4().hex}",
        body,
        lambda text, finish: {
            "text": text,
            "index": 0,
            "logprobs": None,
            "finish_reason": finish,
        },
    )
    return await answer(
        state,
        request,
        body,
        gen,
        text_chunk=lambda t: chunk(t, None),
        end_chunk=lambda r: chunk("", r),
        first=[chunk(echo, None)] if echo else [],
        whole=lambda text, reason: chunk(echo + text, reason),
    )
