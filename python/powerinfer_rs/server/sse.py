"""A job's events to the client: `run_to_end` collects the whole answer, `EventStream` sends
it as server-sent events. Both read the events through `job_events`, which watches the
connection, and finish through `settle`, which cancels a job the client left and logs it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..engine import Generation
from .scheduler import Job, Scheduler
from .schemas import APIError


def usage(gen: Generation) -> dict[str, Any]:
    p, c = gen.stats["prompt_tokens"], gen.stats["generated_tokens"]
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": gen.stats["cached_tokens"]},
    }


def note(request_or_scope, **fields) -> None:
    """Adds fields to this request's log line (see `RequestLog`)."""
    scope = request_or_scope.scope if isinstance(request_or_scope, Request) else request_or_scope
    scope.setdefault("powerinfer.log", {}).update(fields)


def note_generation(scope, gen: Generation, reason: str) -> None:
    s = gen.stats
    note(
        scope,
        prompt_tokens=s["prompt_tokens"],
        cached_tokens=s["cached_tokens"],
        completion_tokens=s["generated_tokens"],
        decode_tps=s["decode_tps"],
        prefill_tps=s["prefill_tps"],
        finish=reason,
    )
    if gen.repetition is not None:
        note(scope, repetition=gen.repetition.describe())


async def until_disconnect(receive) -> None:
    """Returns when the client goes away; the request body has been read, nothing else matters."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def job_events(job: Job, receive, scope) -> AsyncIterator[tuple[str, Any]]:
    """The job's events, ("text", str) pieces then one ("end", reason) or ("error", exc); stops
    early, noting it in the log line, when the client goes away."""
    watcher = asyncio.create_task(until_disconnect(receive))
    try:
        while True:
            getter = asyncio.create_task(job.events.get())
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                note(scope, error="client disconnected")
                return
            kind, value = getter.result()
            yield kind, value
            if kind != "text":
                return
    finally:
        watcher.cancel()


async def settle(scheduler: Scheduler, job: Job, scope, reason: str, ended: bool) -> None:
    """Ends a request's job: one that has not ended (its client left) is cancelled, and the log
    line reports what the scheduler really did, the tokens generated until it dropped the job
    (or the whole answer, had the job ended meanwhile)."""
    if not ended:
        scheduler.cancel(job)
        reason = await job.wait_end()
    note_generation(scope, job.generation, reason)


async def run_to_end(scheduler: Scheduler, job: Job, request: Request) -> tuple[str, str]:
    """Runs a job to its end and returns (text, finish_reason); cancels it if the client leaves."""
    scheduler.submit(job)
    pieces, reason, ended = [], "cancelled", False
    try:
        async with contextlib.aclosing(job_events(job, request.receive, request.scope)) as events:
            async for kind, value in events:
                if kind == "text":
                    pieces.append(value)
                    continue
                ended = True
                if kind == "error":
                    reason = "error"
                    raise APIError(500, f"generation failed: {value}", type="server_error")
                reason = value
        return ("".join(pieces) if ended else ""), reason
    finally:
        await settle(scheduler, job, request.scope, reason, ended)


class EventStream(Response):
    """A server-sent-event response fed by a job: `data: {chunk}` per text piece, a last chunk
    with the finish reason (and one with usage when asked), then `data: [DONE]`. It watches the
    connection itself, so a client that goes away cancels the job whatever the ASGI server's
    disconnect behaviour is."""

    media_type = "text/event-stream"

    def __init__(
        self,
        scheduler: Scheduler,
        job: Job,
        text_chunk,
        end_chunk,
        first: list[dict],
        include_usage: bool,
    ):
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
        job, reason, ended = self.job, "cancelled", False
        self.scheduler.submit(job)

        async def event(data: dict | str) -> None:
            payload = (
                data
                if isinstance(data, str)
                else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
            )
            await send(
                {
                    "type": "http.response.body",
                    "body": f"data: {payload}\n\n".encode(),
                    "more_body": True,
                }
            )

        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            for c in self.first:
                await event(c)
            async with contextlib.aclosing(job_events(job, receive, scope)) as events:
                async for kind, value in events:
                    if kind == "text":
                        # (None: a piece with nothing to send, such as markup)
                        if (c := self.text_chunk(value)) is not None:
                            await event(c)
                        continue
                    ended = True
                    if kind == "error":
                        reason = "error"
                        note(scope, error=f"generation failed: {value}", error_kind="server_error")
                        await event(
                            {
                                "error": {
                                    "message": f"generation failed: {value}",
                                    "type": "server_error",
                                    "param": None,
                                    "code": None,
                                }
                            }
                        )
                    else:
                        reason = value
                        await event(self.end_chunk(value))
                        if self.include_usage:
                            await event(
                                {
                                    **self.end_chunk(None),
                                    "choices": [],
                                    "usage": usage(job.generation),
                                }
                            )
            if ended:
                await event("[DONE]")
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the connection broke while sending
            note(scope, error="client disconnected")
        finally:
            await settle(self.scheduler, job, scope, reason, ended)
