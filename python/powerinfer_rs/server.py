"""OpenAI-compatible HTTP server (`powerinfer-rs serve`): /v1/models, /v1/completions,
/v1/chat/completions (with server-sent-event streaming) and /health, on FastAPI + uvicorn.

One Engine (one model) serves every request. Each request becomes a `Job` owning a `Generation`
(its own session and KV cache). A single scheduler thread admits jobs first come, first served
into a fixed number of slots and steps the active ones in rounds: in each round every active
generation advances by one prompt piece or one token, and the tokens of all generations past their
prompt are evaluated as one batch (the weights are read once per round, not once per client). So
all admitted clients advance at the same pace, a long answer never starves a short one, and the
compute threads work on one evaluation at a time instead of fighting over the cores. A waiting job
holds no session; a finished or abandoned one (the client disconnected) gives its session back at
once. The event loop never computes: it tokenizes in a worker thread and only moves text.

This module must not change the engine's sampling or stopping rules: it maps OpenAI's request
fields onto `Engine.stream` and its results back onto OpenAI's response shapes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import os
import threading
import time
import uuid
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import __version__
from .engine import Engine, Generation

log = logging.getLogger("powerinfer_rs.server")

# Prompt tokens evaluated per scheduler step: a long prompt is split so the other active
# generations keep streaming while it is read.
PREFILL_CHUNK = 256


class APIError(Exception):
    """An error answered with OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


# ----- request bodies (unknown fields are ignored, as OpenAI's newer clients send fields older
# servers do not know; fields we know but cannot honour are refused in `_sampling`)


class StreamOptions(BaseModel):
    include_usage: bool = False


