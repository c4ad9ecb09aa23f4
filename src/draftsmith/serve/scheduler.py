"""The scheduler: a bounded queue in front of one worker thread that interleaves requests round by round.

What it does, precisely:

- One worker thread owns the target. It keeps up to `max_active` requests *active*; each has its own KV cache,
  its own drafter state and its own seeded generator, and is advanced by `SpeculativeDecoder.rounds`, one target
  forward (a prefill or one draft -> verify -> accept round) at a time. The worker cycles over the active requests,
  one round each, so a new request starts after at most one round of every other request instead of after their
  whole answers, and every stream keeps moving.
- It does **not** batch forwards across requests: each forward is one sequence. The per-request caches have
  different lengths, and a padded batch changes the floating-point results slightly, which would break the rule
  that a T=0 answer equals the offline `draftsmith eval` answer token for token. Throughput therefore does not grow
  with concurrency; latency is shared fairly.
- Requests beyond `max_active` wait in a FIFO queue. Once `max_active + max_queue` requests are in (decoding or
  waiting), `submit` raises `Overloaded` with a Retry-After estimate, so memory stays bounded (each active request
  holds one KV cache of at most the context length). A request stops counting just before its last event goes
  out, so a client that sends its next request on receiving an answer always finds the place that answer freed.
- A cancelled request (the client went away) leaves the queue at once, or leaves the active set before its next
  round, so its slot is freed within one round.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from draftsmith.decode.engine import Generation, SpeculativeDecoder
from draftsmith.drafters.base import Drafter
from draftsmith.drafters.merged import MergedDrafter
from draftsmith.serve.metrics import ServerMetrics
from draftsmith.serve.text import TextStream
from draftsmith.target import Target


@dataclass(frozen=True)
class GenerationRequest:
    """What the engine needs for one answer, already validated against the context."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()


@dataclass
class Event:
    """One step of an answer, from the worker to the request's handler."""

    text: str  # new text to send (may be empty)
    tokens: int  # tokens generated in this step
    finish_reason: str | None = None  # set on the last event: "stop" | "length"
    error: str | None = None  # set instead when the engine failed


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    target_forwards: int = 0


INTERNAL_ERROR = "internal error; the server log has the details"


class WorkerDead(Exception):
    """The scheduler's worker thread is not running: no request can be served."""


class Overloaded(Exception):
    """The queue is full; retry after `retry_after` seconds."""

    def __init__(self, retry_after: int, queued: int) -> None:
        super().__init__(f"the server is at capacity ({queued} requests queued)")
        self.retry_after, self.queued = retry_after, queued


@dataclass(eq=False)  # a job is itself, not its fields: two identical requests are two jobs
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    usage: Usage = field(init=False)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: bool = False

    def __post_init__(self) -> None:
        self.usage = Usage(prompt_tokens=len(self.request.prompt_ids))

    def emit(self, event: Event) -> None:
        """Hand an event to the request's event loop (called from the worker thread)."""
        with contextlib.suppress(RuntimeError):  # a closed loop: the server is shutting down, nobody listens
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class _Active:
    job: Job
    steps: Iterator[Generation]
    text: TextStream
    started: float
    seen: int = 0  # tokens already turned into events
    forwards: int = 0


