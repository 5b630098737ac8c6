"""The FastAPI app: `create_app` puts the shared state (`state.ServerState`) on `app.state`,
starts the scheduler with the app, and mounts the routes (`routes`: the API, and the chat page
at `/`), the OpenAI-shaped error handlers (`errors`) and the per-request log line
(`RequestLog`); `serve` runs it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from fastapi import FastAPI

from .. import __version__
from ..engine import Engine
from .errors import install_error_handlers
from .metrics import Metrics
from .routes import chat, completions, models, page
from .scheduler import Scheduler
from .state import ServerState, model_id_of

log = logging.getLogger("powerinfer_rs.server")


def _check_int(name: str, value, least: int, what: str) -> None:
    """ValueError naming `name` unless `value` is an int (not a bool) of at least `least`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def create_app(
    engine: Engine,
    model_id: str | None = None,
    api_key: str | None = None,
    slots: int = 4,
    batch: bool = True,
    prompt_cache: int | None = None,
    n_predict: int | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` as model `model_id` (default: the file name without
    .gguf). `api_key`: require `Authorization: Bearer <api_key>` on /v1/*. `slots`: generations
    run at once (round-robin); later requests wait their turn in arrival order. `batch=False`
    evaluates each client's token separately (for comparison). `prompt_cache`: finished sessions
    kept so a later prompt with the same beginning skips evaluating it (default: `slots`; 0: none).
    `n_predict`: the most tokens one answer has, for a request that names none and one that names
    more (as llama.cpp's server's `-n`; default None: OpenAI's rule, until an end token or a full
    context)."""
    _check_int("slots", slots, 1, "a positive int")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string or None")
    if prompt_cache is not None:
        _check_int("prompt_cache", prompt_cache, 0, "an int >= 0 or None")
    if n_predict is not None:
        _check_int("n_predict", n_predict, 1, "an int >= 1 or None")
    state = ServerState(
        engine=engine,
        model_id=model_id or model_id_of(engine),
        api_key=api_key,
        created=int(os.path.getmtime(engine.path)),
        fingerprint=f"powerinfer-rs-{__version__}-{engine.sparsity}-{engine.device}",
        n_predict=n_predict,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler = Scheduler(engine, slots, batch, prompt_cache)
        yield
        await asyncio.to_thread(state.scheduler.close)

    app = FastAPI(title="powerinfer-rs", version=__version__, lifespan=lifespan)
    app.state.server = state
    state.metrics = Metrics(lambda: state.scheduler.counts() if state.scheduler else {})
    app.add_middleware(RequestLog, metrics=state.metrics)
    install_error_handlers(app)
    app.include_router(models.health_router)
    app.include_router(models.router)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(page.router)
    return app


class RequestLog:
    """ASGI middleware: one log line per request when it ends (streams included): method, path,
    status, and for generations the token counts and speeds."""

    def __init__(self, app, metrics: Metrics | None = None):
        self.app = app
        self.metrics = metrics

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
            seconds = time.perf_counter() - t0
            if self.metrics is not None:
                self.metrics.record(scope["path"], status[0], seconds, f)
            line = f"{scope['method']} {scope['path']} {status[0] or '-'} {seconds:.2f}s"
            if "prompt_tokens" in f:
                cached = f"{f['cached_tokens']} cached, " if f["cached_tokens"] else ""
                line += (
                    f" prompt={f['prompt_tokens']} tok ({cached}{f['prefill_tps']:.1f} tok/s)"
                    f" completion={f['completion_tokens']} tok ({f['decode_tps']:.1f} tok/s) finish={f['finish']}"
                )
            if "repetition" in f:
                line += f" (stopped repeating itself: {f['repetition']})"
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
    n_predict: int | None = None,
    log_level: str = "info",
) -> None:
    """Serves `engine` until interrupted. Binds first, then prints the address it listens on
    (with the real port when `port` is 0)."""
    import socket

    import uvicorn

    app = create_app(engine, model_id, api_key, slots, batch, prompt_cache, n_predict)
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
        model_id or model_id_of(engine),
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