# Fields OpenAI's reference marks nullable: an explicit null means the default.
_NULL_MEANS_DEFAULT = {
    "temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "top_k", "min_p",
    "repeat_penalty", "echo", "max_tokens", "max_completion_tokens",
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
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = 1
    stream: StrictBool = False  # "true" or 1 is a client bug, not a request to stream
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # llama.cpp's range: a signed 64-bit integer
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # llama.cpp server's extensions
    top_k: int = Field(0, ge=0, le=2**31 - 1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0)


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


# ----- scheduling


class Job:
    """One request's generation, fed by the scheduler thread and read by the event loop."""

    def __init__(self, generation: Generation, loop: asyncio.AbstractEventLoop):
        self.generation = generation
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.started = time.perf_counter()
        self._loop = loop

    async def wait_end(self, timeout: float = 120.0) -> str:
        """Waits for the scheduler to finish with this job (after `Scheduler.cancel`, at the end
        of its current step) and returns how it ended."""

        async def drain() -> str:
            while True:
                kind, value = await self.events.get()
                if kind == "end":
                    return value
                if kind == "error":
                    return "error"

        try:
            return await asyncio.wait_for(drain(), timeout)
        except TimeoutError:
            return "cancelled"

    def emit(self, kind: str, value: Any = None) -> None:
        """Queues an event for the event loop: ("text", str), ("end", reason) or ("error", exc)."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop has closed (server shutting down)
            pass


class Scheduler:
    """Admits jobs first come, first served into `slots` and steps the active ones round-robin
    (`Engine.step_many`: one prompt piece or one token each, the tokens batched)."""

    def __init__(self, engine: Engine, slots: int, batch: bool = True, cache: int | None = None):
        self.engine = engine
        self.slots = slots
        self.batch = batch
        # Finished sessions kept for their tokens' KV (most recent last): a new request whose
        # prompt starts with the same tokens (the next turn of a chat, a shared system prompt)
        # continues from one instead of evaluating its prompt again. Not on the GPU (untested).
        self.cache_size = (slots if cache is None else cache) if engine.device == "cpu" else 0
        self._cache: list[tuple[list[int], Any]] = []
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="powerinfer-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", type="server_error")
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stops a job; a waiting one leaves the queue now, an active one at the end of its step.
        Either way the job gets exactly one ("end", ...) event, as every job does."""
        with self._cond:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
                job.generation.close()
                job.emit("end", "cancelled")

    def counts(self) -> dict[str, int]:
        with self._cond:
            sessions = sum(j.generation.holds_session for j in self._active)
            return {"slots_total": self.slots, "slots_busy": len(self._active), "queued": len(self._waiting),
                    "sessions": sessions, "cached_sessions": len(self._cache)}

    def _adopt_cached(self, gen: Generation) -> None:
        """Gives `gen` the cached session sharing the longest prefix with its prompt, if any."""
        if self.cache_size == 0 or gen.done:
            return
        gen.keep_session = True
        prompt, best, best_len = gen.prompt_ids, None, 0
        for i, (tokens, _) in enumerate(self._cache):
            n = 0
            for a, b in zip(tokens, prompt[:-1]):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = i, n
        if best is not None:
            tokens, session = self._cache.pop(best)
            gen.reuse_session(session, tokens)

    def _keep(self, gen: Generation) -> None:
        """Caches the session of a generation that ended normally, dropping the oldest."""
        session, gen.finished_session = gen.finished_session, None
        if session is None or self.cache_size == 0:
            return
        with self._cond:
            self._cache.append((session.tokens, session))
            del self._cache[: max(0, len(self._cache) - self.cache_size)]
    def close(self) -> None:
        with self._cond:
            self._closed = True
            for job in list(self._waiting) + self._active:
                job.cancelled = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._active and not self._waiting:
                    self._cond.wait()
                if self._closed:
                    self._cache.clear()
                    for job in list(self._waiting) + self._active:
                        job.generation.close()
                        job.emit("end", "cancelled")
                    self._waiting.clear()
                    self._active.clear()
                    return
                while self._waiting and len(self._active) < self.slots:
                    job = self._waiting.popleft()
                    self._adopt_cached(job.generation)
                    self._active.append(job)
                round_ = list(self._active)
            finished = [j for j in round_ if j.cancelled]
            for job in finished:
                job.generation.close()
                job.emit("end", "cancelled")
            live = [j for j in round_ if not j.cancelled]
            # one step each; the generations past their prompt share one batched evaluation
            try:
                results = self.engine.step_many([j.generation for j in live], batch=self.batch)
            except Exception as e:  # a fault outside any one generation: fail this round's jobs, keep serving
                log.exception("scheduler round failed")
                results = [e] * len(live)
                for job in live:
                    job.generation.close()
            for job, result in zip(live, results):
                gen = job.generation
                if isinstance(result, Exception):  # this request fails, the others go on
                    job.emit("error", result)
                    finished.append(job)
                    continue
                if result:
                    job.emit("text", result)
                if gen.done:
                    self._keep(gen)
                    job.emit("end", gen.finish_reason)
                    finished.append(job)
            if finished:
                with self._cond:
                    self._active = [j for j in self._active if j not in finished]


# ----- the app


def _model_id(engine: Engine) -> str:
    name = os.path.basename(engine.path)
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def create_app(engine: Engine, model_id: str | None = None, api_key: str | None = None, slots: int = 4, batch: bool = True,
               prompt_cache: int | None = None) -> FastAPI:
    """The FastAPI app serving `engine` as model `model_id` (default: the file name without
    .gguf). `api_key`: require `Authorization: Bearer <api_key>` on /v1/*. `slots`: generations
    run at once (round-robin); later requests wait their turn in arrival order. `batch=False`
    evaluates each client's token separately (for comparison). `prompt_cache`: finished sessions
    kept so a later prompt with the same beginning skips evaluating it (default: `slots`; 0: none)."""
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise ValueError(f"slots must be a positive int, got {slots!r}")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string or None")
    if prompt_cache is not None and (not isinstance(prompt_cache, int) or isinstance(prompt_cache, bool) or prompt_cache < 0):
        raise ValueError(f"prompt_cache must be an int >= 0 or None, got {prompt_cache!r}")
    model_id = model_id or _model_id(engine)
    created = int(os.path.getmtime(engine.path))
    fingerprint = f"powerinfer-rs-{__version__}-{engine.sparsity}-{engine.device}"
    state: dict[str, Any] = {}

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
        _note(request, error=e.message)
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
                f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: {err.get('msg')}" for err in errors
            )
        return await on_api_error(request, APIError(400, message, param=param))

    @app.exception_handler(Exception)
    async def on_fault(request: Request, e: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return await on_api_error(request, APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

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
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            what = "missing" if not header else "invalid"
            raise APIError(401, f"{what} API key: send 'Authorization: Bearer <key>' with the key the server was started with", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_id:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{model_id}'", param="model", code="model_not_found")

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

    def prepare(body: _Sampling, prompt_ids: list[int], max_tokens: int | None, explicit: bool) -> Generation:
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
            _check_text(x, "stop")
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
            raise APIError(400, str(e), param=first if first in type(body).model_fields else None) from None
        gen.prefill_chunk = PREFILL_CHUNK
        return gen

    def refuse_unsupported(body: _Sampling) -> None:
        if body.n != 1:
            raise APIError(400, f"n={body.n} is not supported: this server returns one choice per request (n=1)", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise APIError(400, f"{name} is not supported (use repeat_penalty)", param=name)
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")

    def completion_prompt(body: CompletionRequest) -> tuple[list[int], str]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request is supported, got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            _check_text(prompt, "prompt")
            return engine.tokenize(prompt), prompt
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < engine.n_vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{engine.n_vocab - 1})", param="prompt")
        return ids, engine.detokenize(ids)

    def chat_prompt(body: ChatRequest) -> list[int]:
        if body.tools or body.functions:
            raise APIError(400, "tools and function calling are not supported", param="tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {'type': 'text'} is supported", param="response_format")
        if body.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        messages = []
        for i, m in enumerate(body.messages):
            # an assistant turn may come without content (it made tool calls); a request may not
            if m.content is None and m.role in ("system", "developer", "user"):
                raise APIError(400, f"messages[{i}]: a '{m.role}' message needs content", param=f"messages.{i}.content")
            if isinstance(m.content, list):
                if any(p.type != "text" or p.text is None for p in m.content):
                    raise APIError(400, f"messages[{i}]: only text content parts are supported", param=f"messages.{i}.content")
                content = "".join(p.text for p in m.content)
            else:
                content = m.content or ""
            _check_text(content, f"messages.{i}.content")
            _check_text(m.role, f"messages.{i}.role")
            messages.append({"role": m.role, "content": content})
        try:
            text = engine.apply_chat_template(messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # the template itself failed (jinja2 errors)
            raise APIError(400, f"the model's chat template failed on these messages: {e}", param="messages") from None
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
        rid, created_at, usage_field = f"cmpl-{uuid.uuid4().hex}", int(time.time()), _include_usage(body)
        echo = prompt_text if body.echo else ""

        def chunk(text: str, finish: str | None) -> dict:
            c = {
                "id": rid, "object": "text_completion", "created": created_at, "model": model_id,
                "system_fingerprint": fingerprint,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
            }
            if usage_field:  # streamed with include_usage: null until the last chunk
                c["usage"] = None
            return c

        if body.stream:
            first = [chunk(echo, None)] if echo else []
            return EventStream(state["scheduler"], Job(gen, asyncio.get_running_loop()),
                               lambda t: chunk(t, None), lambda r: chunk("", r), first, _include_usage(body))
        text, reason = await _run_to_end(state["scheduler"], Job(gen, asyncio.get_running_loop()), request)
        out = chunk(echo + text, reason)
        out["usage"] = _usage(gen)
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
        rid, created_at, usage_field = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), _include_usage(body)

        def chunk(delta: dict, finish: str | None) -> dict:
            c = {
                "id": rid, "object": "chat.completion.chunk", "created": created_at, "model": model_id,
                "system_fingerprint": fingerprint,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
            if usage_field:  # null until the last chunk
                c["usage"] = None
            return c

        if body.stream:
            first = [chunk({"role": "assistant", "content": ""}, None)]
            return EventStream(state["scheduler"], Job(gen, asyncio.get_running_loop()),
                               lambda t: chunk({"content": t}, None), lambda r: chunk({}, r), first, _include_usage(body))
        text, reason = await _run_to_end(state["scheduler"], Job(gen, asyncio.get_running_loop()), request)
        return {
            "id": rid, "object": "chat.completion", "created": created_at, "model": model_id,
            "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}],
            "usage": _usage(gen),
        }

    return app


def _check_text(text: str, param: str) -> None:
    """Refuses strings that are not valid Unicode (JSON allows lone surrogates like "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode: {e.reason} at position {e.start}", param=param) from None


def _include_usage(body: _Sampling) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _usage(gen: Generation) -> dict[str, Any]:
    p, c = gen.stats["prompt_tokens"], gen.stats["generated_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": gen.stats["cached_tokens"]}}


def _note(request_or_scope, **fields) -> None:
    """Adds fields to this request's log line (see `RequestLog`)."""
    scope = request_or_scope.scope if isinstance(request_or_scope, Request) else request_or_scope
    scope.setdefault("powerinfer.log", {}).update(fields)


def _note_generation(scope, gen: Generation, reason: str) -> None:
    s = gen.stats
    _note(scope, prompt_tokens=s["prompt_tokens"], cached_tokens=s["cached_tokens"], completion_tokens=s["generated_tokens"],
          decode_tps=s["decode_tps"], prefill_tps=s["prefill_tps"], finish=reason)


async def _until_disconnect(receive) -> None:
    """Returns when the client goes away; the request body has been read, nothing else matters."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _run_to_end(scheduler: Scheduler, job: Job, request: Request) -> tuple[str, str]:
    """Runs a job to its end and returns (text, finish_reason); cancels it if the client leaves."""
    scheduler.submit(job)
    watcher = asyncio.create_task(_until_disconnect(request.receive))
    pieces, reason = [], None
    try:
        while True:
            getter = asyncio.create_task(job.events.get())
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                reason = "cancelled"
                _note(request, error="client disconnected")
                return "", reason
            kind, value = getter.result()
            if kind == "text":
                pieces.append(value)
            elif kind == "error":
                reason = "error"
                raise APIError(500, f"generation failed: {value}", type="server_error")
            else:
                reason = value
                return "".join(pieces), reason
    finally:
        watcher.cancel()
        if reason not in ("stop", "length", "error"):
            scheduler.cancel(job)
            reason = await job.wait_end()
        _note_generation(request.scope, job.generation, reason)


class EventStream(Response):
    """A server-sent-event response fed by a job: `data: {chunk}` per text piece, a last chunk
    with the finish reason (and one with usage when asked), then `data: [DONE]`. It watches the
    connection itself, so a client that goes away cancels the job whatever the ASGI server's
    disconnect behaviour is."""

    media_type = "text/event-stream"

    def __init__(self, scheduler: Scheduler, job: Job, text_chunk, end_chunk, first: list[dict], include_usage: bool):
        # no Content-Length: the body's size is not known until the generation ends
        self.status_code, self.background = 200, None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self.scheduler, self.job = scheduler, job
        self.text_chunk, self.end_chunk, self.first = text_chunk, end_chunk, first
        self.include_usage = include_usage

    async def __call__(self, scope, receive, send) -> None:
        job, reason = self.job, None
        self.scheduler.submit(job)
        watcher = asyncio.create_task(_until_disconnect(receive))

        async def event(data: dict | str) -> None:
            payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
            await send({"type": "http.response.body", "body": f"data: {payload}\n\n".encode(), "more_body": True})

        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            for c in self.first:
                await event(c)
            while True:
                getter = asyncio.create_task(job.events.get())
                await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    _note(scope, error="client disconnected")
                    return
                kind, value = getter.result()
                if kind == "text":
                    await event(self.text_chunk(value))
                elif kind == "error":
                    reason = "error"
                    _note(scope, error=f"generation failed: {value}")
                    await event({"error": {"message": f"generation failed: {value}", "type": "server_error", "param": None, "code": None}})
                    break
                else:
                    reason = value
                    await event(self.end_chunk(value))
                    if self.include_usage:
                        await event({**self.end_chunk(None), "choices": [], "usage": _usage(job.generation)})
                    break
            await event("[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the connection broke while sending
            _note(scope, error="client disconnected")
        finally:
            watcher.cancel()
            if reason not in ("stop", "length", "error"):
                # the log line reports what the scheduler really did: the tokens generated until
                # it dropped the job (or the whole answer, had the job ended meanwhile)
                self.scheduler.cancel(job)
                reason = await job.wait_end()
            _note_generation(scope, job.generation, reason)


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


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8080, model_id: str | None = None,
          api_key: str | None = None, slots: int = 4, batch: bool = True, prompt_cache: int | None = None,
          log_level: str = "info") -> None:
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
        model_id or _model_id(engine), engine.architecture, engine.n_ctx, f"sparsity {engine.sparsity}", f"device {engine.device}",
        shown, bound, slots, "" if batch else ", no batching", ", API key required" if api_key else "",
    )
    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


__all__ = ["create_app", "serve", "APIError", "Scheduler", "Job"]
