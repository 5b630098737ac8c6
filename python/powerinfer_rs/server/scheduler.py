"""Jobs and the scheduler thread: admission into slots, rounds of batched steps, and the
prompt cache of finished sessions."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any

from ..engine import Engine, Generation
from .schemas import APIError

log = logging.getLogger("powerinfer_rs.server")

# Prompt tokens evaluated per scheduler step: a long prompt is split so the other active
# generations keep streaming while it is read.
PREFILL_CHUNK = 256


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
        # continues from one instead of evaluating its prompt again.
        self.cache_size = slots if cache is None else cache
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
            return {
                "slots_total": self.slots,
                "slots_busy": len(self._active),
                "queued": len(self._waiting),
                "sessions": sessions,
                "cached_sessions": len(self._cache),
            }

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
            except (
                Exception
            ) as e:  # a fault outside any one generation: fail this round's jobs, keep serving
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
