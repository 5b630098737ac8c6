"""The FastAPI app: OpenAI's routes (/v1/models, /v1/completions, /v1/chat/completions),
/health, errors in OpenAI's shape, the API key, the per-request log line, and `serve`."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine import Engine, Generation
from .scheduler import PREFILL_CHUNK, Job, Scheduler
from .schemas import APIError, ChatRequest, CompletionRequest, _Sampling, check_text, include_usage
from .sse import EventStream, note, run_to_end, usage

log = logging.getLogger("powerinfer_rs.server")


def _model_id(engine: Engine) -> str:
    name = os.path.basename(engine.path)
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def create_app(
    engine: Engine,
    model_id: str | None = None,
    api_key: str | None = None,
    slots: int = 4,
    batch: bool = True,
    prompt_cache: int | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` as model `model_id` (default: the file name without
    .gguf). `api_key`: require `Authorization: Bearer <api_key>` on /v1/*. `slots`: generations
    run at once (round-robin); later requests wait their turn in arrival order. `batch=False`
    evaluates each client's token separately (for comparison). `prompt_cache`: finished sessions
    kept so a later prompt with the same beginning skips evaluating it (default: `slots`; 0: none)."""
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise ValueError(f"slots must be a positive int, got {slots!r}")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string or None")
    if prompt_cache is not None and (
        not isinstance(prompt_cache, int) or isinstance(prompt_cache, bool) or prompt_cache < 0
    ):
        raise ValueError(f"prompt_cache must be an int >= 0 or None, got {prompt_cache!r}")
    model_id = model_id or _model_id(engine)
    created = int(os.path.getmtime(engine.path))
    fingerprint = f"powerinfer-rs-{__version__}-{engine.sparsity}-{engine.device}"
    state: dict[str, Any] = {}

    def chunker(
        obj: str, rid: str, body: _Sampling, choice: Callable[[Any, str | None], dict]
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
                "model": model_id,
                "system_fingerprint": fingerprint,
                "choices": [choice(part, finish)],
            }
            if usage_field:
                c["usage"] = None
            return c

        return chunk

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state["scheduler"] = Scheduler(engine, slots, batch, prompt_cache)
        yield
        await asyncio.to_thread(state["scheduler"].close)

    app = FastAPI(title="powerinfer-rs", version=__version__, lifespan=lifespan)
    app.add_middleware(RequestLog)

    # ----- errors in OpenAI's shape

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        note(request, error=e.message)
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            param = None
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error') or first.get('msg')}"
        else:
            message = "; ".join(
                f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: {err.get('msg')}"
                for err in errors
            )
        return await on_api_error(request, APIError(400, message, param=param))

    @app.exception_handler(Exception)
    async def on_fault(request: Request, e: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return await on_api_error(
            request, APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
        )

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, e: StarletteHTTPException):
        code = "not_found" if e.status_code == 404 else None
        return await on_api_error(request, APIError(e.status_code, str(e.detail), code=code))

    # ----- auth and model

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            what = "missing" if not header else "invalid"
            raise APIError(
                401,
                f"{what} API key: send 'Authorization: Bearer <key>' with the key the server was started with",
                code="invalid_api_key",
            )

    def check_model(name: str | None) -> None:
        if name is not None and name != model_id:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{model_id}'",
                param="model",
                code="model_not_found",
            )

    def model_card() -> dict:
        return {
            "id": model_id,
            "object": "model",
            "created": created,
            "owned_by": "powerinfer-rs",
            "meta": {
                "architecture": engine.architecture,
                "n_ctx": engine.n_ctx,
                "n_vocab": engine.n_vocab,
                "n_layer": engine.n_layer,
                "sparsity": engine.sparsity,
                "device": engine.device,
            },
        }

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, **state["scheduler"].counts()}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorize)])
    async def get_model(name: str):
        check_model(name)
        return model_card()

    # ----- generation

    def prepare(
        body: _Sampling, prompt_ids: list[int], max_tokens: int | None, explicit: bool
    ) -> Generation:
        """Checks the prompt against the context and opens a generation (no compute yet)."""
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
        # without a limit, generation runs until an end token or a full context (the engine stops there)
        limit = n_ctx if max_tokens is None else max_tokens
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        for x in stop:
            check_text(x, "stop")
        try:
            gen = engine.stream(
                prompt_ids,
                max_tokens=limit,
                temperature=body.temperature,
                top_k=body.top_k,
                top_p=body.top_p,
                min_p=body.min_p,
                repeat_penalty=body.repeat_penalty,
                seed=None if body.seed is None else body.seed % 2**64,
                stop=stop,
            )
        except (ValueError, OverflowError) as e:
            first = str(e).split(" ", 1)[0]
            raise APIError(
                400, str(e), param=first if first in type(body).model_fields else None
            ) from None
        gen.prefill_chunk = PREFILL_CHUNK
        return gen

    def refuse_unsupported(body: _Sampling) -> None:
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

    def completion_prompt(body: CompletionRequest) -> tuple[list[int], str]:
        prompt = body.prompt
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

    def chat_prompt(body: ChatRequest) -> list[int]:
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

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        refuse_unsupported(body)
        if body.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported", param="best_of")
        if body.suffix:
            raise APIError(400, "suffix (insertion) is not supported", param="suffix")
        explicit = "max_tokens" in body.model_fields_set

        def setup():
            ids, text = completion_prompt(body)
            return prepare(body, ids, body.max_tokens, explicit), text

        gen, prompt_text = await run_in_threadpool(setup)
        echo = prompt_text if body.echo else ""
        chunk = chunker(
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

        if body.stream:
            first = [chunk(echo, None)] if echo else []
            return EventStream(
                state["scheduler"],
                Job(gen, asyncio.get_running_loop()),
                lambda t: chunk(t, None),
                lambda r: chunk("", r),
                first,
                include_usage(body),
            )
        text, reason = await run_to_end(
            state["scheduler"], Job(gen, asyncio.get_running_loop()), request
        )
        out = chunk(echo + text, reason)
        out["usage"] = usage(gen)
        return out

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body.model)
        refuse_unsupported(body)
        if body.max_completion_tokens is not None:
            max_tokens, explicit = body.max_completion_tokens, True
        else:
            max_tokens, explicit = body.max_tokens, body.max_tokens is not None

        def setup():
            return prepare(body, chat_prompt(body), max_tokens, explicit)

        gen = await run_in_threadpool(setup)
        chunk = chunker(
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

        if body.stream:
            first = [chunk({"role": "assistant", "content": ""}, None)]
            return EventStream(
                state["scheduler"],
                Job(gen, asyncio.get_running_loop()),
                lambda t: chunk({"content": t}, None),
                lambda r: chunk({}, r),
                first,
                include_usage(body),
            )
        text, reason = await run_to_end(
            state["scheduler"], Job(gen, asyncio.get_running_loop()), request
        )
        out = chunk(None, reason)
        out["object"] = "chat.completion"
        out["choices"] = [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
        ]
        out["usage"] = usage(gen)
        return out

    return app


class RequestLog:
    """ASGI middleware: one log line per request when it ends (streams included): method, path,
    status, and for generations the token counts and speeds."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = [0]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            f = scope.get("powerinfer.log", {})
            line = f"{scope['method']} {scope['path']} {status[0] or '-'} {time.perf_counter() - t0:.2f}s"
            if "prompt_tokens" in f:
                cached = f"{f['cached_tokens']} cached, " if f["cached_tokens"] else ""
                line += (
                    f" prompt={f['prompt_tokens']} tok ({cached}{f['prefill_tps']:.1f} tok/s)"
                    f" completion={f['completion_tokens']} tok ({f['decode_tps']:.1f} tok/s) finish={f['finish']}"
                )
            if "error" in f:
                line += f" error={f['error']!r}"
            log.info(line)


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_id: str | None = None,
    api_key: str | None = None,
    slots: int = 4,
    batch: bool = True,
    prompt_cache: int | None = None,
    log_level: str = "info",
) -> None:
    """Serves `engine` until interrupted. Binds first, then prints the address it listens on
    (with the real port when `port` is 0)."""
    import socket

    import uvicorn

    app = create_app(engine, model_id, api_key, slots, batch, prompt_cache)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    log.info(
        "serving %s (%s, n_ctx %d, %s, %s) at http://%s:%d/v1 with %d slot(s)%s%s",
        model_id or _model_id(engine),
        engine.architecture,
        engine.n_ctx,
        f"sparsity {engine.sparsity}",
        f"device {engine.device}",
        shown,
        bound,
        slots,
        "" if batch else ", no batching",
        ", API key required" if api_key else "",
    )
    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
