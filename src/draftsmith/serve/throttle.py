"""Answer a client that keeps sending requests the server refuses ever more slowly.

Refusing a bad request is cheap but not free: its body is read and parsed on the event loop, under the GIL the
decoding thread also needs. A client in a loop of bad requests (megabyte bodies of stop strings over the cap, say)
is answered at once and comes straight back, so it takes the CPU from every other client's decoding. Holding back
its 4xx answers bounds a sequential client to about 1 / `most` bad requests a second; its good requests, and
other clients' requests, are never held. Clients are told apart by address, as nginx's `limit_req` does.
"""

from __future__ import annotations

import asyncio
import math
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ErrorScore:
    """Per client, the refused requests of the last minute or so (each one's weight decays as exp(-age / tau)); the
    first `free` cost nothing, each one beyond adds `step` seconds to the next answer, up to `most`."""

    def __init__(self, free: float = 10.0, step: float = 0.05, most: float = 1.0, tau: float = 60.0) -> None:
        self.free, self.step, self.most, self.tau = free, step, most, tau
        self._scores: dict[str, tuple[float, float]] = {}  # client -> (score, when)

    def refused(self, client: str, now: float | None = None) -> float:
        """Count one refused request of `client`; the seconds to hold its answer back."""
        now = time.monotonic() if now is None else now
        score = self.score(client, now) + 1.0
        self._scores[client] = (score, now)
        if len(self._scores) > 4096:  # many addresses: forget those whose score has decayed to nothing
            self._scores = {c: v for c, v in self._scores.items() if self.score(c, now) >= 1.0}
        return min(self.most, self.step * max(0.0, score - self.free))

    def score(self, client: str, now: float) -> float:
        score, when = self._scores.get(client, (0.0, now))
        return score * math.exp(-(now - when) / self.tau)


class ThrottleRefusals:
    """ASGI middleware: a 4xx answer waits as long as `ErrorScore` says before it is sent."""

    def __init__(self, app: ASGIApp, scores: ErrorScore) -> None:
        self.app, self.scores = app, scores

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = (scope.get("client") or ("?", 0))[0]

        async def held(message: Message) -> None:
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500:
                delay = self.scores.refused(client)
                if delay > 0:
                    await asyncio.sleep(delay)
            await send(message)

        await self.app(scope, receive, held)