class Scheduler:
    def __init__(
        self,
        target: Target,
        drafter: Drafter,
        metrics: ServerMetrics,
        num_draft_tokens: int = 7,
        max_active: int = 4,
        max_queue: int = 32,
    ) -> None:
        self.target, self.template, self.metrics = target, drafter, metrics
        self.num_draft_tokens, self.max_active, self.max_queue = num_draft_tokens, max_active, max_queue
        self._pending: deque[Job] = deque()
        self._wake = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self._active_count = 0
        self._in_system = 0  # queued + active; counted down as a request ends, before its client hears of it
        self._service_seconds = 1.0  # moving average of a request's time in a slot, for Retry-After
        self._died: BaseException | None = None  # the bug that stopped the worker thread, if one did
        self._jobs: set[Job] = set()  # every job queued or decoding: told when the worker goes away
        with metrics.update():
            metrics.queue_capacity.set(max_queue)
            metrics.slots.set(max_active)

    # ---- called from the event loop -------------------------------------------------------------------------

    def check_capacity(self) -> None:
        """Raise `Overloaded` when a request would be refused: called before the request is tokenised, so a
        flood costs the server a counter check, not a tokenisation per request."""
        with self._wake:
            self._check_capacity()

    def _check_capacity(self) -> None:
        if not self.alive():
            raise WorkerDead()
        if self._in_system >= self.max_active + self.max_queue:
            with self.metrics.update():
                self.metrics.rejected.inc()
            raise Overloaded(self._retry_after(), len(self._pending))

    def alive(self) -> bool:
        """The worker thread is running (False before `start`, after `stop`, and after it died of a bug)."""
        return self._thread is not None and self._thread.is_alive() and self._died is None

    def submit(self, request: GenerationRequest) -> Job:
        job = Job(request, asyncio.get_running_loop())
        with self._wake:
            self._check_capacity()
            self._pending.append(job)
            self._jobs.add(job)
            self._in_system += 1
            with self.metrics.update():
                self.metrics.queue_depth.set(len(self._pending))
                self.metrics.prompt_tokens.inc(len(request.prompt_ids))
            self._wake.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop a queued job now, an active one before its next round."""
        if job.done:
            return
        job.cancelled.set()
        with self._wake:
            if job in self._pending:
                self._pending.remove(job)
                self._jobs.discard(job)
                self._in_system -= 1
                job.done = True
                with self.metrics.update():
                    self.metrics.queue_depth.set(len(self._pending))
                    self.metrics.finished.inc(reason="cancelled")

    def load(self) -> tuple[int, int]:
        """(active, queued) right now."""
        with self._wake:
            return self._active_count, len(self._pending)

    def _retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the queue ahead, drained `max_active` at a time."""
        waves = (len(self._pending) + 1) / self.max_active
        return max(1, min(60, math.ceil(waves * self._service_seconds)))

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._run, name="draftsmith-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the worker thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        active: list[_Active] = []
        try:
            self._loop(active)
        except BaseException as exc:  # a bug outside any one request: fail them all, /health reports it
            traceback.print_exception(exc, file=sys.stderr)
            self._died = exc
            self._shut_down(active, INTERNAL_ERROR)
            return
        self._shut_down(active)

    def _loop(self, active: list[_Active]) -> None:
        while True:
            with self._wake:
                self._publish(len(active))
                while self._running and not self._pending and not active:
                    self._wake.wait()
                if not self._running:
                    break
                admitted = [
                    self._pending.popleft() for _ in range(min(len(self._pending), self.max_active - len(active)))
                ]
                self._publish(len(active) + len(admitted))
            for job in admitted:
                try:
                    active.append(self._start(job))
                except Exception as exc:  # a bug: this request fails, the server keeps serving
                    self._fail(job, exc)
            for slot in list(active):
                if not self._step(slot):
                    active.remove(slot)

    def _publish(self, active: int) -> None:
        """Update the load figures (the caller holds `_wake`)."""
        self._active_count = active
        with self.metrics.update():
            self.metrics.queue_depth.set(len(self._pending))
            self.metrics.active.set(active)

    def _shut_down(self, active: list[_Active], reason: str = "the server is shutting down") -> None:
        """Tell every waiting and running request that the server is going away."""
        with self._wake:
            jobs, self._jobs, self._pending = list(self._jobs), set(), deque()
            self._in_system = 0
        for slot in active:
            with contextlib.suppress(Exception):
                slot.steps.close()
        for job in jobs:  # queued, decoding, or between the two when the worker died
            job.done = True
            job.emit(Event("", 0, error=reason))

    def _start(self, job: Job) -> _Active:
        req = job.request
        decoder = SpeculativeDecoder(self.target, fork_drafter(self.template), self.num_draft_tokens)
        steps = decoder.rounds(req.prompt_ids, req.max_tokens, req.temperature, req.top_p, req.seed)
        now = time.perf_counter()
        with self.metrics.update():
            self.metrics.queue_wait.observe(now - job.submitted)
        return _Active(job, steps, TextStream(self.target.tokenizer, list(req.stop)), started=now)

    def _step(self, slot: _Active) -> bool:
        """Advance one request by one target forward; False when it has left the active set."""
        job = slot.job
        if job.cancelled.is_set():
            self._finish(slot, "cancelled")
            return False
        try:
            return self._advance(slot)
        except Exception as exc:  # a bug, not a user error: the request fails, the server keeps serving
            slot.steps.close()
            self._fail(job, exc)
            return False

    def _advance(self, slot: _Active) -> bool:
        job = slot.job
        gen = next(slot.steps)
        new = gen.tokens[slot.seen :]
        slot.seen = len(gen.tokens)
        forwards, slot.forwards = gen.target_forwards - slot.forwards, gen.target_forwards
        job.usage.completion_tokens, job.usage.target_forwards = len(gen.tokens), gen.target_forwards
        text = slot.text.push(new)
        with self.metrics.update():
            if slot.seen == len(new):
                self.metrics.ttft.observe(time.perf_counter() - job.submitted)
            self.metrics.generation_tokens.inc(len(new))
            self.metrics.target_forwards.inc(forwards)
            self.metrics.acceptance.observe(len(new))
        reason = None
        if slot.text.stopped or gen.tokens[-1] in self.target.eos_token_ids:
            reason = "stop"
        elif len(gen.tokens) >= job.request.max_tokens:
            reason = "length"
        if reason is None:
            job.emit(Event(text, len(new)))
            return True
        last = Event(text + slot.text.finish(), len(new), finish_reason=reason)
        self._finish(slot, reason)  # before the answer goes out, so that the client's next request finds its place
        job.emit(last)
        return False

    def _finish(self, slot: _Active, reason: str) -> None:
        slot.steps.close()
        now = time.perf_counter()
        self._service_seconds = 0.8 * self._service_seconds + 0.2 * (now - slot.started)
        self._leave(slot.job, reason)
        if reason in ("stop", "length"):
            with self.metrics.update():
                self.metrics.e2e.observe(now - slot.job.submitted)

    def _fail(self, job: Job, exc: Exception) -> None:
        traceback.print_exception(exc, file=sys.stderr)
        self._leave(job, "error")
        job.emit(Event("", 0, error=INTERNAL_ERROR))  # the details went to the server's log, not to the client

    def _leave(self, job: Job, reason: str) -> None:
        job.done = True
        with self._wake:
            self._in_system -= 1
            self._jobs.discard(job)
        with self.metrics.update():
            self.metrics.finished.inc(reason=reason)


def fork_drafter(template: Drafter) -> Drafter:
    """A drafter of its own for one request: weights shared, per-sequence state (caches, n-gram yields) copied.

    Interleaved requests cannot share one drafter, whose state follows one sequence. Modules, targets and tensors
    at the top level are shared (a drafter's `begin` rebinds the per-sequence ones); everything else is deep-copied
    from the untouched template, so each request's drafts, and hence its samples at T>0, do not depend on which
    other requests ran before or beside it.
    """
    if isinstance(template, MergedDrafter):
        return MergedDrafter([fork_drafter(part) for part in template.parts], template.take_turns)
    shared = (torch.nn.Module, torch.Tensor, Target)
    memo = {id(v): v for v in vars(template).values() if isinstance(v, shared)}
    with torch.inference_mode():
        return copy.deepcopy(template, memo)
