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

This package must not change the engine's sampling or stopping rules: it maps OpenAI's request
fields onto `Engine.stream` (with each endpoint's defaults from `settings`) and its results back
onto OpenAI's response shapes.

Modules: `schemas` (request bodies and the error type), `state` (what the routes share, on
`app.state.server`, and the API key check), `generation` (a request's sampling, the prompt checks
that open a generation, response chunks), `routes` (`models`, `completions`, `chat`), `errors`
(errors in OpenAI's shape), `scheduler` (jobs, the scheduler thread and its prompt cache), `sse`
(a job's events to the client, whole or as a server-sent-event stream), `app` (`create_app`, the
request log line, and `serve`).
"""

from .app import create_app, serve
from .scheduler import PREFILL_CHUNK, Job, Scheduler
from .schemas import APIError

__all__ = ["create_app", "serve", "APIError", "Scheduler", "Job", "PREFILL_CHUNK"]
