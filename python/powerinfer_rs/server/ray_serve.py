"""Replicas of the OpenAI server under Ray Serve (`pip install 'powerinfer-rs[ray]'`): each
replica is a Ray actor that loads its own `Engine` and serves the same FastAPI app as
`powerinfer-rs serve` (built on the replica by `create_app`, its scheduler started by the app's
lifespan), behind Ray Serve's HTTP proxy, which spreads requests over the replicas and streams
server-sent events through. Ray replaces a replica that dies.

    powerinfer-rs serve --ray --replicas 2 -t 4          # a local Ray instance, or --address
    serve run powerinfer_rs.server.ray_serve:app_builder model=/models/m.gguf replicas=2

The model is found by path on each node (the same path everywhere) or by `hf://` (each node
downloads into its own cache). Each replica asks Ray for its engine's threads as CPUs and, on a
GPU device, for one GPU; responses carry the replica's id in `X-Powerinfer-Replica`."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..settings import EngineSettings

#: The header naming the replica that answered (for tests and for following a request in logs).
REPLICA_HEADER = "x-powerinfer-replica"


def _ray_serve():
    try:
        from ray import serve
    except ImportError:
        raise ImportError(
            "Ray Serve is not installed: pip install 'powerinfer-rs[ray]' (or 'ray[serve]')"
        ) from None
    return serve


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What `create_app` takes besides the engine (see `powerinfer_rs.server.create_app`)."""

    model_id: str | None = None
    api_key: str | None = None
    slots: int = 4
    batch: bool = True
    prompt_cache: int | None = None
    n_predict: int | None = None


class _ReplicaHeader:
    """ASGI middleware: the replica's id on every HTTP response."""

    def __init__(self, app, replica: str):
        self.app = app
        self.replica = replica.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-powerinfer-replica", self.replica),
                ]
            await send(message)

        await self.app(scope, receive, send_with_header)


def _build_replica_app(engine_settings: EngineSettings, options: ServeOptions):
    """Runs on the replica: loads the engine and builds the server's app around it."""
    import logging
    import os

    from ..engine import Engine
    from .app import create_app

    logging.getLogger("powerinfer_rs.server").setLevel(logging.INFO)
    serve = _ray_serve()
    try:
        replica = serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica (no context): the process is enough to tell them apart
        replica = f"pid-{os.getpid()}"
    engine = Engine.load(settings=engine_settings)
    app = create_app(engine, **dataclasses.asdict(options))
    return _ReplicaHeader(app, replica)


def application(
    engine_settings: EngineSettings,
    options: ServeOptions | None = None,
    replicas: int | str = 1,
    max_replicas: int | None = None,
    cpus_per_replica: float | None = None,
    gpus_per_replica: float | None = None,
):
    """The Ray Serve application: `replicas` copies of the server (an int, or "auto" for
    autoscaling between 1 and `max_replicas` on the requests each replica has in flight). Each
    replica asks Ray for `cpus_per_replica` CPUs (default: the engine's threads, else 1) and
    `gpus_per_replica` GPUs (default: 1 on a CUDA device, else 0). Returns the bound
    application for `serve.run`."""
    serve = _ray_serve()
    options = options or ServeOptions()
    if not isinstance(engine_settings, EngineSettings):
        raise TypeError(
            f"engine_settings must be EngineSettings, not {type(engine_settings).__name__}"
        )
    if replicas != "auto" and (
        not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1
    ):
        raise ValueError(f"replicas must be a positive int or 'auto', got {replicas!r}")
    if max_replicas is not None and (not isinstance(max_replicas, int) or max_replicas < 1):
        raise ValueError(f"max_replicas must be a positive int, got {max_replicas!r}")
    if engine_settings.device == "emulated":
        raise ValueError("the emulated device is for tests of one process; use cpu or cuda")
    cpus = cpus_per_replica if cpus_per_replica is not None else (engine_settings.threads or 1)
    gpus = gpus_per_replica
    if gpus is None:
        gpus = 1 if engine_settings.device == "cuda" else 0
    if cpus <= 0 or gpus < 0:
        raise ValueError(
            f"cpus_per_replica must be > 0 and gpus_per_replica >= 0, got {cpus}, {gpus}"
        )

    deployment: dict[str, Any] = {
        "name": "powerinfer",
        "ray_actor_options": {"num_cpus": cpus, "num_gpus": gpus},
        # a replica takes its slots at once and queues a few more; the proxy sends the rest elsewhere
        "max_ongoing_requests": 4 * options.slots,
        "health_check_period_s": 2,
        "health_check_timeout_s": 30,
    }
    if replicas == "auto":
        deployment["autoscaling_config"] = {
            "min_replicas": 1,
            "max_replicas": max_replicas or 4,
            "target_ongoing_requests": options.slots,
        }
    else:
        deployment["num_replicas"] = replicas

    def build():
        return _build_replica_app(engine_settings, options)

    class PowerInferReplica:
        """One engine and its OpenAI server, as a Ray Serve replica."""

    ingress = serve.ingress(build)(PowerInferReplica)
    return serve.deployment(**deployment)(ingress).bind()


def app_builder(args: dict[str, str]):
    """For `serve run powerinfer_rs.server.ray_serve:app_builder key=value ...` and Ray Serve's
    config files: `model` (path or hf://), `threads`, `n_ctx`, `device`, `sparsity`,
    `replicas` (an int or "auto"), `max_replicas`, `slots`, `api_key`, `model_id`."""
    known = {
        "model",
        "threads",
        "n_ctx",
        "device",
        "sparsity",
        "replicas",
        "max_replicas",
        "slots",
        "api_key",
        "model_id",
    }
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; known: {sorted(known)}")

    def num(key: str) -> int | None:
        return int(args[key]) if args.get(key) not in (None, "") else None

    fields = {"model": args.get("model"), "threads": num("threads"), "n_ctx": num("n_ctx")}
    fields.update({k: args[k] for k in ("device", "sparsity") if args.get(k)})
    engine = EngineSettings(**fields)
    replicas = args.get("replicas", "1")
    return application(
        engine,
        ServeOptions(
            model_id=args.get("model_id"), api_key=args.get("api_key"), slots=num("slots") or 4
        ),
        replicas="auto" if replicas == "auto" else int(replicas),
        max_replicas=num("max_replicas"),
    )


def serve_with_ray(
    engine_settings: EngineSettings,
    options: ServeOptions,
    host: str = "127.0.0.1",
    port: int = 8080,
    replicas: int | str = 1,
    max_replicas: int | None = None,
    address: str | None = None,
) -> None:
    """`powerinfer-rs serve --ray`: connects to the Ray cluster at `address` (default: a local
    Ray instance started here), runs the application with Ray Serve's proxy on host:port, and
    serves until interrupted."""
    import logging
    import signal
    import sys
    import time

    import ray

    serve = _ray_serve()
    # a terminated server shuts its replicas (and the Ray instance it started) down too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log = logging.getLogger("powerinfer_rs.server")
    app = application(engine_settings, options, replicas=replicas, max_replicas=max_replicas)
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name="powerinfer", route_prefix="/")
        shown = f"[{host}]" if ":" in host else host
        log.info(
            "serving %s with %s replica(s) under Ray Serve at http://%s:%d/v1",
            engine_settings.model or "the default model",
            replicas,
            shown,
            port,
        )
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
