"""/health, /metrics and /slots (open to all: balancers and Prometheus poll them) and /v1/models
(behind the API key)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..schemas import V1_ERRORS
from ..state import ServerState, authorize, server_state

health_router = APIRouter()
router = APIRouter(dependencies=[Depends(authorize)], responses=V1_ERRORS)


def model_card(state: ServerState) -> dict:
    engine = state.engine
    return {
        "id": state.model_id,
        "object": "model",
        "created": state.created,
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


@health_router.get(
    "/health", responses={503: {"description": "the model is not loaded yet (or is shutting down)"}}
)
async def health(request: Request):
    """200 with the slots' counts once the scheduler runs; 503 before (and after) that."""
    state = server_state(request)
    if state.scheduler is None:
        return JSONResponse({"status": "loading", "model": state.model_id}, status_code=503)
    return {"status": "ok", "model": state.model_id, **state.scheduler.counts()}


@health_router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"description": "Prometheus' text format", "content": {CONTENT_TYPE_LATEST: {}}}
    },
)
async def metrics(request: Request):
    m = server_state(request).metrics
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)


@health_router.get("/slots")
async def slots(request: Request):
    """Capacity for a balancer: slots in all, busy and free, and requests waiting."""
    c = server_state(request).scheduler.counts()
    return {
        "slots_total": c["slots_total"],
        "slots_busy": c["slots_busy"],
        "slots_free": c["slots_total"] - c["slots_busy"],
        "queued": c["queued"],
    }


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [model_card(server_state(request))]}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request):
    state = server_state(request)
    state.check_model(name)
    return model_card(state)
