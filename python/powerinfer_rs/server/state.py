"""What every route reads from `app.state.server`: the served engine and the names it goes by,
the API key, the scheduler; and the checks made with them (the API key, the model name)."""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

from fastapi import Request

from ..engine import Engine
from .metrics import Metrics
from .scheduler import Scheduler
from .schemas import APIError


def model_id_of(engine: Engine) -> str:
    """The model id clients use by default: the file name without .gguf."""
    name = os.path.basename(engine.path)
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


@dataclass
class ServerState:
    engine: Engine
    model_id: str
    api_key: str | None
    created: int  # the model file's time, as /v1/models reports it
    fingerprint: str  # system_fingerprint: what answers depend on besides the model
    n_predict: int | None = None  # the most tokens of one answer (None: up to a full context)
    scheduler: Scheduler | None = None  # started and closed by the app's lifespan
    metrics: Metrics | None = None  # /metrics' counters, fed by the request log

    def check_model(self, name: str | None) -> None:
        """Refuses a request for a model this server does not serve (none named is fine)."""
        if name is not None and name != self.model_id:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{self.model_id}'",
                param="model",
                code="model_not_found",
            )


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def authorize(request: Request) -> None:
    """The /v1/* routes' dependency: with an API key set, `Authorization: Bearer <key>`."""
    api_key = server_state(request).api_key
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
